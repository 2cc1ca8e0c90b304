"""GPT-2's training pass on the CPU (gpt2/backward.py, NumPy, the reference attention): every parameter's
gradient against central differences in float64, the loss against gpt2.model.forward's logits, the
fused classifier against the plain one and padded against unpadded, the bfloat16 path against float32, and bad input."""

import numpy as np
import pytest

import gpt2
import kernels
from gpt2 import GPT2Config, LabError
from gpt2.backward import Attention, classifier_forward_backward, loss_and_grads, softmax_cross_entropy
from gpt2.model import cast_params, forward

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
REF = Attention.reference()


def random_params(config, seed, dtype=np.float64):
    """gpt2.random_weights, with LayerNorms and biases random too, so that every parameter matters."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, a in gpt2.random_weights(config, seed=seed).params.items():
        if name.endswith(".bias"):
            a = a + 0.1 * rng.standard_normal(a.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            a = a + 0.2 * rng.standard_normal(a.shape)
        else:
            a = a * 5  # larger weights than GPT-2's init: a harder, less linear function
        params[name] = a.astype(dtype)
    return params


def batch(config, B, T, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def loss_of(params, config, idx, targets):
    return loss_and_grads(params, config, idx, targets, REF)[0]


@pytest.mark.parametrize("T", [5, 16])  # odd, and the whole context
def test_every_gradient_matches_central_differences_in_float64(T):
    params = random_params(TINY, seed=T)
    idx, targets = batch(TINY, 2, T, seed=T)
    loss, grads = loss_and_grads(params, TINY, idx, targets, REF)
    assert set(grads) == set(params)
    rng = np.random.default_rng(100 + T)
    h = 1e-5
    for name, a in params.items():
        assert grads[name].shape == a.shape and grads[name].dtype == np.float64, name
        for _ in range(4):
            j = tuple(int(rng.integers(0, n)) for n in a.shape)
            old = a[j]
            a[j] = old + h
            up = loss_of(params, TINY, idx, targets)
            a[j] = old - h
            down = loss_of(params, TINY, idx, targets)
            a[j] = old
            fd = (up - down) / (2 * h)
            assert abs(fd - grads[name][j]) <= 1e-8 + 1e-6 * abs(fd), f"{name}{j}: {grads[name][j]} vs {fd}"
    # the whole gradient along one random direction: its dot product is the directional derivative
    u = {name: rng.standard_normal(a.shape) for name, a in params.items()}
    moved = [loss_of({k: a + s * h * u[k] for k, a in params.items()}, TINY, idx, targets) for s in (1, -1)]
    along = sum(float((grads[k] * u[k]).sum()) for k in params)
    fd = (moved[0] - moved[1]) / (2 * h)
    assert abs(fd - along) <= 1e-7 * abs(fd), f"{along} vs {fd}"
    assert abs(fd) > 1e-3  # a direction that moves the loss


def cross_entropy(logits, targets):
    """Mean -log softmax(logits)[target] in float64."""
    z = np.asarray(logits, np.float64)
    m = z.max(axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(z - m).sum(axis=-1))
    return float((lse - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]).mean())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_is_the_cross_entropy_of_the_forward_s_logits(dtype):
    """The training forward is gpt2.model.forward: the same products in the same dtypes."""
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=24)
    params = random_params(config, seed=3, dtype=np.float32)
    idx, targets = batch(config, 3, 11, seed=4)
    loss, grads = loss_and_grads(params, config, idx, targets, REF, dtype=dtype)
    assert isinstance(loss, float)
    assert all(g.dtype == np.float32 for g in grads.values())
    logits = forward(cast_params(params, dtype), config, idx, kernels.reference_attention)
    want = cross_entropy(logits, targets)
    assert abs(loss - want) <= 1e-6 * want, f"{loss} vs {want}"


def test_bfloat16_gradients_are_float32_s_within_bfloat16_rounding():
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=24)
    params = random_params(config, seed=5, dtype=np.float32)
    idx, targets = batch(config, 2, 13, seed=6)
    loss32, g32 = loss_and_grads(params, config, idx, targets, REF)
    loss16, g16 = loss_and_grads(params, config, idx, targets, REF, dtype="bfloat16")
    assert abs(loss16 - loss32) <= 1e-3 * loss32
    for name in params:
        err = np.linalg.norm(g16[name] - g32[name]) / np.linalg.norm(g32[name])
        assert err <= 2e-2, f"{name}: relative error {err:.3g}"  # 0.8% at most, measured


def plain_classifier(xf, wte, targets):
    """The unfused classifier: every logit, the softmax, then dlogits, in float64."""
    xf, wte = xf.astype(np.float64), wte.astype(np.float64)
    N = xf.shape[0]
    logits = xf @ wte.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(N), targets]).mean())
    dlogits = p
    dlogits[np.arange(N), targets] -= 1
    dlogits /= N
    return loss, dlogits @ wte, dlogits.T @ xf


@pytest.mark.parametrize("rows", [None, 1, 3, 10])  # all rows at once, and chunks that do not divide N
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fused_classifier_is_the_plain_one(rows, dtype):
    rng = np.random.default_rng(7)
    N, C, V = 10, 16, 50
    xf, wte = (rng.standard_normal(s).astype(dtype) for s in ((N, C), (V, C)))
    targets = rng.integers(0, V, N)
    loss, dxf, dwte = classifier_forward_backward(xf, wte, targets, rows)
    want_loss, want_dxf, want_dwte = plain_classifier(xf, wte, targets)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert dxf.dtype == dwte.dtype == dtype
    assert abs(loss - want_loss) <= tol * want_loss
    for got, want in ((dxf, want_dxf), (dwte, want_dwte)):
        assert np.abs(got - want).max() <= tol * np.abs(want).max()



@pytest.mark.parametrize("V", [51, 128, 1001])  # odd, already a multiple of 128 (no padding), odd
def test_the_padded_classifier_is_the_unpadded_one(V):
    rng = np.random.default_rng(8)
    N, C = 12, 16
    xf, wte = rng.standard_normal((N, C)), rng.standard_normal((V, C))
    targets = rng.integers(0, V, N)
    targets[0] = V - 1  # the last real column, beside the padding
    loss, dxf, dwte = classifier_forward_backward(xf, wte, targets, rows=5)  # padded to 128 or 1024
    want_loss, want_dxf, want_dwte = classifier_forward_backward(xf, wte, targets, rows=5, multiple=1)
    assert dwte.shape == (V, C) and dxf.shape == (N, C)
    assert abs(loss - want_loss) <= 1e-13 * want_loss
    for got, want in ((dxf, want_dxf), (dwte, want_dwte)):
        assert np.abs(got - want).max() <= 1e-13 * np.abs(want).max()


def test_softmax_cross_entropy_excludes_and_zeroes_the_padded_columns():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((4, 8))
    targets = np.array([0, 4, 2, 1])
    want, want_loss = softmax_cross_entropy(logits[:, :5].copy(), targets, 6, np.float64)
    padded = logits.copy()
    padded[:, 5:] = 1e3  # would dominate the softmax were they read
    got, loss = softmax_cross_entropy(padded, targets, 6, np.float64, V=5)
    assert got.shape == (4, 8) and (got[:, 5:] == 0).all()
    np.testing.assert_allclose(got[:, :5], want, rtol=1e-14, atol=1e-17)
    assert abs(loss - want_loss) <= 1e-14 * want_loss

def test_a_forward_rung_without_the_log_sum_exp_cannot_train():
    with pytest.raises(LabError, match=r"kernel v12_o_in_registers does not write the log-sum-exp \(lab.lse\).*v13"):
        Attention.make(kernel="v12", backward="b02")


def test_a_rung_pair_without_a_dtype_in_common_cannot_train():
    with pytest.raises(LabError, match="kernel v13_fa2_partitioning runs float32 and backward b04_bf16_mma "
                                       "bfloat16, float16: no dtype in common"):
        Attention.make(kernel="v13", backward="b04")
    with pytest.raises(LabError, match="unknown backward kernel 'b99'"):
        Attention.make(kernel="v13", backward="b99")


def test_a_rung_is_checked_against_the_run_s_dtype_and_device():
    params = random_params(TINY, seed=1, dtype=np.float32)
    idx, targets = batch(TINY, 1, 4, seed=1)
    config = GPT2Config(n_layer=1, n_head=1, n_embd=64, vocab_size=50, n_positions=16)  # head size 64
    params64 = {k: a.astype(np.float32) for k, a in gpt2.random_weights(config).params.items()}
    with pytest.raises(LabError, match=r"attention v13_fa2_partitioning \+ b02_fa2 runs float32, not bfloat16"):
        loss_and_grads(params64, config, idx, targets, Attention.make("v13", "b02"), dtype="bfloat16")
    with pytest.raises(LabError, match="runs on the GPU; on the CPU use the reference attention"):
        loss_and_grads(params64, config, idx, targets, Attention.make("v13", "b02"))
    with pytest.raises(LabError, match="supports head sizes .*; the model's is 8"):
        loss_and_grads(params, TINY, idx, targets, Attention.make("v13", "b02"))


def test_a_sequence_longer_than_the_model_s_positions_is_refused():
    params = random_params(TINY, seed=1, dtype=np.float32)
    idx, targets = batch(TINY, 1, 17, seed=1)
    with pytest.raises(LabError, match="sequence length 17 exceeds the model's 16 positions"):
        loss_and_grads(params, TINY, idx, targets, REF)
    with pytest.raises(LabError, match=r"idx and targets must both be \(B, T\)"):
        loss_and_grads(params, TINY, idx, targets[:, :-1], REF)
