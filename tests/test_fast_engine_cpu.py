"""lm/engine.py's FastEngine on the CPU: a toy family's engine whose one-kernel decode step is NumPy
code, on a stand-in for CuPy's streams, graphs, events and pinned copies, so that the base's window
loop, decoding by graphs of steps, end-of-text stops, launch variants and measurements are checked
here; tests/test_fused_gpu.py and test_llama_fast_gpu.py run the real engines on the device."""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from lm.arena import Buffer
from lm.engine import EngineCache, FastEngine, Launch, prefetch_targets
from lm.errors import LabError
from lm.switch import Switch

V = 50  # the toy vocabulary


class DeviceArray(np.ndarray):
    """A NumPy array with what the engine asks of a CuPy one: .data.ptr and set(values, stream=)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)

    def set(self, values, stream=None):
        self[...] = values


class Pinned(bytearray):
    @property
    def ptr(self):
        return ctypes.addressof(ctypes.c_char.from_buffer(self))


class Stream:
    """Runs what is launched at once, or records it between begin_capture and end_capture."""

    ptr = 0

    def __init__(self, non_blocking=True):
        self.captured = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def begin_capture(self):
        self.captured = []

    def end_capture(self):
        graph, self.captured = Graph(self.captured), None
        return graph


class Graph:
    def __init__(self, calls):
        self.calls = calls
        self.replays = 0

    def upload(self, stream):
        pass

    def launch(self, stream):
        self.replays += 1
        for call in self.calls:
            call()


class Event:
    def __init__(self, block=True, disable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def fake_cupy():
    stream = Stream()

    def zeros(shape, dtype=np.float32):
        return np.zeros(shape, dtype).view(DeviceArray)

    def memcpy(dst, src, nbytes, kind, stream_ptr):
        ctypes.memmove(dst, src, nbytes)

    cuda = SimpleNamespace(Stream=lambda non_blocking=True: stream, get_current_stream=lambda: SimpleNamespace(
        record=lambda: Event()), alloc_pinned_memory=lambda n: Pinned(n), Event=Event,
        runtime=SimpleNamespace(memcpyAsync=memcpy, memcpyDeviceToHost=2),
        get_elapsed_time=lambda a, b: 1.0, Device=lambda: SimpleNamespace(compute_capability="80"))
    return SimpleNamespace(cuda=cuda, zeros=zeros, ndarray=DeviceArray, int32=np.int32, float32=np.float32)


class Kernel:
    """A launched function: run now, or recorded into the stream's capture."""

    def __init__(self, stream, body):
        self.stream, self.body = stream, body

    def __call__(self, grid, block, args, shared_mem=0):
        if self.stream.captured is not None:
            self.stream.captured.append(lambda: self.body(*args))
        else:
            self.body(*args)


def next_token(token: int, pos: int) -> int:
    return (7 * token + pos) % V


def step(state, history, x):  # the toy decode step: the next token from the last and its position
    token, pos = int(state[0]), int(state[1])
    history[pos + 1] = state[0] = next_token(token, pos)
    state[1] = pos + 1
    x[0] += 1


class ToyEngine(FastEngine):
    label = "toy"

    def __init__(self, max_len=64, steps_per_graph=4, pdl=None):
        cp = fake_cupy()
        super().__init__(cp, SimpleNamespace(vocab_size=V), "float32", max_len, steps_per_graph=steps_per_graph)
        self.params, self.weights = {}, SimpleNamespace(arrays=dict)  # no weights: the step reads none
        self.allocate([Buffer("x", 1, np.float32), Buffer("y", 1, np.float32),
                       Buffer("k_cache", (1, max_len, 2), np.float32)])
        self.v_cache = self.k_cache
        self.fn = {"step": Kernel(self.stream, step), "spin": Kernel(self.stream, lambda n: None)}
        self.choose_launches(True, pdl, persistent=None)

    attention_kind = "attn"

    def step_reads(self):  # what step_bytes counts: a layer's attention and matrix, and a head
        return [("embed", None), ("h.0.attn", None), ("h.0.proj", self.x), ("lm_head", self.y)]

    def _decode_launches(self, prefetch, pdl):
        return [Launch("step", self.fn["step"], (1,), (1,), (self.state, self.history, self.x))]

    def start(self, prompt, attend, *, kv_cache=True):
        T = len(prompt)
        self.history[:T] = prompt
        self.history[T] = self.state[0] = next_token(prompt[-1], T - 1)
        self.state[1] = T

    def _setup_persistent(self):
        return Switch.off("a toy")


def expected(prompt, n):
    tokens, pos = [], len(prompt) - 1
    token = prompt[-1]
    for _ in range(n):
        token = next_token(token, pos)
        tokens.append(token)
        pos += 1
    return tokens


@pytest.mark.parametrize("n_new", [1, 3, 4, 5, 13])
@pytest.mark.parametrize("graph", [True, False])
def test_generate_hands_over_every_window_s_tokens_in_order(n_new, graph):
    engine = ToyEngine()
    seen = []
    out = engine.generate([3, 9, 4], n_new, attend=None, on_token=seen.append, graph=graph)
    assert out.tokens == seen == expected([3, 9, 4], n_new) and not out.stopped_at_eos
    graphs = sum(g.replays for g in engine.graphs.values())
    assert graphs == ((n_new - 1) // 4 + (n_new - 1) % 4 if graph else 0)  # graphs of 4 steps, then single steps


def test_generate_stops_after_an_end_of_text_id():
    full = expected([1, 2], 20)
    eos = full[9]
    out = ToyEngine().generate([1, 2], 20, attend=None, eos_ids=(eos,))
    assert out.tokens == full[:full.index(eos) + 1] and out.stopped_at_eos


def test_generate_refuses_more_positions_than_the_engine_holds():
    with pytest.raises(LabError, match="exceed the engine's 64 positions"):
        ToyEngine().generate([1] * 60, 5, attend=None)
    with pytest.raises(LabError, match="runs with a KV cache only"):
        ToyEngine().generate([1, 2], 5, attend=None, kv_cache=False)


def test_launch_modes_are_switches():
    engine = ToyEngine()
    assert not engine.pdl and engine.pdl_note == "off (needs compute capability 9.0)"
    assert not engine.persistent and engine.persistent_note == "off (a toy)" and engine.window == 4
    assert ToyEngine(pdl=False).pdl_note == "off (asked)"
    with pytest.raises(RuntimeError, match="programmatic dependent launch does not work here"):
        ToyEngine(pdl=True)
    assert set(engine.graphs) == {(1, True, False), (4, True, False)}  # captured at construction
    assert engine.launches(prefetch=False) is not engine.launches() and engine.launches() is engine.launches()


def test_replay_and_profile_time_from_the_given_position():
    engine = ToyEngine()
    assert engine.replay_ms(10, 8) == 1.0 / 8  # the stand-in's events: 1 ms for the 8 steps
    assert int(engine.state[1]) == 10 + 8
    with pytest.raises(LabError, match="persistent step is off"):
        engine.replay_ms(10, 8, persistent=True)
    with pytest.raises(LabError, match="do not fit"):
        engine.replay_ms(60, 8)
    assert [name for name, _ in engine.profile_step(5)] == ["step"]


def test_arrays_are_the_engine_s_device_arrays():
    """Every buffer a view of the one arena, whose bytes (the padding between views too) are what the
    engine adds."""
    engine = ToyEngine()
    held = engine.arrays()
    assert any(a is engine.history for a in held) and any(a is engine.state for a in held)
    assert any(a is engine.arena.buffer for a in held)
    views = (engine.state, engine.history, engine.x, engine.y, engine.k_cache)
    assert engine.added_bytes() == engine.arena.nbytes
    assert engine.arena.nbytes >= sum(a.nbytes for a in views)
    assert [name for name, *_ in engine.arena.table()] == ["state", "history", "x", "y", "k_cache"]


def test_prefetch_targets_name_the_next_matrix_and_wrap():
    a, b = np.zeros(100, np.float32).view(DeviceArray), np.zeros(1 << 20, np.float32).view(DeviceArray)
    plan = [("embed", None), ("one", a), ("attn", None), ("two", b)]
    got = prefetch_targets(plan, True, 1 << 20, np.uint64(0))
    assert set(got) == {1, 3} and got[1] == (np.uint64(b.ctypes.data), np.uint64(1 << 20))
    assert got[3] == (np.uint64(a.ctypes.data), np.uint64(256))  # 400 bytes: whole 256-byte lines
    assert prefetch_targets(plan, False, 1 << 20, np.uint64(0))[1] == (np.uint64(0), np.uint64(0))


def test_the_engine_cache_keeps_the_newest_and_rebuilds_one_too_small():
    cache, built = EngineCache(2), []
    params = {"w": np.zeros(3, np.float32).view(DeviceArray)}

    def build(size):
        built.append(size)
        return SimpleNamespace(size=size)

    first = cache.get(lambda: build(1), params, "config", "float32", {})
    assert cache.get(lambda: build(2), params, "config", "float32", {}) is first and built == [1]
    bigger = cache.get(lambda: build(8), params, "config", "float32", {}, fits=lambda e: e.size >= 8)
    assert bigger.size == 8 and built == [1, 8]
    cache.get(lambda: build(3), params, "config", "bfloat16", {})
    cache.get(lambda: build(4), params, "config", "float32", {"pdl": False})
    assert cache.get(lambda: build(5), params, "config", "float32", {}).size == 5  # the oldest went


def test_the_engine_cache_finds_the_last_engine_by_its_arrays_identity():
    """The engine returned last, for params holding the very arrays it keeps, without the key's addresses;
    another array in their place (a new address), or other settings, through the key."""
    reads = []

    class Counted(DeviceArray):
        @property
        def data(self):
            reads.append(1)
            return SimpleNamespace(ptr=self.ctypes.data)

    cache, built = EngineCache(2), []
    params = {name: np.zeros(3, np.float32).view(Counted) for name in ("a", "b", "c")}

    def build(weights):
        built.append(weights)
        return SimpleNamespace(params=dict(weights))

    first = cache.get(lambda: build(params), params, "config", "float32", {})
    reads.clear()
    assert cache.get(lambda: build(params), dict(params), "config", "float32", {}) is first and not reads
    other = dict(params, b=np.zeros(3, np.float32).view(Counted))  # a new array (new address) for one name
    second = cache.get(lambda: build(other), other, "config", "float32", {})
    assert second is not first and len(reads) == 3 and len(built) == 2
    reads.clear()
    assert cache.get(lambda: build(params), params, "config", "float32", {}) is first and len(reads) == 3
    assert cache.get(lambda: build(params), params, "config", "bfloat16", {}) is not first and len(built) == 3
    cache.clear()
    reads.clear()
    cache.get(lambda: build(params), params, "config", "float32", {})
    assert len(reads) == 3 and len(built) == 4


@pytest.mark.parametrize("position", [0, 15, 62])
def test_step_bytes_counts_each_launchs_matrix_and_the_attentions_cache_up_to_the_position(position):
    """FastEngine.step_bytes: a matrix's bytes for the launch that reads it; for the attention one layer's
    keys and values at positions 0..position (the toy's cache: one layer of 64 positions x 2 floats, k
    and v the same buffer), nothing for a launch that reads no matrix."""
    engine = ToyEngine()
    cache = 2 * (position + 1) * 2 * 4
    assert engine.step_bytes(position) == [("embed", 0), ("h.0.attn", cache), ("h.0.proj", 4), ("lm_head", 4)]


def test_a_graph_without_a_kind_of_launch_leaves_the_others_and_the_step_s_graphs_alone():
    engine = ToyEngine()
    before = set(engine.graphs)
    assert engine.replay_ms(10, 8, drop={"step"}) == 1.0 / 8  # timed as ever
    assert int(engine.state[1]) == 10  # the step's one launch dropped: nothing advanced
    dropped = engine.graph(4, drop={"step"})
    assert dropped.calls == [] and dropped is not engine.graph(4) and set(engine.graphs) - before == {
        (4, True, False, frozenset({"step"}))}
    assert engine.graph(4, drop={"attn"}).calls != []  # a kind the step has none of: every launch stays
    with pytest.raises(LabError, match="only the graphs drop"):
        engine.replay_ms(10, 8, persistent=True, drop={"step"})
