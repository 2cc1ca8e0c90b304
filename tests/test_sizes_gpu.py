"""Every GPT-2 size on the fast decode path (random weights of the real shapes), held to what GPT-2
small is held to in tests/test_fused_gpu.py: float32 greedy tokens equal the eager model's
(gpt2/model.py) token for token, here over 512 tokens; bfloat16 (matrices and KV cache) judged by
teacher forcing over the eager float32 run's sequence: logits within 2e-2 relative per step, the
argmax agreeing at every clear step (top-two margin at least MARGIN) and at 90% of all. And the
persistent step (kernels/fused/decode_step.cu), which runs these sizes with a stage's share split
into several items of its weight stream, against the per-operation step: float32 tokens equal over
128 tokens, logits by teacher forcing in both dtypes within summation-order rounding."""

import numpy as np
import pytest

import gpt2.fast as fast
from gpt2 import generate, reference_attend
from gpt2.load import random_weights
from tests.test_fused_gpu import (
    MARGIN,
    PROMPT,
    first_difference,
    follows_step_by_step,
    margins,
    persistent_engine,
    teacher_forced,
)
from tests.tiers import tiered

pytestmark = pytest.mark.gpu

SIZES = ("gpt2-medium", "gpt2-large", "gpt2-xl")
TOKENS = 512


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module", params=tiered(SIZES, quick=SIZES[:1]))  # quick: the smallest
def model(request, cp):
    checkpoint = random_weights(request.param, seed=0, xp=cp)
    yield request.param, checkpoint
    fast.clear_cache()  # the engines built on these weights go with them
    del checkpoint
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.exhaustive  # 512 eager steps a size; the quick tier holds GPT-2 small's fast decode to eager (test_fused_gpu)
def test_float32_fast_decode_equals_the_eager_model_over_512_tokens(cp, model):
    size, ckpt = model
    why = fast.unsupported_reason(ckpt.params, ckpt.config, kv_cache=True)
    assert why is None, f"{size}: greedy float32 decode does not take the fast path: {why}"
    fast_run = generate(ckpt.params, ckpt.config, PROMPT, TOKENS, attend=reference_attend, kv_cache=True)
    eager = generate(ckpt.params, ckpt.config, PROMPT, TOKENS, attend=reference_attend, kv_cache=True, fast=False,
                     record_logits=True)
    first = first_difference(fast_run.tokens, eager.tokens)
    assert first is None, (f"{size}: fast and eager tokens part at new token {first}; the eager top-two margin "
                           f"there is {margins(cp, eager.logits)[first]:.2e} (a near tie if below ~1e-4)")


def test_bfloat16_logits_follow_the_eager_float32_model(cp, model):
    size, ckpt = model
    n = 48
    eager = generate(ckpt.params, ckpt.config, PROMPT, n, attend=reference_attend, kv_cache=True, fast=False,
                     record_logits=True)
    engine = fast.Engine(ckpt.params, ckpt.config, dtype="bfloat16", keep_logits=True)
    got = teacher_forced(cp, engine, PROMPT, eager.tokens)
    rel = [float(cp.linalg.norm(g - e) / cp.linalg.norm(e)) for g, e in zip(got, eager.logits, strict=True)]
    agree = np.array([int(g.argmax()) == t for g, t in zip(got, eager.tokens, strict=True)])
    clear = margins(cp, eager.logits) >= MARGIN
    assert max(rel) <= 2e-2, f"{size}: relative logit error per step {np.round(rel, 5).tolist()} (limit 2e-2)"
    assert agree[clear].all(), f"{size}: argmax differs at clear steps {np.flatnonzero(clear & ~agree).tolist()}"
    assert agree.mean() >= 0.9, f"{size}: argmax agrees at {agree.mean():.0%} of steps"


def test_the_persistent_step_splits_shares_and_gives_the_per_operation_steps_tokens(cp, model):
    """float32, 128 tokens: the persistent step (the engine's default here) and the per-operation
    graphs, token for token; the plan splits some stage's share into several items (every size here
    in float32 on an H100 or H200)."""
    size, ckpt = model
    engine = persistent_engine(cp, ckpt, "float32")
    assert max(engine.plan.stage_items) > 1, f"{size}: {engine.plan}"
    graphs = fast.Engine(ckpt.params, ckpt.config, dtype="float32", keep_logits=True, persistent=False)
    want = graphs.generate(PROMPT, 128, attend=reference_attend, kv_cache=True)
    got = engine.generate(PROMPT, 128, attend=reference_attend, kv_cache=True)
    first = first_difference(got.tokens, want.tokens)
    if first is not None:  # the margin where they part: a near tie, or a fault
        gap = margins(cp, teacher_forced(cp, graphs, PROMPT, want.tokens[:first + 1])[-1:])[0]
        pytest.fail(f"{size}: persistent and per-operation tokens part at new token {first} ({engine.plan}); "
                    f"the per-operation step's top-two margin there is {gap:.2e} (a near tie if below ~1e-4)")


@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_the_persistent_step_follows_the_per_operation_step(cp, model, dtype):
    """Teacher-forced to the per-operation step's tokens, 40 steps: the logits within summation-order
    rounding (float32 1e-5 relative, bfloat16 5e-4, as for GPT-2 small in tests/test_fused_gpu.py), the
    same argmax wherever the top two are 1e-3 apart, the same position."""
    size, ckpt = model
    engine = persistent_engine(cp, ckpt, dtype)
    graphs = fast.Engine(ckpt.params, ckpt.config, dtype=dtype, keep_logits=True, persistent=False)
    follows_step_by_step(cp, engine, graphs, dtype, 40, f"{size} {dtype}")
