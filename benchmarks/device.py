"""What ran where: the device, driver, CUDA and library versions every result file carries and every
table is headed by; CuPy and torch, imported when first needed; the GPU memory both hold."""

from __future__ import annotations

import gc
import os
import platform
import re
import shlex
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np

from . import CUPY_TF32_GIVEN

ROOT = Path(__file__).resolve().parent.parent  # the checkout: bench.py, results/, README.md


class CannotRun(Exception):
    """A subcommand that cannot run here (no GPU, no gpt2 package, no NVRTC): one line, exit 2."""


class Unavailable(Exception):
    """A peer that cannot run here (a missing package, a backend refusing the dtype, memory): a row says so."""


class NotComparable(Unavailable):
    """A peer that could run, but not with the rungs' mask (cross lengths on a torch without a bottom-right
    causal mask for this backend): its row says n/a rather than comparing different masks."""


def progress(text: str) -> None:
    print(text, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def get_cupy():
    import cupy

    return cupy


_torch_module = None


def get_torch():
    """torch, imported once; Unavailable if it cannot be."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except Exception as exc:
            raise Unavailable(f"torch is not importable ({type(exc).__name__}: {exc})") from None
        if not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False  # the math backend's matmuls in plain fp32
        _torch_module = torch
    return _torch_module


def gpu_problem() -> str | None:
    """None if CuPy sees a CUDA device; else why not, in a few words."""
    try:
        cupy = get_cupy()
    except ImportError as exc:
        return f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, insufficient driver, ...
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None if count > 0 else "no CUDA device visible"


def require_gpu() -> None:
    problem = gpu_problem()
    if problem:
        raise CannotRun(f"needs a CUDA GPU, and none is usable here ({problem}); run it on the GPU machine")


def free_memory() -> int:
    """Bytes the next allocation could get: the device's free memory plus CuPy's cached blocks,
    after torch hands its cached blocks back."""
    cupy = get_cupy()
    if _torch_module is not None:
        _torch_module.cuda.empty_cache()
    pool = cupy.get_default_memory_pool()
    return cupy.cuda.runtime.memGetInfo()[0] + pool.free_bytes()


def release_memory():
    """The last measurement's device memory back: unreachable objects collected first (a fast engine and
    its parts refer to each other, so only the cycle collector frees them, and a row measured before it
    runs would count the last row's engine), then CuPy's pool and torch's cache emptied."""
    gc.collect()
    get_cupy().get_default_memory_pool().free_all_blocks()
    if _torch_module is not None:
        _torch_module.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Setup: what ran where. Every result file carries this; every table is headed by it.
# ---------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _driver_release() -> str | None:
    """The kernel driver's release (580.65.06), which the CUDA version alone does not name."""
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit (+dirty with uncommitted changes to tracked files); LAB_COMMIT, where
    set, names it instead: a copy of the tree without its history (a GPU machine it was synced to)
    cannot tell."""
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_info() -> dict | None:
    if gpu_problem():
        return None
    cupy = get_cupy()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {
        "name": name,
        "arch": f"sm_{dev.compute_capability}",
        "sm_count": int(dev.attributes["MultiProcessorCount"]),
        "l2_bytes": int(props["l2CacheSize"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver": _driver_release(),
        "driver_cuda": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
    }


def setup_info(argv: list[str]) -> dict:
    """Device, driver, CUDA, library versions, date and command: the header of every result."""
    cupy_version = _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy")
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python3", "bench.py", *argv]),
        "git": _git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": cupy_version,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "cupy_tf32": f"0 (set by bench.py; was {CUPY_TF32_GIVEN!r})",
        "device": device_info(),
    }


def device_slug(setup: dict, fallback: str = "nogpu") -> str:
    name = setup["device"]["name"] if setup.get("device") else fallback
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
