"""Llama's fast engine: for one set of weights and a run's length, the weights as the kernels read them,
the static KV cache, the activations, the decode step (its launches and graphs), the prefill, generation
and the step's measurements. See llama/fast's docstring for how a decode step runs."""

from __future__ import annotations

import math
import warnings
from collections import deque

import numpy as np

from gpt2.fast.engine import _switch
from gpt2.fast.launch import DecodeGraphs, Launch
from gpt2.fast.weights import bf16_bits
from kernels import driver, fused
from lm.arrays import held_bytes
from lm.errors import LabError
from lm.generate import Generation
from lm.kv_cache import KVCache

from ..config import LlamaConfig
from ..model import forward, rope_tables
from .plan import (
    ATTENTION_WARPS,
    DEFAULT_POSITIONS,
    GEMV_WARPS,
    NULL,
    PREFETCH_CAP,
    STEPS_PER_GRAPH,
    attention_plan,
    cache_positions,
    gemv_grid,
    kernel_expressions,
    matrices,
    param_dtype,
    unsupported_reason,
)
from .weights import decode_weights

STEP_KINDS = ("rms+qkv+rope+kv_store", "gqa_attention", "o_proj+residual", "rms+gate_up+silu", "down_proj+residual")


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


class Engine(DecodeGraphs):
    """Everything the fast path needs for one set of weights, allocated once: the weights as its kernels
    read them (views of params laid out by decode_layout, else copies), the static KV cache of max_len
    positions (the run's, not the model's 131,072), activations, the decode step's launches and graphs."""

    def __init__(self, params: dict, config: LlamaConfig, *, dtype: str | None = None, max_len: int | None = None,
                 prefetch: bool = True, pdl: bool | None = None, steps_per_graph: int = STEPS_PER_GRAPH,
                 keep_logits: bool = False):
        import cupy as cp

        import kernels

        self.cp, self.config = cp, config
        self.dtype = dtype or param_dtype(params)
        why = unsupported_reason(params, config, kv_cache=True, dtype=self.dtype)
        if why is not None:
            raise LabError(f"the fast path cannot run this model: {why}")
        self.max_len = max_len or cache_positions(min(DEFAULT_POSITIONS, config.n_positions), config)
        if not 2 <= self.max_len <= config.n_positions:
            raise LabError(f"max_len {self.max_len}: the engine holds 2 to {config.n_positions} positions")
        limits = kernels.device_limits()
        self.sm_count = limits.sm_count
        widest = max(m.K for m in matrices(config).values())
        if 4 * widest > limits.max_shared_per_block:
            raise LabError(f"rms_gemv stages {4 * widest} bytes of input in shared memory; the device has "
                           f"{limits.max_shared_per_block}")
        self.steps_per_graph = steps_per_graph
        self.stream = cp.cuda.Stream(non_blocking=True)
        C, NH, NKV, HS = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_size
        bf16 = self.dtype == "bfloat16"
        self.eps = np.float32(config.rms_norm_eps)
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # the weights are written first

        with self.stream:
            # the weights as the kernels read them: views of params in the run's dtype laid out by
            # decode_layout, else one copy each (weights.decode_weights)
            self.weights = decode_weights(cp, params, config, self.dtype)
            self.params = dict(params)  # the arrays the views view, and what the prefill's eager forward reads

            # state = {token, pos}: the decode step's input; history: every token id, by position
            self.state = cp.zeros(2, dtype=cp.int32)
            self.history = cp.zeros(self.max_len, dtype=cp.int32)
            self.pinned = cp.cuda.alloc_pinned_memory(4 * self.max_len)
            self.host_history = np.frombuffer(self.pinned, dtype=np.int32, count=self.max_len)
            # the static cache, (n_layer, 1, NKV, max_len, HS) in the run's dtype: the eager KVCache, so that
            # the prefill (llama/model.py forward) writes what the decode kernels read
            import ml_dtypes

            self.cache = KVCache(config, 1, self.max_len, cp, ml_dtypes.bfloat16 if bf16 else np.float32)
            self.k_cache, self.v_cache = self.cache.k, self.cache.v
            bits = (lambda a: a.view(cp.uint16)) if bf16 else (lambda a: a)
            self.kv = [(bits(self.k_cache[i, 0]), bits(self.v_cache[i, 0])) for i in range(config.n_layer)]
            # RoPE's tables, the eager model's own values: (max_len, HS / 2) each
            cos, sin = rope_tables(config, 0, self.max_len, cp)
            self.rope_cos = cp.ascontiguousarray(cos[:, :HS // 2])
            self.rope_sin = cp.ascontiguousarray(sin[:, :HS // 2])
            # decode activations
            self.x = cp.zeros(C, dtype=cp.float32)  # the residual stream
            self.q = cp.zeros(NH * HS, dtype=cp.float32)  # rotated, not scaled
            self.y = cp.zeros(NH * HS, dtype=cp.float32)  # attention output, heads side by side
            self.g = cp.zeros(config.intermediate_size, dtype=cp.float32)  # silu(gate) * up
            # split-KV attention
            self.attn = attention_plan(config, self.max_len, self.sm_count, 2 if bf16 else 4)
            self.attn_partial = cp.zeros((NH, self.attn.splits, HS + 2), dtype=cp.float32)
            self.attn_counters = cp.zeros(NKV, dtype=cp.uint32)
            self._compile()
            # lm_head: one (max, argmax) per block and the last-block ticket
            lm_blocks = self.gemv["lm_head"][1]
            self.block_max = cp.zeros(lm_blocks, dtype=cp.float32)
            self.block_arg = cp.zeros(lm_blocks, dtype=cp.int32)
            self.lm_counter = cp.zeros(1, dtype=cp.uint32)
            self.logits = cp.full(config.vocab_size, cp.nan, dtype=cp.float32) if keep_logits else None
        self.stream.synchronize()
        self.prefetch = prefetch
        self._variants: dict[tuple, list[Launch]] = {}
        self.graphs: dict[tuple, object] = {}
        self.step_launches = self.launches(prefetch, pdl=False)  # eager launches, and what profile_step times
        # Programmatic dependent launch for the graphs (gpt2/fast's docstring): on where it works, unless
        # pdl=False; pdl=True insists.
        self.pdl, self.pdl_note = _switch(pdl, self._check_pdl, "programmatic dependent launch")
        if self.pdl_note.startswith("off (") and not self.pdl_note.startswith(("off (asked", "off (needs compute")):
            warnings.warn(f"llama.fast: programmatic dependent launch disabled: {self.pdl_note[5:-1]}", stacklevel=2)
        for steps in sorted({1, steps_per_graph}):  # captured now, on an idle stream, replayed from here on
            self.graph(steps)
        self.persistent, self.persistent_note = False, "off (Llama: CUDA graphs of the fused kernels)"
        self.window = steps_per_graph  # tokens per copy back

    # -- kernels -----------------------------------------------------------------------------------

    def _compile(self):
        """Compile every kernel; each matrix's stream gets its one-wave grid (the kernel's occupancy with
        its input's K floats of dynamic shared memory) and opts in to that shared memory."""
        c = self.config
        self.fn = {key: fused.function(file, expr) for key, (file, expr) in kernel_expressions(c, self.dtype).items()}
        self.gemv = {}
        for key, m in matrices(c).items():
            fn, smem = self.fn[key], 4 * m.K
            fn.max_dynamic_shared_size_bytes = smem
            grid = gemv_grid(m.tasks, driver.blocks_per_sm(fn, GEMV_WARPS * 32, smem), self.sm_count)
            self.gemv[key] = (fn, grid, smem)
        # the compiled kernel is shared by every engine of this model and dtype: its opt-in only grows
        attention = self.fn["attention"]
        attention.max_dynamic_shared_size_bytes = max(attention.max_dynamic_shared_size_bytes, self.attn.smem)

    # -- the decode step -----------------------------------------------------------------------------

    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers: embed, five per layer, the head. Each
        stream of a matrix asks L2, at its end, to prefetch the next matrix (the head wraps to the first
        layer's qkv)."""
        c, w, norms = self.config, self.weights, self.weights.norms
        C, NH, NKV, HS = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size
        eps = self.eps
        plan = [("embed", None)]  # (name, matrix read)
        for i, layer in enumerate(w.layers):
            plan += [(f"h.{i}.{STEP_KINDS[0]}", layer["qkv"]), (f"h.{i}.{STEP_KINDS[1]}", None),
                     (f"h.{i}.{STEP_KINDS[2]}", layer["o_proj"]), (f"h.{i}.{STEP_KINDS[3]}", layer["gate_up"]),
                     (f"h.{i}.{STEP_KINDS[4]}", layer["down_proj"])]
        plan.append(("norm+lm_head+argmax", w.head))
        with_matrix = [k for k, (_, m) in enumerate(plan) if m is not None]
        target = {}
        for a, b in zip(with_matrix, with_matrix[1:] + with_matrix[:1]):
            m = plan[b][1]
            target[a] = (_ptr(m), np.uint64(min(m.nbytes, PREFETCH_CAP) // 256 * 256)) if prefetch else (NULL, np.uint64(0))

        def stream(k, key, args):
            fn, grid, smem = self.gemv[key]
            return Launch(plan[k][0], fn, (grid,), (GEMV_WARPS * 32,), (plan[k][1], *args, *target[k]), shared_mem=smem)

        launches = [Launch(plan[0][0], self.fn["embed"], (1,), (256,),
                           (w.embed, NULL, self.state, NULL, np.int32(C), self.x, NULL, np.uint64(0)))]
        for i in range(c.n_layer):
            k = 1 + 5 * i
            pre = f"model.layers.{i}."
            k_cache, v_cache = self.kv[i]
            launches += [
                stream(k, "qkv", (self.x, norms[pre + "input_layernorm.weight"], eps, np.int32(NH), np.int32(NKV),
                                  self.state, self.rope_cos, self.rope_sin, self.q, k_cache, v_cache,
                                  np.int32(self.max_len))),
                Launch(plan[k + 1][0], self.fn["attention"], (self.attn.splits, NKV), (ATTENTION_WARPS * 32,),
                       (self.q, k_cache, v_cache, self.state, np.int32(self.max_len), np.int32(self.attn.staged_rows),
                        np.float32(1.0 / math.sqrt(HS)), self.attn_partial, self.attn_counters, self.y, NULL,
                        np.uint64(0)), shared_mem=self.attn.smem),
                stream(k + 2, "o_proj", (self.y, np.int32(C), self.x)),
                stream(k + 3, "gate_up", (self.x, norms[pre + "post_attention_layernorm.weight"], eps,
                                          np.int32(c.intermediate_size), self.g)),
                stream(k + 4, "down_proj", (self.g, np.int32(C), self.x)),
            ]
        launches.append(stream(len(plan) - 1, "lm_head", (
            self.x, norms["model.norm.weight"], eps, np.int32(c.vocab_size),
            self.logits if self.logits is not None else NULL, self.block_max, self.block_arg, self.lm_counter,
            self.state, self.history)))
        assert [launch.name for launch in launches] == [name for name, _ in plan]
        for launch in launches:
            launch.pdl, launch.stream = pdl, self.stream.ptr
        return launches

    def decode(self, n: int, *, graph: bool = True) -> None:
        """Queue n decode steps on the engine's stream: graphs of steps_per_graph steps, then single steps
        (graph=False: the kernels launched one by one, plainly)."""
        with self.stream:
            if not graph:
                for _ in range(n):
                    for launch in self.step_launches:
                        launch()
                return
            big, small = self.graph(self.steps_per_graph), self.graph(1)
            for _ in range(n // self.steps_per_graph):
                big.launch(self.stream)
            for _ in range(n % self.steps_per_graph):
                small.launch(self.stream)

    def _check_pdl(self) -> str | None:
        """One decode step from a fixed state, with random keys and values in the cache, launched plainly
        and replayed as a graph of programmatic dependent launches: None if both leave the same bits in
        x, y and state, else why not (the engine then keeps plain launches)."""
        cp = self.cp
        if int(cp.cuda.Device().compute_capability) < 90:
            return "needs compute capability 9.0"
        pos, token = min(5, self.max_len - 2), min(123, self.config.vocab_size - 1)
        start = np.asarray([token, pos], dtype=np.int32)
        try:
            replayed = self.graph(1, pdl=True)  # captured first, on the idle stream
            results = []
            with self.stream:
                rng = cp.random.default_rng(0)
                for cache in (self.k_cache, self.v_cache):
                    rows = cache[:, :, :, :pos]  # every layer's rows before pos
                    values = rng.standard_normal(rows.shape, dtype=cp.float32)
                    if self.dtype == "bfloat16":
                        cache.view(cp.uint16)[:, :, :, :pos] = bf16_bits(cp, values)
                    else:
                        rows[...] = values
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
            return f"{type(exc).__name__}: {exc}"
        (x0, s0, y0), (x1, s1, y1) = results
        if not (bool((x0 == x1).all()) and bool((s0 == s1).all()) and bool((y0 == y1).all())):
            return "a step replayed with it differed from plain launches"
        return None

    # -- prefill and generation ----------------------------------------------------------------------

    def start(self, prompt: list[int], attend) -> None:
        """Queue the prompt: the eager model's forward over it (llama/model.py: its products on cuBLAS,
        the attention under test), which writes every layer's keys and values into the engine's cache;
        then the first token, the argmax of the last position's logits, into history[T] and state =
        {it, T}: the decode step's input."""
        T = len(prompt)
        if not 1 <= T < self.max_len:
            raise LabError(f"the prompt has {T} tokens; the fast engine holds {self.max_len} positions")
        with self.stream:
            self.history[:T].set(np.asarray(prompt, dtype=np.int32), stream=self.stream)
            self.cache.length = 0
            logits = forward(self.params, self.config, self.history[None, :T], attend, cache=self.cache,
                             last_only=True)[0, -1]  # (vocab,) float32
            if self.logits is not None:
                self.logits[...] = logits
            token = logits.argmax()  # the first of equal values, as the eager Sampler's
            self.history[T:T + 1] = token
            self.state[0:1] = token
            self.state[1:2].fill(T)

    def generate(self, prompt: list[int], n_new: int, *, attend, eos_ids=(), on_token=None,
                 graph: bool = True) -> Generation:
        """n_new greedy tokens after prompt; stops after any of eos_ids. The GPU runs a window of
        self.window tokens ahead of the host, which hands the previous window's tokens to on_token as
        they arrive."""
        cp = self.cp
        T0 = len(prompt)
        if T0 + n_new > self.max_len:
            raise LabError(f"{T0} prompt tokens + {n_new} new tokens exceed the engine's {self.max_len} positions")
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # after whatever the caller queued
        out = Generation(tokens=[])
        with self.stream:
            self.start(prompt, attend)
            pending = deque([self._copy_back(T0, 1)])
            produced = 1
            while pending:
                if produced < n_new:  # queue the next window before waiting for the previous one
                    count = min(self.window, n_new - produced)
                    self.decode(count, graph=graph)
                    pending.append(self._copy_back(T0 + produced, count))
                    produced += count
                event, first, count = pending.popleft()
                event.synchronize()
                for token in self.host_history[first:first + count].tolist():
                    out.tokens.append(token)
                    if on_token is not None:
                        on_token(token)
                    if token in eos_ids:
                        out.stopped_at_eos = True
                        break
                if out.stopped_at_eos:
                    break
        self.stream.synchronize()  # queued windows past an end-of-text finish before the next use
        return out

    # -- measuring -----------------------------------------------------------------------------------

    def arrays(self) -> list:
        """Every device array the engine holds, found through its attributes (and the lists, tuples, dicts
        and DecodeWeights in them), the caller's params aside: views of params among them."""
        found, todo = [], [value for name, value in vars(self).items() if name != "params"]
        while todo:
            value = todo.pop()
            if isinstance(value, self.cp.ndarray):
                found.append(value)
            elif isinstance(value, dict):
                todo += value.values()
            elif isinstance(value, (list, tuple)):
                todo += value
            elif value is self.weights:
                todo.append(value.arrays())
        return found

    def added_bytes(self) -> int:
        """Device bytes the engine holds beside its params (each byte once): with params in the run's
        dtype and decode_layout's layout, the KV cache, RoPE's tables, activations and the RMSNorm weights
        widened to float32 in a bfloat16 run; no copy of a matrix."""
        return held_bytes(self.arrays(), besides=list(self.params.values()))

    def replay_ms(self, position: int, steps: int = 64, *, prefetch: bool | None = None, pdl: bool | None = None,
                  persistent: bool | None = None, repeats: int = 5) -> float:
        """Milliseconds per decode step from `position` as generate() runs them (median of `repeats` runs
        of `steps` steps, rounded down to whole graphs of steps_per_graph), in a launch variant (default:
        the engine's). There is no persistent step: persistent=True is refused."""
        cp = self.cp
        if persistent:
            raise LabError(f"the persistent step is {self.persistent_note}")
        steps = steps // self.steps_per_graph * self.steps_per_graph
        if steps < 1 or position + steps >= self.max_len:
            raise LabError(f"{steps} steps from position {position} do not fit the engine's {self.max_len} positions")
        big = self.graph(self.steps_per_graph, prefetch, pdl)
        start = np.asarray([0, position], dtype=np.int32)
        times = []
        with self.stream:
            before, after = cp.cuda.Event(), cp.cuda.Event()
            for _ in range(repeats + 1):  # the first run warms up
                self.state.set(start, stream=self.stream)
                before.record(self.stream)
                for _ in range(steps // self.steps_per_graph):
                    big.launch(self.stream)
                after.record(self.stream)
                after.synchronize()
                times.append(cp.cuda.get_elapsed_time(before, after) / steps)
        return float(np.median(times[1:]))
