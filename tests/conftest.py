"""GPU tests are marked `gpu` and skip where no CUDA device is present. On a device, two tiers
(tests/tiers.py, docs/ladder.md#testing):

    python3 -m pytest -q -m "gpu and not exhaustive" -n 8   # quick: every rung, kernel and engine, a few awkward shapes
    python3 -m pytest -q -m gpu -n 8                         # the whole suite, exhaustive matrices too
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402

HAS_GPU = kernels.gpu_available()


def pytest_collection_modifyitems(config, items):
    # pytest-xdist hands tests out in collection order: a long one collected last would run alone at
    # the end while the other workers idle, so the tests marked `long` go first
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device (GPU tests run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def unverified_rung(tmp_path, monkeypatch):
    """add(base, name) -> name: a copy of the .cu rung `base` that declares `lab.unverified  not yet run on
    a GPU`, written to tmp_path and added to the ladder (kernels.names(), resolve, load) for the test, the
    newest rung where its number is. The ladder itself holds no such forward rung once those written
    before a GPU ran them have run (v32 and v33 did, and were removed: docs/ladder.md#v32)."""
    from kernels import ladder

    added, original = [], ladder.rung_files

    def rung_files():
        files = [*original(), *added]
        return sorted(files, key=lambda p: (int(ladder._RUNG_FILE.match(p.name).group(1)), p.name))

    monkeypatch.setattr(ladder, "rung_files", rung_files)
    monkeypatch.setattr(ladder, "_resolved", {})  # names resolved during the test are forgotten after it

    def add(base: str, name: str = "v99_unverified") -> str:
        source, marker = ladder.resolve(base).read_text(), " * lab.template"
        assert source.count(marker) == 1 and "lab.unverified" not in source
        path = tmp_path / f"{name}.cu"
        path.write_text(source.replace(marker, " * lab.unverified  not yet run on a GPU\n" + marker, 1))
        added.append(path)
        return name

    return add
