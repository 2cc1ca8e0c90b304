"""Llama's elementwise steps, each one launch on CuPy, in float32 arithmetic whatever the operands'
dtype, the result written in the dtype the next product takes: no float32 copy in between, no chain of
CuPy's one-op kernels over (T, 4 x C) activations. NumPy runs them as array expressions: the CPU's
reference, and the arithmetic the kernels repeat op for op.

    h = rms_norm(x, weight, eps, dtype)   x / sqrt(mean(x^2) + eps) * weight; x (..., C) float32
    q = rope(q, cos, sin, dtype)          x * cos + rotate_half(x) * sin; x (B, H, T, hs), any strides,
                                          cos and sin (T, hs); the result contiguous (B, H, T, hs)
    f = silu_mul(gate, up)                silu(gate) * up, (..., F), in gate's dtype

The kernels keep the expressions' rounding: no product contracted into an FMA (__fmul_rn, __fadd_rn),
expf and IEEE division as CuPy's own elementwise kernels take them, so rope and silu_mul equal the
array expressions on CuPy bit for bit. rms_norm's mean is summed in another order than CuPy's mean, so
it agrees to float32 rounding. Each kernel compiles on its first call (CuPy caches it per device and
dtype).
"""

from __future__ import annotations

import functools

import numpy as np

from lm.arrays import array_module

MEAN_SQUARE = ("float32 x", "float32 ms", "x * x", "a + b",
               "ms = a / (float)(_in_ind.size() / _out_ind.size())", "0")
RMS_SCALE = ("float32 x, float32 ms, W w, float32 eps", "O y",
             "y = (O)__fmul_rn(__fmul_rn(x, powf(__fadd_rn(ms, eps), -0.5f)), (float)w);")
# y (B, H, T, hs) contiguous, i its flat index; x read through its own strides at the same (b, h, t, j)
ROPE = ("raw X x, raw float32 cos, raw float32 sin, int32 T, int32 hs", "O y", """
    const int j = i % hs, t = (i / hs) % T, half = hs / 2;
    const float a = (float)x[i];
    const float rotated = j < half ? -(float)x[i + half] : (float)x[i - half];  // rotate_half(x)[j]
    y = (O)__fadd_rn(__fmul_rn(a, cos[t * hs + j]), __fmul_rn(rotated, sin[t * hs + j]));
""")
SILU_MUL = ("G g, U u", "G y", "const float a = (float)g; y = (G)(a / (1.0f + expf(-a)) * (float)u);")


@functools.cache
def _kernels():
    import cupy as cp

    return {"mean_square": cp.ReductionKernel(*MEAN_SQUARE, "lab_mean_square"),
            "rms_scale": cp.ElementwiseKernel(*RMS_SCALE, "lab_rms_scale"),
            "rope": cp.ElementwiseKernel(*ROPE, "lab_rope"),
            "silu_mul": cp.ElementwiseKernel(*SILU_MUL, "lab_silu_mul")}


def rms_norm(x, weight, eps: float, dtype=np.float32):
    """RMSNorm of the float32 residual stream x (..., C): x / sqrt(mean(x^2) + eps) * weight, in dtype."""
    xp = array_module(x)
    if xp is np:
        ms = (x * x).mean(axis=-1, keepdims=True)  # (..., 1)
        return (x * (ms + np.float32(eps)) ** np.float32(-0.5) * weight).astype(dtype, copy=False)
    k = _kernels()
    x = x.astype(np.float32, copy=False)
    ms = k["mean_square"](x, axis=-1, keepdims=True)  # (..., 1)
    return k["rms_scale"](x, ms, weight, np.float32(eps), xp.empty(x.shape, dtype=dtype))


def rope(x, cos, sin, dtype=np.float32):
    """x (B, H, T, hs) rotated by the angles cos and sin (T, hs) hold: x * cos + rotate_half(x) * sin,
    rotate_half(x) = [-x2, x1] (HF's layout: element i with element i + hs / 2), in float32
    arithmetic; the result contiguous in dtype."""
    xp = array_module(x)
    if xp is np:
        x = x.astype(np.float32, copy=False)
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # (B, H, T, hs)
        return (x * cos + rotated * sin).astype(dtype, copy=False)
    T, hs = x.shape[-2:]
    if cos.shape != (T, hs) or sin.shape != (T, hs):
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must be (T, hs) = {(T, hs)}")
    return _kernels()["rope"](x, cos, sin, np.int32(T), np.int32(hs), xp.empty(x.shape, dtype=dtype))


def silu(x):
    """x * sigmoid(x), as x / (1 + exp(-x))."""
    xp = array_module(x)
    return x / (1.0 + xp.exp(-x))


def silu_mul(gate, up):
    """silu(gate) * up in float32 arithmetic, in gate's dtype (the down projection's operand)."""
    xp = array_module(gate)
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ")
    if xp is np:
        return (silu(gate.astype(np.float32)) * up.astype(np.float32)).astype(gate.dtype, copy=False)
    return _kernels()["silu_mul"](gate, up)
