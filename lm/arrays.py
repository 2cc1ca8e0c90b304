"""NumPy or CuPy, and the weights' dtype: what every model's array code asks of its arrays."""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


def array_module(x):
    """numpy or cupy, whichever owns x."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def cast_params(params: dict, dtype) -> dict:
    """Every parameter in `dtype` (float32, float16 or bfloat16), rounded once to nearest even;
    forward() widens to float32 wherever the model needs it."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, and so with CuPy)

    dtype = np.dtype(dtype)
    if dtype.name not in DTYPES:
        raise ValueError(f"dtype {dtype.name}: the model runs float32, float16 or bfloat16")
    return {name: a.astype(dtype, copy=False) for name, a in params.items()}
