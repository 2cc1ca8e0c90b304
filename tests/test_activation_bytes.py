"""The no-cache mode's memory bound counts one forward's activations analytically
(model.forward_activation_bytes, both families): against the peak of a NumPy forward's arrays
(tracemalloc), at lengths where the arrays outweigh the interpreter's own small objects."""

import tracemalloc

import numpy as np
import pytest

import gpt2
import llama
from gpt2.config import GPT2Config
from llama.config import LlamaConfig
from lm.attention import attention_bytes
from lm.generate import reference_attend
from lm.summary import MEMORY_FACTOR, MEMORY_HEADROOM, memory_figures, memory_rows

MODELS = {
    "gpt2": (gpt2, GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=160)),
    "llama": (llama, LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=96, max_position_embeddings=160)),
}


def measured_peak(family, params, config, T: int, last_only: bool) -> int:
    ids = np.arange(T)[None] % config.vocab_size
    family.forward(params, config, ids, reference_attend, last_only=last_only)  # caches filled first
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        family.forward(params, config, ids, reference_attend, last_only=last_only)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("T", [64, 97, 160])
@pytest.mark.parametrize("last_only", [True, False])
def test_the_count_bounds_a_numpy_forwards_peak_closely(name, T, last_only):
    family, config = MODELS[name]
    params = family.random_weights(config, seed=3).params
    peak = measured_peak(family, params, config, T, last_only)
    count = family.model.forward_activation_bytes(config, 1, T, "float32", reference=True, last_only=last_only)
    # at most the count (NumPy elides temporaries CuPy makes), and within 10% of it
    assert peak <= count <= 1.1 * peak, f"peak {peak} bytes, counted {count}"


@pytest.mark.parametrize("name", MODELS)
def test_the_count_grows_with_the_length_and_the_scores_are_the_references(name):
    family, config = MODELS[name]
    count = family.model.forward_activation_bytes
    ts = [1, 2, 17, 64, 160]
    for dtype in ("float32", "bfloat16"):
        ref = [count(config, 1, T, dtype, reference=True) for T in ts]
        rung = [count(config, 1, T, dtype, reference=False) for T in ts]
        assert ref == sorted(ref) and rung == sorted(rung) and all(r >= g for r, g in zip(ref, rung, strict=True))
    # the reference's three (B, NH, T, T) float32 score arrays dominate at length 160
    scores = 3 * config.n_head * 160 * 160 * 4
    assert count(config, 1, 160, "float32", reference=True) > scores


def test_attention_bytes_of_a_rung_are_its_copies_and_output():
    # q (1, 4, 5, 8) float32 over k, v (1, 2, 7, 8): q, k, v copied, the output its own
    assert attention_bytes(1, 4, 2, 5, 7, 8, 4, reference=False) == 4 * (4 * 5 * 8 + 2 * 2 * 7 * 8 + 4 * 5 * 8)
    # the reference: k and v repeated to 4 heads, three scores (4, 5, 7), the mask, O and P V
    assert attention_bytes(1, 4, 2, 5, 7, 8, 4, reference=True) == (2 * 4 * 4 * 7 * 8 + 3 * 4 * 4 * 5 * 7 + 5 * 7
                                                                    + 2 * 4 * 4 * 5 * 8)


def test_the_no_cache_bound_is_on_the_weights_and_activations():
    mib = 2**20
    f = memory_figures(peak=1301 * mib, used=1400 * mib, weight_bytes=475 * mib, kv_bytes=72 * mib,
                       engine_bytes=800 * mib, activation_bytes=820 * mib, activation_basis="one forward at T = 519")
    assert f["memory_bound_bytes"] == int(MEMORY_FACTOR * 1295 * mib + MEMORY_HEADROOM) and f["within_memory_bound"]
    assert f["kv_cache_bytes"] == 72 * mib and f["memory_bound_basis"] == "weights + one forward at T = 519"
    rows = dict(memory_rows({"peak_gpu_memory_bytes": 1301 * mib, **f}))
    assert rows["peak GPU memory"].startswith("1301.0 MiB = 1.00 x (weights 475.0 + activations 820.0 MiB)")
    assert rows["bound"].startswith("weights + one forward at T = 519")
    cached = memory_figures(peak=1301 * mib, used=1400 * mib, weight_bytes=475 * mib, kv_bytes=72 * mib)
    assert cached["memory_bound_basis"] == "weights + KV cache" and not cached["within_memory_bound"]
    assert "bound" not in dict(memory_rows({"peak_gpu_memory_bytes": 1301 * mib, **cached}))
