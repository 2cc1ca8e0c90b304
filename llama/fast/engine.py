"""Llama's fast engine: for one set of weights and a run's length, the weights as the kernels read them,
the static KV cache, the decode activations, the decode step's launches and the prefill. lm/engine.py's
FastEngine runs the rest (launch variants, graphs, generation, measurements). See llama/fast's
docstring for how a decode step runs."""

from __future__ import annotations

import math

import numpy as np

from kernels import driver, fused
from lm import prefill_graph
from lm.arena import Buffer
from lm.engine import FastEngine, Launch, prefetch_targets
from lm.errors import LabError
from lm.kv_cache import KVCache
from lm.prefill_graph import PassGraph, PrefillGraphs, bucket_rows
from lm.switch import Switch

from ..config import LlamaConfig
from ..model import hidden_states, logits_of, rope_tables
from .plan import (
    ATTENTION_PREFETCH,
    ATTENTION_TRACE_MARKS,
    DEFAULT_POSITIONS,
    GEMV_WARPS,
    ITEM_LOADS,
    MATRIX_NAMES,
    NULL,
    PREFETCH_CAP,
    STEPS_PER_GRAPH,
    STREAM_BLOCKS_PER_SM,
    attention_kernel,
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


def gemv_options(given: dict | None) -> dict:
    """The streams' overrides, for measuring (tools/llama_step_variants.py): blocks_per_sm (at most this
    many blocks of every stream an SM) and blocks_per_sm_of ({matrix: n}, that stream's, over the plan's
    STREAM_BLOCKS_PER_SM); item_loads (every stream's gemv_unroll argument, None: the plan's) and
    item_loads_of ({matrix: n}, that stream's). By default the plan's: STREAM_BLOCKS_PER_SM, else as
    many as fit; STREAM_ITEM_LOADS, else ITEM_LOADS."""
    out = {"blocks_per_sm": 1 << 30, "blocks_per_sm_of": dict(STREAM_BLOCKS_PER_SM), "item_loads": None,
           "item_loads_of": {}}
    if unknown := set(given or {}) - set(out):
        raise LabError(f"gemv {given}: unknown {', '.join(sorted(unknown))} (blocks_per_sm, blocks_per_sm_of, "
                       "item_loads, item_loads_of)")
    for key, value in (given or {}).items():
        if key.endswith("_of"):
            out[key].update(value)
        else:
            out[key] = value
    if unknown := (set(out["blocks_per_sm_of"]) | set(out["item_loads_of"])) - set(MATRIX_NAMES):
        raise LabError(f"gemv {given}: no stream {', '.join(sorted(unknown))}; the streams are "
                       f"{', '.join(MATRIX_NAMES)}")
    loads = [n for n in (out["item_loads"], *out["item_loads_of"].values()) if n is not None]
    if min([out["blocks_per_sm"], *out["blocks_per_sm_of"].values()]) < 1 or not all(1 <= n <= ITEM_LOADS for n in loads):
        raise LabError(f"gemv {given}: blocks_per_sm at least 1, item_loads 1 to {ITEM_LOADS} (more spills "
                       "under rms_gemv.cu's 128 registers)")
    return out


def l2_options(given: dict | None) -> dict:
    """The L2 prefetch hints' overrides, for measuring (tools/llama_step_variants.py): cap (bytes of the next
    matrix each stream asks L2 for at its end) and attention (bytes of the layer's gate/up matrix the
    attention launch asks L2 for as it starts); by default PREFETCH_CAP and ATTENTION_PREFETCH."""
    out = {"cap": PREFETCH_CAP, "attention": ATTENTION_PREFETCH}
    if unknown := set(given or {}) - set(out):
        raise LabError(f"l2 {given}: unknown {', '.join(sorted(unknown))} (cap, attention)")
    out.update(given or {})
    if out["cap"] < 256 or out["attention"] < 0:
        raise LabError(f"l2 {given}: cap at least 256 bytes, attention at least 0")
    return out


class Engine(FastEngine):
    """Everything the fast path needs for one set of weights, allocated once: the weights as its kernels
    read them (views of params laid out by decode_layout, else copies), the static KV cache of max_len
    positions (the run's, not the model's 131,072), activations, the decode step's launches and graphs."""

    label = "llama.fast"

    def __init__(self, params: dict, config: LlamaConfig, *, dtype: str | None = None, max_len: int | None = None,
                 prefetch: bool = True, pdl: bool | None = None, steps_per_graph: int = STEPS_PER_GRAPH,
                 keep_logits: bool = False, attention: dict | None = None, gemv: dict | None = None,
                 l2: dict | None = None, trace: bool = False):
        import cupy as cp

        import kernels

        dtype = dtype or param_dtype(params)
        why = unsupported_reason(params, config, kv_cache=True, dtype=dtype)
        if why is not None:
            raise LabError(f"the fast path cannot run this model: {why}")
        max_len = max_len or cache_positions(min(DEFAULT_POSITIONS, config.n_positions), config)
        if not 2 <= max_len <= config.n_positions:
            raise LabError(f"max_len {max_len}: the engine holds 2 to {config.n_positions} positions")
        limits = kernels.device_limits()
        widest = max(m.K for m in matrices(config).values())
        if 4 * widest > limits.max_shared_per_block:
            raise LabError(f"rms_gemv stages {4 * widest} bytes of input in shared memory; the device has "
                           f"{limits.max_shared_per_block}")
        super().__init__(cp, config, dtype, max_len, steps_per_graph=steps_per_graph)
        self.sm_count = limits.sm_count
        self.eps = np.float32(config.rms_norm_eps)
        try:  # attention: attention_plan's overrides (splits, split_keys, warps, cluster), for measuring
            self.attn = attention_plan(config, self.max_len, self.sm_count, 2 if self.dtype == "bfloat16" else 4,
                                       **(attention or {}))
        except (TypeError, ValueError) as exc:
            raise LabError(f"attention {attention}: {exc}") from None
        self.trace = trace  # the attention's diagnostic build: its marks in attn_trace (tools/attention_trace.py)
        self.attn_trace = None
        self.gemv_options = gemv_options(gemv)  # the streams' overrides (blocks_per_sm[_of], item_loads[_of])
        self.l2_options = l2_options(l2)  # the prefetch hints' overrides (cap, attention)
        with self.stream:
            # the weights as the kernels read them: views of params in the run's dtype laid out by
            # decode_layout, else one copy each (weights.decode_weights)
            self.weights = decode_weights(cp, params, config, self.dtype)
            self.params = dict(params)  # the arrays the views view, and what the prefill's eager forward reads
            self.prefills = PrefillGraphs()  # the prefill's graphs, with PREFILL_GRAPHS
            self._compile()
            self._allocate(keep_logits)
        self.stream.synchronize()
        self.choose_launches(prefetch, pdl, persistent=None)

    def _allocate(self, keep_logits: bool) -> None:
        """The static cache, RoPE's tables and the decode step's activations and scratch, in the engine's
        arena."""
        c = self.config
        NH, NKV, HS = c.num_attention_heads, c.num_key_value_heads, c.head_size
        bf16 = self.dtype == "bfloat16"
        import ml_dtypes

        kv_dtype = ml_dtypes.bfloat16 if bf16 else np.float32
        lm_blocks = self.gemv["lm_head"][1]
        self.logits = None  # unless keep_logits: then NaN until the step writes them
        self.allocate([
            # the static cache, (n_layer, 1, NKV, max_len, HS) in the run's dtype, as the eager KVCache lays
            # it out, so that the prefill (llama/model.py forward) writes what the decode kernels read
            Buffer("k_cache", (c.n_layer, 1, NKV, self.max_len, HS), kv_dtype),
            Buffer("v_cache", (c.n_layer, 1, NKV, self.max_len, HS), kv_dtype),
            Buffer("rope_cos", (self.max_len, HS // 2), np.float32),  # RoPE's tables: (max_len, HS / 2) each
            Buffer("rope_sin", (self.max_len, HS // 2), np.float32),
            Buffer("x", c.hidden_size, np.float32),  # the residual stream
            Buffer("q", NH * HS, np.float32),  # rotated, not scaled
            Buffer("y", NH * HS, np.float32),  # attention output, heads side by side
            Buffer("g", c.intermediate_size, np.float32),  # silu(gate) * up
            Buffer("attn_partial", (NH, self.attn.splits, HS + 2), np.float32),  # split-KV attention
            Buffer("attn_counters", NKV, np.uint32),
            # with trace: each attention block's global-timer marks, by layer, key/value head and split
            *([Buffer("attn_trace", (c.n_layer, NKV, self.attn.splits, ATTENTION_TRACE_MARKS), np.uint64)]
              if self.trace else []),
            Buffer("block_max", lm_blocks, np.float32),  # lm_head: one (max, argmax) per block
            Buffer("block_arg", lm_blocks, np.int32),
            Buffer("lm_counter", 1, np.uint32),  # the last-block ticket
            *([Buffer("logits", c.vocab_size, np.float32, fill=np.nan)] if keep_logits else []),
        ])
        self.cache = KVCache.over(self.k_cache, self.v_cache)
        bits = (lambda a: a.view(np.uint16)) if bf16 else (lambda a: a)
        self.kv = [(bits(self.k_cache[i, 0]), bits(self.v_cache[i, 0])) for i in range(c.n_layer)]
        cos, sin = rope_tables(c, 0, self.max_len, self.cp)  # the eager model's own values
        self.rope_cos[...] = cos[:, :HS // 2]
        self.rope_sin[...] = sin[:, :HS // 2]

    def _compile(self):
        """Compile every kernel; each matrix's stream gets its one-wave grid (the kernel's occupancy with
        its input's K floats of dynamic shared memory) and opts in to that shared memory."""
        c = self.config
        exprs = kernel_expressions(c, self.dtype, item_loads=self.gemv_options["item_loads"],
                                   item_loads_of=self.gemv_options["item_loads_of"])
        exprs["attention"] = attention_kernel(c, self.dtype, self.attn.warps, self.attn.cluster, self.trace)  # the plan's
        self.fn = {key: fused.function(file, expr) for key, (file, expr) in exprs.items() if "/" not in key}
        self.gemv = {}
        for key, m in matrices(c).items():
            fn, smem = self.fn[key], 4 * m.K
            fn.max_dynamic_shared_size_bytes = smem
            held = min(driver.blocks_per_sm(fn, GEMV_WARPS * 32, smem), self.gemv_options["blocks_per_sm"],
                       self.gemv_options["blocks_per_sm_of"].get(key, 1 << 30))
            grid = gemv_grid(m.tasks, held, self.sm_count)
            self.gemv[key] = (fn, grid, smem)
        # the compiled kernel is shared by every engine of this model and dtype: its opt-in only grows
        attention = self.fn["attention"]
        attention.max_dynamic_shared_size_bytes = max(attention.max_dynamic_shared_size_bytes, self.attn.smem)
        self.attn_clusters_held = None  # with cluster: how many of the launch's clusters the device holds at once
        if self.attn.cluster:  # a cluster a key/value head: the device must hold one at least
            S, NKV = self.attn.splits, c.num_key_value_heads
            if S > 8:
                driver.allow_non_portable_clusters(attention)
            held = driver.max_active_clusters(attention, (S, NKV), (32 * self.attn.warps,), S, self.attn.smem)
            self.attn_clusters_held = held
            if held < 1:
                raise LabError(f"gqa_decode_attention: the device holds no cluster of {S} blocks of "
                               f"{32 * self.attn.warps} threads and {self.attn.smem} bytes of shared memory "
                               "(attention={'cluster': False} combines by a ticket)")

    # -- what the base runs: the decode step and the prefill -------------------------------------------

    attention_kind = STEP_KINDS[1]  # step_reads' name of the attention over the cache, after h.N.

    def step_reads(self) -> list[tuple[str, object]]:
        """The decode step's launches in order, (name, the matrix it reads, or None)."""
        plan = [("embed", None)]
        for i, layer in enumerate(self.weights.layers):
            plan += [(f"h.{i}.{STEP_KINDS[0]}", layer["qkv"]), (f"h.{i}.{STEP_KINDS[1]}", None),
                     (f"h.{i}.{STEP_KINDS[2]}", layer["o_proj"]), (f"h.{i}.{STEP_KINDS[3]}", layer["gate_up"]),
                     (f"h.{i}.{STEP_KINDS[4]}", layer["down_proj"])]
        return plan + [("norm+lm_head+argmax", self.weights.head)]

    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers: embed, five per layer, the head. Each
        stream of a matrix asks L2, at its end, to prefetch the next matrix (the head wraps to the first
        layer's qkv), and the attention, as it starts, the first bytes of its layer's gate/up (l2_options)."""
        c, w, norms = self.config, self.weights, self.weights.norms
        C, NH, NKV, HS = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size
        eps = self.eps
        plan = self.step_reads()
        target = prefetch_targets(plan, prefetch, self.l2_options["cap"], NULL)
        ahead = self.l2_options["attention"] if prefetch else 0

        def attention_target(gate_up):  # the first `ahead` bytes of the layer's gate/up, or none
            return (np.uint64(gate_up.data.ptr), np.uint64(min(gate_up.nbytes, ahead) // 256 * 256)) if ahead else (
                NULL, np.uint64(0))

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
                Launch(plan[k + 1][0], self.fn["attention"], (self.attn.splits, NKV), (32 * self.attn.warps,),
                       (self.q, k_cache, v_cache, self.state, np.int32(self.max_len), np.int32(self.attn.split_keys),
                        np.int32(self.attn.staged_rows),
                        np.float32(1.0 / math.sqrt(HS)), self.attn_partial, self.attn_counters, self.y,
                        *attention_target(w.layers[i]["gate_up"]),
                        self.attn_trace[i] if self.attn_trace is not None else NULL), shared_mem=self.attn.smem,
                       cluster=(self.attn.splits, 1, 1) if self.attn.cluster else None),
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
        return launches

    def start(self, prompt: list[int], attend, *, kv_cache: bool = True) -> None:
        """Queue the prompt: the eager model's forward over it (llama/model.py: its products on cuBLAS,
        the attention under test), which writes every layer's keys and values into the engine's cache;
        then the first token, the argmax of the last position's logits, into history[T] and state =
        {it, T}: the decode step's input. Llama's fast path runs with a KV cache only."""
        T = len(prompt)
        if not kv_cache:
            raise LabError("llama.fast runs with a KV cache only")
        if not 1 <= T < self.max_len:
            raise LabError(f"the prompt has {T} tokens; the fast engine holds {self.max_len} positions")
        with self.stream:
            self.history[:T].set(np.asarray(prompt, dtype=np.int32), stream=self.stream)
            logits = logits_of(self.params, self.config, self.prefill(T, attend))[0, -1]  # (vocab,) float32
            if self.logits is not None:
                self.logits[...] = logits
            token = logits.argmax()  # the first of equal values, as the eager Sampler's
            self.history[T:T + 1] = token
            self.state[0:1] = token
            self.state[1:2].fill(T)

    def prefill(self, T: int, attend):
        """The eager model over history[0:T] into the cache (cache.length = T after it): the residual
        stream at position T - 1 after the last layer, (1, 1, C) float32. With PREFILL_GRAPHS, the pass
        runs over a bucket of rows (lm/prefill_graph.py), the last layer after its keys and values over
        the bucket's last PREFILL_BUCKET rows (the prompt's last is one of them), replayed from a graph
        where the bucket was seen before; the row T - 1 is taken after it."""
        if not prefill_graph.PREFILL_GRAPHS:
            self.cache.length = 0
            return hidden_states(self.params, self.config, self.history[None, :T], attend, cache=self.cache,
                                 last_only=True)
        rows = bucket_rows(T, self.max_len)
        tail = min(prefill_graph.PREFILL_BUCKET, rows)  # rows - T < PREFILL_BUCKET: row T - 1 is in them

        def passes(_):
            self.cache.length = 0
            return hidden_states(self.params, self.config, self.history[None, :rows], attend, cache=self.cache,
                                 last_only=True, tail=tail)

        graph = self.prefills.get((rows, attend), lambda: PassGraph(self.cp, self.stream, passes))
        if graph is None:  # the bucket's first pass, or one that cannot be captured
            x = passes(None)
        else:
            graph.launch(self.stream)
            x = graph.out  # (1, tail, C), in the graph's pool: rewritten by the launch
        self.cache.length = T
        last = T - 1 - (rows - tail)  # row T - 1 among the last `tail`
        return x[:, last:last + 1]

    def prefill_graphs(self) -> PrefillGraphs:
        return self.prefills

    def _setup_persistent(self) -> Switch:
        return Switch.off("Llama: CUDA graphs of the fused kernels")
