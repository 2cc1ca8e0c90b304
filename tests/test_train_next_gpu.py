"""kernels/fused/train_next.cu (gpt2/train_next.py) against the array code of gpt2/backward.py, as
tests/test_train_kernels_gpu.py checks train.cu, with its helpers: rows 1, 17, 97, 1000, GPT-2's
widths, padded vocabularies, float32 and bfloat16, every output carved from NaN-poisoned memory. Then
loss_and_grads on the next kernels against the array code (the reference attention), and against
train.cu's fused path with the rungs the profile runs (v15 + b04, bfloat16): the loss and every
gradient."""

from dataclasses import replace

import numpy as np
import pytest

from gpt2 import backward as bw
from gpt2 import train_kernels, train_next
from gpt2.backward import Attention, loss_and_grads
from lm.arrays import run_dtype
from tests.test_train_kernels_gpu import DTYPES, ROWS, TINY, bits, close, draw, layernorm_params, poison, rel
from tests.tiers import tiered

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.fixture
def next_kernels():
    train_kernels.use_next(True)
    yield
    train_kernels.use_next(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,ld", [(50257, 50304), (1001, 1024), (1000, 1000)])
@pytest.mark.parametrize("rows", ROWS)
def test_softmax_cross_entropy(cp, rows, V, ld, dtype):
    logits = draw(cp, (rows, ld), scale=3.0)
    logits[:, V:] = 30.0  # the padding: would dominate the softmax were it read
    targets = cp.random.default_rng(1).integers(0, V, rows)
    targets[0] = V - 1
    n = 4 * rows + 3
    want_d, want_loss = bw.softmax_cross_entropy(logits.copy(), targets, n, run_dtype(dtype), V)
    poison(cp)
    got_d, got_loss = train_next.softmax_cross_entropy(logits.copy(), targets, n, run_dtype(dtype), V)
    assert got_d.dtype == run_dtype(dtype) and bool((got_d[:, V:] == 0).all())
    close(got_d, want_d, dtype, float32_tol=1e-6)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", tiered([768, 1024, 1600], quick=[1600]))
@pytest.mark.parametrize("rows", ROWS)
def test_layernorm_forward_and_backward(cp, rows, C, dtype, residual):
    x = draw(cp, (rows, C), scale=2.0) + 0.5
    w, b = layernorm_params(cp, C, dtype)
    if residual:
        y, y_bias = draw(cp, (rows, C), seed=3).astype(w.dtype), draw(cp, (C,), seed=4).astype(w.dtype)
        want = bw.residual_layernorm_forward(x, y, y_bias, w, b, 1e-5, w.dtype)
        poison(cp)
        got = train_next.residual_layernorm_forward(x, y, y_bias, w, b, 1e-5, w.dtype)
        names = ("x_new", "out", "mean", "rstd")
    else:
        want = bw.layernorm_forward(x, w, b, 1e-5, w.dtype)
        poison(cp)
        got = train_next.layernorm_forward(x, w, b, 1e-5, w.dtype)
        names = ("out", "mean", "rstd")
    for g, wt, what in zip(got, want, names, strict=True):
        close(g, wt, dtype if what == "out" else "float32", what=what)
    _, mean, rstd = want[-3:]
    dout = draw(cp, (rows, C), seed=5)
    dresid = draw(cp, (rows, C), seed=6) if residual else None
    want = bw.layernorm_backward(dout, x, mean, rstd, w, None if dresid is None else dresid.copy())
    poison(cp)
    got = train_next.layernorm_backward(dout, x, mean, rstd, w, None if dresid is None else dresid.copy())
    for g, wt, what in zip(got, want, ("dx", "dweight", "dbias"), strict=True):
        close(g, wt, "float32", float32_tol=1e-5 if what == "dx" else 1e-5 * max(1.0, rows**0.5), what=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_bias_gelu_is_linear_forwards_add_then_gelu(cp, rows, dtype):
    y = draw(cp, (rows, 3072), scale=3.0).astype(run_dtype(dtype))
    bias = draw(cp, (3072,), seed=2).astype(y.dtype)
    want_h = y + bias
    want_g = bw.gelu_forward(want_h, np.float32)
    poison(cp)
    h, g = train_next.bias_gelu(y, bias)
    assert bool((bits(h) == bits(want_h)).all())
    close(g, want_g, dtype, float32_tol=1e-6)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", tiered([768, 2304, 3072, 1600], quick=[2304]))
@pytest.mark.parametrize("rows", ROWS)
def test_column_sums_with_the_cast_and_gelu_backward(cp, rows, C, dtype, gelu):
    dtype_ = run_dtype(dtype)
    dout = draw(cp, (rows, C), seed=7)
    h = draw(cp, (rows, C), scale=3.0, seed=8).astype(dtype_) if gelu else None
    v = bw.gelu_backward(dout, h.astype(np.float32)) if gelu else dout
    cast = dtype_ if gelu or dtype != "float32" else None
    poison(cp)
    sums, copy = train_next.column_sums(dout, cast, h)
    assert sums.shape == (C,) and sums.dtype == np.float32
    close(sums, v.sum(axis=0), "float32", float32_tol=1e-5 * max(1.0, rows**0.5))
    if cast is None:
        assert copy is None
    else:
        close(copy, v.astype(dtype_), dtype, float32_tol=1e-6)
    a = dout.astype(dtype_)  # dqkv's sums: a 16-bit input, no copy
    close(train_next.column_sums(a)[0], a.astype(np.float32).sum(axis=0), "float32", float32_tol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,NH,T,hs", [(1, 1, 1, 64), (2, 3, 97, 64), (1, 12, 17, 32), (3, 25, 33, 64)])
def test_the_heads_layouts(cp, B, NH, T, hs, dtype):
    dq, dk, dv = (draw(cp, (B, NH, T, hs), seed=s).astype(run_dtype(dtype)) for s in (10, 11, 12))
    C = NH * hs
    poison(cp)
    assert bool((bits(train_next.heads_to_rows([dq])) == bits(bw.heads_side_by_side(dq))).all())
    poison(cp)
    got = train_next.heads_to_rows([dq, dk, dv])
    for i, d in enumerate((dq, dk, dv)):
        assert bool((bits(cp.ascontiguousarray(got[:, i * C:(i + 1) * C])) == bits(bw.heads_side_by_side(d))).all()), i
    poison(cp)
    (do,) = train_next.rows_to_heads(bw.heads_side_by_side(dq), B, NH)
    assert do.flags.c_contiguous and bool((bits(do) == bits(dq)).all())
    qkv, bias = got, draw(cp, (3 * C,), seed=13).astype(dq.dtype)
    poison(cp)
    heads = train_next.rows_to_heads(qkv, B, NH, bias)
    want = (qkv + bias).reshape(B, T, 3, NH, hs)  # linear_forward's add, then attention_forward's views
    for i, h in enumerate(heads):
        assert h.flags.c_contiguous and bool((bits(h) == bits(cp.ascontiguousarray(want[:, :, i].transpose(0, 2, 1, 3)))).all()), i


def _params(cp, config, rng):
    import gpt2

    params = {}
    for name, a in gpt2.random_weights(config, seed=3).params.items():
        if name.endswith(".bias"):
            a = 0.02 * rng.standard_normal(a.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            a = 1.0 + 0.1 * rng.standard_normal(a.shape)
        params[name] = cp.asarray(a.astype(np.float32))
    return params


@pytest.mark.parametrize("vocab", [1000, 1001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_and_grads_on_the_next_kernels_against_the_array_code(cp, next_kernels, dtype, vocab):
    config = replace(TINY, vocab_size=vocab)
    rng = np.random.default_rng(3)
    params = _params(cp, config, rng)
    idx, targets = (cp.asarray(rng.integers(0, vocab, (2, 97))) for _ in range(2))
    want_loss, want = loss_and_grads(params, config, idx, targets, Attention.reference(), dtype, fused=False)
    poison(cp)
    loss, grads = loss_and_grads(params, config, idx, targets, Attention.reference(), dtype, fused=True)
    assert abs(loss - want_loss) <= (1e-5 if dtype == "float32" else 1e-3) * abs(want_loss), (loss, want_loss)
    errors = {name: rel(grads[name], want[name]) for name in params}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= (1e-4 if dtype == "float32" else 1e-2), f"{worst}: {errors[worst]:.2e} ({errors})"
    assert train_next.applies(cp, run_dtype(dtype), config.n_embd)  # the next path ran


def test_loss_and_grads_on_the_next_kernels_against_train_cu_with_the_rungs(cp):
    """The profile's pass (v15 + b04, bfloat16) at GPT-2 small's width and 2 layers: train.cu against
    train_next.cu, each within bfloat16's reach of the other."""
    import gpt2

    config = replace(gpt2.SIZES["gpt2"], n_layer=2)
    rng = np.random.default_rng(4)
    params = _params(cp, config, rng)
    idx, targets = (cp.asarray(rng.integers(0, config.vocab_size, (2, 257))) for _ in range(2))
    attn = Attention.make("v15", "b04")
    want_loss, want = loss_and_grads(params, config, idx, targets, attn, "bfloat16")
    train_kernels.use_next(True)
    try:
        poison(cp)
        loss, grads = loss_and_grads(params, config, idx, targets, attn, "bfloat16")
    finally:
        train_kernels.use_next(False)
    assert abs(loss - want_loss) <= 1e-3 * abs(want_loss), (loss, want_loss)
    errors = {name: rel(grads[name], want[name]) for name in params}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-2, f"{worst}: {errors[worst]:.2e} ({errors})"
