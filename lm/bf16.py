"""bfloat16 as the fused kernels hold it: bits in uint16, rounded to nearest even as
kernels/fused/common.cuh rounds, widened through the bits (no CuPy bfloat16 arithmetic needed). Every
function takes the array module (`cp`: CuPy, or NumPy in the CPU tests)."""

from __future__ import annotations

import numpy as np


def to_float32(cp, a):
    """float32 from float32, float16, bfloat16 or bfloat16 bits (uint16; widened through the bits: no
    CuPy bfloat16 arithmetic needed)."""
    if a.dtype.name in ("bfloat16", "uint16"):
        return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return cp.ascontiguousarray(a, dtype=cp.float32)


def bf16_bits(cp, a32):
    """float32 -> bfloat16 bits in uint16, rounded to nearest even (as kernels/fused/common.cuh does)."""
    bits = cp.ascontiguousarray(a32, dtype=cp.float32).view(cp.uint32)
    return ((bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def round_to_bf16(cp, a32):
    """float32 values rounded to bfloat16, held in float32."""
    return (bf16_bits(cp, a32).astype(cp.uint32) << 16).view(cp.float32)


def kernel_type(cp, a, dtype: str):
    """a in the kernels' element type for a run in dtype: float32, or bfloat16 as its bits (uint16).
    A view where a holds that already, else a converted copy."""
    if dtype == "bfloat16":
        return a.view(cp.uint16) if a.dtype.name == "bfloat16" else bf16_bits(cp, to_float32(cp, a))
    return a if a.dtype == np.float32 else to_float32(cp, a)
