"""The multi-tensor AdamW (lm/adamw.py's MultiTensor, kernels/fused/adamw.cu) against the per-tensor path
on CuPy: GPT-2 small's 148 parameter shapes, every p, g, m and v inside a buffer whose untouched
margins hold a NaN of an odd payload (a store outside a tensor changes those bits: arithmetic gives
the canonical NaN), four steps (clipped, not clipped, no clipping asked, measured only). The update is
bit for bit the per-tensor path's given the same clip scale (each path scales by its own norm, and the
two norms are summed in different orders); the norm within float32 rounding of the float64 norm. Then
one step on loss_and_grads's own gradients of a small GPT-2, float32 and bfloat16."""

import math
from dataclasses import replace

import numpy as np
import pytest

import gpt2
from gpt2.backward import Attention, loss_and_grads
from lm.adamw import AdamW, MultiTensor, clip_grad_norm

pytestmark = pytest.mark.gpu

POISON = np.uint32(0x7FC0_0123)  # a quiet NaN no arithmetic produces
MARGIN = 1000  # elements of poison before and after each tensor (not a multiple of the chunk)


@pytest.fixture
def cp():
    import cupy

    return cupy


def guarded(cp, a):
    """(a copy of a inside a poisoned buffer, the buffer): the copy contiguous float32, MARGIN elements in."""
    buf = cp.full(a.size + 2 * MARGIN, POISON, dtype=cp.uint32).view(cp.float32)
    inner = buf[MARGIN:MARGIN + a.size].reshape(a.shape)
    inner[...] = a
    return inner, buf


def margins_intact(buf) -> bool:
    bits = buf.view(np.uint32)
    return bool((bits[:MARGIN] == POISON).all()) and bool((bits[-MARGIN:] == POISON).all())


def same_bits(a, b) -> bool:
    return bool((a.view(np.uint32) == b.view(np.uint32)).all())


def test_multi_tensor_equals_per_tensor_on_gpt2_small(cp):
    params = gpt2.random_weights("gpt2", seed=0, xp=cp).params
    assert len(params) == 148
    buffers = []
    got = {}
    for k, p in params.items():
        got[k], buf = guarded(cp, p)
        buffers.append(buf)
    ref = {k: p.copy() for k, p in params.items()}
    multi, per_tensor = AdamW(got, multi_tensor=False), AdamW(ref, multi_tensor=False)  # multi's tables below
    for state in (multi.m, multi.v):  # the state in poisoned buffers too, before the tables are built
        for k in state:
            state[k], buf = guarded(cp, state[k])
            buffers.append(buf)
    multi.multi = MultiTensor(multi.m, multi.v, multi.decay)
    rng = cp.random.default_rng(1)
    # (gradient scale, lr, max_norm): clipped, under the limit, no clipping asked, measured only
    for scale, lr, max_norm in [(1e-3, 6e-4, 1.0), (1e-6, 3e-4, 1.0), (1e-3, 2e-4, None), (1e-3, 1e-4, 0.0)]:
        grads, step_buffers = {}, []
        for k, p in params.items():
            grads[k], buf = guarded(cp, rng.standard_normal(p.shape, dtype=cp.float32) * np.float32(scale))
            step_buffers.append(buf)
        want = math.sqrt(sum(float(cp.vdot(g.ravel().astype(cp.float64), g.ravel().astype(cp.float64)))
                             for g in grads.values()))
        ref_grads = {k: g.copy() for k, g in grads.items()}
        norm = multi.step(got, grads, lr, max_norm=max_norm)
        assert all(same_bits(grads[k], ref_grads[k]) for k in grads), "the multi-tensor path scaled a gradient"
        if max_norm is None:
            assert norm is None
        else:
            coef = max_norm / (norm + 1e-6)
            print(f"max_norm {max_norm}: norm {norm:.9g}, float64 {want:.9g}, per-tensor "
                  f"{clip_grad_norm({k: g.copy() for k, g in grads.items()}, max_norm):.9g}")
            assert abs(norm - want) <= 1e-6 * want
            assert (max_norm > 0 and coef < 1) == (scale == 1e-3 and max_norm == 1.0)
            if max_norm > 0 and coef < 1:
                for g in ref_grads.values():
                    g *= np.float32(coef)
        per_tensor.step(ref, ref_grads, lr)
        for k in params:
            assert same_bits(got[k], ref[k]), f"p {k}"
            assert same_bits(multi.m[k], per_tensor.m[k]) and same_bits(multi.v[k], per_tensor.v[k]), f"m, v {k}"
        assert all(margins_intact(b) for b in buffers + step_buffers), "a store outside a tensor"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_tensor_takes_the_backwards_gradients(cp, dtype):
    """One clipped step on the gradients loss_and_grads returns (fused kernels): accepted as they come
    (contiguous float32), the same update as the per-tensor path's with the same scale."""
    config = replace(gpt2.GPT2Config(n_layer=2, n_head=4, n_embd=128), vocab_size=1000)
    params = gpt2.random_weights(config, seed=0, xp=cp).params
    idx, targets = cp.random.default_rng(0).integers(0, config.vocab_size, (2, 2, 97))
    _, grads = loss_and_grads(params, config, idx, targets, Attention.reference(), dtype)
    got, ref = {k: p.copy() for k, p in params.items()}, {k: p.copy() for k, p in params.items()}
    norm = AdamW(got, multi_tensor=True).step(got, grads, 6e-4, max_norm=0.1)
    coef = 0.1 / (norm + 1e-6)
    assert coef < 1, norm
    for g in grads.values():
        g *= np.float32(coef)
    AdamW(ref, multi_tensor=False).step(ref, grads, 6e-4)
    assert all(same_bits(got[k], ref[k]) for k in params)
