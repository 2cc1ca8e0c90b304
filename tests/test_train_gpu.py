"""Training on the GPU: the same GPT-2 weights and batches stepped by the lab (gpt2.backward.loss_and_grads +
lm.adamw) and by a nanoGPT-style PyTorch GPT-2 with torch.optim.AdamW (benchmarks/torch_gpt2.py), their losses
compared step by step (llm.c's test); every backward rung against the reference backward over ten steps;
and train.py's --out loaded by transformers. Needs torch and transformers (the device has them).

Tolerances: float32 losses within 1e-5 relative (the issue's, and llm.c's order of agreement), PyTorch in
plain float32 (TF32 off, SDPA's math backend); bfloat16 within 1e-2 relative of PyTorch's autocast, or of
the reference backward in bfloat16: two bfloat16 runs differ by their roundings (2^-8 relative per
operand), not by 1e-5."""

import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

import gpt2
import kernels
from gpt2.backward import Attention, loss_and_grads
from kernels import backward as backward_ladder
from lm.adamw import AdamW, clip_grad_norm, get_lr
from lm.token_data import write_bin

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}  # relative, per step's loss
# the batches' ids come from the first TOKENS of the vocabulary: a distribution a model learns within ten
# steps, so that the losses fall (uniform ids over the vocabulary sit at log(vocab) whatever the model
# does, and their noise gradients, amplified by the first full-rate steps, part two bfloat16 runs by more
# than their roundings: 1.3e-2 at step 6 on the H200 against autocast)
TOKENS = 64


def schedule(steps: int, lr: float) -> list[float]:
    return [get_lr(s, lr=lr, min_lr=lr / 10, warmup=2, steps=steps) for s in range(steps)]


def random_batches(steps: int, B: int, T: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` (inputs, next-token targets) pairs of ids drawn from TOKENS, each (B, T) int32 (as train.py's
    Batches gives them)."""
    ids = np.random.default_rng(seed).integers(0, TOKENS, (steps, B, T + 1), dtype=np.int32)
    return [(np.ascontiguousarray(i[:, :-1]), np.ascontiguousarray(i[:, 1:])) for i in ids]


def lab_losses(config, dtype: str, attn, steps: int, B: int, T: int, lr: float, seed: int = 0) -> np.ndarray:
    """Each step's loss, train.py's step (loss_and_grads, clipping at 1.0, AdamW) from seeded random weights."""
    cupy = pytest.importorskip("cupy")

    params = gpt2.random_weights(config, seed=seed, xp=cupy).params
    opt, losses = AdamW(params), []
    for (x, y), step_lr in zip(random_batches(steps, B, T, seed), schedule(steps, lr)):
        loss, grads = loss_and_grads(params, config, cupy.asarray(x), cupy.asarray(y), attn, dtype=dtype)
        assert isinstance(loss, float)
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, step_lr)
        losses.append(loss)
    assert all(p.dtype == np.float32 for p in params.values())  # the master weights stay float32
    return np.array(losses)


def torch_losses(config, dtype: str, steps: int, B: int, T: int, lr: float, seed: int = 0) -> np.ndarray:
    """The same from the same weights with benchmarks/torch_gpt2.py (torch.optim.AdamW, unfused): float32
    in plain float32 (TF32 off, SDPA's math backend), bfloat16 under autocast (SDPA's choice)."""
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.torch_gpt2 import TorchGPT2

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    peer = TorchGPT2(gpt2.random_weights(config, seed=seed, xp=cupy).params, config, dtype=dtype, fused=False)
    losses = []
    with sdpa_kernel([SDPBackend.MATH]) if dtype == "float32" else nullcontext():
        for (x, y), step_lr in zip(random_batches(steps, B, T, seed), schedule(steps, lr)):
            idx, targets = (torch.from_numpy(a).long().cuda() for a in (x, y))
            losses.append(float(peer.step(idx, targets, step_lr)))
    return np.array(losses)


def rel_err(got, want) -> np.ndarray:
    return np.abs(got - want) / np.abs(want)


def default_attention(config, dtype: str, backward: str | None = None) -> Attention:
    """train.py's rungs for the dtype on this device (backward: that rung, checked), as an Attention."""
    import train

    argv = ["--data", "-", "--dtype", dtype] + (["--backward", backward] if backward else [])
    return Attention.make(*train.pick_rungs(train.parse_args(argv), config, kernels.device_limits().arch))


def test_float32_ten_adamw_steps_match_torch():
    config = gpt2.GPT2Config(n_layer=4, n_head=4, n_embd=256, n_positions=256)
    lab = lab_losses(config, "float32", default_attention(config, "float32"), steps=10, B=4, T=128, lr=1e-3)
    ref = torch_losses(config, "float32", steps=10, B=4, T=128, lr=1e-3)
    err = rel_err(lab, ref)
    print("lab", lab, "torch", ref, "rel err", err)
    assert lab[-1] < 0.9 * lab[0]  # it trains
    assert err.max() <= TOLERANCE["float32"], err


def test_bfloat16_twenty_steps_at_gpt2_small_shapes_match_torch_autocast():
    config = gpt2.SIZES["gpt2"]
    lab = lab_losses(config, "bfloat16", default_attention(config, "bfloat16"), steps=20, B=4, T=1024, lr=6e-4)
    ref = torch_losses(config, "bfloat16", steps=20, B=4, T=1024, lr=6e-4)
    err = rel_err(lab, ref)
    print("lab", lab, "torch", ref, "rel err", err)
    assert err.max() <= TOLERANCE["bfloat16"], err


# every backward rung, paired with train.py's forward rung, against the reference pair on CuPy arrays
RUNG_CONFIG = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=128, vocab_size=1024, n_positions=256)  # head size 64
RUNG_STEPS = dict(steps=10, B=4, T=256, lr=1e-3)


def backward_rungs(dtype: str) -> list[str]:
    """The backward rungs that declare the dtype and RUNG_CONFIG's head size (from their declarations)."""
    return [n for n in backward_ladder.names() if dtype in (r := backward_ladder.load(n)).dtypes
            and RUNG_CONFIG.head_size in r.head_sizes()]


RUNG_CASES = [(dtype, name) for dtype in TOLERANCE for name in backward_rungs(dtype)]


def test_the_backward_rungs_are_found():
    assert {"b01_naive", "b02_fa2", "b03_tf32_mma"} <= set(backward_rungs("float32"))
    assert {"b04_bf16_mma", "b05_wgmma", "b06_wide_query_tiles"} <= set(backward_rungs("bfloat16"))


@pytest.fixture(scope="module")
def reference_losses():
    """The reference forward and backward (Attention.reference(), CuPy), per dtype, computed once."""
    return {dtype: lab_losses(RUNG_CONFIG, dtype, Attention.reference(), **RUNG_STEPS) for dtype in TOLERANCE}


@pytest.mark.parametrize(("dtype", "backward"), RUNG_CASES, ids=[f"{d}-{b[:3]}" for d, b in RUNG_CASES])
def test_every_backward_rung_trains_as_the_reference_backward(reference_losses, dtype, backward):
    rung = backward_ladder.load(backward)
    if not rung.runs_on(kernels.device_limits().arch):
        pytest.skip(f"{rung.name} needs {rung.arch_needed()}")
    attn = default_attention(RUNG_CONFIG, dtype, backward)
    got, want = lab_losses(RUNG_CONFIG, dtype, attn, **RUNG_STEPS), reference_losses[dtype]
    err = rel_err(got, want)
    print(f"\n{attn.name} {dtype}: losses {got}, reference {want}, worst relative error {err.max():.2e}")
    assert got[-1] < 0.9 * got[0]  # it trains
    assert err.max() <= TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_py_on_the_gpu_writes_out_that_transformers_loads(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    data = write_bin(tmp_path / "d.bin", np.random.default_rng(0).integers(0, 50257, 40_000))
    out, log = tmp_path / "out", tmp_path / "run.json"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--device", "gpu", "--random-weights", "--dtype", dtype,
                        "--data", str(data), "--steps", "5", "--batch", "4", "--seq", "256", "--out", str(out),
                        "--json", str(log), "--sample-every", "5", "--sample-tokens", "8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(log.read_text())
    assert len(summary["losses"]) == 5 and all(m is not None and 0 < m < 1 for m in summary["mfu"])
    assert summary["peak_gpu_memory_bytes"] > 0 and "sample: " in r.stdout
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ckpt = gpt2.load(out)
    ids = np.array([[15496, 11, 314, 1101, 257, 3303, 2746, 11]])
    want = gpt2.forward(ckpt.params, ckpt.config, ids, gpt2.reference_attend)
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
