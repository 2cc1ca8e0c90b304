"""GPT-2's fast engine: for one set of weights, the weight copies, the static KV cache, the decode
activations and the decode step's launches; its whole-sequence pass (prefill and the mode without a
cache: sequence.py) and its persistent step (persistent.py) beside it. lm/engine.py's FastEngine runs
the rest (launch variants, graphs, generation, measurements). See gpt2/fast's docstring for how a
decode step runs."""

from __future__ import annotations

import math

import numpy as np

from kernels import fused
from lm.arena import Buffer
from lm.engine import FastEngine, Launch, prefetch_targets
from lm.errors import LabError
from lm.switch import Switch

from ..config import GPT2Config
from .persistent import PersistentStep
from .plan import (
    GEMM_OPTIONS,
    GEMM_SMEM,
    NULL,
    PREFETCH_CAP,
    STEPS_PER_GRAPH,
    STEPS_PER_LAUNCH,
    attention_staging,
    attention_warps,
    gemm_expressions,
    gemv_shape,
    kernel_expressions,
    lm_head_blocks,
    lm_head_shape,
    param_dtype,
    unsupported_reason,
)
from .sequence import WholeSequence, choose_products
from .weights import decode_weights


class Engine(FastEngine):
    """Everything the fast path needs for one set of weights, allocated once: the weights as its kernels
    read them (views of params laid out by decode_layout, else copies), the static KV cache (n_positions
    long), activations, the decode step's launches and its graphs."""

    label = "gpt2.fast"

    def __init__(self, params: dict, config: GPT2Config, *, dtype: str | None = None, max_len: int | None = None,
                 prefetch: bool = True, pdl: bool | None = None, steps_per_graph: int = STEPS_PER_GRAPH,
                 steps_per_launch: int = STEPS_PER_LAUNCH, keep_logits: bool = False,
                 persistent: bool | None = None, products: str | None = None, step_ring: int | None = None,
                 step_reduce: bool | None = None, step_splits: int | None = None):
        import cupy as cp

        import kernels

        dtype = dtype or param_dtype(params)
        why = unsupported_reason(params, config, kv_cache=True, dtype=dtype)
        if why is not None:
            raise LabError(f"the fast path cannot run this model: {why}")
        products = choose_products(cp, products)
        super().__init__(cp, config, dtype, max_len or config.n_positions, steps_per_graph=steps_per_graph,
                         steps_per_launch=steps_per_launch)
        self.eps = np.float32(config.layer_norm_epsilon)
        self.sm_count = kernels.device_limits().sm_count
        with self.stream:
            # the weights as the kernels read them: views of params where they are in the run's dtype and
            # laid out by decode_layout, else one copy each (weights.decode_weights)
            w = decode_weights(cp, params, config, self.dtype)
            self.wte, self.wpe, self.layers, self.vectors = w.wte, w.wpe, w.layers, w.vectors
            self.weights = w
            self.params = dict(params)  # the arrays the views view, as they are now: kept alive with them
            self._allocate(keep_logits)
            self.whole = WholeSequence(self, products)
            self._compile()
        self.stream.synchronize()
        self.step = PersistentStep(self, step_ring, step_reduce, step_splits)
        self.choose_launches(prefetch, pdl, persistent)

    def _allocate(self, keep_logits: bool) -> None:
        """The static KV cache and the decode step's activations and scratch, in the engine's arena."""
        c = self.config
        C, NH, HS, V = c.n_embd, c.n_head, c.head_size, c.vocab_size
        bf16 = self.dtype == "bfloat16"
        kv_dtype = np.uint16 if bf16 else np.float32
        # split-KV attention: S splits per head, one wave of S * NH blocks
        self.splits = max(1, min(self.sm_count // NH, -(-self.max_len // 16)))
        self.attn_rows, self.attn_smem = attention_staging(self.max_len, self.splits, HS, 2 if bf16 else 4)
        # lm_head: one (max, argmax) per block and the last-block ticket
        # (one wave of blocks: the grid depends on the compiled kernel's occupancy)
        lm_exprs = kernel_expressions(c, self.dtype)
        self.lm_warps, self.lm_rows = lm_head_shape(c, self.dtype)
        self.lm_blocks = lm_head_blocks(fused.function(*lm_exprs["lm_head"]), self.lm_warps, self.lm_rows, V,
                                        self.sm_count)
        self.logits = None  # unless keep_logits: then NaN until the step writes them
        self.allocate([
            Buffer("k_cache", (c.n_layer, NH, self.max_len, HS), kv_dtype),
            Buffer("v_cache", (c.n_layer, NH, self.max_len, HS), kv_dtype),
            Buffer("x", C, np.float32),  # the residual stream
            Buffer("qkv", 3 * C, np.float32),
            Buffer("y", C, np.float32),  # attention output, heads side by side
            Buffer("g", c.mlp_width, np.float32),  # gelu(c_fc)
            Buffer("attn_partial", (NH, self.splits, HS + 2), np.float32),
            Buffer("attn_counters", NH, np.uint32),
            Buffer("block_max", self.lm_blocks, np.float32),
            Buffer("block_arg", self.lm_blocks, np.int32),
            Buffer("lm_counter", 1, np.uint32),
            *([Buffer("logits", V, np.float32, fill=np.nan)] if keep_logits else []),
        ])

    def _compile(self):
        c = self.config
        item = 2 if self.dtype == "bfloat16" else 4
        self.fn = {key: fused.function(file, expr) for key, (file, expr) in kernel_expressions(c, self.dtype).items()
                   if key != "decode_step"}  # compiled by the persistent step's setup, where the device runs it
        for key, (file, expr) in gemm_expressions().items() if self.products == "3xtf32" else ():
            self.fn[key] = fused.function(file, expr, options=GEMM_OPTIONS)
            self.fn[key].max_dynamic_shared_size_bytes = GEMM_SMEM
        for key, (N, K) in {"c_attn": (3 * c.n_embd, c.n_embd), "c_proj": (c.n_embd, c.n_embd),
                            "c_fc": (c.mlp_width, c.n_embd), "mlp_proj": (c.n_embd, c.mlp_width)}.items():
            warps, rows = gemv_shape(N, K, item)
            self.fn[key] = (self.fn[key], -(-N // (warps * rows)), warps * 32)  # kernel, blocks, threads
        self.attn_warps = attention_warps(c)
        # opt in to the dynamic shared memory (with the static, past 48 KB a kernel must)
        self.fn["attention"].max_dynamic_shared_size_bytes = self.attn_smem

    # -- what the base runs: the decode step, the prefill, the pass without a cache, the persistent step --

    attention_kind = "attn"  # step_reads' name of the attention over the cache, after h.N.

    def step_reads(self) -> list[tuple[str, object]]:
        """The decode step's launches in order, (name, the matrix it reads, or None)."""
        plan = [("embed", None)]
        for i, layer in enumerate(self.layers):
            plan += [(f"h.{i}.ln_1+attn.c_attn", layer["attn.c_attn"]), (f"h.{i}.attn", None),
                     (f"h.{i}.attn.c_proj+residual", layer["attn.c_proj"]),
                     (f"h.{i}.ln_2+mlp.c_fc+gelu", layer["mlp.c_fc"]),
                     (f"h.{i}.mlp.c_proj+residual", layer["mlp.c_proj"])]
        return plan + [("ln_f+lm_head+argmax", self.wte)]

    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers. Each kernel that reads a matrix
        also asks L2 to prefetch the next one (the last wraps to the first layer's c_attn)."""
        c, p = self.config, self.vectors
        C, NH, HS = c.n_embd, c.n_head, c.head_size
        plan = self.step_reads()
        target = prefetch_targets(plan, prefetch, PREFETCH_CAP, NULL)

        def pf(k):
            return target.get(k, (NULL, np.uint64(0)))

        def gemv(k, key, layer, linear, x, ln, out, N):
            fn, grid, threads = self.fn[key]
            h = f"h.{layer}."
            ln_w, ln_b = (p[h + ln + ".weight"], p[h + ln + ".bias"]) if ln else (NULL, NULL)
            return Launch(plan[k][0], fn, (grid,), (threads,),
                          (self.layers[layer][linear], p[h + linear + ".bias"], x, ln_w, ln_b, self.eps, out,
                           np.int32(N), *pf(k)))

        launches = [Launch(plan[0][0], self.fn["embed"], (1,), (256,),
                           (self.wte, self.wpe, self.state, self.state[1:], np.int32(C), self.x, *pf(0)))]
        for i in range(c.n_layer):
            k = 1 + 5 * i
            launches += [
                gemv(k, "c_attn", i, "attn.c_attn", self.x, "ln_1", self.qkv, 3 * C),
                Launch(plan[k + 1][0], self.fn["attention"], (self.splits, NH), (self.attn_warps * 32,),
                       (self.qkv, self.k_cache[i], self.v_cache[i], self.state, np.int32(NH), np.int32(self.max_len),
                        np.int32(self.attn_rows), np.float32(1.0 / math.sqrt(HS)), self.attn_partial,
                        self.attn_counters, self.y, *pf(k + 1)),
                       shared_mem=self.attn_smem),
                gemv(k + 2, "c_proj", i, "attn.c_proj", self.y, None, self.x, C),
                gemv(k + 3, "c_fc", i, "mlp.c_fc", self.x, "ln_2", self.g, c.mlp_width),
                gemv(k + 4, "mlp_proj", i, "mlp.c_proj", self.g, None, self.x, C),
            ]
        k = len(plan) - 1
        launches.append(Launch(plan[k][0], self.fn["lm_head"], (self.lm_blocks,), (self.lm_warps * 32,),
                               (self.wte, self.x, NULL, NULL, p["ln_f.weight"], p["ln_f.bias"], self.eps,
                                np.int32(c.vocab_size), self.logits if self.logits is not None else NULL,
                                self.block_max, self.block_arg, self.lm_counter, self.state, self.history, *pf(k))))
        assert [launch.name for launch in launches] == [name for name, _ in plan]
        return launches

    def start(self, prompt: list[int], attend, *, kv_cache: bool = True) -> None:
        """Queue the prompt: history[0:T] = prompt, state = {last token, T - 1}, then the whole prompt
        through the whole-sequence pass, which leaves the first new token in history[T] and state = {it, T}."""
        T = len(prompt)
        if not 1 <= T < self.max_len:
            raise LabError(f"the prompt has {T} tokens; the fast engine holds {self.max_len} positions")
        with self.stream:
            self.history[:T].set(np.asarray(prompt, dtype=np.int32), stream=self.stream)
            self.state.set(np.asarray([prompt[-1], T - 1], dtype=np.int32), stream=self.stream)
            self.whole.run(T, attend, store_kv=kv_cache)

    def prefill_graphs(self):
        """The prefill's graphs (lm.prefill_graph.PrefillGraphs), with PREFILL_GRAPHS."""
        return self.whole.prefills

    def recompute(self, T: int, attend) -> None:
        self.whole.run(T, attend, store_kv=False)

    def reserve(self, T: int) -> None:
        self.whole.reserve(T)

    def _setup_persistent(self) -> Switch:
        return self.step.setup()

    def persistent_steps(self, n: int, trace=None) -> None:
        self.step.launch(n, trace)

    def profile_persistent(self, position: int, repeats: int = 5) -> list[tuple[str, float, float, float]]:
        """PersistentStep.profile: where the persistent step's time goes at `position`, by stage."""
        if not self.persistent:
            raise LabError(f"the persistent step is {self.persistent_note}")
        return self.step.profile(position, repeats)

    def parts(self) -> list:
        return [self.whole, self.step]

    # what tools and tests read of the parts
    @property
    def products(self) -> str:
        return self.whole.products

    @property
    def work(self) -> dict:
        return self.whole.work

    @property
    def plan(self):
        return self.step.plan
