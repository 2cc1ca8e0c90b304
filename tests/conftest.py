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
