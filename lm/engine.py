"""What every fast engine shares (gpt2/fast, llama/fast): the token state and history, one arena for
every buffer (lm/arena.py), the decode step's launches in each variant (plain or programmatic dependent launches, with or without the L2 prefetch
hints) and their CUDA graphs, decoding, the generate window loop, and the step's measurements.

A family's engine subclasses FastEngine and supplies, as abstract methods, its decode step
(_decode_launches), its prefill (start) and whether it has a persistent decode step (_setup_persistent;
where it has, persistent_steps launches it). It may also supply the mode without a KV cache (recompute,
with reserve for its activations) and the objects beside it whose arrays it holds (parts)."""

from __future__ import annotations

import re
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from kernels import driver

from .arena import Arena, Buffer
from .arrays import held_bytes
from .bf16 import bf16_bits
from .errors import LabError
from .generate import Generation
from .measure import kind_of
from .switch import FAILED, ON, Switch, decide


def common_reason(weight, *, sampler, record_logits: bool) -> str | None:
    """Why no fast engine runs a generation, whatever the family (None if nothing here stops it): NumPy
    arrays (`weight`, one of the params), sampling, recorded logits."""
    if isinstance(weight, np.ndarray):
        return "NumPy arrays: the fast path runs on the GPU"
    if sampler is not None and sampler.temperature != 0:
        return "sampling: the fast path is greedy (argmax on the device)"
    if record_logits:
        return "recording logits: the fast path never writes them"
    return None


class EngineCache:
    """The engines built for sets of weights (by the arrays' addresses), the `size` most recently used
    kept: each holds a KV cache and views or copies of the weights, so after editing params in place,
    clear() it."""

    def __init__(self, size: int):
        self.size = size
        self._engines: OrderedDict = OrderedDict()
        self._last = None  # the key get() returned last

    def get(self, build, params: dict, config, dtype: str, options: dict, fits=None):
        """The engine for these weights, dtype and options: the one kept, unless fits(engine) says it is
        too small (then dropped first: its cache back to the pool), else build() now.

        The key names every array's address, dtype and shape: at GPT-2 XL's 580 arrays a third of a
        millisecond of Python, a twentieth of its first token. So the engine returned last is found first
        by identity: params holding the very arrays its engine keeps (engine.params, the dict it was built
        from, which keeps them alive: no address among them can have been freed and reused)."""
        settings = (config, dtype, tuple(sorted(options.items())))
        key = self._last
        if key is None or key[:3] != settings or not same_arrays(getattr(self._engines[key], "params", None), params):
            key = (*settings, tuple((name, a.data.ptr, a.dtype.str, a.shape) for name, a in sorted(params.items())))
        engine = self._engines.get(key)
        if engine is not None and fits is not None and not fits(engine):
            del self._engines[key], engine  # its cache back to the pool before the larger one is allocated
            engine = None
        if engine is None:
            self._last = None
            engine = self._engines[key] = build()
            while len(self._engines) > self.size:
                self._engines.popitem(last=False)
        self._engines.move_to_end(key)
        self._last = key
        return engine

    def clear(self) -> None:
        self._engines.clear()
        self._last = None


def same_arrays(held: dict | None, params: dict) -> bool:
    """Whether params maps the same names to the very objects held does."""
    return held is not None and len(held) == len(params) and all(held.get(name) is a for name, a in params.items())


@dataclass
class Launch:
    """One kernel launch with fixed arguments: the unit of the decode step. With pdl, launched through
    cuLaunchKernelEx with programmatic stream serialization on `stream` (see kernels/fused/common.cuh);
    with cluster, in thread-block clusters of those dimensions, through cuLaunchKernelEx on `stream`."""

    name: str
    fn: object
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int = 0
    pdl: bool = False
    stream: int = 0  # the CUstream handle of a pdl or cluster launch
    cluster: tuple | None = None  # thread-block cluster dimensions, None: no clusters
    _packed: object = field(default=None, repr=False, compare=False)  # cuLaunchKernelEx's arguments, packed on the first call

    def __call__(self):
        if not self.pdl and self.cluster is None:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)
            return
        if self._packed is None:  # packed on first use, after the engine sets pdl and stream
            self._packed = driver.PackedLaunch(self.fn, self.grid, self.block, self.args, shared_mem=self.shared_mem,
                                               stream=self.stream, pdl=self.pdl, cluster=self.cluster, name=self.name)
        self._packed()


def prefetch_targets(plan: list[tuple[str, object]], prefetch: bool, cap: int, null) -> dict[int, tuple]:
    """For a step's launches in order, (name, matrix read or None): the (address, bytes) of the matrix
    each launch that reads one asks L2 to prefetch, the next one read (the last wraps to the first), at
    most `cap` bytes in whole 256-byte lines; (null, 0) for each without prefetch."""
    with_matrix = [k for k, (_, m) in enumerate(plan) if m is not None]
    target = {}
    for a, b in zip(with_matrix, with_matrix[1:] + with_matrix[:1]):
        m = plan[b][1]
        target[a] = ((np.uint64(m.data.ptr), np.uint64(min(m.nbytes, cap) // 256 * 256)) if prefetch
                     else (null, np.uint64(0)))
    return target


class FastEngine(ABC):
    """A fast engine for one set of weights: `state` = {token, pos} (the decode step's only input),
    `history` (every token id, by position) and its pinned host copy, the stream everything runs on.
    The subclass allocates its buffers (allocate: state and history in the same arena) and compiles
    its kernels between __init__ (this one, first) and choose_launches (last); its decode step reads
    and writes x and y (the residual stream and the attention's output: what _check_pdl compares) and
    the caches k_cache and v_cache (positions on their next-to-last axis), and its fn holds the spin
    kernel profile_step queues first."""

    label = "fast engine"  # the family's fast path in messages: "gpt2.fast"

    def __init__(self, cp, config, dtype: str, max_len: int, *, steps_per_graph: int, steps_per_launch: int = 1):
        self.cp, self.config, self.dtype, self.max_len = cp, config, dtype, max_len
        self.steps_per_graph, self.steps_per_launch = steps_per_graph, steps_per_launch
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # the weights are written first
        self.pinned = cp.cuda.alloc_pinned_memory(4 * max_len)
        self.host_history = np.frombuffer(self.pinned, dtype=np.int32, count=max_len)

    def allocate(self, buffers: list[Buffer]) -> None:
        """The engine's device buffers in one arena on its stream, state and history first, each zeros
        unless its Buffer says otherwise and each an attribute of its name (self.x, self.k_cache, ...)."""
        with self.stream:
            self.arena = Arena(self.cp, [Buffer("state", 2, np.int32), Buffer("history", self.max_len, np.int32),
                                         *buffers])
        vars(self).update(self.arena)

    # -- what a family supplies ----------------------------------------------------------------------

    @abstractmethod
    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers, in one variant: it reads the token
        and its position from `state`, writes the next token into `history` and advances `state`."""

    @abstractmethod
    def step_reads(self) -> list[tuple[str, object]]:
        """The decode step's launches in order, (name, the matrix it reads, or None): what the L2
        prefetch hints chain and step_bytes counts. Layers' names start h.N.; the attention's kind
        (its name after h.N.) is the class's attention_kind."""

    def step_bytes(self, position: int) -> list[tuple[str, int]]:
        """The bytes each launch of the decode step at `position` must read: its matrix, or the
        attention's one layer of cached keys and values up to the position, else none counted (the
        embedding's row, the vectors)."""
        cache = (self.k_cache[0].nbytes + self.v_cache[0].nbytes) * (position + 1) // self.max_len  # one layer's
        attention = re.compile(rf"h\.\d+\.{re.escape(self.attention_kind)}$")
        return [(name, int(matrix.nbytes) if matrix is not None else cache if attention.match(name) else 0)
                for name, matrix in self.step_reads()]

    @abstractmethod
    def start(self, prompt: list[int], attend, *, kv_cache: bool = True) -> None:
        """Queue the prompt (the prefill, with `attend` as its attention): history[0:T] = prompt, then
        the first new token into history[T] and state = {it, T}."""

    @abstractmethod
    def _setup_persistent(self) -> Switch:
        """The decode step as one persistent launch, set up: on where it runs; off, with why, where it
        cannot or the family has none."""

    def persistent_steps(self, n: int, trace=None) -> None:
        """Queue n decode steps as one launch of the persistent step (a family that has one)."""
        raise LabError(f"the persistent step is {self.persistent_note}")

    def reserve(self, T: int) -> None:
        """Activations for whole-sequence passes of up to T positions (recompute's), allocated once."""
        return  # none by default: a family without recompute, or whose passes allocate their own

    def recompute(self, T: int, attend) -> None:
        """The mode without a KV cache: one pass over history[0:T], the next token into history[T]."""
        raise LabError("this fast engine runs with a KV cache only")

    def parts(self) -> list:
        """The objects beside the engine whose device arrays it holds (arrays() counts theirs)."""
        return []

    # -- launch variants and graphs ------------------------------------------------------------------

    def choose_launches(self, prefetch: bool, pdl: bool | None, persistent: bool | None) -> None:
        """The step's launch modes, each on where it works (see lm.switch.decide): programmatic dependent
        launch for the graphs (checked against plain launches) and the persistent step; the graphs of
        1 and steps_per_graph steps captured now, on an idle stream, and replayed from here on."""
        self.prefetch = prefetch
        self._variants: dict[tuple, list[Launch]] = {}
        self.graphs: dict[tuple, object] = {}
        self.step_launches = self.launches(prefetch, pdl=False)  # eager launches, and what profile_step times
        self.pdl_state = decide(pdl, self._check_pdl, "programmatic dependent launch")
        if self.pdl_state.kind == FAILED:
            warnings.warn(f"{self.label}: programmatic dependent launch disabled: {self.pdl_state.why}", stacklevel=3)
        for steps in sorted({1, self.steps_per_graph}):
            self.graph(steps)
        self.persistent_state = decide(persistent, self._setup_persistent, "the persistent decode step")
        self.window = self.steps_per_launch if self.persistent else self.steps_per_graph  # tokens per copy back

    @property
    def pdl(self) -> bool:
        return self.pdl_state.on

    @property
    def pdl_note(self) -> str:
        return str(self.pdl_state)

    @property
    def persistent(self) -> bool:
        return self.persistent_state.on

    @property
    def persistent_note(self) -> str:
        return str(self.persistent_state)

    def launches(self, prefetch: bool | None = None, pdl: bool | None = None) -> list[Launch]:
        """The decode step's launches in one variant (default: the engine's): with or without the L2
        prefetch hints, through plain launches or programmatic dependent launches."""
        key = (self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        if key not in self._variants:
            launches = self._decode_launches(*key)
            for launch in launches:
                launch.pdl, launch.stream = key[1], self.stream.ptr
            self._variants[key] = launches
        return self._variants[key]

    def graph(self, steps: int, prefetch: bool | None = None, pdl: bool | None = None, drop: frozenset = frozenset()):
        """A CUDA graph of `steps` decode steps in one launch variant (captured once, then kept); without
        the launches of the kinds in `drop` (by_kind's names: a measurement of what they cost in the
        graph, whose steps then compute nothing meaningful)."""
        key = (steps, self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        key += (frozenset(drop),) if drop else ()  # the step's graphs keep their (steps, prefetch, pdl)
        if key not in self.graphs:
            launches = [launch for launch in self.launches(*key[1:3]) if kind_of(launch.name) not in drop]
            with self.stream:
                self.stream.begin_capture()
                try:
                    for _ in range(steps):
                        for launch in launches:
                            launch()
                finally:
                    graph = self.stream.end_capture()
            graph.upload(self.stream)
            self.graphs[key] = graph
        return self.graphs[key]

    def _check_pdl(self) -> Switch:
        """One decode step from a fixed state, with random keys and values in the cache, launched plainly
        and replayed as a graph of programmatic dependent launches: on if both leave the same bits in x,
        y and state, else off with why not (the engine then keeps plain launches)."""
        cp = self.cp
        if int(cp.cuda.Device().compute_capability) < 90:
            return Switch.off("needs compute capability 9.0")
        pos, token = min(5, self.max_len - 2), min(123, self.config.vocab_size - 1)
        start = np.asarray([token, pos], dtype=np.int32)
        try:
            replayed = self.graph(1, pdl=True)  # captured first, on the idle stream
            results = []
            with self.stream:
                rng = cp.random.default_rng(0)
                for cache in (self.k_cache, self.v_cache):  # positions on the next-to-last axis
                    values = rng.standard_normal(cache[..., :pos, :].shape, dtype=cp.float32)
                    if cache.dtype == cp.float32:
                        cache[..., :pos, :] = values
                    else:  # bfloat16, or its bits
                        cache.view(cp.uint16)[..., :pos, :] = bf16_bits(cp, values)
                for pdl in (False, True):
                    self.state.set(start, stream=self.stream)
                    if pdl:
                        replayed.launch(self.stream)
                    else:
                        for launch in self.launches(pdl=False):
                            launch()
                    results.append((self.x.copy(), self.state.copy(), self.y.copy()))
            self.stream.synchronize()
        except Exception as exc:  # no cuLaunchKernelEx, a capture the driver refuses, ...
            return Switch.off(f"{type(exc).__name__}: {exc}", FAILED)
        if not all(bool((a == b).all()) for a, b in zip(*results, strict=True)):
            return Switch.off("a step replayed with it differed from plain launches", FAILED)
        return ON

    # -- decoding and generation ---------------------------------------------------------------------

    def decode(self, n: int, *, graph: bool = True) -> None:
        """Queue n decode steps on the engine's stream: one persistent launch of n steps where the engine
        is persistent, else graphs of steps_per_graph steps, then single steps (graph=False: the
        per-operation kernels launched one by one, plainly)."""
        with self.stream:
            if not graph:
                for _ in range(n):
                    for launch in self.step_launches:
                        launch()
                return
            if self.persistent:
                self.persistent_steps(n)
                return
            big, small = self.graph(self.steps_per_graph), self.graph(1)
            for _ in range(n // self.steps_per_graph):
                big.launch(self.stream)
            for _ in range(n % self.steps_per_graph):
                small.launch(self.stream)

    def generate(self, prompt: list[int], n_new: int, *, attend, kv_cache: bool = True, eos_ids=(), on_token=None,
                 graph: bool = True) -> Generation:
        """n_new greedy tokens after prompt; stops after any of eos_ids. The GPU runs a window of
        self.window tokens ahead of the host, which hands the previous window's tokens to on_token as
        they arrive."""
        T0 = len(prompt)
        if T0 + n_new > self.max_len:
            raise LabError(f"{T0} prompt tokens + {n_new} new tokens exceed the engine's {self.max_len} positions")
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())  # after whatever the caller queued
        out = Generation(tokens=[])
        if not kv_cache:  # every step a pass over the whole sequence: activations for the longest, once
            self.reserve(T0 + n_new - 1)
        with self.stream:
            self.start(prompt, attend, kv_cache=kv_cache)
            pending = deque([self._copy_back(T0, 1)])
            produced = 1
            while pending:
                if produced < n_new:  # queue the next window before waiting for the previous one
                    count = min(self.window, n_new - produced)
                    self._advance(T0 + produced, count, attend, kv_cache=kv_cache, graph=graph)
                    pending.append(self._copy_back(T0 + produced, count))
                    produced += count
                event, first, count = pending.popleft()
                event.synchronize()
                if self._hand_over(out, self.host_history[first:first + count].tolist(), eos_ids, on_token):
                    break
        self.stream.synchronize()  # queued windows past an end-of-text finish before the next use
        return out

    def _advance(self, position: int, count: int, attend, *, kv_cache: bool, graph: bool) -> None:
        """Queue the tokens at position .. position + count - 1."""
        if kv_cache:
            self.decode(count, graph=graph)
            return
        for j in range(count):
            self.recompute(position + j, attend)

    @staticmethod
    def _hand_over(out: Generation, tokens: list[int], eos_ids, on_token) -> bool:
        """Append a window's tokens to out, each to on_token; True (stopped) after one of eos_ids."""
        for token in tokens:
            out.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos_ids:
                out.stopped_at_eos = True
                return True
        return False

    def _copy_back(self, first: int, count: int):
        """Queue history[first:first + count] -> pinned host memory; the event that says it is there."""
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.pinned.ptr + 4 * first, self.history.data.ptr + 4 * first, 4 * count,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return event, first, count

    # -- measuring -----------------------------------------------------------------------------------

    def replay_ms(self, position: int, steps: int = 64, *, prefetch: bool | None = None, pdl: bool | None = None,
                  persistent: bool | None = None, repeats: int = 5, drop: frozenset = frozenset()) -> float:
        """Milliseconds per decode step from `position` as generate() runs them (median of `repeats` runs
        of `steps` steps): persistent launches of up to steps_per_launch steps where the engine is
        persistent (persistent=False: the per-operation graphs), else replays of graphs of
        steps_per_graph steps (`steps` rounded down to whole graphs), in a launch variant (default: the
        engine's; `drop`: graphs without those kinds of launch, as graph() makes them)."""
        cp = self.cp
        if persistent is None:  # the engine's step, unless a graph variant is asked for
            persistent = self.persistent and prefetch is None and pdl is None and not drop
        if persistent and drop:
            raise LabError("drop: the persistent step is one kernel; only the graphs drop launches")
        if persistent and not self.persistent:
            raise LabError(f"the persistent step is {self.persistent_note}")
        if not persistent:
            steps = steps // self.steps_per_graph * self.steps_per_graph
        if steps < 1 or position + steps >= self.max_len:
            raise LabError(f"{steps} steps from position {position} do not fit the engine's {self.max_len} positions")
        big = None if persistent else self.graph(self.steps_per_graph, prefetch, pdl, drop)
        start = np.asarray([0, position], dtype=np.int32)
        times = []
        with self.stream:
            before, after = cp.cuda.Event(), cp.cuda.Event()
            for _ in range(repeats + 1):  # the first run warms up
                self.state.set(start, stream=self.stream)
                before.record(self.stream)
                if persistent:
                    for first in range(0, steps, self.steps_per_launch):
                        self.persistent_steps(min(self.steps_per_launch, steps - first))
                else:
                    for _ in range(steps // self.steps_per_graph):
                        big.launch(self.stream)
                after.record(self.stream)
                after.synchronize()
                times.append(cp.cuda.get_elapsed_time(before, after) / steps)
        return float(np.median(times[1:]))

    def profile_step(self, position: int, repeats: int = 20) -> list[tuple[str, float]]:
        """Milliseconds of each kernel of one decode step at `position` (median of `repeats`), timed
        with events around each launch, the kernels queued behind a spin kernel so that they run
        back to back. Changes state, history and the cache at `position`: run generate() again after."""
        cp = self.cp
        if not 0 <= position < self.max_len - 1:
            raise LabError(f"position {position} outside the engine's 0..{self.max_len - 2}")
        n = len(self.step_launches)
        times = np.zeros((repeats, n))
        start = np.asarray([0, position], dtype=np.int32)
        with self.stream:
            events = [cp.cuda.Event() for _ in range(n + 1)]
            for r in range(repeats):
                self.state.set(start, stream=self.stream)
                self.fn["spin"]((1,), (1,), (np.int64(5_000_000),))  # 5 ms: the host queues the whole step
                events[0].record(self.stream)
                for i, launch in enumerate(self.step_launches):
                    launch()
                    events[i + 1].record(self.stream)
                self.stream.synchronize()
                times[r] = [cp.cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(n)]
        return list(zip([launch.name for launch in self.step_launches], np.median(times, axis=0).tolist(), strict=True))

    def arrays(self) -> list:
        """Every device array the engine holds, found through its attributes and its parts' (and the
        lists, tuples, dicts, arenas and DecodeWeights in them), the caller's params aside: views of
        params among them."""
        found = []
        todo = [value for name, value in vars(self).items() if name != "params"]
        todo += [value for part in self.parts() for value in vars(part).values()]
        while todo:
            value = todo.pop()
            if isinstance(value, self.cp.ndarray):
                found.append(value)
            elif isinstance(value, Arena):  # the whole allocation: the padding between its views too
                found.append(value.buffer)
            elif isinstance(value, dict):
                todo += value.values()
            elif isinstance(value, (list, tuple)):
                todo += value
            elif value is self.weights:
                todo.append(value.arrays())
        return found

    def added_bytes(self) -> int:
        """Device bytes the engine holds beside its params (each byte once): with params in the run's
        dtype and the family's decode layout, no copy of a matrix but what the family's step makes."""
        return held_bytes(self.arrays(), besides=list(self.params.values()))
