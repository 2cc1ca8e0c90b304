"""NumPy or CuPy, and the weights' dtype: what every model's array code asks of its arrays, and the
bytes a set of arrays holds (byte_span, held_bytes: what lab.py and the engine count)."""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


def array_module(x):
    """numpy or cupy, whichever owns x."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def run_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a run: float32, float16 or bfloat16 (ml_dtypes registers it with NumPy)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, and so with CuPy)

    dtype = np.dtype(dtype)
    if dtype.name not in DTYPES:
        raise ValueError(f"dtype {dtype.name}: the model runs float32, float16 or bfloat16")
    return dtype


def to_device(xp, a, dtype=None):
    """A NumPy array on xp's device in `dtype` (default its own), cast on the host: a 16-bit run's
    weights never exist there in float32. bfloat16 travels as its bits (a uint16 view)."""
    a = np.ascontiguousarray(a if dtype is None else a.astype(run_dtype(dtype), copy=False))
    if xp is np:
        return a
    return xp.asarray(a.view(np.uint16)).view(a.dtype) if a.dtype.name == "bfloat16" else xp.asarray(a)


def cast_params(params: dict, dtype) -> dict:
    """Every parameter in `dtype` (float32, float16 or bfloat16), rounded once to nearest even;
    forward() widens to float32 wherever the model needs it."""
    dtype = run_dtype(dtype)
    return {name: a.astype(dtype, copy=False) for name, a in params.items()}


def address(a) -> int:
    """Where a NumPy or CuPy array's first element lies (host or device)."""
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def byte_span(a) -> tuple[int, int]:
    """The addresses [first, last + 1) of a NumPy or CuPy array's elements (whatever its strides)."""
    ptr = address(a)
    if a.size == 0:
        return ptr, ptr
    low = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True) if s > 0)
    return ptr + low, ptr + high + a.itemsize


def _merged(spans) -> list[tuple[int, int]]:
    """Address ranges, overlapping ones merged, in order."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def held_bytes(arrays, besides=()) -> int:
    """Bytes that `arrays` span, each byte counted once however many of them view it, leaving out
    those that the arrays `besides` span (the caller's weights, when counting what an engine adds)."""
    held = _merged(byte_span(a) for a in arrays)
    other = _merged(byte_span(b) for b in besides)
    total = sum(hi - lo for lo, hi in held)
    return total - sum(max(0, min(hi, o_hi) - max(lo, o_lo)) for lo, hi in held for o_lo, o_hi in other)
