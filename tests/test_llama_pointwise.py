"""llama/pointwise.py: RMSNorm, RoPE and the SiLU-gated product, one launch each on CuPy.

CPU: the NumPy path against float64, and bad shapes refused. GPU: each kernel against the chain of
CuPy's one-op kernels it replaces (the array expression, run on CuPy): rope and silu_mul equal it bit
for bit, rms_norm (its mean summed in another order) within float32 rounding of it, float32 and bfloat16
outputs, awkward lengths, RoPE on the strided view a projection's output is read through. Freed memory
is filled with NaN before each kernel runs, so that an element a kernel leaves unwritten fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import llama.model
from llama.config import LlamaConfig
from llama.pointwise import rms_norm, rope, silu, silu_mul

CONFIG = LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=1, vocab_size=64, max_position_embeddings=2048)


def test_numpy_rms_norm_matches_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 17, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=4e-6 * np.abs(want).max())


def test_numpy_silu_mul_matches_float64_and_keeps_gate_dtype():
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((17, 40)).astype(np.float32) * 4 for _ in range(2))
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    got = silu_mul(gate, up)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, silu(gate) * up)


def test_numpy_rope_turns_each_pair_by_its_angle():
    rng = np.random.default_rng(2)
    hs = CONFIG.head_size
    x = rng.standard_normal((1, 3, 5, hs)).astype(np.float32)
    cos, sin = llama.model.rope_tables(CONFIG, 7, 5, np)
    got = rope(x, cos, sin).astype(np.float64)
    half = hs // 2
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    c, s = cos[:, :half].astype(np.float64), sin[:, :half].astype(np.float64)
    np.testing.assert_allclose(got[..., :half], a * c - b * s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[..., half:], b * c + a * s, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="differ"):
        silu_mul(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))


# -- on the GPU: each kernel against the CuPy chain it replaces ---------------------------------------------


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    return cupy


def poison_pool(cp, nbytes: int) -> None:
    """Fill a freed block of the pool with NaN bytes: the next allocation of that size takes it."""
    block = cp.full(-(-nbytes // 4), np.nan, dtype=cp.float32)
    del block


def chain_rope(cp, x, cos, sin, dtype):
    x = x.astype(cp.float32)
    half = x.shape[-1] // 2
    rotated = cp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 17, 97])
@pytest.mark.parametrize("heads", [2, 8])
def test_rope_equals_the_array_expression_on_the_projection_s_view(cp, dtype, T, heads):
    hs = CONFIG.head_size
    rng = cp.random.default_rng(T * heads)
    out = (rng.standard_normal((1, T, heads * hs), dtype=cp.float32) * 2).astype(dtype)  # a projection's output
    x = out.reshape(1, T, heads, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs), strided, as the model reads it
    cos, sin = llama.model.rope_tables(CONFIG, 1000 - T, T, cp)
    want = chain_rope(cp, x, cos, sin, dtype)
    poison_pool(cp, want.nbytes)
    got = rope(x, cos, sin, cp.dtype(dtype))
    assert got.dtype == want.dtype and got.shape == (1, heads, T, hs) and got.flags.c_contiguous
    cp.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 17, 97])
def test_silu_mul_equals_the_array_expression(cp, dtype, T):
    rng = cp.random.default_rng(T)
    gate, up = ((rng.standard_normal((1, T, 1000), dtype=cp.float32) * 4).astype(dtype) for _ in range(2))
    want = (silu(gate.astype(cp.float32)) * up.astype(cp.float32)).astype(dtype)
    poison_pool(cp, want.nbytes)
    got = silu_mul(gate, up)
    assert got.dtype == want.dtype and got.shape == want.shape
    cp.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 17, 97])
def test_rms_norm_agrees_with_the_array_expression_and_float64(cp, dtype, T):
    C = 2048
    rng = cp.random.default_rng(T)
    x = rng.standard_normal((1, T, C), dtype=cp.float32) * 3
    w = (rng.standard_normal(C, dtype=cp.float32)).astype(dtype)
    want32 = x * ((x * x).mean(axis=-1, keepdims=True) + 1e-5) ** -0.5 * w  # the chain, float32
    x64 = x.astype(cp.float64)
    want64 = x64 / cp.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w.astype(cp.float64)
    poison_pool(cp, x.size * cp.dtype(dtype).itemsize)
    got = rms_norm(x, w, 1e-5, cp.dtype(dtype))
    assert got.dtype == cp.dtype(dtype) and got.shape == x.shape
    got32 = got.astype(cp.float32)
    # float32: the chain's own error against float64, a few times over; bfloat16: one rounding of that
    chain_err = float(cp.abs(want32 - want64).max())
    scale = float(cp.abs(want64).max())
    bound = 4 * chain_err + 4 * np.finfo(np.float32).eps * scale if dtype == "float32" else 2.0 ** -8 * scale
    err = float(cp.abs(got32 - want64).max())
    assert err <= bound, f"max |rms_norm - float64| = {err:.3g} > {bound:.3g}"
    assert not bool(cp.isnan(got32).any())
