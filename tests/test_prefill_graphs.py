"""lm.prefill_graph (PREFILL_GRAPHS) on the CPU: the buckets, which pass runs eagerly, which is captured,
which replays, in gpt2.fast's whole-sequence pass with its kernels recorded. The passes themselves (a
graph's logits against the eager pass's, the tokens after it) are the GPU tests' -k prefill_graph
(tests/test_fused_gpu.py, tests/test_llama_fast_gpu.py); Llama's padded pass is checked on NumPy in
tests/test_llama_fast_cpu.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2.fast.sequence as sequence
from gpt2.fast.sequence import WholeSequence
from lm import prefill_graph
from lm.prefill_graph import PrefillGraphs, bucket_rows

LAST = ("y", "bias")  # what the stand-in passes return: the residual the head adds


class Recorder:
    """A WholeSequence whose kernels, prepares and captures are calls recorded; the head checks that it
    gets the residual its pass returned (eager, or the captured pass's through the graph)."""

    def __init__(self, monkeypatch, max_len=1024, capturable=True):
        monkeypatch.setattr(sequence, "launcher", lambda attend, q, k, v: ("prepared", attend, q.shape[2]))
        calls = self.calls = []

        class Graph:  # stands in for PassGraph: prepares, "captures" the pass (nothing runs), replays
            def __init__(self, cp, stream, passes, prepare):
                calls.append(("capture", prepare()[2]))
                if not capturable:
                    raise RuntimeError("operation not permitted when stream is capturing")
                self.out = LAST

            def launch(self, stream):
                calls.append(("replay",))

        monkeypatch.setattr(sequence, "PassGraph", Graph)
        whole = WholeSequence.__new__(WholeSequence)
        whole.engine = SimpleNamespace(cp=np, stream=contextlib.nullcontext(), max_len=max_len, dtype="float32",
                                       config=SimpleNamespace(n_embd=8, n_head=2, head_size=4, mlp_width=32))
        whole.products, whole.rows, whole.work, whole.prefills = "cublas", 0, {}, PrefillGraphs()
        whole.layers = lambda T, run_attention, **kw: calls.append(("layers", T, run_attention[2], kw["tail"])) or LAST

        def head(T, residual):
            assert residual is LAST
            calls.append(("head", T))

        whole.head = head
        self.whole = whole

    def prefill(self, T, attend="v24"):
        self.calls.clear()
        self.whole.run(T, attend, store_kv=True)
        return list(self.calls)


def test_without_prefill_graphs_each_prefill_runs_eagerly_over_its_own_rows(monkeypatch):
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", False)
    r = Recorder(monkeypatch)
    for _ in range(3):
        assert r.prefill(97) == [("layers", 97, 97, 1), ("head", 97)]


def test_a_bucket_runs_eagerly_first_then_is_captured_then_replays(monkeypatch):
    """A bucket's first prompt runs eagerly over the bucket's rows (compiling, cuBLAS choosing), its second
    is captured and launched, every later one replays; the head always reads the prompt's own last row."""
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", True)
    monkeypatch.setattr(prefill_graph, "PREFILL_BUCKET", 128)  # the mechanism at a bucket of 128 rows
    r = Recorder(monkeypatch)
    assert r.prefill(100) == [("layers", 128, 128, 128), ("head", 100)]
    assert r.prefill(117) == [("capture", 128), ("replay",), ("head", 117)]
    assert r.prefill(128) == [("replay",), ("head", 128)]
    assert r.prefill(1) == [("replay",), ("head", 1)]
    assert r.prefill(129) == [("layers", 256, 256, 128), ("head", 129)]  # the next bucket: its own
    assert r.prefill(1000) == [("layers", 1024, 1024, 128), ("head", 1000)]
    assert r.prefill(1000, attend="v20") == [("layers", 1024, 1024, 128), ("head", 1000)]  # another rung: its own


@pytest.mark.parametrize("T, rows", [(1, 128), (128, 128), (129, 200), (190, 200), (200, 200)])
def test_the_bucket_stays_within_the_engines_positions(monkeypatch, T, rows):
    monkeypatch.setattr(prefill_graph, "PREFILL_BUCKET", 128)
    assert bucket_rows(T, 200) == rows
    assert bucket_rows(T, 4096) == -(-T // 128) * 128


@pytest.mark.parametrize("T, rows", [(1, 8), (8, 8), (9, 16), (97, 104), (1000, 1000), (1021, 1024)])
def test_the_default_bucket_pads_at_most_7_rows(T, rows):
    assert bucket_rows(T, 1024) == rows


def test_an_engine_keeps_its_most_recently_launched_graphs(monkeypatch):
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS_KEPT", 2)
    graphs, made = PrefillGraphs(), []

    def capture(key):
        made.append(key)
        return key

    def launch(key):
        return graphs.get(key, lambda: capture(key))

    for key in ("a", "b"):
        assert launch(key) is None and launch(key) == key  # the first pass eager, the second captured
    assert launch("a") == "a"  # replayed: now the most recent
    assert launch("c") is None and launch("c") == "c"  # a third: "b", the least recently launched, goes
    assert list(graphs.graphs) == ["a", "c"] and made == ["a", "b", "c"]
    assert launch("b") == "b" and made[-1] == "b"  # seen before: captured again at once
    assert list(graphs.graphs) == ["c", "b"]


def test_an_attention_that_cannot_be_captured_runs_eagerly_and_is_tried_once(monkeypatch):
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", True)
    monkeypatch.setattr(prefill_graph, "PREFILL_BUCKET", 128)
    r = Recorder(monkeypatch, capturable=False)
    r.prefill(50)
    with pytest.warns(UserWarning, match="could not be captured"):
        assert r.prefill(50) == [("capture", 128), ("layers", 128, 128, 128), ("head", 50)]
    assert r.prefill(60) == [("layers", 128, 128, 128), ("head", 60)]


def test_regrown_work_buffers_drop_the_graphs_that_read_the_old_ones(monkeypatch):
    """reserve() for a longer pass allocates new buffers: the graphs captured on the old ones go."""
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", True)
    monkeypatch.setattr(prefill_graph, "PREFILL_BUCKET", 128)
    r = Recorder(monkeypatch)
    r.whole.reserve = WholeSequence.reserve.__get__(r.whole)
    r.prefill(100)
    r.prefill(100)
    assert r.prefill(100) == [("replay",), ("head", 100)]
    r.prefill(300)  # the buffers grow to 384 rows
    assert r.whole.rows == 384 and r.whole.prefills.graphs == {}
    assert r.prefill(100) == [("layers", 128, 128, 128), ("head", 100)]  # eager again, then captured anew
    assert r.prefill(100) == [("capture", 128), ("replay",), ("head", 100)]


class ReplayedPass:
    """Stands in for PassGraph on NumPy: the "capture" keeps the pass, each launch runs it again (as a
    replay rewrites the graph's output in place)."""

    captures = 0

    def __init__(self, cp, stream, passes, prepare=lambda: None):
        ReplayedPass.captures += 1
        self.passes, self.prepared, self.out = passes, prepare(), None

    def launch(self, stream):
        self.out = self.passes(self.prepared)


def llama_engine(T_max=300):
    """llama.fast.Engine's prefill on NumPy: a tiny model's params, its history and a KV cache."""
    import llama
    import llama.fast.engine as engine_mod
    from lm.generate import reference_attend
    from lm.kv_cache import KVCache

    config = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False,
                               max_position_embeddings=512)
    params = llama.random_weights(config, seed=3).params
    engine = engine_mod.Engine.__new__(engine_mod.Engine)
    engine.cp, engine.stream, engine.config, engine.params = np, contextlib.nullcontext(), config, params
    engine.max_len, engine.prefills = T_max, PrefillGraphs()
    engine.history = np.zeros(T_max, dtype=np.int32)
    engine.cache = KVCache(config, 1, T_max, np, np.float32)
    return engine, config, params, reference_attend


@pytest.mark.parametrize("T", [1, 17, 97, 128, 257])
def test_llamas_graphed_prefill_is_the_unpadded_prefill_on_numpy(monkeypatch, T):
    """llama.fast.Engine.prefill with PREFILL_GRAPHS, its graph run eagerly on NumPy: over the bucket's
    rows (the last layer over every row), then row T - 1. The logits of that row, the cache's first T
    positions and the cache's length are the unpadded eager prefill's; and a decode step after it
    (the eager model on the cache) gives the same logits, the padding's positions written before read."""
    import llama.fast.engine as engine_mod
    from llama.model import forward, logits_of

    monkeypatch.setattr(engine_mod, "PassGraph", ReplayedPass)
    engine, config, params, attend = llama_engine()
    prompt = np.random.default_rng(T).integers(0, config.vocab_size, T)
    engine.history[:] = np.random.default_rng(0).integers(0, config.vocab_size, engine.max_len)  # stale ids
    engine.history[:T] = prompt

    def prefill_and_step(graphs):
        monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", graphs)
        engine.cache.k[...] = np.nan  # a position nobody wrote reads as NaN
        engine.cache.v[...] = np.nan
        logits = logits_of(params, config, engine.prefill(T, attend))[0, -1]
        assert engine.cache.length == T
        cached = engine.cache.k[:, :, :, :T].copy(), engine.cache.v[:, :, :, :T].copy()
        step = forward(params, config, np.array([[7]]), attend, cache=engine.cache)[0, -1]
        return logits, cached, step

    plain, plain_cache, plain_step = prefill_and_step(False)
    ReplayedPass.captures = 0
    for run in range(3):  # eager over the bucket, then captured and launched, then replayed
        logits, cache, step = prefill_and_step(True)
        assert ReplayedPass.captures == (0 if run == 0 else 1)
        np.testing.assert_allclose(logits, plain, rtol=1e-5, atol=1e-5)
        for got, want in zip(cache, plain_cache, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(step, plain_step, rtol=1e-5, atol=1e-5)
