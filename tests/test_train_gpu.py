"""Training on the GPU against PyTorch (llm.c's test): the same GPT-2 weights and batches stepped by the lab
(gpt2.backward.loss_and_grads + lm.adamw) and by a nanoGPT-style PyTorch GPT-2 with torch.optim.AdamW
(benchmarks/torch_gpt2.py), their losses compared step by step; and train.py's --out loaded by
transformers. Needs gpt2/backward.py, torch and transformers (the device has them)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt2
import kernels
from lm.adamw import AdamW, clip_grad_norm, get_lr
from lm.token_data import write_bin

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def lab_and_torch_losses(config, dtype: str, steps: int, B: int, T: int, lr: float = 1e-3, seed: int = 0,
                         tokens: int | None = None):
    """(lab losses, torch losses) over `steps` steps of random batches from one set of weights, the ids drawn
    from the first `tokens` of the vocabulary (default all: a loss that cannot fall below log(vocab))."""
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    import train
    from benchmarks.torch_gpt2 import TorchGPT2

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ckpt = gpt2.random_weights(config, seed=seed, xp=cupy)
    args = train.parse_args(["--data", "-", "--dtype", dtype])
    forward, backward = train.pick_rungs(args, config, kernels.device_limits().arch)
    attn = train.Attention.make(kernel=forward, backward=backward)
    peer = TorchGPT2(ckpt.params, config, dtype=dtype, fused=False)
    params = {k: v.copy() for k, v in ckpt.params.items()}
    opt = AdamW(params)
    rng = np.random.default_rng(seed)
    lab, ref = [], []
    for step in range(steps):
        step_lr = get_lr(step, lr=lr, min_lr=lr / 10, warmup=2, steps=steps)
        ids = rng.integers(0, tokens or config.vocab_size, (B, T + 1))
        x, y = ids[:, :-1], ids[:, 1:]
        loss, grads = train.loss_and_grads(params, config, cupy.asarray(x), cupy.asarray(y), attn, dtype=dtype)
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, step_lr)
        lab.append(loss)
        ref.append(float(peer.step(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda(), step_lr)))
    return np.array(lab), np.array(ref)


def test_float32_ten_adamw_steps_match_torch():
    config = gpt2.GPT2Config(n_layer=4, n_head=4, n_embd=256, n_positions=256)
    # ids from 64 tokens: a distribution the model learns within ten steps, so that the losses fall
    # (uniform ids over the whole vocabulary sit at log(50257) whatever the model does)
    lab, ref = lab_and_torch_losses(config, "float32", steps=10, B=4, T=128, tokens=64)
    err = np.abs(lab - ref) / np.abs(ref)
    print("lab", lab, "torch", ref, "rel err", err)
    assert lab[-1] < 0.9 * lab[0]  # it trains
    assert err.max() < 1e-5, err


def test_bfloat16_twenty_steps_at_gpt2_small_shapes_match_torch_autocast():
    # ids from 64 tokens, as above: on uniform ids over the whole vocabulary the gradients are noise, which
    # the first full-rate steps amplify into trajectories that part by more than bfloat16's own rounding
    lab, ref = lab_and_torch_losses(gpt2.SIZES["gpt2"], "bfloat16", steps=20, B=4, T=1024, lr=6e-4, tokens=64)
    err = np.abs(lab - ref) / np.abs(ref)
    print("lab", lab, "torch", ref, "rel err", err)
    assert err.max() < 1e-2, err


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
