import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402

HAS_GPU = kernels.gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device (GPU tests run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _tiktoken_cache():
    """The GPT-2 BPE files: shared/tiktoken-cache beside the checkout, or a copy carried inside it."""
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        for candidate in (ROOT / ".cache" / "tiktoken", ROOT.parent / "shared" / "tiktoken-cache"):
            if candidate.is_dir():
                os.environ["TIKTOKEN_CACHE_DIR"] = str(candidate)
                break
    yield
