"""The training pass's fused kernels (gpt2/train_kernels.py, kernels/fused/train.cu) against the array
code of gpt2/backward.py that they replace, on CuPy: awkward row counts (1, 17, 97, 1000), widths of
multiples of 8 that are and are not multiples of a warp's vectors (200, 768, 1024, 1600, 2304, 3072),
GPT-2's vocabulary and small ones (padded to a multiple of 128, as the classifier pads them, and not),
LayerNorm with and without the residual add before it, the bias adds folded into GELU and into the
heads' split, the heads' layouts both ways, float32 and bfloat16; every output allocated from memory
poisoned with all-ones bytes (NaN as float32 and as bfloat16), so that an element no thread writes
fails. Then loss_and_grads fused against unfused: on small GPT-2s (an even and an odd vocabulary) with
the reference attention, and at GPT-2 small's width with the rungs the profile runs (v15 + b04): the
loss and every gradient.

Tolerances: float32 results within a few float32 roundings of the array code's (the sums run in
another order); bfloat16 results within one bfloat16 rounding (2^-8 relative: a float32 value near a
rounding boundary may land on either side), and the whole pass within 1e-2 relative in norm."""

from dataclasses import replace

import numpy as np
import pytest

from gpt2 import GPT2Config, train_kernels
from gpt2 import backward as bw
from gpt2.backward import Attention, loss_and_grads
from lm.arrays import run_dtype
from tests.tiers import tiered

pytestmark = pytest.mark.gpu

ROWS = tiered((1, 17, 97, 1000), quick=[1, 97])  # row counts: one, a multiple of none, many
DTYPES = ("float32", "bfloat16")


@pytest.fixture
def cp():
    import cupy

    return cupy


def poison(cp):
    """Fill the memory pool's free memory with all-ones bytes: the next allocations are carved from it."""
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    junk = cp.full(64 * 2**20, 0xFFFFFFFF, dtype=cp.uint32)  # 256 MiB, freed back to the pool below
    del junk


def rel(got, want) -> float:
    """|got - want| / |want| in norm, in float64; NaN anywhere gives inf."""
    import cupy

    got, want = (cupy.asarray(a).astype(cupy.float64) for a in (got, want))
    if not bool(cupy.isfinite(got).all()):
        return float("inf")
    return float(cupy.linalg.norm(got - want) / max(float(cupy.linalg.norm(want)), 1e-30))


def close(got, want, dtype, float32_tol=1e-5, what=""):
    """Each element within the dtype's tolerance of the array code's: float32 a few roundings of the
    row's scale; bfloat16 one unit in the last place of the element (2^-7 of it: the two paths' float32
    values, a rounding apart, may round to neighbouring bfloat16 values) plus a float32 one of the scale."""
    import cupy

    got, want = (cupy.asarray(a).astype(cupy.float64) for a in (got, want))
    scale = float(cupy.abs(want).max()) or 1.0
    bound = float32_tol * scale + (2.0**-7 * cupy.abs(want) if dtype == "bfloat16" else 0.0)
    err = cupy.abs(got - want)
    assert bool(cupy.isfinite(got).all()), f"{what}: {int((~cupy.isfinite(got)).sum())} elements not finite (unwritten?)"
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max()):.2e}, mean {float(err.mean()):.2e}, scale {scale:.2e}"


def bits(a):
    """The array's bits, for exact comparisons of float32 and bfloat16 alike."""
    import cupy

    return a.view(cupy.uint16 if a.itemsize == 2 else cupy.uint32)


def draw(cp, shape, scale=1.0, seed=0):
    return (scale * cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32)).astype(cp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,ld", tiered([(50257, 50304), (1001, 1024), (1000, 1000)], quick=[(50257, 50304), (1001, 1024)]))  # padded, not
@pytest.mark.parametrize("rows", ROWS)
def test_softmax_cross_entropy(cp, rows, V, ld, dtype):
    logits = draw(cp, (rows, ld), scale=3.0)
    logits[:, V:] = 30.0  # the padding: would dominate the softmax were it read
    targets = cp.random.default_rng(1).integers(0, V, rows)
    targets[0] = V - 1  # the last real column, beside the padding
    n = 4 * rows + 3  # the batch's rows, more than this chunk's
    want_d, want_loss = bw.softmax_cross_entropy(logits.copy(), targets, n, run_dtype(dtype), V)
    poison(cp)
    got_d, got_loss = train_kernels.softmax_cross_entropy(logits.copy(), targets, n, run_dtype(dtype), V)
    assert got_d.dtype == run_dtype(dtype) and got_d.shape == (rows, ld)
    assert bool((got_d[:, V:] == 0).all())  # written, and zero
    close(got_d, want_d, dtype, float32_tol=1e-6)
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))


def test_softmax_cross_entropy_gives_nan_for_a_target_outside_the_vocabulary(cp):
    logits = draw(cp, (3, 104))
    _, loss = train_kernels.softmax_cross_entropy(logits, cp.asarray([0, 100, 5]), 3, np.float32, 100)
    assert np.isnan(float(loss))


def layernorm_params(cp, C, dtype, seed=2):
    w = (1.0 + 0.1 * draw(cp, (C,), seed=seed)).astype(run_dtype(dtype))
    b = (0.1 * draw(cp, (C,), seed=seed + 1)).astype(run_dtype(dtype))
    return w, b


WIDTHS = tiered([768, 200, 1024, 1600], quick=[200, 1600])  # LayerNorm's: a warp's vectors and less, GPT-2's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_layernorm_forward(cp, rows, C, dtype):
    x = draw(cp, (rows, C), scale=2.0) + 0.5
    w, b = layernorm_params(cp, C, dtype)
    want = bw.layernorm_forward(x, w, b, 1e-5, run_dtype(dtype))
    poison(cp)
    got = bw.layernorm_forward(x, w, b, 1e-5, run_dtype(dtype), fused=True)
    assert got[0].dtype == run_dtype(dtype) and got[1].shape == got[2].shape == (rows, 1)
    for g, wt, what in zip(got, want, ("out", "mean", "rstd"), strict=True):
        close(g, wt, dtype if what == "out" else "float32", what=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_residual_layernorm_forward(cp, rows, C, dtype):
    """The residual add x + (y + y_bias) and the LayerNorm after it, one launch."""
    x = draw(cp, (rows, C), scale=2.0) + 0.5
    y = draw(cp, (rows, C), seed=4).astype(run_dtype(dtype))  # a product's output, in the weights' dtype
    y_bias = (0.1 * draw(cp, (C,), seed=5)).astype(run_dtype(dtype))
    w, b = layernorm_params(cp, C, dtype)
    want = bw.residual_layernorm_forward(x, y, y_bias, w, b, 1e-5, run_dtype(dtype))
    poison(cp)
    got = bw.residual_layernorm_forward(x, y, y_bias, w, b, 1e-5, run_dtype(dtype), fused=True)
    assert got[0].dtype == np.float32 and got[1].dtype == run_dtype(dtype)
    close(got[0], want[0], "float32", float32_tol=1e-6, what="x_new")  # the same sums, rounded alike
    for g, wt, what in zip(got[1:], want[1:], ("out", "mean", "rstd"), strict=True):
        close(g, wt, dtype if what == "out" else "float32", what=what)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_layernorm_backward(cp, rows, C, dtype, residual):
    x = draw(cp, (rows, C), scale=2.0) + 0.5
    w, b = layernorm_params(cp, C, dtype)
    _, mean, rstd = bw.layernorm_forward(x, w, b, 1e-5)
    dout = draw(cp, (rows, C), seed=5)
    dresid = draw(cp, (rows, C), seed=6) if residual else None
    want = bw.layernorm_backward(dout, x, mean, rstd, w, None if dresid is None else dresid.copy())
    poison(cp)
    got = bw.layernorm_backward(dout, x, mean, rstd, w, None if dresid is None else dresid.copy(), fused=True)
    for g, wt, what in zip(got, want, ("dx", "dweight", "dbias"), strict=True):
        assert g.dtype == np.float32, what
        close(g, wt, "float32", float32_tol=1e-5 if what == "dx" else 1e-5 * max(1.0, rows**0.5), what=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_bias_gelu_is_linear_forwards_add_then_gelu(cp, rows, dtype):
    y = draw(cp, (rows, 3072), scale=3.0).astype(run_dtype(dtype))
    bias = draw(cp, (3072,), seed=2).astype(y.dtype)
    want_h = y + bias
    want_g = bw.gelu_forward(want_h, np.float32)
    poison(cp)
    h, g = train_kernels.bias_gelu(y, bias)
    assert h.dtype == g.dtype == y.dtype
    assert bool((bits(h) == bits(want_h)).all())
    close(g, want_g, dtype, float32_tol=1e-6)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", tiered([768, 200, 2304, 3072, 1600], quick=[200, 2304]))
@pytest.mark.parametrize("rows", ROWS)
def test_column_sums_with_the_cast_and_gelu_backward(cp, rows, C, dtype, gelu):
    """What linear_backward's fused branch computes: the products' operand and the bias's gradient."""
    dtype_ = run_dtype(dtype)
    dout = draw(cp, (rows, C), seed=7)
    h = draw(cp, (rows, C), scale=3.0, seed=8).astype(dtype_) if gelu else None
    v = bw.gelu_backward(dout, h.astype(np.float32)) if gelu else dout
    cast = dtype_ if gelu or dtype != "float32" else None
    poison(cp)
    sums, copy = train_kernels.column_sums(dout, cast, h)
    assert sums.shape == (C,) and sums.dtype == np.float32
    close(sums, v.sum(axis=0), "float32", float32_tol=1e-5 * max(1.0, rows**0.5))
    if cast is None:
        assert copy is None
    else:
        assert copy.dtype == dtype_
        close(copy, v.astype(dtype_), dtype, float32_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_sums_of_a_16_bit_input(cp, dtype):
    a = draw(cp, (1000, 2304), seed=9).astype(run_dtype(dtype))  # dqkv's: no copy
    sums, copy = train_kernels.column_sums(a)
    assert copy is None
    close(sums, a.astype(np.float32).sum(axis=0), "float32", float32_tol=1e-4)


@pytest.mark.parametrize("N, C, vocab", [(1, 768, 50257), (97, 200, 7), (1000, 768, 64), (4096, 1600, 50257)])
def test_the_embedding_backward_adds_as_add_at_does_bit_for_bit(cp, N, C, vocab):
    """Each token's rows added in row order onto what dwte held (the classifier's gradient), as NumPy's
    add.at adds them: the same bits, on every run; few distinct tokens make long runs of one."""
    rng = np.random.default_rng(N)
    ids = rng.integers(0, vocab, N)
    ids[: N // 3] = ids[0]  # one token many times over
    dx = rng.standard_normal((N, C), dtype=np.float32)
    dwte = rng.standard_normal((vocab, C), dtype=np.float32)
    want = dwte.copy()
    np.add.at(want, ids, dx)
    for _ in range(2):
        got = cp.asarray(dwte)
        train_kernels.embedding_backward(got, cp.asarray(dx), cp.asarray(ids.reshape(1, N)))
        assert np.array_equal(cp.asnumpy(got), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,NH,T,hs", [(1, 1, 1, 64), (2, 3, 97, 64), (1, 12, 17, 32), (3, 25, 33, 64)])
def test_the_heads_layouts(cp, B, NH, T, hs, dtype):
    """heads_to_rows (o's rows; dq, dk, dv into dqkv) and rows_to_heads (dy into do; the QKV product plus
    its bias into q, k, v) against the array code's transposes, bit for bit."""
    dq, dk, dv = (draw(cp, (B, NH, T, hs), seed=s).astype(run_dtype(dtype)) for s in (10, 11, 12))
    C = NH * hs
    poison(cp)
    assert bool((bits(train_kernels.heads_to_rows([dq])) == bits(bw.heads_side_by_side(dq))).all())
    poison(cp)
    got = train_kernels.heads_to_rows([dq, dk, dv])  # [q | k | v] in each row
    assert got.shape == (B * T, 3 * C)
    for i, d in enumerate((dq, dk, dv)):
        assert bool((bits(cp.ascontiguousarray(got[:, i * C:(i + 1) * C])) == bits(bw.heads_side_by_side(d))).all()), i
    poison(cp)
    (do,) = train_kernels.rows_to_heads(bw.heads_side_by_side(dq), B, NH)
    assert do.flags.c_contiguous and bool((bits(do) == bits(dq)).all())
    qkv, bias = got, draw(cp, (3 * C,), seed=13).astype(dq.dtype)
    poison(cp)
    heads = train_kernels.rows_to_heads(qkv, B, NH, bias)
    want = (qkv + bias).reshape(B, T, 3, NH, hs)  # linear_forward's add, then attention_forward's views
    for i, h in enumerate(heads):
        assert h.flags.c_contiguous and bool((bits(h) == bits(cp.ascontiguousarray(want[:, :, i].transpose(0, 2, 1, 3)))).all()), i


TINY = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128)


def random_params(cp, config, rng):
    """gpt2.random_weights with random biases and LayerNorm weights (their init is zeros and ones), float32."""
    import gpt2

    params = {}
    for name, a in gpt2.random_weights(config, seed=3).params.items():
        if name.endswith(".bias"):
            a = 0.02 * rng.standard_normal(a.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            a = 1.0 + 0.1 * rng.standard_normal(a.shape)
        params[name] = cp.asarray(a.astype(np.float32))
    return params


def check_against_the_array_code(cp, params, config, idx, targets, attn, dtype):
    """loss_and_grads fused against unfused: the loss, and every gradient in norm."""
    want_loss, want = loss_and_grads(params, config, idx, targets, attn, dtype, fused=False)
    poison(cp)
    loss, grads = loss_and_grads(params, config, idx, targets, attn, dtype, fused=True)
    assert train_kernels.applies(cp, run_dtype(dtype), config.n_embd, config.head_size)  # the fused path ran
    assert abs(loss - want_loss) <= (1e-5 if dtype == "float32" else 1e-3) * abs(want_loss), (loss, want_loss)
    errors = {name: rel(grads[name], want[name]) for name in params}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= (1e-4 if dtype == "float32" else 1e-2), f"{worst}: {errors[worst]:.2e} (every gradient: {errors})"
    assert set(grads) == set(params) and all(grads[n].shape == params[n].shape for n in params)


@pytest.mark.parametrize("vocab", [1000, 1001])  # padded to 1024 either way; odd
@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_and_grads_fused_against_the_array_code(cp, dtype, vocab):
    config = replace(TINY, vocab_size=vocab)
    rng = np.random.default_rng(3)
    params = random_params(cp, config, rng)
    idx, targets = (cp.asarray(rng.integers(0, vocab, (2, 97))) for _ in range(2))
    check_against_the_array_code(cp, params, config, idx, targets, Attention.reference(), dtype)


def test_loss_and_grads_fused_against_the_array_code_with_the_rungs(cp):
    """The profile's pass (v15 + b04, bfloat16) at GPT-2 small's width and vocabulary, 2 layers: the rungs
    take the contiguous q, k, v and do that rows_to_heads writes, or the array code's views."""
    import gpt2

    config = replace(gpt2.SIZES["gpt2"], n_layer=2)
    rng = np.random.default_rng(4)
    params = random_params(cp, config, rng)
    idx, targets = (cp.asarray(rng.integers(0, config.vocab_size, (2, 257))) for _ in range(2))
    check_against_the_array_code(cp, params, config, idx, targets, Attention.make("v15", "b04"), "bfloat16")
