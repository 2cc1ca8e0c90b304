"""Property-based tests (hypothesis): the reference and input validation on the CPU, every rung
against the reference on the GPU over random shapes, strides and value scales."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels
from kernels import runtime

from .test_kernels_cpu import direct_attention

dims = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 9), st.sampled_from([1, 4, 8]))


def arrays(rng, shape, magnitude=1.0):
    return rng.standard_normal(shape) * magnitude


@settings(max_examples=40, deadline=None)
@given(dims=dims, Tk=st.integers(1, 9), causal=st.booleans(), scale=st.floats(0.01, 4.0), seed=st.integers(0, 2**32 - 1))
def test_reference_matches_the_formula_on_random_shapes(dims, Tk, causal, scale, seed):
    B, NH, Tq, d = dims
    rng = np.random.default_rng(seed)
    q, k, v = arrays(rng, (B, NH, Tq, d)), arrays(rng, (B, NH, Tk, d)), arrays(rng, (B, NH, Tk, d))
    got = kernels.reference_attention(q, k, v, causal=causal, scale=scale)
    np.testing.assert_allclose(got, direct_attention(q, k, v, causal, scale), rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(dims=dims, magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1e3]), seed=st.integers(0, 2**32 - 1))
def test_reference_outputs_are_convex_combinations_of_visible_values(dims, magnitude, seed):
    """Every output row is a weighted mean of the value rows it may see, whatever the score scale."""
    B, NH, T, d = dims
    rng = np.random.default_rng(seed)
    q, k, v = (arrays(rng, (B, NH, T, d), magnitude) for _ in range(3))
    out = kernels.reference_attention(q, k, v)
    assert np.isfinite(out).all()
    for i in range(T):
        lo = v[:, :, : i + 1].min(axis=2)
        hi = v[:, :, : i + 1].max(axis=2)
        tol = 1e-9 * (1 + np.abs(v).max())
        assert (out[:, :, i] >= lo - tol).all() and (out[:, :, i] <= hi + tol).all()


@settings(max_examples=30, deadline=None)
@given(dims=dims, c=st.floats(0.1, 10.0), seed=st.integers(0, 2**32 - 1))
def test_reference_scale_moves_between_q_and_scale(dims, c, seed):
    B, NH, T, d = dims
    rng = np.random.default_rng(seed)
    q, k, v = (arrays(rng, (B, NH, T, d)) for _ in range(3))
    a = kernels.reference_attention(q * c, k, v, scale=0.5)
    b = kernels.reference_attention(q, k, v, scale=0.5 * c)
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


bad_dtypes = st.sampled_from([np.float16, np.float64, np.int32, np.complex64, np.uint8])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=6),
    dtype=st.one_of(st.just(np.float32), bad_dtypes),
    d=st.sampled_from([1, 16, 32, 48, 64, 80, 128, 256]),
    causal=st.booleans(),
)
def test_validation_raises_only_clear_errors(shape, dtype, d, causal):
    """Whatever the layout, validation either accepts it or raises TypeError/ValueError, and it
    accepts only float32 (B, NH, T, d) with a declared head size, causal, non-empty."""
    shape = tuple(shape[:-1]) + (d,) if shape else (d,)
    x = np.zeros(shape, dtype=dtype)
    rung = kernels.load("v02")
    try:
        runtime.check_layout(x, x, x, rung, causal, None)
    except (TypeError, ValueError) as exc:
        assert str(exc)
        return
    assert x.dtype == np.float32 and x.ndim == 4 and 0 not in x.shape
    assert d in rung.head_sizes() and causal


# -- every rung on the GPU -----------------------------------------------------------------------

layouts = st.sampled_from(["contiguous", "packed_qkv", "transposed_heads", "sliced_rows"])


def make_inputs(cp, B, NH, T, d, layout, magnitude, seed):
    rng = cp.random.default_rng(seed)

    def rand(shape):
        return rng.standard_normal(shape, dtype=cp.float32) * magnitude

    if layout == "packed_qkv":  # (B, T, 3, NH, d) viewed as three (B, NH, T, d)
        qkv = rand((B, T, 3, NH, d))
        return tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    if layout == "transposed_heads":  # (B, T, NH, d) viewed as (B, NH, T, d)
        return tuple(rand((B, T, NH, d)).transpose(0, 2, 1, 3) for _ in range(3))
    if layout == "sliced_rows":  # every other row of a longer sequence
        return tuple(rand((B, NH, 2 * T, d))[:, :, ::2] for _ in range(3))
    return tuple(rand((B, NH, T, d)) for _ in range(3))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in kernels.names() if not kernels.load(n).fp8])  # FP8: test_fp8_gpu.py
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 3),
    NH=st.integers(1, 4),
    T=st.integers(1, 300),
    layout=layouts,
    magnitude=st.sampled_from([0.01, 1.0, 10.0]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_rung_matches_reference_on_random_inputs(name, B, NH, T, layout, magnitude, seed, data):
    import cupy as cp

    from .test_kernels_gpu import check_against_reference

    rung = kernels.load(name)
    d = data.draw(st.sampled_from(rung.head_sizes()), label="d")
    dtype = data.draw(st.sampled_from(rung.dtypes), label="dtype")
    inputs = make_inputs(cp, B, NH, T, d, layout, magnitude, seed)
    check_against_reference(*(x.astype(dtype) if dtype != "float32" else x for x in inputs), name)
