"""The whole-sequence pass's kernels (gpt2/fast/sequence.py: the prefill and the no-cache mode), each
against the CuPy code it replaces, in float32 and in a bfloat16 run's activations: the residual add and
LayerNorm, the bias and GELU after a product, the keys and values into the static cache, the heads
merged. Outputs poisoned with NaN (bfloat16: its bits); float32 judged as tests/test_fused_gpu.py's
check_close judges, bfloat16 against the float32 result rounded once, or the eager model's roundings.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpt2
import gpt2.fast as fast
from kernels import fused
from lm.bf16 import to_float32
from tests.test_fused_gpu import NULL, check_close, gelu64, ln32, ln64, nan_bits, weights

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


WT = {"float32": "float", "bfloat16": "unsigned short"}


@pytest.mark.parametrize("residual", [False, True], ids=["layernorm", "residual+layernorm"])
@pytest.mark.parametrize("rows,C", [(1, 768), (7, 768), (97, 32), (5, 1600), (3, 100)])
def test_add_layernorm_matches_residual_add_and_layer_norm(cp, rows, C, residual):
    """float32 out against float64; bfloat16 out (a bfloat16 run's next operand) the float32 out rounded
    once, bit for bit."""
    rng = cp.random.default_rng()
    x0 = rng.standard_normal((rows, C), dtype=cp.float32) * np.float32(3.0) + np.float32(1.0)
    y = rng.standard_normal((rows, C), dtype=cp.float32)
    b = rng.standard_normal(C, dtype=cp.float32)
    w = np.float32(1.0) + rng.standard_normal(C, dtype=cp.float32) * np.float32(0.1)
    lb = rng.standard_normal(C, dtype=cp.float32) * np.float32(0.1)
    outs = {}
    for dtype in fast.DTYPES:
        x = x0.copy()
        outs[dtype] = out = nan_bits(cp, (rows, C), dtype)
        fused.function("layernorm", f"add_layernorm<256, {WT[dtype]}>")(
            (rows,), (256,), (x, y if residual else NULL, b if residual else NULL, w, lb, np.float32(1e-5), out,
                              np.int32(C)), shared_mem=4 * C)
        expected_x = x0 + (y + b) if residual else x0  # the eager model's x + linear(...)
        assert bool((x == expected_x).all()), "the residual stream must be x + (y + b), bit for bit"
    check_close(cp, outs["float32"], ln64(cp, expected_x, w, lb, 1e-5), ln32(expected_x, w, lb, 1e-5),
                f"layernorm {rows}x{C}")
    assert bool((outs["bfloat16"] == fast.bf16_bits(cp, outs["float32"])).all()), "bfloat16 out: float32's, rounded"


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("gelu", [False, True], ids=["bias", "bias+gelu"])
@pytest.mark.parametrize("rows,N", [(1, 2304), (7, 3072), (97, 12)])
def test_bias_act_matches_bias_and_gelu(cp, rows, N, gelu, dtype):
    """In bfloat16 as the eager model: y + b rounded to bfloat16 (its linear's output), GELU in float32 on
    that, rounded again; the bias alone bit for bit, GELU within one bfloat16 step of CuPy's."""
    rng = cp.random.default_rng()
    y0, y0_32 = weights(cp, rng, (rows, N), dtype, scale=3.0)
    b = rng.standard_normal(N, dtype=cp.float32)
    y = y0.copy()
    fused.function("bias_act", f"bias_act<{'true' if gelu else 'false'}, {WT[dtype]}>")(
        (7,), (256,), (y, b, np.int32(rows), np.int32(N)))  # a small grid: the loop strides
    if dtype == "float32":
        if not gelu:
            assert bool((y == y0 + b).all())
        else:
            check_close(cp, y, gelu64(cp, y0.astype(cp.float64) + b), gpt2.model.gelu(y0 + b), f"gelu {rows}x{N}")
        return
    linear = fast.round_to_bf16(cp, y0_32 + b)  # the eager model's linear output, bfloat16
    if not gelu:
        assert bool((y == fast.bf16_bits(cp, linear)).all())
        return
    got, want = to_float32(cp, y), fast.round_to_bf16(cp, gpt2.model.gelu(linear))
    # one bfloat16 step (8 bits of significand) of the larger, and a floor where 1 + tanh cancels to ~0
    step = cp.maximum(cp.abs(want), cp.abs(got)) * np.float32(2.0**-7) + np.float32(1e-6)
    worst = float((cp.abs(got - want) / step).max())
    assert worst <= 1.0, f"bfloat16 gelu {rows}x{N}: {worst:.2f} bfloat16 steps from CuPy's"


@pytest.mark.parametrize("kv", fast.DTYPES)
@pytest.mark.parametrize("T,NH,HS,max_len,offset", [(1, 12, 64, 1024, 0), (9, 12, 64, 1024, 1), (64, 2, 16, 64, 0),
                                                    (17, 3, 20, 40, 0), (7, 2, 6, 16, 0)])
def test_kv_store_fills_the_static_cache(cp, T, NH, HS, max_len, offset, kv):
    """16 bytes a thread where a head is whole vectors (HS 64, 16; 20 in float32), one element else (HS 6;
    20 in bfloat16) and where qkv starts off a 16-byte boundary (offset: one element into its buffer)."""
    rng = cp.random.default_rng()
    C = NH * HS
    flat, _ = weights(cp, rng, (offset + T * 3 * C,), kv, scale=1.0)  # the projection, in the run's dtype
    qkv = flat[offset:].reshape(T, 3 * C)
    k_cache, v_cache = nan_bits(cp, (NH, max_len, HS), kv), nan_bits(cp, (NH, max_len, HS), kv)
    fused.function("kv_store", f"kv_store<{WT[kv]}>")(
        (5,), (256,), (qkv, k_cache, v_cache, np.int32(T), np.int32(NH), np.int32(HS), np.int32(max_len)))
    views = qkv.reshape(T, 3, NH, HS)
    for cache, part in ((k_cache, 1), (v_cache, 2)):
        expected = views[:, part].transpose(1, 0, 2)  # (NH, T, HS), as KVCache.append stores it
        assert bool((cache[:, :T] == expected).all())
        if T < max_len:
            tail = cache[:, T:]
            assert bool((tail == 0x7FC0).all()) if kv == "bfloat16" else bool(cp.isnan(tail).all()), "written past T"


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("HS,pad", [(64, 0), (64, 1), (20, 0), (6, 0)])
def test_merge_heads_reads_any_strides(cp, dtype, HS, pad):
    """Strided input (the heads' rows interleaved), at 16 bytes a thread and at one element: HS 6, 20 in
    bfloat16, and rows padded by one element (pad: strides off the 16-byte grid)."""
    rng = cp.random.default_rng()
    T, NH = 97, 12
    y = weights(cp, rng, (1, T, NH, HS + pad), dtype, scale=1.0)[0][..., :HS].transpose(0, 2, 1, 3)  # (1, NH, T, HS)
    out = nan_bits(cp, (T, NH * HS), dtype)
    item = y.itemsize
    fused.function("merge_heads", f"merge_heads<{WT[dtype]}>")(
        (11,), (256,), (y, np.int64(y.strides[1] // item), np.int64(y.strides[2] // item), out, np.int32(T),
                        np.int32(NH), np.int32(HS)))
    assert bool((out == y.transpose(0, 2, 1, 3).reshape(T, NH * HS)).all())
