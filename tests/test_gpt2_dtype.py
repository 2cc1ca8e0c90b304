"""GPT-2 with 16-bit weights: cast once (gpt2.model.cast_params), products and attention in the
weights' dtype, residual stream, LayerNorm, GELU and logits in float32.

CPU: NumPy with the reference attention (its low-precision recipe). GPU: bfloat16 generation with the
v15 rung against float32 generation with the reference attention, on random weights.

The GPU criterion. Random GPT-2 weights give logits of standard deviation about 0.3 whose top two are
often close. Casting the weights to bfloat16 moves the logits by at most about 0.011 and the top-two
margin by at most 0.008 (measured on the CPU for this model, with every product rounded to bfloat16
as cuBLAS returns it), so only a step whose float32 top-two margin is below MARGIN = 0.02 may pick
another token. Hence: (1) over the float32 run's whole sequence
(teacher forcing), the bfloat16 model's argmax equals float32's at every position with a margin of at
least MARGIN, and at 90% of all positions; (2) generated freely, the bfloat16 tokens equal the float32
tokens up to the first step with a margin below MARGIN, and the prompt is chosen so that there are at
least MIN_CLEAR such steps.
"""

import numpy as np
import pytest

import kernels
from gpt2 import GPT2Config, forward, generate, reference_attend
from gpt2.load import random_weights
from gpt2.model import KVCache, cast_params, compute_dtype

CONFIG = GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=50257, n_positions=256)  # head size 64
MARGIN = 0.02
MIN_CLEAR = 8
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


@pytest.fixture(scope="module")
def checkpoint():
    return random_weights(CONFIG, seed=3)


def ids(T, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (1, T))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cast_params_casts_every_parameter_once(checkpoint, dtype):
    cast = cast_params(checkpoint.params, dtype)
    assert set(cast) == set(checkpoint.params)
    assert all(a.dtype.name == dtype and a.shape == checkpoint.params[k].shape for k, a in cast.items())
    assert compute_dtype(cast).name == dtype
    if dtype == "float32":
        assert all(cast[k] is checkpoint.params[k] for k in cast)  # nothing copied


def test_cast_params_refuses_other_dtypes(checkpoint):
    with pytest.raises(ValueError, match="float64: the model runs float32, float16 or bfloat16"):
        cast_params(checkpoint.params, "float64")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_forward_keeps_float32_where_the_model_needs_it(checkpoint, dtype):
    """q, k, v reach the attention in the weights' dtype; the logits come back float32 and within a
    few epsilons of the dtype (times the logits' scale) of the float32 model's."""
    seen = []

    def spy(q, k, v):
        seen.append((q.dtype.name, k.dtype.name, v.dtype.name))
        return reference_attend(q, k, v)

    x = ids(40)
    logits = forward(cast_params(checkpoint.params, dtype), CONFIG, x, spy)
    exact = forward(checkpoint.params, CONFIG, x, reference_attend)
    assert logits.dtype == np.float32 and logits.shape == exact.shape
    assert seen == [(dtype, dtype, dtype)] * CONFIG.n_layer
    err = float(np.abs(logits - exact).max())
    assert 0 < err < 8 * EPS[dtype] * float(np.abs(exact).max()), err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_kv_cache_matches_the_full_forward(checkpoint, dtype):
    params = cast_params(checkpoint.params, dtype)
    x = ids(24, seed=1)
    full = forward(params, CONFIG, x, reference_attend)
    cache = KVCache(CONFIG, 1, 24, dtype=compute_dtype(params))
    assert cache.k.dtype.name == dtype
    pieces = [forward(params, CONFIG, x[:, :20], reference_attend, cache=cache)]
    pieces += [forward(params, CONFIG, x[:, t:t + 1], reference_attend, cache=cache) for t in range(20, 24)]
    stepped = np.concatenate(pieces, axis=1)
    # the same products in another grouping: equal up to the dtype's rounding of k, v and P
    assert float(np.abs(stepped - full).max()) < 4 * EPS[dtype] * float(np.abs(full).max())


@pytest.mark.parametrize("kv_cache", [False, True])
def test_16_bit_generation_runs_in_both_modes(checkpoint, kv_cache):
    params = cast_params(checkpoint.params, "float16")
    out = generate(params, CONFIG, [15496, 11, 314], 6, attend=reference_attend, kv_cache=kv_cache, fast=False,
                   record_logits=True)
    assert len(out.tokens) == 6 and all(row.dtype == np.float32 for row in out.logits)


def margins(logits):
    top2 = np.sort(np.asarray(logits, np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", [False, True], ids=["no-cache", "kv-cache"])
def test_bfloat16_generation_with_v15_follows_float32(kv_cache):
    import cupy

    def v15(q, k, v):
        return kernels.attention(q, k, v, kernel="v15")

    ckpt = random_weights(CONFIG, seed=3, xp=cupy)
    bf16 = cast_params(ckpt.params, "bfloat16")
    for seed in range(40):  # a prompt whose first MIN_CLEAR float32 steps are clear of near ties
        prompt = ids(16, seed=seed)[0].tolist()
        ref = generate(ckpt.params, CONFIG, prompt, 48, attend=reference_attend, fast=False, record_logits=True)
        step_margins = margins(cupy.asnumpy(cupy.stack(ref.logits)))
        clear = int(np.argmax(step_margins < MARGIN)) if (step_margins < MARGIN).any() else len(step_margins)
        if clear >= MIN_CLEAR:
            break
    else:
        raise AssertionError(f"no prompt gave {MIN_CLEAR} float32 steps clear of near ties")

    # (1) teacher forcing over the float32 run's sequence
    sequence = cupy.asarray([prompt + ref.tokens])
    logits32 = cupy.asnumpy(forward(ckpt.params, CONFIG, sequence, reference_attend)[0, len(prompt) - 1:])
    logits16 = forward(bf16, CONFIG, sequence, v15)[0, len(prompt) - 1:]
    assert logits16.dtype == cupy.float32
    agree = cupy.asnumpy(logits16.argmax(axis=-1)) == logits32.argmax(axis=-1)
    clear_positions = margins(logits32) >= MARGIN
    assert agree[clear_positions].all(), f"argmax differs at clear positions {np.flatnonzero(clear_positions & ~agree)}"
    assert agree.mean() >= 0.9, f"argmax agrees at {agree.mean():.0%} of positions"

    # (2) free generation, through v15 in every step (no cache) or in the prefill (cache)
    out = generate(bf16, CONFIG, prompt, 48, attend=v15, kv_cache=kv_cache, fast=False)
    assert out.tokens[:clear] == ref.tokens[:clear], (out.tokens, ref.tokens, clear)
