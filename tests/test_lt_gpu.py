"""lm/lt.py on the GPU: cuBLASLt's bias, GELU and residual-adding epilogues on bfloat16 products against float64, eagerly
and replayed from a CUDA graph; and GPT-2's whole-sequence pass with them (the default) and without (LAB_LT_EPILOGUES=0)
against the unfused one's logits."""

from __future__ import annotations

import numpy as np
import pytest

import gpt2.fast as fast
from lm import lt
from lm.bf16 import round_to_bf16, to_float32
from tests.test_fused_gpu import gelu64, nan_bits, weights

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def within_a_bf16_step(cp, got, want, what: str) -> None:
    """got (bfloat16 bits) within one bfloat16 step (8 bits of significand) of the float64 want, a floor
    where GELU's 1 + tanh cancels to ~0."""
    got = to_float32(cp, got).astype(cp.float64)
    step = cp.maximum(cp.abs(want), cp.abs(got)) * 2.0**-7 + 1e-5
    worst = float((cp.abs(got - want) / step).max())
    assert worst <= 1.0, f"{what}: {worst:.2f} bfloat16 steps from float64"


@pytest.mark.parametrize("gelu", [False, True], ids=["bias", "bias+gelu"])
@pytest.mark.parametrize("M,N,K", [(1, 2304, 768), (17, 3072, 768), (97, 96, 32), (1000, 6400, 1600)])
def test_epilogues_match_float64(cp, M, N, K, gelu):
    rng = cp.random.default_rng()
    (a, a32), (W, W32) = weights(cp, rng, (M, K), "bfloat16", 1.0), weights(cp, rng, (N, K), "bfloat16", 0.05)
    bias = rng.standard_normal(N, dtype=cp.float32)
    out = nan_bits(cp, (M, N), "bfloat16")
    assert lt.Lt(cp).gemm(a, W, bias, out, gelu=gelu)
    want = a32.astype(cp.float64) @ W32.astype(cp.float64).T + round_to_bf16(cp, bias)  # the bias as cuBLASLt takes it
    within_a_bf16_step(cp, out, gelu64(cp, want) if gelu else want, f"{M}x{N}x{K}")


@pytest.mark.parametrize("M,N,K", [(1, 768, 3072), (97, 1600, 1600), (1000, 1600, 6400)])
def test_an_adding_product_matches_float64(cp, M, N, K):
    """x += a @ W^T + bias (the residual products): x float32, the bias float32 as given."""
    rng = cp.random.default_rng()
    (a, a32), (W, W32) = weights(cp, rng, (M, K), "bfloat16", 1.0), weights(cp, rng, (N, K), "bfloat16", 0.05)
    bias = rng.standard_normal(N, dtype=cp.float32)
    x = rng.standard_normal((M, N), dtype=cp.float32)
    want = x.astype(cp.float64) + a32.astype(cp.float64) @ W32.astype(cp.float64).T + bias
    assert lt.Lt(cp).gemm(a, W, bias, x, add=True)
    err = float(cp.abs(x - want).max() / cp.abs(want).max())
    assert err < 1e-5, err  # float32 accumulation of exact bfloat16 products


def test_a_captured_product_replays_with_the_operands_new_values(cp):
    M, N, K = 33, 3072, 768
    rng = cp.random.default_rng()
    me = lt.Lt(cp)
    a, W = weights(cp, rng, (M, K), "bfloat16", 1.0)[0], weights(cp, rng, (N, K), "bfloat16", 0.05)[0]
    bias, out = rng.standard_normal(N, dtype=cp.float32), nan_bits(cp, (M, N), "bfloat16")
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # the operands, written on the legacy stream, first
    with stream:
        assert me.gemm(a, W, bias, out, gelu=True)  # planned (and the bias's bfloat16 copy made) outside the capture
        stream.synchronize()
        stream.begin_capture()
        me.gemm(a, W, bias, out, gelu=True)
        graph = stream.end_capture()
        fresh, fresh32 = weights(cp, rng, (M, K), "bfloat16", 1.0)
        a[...] = fresh
        out.fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    want = fresh32.astype(cp.float64) @ to_float32(cp, W).astype(cp.float64).T + round_to_bf16(cp, bias)
    within_a_bf16_step(cp, out, gelu64(cp, want), "replayed")


def test_gpt2_prefill_with_the_epilogues_keeps_the_unfused_logits(cp, monkeypatch):
    """GPT-2 small's random weights in bfloat16, a 97-token prompt through the whole-sequence pass with
    cuBLASLt's epilogues and without: the first token's logits within bfloat16's reach of each other (the
    fused pass rounds the product once, the unfused twice)."""
    import kernels
    from gpt2.load import random_weights

    small = random_weights("gpt2", seed=0, xp=cp)
    prompt = np.random.default_rng(97).integers(0, small.config.vocab_size, 97).tolist()
    logits = {}
    for enabled in (False, True):
        monkeypatch.setattr(lt, "ENABLED", enabled)
        engine = fast.Engine(small.params, small.config, dtype="bfloat16", keep_logits=True, persistent=False)
        assert (engine.whole.lt is not None) == enabled
        engine.start(prompt, kernels.Attend("v24", dtype="bfloat16"), kv_cache=True)
        with engine.stream:
            logits[enabled] = engine.logits.astype(cp.float64)
        engine.stream.synchronize()
    rel = float(cp.linalg.norm(logits[True] - logits[False]) / cp.linalg.norm(logits[False]))
    assert rel < 2e-2, rel
