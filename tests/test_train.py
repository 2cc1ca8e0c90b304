"""Training on the CPU: AdamW against a float64 transcription of torch.optim.AdamW, clipping and the
schedule; the token files and llm.c's batch order; train.py end to end, its output loaded by lab.py.

Most tests run train.py on a stand-in of gpt2.backward's interface (a quadratic loss over the parameters
that records the batches it is given), so that the loop, the optimizer and the files are tested apart
from the model; test_the_real_backward_overfits_one_repeated_batch runs the real one."""

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2
from gpt2 import GPT2Config
from gpt2.load import random_weights, save
from kernels import fused
from lm import adamw
from lm.adamw import AdamW, clip_grad_norm, get_lr
from lm.errors import LabError
from lm.token_data import Batches, read_tokens, write_bin

ROOT = Path(__file__).resolve().parent.parent
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64)


# ---------------------------------------------------------------------------------------------
# AdamW, clipping, schedule
# ---------------------------------------------------------------------------------------------

def torch_adamw64(params, grads_per_step, lrs, *, wd, max_norm, betas=(0.9, 0.95), eps=1e-8):
    """torch.optim.AdamW (decoupled decay, bias-corrected m and v) after clip_grad_norm_, in float64,
    decay on tensors of 2+ dimensions only: the transcription the float32 optimizer is held to."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        g = {k: x.astype(np.float64) for k, x in grads.items()}
        total = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
        coef = min(1.0, max_norm / (total + 1e-6))
        for k in p:
            gk = g[k] * coef
            if p[k].ndim >= 2:
                p[k] = p[k] * (1 - lr * wd)
            m[k] = betas[0] * m[k] + (1 - betas[0]) * gk
            v2[k] = betas[1] * v2[k] + (1 - betas[1]) * gk * gk
            m_hat = m[k] / (1 - betas[0] ** t)
            v_hat = v2[k] / (1 - betas[1] ** t)
            p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def small_params(rng):
    return {"h.0.mlp.c_fc.weight": rng.standard_normal((8, 16)).astype(np.float32),
            "h.0.mlp.c_fc.bias": rng.standard_normal(16).astype(np.float32),
            "ln_f.weight": np.ones(8, np.float32)}


def test_adamw_follows_torchs_formula_over_steps_with_clipping_and_decay_masks():
    rng = np.random.default_rng(0)
    params = small_params(rng)
    # large gradients on some steps (clipped), small on others (not)
    grads_per_step = [{k: (rng.standard_normal(v.shape) * scale).astype(np.float32) for k, v in params.items()}
                      for scale in (5.0, 0.01, 3.0, 0.02, 10.0, 0.05)]
    lrs = [get_lr(s, lr=1e-2, min_lr=1e-3, warmup=2, steps=6) for s in range(6)]
    want = torch_adamw64(params, grads_per_step, lrs, wd=0.1, max_norm=1.0)
    got = {k: v.copy() for k, v in params.items()}
    opt = AdamW(got, weight_decay=0.1)
    clipped = []
    for grads, lr in zip(grads_per_step, lrs):
        grads = {k: g.copy() for k, g in grads.items()}
        norm = clip_grad_norm(grads, 1.0)
        clipped.append(norm > 1.0)
        opt.step(got, grads, lr)
    assert clipped == [True, False, True, False, True, False]
    for k in params:
        assert got[k].dtype == np.float32 and opt.m[k].dtype == np.float32 and opt.v[k].dtype == np.float32
        err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
        assert err < 1e-6, (k, err)


def test_weight_decay_only_on_matrices():
    """With zero gradients Adam's update is 0: what remains is the decay, p * (1 - lr wd), on matrices alone."""
    params = small_params(np.random.default_rng(1))
    before = {k: v.copy() for k, v in params.items()}
    AdamW(params, weight_decay=0.5).step(params, {k: np.zeros_like(v) for k, v in params.items()}, lr=0.1)
    np.testing.assert_array_equal(params["h.0.mlp.c_fc.weight"], before["h.0.mlp.c_fc.weight"] * np.float32(0.95))
    np.testing.assert_array_equal(params["h.0.mlp.c_fc.bias"], before["h.0.mlp.c_fc.bias"])
    np.testing.assert_array_equal(params["ln_f.weight"], before["ln_f.weight"])


def test_clip_grad_norm_semantics():
    g = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}
    assert clip_grad_norm(g, 10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(g["a"], [3.0, 0.0])  # under the limit: untouched
    assert clip_grad_norm(g, 1.0) == pytest.approx(5.0)  # returns the norm before clipping
    np.testing.assert_allclose(g["a"], [3.0 / (5.0 + 1e-6), 0.0], rtol=1e-6)
    np.testing.assert_allclose(g["b"], [[4.0 / (5.0 + 1e-6)]], rtol=1e-6)
    assert clip_grad_norm(g, 0.0) == pytest.approx(1.0, rel=1e-5)  # 0: measured, not clipped
    np.testing.assert_allclose(g["b"], [[4.0 / (5.0 + 1e-6)]], rtol=1e-6)


# kernels/fused/adamw.cu's grid, emulated: block b takes tensor block_tensor[b], chunk b - first_block[t],
# thread i the elements start + i, start + i + THREADS, ... below the chunk's end.
AWKWARD = [(1,), (17,), (768,), (50257, 768), (3, 2 * adamw.CHUNK + 5)]


def kernel_elements(block_tensor, first_block, sizes, b):
    """(t, the flat indices block b touches, thread by thread), as adamw.cu's chunk_of and loops compute them."""
    t = int(block_tensor[b])
    start = (b - int(first_block[t])) * adamw.CHUNK
    end = min(int(sizes[t]), start + adamw.CHUNK)
    return t, np.concatenate([np.arange(start + i, end, adamw.THREADS, dtype=np.int64) for i in range(adamw.THREADS)])


def test_the_multi_tensor_grid_covers_every_element_once():
    sizes = [math.prod(s) for s in AWKWARD]
    block_tensor, first_block = adamw.chunk_tables(sizes)
    assert len(block_tensor) == sum(-(-n // adamw.CHUNK) for n in sizes)
    seen = [np.zeros(n, dtype=np.uint8) for n in sizes]
    for b in range(len(block_tensor)):
        t, idx = kernel_elements(block_tensor, first_block, sizes, b)
        seen[t][idx] += 1
    assert all((s == 1).all() for s in seen)
    with pytest.raises(ValueError, match="runs on CuPy arrays"):
        AdamW({"w": np.zeros((2, 2), np.float32)}, multi_tensor=True)
    assert AdamW({"w": np.zeros((2, 2), np.float32)}).multi is None  # NumPy's default: per tensor


def test_the_multi_tensor_emulation_equals_the_per_tensor_step_and_norm():
    """The kernels' arithmetic through their index arithmetic, in NumPy (the 50257 x 768 table aside: its
    coverage is checked above): the norm from per-block float32 partials summed in double, the step with
    the clip scale applied to g first, bit for bit the per-tensor path's (clip_grad_norm, AdamW.step)."""
    rng = np.random.default_rng(3)
    shapes = [s for s in AWKWARD if s != (50257, 768)]
    params = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    got = {k: v.copy() for k, v in params.items()}
    ref = {k: v.copy() for k, v in params.items()}
    emulated, per_tensor = AdamW(got, weight_decay=0.1), AdamW(ref, weight_decay=0.1)
    sizes, names = [p.size for p in params.values()], list(params)
    block_tensor, first_block = adamw.chunk_tables(sizes)
    for step, (scale, lr) in enumerate([(30.0, 1e-2), (1e-4, 5e-3), (10.0, 2e-3)], start=1):
        grads = {k: (rng.standard_normal(v.shape) * scale).astype(np.float32) for k, v in params.items()}
        partial = np.zeros(len(block_tensor), dtype=np.float32)
        for b in range(len(block_tensor)):
            t, idx = kernel_elements(block_tensor, first_block, sizes, b)
            x = grads[names[t]].ravel()[idx]
            partial[b] = np.sum(x * x, dtype=np.float32)
        norm = math.sqrt(float(partial.astype(np.float64).sum()))
        coef = 1.0 / (norm + 1e-6)
        clip = np.float32(coef) if coef < 1 else np.float32(1)
        want_norm = clip_grad_norm({k: g.copy() for k, g in grads.items()}, 1.0)
        assert norm == pytest.approx(want_norm, rel=1e-6)
        assert (coef < 1) == (step != 2)
        # the per-tensor path with the scale the device computes from its own norm
        ref_grads = {k: g * clip for k, g in grads.items()}
        per_tensor.step(ref, ref_grads, lr)
        emulated.t += 1
        beta1, beta2 = emulated.betas
        for b in range(len(block_tensor)):
            t, idx = kernel_elements(block_tensor, first_block, sizes, b)
            k = names[t]
            flat = [a.reshape(-1) for a in (got[k], emulated.m[k], emulated.v[k])]
            p, m, v = (a[idx] for a in flat)
            keep = 1 - lr * (emulated.weight_decay if emulated.decay[k] else 0.0)
            scalars = (keep, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step),
                       emulated.eps)
            adamw._step_numpy(p, grads[k].ravel()[idx] * clip, m, v, *(np.float32(s) for s in scalars))
            for a, new in zip(flat, (p, m, v)):
                a[idx] = new
        for k in params:
            for a, b in ((got[k], ref[k]), (emulated.m[k], per_tensor.m[k]), (emulated.v[k], per_tensor.v[k])):
                assert (a.view(np.uint32) == b.view(np.uint32)).all(), k


class OnDevice(np.ndarray):
    """A NumPy array with CuPy's .data.ptr: MultiTensor's tables hold real addresses, resolved by EmulatedDevice."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)

    def set(self, a, stream=None):
        """CuPy's host-to-device copy."""
        assert a.dtype == self.dtype and a.shape == self.shape
        self[...] = a


class EmulatedDevice:
    """fused.function and fused.launch for adamw.cu, run in NumPy: the kernels' arguments unpacked in
    their signatures' order, each table address resolved to the array it came from."""

    def __init__(self, *dicts):
        self.arrays = {a.ctypes.data: a.reshape(-1) for d in dicts for a in d.values()}

    def launch(self, expression, grid, block, args):
        assert block == adamw.THREADS and grid == len(args[2])
        table, sizes, block_tensor, first_block = args[:4]
        n = int(args[4] if expression == adamw.KERNELS[0] else args[5])
        rows = [[self.arrays[int(a)] for a in table.reshape(4, n)[r]] for r in range(4)]
        elements = [kernel_elements(block_tensor, first_block, sizes, b) for b in range(grid)]
        if expression == adamw.KERNELS[0]:
            max_norm, partial, ticket, out, scale = args[5:]
            for b, (t, idx) in enumerate(elements):
                partial[b] = np.sum(rows[1][t][idx] ** 2, dtype=np.float32)
            out[0] = math.sqrt(float(partial.astype(np.float64).sum()))
            coef = max_norm / (out[0] + 1e-6)
            scale[0] = coef if max_norm > 0 and coef < 1 else 1.0
            assert ticket[0] == 0
        else:
            decays, _, scale, *by_value = args[4:]  # adamw_step's scalars, or adamw_step_graph's hyper
            hyper = by_value[0] if expression == adamw.KERNELS[2] else np.array(by_value, dtype=np.float32)
            keep, *scalars = np.asarray(hyper, dtype=np.float32)  # HYPER's order, read at the launch
            for t, idx in elements:
                p, g, m, v = (row[t] for row in rows)
                pi, mi, vi = p[idx], m[idx], v[idx]
                adamw._step_numpy(pi, g[idx] * scale[0], mi, vi, keep if decays[t] else np.float32(1), *scalars)
                p[idx], m[idx], v[idx] = pi, mi, vi


FAKE_CUPY = SimpleNamespace(asarray=lambda a: np.array(a).view(OnDevice), empty=np.empty, ones=np.ones,
                            zeros=lambda *a, **kw: np.zeros(*a, **kw).view(OnDevice))


def test_multi_tensor_host_side_on_an_emulated_device(monkeypatch):
    """MultiTensor's tables and launches (lm/adamw.py) with NumPy for CuPy and the kernels emulated:
    bit for bit the per-tensor path over clipped, unclipped and unmeasured steps."""
    monkeypatch.setitem(sys.modules, "cupy", FAKE_CUPY)
    rng = np.random.default_rng(4)
    shapes = [s for s in AWKWARD if s != (50257, 768)]
    params = {f"t{i}": rng.standard_normal(s).astype(np.float32).view(OnDevice) for i, s in enumerate(shapes)}
    ref = {k: np.array(v) for k, v in params.items()}
    opt, per_tensor = AdamW(params), AdamW(ref)
    opt.m, opt.v = ({k: a.view(OnDevice) for k, a in state.items()} for state in (opt.m, opt.v))
    opt.multi = adamw.MultiTensor(opt.m, opt.v, opt.decay)
    for scale, lr, max_norm in [(30.0, 1e-2, 1.0), (1e-4, 5e-3, 1.0), (10.0, 2e-3, None), (10.0, 1e-3, 0.0)]:
        grads = {k: (rng.standard_normal(v.shape) * scale).astype(np.float32).view(OnDevice) for k, v in params.items()}
        device = EmulatedDevice(params, grads, opt.m, opt.v)
        monkeypatch.setattr(fused, "function", lambda name, expression, options: expression)
        monkeypatch.setattr(fused, "launch", device.launch)
        ref_grads = {k: np.array(g) for k, g in grads.items()}
        norm = opt.step(params, grads, lr, max_norm=max_norm)
        assert (norm is None) == (max_norm is None)
        if max_norm and max_norm / (norm + 1e-6) < 1:
            for g in ref_grads.values():
                g *= np.float32(max_norm / (norm + 1e-6))
        per_tensor.step(ref, ref_grads, lr)
        for k in params:
            assert (np.asarray(params[k]).view(np.uint32) == ref[k].view(np.uint32)).all(), k


def test_the_captured_multi_tensor_step_replays_with_each_steps_scalars(monkeypatch):
    """train.py --graph's optimizer: MultiTensor.launch() captured once (the emulated launches recorded with
    their arguments as they were, scalars by value, as a CUDA graph freezes them), then replayed over steps
    of a warmup and cosine schedule, each after load() of that step's addresses and AdamW.advance(lr): bit
    for bit the per-tensor path, step by step. The gradients live in fixed buffers that each step rewrites,
    as the captured pass rewrites its outputs; a replay without load() keeps the last step's scalars."""
    monkeypatch.setitem(sys.modules, "cupy", FAKE_CUPY)
    rng = np.random.default_rng(5)
    shapes = [s for s in AWKWARD if s != (50257, 768)]
    params = {f"t{i}": rng.standard_normal(s).astype(np.float32).view(OnDevice) for i, s in enumerate(shapes)}
    grads = {k: np.zeros(p.shape, np.float32).view(OnDevice) for k, p in params.items()}  # the graph's outputs
    ref = {k: np.array(v) for k, v in params.items()}
    opt, per_tensor = AdamW(params), AdamW(ref)
    opt.m, opt.v = ({k: a.view(OnDevice) for k, a in state.items()} for state in (opt.m, opt.v))
    opt.multi = adamw.MultiTensor(opt.m, opt.v, opt.decay)
    device, recorded = EmulatedDevice(params, grads, opt.m, opt.v), []
    monkeypatch.setattr(fused, "function", lambda name, expression, options: expression)
    monkeypatch.setattr(fused, "launch", lambda *launch: recorded.append(launch))
    opt.multi.launch(1.0)  # the capture: recorded, not run
    assert [r[0] for r in recorded] == [adamw.KERNELS[0], adamw.KERNELS[2]]  # the update reads self.hyper
    lrs = [get_lr(step, lr=1e-2, min_lr=1e-3, warmup=2, steps=6) for step in range(6)]
    assert len(set(lrs)) == 6
    for lr in lrs:
        for g in grads.values():  # the pass's replay rewrites the gradients in place
            g[...] = rng.standard_normal(g.shape) * 3.0
        scalars = opt.advance(lr)
        opt.multi.load(params, grads, scalars)
        for launch in recorded:
            device.launch(*launch)
        norm = float(opt.multi.norm[0])
        ref_grads = {k: np.array(g) for k, g in grads.items()}
        assert norm == pytest.approx(clip_grad_norm({k: g.copy() for k, g in ref_grads.items()}, 0.0), rel=1e-6)
        if 1.0 / (norm + 1e-6) < 1:
            for g in ref_grads.values():
                g *= np.float32(1.0 / (norm + 1e-6))
        per_tensor.step(ref, ref_grads, lr)
        for k in params:
            assert (np.asarray(params[k]).view(np.uint32) == ref[k].view(np.uint32)).all(), (lr, k)
    assert opt.t == per_tensor.t == 6
    np.testing.assert_array_equal(opt.multi.hyper, np.array(scalars, dtype=np.float32))  # the last step's


def test_the_pass_can_keep_its_loss_on_the_device():
    """loss_and_grads(loss_on_host=False), what the captured step calls: the same loss as a 0-d array
    (nothing read back), the same gradients."""
    from gpt2.backward import Attention, loss_and_grads

    params = random_weights(TINY, seed=1).params
    idx, targets = np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 2, 8))
    loss, grads = loss_and_grads(params, TINY, idx, targets, Attention.reference())
    kept, kept_grads = loss_and_grads(params, TINY, idx, targets, Attention.reference(), loss_on_host=False)
    assert type(loss) is float and type(kept) is not float and np.ndim(kept) == 0  # NumPy: a float32 scalar
    assert float(kept) == loss
    assert all(np.array_equal(grads[k], kept_grads[k]) for k in grads)


def test_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup=4, steps=15)
    assert [get_lr(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert get_lr(4, **kw) == 1.0  # the cosine starts at the peak
    assert get_lr(9, **kw) == pytest.approx(0.55)  # half way: the mean of the two
    assert get_lr(14, **kw) == pytest.approx(0.1)  # the last step at min_lr
    assert get_lr(40, **kw) == pytest.approx(0.1)
    assert all(get_lr(s, **kw) >= get_lr(s + 1, **kw) for s in range(4, 14))
    assert [get_lr(s, **kw, schedule="constant") for s in (3, 4, 14)] == [1.0, 1.0, 1.0]
    assert get_lr(0, lr=1.0, min_lr=0.0, warmup=0, steps=1) == 1.0  # one step, no warmup: the peak


# ---------------------------------------------------------------------------------------------
# Token files and batches
# ---------------------------------------------------------------------------------------------

def test_bin_round_trip_memory_mapped(tmp_path):
    ids = np.array([0, 1, 50256, 7, 65535 % 50257], dtype=np.int64)
    path = write_bin(tmp_path / "t.bin", ids)
    assert path.stat().st_size == 1024 + 2 * len(ids)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, len(ids)]
    tokens = read_tokens(path, vocab_size=50257)
    assert isinstance(tokens, np.memmap)
    np.testing.assert_array_equal(tokens, ids)


@pytest.mark.parametrize("case, message", [
    ("magic", "not a .bin token file (magic 1234"),
    ("version", ".bin version 2"),
    ("truncated", "the header says 10 tokens"),
    ("short", "shorter than a .bin token file's 1,024-byte header"),
    ("vocab", "token ids from 0 to 300, but the model's vocabulary is [0, 256)"),
    ("npy_float", "a .npy of tokens is a 1-D array of integer ids; this one is float32"),
    ("npy_2d", "of shape (2, 3)"),
    ("suffix", "token files are .bin, .npy, .txt"),
    ("missing", "no such file"),
])
def test_files_that_are_not_tokens_get_one_line(tmp_path, case, message):
    path = tmp_path / "t.bin"
    if case in ("magic", "version", "truncated"):
        write_bin(path, np.arange(10))
        raw = bytearray(path.read_bytes())
        if case == "magic":
            raw[0:4] = (1234).to_bytes(4, "little")
        elif case == "version":
            raw[4:8] = (2).to_bytes(4, "little")
        else:
            raw = raw[:-2]
        path.write_bytes(bytes(raw))
    elif case == "short":
        path.write_bytes(b"hello")
    elif case == "vocab":
        write_bin(path, [0, 300])
    elif case.startswith("npy"):
        path = tmp_path / "t.npy"
        np.save(path, np.zeros(6, np.float32) if case == "npy_float" else np.zeros((2, 3), np.int32))
    elif case == "suffix":
        path = tmp_path / "t.csv"
        path.write_text("1,2,3")
    with pytest.raises(LabError) as exc:
        read_tokens(path, vocab_size=256)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_npy_and_txt(tmp_path):
    np.save(tmp_path / "t.npy", np.array([5, 6, 7], np.uint16))
    np.testing.assert_array_equal(read_tokens(tmp_path / "t.npy", vocab_size=50257), [5, 6, 7])
    text = "Hello, I'm a language model,<|endoftext|> and more"
    (tmp_path / "t.txt").write_text(text)
    tokens = read_tokens(tmp_path / "t.txt", vocab_size=50257)
    assert tokens.tolist() == gpt2.load_tokenizer().encode(text, allowed_special="all")
    assert tokens.tolist()[:8] == [15496, 11, 314, 1101, 257, 3303, 2746, 11] and 50256 in tokens.tolist()


def test_batches_follow_llmc_order_and_start_over():
    B, T = 2, 3
    tokens = np.arange(20)  # (20 - 1) // 6 = 3 batches per pass
    batches = Batches(tokens, B, T)
    assert len(batches) == 3
    for i in range(7):
        x, y = batches[i]
        start = (i % 3) * B * T
        np.testing.assert_array_equal(x, np.arange(start, start + B * T).reshape(B, T))
        np.testing.assert_array_equal(y, x + 1)  # next-token targets, across the row boundary too
    assert batches[3][0][0, 0] == 0  # the 4th batch would need tokens 18..24: it starts over
    with pytest.raises(LabError, match="fewer than one batch of B x T \\+ 1 = 7"):
        Batches(np.arange(6), B, T)


# ---------------------------------------------------------------------------------------------
# train.py end to end
# ---------------------------------------------------------------------------------------------

class StandInAttention:
    @classmethod
    def make(cls, kernel, backward):
        return ("rungs", kernel, backward)

    @classmethod
    def reference(cls):
        return "reference"


class QuadraticLoss:
    """loss = sum over parameters of mean((p - 0.5)^2) / 2: gradients (p - 0.5) / p.size; the batches
    it was given are kept to check the loop's order."""

    def __init__(self):
        self.calls = []

    def __call__(self, params, config, idx, targets, attn, dtype="float32"):
        self.calls.append((np.asarray(idx).copy(), np.asarray(targets).copy(), attn, dtype))
        loss = sum(float(((p - 0.5) ** 2).mean()) / 2 for p in params.values())
        return loss, {k: ((p - 0.5) / p.size).astype(np.float32) for k, p in params.items()}


@pytest.fixture
def train(monkeypatch):
    """train.py with stand-ins for what it steps with: GPT-2's family.backward (gpt2/backward.py)."""
    import train as module

    monkeypatch.setattr(gpt2.backward, "Attention", StandInAttention)
    monkeypatch.setattr(gpt2.backward, "loss_and_grads", QuadraticLoss())
    return module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save(random_weights(TINY, seed=3), tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.bin"
    return write_bin(path, np.random.default_rng(0).integers(0, TINY.vocab_size, 2000))


def test_cli_trains_writes_json_and_out_then_lab_generates(train, folder, data, tmp_path, capsys):
    out, log = tmp_path / "out", tmp_path / "run.json"
    argv = ["--device", "cpu", "--model", folder, "--data", data, "--val-data", data, "--eval-every", "2",
            "--val-batches", "2", "--steps", "4", "--batch", "2", "--seq", "16", "--accum", "2", "--lr", "1e-2",
            "--warmup", "1", "--out", out, "--json", log]
    assert train.main([str(a) for a in argv]) == 0
    printed = capsys.readouterr().out
    assert "step 1/4 | loss " in printed and "step 4/4 | loss " in printed and " tok/s" in printed
    assert printed.count("val loss ") == 2  # after steps 2 and 4
    calls = gpt2.backward.loss_and_grads.calls
    assert len(calls) == 8  # 4 steps x 2 micro-batches, each the next batch in llm.c's order
    batches = Batches(read_tokens(data, vocab_size=TINY.vocab_size), 2, 16)
    for i, (idx, targets, attn, dtype) in enumerate(calls):
        np.testing.assert_array_equal(idx, batches[i][0])
        np.testing.assert_array_equal(targets, batches[i][1])
        assert attn == "reference" and dtype == "float32"
    summary = json.loads(log.read_text())
    assert len(summary["losses"]) == 4 and summary["losses"][0] > summary["losses"][-1]
    for key in ("lr", "grad_norm", "ms", "tokens_per_s", "mfu"):
        assert len(summary[key]) == 4, key
    assert summary["lr"] == [pytest.approx(get_lr(s, lr=1e-2, min_lr=1e-3, warmup=1, steps=4)) for s in range(4)]
    assert [v["step"] for v in summary["val_losses"]] == [2, 4]
    assert summary["mfu"] == [None] * 4 and summary["peak_gpu_memory_bytes"] is None
    assert summary["tokens_per_step"] == 2 * 16 * 2 and summary["kernel"] == "reference"
    trained = gpt2.load(out)
    assert trained.config == TINY
    # the quadratic loss pulls every parameter towards 0.5
    start = gpt2.load(folder)
    # its gradient does not depend on the batch: the 2 micro-batches' average is one's (a sum would double it)
    first = math.sqrt(sum(float((((p.astype(np.float64) - 0.5) / p.size) ** 2).sum()) for p in start.params.values()))
    assert summary["grad_norm"][0] == pytest.approx(first, rel=1e-5)
    assert np.abs(trained.params["ln_f.bias"] - 0.5).max() < np.abs(start.params["ln_f.bias"] - 0.5).max()
    generated = tmp_path / "lab.json"
    r = subprocess.run([sys.executable, str(ROOT / "lab.py"), "--device", "cpu", "--model", str(out), "--tokens", "3",
                        "--json", str(generated)], capture_output=True, text=True, cwd=ROOT, env=dict(os.environ),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(generated.read_text())["n_new_tokens"] == 3


@pytest.mark.parametrize("extra, message", [
    (["--seq", "65"], "--seq 65 is longer than the model's 64 positions"),
    (["--kernel", "v13"], "--kernel and --backward run on the GPU"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--random-weights"], "--model and --random-weights exclude each other"),
    (["--batch", "200"], "fewer than one batch of B x T + 1"),
    (["--graph"], "--graph captures a CUDA graph; on the CPU the steps run eagerly"),
    (["--graph", "--per-tensor"], "--graph captures the multi-tensor AdamW"),
])
def test_user_errors_exit_2_with_one_line(train, folder, data, capsys, extra, message):
    argv = ["--device", "cpu", "--model", str(folder), "--data", str(data), "--steps", "1", "--batch", "2",
            "--seq", "16", *extra]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_family_without_a_backward_exits_2_saying_which_train(train, data, tmp_path, capsys):
    import llama

    config = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=TINY.vocab_size, max_position_embeddings=64)
    folder = llama.save(llama.random_weights(config, seed=0), tmp_path / "tiny-llama")
    assert train.main(["--device", "cpu", "--model", str(folder), "--data", str(data), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama' has no backward pass; train.py trains gpt2" in err and err.count("\n") == 1, err


def test_train_py_asks_the_family_and_never_compares_a_family_s_name():
    """No comparison of a value with a family's or a size's name in train.py (`family != "gpt2"`): whether a
    family trains is its Family's backward, as lab.py and bench.py ask theirs."""
    import llama

    names = {gpt2.FAMILY.name, llama.FAMILY.name, *gpt2.SIZES, *llama.SIZES}
    found = [f"train.py:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse((ROOT / "train.py").read_text()))
             if isinstance(node, ast.Compare)
             and {c.value for side in (node.left, *node.comparators) for c in ast.walk(side)
                  if isinstance(c, ast.Constant)} & names]
    assert found == []


def test_a_file_that_is_not_tokens_exits_2(train, folder, tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 2048)
    assert train.main(["--device", "cpu", "--model", str(folder), "--data", str(bad), "--batch", "2", "--seq", "16"]) == 2
    assert "not a .bin token file (magic 0" in capsys.readouterr().err


def test_pick_rungs_refuses_a_forward_rung_without_lse(train):
    args = train.parse_args(["--data", "x.bin", "--kernel", "v12", "--dtype", "float32"])
    with pytest.raises(LabError, match="does not write the log-sum-exp the backward needs"):
        train.pick_rungs(args, gpt2.SIZES["gpt2"], "sm_90")


def test_deterministic_asks_the_backward_rung_for_its_fixed_order(monkeypatch):
    """--deterministic reaches kernels.attention_backward as deterministic=True, on by default off; a backward
    rung without a deterministic configuration for the shared head sizes is refused, naming those that have one."""
    import kernels
    from gpt2.backward import Attention
    from kernels.backward import BackwardRung

    asked = []
    monkeypatch.setattr(kernels, "attention_backward", lambda *a, **kw: asked.append(kw["deterministic"]))
    for deterministic in (False, True):
        Attention.make("v19", "b08", deterministic=deterministic).backward(*[None] * 6)
    assert asked == [False, True]
    monkeypatch.setattr(BackwardRung, "is_deterministic", lambda self, config: False)
    assert Attention.make("v19", "b08").head_sizes  # the default needs no deterministic configuration
    with pytest.raises(LabError, match="b08_pingpong has no deterministic configuration .* have one"):
        Attention.make("v19", "b08", deterministic=True)


@pytest.mark.parametrize("dtype, arch, forward, backward", [
    ("float32", "sm_90", "v13_fa2_partitioning", "b02_fa2"),  # float32 without TF32
    ("bfloat16", "sm_90", "v19_wgmma_overlap", "b14_wide_stores_d64"),  # head size 64
    ("bfloat16", "sm_80", "v15_bf16_mma", "b04_bf16_mma"),  # no wgmma before Hopper
])
def test_default_rungs(train, dtype, arch, forward, backward):
    args = train.parse_args(["--data", "x.bin", "--dtype", dtype])
    assert train.pick_rungs(args, gpt2.SIZES["gpt2"], arch) == (forward, backward)


def test_a_backward_rung_not_yet_run_on_a_gpu_trains_only_when_named(train, monkeypatch):
    """A newer backward rung declared lab.unverified is not the default; --backward names it."""
    import dataclasses

    from kernels import backward as backward_ladder

    load, names, resolve = backward_ladder.load, backward_ladder.names, backward_ladder.resolve
    newer = dataclasses.replace(load("b08"), name="b99_new", unverified="not yet run on a GPU")
    monkeypatch.setattr(backward_ladder, "names", lambda: [*names(), "b99_new"])
    monkeypatch.setattr(backward_ladder, "load", lambda n: newer if n == "b99_new" else load(n))
    monkeypatch.setattr(backward_ladder, "resolve", lambda n: newer.path.with_name("b99_new.cu") if n == "b99_new" else resolve(n))
    args = train.parse_args(["--data", "x.bin", "--dtype", "bfloat16"])
    assert train.pick_rungs(args, gpt2.SIZES["gpt2"], "sm_90")[1] == "b14_wide_stores_d64"
    args = train.parse_args(["--data", "x.bin", "--dtype", "bfloat16", "--backward", "b99_new"])
    assert train.pick_rungs(args, gpt2.SIZES["gpt2"], "sm_90")[1] == "b99_new"


@pytest.mark.parametrize("declared, chosen", [
    ({}, "v26_new"),  # a newer rung that declares what training needs is the default, no list to edit
    ({"lse": False}, "v13_fa2_partitioning"),  # no log-sum-exp for the backward
    ({"tf32_products": "1"}, "v13_fa2_partitioning"),  # float32 on the TF32 tensor cores
    ({"min_arch": 100}, "v13_fa2_partitioning"),  # does not compile for sm_90
])
def test_default_rungs_follow_the_declarations(train, monkeypatch, declared, chosen):
    import dataclasses

    import kernels

    load, names = kernels.load, kernels.names
    newer = dataclasses.replace(load("v13"), name="v26_new", **declared)
    monkeypatch.setattr(kernels, "names", lambda: [*names(), "v26_new"])
    monkeypatch.setattr(kernels, "load", lambda n: newer if n == "v26_new" else load(n))
    args = train.parse_args(["--data", "x.bin", "--dtype", "float32"])
    assert train.pick_rungs(args, gpt2.SIZES["gpt2"], "sm_90")[0] == chosen


def test_the_real_backward_overfits_one_repeated_batch(tmp_path):
    """train.main with the real loss_and_grads and the reference attention (NumPy): a tiny model with a
    small vocabulary, one batch of random tokens repeated (exactly B x T + 1 tokens: Batches starts over
    every step), falls below 10% of its starting loss within 100 steps (llm.c's and nanoGPT's sanity check)."""
    import train

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    model = save(random_weights(config, seed=3), tmp_path / "tiny")
    B, T = 4, 16
    one_batch = write_bin(tmp_path / "one.bin", np.random.default_rng(0).integers(0, config.vocab_size, B * T + 1))
    log = tmp_path / "run.json"
    assert train.main([str(a) for a in ("--device", "cpu", "--model", model, "--data", one_batch, "--steps", 100,
                                         "--batch", B, "--seq", T, "--lr", 1e-2, "--json", log)]) == 0
    losses = json.loads(log.read_text())["losses"]
    assert losses[0] == pytest.approx(math.log(config.vocab_size), rel=0.05)  # random weights: about uniform
    assert losses[-1] < 0.1 * losses[0], losses


def test_training_graph_captures_the_passes_and_the_optimizer_once_and_replays_with_each_lr():
    """lm/step_graph.TrainingGraph on a stand-in CuPy: the capture runs passes(inputs) and the optimizer's
    launch once, inside the capture; each step copies the batch in, loads the step's scalars (advance(lr))
    and launches the graph, in that order, and never runs the passes again."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from lm.step_graph import TrainingGraph

    events = []

    class Stream:
        def wait_event(self, e):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            events.append("begin")

        def end_capture(self):
            events.append("end")
            return SimpleNamespace(upload=lambda s: None, launch=lambda s: events.append("launch"))

        def record(self):
            return None

    class Buffer(np.ndarray):
        def set(self, a):
            events.append(("copy", int(a[0])))
            self[...] = a

    cuda = SimpleNamespace(Stream=lambda non_blocking=True: Stream(), MemoryPool=lambda: SimpleNamespace(malloc=None),
                           using_allocator=lambda malloc: nullcontext(), get_current_stream=lambda: Stream())
    cp = SimpleNamespace(cuda=cuda, zeros=lambda shape, dtype: np.zeros(shape, dtype).view(Buffer))
    multi = SimpleNamespace(launch=lambda max_norm: events.append(("launch_adamw", max_norm)),
                            load=lambda params, grads, scalars: events.append(("load", scalars)))
    opt = SimpleNamespace(multi=multi, advance=lambda lr: (lr, "t+1"))

    def passes(inputs):
        events.append(("passes", len(inputs)))
        return ["loss"], {"w": "grad"}

    tg = TrainingGraph(cp, passes, opt, {"w": 0}, [(2,), (2,)], 0.5)
    assert events == ["begin", ("passes", 2), ("launch_adamw", 0.5), "end"]
    assert (tg.losses, tg.grads) == (["loss"], {"w": "grad"})
    events.clear()
    for lr in (1e-3, 5e-4):
        tg.step([np.array([7, 8]), np.array([9, 10])], lr)
    assert events == [("copy", 7), ("copy", 9), ("load", (1e-3, "t+1")), "launch",
                      ("copy", 7), ("copy", 9), ("load", (5e-4, "t+1")), "launch"]
    with pytest.raises(ValueError, match="multi-tensor AdamW"):
        TrainingGraph(cp, passes, SimpleNamespace(multi=None), {}, [(2,)], 1.0)
