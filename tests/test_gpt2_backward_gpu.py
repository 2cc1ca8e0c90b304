"""GPT-2's training pass on the GPU (gpt2/backward.py on CuPy) against PyTorch, llm.c's test: the loss
and every parameter's gradient of a GPT-2-small-shaped model (2 layers, width 768, 12 heads, the
whole vocabulary), random weights with random LayerNorms and biases, against a nanoGPT-style model
written here in PyTorch on the same weights and batch.

float32 (TF32 off in PyTorch, SDPA's math backend; every rung pair whose forward writes the log-sum-exp and whose two
rungs declare float32, found from their declarations): the loss within 1e-5 relative, each
gradient within 1e-4 relative in norm. bfloat16 (the pairs declaring bfloat16): PyTorch's autocast
bfloat16 beside ours, both measured against PyTorch in float32: our loss within 1e-2 relative, and
each gradient's error at most twice autocast's, or 1e-2 relative in norm where autocast's is
smaller. Then the CuPy path's loss and gradients against the NumPy path's, float32."""

import math
from contextlib import nullcontext

import numpy as np
import pytest

import kernels
from gpt2 import GPT2Config
from gpt2.backward import Attention, loss_and_grads
from kernels import backward as backward_ladder
from lm.arrays import to_device

pytestmark = pytest.mark.gpu

CONFIG = GPT2Config(n_layer=2, n_head=12, n_embd=768)  # GPT-2 small's widths and vocabulary, 2 layers
B, T = 4, 256


def rung_pairs(dtype: str) -> list[tuple[str, str]]:
    """Every (forward, backward) pair that can train CONFIG in dtype, from the rungs' declarations."""
    hs = CONFIG.head_size
    forward = [n for n in kernels.names() if kernels.load(n).lse and dtype in kernels.load(n).dtypes
               and hs in kernels.load(n).head_sizes()]
    backward = [n for n in backward_ladder.names() if dtype in backward_ladder.load(n).dtypes
                and hs in backward_ladder.load(n).head_sizes()]
    return [(f, b) for f in forward for b in backward]


FLOAT32_PAIRS, BFLOAT16_PAIRS = rung_pairs("float32"), rung_pairs("bfloat16")


def test_the_rung_pairs_are_found():
    assert ("v13_fa2_partitioning", "b02_fa2") in FLOAT32_PAIRS and ("v14_tf32_mma", "b03_tf32_mma") in FLOAT32_PAIRS
    assert ("v15_bf16_mma", "b04_bf16_mma") in BFLOAT16_PAIRS


def random_params(config, seed):
    """float32 NumPy weights: GPT-2's init for the matrices, LayerNorms and biases random too."""
    import gpt2

    rng = np.random.default_rng(seed)
    params = {}
    for name, a in gpt2.random_weights(config, seed=seed).params.items():
        if name.endswith(".bias"):
            a = 0.02 * rng.standard_normal(a.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            a = 1.0 + 0.1 * rng.standard_normal(a.shape)
        params[name] = a.astype(np.float32)
    return params


def torch_loss(torch, w, config, idx, targets):
    """nanoGPT's GPT-2 on the checkpoint-native names (Conv1D weights (in, out), wte tied); F.linear
    as nanoGPT's nn.Linear, so that autocast runs each product with its bias in bfloat16."""
    F = torch.nn.functional
    C, NH, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
    Bt, Tt = idx.shape

    def linear(x, name):
        return F.linear(x, w[name + ".weight"].t(), w[name + ".bias"])

    def layer_norm(x, name):
        return F.layer_norm(x, (C,), w[name + ".weight"], w[name + ".bias"], eps)

    x = w["wte.weight"][idx] + w["wpe.weight"][:Tt]
    for i in range(config.n_layer):
        p = f"h.{i}."
        qkv = linear(layer_norm(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = (t.view(Bt, Tt, NH, C // NH).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bt, Tt, C)
        x = x + linear(y, p + "attn.c_proj")
        h = F.gelu(linear(layer_norm(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
        x = x + linear(h, p + "mlp.c_proj")
    x = layer_norm(x, "ln_f")
    logits = x @ w["wte.weight"].T
    return F.cross_entropy(logits.float().view(-1, config.vocab_size), targets.view(-1))


def torch_run(torch, params, idx, targets, autocast: bool):
    """(loss, grads) of the PyTorch model: plain float32 (TF32 off, SDPA's math backend: no 3xTF32 or
    other approximation of float32 in the reference) or under autocast bfloat16 (SDPA's own choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = {k: torch.tensor(a, device="cuda", requires_grad=True) for k, a in params.items()}
    idx_t, targets_t = (torch.tensor(a, device="cuda") for a in (idx, targets))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), \
            (nullcontext() if autocast else sdpa_kernel([SDPBackend.MATH])):
        loss = torch_loss(torch, w, CONFIG, idx_t, targets_t)
    loss.backward()
    return loss.item(), {k: t.grad.double().cpu().numpy() for k, t in w.items()}


@pytest.fixture(scope="module")
def case():
    torch = pytest.importorskip("torch")
    params = random_params(CONFIG, seed=0)
    rng = np.random.default_rng(1)
    idx, targets = (rng.integers(0, CONFIG.vocab_size, (B, T)) for _ in range(2))
    return {"params": params, "idx": idx, "targets": targets,
            "float32": torch_run(torch, params, idx, targets, autocast=False),
            "autocast": torch_run(torch, params, idx, targets, autocast=True)}


def ours(cp, case, attn, dtype):
    params = {k: to_device(cp, a) for k, a in case["params"].items()}
    loss, grads = loss_and_grads(params, CONFIG, cp.asarray(case["idx"]), cp.asarray(case["targets"]), attn, dtype)
    assert all(g.dtype == np.float32 and g.shape == params[k].shape for k, g in grads.items())
    return loss, {k: cp.asnumpy(g).astype(np.float64) for k, g in grads.items()}


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def skip_unless_runs_here(forward: str, backward: str):
    arch = kernels.device_limits().arch
    for rung in (kernels.load(forward), backward_ladder.load(backward)):
        if not rung.runs_on(arch):
            pytest.skip(f"{rung.name} needs {rung.arch_needed()}; this device is {arch}")


@pytest.mark.parametrize(("forward", "backward"), FLOAT32_PAIRS, ids=[f"{f[:3]}+{b[:3]}" for f, b in FLOAT32_PAIRS])
def test_float32_loss_and_gradients_match_pytorch(case, forward, backward):
    import cupy as cp

    skip_unless_runs_here(forward, backward)
    loss, grads = ours(cp, case, Attention.make(forward, backward), "float32")
    want_loss, want = case["float32"]
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), f"loss {loss} vs PyTorch's {want_loss}"
    errors = {k: rel(grads[k], want[k]) for k in want}
    worst = max(errors, key=errors.get)
    print(f"\n{forward} + {backward}: loss {loss:.7f} (PyTorch {want_loss:.7f}); worst gradient {worst} "
          f"{errors[worst]:.2e}")
    bad = {k: f"{e:.2e}" for k, e in errors.items() if not e <= 1e-4}
    assert not bad, f"gradients off by more than 1e-4 relative: {bad}"


@pytest.mark.parametrize(("forward", "backward"), BFLOAT16_PAIRS, ids=[f"{f[:3]}+{b[:3]}" for f, b in BFLOAT16_PAIRS])
def test_bfloat16_loss_and_gradients_are_as_close_to_float32_as_autocast(case, forward, backward):
    import cupy as cp

    skip_unless_runs_here(forward, backward)
    loss, grads = ours(cp, case, Attention.make(forward, backward), "bfloat16")
    want_loss, want = case["float32"]
    auto_loss, auto = case["autocast"]
    print(f"\n{forward} + {backward}: loss {loss:.6f}, autocast {auto_loss:.6f}, float32 {want_loss:.6f}")
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss)
    bad = {}
    for k in want:
        mine, theirs = rel(grads[k], want[k]), rel(auto[k], want[k])
        if not mine <= max(2 * theirs, 1e-2):
            bad[k] = f"ours {mine:.2e}, autocast {theirs:.2e}"
    assert not bad, f"gradients further from float32 than autocast's: {bad}"


def test_cupy_and_numpy_give_the_same_loss_and_gradients():
    import cupy as cp

    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=64)
    params = random_params(config, seed=2)
    rng = np.random.default_rng(3)
    idx, targets = (rng.integers(0, config.vocab_size, (2, 63)) for _ in range(2))
    attn = Attention.reference()
    loss_np, grads_np = loss_and_grads(params, config, idx, targets, attn)
    loss_cp, grads_cp = loss_and_grads({k: cp.asarray(a) for k, a in params.items()}, config,
                                       cp.asarray(idx), cp.asarray(targets), attn)
    assert math.isclose(loss_cp, loss_np, rel_tol=1e-5), (loss_cp, loss_np)
    errors = {k: rel(cp.asnumpy(grads_cp[k]).astype(np.float64), grads_np[k].astype(np.float64)) for k in params}
    bad = {k: f"{e:.2e}" for k, e in errors.items() if not e <= 1e-4}
    assert not bad, f"CuPy's gradients differ from NumPy's: {bad}"
