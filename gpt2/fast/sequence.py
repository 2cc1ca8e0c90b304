"""GPT-2's whole-sequence pass on the fast engine: the prefill (keys and values into the cache) and the
mode without a KV cache (the whole sequence every step), eager launches of the fused kernels around the
products (cuBLAS: lm/products.py; or gemm.cu's 3xTF32 on wgmma in the no-cache mode's float32 passes,
launched by gemm) and the attention under test.

The activations a product takes or the attention reads (h, qkv, merged, f) are in the run's dtype: a
bfloat16 run's LayerNorm writes its operand in bfloat16, cuBLAS writes qkv and the MLP's hidden layer in
bfloat16 (their bias and GELU added in place), the attention reads q, k, v where they lie and writes o in
bfloat16, as the eager model's products and attention do; the residual stream x and the products that
add into it (y) stay float32.

With lm.prefill_graph.PREFILL_GRAPHS, the prefill's layers run over a bucket of rows, replayed from a
CUDA graph where the bucket was seen before, and the head on the prompt's last row after them."""

from __future__ import annotations

import numpy as np

from kernels import launcher
from lm import lt, prefill_graph
from lm.prefill_graph import PassGraph, PrefillGraphs, bucket_rows
from lm.products import Blas

from .plan import GEMM_BIAS, GEMM_BIAS_GELU, GEMM_NONE, GEMM_SMEM, GEMM_TILE, NULL, gemm_splits
from .weights import gemm_weight


def choose_products(cp, products: str | None) -> str:
    """The no-cache mode's float32 products: gemm.cu (3xTF32 on wgmma, sm_90a) where the device runs it,
    or cuBLAS SGEMM (the prefill's always run on cuBLAS, on the weights the decode step reads: no copy)."""
    able = int(cp.cuda.Device().compute_capability) == 90
    if products not in (None, "3xtf32", "cublas"):
        raise ValueError(f"products must be '3xtf32' or 'cublas', got {products!r}")
    if products == "3xtf32" and not able:
        raise RuntimeError("products='3xtf32' needs compute capability 9.0 (TF32 wgmma, sm_90a)")
    return products or ("3xtf32" if able else "cublas")


def gemm(fn, a, w_parts: tuple, bias, out, partials, tickets, sm_count: int, splits: int | None = None) -> None:
    """Launch gemm.cu's kernel fn: out (M, N) = a (M, K) @ W with fn's epilogue, W as gemm_weight
    made it; partials (2 x sm_count x 64 x 64 float32) and tickets (sm_count uint32, zeros, left
    zeros) serve split K. splits: gemm_splits' choice unless given."""
    (M, K), N = a.shape, out.shape[1]
    splits = splits or gemm_splits(M, N, K, sm_count)
    tiles = (N // GEMM_TILE) * -(-M // GEMM_TILE)
    if splits > 1 and (splits * tiles * GEMM_TILE**2 > partials.size or tiles > tickets.size):
        raise ValueError(f"{splits} splits of a ({M}, {N}) output need more partial sums or tickets than the buffers hold")
    fn((N // GEMM_TILE, -(-M // GEMM_TILE), splits), (128,),
       (a, *w_parts, bias, out, np.int32(M), np.int32(N), np.int32(K), partials, tickets), shared_mem=GEMM_SMEM)


class WholeSequence:
    """The pass over history[0:T] for one engine, with its activations (allocated for the longest pass
    a run asks for) and gemm.cu's tiled weights and split-K buffers."""

    def __init__(self, engine, products: str):
        cp = engine.cp
        self.engine, self.products = engine, products
        self.rows, self.work = 0, {}
        self.blas = Blas(cp)
        # the bfloat16 products with a bias (and GELU) in cuBLASLt's epilogue (LAB_LT_EPILOGUES=0: not)
        self.lt = lt.Lt(cp) if lt.ENABLED and engine.dtype == "bfloat16" else None
        # gemm.cu's weights, split and tiled on the no-cache mode's first pass (gemm_weight: two float32
        # copies of every linear weight, which a KV-cache run never makes)
        self.gemm_weights = None
        # split K: the splits' sums (fewer than 2 x SMs tiles of 64 x 64) and a ticket per output tile
        self.gemm_partials = cp.zeros(2 * engine.sm_count * GEMM_TILE * GEMM_TILE, dtype=cp.float32)
        self.gemm_tickets = cp.zeros(engine.sm_count, dtype=cp.uint32)
        self.prefills = PrefillGraphs()  # the prefill's graphs, with PREFILL_GRAPHS

    def reserve(self, T: int) -> None:
        """Activations for passes of up to T positions: allocated for the longest pass a run asks for (the
        prompt's, or the no-cache mode's last), kept, and regrown only for a longer one."""
        if T <= self.rows:
            return
        e = self.engine
        cp, C, F = e.cp, e.config.n_embd, e.config.mlp_width
        self.work = {}  # the shorter buffers go back to the pool first
        self.prefills.clear()  # they read the old buffers
        run = self.activation_dtype()
        with e.stream:
            self.work = {name: cp.zeros((T, width), dtype=dtype) for name, width, dtype in
                         (("x", C, cp.float32), ("h", C, run), ("qkv", 3 * C, run), ("merged", C, run),
                          ("y", C, cp.float32), ("f", F, run))}
        self.rows = T

    def activation_dtype(self):
        """The dtype of the activations the products and the attention read: the run's (bfloat16 as
        CuPy's bfloat16, which the attention takes; the kernels see its bits)."""
        if self.engine.dtype != "bfloat16":
            return np.float32
        import ml_dtypes

        return ml_dtypes.bfloat16

    def tiles(self) -> list[dict]:
        """gemm.cu's split and tiled copies of every layer's linear weights (gemm_weight), made on the
        first pass that uses them and kept."""
        e = self.engine
        if self.gemm_weights is None:
            with e.stream:
                self.gemm_weights = [{name: gemm_weight(e.cp, W.T) for name, W in layer.items()} for layer in e.layers]
        return self.gemm_weights

    def product(self, a, layer: int, linear: str, out, epi: int, *, tiled: bool) -> None:
        """out = a @ W, then + bias (GEMM_BIAS) or gelu(. + bias) (GEMM_BIAS_GELU), W the layer's linear
        weight: gemm.cu's 3xTF32 on its tiles (tiled), else cuBLAS on the (out, in) matrix the decode
        step reads (float32: SGEMM; bfloat16: gemmEx, accumulated in float32, out in its own dtype:
        bfloat16 or float32) and bias_act.cu; in bfloat16 (unless LAB_LT_EPILOGUES=0), a product with a bias
        on cuBLASLt, its bias and GELU in the product's epilogue (lm/lt.py)."""
        e = self.engine
        M, N = a.shape[0], out.shape[1]
        W, b = e.layers[layer][linear], e.vectors[f"h.{layer}.{linear}.bias"]
        if tiled:
            gemm(e.fn[f"gemm_{epi}"], a, self.tiles()[layer][linear], b, out, self.gemm_partials,
                 self.gemm_tickets, e.sm_count)
            return
        if epi != GEMM_NONE and self.lt is not None and self.lt.gemm(a, W, b, out, gelu=epi == GEMM_BIAS_GELU):
            return  # one kernel: the product, its bias and GELU (lm/lt.py)
        self.blas.gemm(a, W.T, out, dtype=e.dtype)  # a in the weights' dtype, as the eager model's products
        if epi != GEMM_NONE:  # 8 elements a thread (16 bytes of bfloat16), 8 blocks of 256 an SM at most
            e.fn["bias_gelu" if epi == GEMM_BIAS_GELU else "bias"](
                (min(-(-M * N // 2048), 8 * e.sm_count),), (256,), (out, b, np.int32(M), np.int32(N)))

    def run(self, T: int, attend, *, store_kv: bool) -> None:
        """The forward pass over history[0:T], then ln_f + lm_head + argmax on position T - 1, which
        writes the next token into history[T] and state. With store_kv, every layer's keys and values go
        into the cache (the prefill): eager launches, or with PREFILL_GRAPHS a pass over a bucket of
        rows (prefill_rows), replayed from a graph where the bucket was seen before. The products run
        on gemm.cu in the no-cache mode's float32 passes where products="3xtf32", else on cuBLAS."""
        e = self.engine
        if store_kv and prefill_graph.PREFILL_GRAPHS:
            rows = bucket_rows(T, e.max_len)
            self.reserve(rows)

            def passes(run_attention):  # the prompt's last row is one of the bucket's last PREFILL_BUCKET
                return self.layers(rows, run_attention, store_kv=True, tiled=False,
                                   tail=min(prefill_graph.PREFILL_BUCKET, rows))

            def prepare():
                return launcher(attend, *self.qkv_views(rows))

            graph = self.prefills.get((rows, attend), lambda: PassGraph(e.cp, e.stream, passes, prepare))
            if graph is None:  # the bucket's first pass, or one that cannot be captured
                residual = passes(prepare())
            else:
                graph.launch(e.stream)
                residual = graph.out
        else:
            self.reserve(T)
            tiled = not store_kv and self.products == "3xtf32" and e.dtype == "float32"
            residual = self.layers(T, launcher(attend, *self.qkv_views(T)), store_kv=store_kv, tiled=tiled, tail=1)
        self.head(T, residual)

    def qkv_views(self, T: int) -> tuple:
        """q, k, v (1, NH, T, hs) views of the qkv buffer's first T rows, columns [q | k | v]."""
        c = self.engine.config
        views = self.work["qkv"][:T].reshape(1, T, 3, c.n_head, c.head_size)  # (B, T, 3, NH, hs)
        return tuple(views[:, :, i].transpose(0, 2, 1, 3) for i in range(3))

    def layers(self, T: int, run_attention, *, store_kv: bool, tiled: bool, tail: int) -> tuple:
        """Embeddings and every layer over rows 0..T-1 of the work buffers; run_attention() -> o is the
        attention prepared on qkv_views(T). Only the last position reaches the logits, so the last layer
        runs its keys and values (and the attention) over every row and everything after the attention
        on its last `tail` rows alone: 1 where T is the prompt's length, the bucket's step in a graphed
        pass (whose prompt ends somewhere in them). Returns what the head still adds to x (add_product's
        residual)."""
        e = self.engine
        c, p, fn = e.config, e.vectors, e.fn
        C, NH, HS = c.n_embd, c.n_head, c.head_size
        x, h, qkv, merged, y, f = (self.work[k][:T] for k in ("x", "h", "qkv", "merged", "y", "f"))
        rows = (T,)  # kv_store's and merge_heads' grid: a block a row
        fn["embed"]((T,), (256,), (e.wte, e.wpe, e.history, NULL, np.int32(C), x, NULL, np.uint64(0)))
        residual = (NULL, NULL)
        for i in range(c.n_layer):
            pre = f"h.{i}."
            # h = ln_1(x), after the previous layer's x += mlp.c_proj output + bias where that is left to do
            fn["add_layernorm"]((T,), (256,), (x, *residual, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], e.eps, h,
                                               np.int32(C)), shared_mem=4 * C)
            self.product(h, i, "attn.c_attn", qkv, GEMM_BIAS, tiled=tiled)
            if store_kv:
                fn["kv_store"](rows, (256,), (qkv, e.k_cache[i], e.v_cache[i], np.int32(T), np.int32(NH),
                                              np.int32(HS), np.int32(e.max_len)))
            self._merge_heads(run_attention(), merged, T)
            if i == c.n_layer - 1:  # from here on, the last `tail` rows alone
                x, h, merged, y, f = (a[T - tail:T] for a in (x, h, merged, y, f))
            residual = self.add_product(merged, i, "attn.c_proj", x, y, tiled=tiled)
            # x += attn.c_proj output + bias, where the product left it; h = ln_2(x)
            fn["add_layernorm"]((x.shape[0],), (256,), (x, *residual, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"],
                                                        e.eps, h, np.int32(C)), shared_mem=4 * C)
            self.product(h, i, "mlp.c_fc", f, GEMM_BIAS_GELU, tiled=tiled)
            residual = self.add_product(f, i, "mlp.c_proj", x, y, tiled=tiled)
        return residual

    def add_product(self, a, layer: int, linear: str, x, y, *, tiled: bool) -> tuple:
        """A product that feeds the residual stream: x += a @ W + bias in the product's own epilogue where
        it can (bfloat16 on cuBLASLt, lm/lt.py), then (NULL, NULL), nothing left to add; else y = a @ W
        and (y, bias), which the next add_layernorm (or the head) adds into x."""
        e = self.engine
        b = e.vectors[f"h.{layer}.{linear}.bias"]
        if not tiled and self.lt is not None and self.lt.gemm(a, e.layers[layer][linear], b, x, add=True):
            return NULL, NULL
        self.product(a, layer, linear, y, GEMM_NONE, tiled=tiled)
        return y, b

    def head(self, T: int, residual: tuple) -> None:
        """Position T - 1: ln_f(x + the last layer's residual, as layers() returned it), the logits, their
        argmax into history[T] and state."""
        e = self.engine
        c, p = e.config, e.vectors
        x = self.work["x"][T - 1]
        y, bias = (NULL, NULL) if residual[0] is NULL else (self.work["y"][T - 1], residual[1])
        e.fn["lm_head"]((e.lm_blocks,), (e.lm_warps * 32,),
                        (e.wte, x, y, bias, p["ln_f.weight"], p["ln_f.bias"], e.eps,
                         np.int32(c.vocab_size), e.logits if e.logits is not None else NULL, e.block_max,
                         e.block_arg, e.lm_counter, e.state, e.history, NULL, np.uint64(0)))

    def _merge_heads(self, o, merged, T: int) -> None:
        """The attention's output o (B, NH, T, hs), any strides, into merged (T, C): heads side by side,
        in the run's dtype."""
        e = self.engine
        cp, c = e.cp, e.config
        item = merged.itemsize
        if o.dtype != merged.dtype or o.strides[3] != item:
            o = cp.ascontiguousarray(o, dtype=merged.dtype)
        e.fn["merge_heads"]((T,), (256,), (o, np.int64(o.strides[1] // item), np.int64(o.strides[2] // item), merged,
                                           np.int32(T), np.int32(c.n_head), np.int32(c.head_size)))

