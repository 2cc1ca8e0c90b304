"""Reference attention in plain array operations, for NumPy or CuPy arrays.

It computes in the dtype it is given: float64 inputs give the float64 reference the tests and
benchmarks compare against; float32 inputs give the plain float32 implementation whose own error
sets the tests' tolerance.
"""

from __future__ import annotations

import math

import numpy as np


def array_module(x):
    """numpy or cupy, whichever owns x (CuPy is imported only if x is not a NumPy array)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def causal_mask(xp, T_q: int, T_k: int):
    """True where query i may attend to key j. Aligned bottom-right: the last query sees every key,
    so with T_q == T_k this is the usual lower triangle, and a query block of the newest T_q tokens
    over a longer cache sees the whole past."""
    i = xp.arange(T_q)[:, None]
    j = xp.arange(T_k)[None, :]
    return j <= i + (T_k - T_q)


def check_qkv(q, k, v):
    """The array module of q (B, NH, T_q, d), k and v (B, NH_kv, T_k, d), after checking that they are
    4-d arrays of one module with shapes that agree (NH a multiple of NH_kv); a clear error if not."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-d array (B, NH, T, d), got {getattr(x, 'shape', type(x))}")
    xp = array_module(q)
    if array_module(k) is not xp or array_module(v) is not xp:
        raise TypeError("q, k and v must all be NumPy arrays or all CuPy arrays")
    if q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"shapes disagree: q {q.shape} is (B, NH, T_q, d), k {k.shape} and v {v.shape} "
                         "must be (B, NH_kv, T_k, d) with NH a multiple of NH_kv")
    return xp


def reference_attention(q, k, v, *, causal: bool = True, scale: float | None = None, return_lse: bool = False):
    """softmax(scale * Q K^T + mask) V for q (B, NH, T_q, d) and k, v (B, NH_kv, T_k, d), NH a
    multiple of NH_kv (grouped-query attention); returns the input's array type. With return_lse,
    (O, lse): lse (B, NH, T_q) the log-sum-exp of each row's scaled scores in natural log, +inf for a
    row that sees no key (the convention of the rungs' lab.lse), in the arithmetic's dtype (float32
    for the low-precision recipe).

    float64 in, float64 arithmetic; float32 in, float32 arithmetic. float16 or bfloat16 in: the
    plain recipe of a low-precision kernel, products accumulated in float32 and the probabilities
    P rounded to the input dtype before P V, the output returned in the input dtype.

    Rows with no visible key (only possible when T_q > T_k) are zero. A NaN or Inf reaches exactly
    the rows that can see it: in Q or K through the scores, in V as NaN in the columns it holds."""
    xp = check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves NH / NH_kv query heads
        group = q.shape[1] // k.shape[1]
        k, v = xp.repeat(k, group, axis=1), xp.repeat(v, group, axis=1)
    low = {q.dtype.name, k.dtype.name, v.dtype.name} & {"float16", "bfloat16"}
    if low:  # the plain low-precision recipe: products accumulate in float32, P is rounded to the dtype
        if len({q.dtype, k.dtype, v.dtype}) != 1:
            raise TypeError(f"q, k and v must share one low-precision dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        f32 = (x.astype(np.float32) for x in (q, k, v))
        O, lse = _attention(xp, *f32, causal, scale, round_p=q.dtype)
        return (O.astype(q.dtype), lse) if return_lse else O.astype(q.dtype)
    dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    if dtype not in (np.float32, np.float64):
        dtype = np.dtype(np.float32)
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    O, lse = _attention(xp, q, k, v, causal, scale)
    return (O, lse) if return_lse else O


def _attention(xp, q, k, v, causal, scale, round_p=None):
    """(O, lse) in q's dtype."""
    dtype = q.dtype
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    S = (q @ k.swapaxes(-1, -2)) * dtype.type(scale)  # (B, NH, T_q, T_k)
    if causal:
        visible = causal_mask(xp, q.shape[2], k.shape[2])
        S = xp.where(visible, S, -xp.inf)
    m = S.max(axis=-1, keepdims=True)
    m = xp.where(xp.isneginf(m), 0, m)  # a row with no visible key: exp(-inf) = 0 everywhere
    P = xp.exp(S - m)
    l = P.sum(axis=-1, keepdims=True)
    lse = xp.where(l == 0, xp.inf, m + xp.log(xp.where(l == 0, 1, l)))[..., 0]  # no key seen: +inf
    if round_p is not None:
        P = P.astype(round_p).astype(dtype)
    finite = xp.isfinite(v)
    if not bool(finite.all()):
        # P @ v would spread 0 * NaN from a masked key into rows that cannot see it: take the
        # finite values through the product, then mark exactly the rows that see a bad value.
        sees = (S > -xp.inf).astype(dtype) if causal else xp.ones_like(S)
        bad = (sees @ (~finite).astype(dtype)) > 0
        O = xp.where(bad, xp.nan, (P @ xp.where(finite, v, 0)) / xp.where(l == 0, 1, l))
    else:
        O = (P @ v) / xp.where(l == 0, 1, l)
    return O.astype(dtype, copy=False), lse.astype(dtype, copy=False)


def reference_attention_backward(q, k, v, o, lse, do, *, causal: bool = True, scale: float | None = None):
    """The gradients (dq, dk, dv) of attention's output O with respect to q, k and v, given dO, in
    plain array operations (NumPy or CuPy): the formulas every backward rung computes.

        S = scale Q K^T (+ mask)    P = exp(S - lse)    D = rowsum(dO o O)
        dV = P^T dO    dP = dO V^T    dS = P o (dP - D)    dQ = scale dS K    dK = scale dS^T Q

    q, o, do (B, NH, T_q, d); k, v (B, NH_kv, T_k, d); lse (B, NH, T_q) each row's log-sum-exp in
    natural log (+inf for a row that sees no key: its P, and so its gradients, are 0). o and lse may
    be None: then they are the forward's, reference_attention(..., return_lse=True), in the same
    arithmetic. With grouped-query heads, dk and dv of a K/V head sum its query heads' gradients.
    float64 in, float64 arithmetic; float32 in, float32. float16 or bfloat16 in: the plain recipe of a
    low-precision kernel, the products accumulated in float32 from 16-bit operands (P and dS rounded
    to the dtype before the products that take them), D from the 16-bit o and do, the gradients
    returned in the dtype. Causal masks are aligned bottom-right when T_q != T_k, as in the forward."""
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        if not hasattr(x, "ndim") or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-d array (B, NH, T, d), got {getattr(x, 'shape', type(x))}")
    xp = array_module(q)
    if o is None or lse is None:
        o_fwd, lse_fwd = reference_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        o = o_fwd if o is None else o
        lse = lse_fwd if lse is None else lse
    if do.shape != q.shape or o.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"shapes disagree: o {o.shape} and do {do.shape} must be q's {q.shape}, lse {lse.shape} "
                         f"must be {q.shape[:3]}")
    low = q.dtype.name in ("float16", "bfloat16")
    dtype = np.dtype(np.float32) if low else np.result_type(q.dtype, k.dtype, v.dtype)
    if dtype not in (np.float32, np.float64):
        dtype = np.dtype(np.float32)

    def rounded(x):  # to the inputs' 16-bit dtype and back: the operand a low-precision kernel multiplies
        return x.astype(q.dtype).astype(dtype) if low else x

    B, NH, T_q, d = q.shape
    NH_kv, T_k = k.shape[1], k.shape[2]
    group = NH // NH_kv
    q_, o_, do_ = (x.astype(dtype) for x in (q, o, do))
    k_, v_ = (xp.repeat(x.astype(dtype), group, axis=1) for x in (k, v))  # each query head's K/V head
    scale = dtype.type(1.0 / math.sqrt(d) if scale is None else scale)
    S = (q_ @ k_.swapaxes(-1, -2)) * scale  # (B, NH, T_q, T_k)
    if causal:
        S = xp.where(causal_mask(xp, T_q, T_k), S, -xp.inf)
    P = xp.exp(S - lse.astype(dtype)[..., None])  # masked, or a row that sees no key (lse = +inf): 0
    dV = rounded(P).swapaxes(-1, -2) @ do_  # (B, NH, T_k, d)
    dP = do_ @ v_.swapaxes(-1, -2)
    D = (do_ * o_).sum(axis=-1, keepdims=True)
    dS = rounded(P * (dP - D))
    dQ = (dS @ k_) * scale
    dK = (dS.swapaxes(-1, -2) @ q_) * scale
    dK, dV = (x.reshape(B, NH_kv, group, T_k, d).sum(axis=2) for x in (dK, dV))  # a group's query heads
    out = q.dtype if low else dtype
    return dQ.astype(out), dK.astype(out), dV.astype(out)
