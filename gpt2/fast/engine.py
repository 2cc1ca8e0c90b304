"""The fast path's engine: for one set of weights, the weight copies, the static KV cache, the
activations, the decode step (its launches, graphs and the persistent kernel), the whole-sequence
pass (prefill and the no-cache mode), generation and the step's measurements. See gpt2/fast's
docstring for how a decode step runs."""

from __future__ import annotations

import math
import warnings
from collections import deque

import numpy as np

from kernels import driver, fused
from lm.arrays import held_bytes
from lm.generate import Generation
from lm.products import Blas

from ..config import GPT2Config
from ..errors import LabError
from .launch import DecodeGraphs, Launch, gemm
from .plan import (
    FOLDS,
    GEMM_BIAS,
    GEMM_BIAS_GELU,
    GEMM_NONE,
    GEMM_OPTIONS,
    GEMM_SMEM,
    GEMM_TILE,
    LAYER_POINTERS,
    NULL,
    PREFETCH_CAP,
    STEP_BLOCK,
    STEP_STAGES,
    STEP_THREADS,
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
    step_plan,
    unsupported_reason,
)
from .weights import ROUND_BF16, bf16_bits, decode_weights, gemm_weight, layernorm_fold


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


def _switch(asked: bool | None, check, what: str) -> tuple[bool, str]:
    """An engine option that is on where it works: False keeps it off, None takes it where check()
    (None, or why not) allows, True insists. (on, note: "on", "off (asked)" or "off (why)")."""
    if asked is False:
        return False, "off (asked)"
    why = check()
    if why is not None and asked:
        raise RuntimeError(f"{what} does not work here: {why}")
    return why is None, "on" if why is None else f"off ({why})"


class Engine(DecodeGraphs):
    """Everything the fast path needs for one set of weights, allocated once: the weights as its kernels
    read them (views of params laid out by decode_layout, else copies), the static KV cache (n_positions
    long), activations, the decode step's launches and its graphs."""

    def __init__(self, params: dict, config: GPT2Config, *, dtype: str | None = None, max_len: int | None = None,
                 prefetch: bool = True, pdl: bool | None = None, steps_per_graph: int = STEPS_PER_GRAPH,
                 steps_per_launch: int = STEPS_PER_LAUNCH, keep_logits: bool = False,
                 persistent: bool | None = None, products: str | None = None, step_ring: int | None = None):
        import cupy as cp

        import kernels

        self.cp, self.config = cp, config
        self.dtype = dtype or param_dtype(params)
        why = unsupported_reason(params, config, kv_cache=True, dtype=self.dtype)
        if why is not None:
            raise LabError(f"the fast path cannot run this model: {why}")
        self.max_len = max_len or config.n_positions
        self.step_ring = step_ring  # the persistent step's slots, where given (step_plan's ring: for measuring)
        self.steps_per_graph, self.steps_per_launch = steps_per_graph, steps_per_launch
        self.stream = cp.cuda.Stream(non_blocking=True)
        C, NH, HS, V = config.n_embd, config.n_head, config.head_size, config.vocab_size
        bf16 = self.dtype == "bfloat16"
        self.weight_type = "unsigned short" if bf16 else "float"
        self.kv_type = self.weight_type
        eps = np.float32(config.layer_norm_epsilon)
        self.eps = eps
        self.sm_count = kernels.device_limits().sm_count
        # the no-cache mode's float32 products: gemm.cu (3xTF32 on wgmma, sm_90a) or cuBLAS SGEMM (the
        # prefill's always run on cuBLAS, on the weights the decode step reads: no copy of them)
        able = int(cp.cuda.Device().compute_capability) == 90
        if products not in (None, "3xtf32", "cublas"):
            raise ValueError(f"products must be '3xtf32' or 'cublas', got {products!r}")
        if products == "3xtf32" and not able:
            raise RuntimeError("products='3xtf32' needs compute capability 9.0 (TF32 wgmma, sm_90a)")
        self.products = products or ("3xtf32" if able else "cublas")
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # the weights are written first

        with self.stream:
            # the weights as the kernels read them: views of params where they are in the run's dtype and
            # laid out by decode_layout, else one copy each (weights.decode_weights)
            w = decode_weights(cp, params, config, self.dtype)
            self.wte, self.wpe, self.layers, self.vectors = w.wte, w.wpe, w.layers, w.vectors
            self.weights = w
            self.params = dict(params)  # the arrays the views view, as they are now: kept alive with them

            # state = {token, pos}: the decode step's input; history: every token id, by position
            self.state = cp.zeros(2, dtype=cp.int32)
            self.history = cp.zeros(self.max_len, dtype=cp.int32)
            self.pinned = cp.cuda.alloc_pinned_memory(4 * self.max_len)
            self.host_history = np.frombuffer(self.pinned, dtype=np.int32, count=self.max_len)
            kv_dtype = cp.uint16 if bf16 else cp.float32
            cache_shape = (config.n_layer, NH, self.max_len, HS)
            self.k_cache = cp.zeros(cache_shape, dtype=kv_dtype)
            self.v_cache = cp.zeros(cache_shape, dtype=kv_dtype)
            # decode activations
            self.x = cp.zeros(C, dtype=cp.float32)  # the residual stream
            self.qkv = cp.zeros(3 * C, dtype=cp.float32)
            self.y = cp.zeros(C, dtype=cp.float32)  # attention output, heads side by side
            self.g = cp.zeros(config.mlp_width, dtype=cp.float32)  # gelu(c_fc)
            # split-KV attention: S splits per head, one wave of S * NH blocks
            self.splits = max(1, min(self.sm_count // NH, -(-self.max_len // 16)))
            self.attn_partial = cp.zeros((NH, self.splits, HS + 2), dtype=cp.float32)
            self.attn_counters = cp.zeros(NH, dtype=cp.uint32)
            self.attn_rows, self.attn_smem = attention_staging(self.max_len, self.splits, HS, 2 if bf16 else 4)
            # lm_head: one (max, argmax) per block and the last-block ticket
            # (one wave of blocks: the grid depends on the compiled kernel's occupancy)
            lm_exprs = kernel_expressions(config, self.dtype)
            self.lm_warps, self.lm_rows = lm_head_shape(config, self.dtype)
            self.lm_blocks = lm_head_blocks(fused.function(*lm_exprs["lm_head"]), self.lm_warps, self.lm_rows, V,
                                            self.sm_count)
            self.block_max = cp.zeros(self.lm_blocks, dtype=cp.float32)
            self.block_arg = cp.zeros(self.lm_blocks, dtype=cp.int32)
            self.lm_counter = cp.zeros(1, dtype=cp.uint32)
            self.logits = cp.full(V, cp.nan, dtype=cp.float32) if keep_logits else None
            # whole-sequence activations: allocated for the longest pass a run asks for (reserve)
            self.rows, self.work = 0, {}
            self.blas = Blas(cp)
            self.round_bf16 = cp.ElementwiseKernel("float32 x", "uint16 y", ROUND_BF16, "round_bf16") if bf16 else None
            # gemm.cu's weights, split and tiled on the no-cache mode's first pass (gemm_weight: two float32
            # copies of every linear weight, which a KV-cache run never makes)
            self.gemm_weights = None
            # split K: the splits' sums (fewer than 2 x SMs tiles of 64 x 64) and a ticket per output tile
            self.gemm_partials = cp.zeros(2 * self.sm_count * GEMM_TILE * GEMM_TILE, dtype=cp.float32)
            self.gemm_tickets = cp.zeros(self.sm_count, dtype=cp.uint32)

            self._compile()
        self.stream.synchronize()
        self.prefetch = prefetch
        self._variants: dict[tuple, list[Launch]] = {}
        self.graphs: dict[tuple, object] = {}
        self.step_launches = self.launches(prefetch, pdl=False)  # eager launches, and what profile_step times
        # Programmatic dependent launch for the graphs (see the module's docstring): on where it works,
        # unless pdl=False; pdl=True insists.
        self.pdl, self.pdl_note = _switch(pdl, self._check_pdl, "programmatic dependent launch")
        if self.pdl_note.startswith("off (") and not self.pdl_note.startswith(("off (asked", "off (needs compute")):
            warnings.warn(f"gpt2.fast: programmatic dependent launch disabled: {self.pdl_note[5:-1]}", stacklevel=2)
        for steps in sorted({1, steps_per_graph}):  # captured now, on an idle stream, replayed from here on
            self.graph(steps)
        # The persistent step (decode_step.cu): the default where it runs, unless persistent=False.
        self.persistent, self.persistent_note = _switch(persistent, self._setup_persistent, "the persistent decode step")
        self.window = steps_per_launch if self.persistent else steps_per_graph  # tokens per copy back

    # -- kernels -----------------------------------------------------------------------------------

    def _compile(self):
        c = self.config
        item = 2 if self.dtype == "bfloat16" else 4
        self.fn = {key: fused.function(file, expr) for key, (file, expr) in kernel_expressions(c, self.dtype).items()
                   if key != "decode_step"}  # compiled by _setup_persistent, where the device runs it
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

    def _setup_persistent(self) -> str | None:
        """Compile decode_step.cu and lay out what it reads (the plan, the layer table, its buffers);
        None when it is ready, else why it cannot run here."""
        cp, c = self.cp, self.config
        device = cp.cuda.Device()
        if int(device.compute_capability) < 90:
            return "needs compute capability 9.0 (cp.async.bulk)"
        if not device.attributes.get("CooperativeLaunch", 0):
            return "the device has no cooperative launch"
        exprs = kernel_expressions(c, self.dtype)
        if "decode_step" not in exprs:
            return f"head size {c.head_size}: decode_step needs a multiple of 32 dividing {STEP_THREADS}"
        import kernels

        plan = step_plan(c, self.dtype, self.sm_count, self.max_len, kernels.device_limits().max_shared_per_block,
                         ring=self.step_ring)
        if isinstance(plan, str):
            return plan
        fn = fused.function(*exprs["decode_step"])
        fn.max_dynamic_shared_size_bytes = plan.smem
        per_sm = driver.blocks_per_sm(fn, STEP_BLOCK, plan.smem)
        if per_sm < 1:
            return f"decode_step does not fit an SM ({plan.smem} bytes of shared memory, {STEP_BLOCK} threads)"
        with self.stream:
            table, self.folds = [], []  # folds: kept alive while the table points at them
            # attn.c_proj head-major, (NH, C, HS): [h, n, d] = W[n, h * HS + d] of the (out, in) copy
            self.proj_heads = [cp.ascontiguousarray(layer["attn.c_proj"].reshape(c.n_embd, c.n_head, c.head_size)
                                                    .transpose(1, 0, 2)) for layer in self.layers]
            p = self.vectors
            for i, layer in enumerate(self.layers):
                arrays = {"k_cache": self.k_cache[i], "v_cache": self.v_cache[i]}
                for name in LAYER_POINTERS[:10]:  # (out, in) matrices in the decode dtype; float32 vectors
                    if name in LAYER_POINTERS[:4]:
                        arrays[name] = layer[name.removesuffix(".weight")]
                    elif name.endswith(".fold"):
                        linear = name.removesuffix(".fold")
                        ln = f"h.{i}.{FOLDS[linear]}"
                        arrays[name] = layernorm_fold(cp, layer[linear], p[f"h.{i}.{linear}.bias"],
                                                      p[ln + ".weight"], p[ln + ".bias"])
                    else:
                        arrays[name] = p[f"h.{i}.{name}"]
                arrays["attn.c_proj.weight"] = self.proj_heads[i]
                self.folds.append([arrays[name] for name in arrays if name.endswith(".fold")])
                table.append([arrays[name].data.ptr for name in LAYER_POINTERS])
            self.layer_table = cp.asarray(np.asarray(table, dtype=np.uint64))
            # LN_f folded into the rows of wte (no bias), one pair more where V is odd (whole 16-byte copies)
            V = c.vocab_size
            fold = layernorm_fold(cp, self.wte, cp.zeros(V, dtype=cp.float32), p["ln_f.weight"], p["ln_f.bias"])
            self.lnf_fold = cp.concatenate([fold, cp.zeros((V % 2, 2), dtype=cp.float32)])
            # what blocks hand each other, per layer (decode_step.cu's handoffs): (value, epoch) words for
            # q, k, v and the key splits' partials, parity words for x, g and the heads' terms of attn.c_proj
            L = c.n_layer
            self.step_ll = {"x": cp.zeros((L, c.n_embd), dtype=cp.uint32),
                            "qkv": cp.zeros((L, 3 * c.n_embd), dtype=cp.uint64),
                            "partial": cp.zeros((L, c.n_head, plan.splits, c.head_size + 2), dtype=cp.uint64),
                            "g": cp.zeros((L, c.mlp_width), dtype=cp.uint32),
                            "proj": cp.zeros((L, c.n_head, c.n_embd), dtype=cp.uint32)}
            self.step_epoch = cp.zeros(1, dtype=cp.uint32)  # the last step's epoch: advanced by every launch
            self.step_max = cp.zeros(plan.blocks, dtype=cp.float32)
            self.step_arg = cp.zeros(plan.blocks, dtype=cp.int32)
            self.step_barrier = cp.zeros(1, dtype=cp.uint32)  # never reset: see decode_step.cu
        self.stream.synchronize()
        self.plan, self.fn["decode_step"] = plan, fn
        return None

    def persistent_steps(self, n: int, trace=None) -> None:
        """Queue n decode steps as one launch of decode_step.cu (cooperative: all blocks resident).
        trace: (n, stages, blocks, 2) uint64 for the global timer at each block's end of a stage and its
        start of the next, inputs in hand (profile_persistent)."""
        c, p, plan = self.config, self.vectors, self.plan
        args = (self.layer_table, np.int32(c.n_layer), self.wte, self.wpe, p["ln_f.weight"], self.lnf_fold, self.eps,
                np.int32(c.vocab_size), np.int32(self.max_len), np.int32(plan.splits),
                np.float32(1.0 / math.sqrt(c.head_size)), self.x, *self.step_ll.values(),
                self.step_max, self.step_arg, self.logits if self.logits is not None else NULL, self.state,
                self.history, self.step_barrier, self.step_epoch, np.int32(n), np.int32(plan.slot_bytes),
                np.int32(plan.slots), *(np.int32(r) for r in plan.item_rows), np.int32(plan.lm_rows),
                np.int32(plan.lm_keep), NULL if trace is None else trace)
        driver.launch_cooperative(self.fn["decode_step"], plan.blocks, STEP_BLOCK, args, shared_mem=plan.smem,
                                  stream=self.stream)

    # -- the decode step -----------------------------------------------------------------------------

    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers. Each kernel that reads a matrix
        also asks L2 to prefetch the next one (the last wraps to the first layer's c_attn)."""
        c, p = self.config, self.vectors
        C, NH, HS = c.n_embd, c.n_head, c.head_size
        eps = self.eps
        plan = [("embed", None)]  # (name, matrix read)
        for i, layer in enumerate(self.layers):
            plan += [(f"h.{i}.ln_1+attn.c_attn", layer["attn.c_attn"]), (f"h.{i}.attn", None),
                     (f"h.{i}.attn.c_proj+residual", layer["attn.c_proj"]),
                     (f"h.{i}.ln_2+mlp.c_fc+gelu", layer["mlp.c_fc"]),
                     (f"h.{i}.mlp.c_proj+residual", layer["mlp.c_proj"])]
        plan.append(("ln_f+lm_head+argmax", self.wte))
        with_matrix = [k for k, (_, m) in enumerate(plan) if m is not None]
        target = {}
        for a, b in zip(with_matrix, with_matrix[1:] + with_matrix[:1]):
            m = plan[b][1]
            target[a] = (_ptr(m), np.uint64(min(m.nbytes, PREFETCH_CAP) // 256 * 256)) if prefetch else (NULL, np.uint64(0))

        def pf(k):
            return target.get(k, (NULL, np.uint64(0)))

        def gemv(k, key, layer, linear, x, ln, out, N):
            fn, grid, threads = self.fn[key]
            h = f"h.{layer}."
            ln_w, ln_b = (p[h + ln + ".weight"], p[h + ln + ".bias"]) if ln else (NULL, NULL)
            return Launch(plan[k][0], fn, (grid,), (threads,),
                          (self.layers[layer][linear], p[h + linear + ".bias"], x, ln_w, ln_b, eps, out, np.int32(N),
                           *pf(k)))

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
                               (self.wte, self.x, NULL, NULL, p["ln_f.weight"], p["ln_f.bias"], eps,
                                np.int32(c.vocab_size), self.logits if self.logits is not None else NULL,
                                self.block_max, self.block_arg, self.lm_counter, self.state, self.history, *pf(k))))
        assert [launch.name for launch in launches] == [name for name, _ in plan]
        for launch in launches:
            launch.pdl, launch.stream = pdl, self.stream.ptr
        return launches

    def decode(self, n: int, *, graph: bool = True) -> None:
        """Queue n decode steps on the engine's stream: one decode_step launch of n steps where the engine
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

    def _check_pdl(self) -> str | None:
        """One decode step from a fixed state, with random keys and values in the cache, launched
        plainly and replayed as a graph of programmatic dependent launches: None if both leave the
        same bits in x and state, else why not (the engine then keeps plain launches)."""
        cp = self.cp
        if int(self.cp.cuda.Device().compute_capability) < 90:
            return "needs compute capability 9.0"
        pos, token = min(5, self.max_len - 2), min(123, self.config.vocab_size - 1)
        start = np.asarray([token, pos], dtype=np.int32)
        try:
            replayed = self.graph(1, pdl=True)  # captured first, on the idle stream
            results = []
            with self.stream:
                rng = cp.random.default_rng(0)
                for cache in (self.k_cache, self.v_cache):
                    values = rng.standard_normal(cache[:, :, :pos].shape, dtype=cp.float32)
                    cache[:, :, :pos] = bf16_bits(cp, values) if cache.dtype == cp.uint16 else values
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

    # -- whole sequences: prefill and the no-cache mode --------------------------------------------

    def reserve(self, T: int) -> None:
        """Whole-sequence activations for passes of up to T positions: allocated for the longest pass a
        run asks for (the prompt's, or the no-cache mode's last), kept, and regrown only for a longer one."""
        if T <= self.rows:
            return
        cp, C, F = self.cp, self.config.n_embd, self.config.mlp_width
        self.work = {}  # the shorter buffers go back to the pool first
        with self.stream:
            self.work = {name: cp.zeros((T, width), dtype=cp.float32)
                         for name, width in (("x", C), ("h", C), ("qkv", 3 * C), ("merged", C), ("y", C), ("f", F))}
            if self.dtype == "bfloat16":  # a product's input rounded to bfloat16, (rows, K) for any K
                self.work["a16"] = cp.zeros(T * max(C, F), dtype=cp.uint16)
        self.rows = T

    def tiles(self) -> list[dict]:
        """gemm.cu's split and tiled copies of every layer's linear weights (gemm_weight), made on the
        first pass that uses them and kept."""
        if self.gemm_weights is None:
            with self.stream:
                self.gemm_weights = [{name: gemm_weight(self.cp, W.T) for name, W in layer.items()}
                                     for layer in self.layers]
        return self.gemm_weights

    def product(self, a, layer: int, linear: str, out, epi: int, *, tiled: bool) -> None:
        """out = a @ W, then + bias (GEMM_BIAS) or gelu(. + bias) (GEMM_BIAS_GELU), W the layer's linear
        weight: gemm.cu's 3xTF32 on its tiles (tiled), else cuBLAS on the (out, in) matrix the decode
        step reads (float32: SGEMM; bfloat16: gemmEx on `a` rounded to bfloat16, accumulated in float32)
        and bias_act.cu."""
        M, N = a.shape[0], out.shape[1]
        W, b = self.layers[layer][linear], self.vectors[f"h.{layer}.{linear}.bias"]
        if tiled:
            gemm(self.fn[f"gemm_{epi}"], a, self.tiles()[layer][linear], b, out, self.gemm_partials,
                 self.gemm_tickets, self.sm_count)
            return
        if self.dtype == "bfloat16":  # the operands in the weights' dtype, as the eager model's products
            a16 = self.work["a16"][:a.size].reshape(a.shape)
            self.round_bf16(a, a16)
            a = a16
        self.blas.gemm(a, W.T, out, dtype=self.dtype)
        if epi != GEMM_NONE:
            self.fn["bias_gelu" if epi == GEMM_BIAS_GELU else "bias"](
                (min(-(-M * N // 1024), 4 * self.sm_count),), (256,), (out, b, np.int32(M), np.int32(N)))

    def sequence(self, T: int, attend, *, store_kv: bool) -> None:
        """The forward pass over history[0:T] (eager launches), then ln_f + lm_head + argmax on
        position T - 1, which writes the next token into history[T] and state. With store_kv, every
        layer's keys and values go into the cache (the prefill). Only position T - 1 reaches the
        logits, so the last layer runs its keys and values (and the attention) over every position,
        and everything after the attention on position T - 1 alone. The products run on gemm.cu in the
        no-cache mode's float32 passes where products="3xtf32", else on cuBLAS."""
        cp, c, p, fn = self.cp, self.config, self.vectors, self.fn
        C, NH, HS = c.n_embd, c.n_head, c.head_size
        eps = self.eps
        tiled = not store_kv and self.products == "3xtf32" and self.dtype == "float32"
        self.reserve(T)
        x, h, qkv, merged, y, f = (self.work[k][:T] for k in ("x", "h", "qkv", "merged", "y", "f"))
        views = qkv.reshape(1, T, 3, NH, HS)  # (B, T, 3, NH, hs): columns [q | k | v]
        q, k, v = (views[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (B, NH, T, hs), a view
        # every layer reads the same views: a rung is validated once per pass (kernels.Attend.prepare)
        run_attention = attend.prepare(q, k, v) if hasattr(attend, "prepare") else (lambda: attend(q, k, v))
        grid = (min(-(-T * C // 256), 4 * self.sm_count),)
        fn["embed"]((T,), (256,), (self.wte, self.wpe, self.history, NULL, np.int32(C), x, NULL, np.uint64(0)))
        for i in range(c.n_layer):
            pre = f"h.{i}."
            if i == 0:  # h = ln_1(x)
                residual = (NULL, NULL)
            else:  # x += mlp.c_proj output + bias (previous layer); h = ln_1(x)
                residual = (y, p[f"h.{i - 1}.mlp.c_proj.bias"])
            fn["add_layernorm"]((T,), (256,), (x, *residual, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], eps, h,
                                               np.int32(C)), shared_mem=4 * C)
            self.product(h, i, "attn.c_attn", qkv, GEMM_BIAS, tiled=tiled)
            if store_kv:
                fn["kv_store"](grid, (256,), (qkv, self.k_cache[i], self.v_cache[i], np.int32(T), np.int32(NH),
                                              np.int32(HS), np.int32(self.max_len)))
            o = run_attention()  # (B, NH, T, hs)
            if o.dtype != cp.float32 or o.strides[3] != 4:
                o = cp.ascontiguousarray(o, dtype=cp.float32)
            fn["merge_heads"](grid, (256,), (o, np.int64(o.strides[1] // 4), np.int64(o.strides[2] // 4), merged,
                                             np.int32(T), np.int32(NH), np.int32(HS)))
            if i == c.n_layer - 1:  # from here on, position T - 1 alone
                x, h, merged, y, f = (a[T - 1:] for a in (x, h, merged, y, f))
            rows = x.shape[0]
            self.product(merged, i, "attn.c_proj", y, GEMM_NONE, tiled=tiled)
            # x += attn.c_proj output + bias; h = ln_2(x)
            fn["add_layernorm"]((rows,), (256,), (x, y, p[pre + "attn.c_proj.bias"], p[pre + "ln_2.weight"],
                                                  p[pre + "ln_2.bias"], eps, h, np.int32(C)), shared_mem=4 * C)
            self.product(h, i, "mlp.c_fc", f, GEMM_BIAS_GELU, tiled=tiled)
            self.product(f, i, "mlp.c_proj", y, GEMM_NONE, tiled=tiled)
        # the last position: ln_f(x + mlp.c_proj output + bias), the logits, their argmax
        last = f"h.{c.n_layer - 1}.mlp.c_proj.bias"
        fn["lm_head"]((self.lm_blocks,), (self.lm_warps * 32,),
                      (self.wte, x[-1], y[-1], p[last], p["ln_f.weight"], p["ln_f.bias"], eps,
                       np.int32(c.vocab_size), self.logits if self.logits is not None else NULL, self.block_max,
                       self.block_arg, self.lm_counter, self.state, self.history, NULL, np.uint64(0)))

    # -- generation --------------------------------------------------------------------------------

    def start(self, prompt: list[int], attend, *, kv_cache: bool = True) -> None:
        """Queue the prompt: history[0:T] = prompt, state = {last token, T - 1}, then the whole prompt
        through sequence(), which leaves the first new token in history[T] and state = {it, T}."""
        T = len(prompt)
        if not 1 <= T < self.max_len:
            raise LabError(f"the prompt has {T} tokens; the fast engine holds {self.max_len} positions")
        with self.stream:
            self.history[:T].set(np.asarray(prompt, dtype=np.int32), stream=self.stream)
            self.state.set(np.asarray([prompt[-1], T - 1], dtype=np.int32), stream=self.stream)
            self.sequence(T, attend, store_kv=kv_cache)

    def generate(self, prompt: list[int], n_new: int, *, attend, kv_cache: bool, eos_id: int | None = None,
                 on_token=None, graph: bool = True) -> Generation:
        """n_new greedy tokens after prompt. The GPU runs a window of self.window tokens ahead of
        the host, which hands the previous window's tokens to on_token as they arrive."""
        cp = self.cp
        T0 = len(prompt)
        if T0 + n_new > self.max_len:
            raise LabError(f"{T0} prompt tokens + {n_new} new tokens exceed the engine's {self.max_len} positions")
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # after whatever the caller queued
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
                    if kv_cache:
                        self.decode(count, graph=graph)
                    else:
                        for j in range(count):
                            self.sequence(T0 + produced + j, attend, store_kv=False)
                    pending.append(self._copy_back(T0 + produced, count))
                    produced += count
                event, first, count = pending.popleft()
                event.synchronize()
                for token in self.host_history[first:first + count].tolist():
                    out.tokens.append(token)
                    if on_token is not None:
                        on_token(token)
                    if eos_id is not None and token == eos_id:
                        out.stopped_at_eos = True
                        break
                if out.stopped_at_eos:
                    break
        self.stream.synchronize()  # queued windows past an end-of-text finish before the next use
        return out

    # -- measuring -----------------------------------------------------------------------------------

    def arrays(self) -> list:
        """Every device array the engine holds, found through its attributes (and the lists, dicts and
        DecodeWeights in them), the caller's params aside: views of params among them."""
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
        dtype and decode_layout's layout, none of them a copy of a weight but the persistent step's
        head-major attn.c_proj."""
        return held_bytes(self.arrays(), besides=list(self.params.values()))


    def replay_ms(self, position: int, steps: int = 64, *, prefetch: bool | None = None, pdl: bool | None = None,
                  persistent: bool | None = None, repeats: int = 5) -> float:
        """Milliseconds per decode step from `position` as generate() runs them (median of `repeats` runs
        of `steps` steps): decode_step launches of up to steps_per_launch steps where the engine is
        persistent (persistent=False: the per-operation graphs), else replays of graphs of
        steps_per_graph steps (`steps` rounded down to whole graphs), in a launch variant (default: the
        engine's)."""
        cp = self.cp
        if persistent is None:  # the engine's step, unless a graph variant is asked for
            persistent = self.persistent and prefetch is None and pdl is None
        if persistent and not self.persistent:
            raise LabError(f"the persistent step is {self.persistent_note}")
        if not persistent:
            steps = steps // self.steps_per_graph * self.steps_per_graph
        if steps < 1 or position + steps >= self.max_len:
            raise LabError(f"{steps} steps from position {position} do not fit the engine's {self.max_len} positions")
        big = None if persistent else self.graph(self.steps_per_graph, prefetch, pdl)
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

    def profile_persistent(self, position: int, repeats: int = 5) -> list[tuple[str, float, float, float]]:
        """Where the persistent step's time goes at `position`: per stage (STEP_STAGES per layer, then
        the lm_head), milliseconds from the previous stage's last start (the last block to have its
        inputs) to this one's (total), the slowest block's work from its start to its end of the stage
        (work), and the median block's wait from its end of the stage to its start of the next, for its
        inputs: a handoff's words or the barrier (wait); medians of `repeats` runs of the second of two
        steps, from the global timer that each block's thread 0 reads. Changes state, history and the
        cache at `position` and the next: run generate() again after."""
        cp, c = self.cp, self.config
        if not self.persistent:
            raise LabError(f"the persistent step is {self.persistent_note}")
        if not 0 <= position < self.max_len - 2:
            raise LabError(f"position {position} outside the engine's 0..{self.max_len - 3}")
        stages = len(STEP_STAGES) * c.n_layer + 1
        trace = cp.zeros((2, stages, self.plan.blocks, 2), dtype=cp.uint64)
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            with self.stream:
                self.state.set(np.asarray([0, position], dtype=np.int32), stream=self.stream)
                self.persistent_steps(2, trace)
            self.stream.synchronize()
            t = cp.asnumpy(trace).astype(np.int64)
            arrive, leave = t[..., 0], t[..., 1]  # (step, stage, block) in ns
            last_leave = leave.max(axis=2).reshape(-1)  # stage by stage over both steps
            prev = leave.reshape(-1, self.plan.blocks)[stages - 1:-1]  # each block's departure before stage k
            step = slice(stages, 2 * stages)
            runs.append(np.stack([last_leave[step] - last_leave[stages - 1:-1],
                                  (arrive[1] - prev).max(axis=1),
                                  np.median(leave[1] - arrive[1], axis=1)], axis=1) / 1e6)
        ms = np.median(runs[1:], axis=0)
        names = [f"h.{i}.{kind}" for i in range(c.n_layer) for kind in STEP_STAGES]
        return [(name, *row) for name, row in zip(names + ["ln_f+lm_head+argmax"], ms.tolist(), strict=True)]
