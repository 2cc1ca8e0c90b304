"""forward(..., last_only=True) runs the last layer's attention output and MLP on the last position
alone (its keys and values for every position): the logits must be the full forward's last row, and
a prefill's KV cache the same, for both families, on the CPU."""

import numpy as np
import pytest

import gpt2
import llama
from gpt2.config import GPT2Config
from llama.config import LlamaConfig
from lm.generate import reference_attend
from lm.kv_cache import KVCache

MODELS = {
    "gpt2": (gpt2, GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32)),
    "llama": (llama, LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)),
}
# the last row's arithmetic is the same; only the products' blocking over 1 row instead of T may differ
BOUND = {"float64": 1e-12, "float32": 16 * float(np.finfo(np.float32).eps)}


def weights(name: str, dtype: str):
    family, config = MODELS[name]
    params = family.random_weights(config, seed=3).params
    return family, config, {k: a.astype(dtype) for k, a in params.items()}


def relative_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


class Spy:
    """The reference attention, recording the query and key lengths it is given; with a rung's path
    (one without lab.supports cross), it is taken as that rung and is given every query row."""

    def __init__(self, path=None):
        self.lengths = []
        if path is not None:
            self.path = path

    def __call__(self, q, k, v):
        self.lengths.append((q.shape[2], k.shape[2]))
        return reference_attend(q, k, v)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", BOUND)
@pytest.mark.parametrize("T", [1, 2, 17])
def test_last_only_is_the_full_forwards_last_row(name, dtype, T):
    family, config, params = weights(name, dtype)
    ids = np.random.default_rng(T).integers(0, config.vocab_size, (2, T))
    full = family.forward(params, config, ids, reference_attend)  # (B, T, V)
    spy = Spy()
    last = family.forward(params, config, ids, spy, last_only=True)  # (B, 1, V)
    assert last.shape == (2, 1, config.vocab_size)
    assert spy.lengths == [(T, T), (1, T)]  # the last layer attends with the last query alone, over every key
    assert relative_err(last[:, 0], full[:, -1]) <= BOUND[dtype]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", BOUND)
@pytest.mark.parametrize("T", [1, 2, 17])
def test_a_prefills_cache_and_logits_are_the_untrimmed_ones(name, dtype, T):
    family, config, params = weights(name, dtype)
    ids = np.random.default_rng(T).integers(0, config.vocab_size, (1, T + 1))
    caches, steps = [], []
    for last_only in (False, True):
        cache = KVCache(config, 1, T + 1, dtype=dtype)
        prefill = family.forward(params, config, ids[:, :T], reference_attend, cache=cache, last_only=last_only)
        step = family.forward(params, config, ids[:, T:], reference_attend, cache=cache, last_only=last_only)
        caches.append(cache)
        steps.append((prefill[:, -1], step[:, -1]))
    (full_cache, cache), ((full_prefill, full_step), (prefill, step)) = caches, steps
    assert cache.length == full_cache.length == T + 1
    assert np.array_equal(cache.k, full_cache.k) and np.array_equal(cache.v, full_cache.v)  # every layer, every row
    assert relative_err(prefill, full_prefill) <= BOUND[dtype]
    assert relative_err(step, full_step) <= BOUND[dtype]


@pytest.mark.parametrize("name", MODELS)
def test_a_rung_without_short_queries_gets_every_query_row(name):
    import kernels

    family, config, params = weights(name, "float32")
    ids = np.arange(2 * 9).reshape(2, 9) % config.vocab_size
    full = family.forward(params, config, ids, reference_attend)
    spy = Spy(path=kernels.Attend("v08").path)  # v08 takes T_q == T_k only
    last = family.forward(params, config, ids, spy, last_only=True)
    assert spy.lengths == [(9, 9), (9, 9)]
    assert relative_err(last[:, 0], full[:, -1]) <= BOUND["float32"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_rung_declaring_cross_gets_one_query_only_once_switched_on(name, monkeypatch):
    """lm.attention.RUNGS_TAKE_ONE_QUERY (off until the eager paths' GPU tests have run with it): off, a
    rung that declares lab.supports cross attends over every row of the last layer; on, with one query."""
    import kernels
    from lm import attention

    family, config, params = weights(name, "float32")
    ids = np.arange(2 * 9).reshape(2, 9) % config.vocab_size
    full = family.forward(params, config, ids, reference_attend)
    assert "cross" in kernels.ladder.load(kernels.Attend("v13").path).supports
    for on, lengths in ((False, [(9, 9), (9, 9)]), (True, [(9, 9), (1, 9)])):
        monkeypatch.setattr(attention, "RUNGS_TAKE_ONE_QUERY", on)
        spy = Spy(path=kernels.Attend("v13").path)
        last = family.forward(params, config, ids, spy, last_only=True)
        assert spy.lengths == lengths
        assert relative_err(last[:, 0], full[:, -1]) <= BOUND["float32"]
