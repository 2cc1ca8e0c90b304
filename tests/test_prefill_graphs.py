"""gpt2.fast.sequence's graphed prefill (PREFILL_GRAPHS), its bookkeeping on the CPU: which pass runs
eagerly, which is captured, which replays, over how many rows. The passes themselves (a graph's
logits against the eager pass's, the tokens after it) are tests/test_fused_gpu.py's -k prefill_graph."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2.fast.sequence as sequence
from gpt2.fast.sequence import WholeSequence


class Recorder:
    """A WholeSequence whose kernels are calls recorded: layers, head and captures."""

    def __init__(self, monkeypatch, max_len=1024, capturable=True):
        monkeypatch.setattr(sequence, "launcher", lambda attend, q, k, v: ("prepared", attend, q.shape[2]))
        self.calls = []
        whole = WholeSequence.__new__(WholeSequence)
        whole.engine = SimpleNamespace(cp=np, stream=contextlib.nullcontext(), max_len=max_len, dtype="float32",
                                       config=SimpleNamespace(n_embd=8, n_head=2, head_size=4, mlp_width=32))
        whole.products, whole.rows, whole.work, whole.graphs, whole.seen = "cublas", 0, {}, {}, set()
        whole.layers = lambda T, run_attention, **kw: self.calls.append(("layers", T, run_attention[2], kw["last_row"]))
        whole.head = lambda T: self.calls.append(("head", T))

        def capture(rows, attend):
            self.calls.append(("capture", rows))
            return SimpleNamespace(launch=lambda stream: self.calls.append(("replay", rows))) if capturable else None

        whole._capture = capture
        self.whole = whole

    def prefill(self, T, attend="v24"):
        self.calls.clear()
        self.whole.run(T, attend, store_kv=True)
        return list(self.calls)


def test_without_prefill_graphs_each_prefill_runs_eagerly_over_its_own_rows(monkeypatch):
    monkeypatch.setattr(sequence, "PREFILL_GRAPHS", False)
    r = Recorder(monkeypatch)
    for _ in range(3):
        assert r.prefill(97) == [("layers", 97, 97, 96), ("head", 97)]


def test_a_bucket_runs_eagerly_first_then_is_captured_then_replays(monkeypatch):
    """A bucket's first prompt runs eagerly over the bucket's rows (compiling, cuBLAS choosing), its second
    is captured and launched, every later one replays; the head always reads the prompt's own last row."""
    monkeypatch.setattr(sequence, "PREFILL_GRAPHS", True)
    r = Recorder(monkeypatch)
    assert r.prefill(100) == [("layers", 128, 128, None), ("head", 100)]
    assert r.prefill(117) == [("capture", 128), ("replay", 128), ("head", 117)]
    assert r.prefill(128) == [("replay", 128), ("head", 128)]
    assert r.prefill(1) == [("replay", 128), ("head", 1)]
    assert r.prefill(129) == [("layers", 256, 256, None), ("head", 129)]  # the next bucket: its own
    assert r.prefill(1000) == [("layers", 1024, 1024, None), ("head", 1000)]
    assert r.prefill(1000, attend="v20") == [("layers", 1024, 1024, None), ("head", 1000)]  # another rung: its own


@pytest.mark.parametrize("T, rows", [(1, 128), (128, 128), (129, 200), (190, 200), (200, 200)])
def test_the_bucket_stays_within_the_engines_positions(monkeypatch, T, rows):
    r = Recorder(monkeypatch, max_len=200)
    assert r.whole.prefill_rows(T) == rows


def test_an_attention_that_cannot_be_captured_runs_eagerly_and_is_tried_once(monkeypatch):
    monkeypatch.setattr(sequence, "PREFILL_GRAPHS", True)
    r = Recorder(monkeypatch, capturable=False)
    r.prefill(50)
    assert r.prefill(50) == [("capture", 128), ("layers", 128, 128, None), ("head", 50)]
    assert r.prefill(60) == [("layers", 128, 128, None), ("head", 60)]


def test_regrown_work_buffers_drop_the_graphs_that_read_the_old_ones(monkeypatch):
    """reserve() for a longer pass allocates new buffers: the graphs captured on the old ones go."""
    monkeypatch.setattr(sequence, "PREFILL_GRAPHS", True)
    r = Recorder(monkeypatch)
    r.whole.reserve = WholeSequence.reserve.__get__(r.whole)
    r.prefill(100)
    r.prefill(100)
    assert r.prefill(100) == [("replay", 128), ("head", 100)]
    r.prefill(300)  # the buffers grow to 384 rows
    assert r.whole.rows == 384 and r.whole.graphs == {}
    assert r.prefill(100) == [("layers", 128, 128, None), ("head", 100)]  # eager again, then captured anew
    assert r.prefill(100) == [("capture", 128), ("replay", 128), ("head", 100)]
