"""Fast greedy generation on the GPU: fused kernels, a static KV cache, the decode step as one
persistent kernel (or CUDA graphs of per-operation kernels).

    out = fast.generate(params, config, prompt, n_new, attend=attend, kv_cache=True)   what generate() calls
    engine = fast.engine_for(params, config, dtype="bfloat16")                           the cached engine
    engine.profile_step(position)                                                        per-kernel milliseconds
    engine.profile_persistent(position)                                                  per-stage milliseconds

gpt2/model.py stays the readable definition of GPT-2; this module runs the same network with fewer,
larger kernels (kernels/fused/*.cu, each tested against the CuPy code it replaces):

- Decode (KV cache, one token per step): a step is a fixed sequence of launches on fixed buffers,
  reading its only inputs, the token and its position, from device memory (`state`), so it is
  captured once as a CUDA graph (STEPS_PER_GRAPH steps per graph) and replayed with no host
  arguments. Per layer five kernels:
      ln_1 + c_attn (+ bias)              gemv, LayerNorm fused in front
      attention over the cache            decode_attention (split over the keys; stores k, v at pos)
      attn.c_proj + bias + residual       gemv, the residual added in place
      ln_2 + c_fc + bias + GELU           gemv
      mlp.c_proj + bias + residual        gemv
  plus embed at the start and ln_f + lm_head + argmax at the end, which also writes the token into
  `history` and advances `state`: 5 * n_layer + 2 kernels per token (62 for GPT-2 small).
  Between kernels, two ways to keep memory busy: each kernel that reads a matrix asks L2 to prefetch
  the next kernel's matrix (cp.async.bulk.prefetch.L2, a hint), and on Hopper the graphs are built
  from programmatic dependent launches (cuLaunchKernelEx), so that a kernel starts, and issues its
  weight loads, while the previous one finishes; it waits (griddepcontrol.wait) before reading
  activations, and reads them through L2 (kernels/fused/common.cuh, fresh()): an SM's L1 may still
  hold lines of x that the previous kernel's blocks read there before other SMs wrote them, and
  with plain L1 loads PDL graphs parted from plain launches after a few dozen tokens. On by default
  where the device has it (compute capability 9.0) and one replayed step matches plain launches
  bit for bit; pdl=False keeps plain launches.
  The linear layers read transposed copies of the Conv1D weights, (out, in), made once here, so that
  a warp reads one output's weights contiguously: on the fast path the linear weights are held
  twice (the (in, out) originals stay for the prefill's matrix products). In bfloat16 the matrices
  (wte, wpe and the linear weights) are rounded once to bfloat16 and the KV cache is bfloat16;
  LayerNorm parameters, biases, activations and every accumulation stay float32.
- The persistent step (the default where it runs: compute capability 9.0 with cooperative launch, a
  head size that is a multiple of 32, shapes that fit shared memory; step_plan says why not):
  kernels/fused/decode_step.cu runs the same operations for a whole window of steps in one
  cooperative launch, one block per SM, where the per-operation step has a kernel boundary a handoff
  of words that carry their step (the reader waits for the words it needs; one grid barrier per
  token, after the argmax), and each block's share of the weights copied into shared
  memory ahead of its use. Four stages per layer (STEP_STAGES): attn.c_proj is done per head inside
  the attention stage, from a head-major copy of its weight made here. One launch per window of
  STEPS_PER_LAUNCH tokens; persistent=False keeps the graphs.
- Prefill, and every step of the no-cache mode: the whole sequence eagerly, the attention under test,
  and fused kernels around it (residual add + LayerNorm, head merge, KV store). The products run on
  kernels/fused/gemm.cu where the device is sm_90 (products="3xtf32", the default there): float32 at
  float32 accuracy on TF32 wgmma, with the bias or bias + GELU in its epilogue and K split across
  blocks where the output tiles are fewer than the SMs; its weights are split and tiled once here
  (gemm_weight: two float32 copies of every linear weight). Elsewhere, or with products="cublas",
  cuBLAS SGEMM (through CuPy's handle, no TF32) and bias_act.cu. Only the last position reaches the
  logits, so the last layer runs its attention over every position and everything after it on the
  last position alone; then the same ln_f + lm_head + argmax kernel. The attention under test is
  validated once per pass (kernels.Attend.prepare): every layer reads the same qkv views. In bfloat16
  the prefill computes in float32 on the bfloat16-rounded weights, so both phases see the same weights.
- Greedy only: tokens stay on the device (`history`), copied back in windows (STEPS_PER_LAUNCH tokens,
  STEPS_PER_GRAPH with graphs) through pinned memory while the GPU runs the next window, so on_token
  still streams.
"""

from __future__ import annotations

import ctypes
import math
import re
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from kernels import fused

from .config import GPT2Config
from .errors import LabError
from .generate import Generation

STEPS_PER_GRAPH = 8  # decode steps per captured graph, and tokens per copy back to the host
# decode steps per decode_step.cu launch, and tokens per copy back to the host, where the engine is
# persistent: a launch boundary costs about 12 us (the launch, the copy back, the weight stream's first
# items). H200, GPT-2 small, decode tokens/s as bench.py e2e measures them, windows of 8 / 16 / 32 / 64:
# bfloat16 6,809 / 6,854 / 6,877 / 6,884, float32 4,851 / 4,870 / 4,880 / 4,882.
STEPS_PER_LAUNCH = 32
PREFETCH_CAP = 16 << 20  # bytes of the next kernel's weights a kernel asks L2 to fetch (L2: 50 MB on H100/H200)
DTYPES = ("float32", "bfloat16")
EPI_BIAS, EPI_GELU, EPI_RESIDUAL = 0, 1, 2  # gemv.cu's epilogues
NULL = np.uint64(0)  # a null pointer argument
GEMM_OPTIONS = ("-arch=sm_90a",)  # gemm.cu: TF32 wgmma
GEMM_TILE, GEMM_BK, GEMM_STAGES = 64, 32, 4  # gemm.cu's output tile (square), K tile and pipeline depth
GEMM_SMEM = 2048 + GEMM_STAGES * (2 * GEMM_TILE * GEMM_BK * 4 + GEMM_TILE * (GEMM_BK + 4) * 4)  # its shared memory
GEMM_NONE, GEMM_BIAS, GEMM_BIAS_GELU = 0, 1, 2  # gemm.cu's epilogues
CACHE_SIZE = 2  # engines kept (each holds its own weight copies and a KV cache of n_positions)


# -- what the fast path runs ---------------------------------------------------------------------


def param_dtype(params: dict) -> str:
    return params["wte.weight"].dtype.name


def unsupported_reason(params: dict, config: GPT2Config, *, kv_cache: bool, sampler=None,
                       record_logits: bool = False, dtype: str | None = None) -> str | None:
    """None when fast.generate runs this generation; otherwise why generate() takes the eager path."""
    if isinstance(params["wte.weight"], np.ndarray):
        return "NumPy arrays: the fast path runs on the GPU"
    if sampler is not None and sampler.temperature != 0:
        return "sampling: the fast path is greedy (argmax on the device)"
    if record_logits:
        return "recording logits: the fast path never writes them"
    dtype = dtype or param_dtype(params)
    if dtype not in DTYPES:
        return f"dtype {dtype}: the fast path runs {' and '.join(DTYPES)}"
    if not kv_cache and dtype != "float32":
        return "no-cache mode in bfloat16: the fast no-cache path computes in float32"
    C, HS = config.n_embd, config.head_size
    if C % 8 or config.mlp_width % 8:
        return f"widths {C} and {config.mlp_width} must be multiples of 8 (whole 16-byte rows)"
    if HS % 8 or 32 % (HS // 8) or HS > 256:
        return f"head size {HS}: decode_attention needs a multiple of 8 with head_size / 8 dividing 32"
    return None


def generate(params: dict, config: GPT2Config, prompt: list[int], n_new: int, *, attend, kv_cache: bool,
             eos_id: int | None = None, on_token=None, graph: bool = True, dtype: str | None = None) -> Generation:
    """Greedy generation as gpt2.generate does it, on the cached engine for these weights."""
    return engine_for(params, config, dtype).generate(prompt, n_new, attend=attend, kv_cache=kv_cache, eos_id=eos_id,
                                                     on_token=on_token, graph=graph)


_engines: OrderedDict = OrderedDict()


def engine_for(params: dict, config: GPT2Config, dtype: str | None = None, **options) -> Engine:
    """The engine for these weights (by the arrays' addresses), built once and kept (CACHE_SIZE most
    recent). The engine copies the weights: after editing params in place, call clear_cache()."""
    dtype = dtype or param_dtype(params)
    key = (config, dtype, tuple(sorted(options.items())),
           tuple((name, a.data.ptr, a.dtype.str, a.shape) for name, a in sorted(params.items())))
    engine = _engines.get(key)
    if engine is None:
        engine = Engine(params, config, dtype=dtype, **options)
        _engines[key] = engine
        while len(_engines) > CACHE_SIZE:
            _engines.popitem(last=False)
    _engines.move_to_end(key)
    return engine


def clear_cache() -> None:
    _engines.clear()


# -- weights ---------------------------------------------------------------------------------------


def to_float32(cp, a):
    """float32 from float32 or bfloat16 (widened through its bits: no CuPy bfloat16 arithmetic needed)."""
    if a.dtype.name == "bfloat16":
        return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return cp.ascontiguousarray(a, dtype=cp.float32)


def bf16_bits(cp, a32):
    """float32 -> bfloat16 bits in uint16, rounded to nearest even (as kernels/fused/common.cuh does)."""
    bits = cp.ascontiguousarray(a32, dtype=cp.float32).view(cp.uint32)
    return ((bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def round_to_bf16(cp, a32):
    """float32 values rounded to bfloat16, held in float32."""
    return (bf16_bits(cp, a32).astype(cp.uint32) << 16).view(cp.float32)


def as_bfloat16(params: dict) -> dict:
    """Every parameter as a bfloat16 CuPy array (rounded to nearest even): the weights of a bfloat16
    run, from which the engine takes its dtype."""
    import cupy as cp
    import ml_dtypes

    try:
        return {name: bf16_bits(cp, to_float32(cp, a)).view(ml_dtypes.bfloat16) for name, a in params.items()}
    except (TypeError, ValueError) as exc:
        raise LabError(f"CuPy cannot hold bfloat16 arrays here ({type(exc).__name__}: {exc})") from None


MATRICES = ("wte.weight", "wpe.weight", "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
            "mlp.c_proj.weight")


def is_matrix(name: str) -> bool:
    return name.endswith(MATRICES)


def weight_bytes_per_token(config: GPT2Config, dtype: str) -> int:
    """Bytes of weights one decode step reads: every matrix once (wte whole, for the logits; one wpe
    row), and the float32 biases and LayerNorm parameters. The KV cache is not counted."""
    C, F, V = config.n_embd, config.mlp_width, config.vocab_size
    item = 2 if dtype == "bfloat16" else 4
    matrices = config.n_layer * (C * 3 * C + C * C + C * F + F * C) + V * C + C
    vectors = config.n_layer * (3 * C + C + F + C + 4 * C) + 2 * C
    return item * matrices + 4 * vectors


def kv_bytes_per_token(config: GPT2Config, dtype: str, position: int) -> int:
    """Bytes of keys and values one decode step at `position` reads (positions 0..position)."""
    item = 2 if dtype == "bfloat16" else 4
    return 2 * config.n_layer * config.n_embd * (position + 1) * item


def gemv_shape(N: int, K: int, itemsize: int, *, most_rows: int = 2, loads: int = 8) -> tuple[int, int]:
    """(warps per block, rows per warp) for gemv.cu: about `loads` 16-byte loads in flight per lane,
    8 warps per block for wide outputs, 4 for narrow ones (more blocks to spread over the SMs)."""
    chunks = K // (16 // itemsize)  # 16-byte vectors per row
    iters = -(-chunks // 32)  # per lane
    rows = max(1, min(most_rows, loads // iters))
    warps = 8 if N > 1024 else 4
    return warps, rows


def lm_head_shape(config: GPT2Config, dtype: str) -> tuple[int, int]:
    """(warps, rows per group) of lm_head_argmax.cu: 8 warps, groups of about 8 16-byte loads per lane
    (two groups in flight, so about 16 loads per lane), at least one row."""
    iters = -(-config.n_embd // (16 // (2 if dtype == "bfloat16" else 4)) // 32)  # 16-byte loads per row, per lane
    return 8, max(1, 8 // iters)


def lm_head_blocks(fn, warps: int, rows: int, V: int, sm_count: int) -> int:
    """lm_head_argmax.cu's grid: one wave, as many blocks as the SMs hold at once (the kernel's
    occupancy), no more than there are row groups for their warps."""
    import cupy

    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, warps * 32, 0)
    groups = -(-V // rows)
    return max(1, min(sm_count * per_sm, -(-groups // warps)))


def kernel_expressions(config: GPT2Config, dtype: str) -> dict[str, tuple[str, str]]:
    """Every kernel the engine compiles for this model and dtype: key -> (kernels/fused file, name
    expression). No device needed: the CPU tests compile exactly these."""
    C, F, HS = config.n_embd, config.mlp_width, config.head_size
    item = 2 if dtype == "bfloat16" else 4
    wt = "unsigned short" if dtype == "bfloat16" else "float"

    def gemv(N, K, ln, epi):
        warps, rows = gemv_shape(N, K, item)
        return "gemv", f"gemv<{wt}, {K}, {warps}, {rows}, {'true' if ln else 'false'}, {epi}>"

    lm_warps, lm_rows = lm_head_shape(config, dtype)
    lm32_warps, lm32_rows = lm_head_shape(config, "float32")
    return {
        "c_attn": gemv(3 * C, C, True, EPI_BIAS),
        "c_proj": gemv(C, C, False, EPI_RESIDUAL),
        "c_fc": gemv(F, C, True, EPI_GELU),
        "mlp_proj": gemv(C, F, False, EPI_RESIDUAL),
        "attention": ("decode_attention", f"decode_attention<{wt}, {HS}, {attention_warps(config)}>"),
        "embed": ("embed", f"embed<{wt}>"),
        "lm_head": ("lm_head_argmax", f"lm_head_argmax<{wt}, {C}, {lm_warps}, {lm_rows}>"),
        # the eager path (prefill, no-cache) computes in float32
        "embed32": ("embed", "embed<float>"),
        "lm_head32": ("lm_head_argmax", f"lm_head_argmax<float, {C}, {lm32_warps}, {lm32_rows}>"),
        "add_layernorm": ("layernorm", "add_layernorm<256>"),
        "bias": ("bias_act", "bias_act<false>"),
        "bias_gelu": ("bias_act", "bias_act<true>"),
        "kv_store": ("kv_store", f"kv_store<{wt}>"),
        "merge_heads": ("merge_heads", "merge_heads"),
        "spin": ("spin", "spin"),
        **({"decode_step": ("decode_step", f"decode_step<{wt}, {C}, {config.n_head}, {HS}, {F}, {STEP_THREADS}>")}
           if HS % 32 == 0 and STEP_THREADS % HS == 0 else {}),
    }


def gemm_weight(cp, w) -> tuple:
    """A Conv1D weight (K, N) as gemm.cu reads it: W^T (N, K) split into big = W^T rounded to TF32
    (nearest, ties away: add half an ulp, clear 13 bits) and small = W^T - big, each cut into tiles of
    GEMM_TILE rows x GEMM_BK columns stored one after the other (a block's tiles along K contiguous),
    and within a tile the 128-byte swizzle: row r's 16-byte chunk c at c ^ (r mod 8)."""
    K, N = w.shape
    if N % GEMM_TILE or K % GEMM_BK:
        raise ValueError(f"gemm.cu needs N % {GEMM_TILE} == 0 and K % {GEMM_BK} == 0, got (K, N) = ({K}, {N})")
    wt = cp.ascontiguousarray(w.T, dtype=cp.float32)  # (N, K)
    big = ((wt.view(cp.uint32) + cp.uint32(0x1000)) & cp.uint32(0xffffe000)).view(cp.float32)
    small = wt - big
    r = cp.arange(GEMM_TILE)[:, None]
    k = cp.arange(GEMM_BK)[None, :]
    col = ((k // 4) ^ (r % 8)) * 4 + k % 4  # (row, k) -> its float within the swizzled row

    def tiles(a):
        a = a.reshape(N // GEMM_TILE, GEMM_TILE, K // GEMM_BK, GEMM_BK).transpose(0, 2, 1, 3)  # (n tile, k tile, r, k)
        out = cp.empty(a.shape, dtype=cp.float32)
        out[:, :, r, col] = a
        return out

    return tiles(big), tiles(small)


def gemm_splits(M: int, N: int, K: int, sm_count: int) -> int:
    """gemm.cu's splits of K (grid z): where the output tiles are fewer than the SMs, enough splits to
    give every SM a block, each split keeping at least two K tiles."""
    blocks = (N // GEMM_TILE) * -(-M // GEMM_TILE)
    return max(1, min(-(-sm_count // blocks), K // GEMM_BK // 2))


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


def gemm_expressions() -> dict[str, tuple[str, str]]:
    """gemm.cu's instantiations, one per epilogue (compiled with GEMM_OPTIONS, for sm_90a)."""
    return {f"gemm_{epi}": ("gemm", f"gemm_tf32x3<{epi}>") for epi in (GEMM_NONE, GEMM_BIAS, GEMM_BIAS_GELU)}


def attention_warps(config: GPT2Config) -> int:
    return max(4, config.head_size // 32)  # a block holds at least one thread per element of a head


STAGE_BYTES = 64 << 10  # shared memory for the K and V rows a decode_attention block copies before its wait


def attention_staging(max_len: int, splits: int, head_size: int, itemsize: int) -> tuple[int, int]:
    """(rows staged per block, dynamic shared memory bytes) of decode_attention.cu: the scores of the
    longest chunk, ceil(max_len / splits) floats, then K and V rows, up to STAGE_BYTES."""
    cap = -(-max_len // splits)
    rows = min(cap, STAGE_BYTES // (2 * head_size * itemsize))
    return rows, 4 * (-(-cap // 4) * 4) + 2 * rows * head_size * itemsize


STEP_THREADS = 320  # decode_step.cu's compute threads (a multiple of 64); one more warp issues the weight stream
STEP_BLOCK = STEP_THREADS + 32  # 11 warps, at most 3 on an SM sub-partition: up to 168 registers a thread
STEP_SLOTS = 8  # at most this many weight slots in decode_step.cu's ring
STEP_MAX_SPLITS = 12  # decode_step.cu's MAX_SPLITS
# Key splits per head that stage B starts from (step_plan takes more where these do not fit). Fewer
# splits than the G // NH that would give every block one: a head's splits wait for each other, and
# each more split is one more block to wait for. H200, GPT-2 small, us a token at position 264 (519):
# bfloat16 with 11 / 7 / 6 / 5 splits 169 / 165 / 160 / 165 (171 / 167 / 163 / 169), float32 with
# 11 / 9 / 8 / 7 splits 223 / 219 / 219 / 224 (224 / 221 / 220 / 224); bigger splits grow the slot.
# With the LayerNorms folded (later, same run, at 264): bfloat16 5 / 6 / 7 146.8 / 145.5 / 147.3,
# float32 7 / 8 / 9 208.0 / 206.8 / 206.4.
STEP_SPLITS = {"float32": 8, "bfloat16": 6}
STEP_STAGES = ("ln_1+attn.c_attn", "attn+attn.c_proj", "residual+ln_2+mlp.c_fc+gelu",
               "mlp.c_proj+residual")  # decode_step.cu's stages A-D of a layer (E, the lm_head, ends the step)
STEP_STATIC_SMEM = 4 << 10  # headroom for decode_step.cu's static shared memory (about 2 KB)


LAYER_POINTERS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight",
                  "attn.c_attn.fold", "attn.c_proj.bias", "mlp.c_fc.fold", "mlp.c_proj.bias",
                  "ln_1.weight", "ln_2.weight", "k_cache", "v_cache")  # decode_step.cu's Layer
FOLDS = {"attn.c_attn": "ln_1", "mlp.c_fc": "ln_2"}  # the linear layers decode_step.cu folds a LayerNorm into


def layernorm_fold(cp, W, bias, ln_w, ln_b):
    """decode_step.cu's fold of a LayerNorm into the rows after it: (N, 2) float32 pairs, per row n of
    W (out, in) the sum_k W_nk ln_w_k and bias_n + sum_k W_nk ln_b_k, computed in float64, so that
    LN(x) . W_n + bias_n = r (sum_k W_nk ln_w_k x_k - mean * fold[n, 0]) + fold[n, 1], r = 1 / std."""
    W64 = W.astype(cp.float64)
    return cp.stack([W64 @ ln_w.astype(cp.float64), bias.astype(cp.float64) + W64 @ ln_b.astype(cp.float64)],
                    axis=1).astype(cp.float32)


@dataclass(frozen=True)
class StepPlan:
    """decode_step.cu's geometry for one model, dtype and device: G blocks (one per SM), `splits` key
    splits per head in stage B, a ring of `slots` shared-memory slots of `slot_bytes` each (the largest
    item of the weight stream), wte streamed `lm_rows` rows per item past the first `lm_keep` of a
    block's rows, which it keeps in shared memory, `smem` dynamic bytes in all."""

    blocks: int
    splits: int
    slot_bytes: int
    slots: int
    lm_rows: int
    lm_keep: int
    smem: int


def step_plan(config: GPT2Config, dtype: str, sm_count: int, max_len: int, smem_limit: int) -> StepPlan | str:
    """The persistent step's geometry (kernels/fused/decode_step.cu), or why it cannot run these shapes."""
    NH, HS = config.n_head, config.head_size
    item = 2 if dtype == "bfloat16" else 4
    if HS % 32 or STEP_THREADS % HS:
        return f"head size {HS}: decode_step needs a multiple of 32 dividing {STEP_THREADS}"
    G = sm_count
    most = min(G // NH, STEP_MAX_SPLITS)
    if most < 1:
        return f"{NH} heads on {G} SMs: decode_step needs a block per head"
    why = ""
    for splits in range(min(STEP_SPLITS[dtype], most), most + 1):  # the fewest from STEP_SPLITS that fit
        plan = _step_plan(config, item, G, splits, max_len, smem_limit)
        if isinstance(plan, StepPlan):
            return plan
        why = plan
    return why


def _step_plan(config: GPT2Config, item: int, G: int, splits: int, max_len: int, smem_limit: int) -> StepPlan | str:
    """step_plan with `splits` key splits per head."""
    C, HS, F = config.n_embd, config.head_size, config.mlp_width
    cap = -(-max_len // splits)  # keys per split, at most
    if cap > F:
        return f"{cap} keys per split: decode_step keeps the scores in {F} floats"

    def rows(N):
        return -(-N // G)

    def linear(N, K, ln):  # decode_step.cu's linear_item: rows, then LayerNorm's weight and folds, or biases
        return rows(N) * K * item + (4 * K + 8 * (rows(N) + 2) if ln else 4 * (rows(N) + 8))

    biggest = max(linear(3 * C, C, True), linear(F, C, True), linear(C, F, False))
    attention = (2 * cap + -(-C // splits)) * HS * item  # a split's keys and values, its rows of W_proj[h]
    slot = -(-max(biggest, attention, 8 * C + C * item) // 128) * 128
    table = config.n_layer * 8 * len(LAYER_POINTERS)
    fixed = 128 + 4 * (F + C) + table + STEP_STATIC_SMEM  # mbarriers, the input vector and x, the table
    slots = min(STEP_SLOTS, (smem_limit - fixed) // slot)
    if slots < 2:
        return f"decode_step needs two slots of {slot} bytes and {fixed} more of shared memory; the device has {smem_limit}"
    def parts(K):  # decode_step.cu's rows_dot: a row in P parts of at most 768 weights
        return -(-K // 768)

    for N, K in ((3 * C, C), (F, C), (C, F)):  # stages A, C, D
        if rows(N) * parts(K) > STEP_THREADS:
            return f"{rows(N)} rows of {K} per block: more row parts than decode_step's {STEP_THREADS} threads"
    # stage E: chunks of lm_rows rows of wte with their folds (decode_step.cu's wte_rows), and the rows a
    # block keeps in the shared memory left over (KeptRows: the rows, LN_f's weight, the folds), at
    # least one row less than its share, so that every block streams at least one chunk. Chunks as large
    # as the slot: in bfloat16 (38 rows) 30 rows a chunk, one round of rows_dot's tasks in place of two,
    # was no faster (144.4 against 144.1 us a token, H200, position 264, same run), and 33 slower (146.6).
    lm_rows = max(1, min(STEP_THREADS // parts(C), (slot - 16) // (C * item + 8)))
    left = smem_limit - fixed - slots * slot - 4 * C - 16
    lm_keep = max(0, min(STEP_THREADS // parts(C), rows(config.vocab_size) - 1, left // (C * item + 8)))
    kept = lm_keep * C * item + 4 * C + 8 * (lm_keep + 2)
    return StepPlan(blocks=G, splits=splits, slot_bytes=slot, slots=slots, lm_rows=lm_rows, lm_keep=lm_keep,
                    smem=128 + slots * slot + 4 * (F + C) + table + kept)


# -- launches --------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One kernel launch with fixed arguments: the unit of the decode step. With pdl, launched through
    cuLaunchKernelEx with programmatic stream serialization on `stream` (see kernels/fused/common.cuh)."""

    name: str
    fn: object
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int = 0
    pdl: bool = False
    stream: int = 0  # the CUstream handle of a pdl launch

    def __call__(self):
        if not self.pdl:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)
            return
        if not hasattr(self, "_packed"):
            self._packed = _pack_launch(self)
        config, function, params = self._packed[:3]
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), function, params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx({self.name}) failed: {_driver_error(status)}")


# cuLaunchKernelEx through ctypes (cuda.h, CUDA 12+): CuPy launches have no launch attributes.
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _libcuda = lib
    return _libcuda


def _driver_error(status: int) -> str:
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(status, ctypes.byref(text))
    return f"CUresult {status}" + (f" ({text.value.decode()})" if text.value else "")


def _pack_launch(launch: Launch):
    """(config, CUfunction, kernelParams, and what they point into) for cuLaunchKernelEx."""
    values = []
    for a in launch.args:
        if isinstance(a, np.uint64):
            values.append(ctypes.c_uint64(int(a)))
        elif isinstance(a, np.int64):
            values.append(ctypes.c_int64(int(a)))
        elif isinstance(a, np.int32):
            values.append(ctypes.c_int32(int(a)))
        elif isinstance(a, np.float32):
            values.append(ctypes.c_float(float(a)))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):  # a CuPy array: its device pointer
            values.append(ctypes.c_void_p(a.data.ptr))
        else:
            raise TypeError(f"{launch.name}: cannot pass {type(a).__name__} to cuLaunchKernelEx")
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attribute = _Attribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.programmaticStreamSerializationAllowed = 1
    grid, block = (tuple(launch.grid) + (1, 1))[:3], (tuple(launch.block) + (1, 1))[:3]
    config = _Config(*grid, *block, launch.shared_mem, ctypes.c_void_p(launch.stream), ctypes.pointer(attribute), 1)
    return config, ctypes.c_void_p(launch.fn.kernel.ptr), params, values, attribute


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


class _Sgemm:
    """out (M, N) = a (M, K) @ b (K, N), row-major float32, through cuBLAS SGEMM on CuPy's handle:
    a few microseconds of Python instead of cupy.matmul's tens. Plain float32 (the handle's default
    math mode: no TF32). Falls back to cupy.matmul where the low-level binding is missing."""

    def __init__(self, cp):
        self.cp = cp
        try:
            from cupy_backends.cuda.libs import cublas

            self.cublas, self.handle = cublas, cp.cuda.device.get_cublas_handle()
        except Exception:  # pragma: no cover - depends on the CuPy build
            self.cublas = None
        self.one, self.zero = np.ones(1, np.float32), np.zeros(1, np.float32)

    def begin(self):
        """Before a run of products: host pointer mode, and the handle on the current stream (CuPy sets
        its handle's stream before each of its own calls, so another stream may be left on it)."""
        if self.cublas is not None:
            self.cublas.setPointerMode(self.handle, self.cublas.CUBLAS_POINTER_MODE_HOST)
            self.cublas.setStream(self.handle, self.cp.cuda.get_current_stream().ptr)

    def __call__(self, a, b, out):
        if self.cublas is None:
            self.cp.matmul(a, b, out=out)
            return
        M, K = a.shape
        N = b.shape[1]
        # column-major view of row-major: out^T (N, M) = b^T (N, K) @ a^T (K, M)
        self.cublas.sgemm(self.handle, self.cublas.CUBLAS_OP_N, self.cublas.CUBLAS_OP_N, N, M, K,
                          self.one.ctypes.data, b.data.ptr, N, a.data.ptr, K, self.zero.ctypes.data, out.data.ptr, N)


def _switch(asked: bool | None, check, what: str) -> tuple[bool, str]:
    """An engine option that is on where it works: False keeps it off, None takes it where check()
    (None, or why not) allows, True insists. (on, note: "on", "off (asked)" or "off (why)")."""
    if asked is False:
        return False, "off (asked)"
    why = check()
    if why is not None and asked:
        raise RuntimeError(f"{what} does not work here: {why}")
    return why is None, "on" if why is None else f"off ({why})"


class Engine:
    """Everything the fast path needs for one set of weights, allocated once: weight copies, the
    static KV cache (n_positions long), activations, the decode step's launches and its graphs."""

    def __init__(self, params: dict, config: GPT2Config, *, dtype: str | None = None, max_len: int | None = None,
                 prefetch: bool = True, pdl: bool | None = None, steps_per_graph: int = STEPS_PER_GRAPH,
                 steps_per_launch: int = STEPS_PER_LAUNCH, keep_logits: bool = False,
                 persistent: bool | None = None, products: str | None = None):
        import cupy as cp

        import kernels

        self.cp, self.config = cp, config
        self.dtype = dtype or param_dtype(params)
        why = unsupported_reason(params, config, kv_cache=True, dtype=self.dtype)
        if why is not None:
            raise LabError(f"the fast path cannot run this model: {why}")
        self.max_len = max_len or config.n_positions
        self.steps_per_graph, self.steps_per_launch = steps_per_graph, steps_per_launch
        self.stream = cp.cuda.Stream(non_blocking=True)
        C, NH, HS, V = config.n_embd, config.n_head, config.head_size, config.vocab_size
        bf16 = self.dtype == "bfloat16"
        self.weight_type = "unsigned short" if bf16 else "float"
        self.kv_type = self.weight_type
        eps = np.float32(config.layer_norm_epsilon)
        self.eps = eps
        self.sm_count = kernels.device_limits().sm_count
        # the whole-sequence products: gemm.cu (3xTF32 on wgmma, sm_90a) or cuBLAS SGEMM
        able = int(cp.cuda.Device().compute_capability) == 90
        if products not in (None, "3xtf32", "cublas"):
            raise ValueError(f"products must be '3xtf32' or 'cublas', got {products!r}")
        if products == "3xtf32" and not able:
            raise RuntimeError("products='3xtf32' needs compute capability 9.0 (TF32 wgmma, sm_90a)")
        self.products = products or ("3xtf32" if able else "cublas")
        self.stream.wait_event(cp.cuda.get_current_stream().record())  # the weights are written first

        with self.stream:
            # float32 weights for the eager products (prefill, no-cache), bfloat16-rounded in bfloat16 mode
            self.params32 = {}
            for name, a in params.items():
                a32 = to_float32(cp, a)
                self.params32[name] = round_to_bf16(cp, a32) if bf16 and is_matrix(name) else cp.ascontiguousarray(a32)
            p = self.params32
            decode = (lambda a: bf16_bits(cp, a)) if bf16 else cp.ascontiguousarray
            # the decode step's copies: (out, in) linear weights, wte and wpe in the decode dtype
            self.wte = decode(p["wte.weight"])  # (V, C): already one row per output
            self.wpe = decode(p["wpe.weight"])  # (n_positions, C)
            self.layers = []
            for i in range(config.n_layer):
                h = f"h.{i}."
                self.layers.append({
                    name: decode(cp.ascontiguousarray(p[h + name + ".weight"].T))
                    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                })

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
            self.lm32_warps, self.lm32_rows = lm_head_shape(config, "float32")  # the eager path's lm_head
            self.lm32_blocks = lm_head_blocks(fused.function(*lm_exprs["lm_head32"]), self.lm32_warps, self.lm32_rows,
                                              V, self.sm_count)
            self.block_max = cp.zeros(max(self.lm_blocks, self.lm32_blocks), dtype=cp.float32)
            self.block_arg = cp.zeros(max(self.lm_blocks, self.lm32_blocks), dtype=cp.int32)
            self.lm_counter = cp.zeros(1, dtype=cp.uint32)
            self.logits = cp.full(V, cp.nan, dtype=cp.float32) if keep_logits else None
            # eager (whole-sequence) activations, max_len rows
            T = self.max_len
            self.xs = cp.zeros((T, C), dtype=cp.float32)
            self.hs = cp.zeros((T, C), dtype=cp.float32)
            self.qkvs = cp.zeros((T, 3 * C), dtype=cp.float32)
            self.merged = cp.zeros((T, C), dtype=cp.float32)
            self.ys = cp.zeros((T, C), dtype=cp.float32)
            self.fs = cp.zeros((T, config.mlp_width), dtype=cp.float32)
            self.sgemm = _Sgemm(cp)
            # gemm.cu's weights: every linear weight split and tiled once (gemm_weight)
            self.gemm_weights = {name: gemm_weight(cp, a) for name, a in self.params32.items()
                                 if self.products == "3xtf32" and is_matrix(name) and name.startswith("h.")}
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

        plan = step_plan(c, self.dtype, self.sm_count, self.max_len, kernels.device_limits().max_shared_per_block)
        if isinstance(plan, str):
            return plan
        fn = fused.function(*exprs["decode_step"])
        fn.max_dynamic_shared_size_bytes = plan.smem
        per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, STEP_BLOCK, plan.smem)
        if per_sm < 1:
            return f"decode_step does not fit an SM ({plan.smem} bytes of shared memory, {STEP_BLOCK} threads)"
        with self.stream:
            table, self.folds = [], []  # folds: kept alive while the table points at them
            # attn.c_proj head-major, (NH, C, HS): [h, n, d] = W[n, h * HS + d] of the (out, in) copy
            self.proj_heads = [cp.ascontiguousarray(layer["attn.c_proj"].reshape(c.n_embd, c.n_head, c.head_size)
                                                    .transpose(1, 0, 2)) for layer in self.layers]
            for i, layer in enumerate(self.layers):
                arrays = {"k_cache": self.k_cache[i], "v_cache": self.v_cache[i]}
                p = self.params32  # bfloat16-rounded matrices in bfloat16: the weights decode_step reads
                for name in LAYER_POINTERS[:10]:  # (out, in) matrices in the decode dtype; float32 vectors
                    if name in LAYER_POINTERS[:4]:
                        arrays[name] = layer[name.removesuffix(".weight")]
                    elif name.endswith(".fold"):
                        linear = f"h.{i}.{name.removesuffix('.fold')}"
                        ln = f"h.{i}.{FOLDS[name.removesuffix('.fold')]}"
                        arrays[name] = layernorm_fold(cp, p[linear + ".weight"].T, p[linear + ".bias"],
                                                      p[ln + ".weight"], p[ln + ".bias"])
                    else:
                        arrays[name] = p[f"h.{i}.{name}"]
                arrays["attn.c_proj.weight"] = self.proj_heads[i]
                self.folds.append([arrays[name] for name in arrays if name.endswith(".fold")])
                table.append([arrays[name].data.ptr for name in LAYER_POINTERS])
            self.layer_table = cp.asarray(np.asarray(table, dtype=np.uint64))
            # LN_f folded into the rows of wte (no bias), one pair more where V is odd (whole 16-byte copies)
            V = c.vocab_size
            fold = layernorm_fold(cp, p["wte.weight"], cp.zeros(V, dtype=cp.float32), p["ln_f.weight"], p["ln_f.bias"])
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
        c, p, plan = self.config, self.params32, self.plan
        args = (self.layer_table, np.int32(c.n_layer), self.wte, self.wpe, p["ln_f.weight"], self.lnf_fold, self.eps,
                np.int32(c.vocab_size), np.int32(self.max_len), np.int32(plan.splits),
                np.float32(1.0 / math.sqrt(c.head_size)), self.x, *self.step_ll.values(),
                self.step_max, self.step_arg, self.logits if self.logits is not None else NULL, self.state,
                self.history, self.step_barrier, self.step_epoch, np.int32(n), np.int32(plan.slot_bytes),
                np.int32(plan.slots), np.int32(plan.lm_rows), np.int32(plan.lm_keep), NULL if trace is None else trace)
        # the launch itself (cupy.cuda.Function): RawKernel takes cooperation from its module's options
        self.fn["decode_step"].kernel((plan.blocks, 1, 1), (STEP_BLOCK, 1, 1), args, shared_mem=plan.smem,
                                      stream=self.stream, enable_cooperative_groups=True)

    # -- the decode step -----------------------------------------------------------------------------

    def launches(self, prefetch: bool | None = None, pdl: bool | None = None) -> list[Launch]:
        """The decode step's launches in one variant (default: the engine's): with or without the L2
        prefetch hints, through plain launches or programmatic dependent launches."""
        key = (self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        if key not in self._variants:
            self._variants[key] = self._decode_launches(*key)
        return self._variants[key]

    def _decode_launches(self, prefetch: bool, pdl: bool) -> list[Launch]:
        """The decode step as a list of launches on fixed buffers. Each kernel that reads a matrix
        also asks L2 to prefetch the next one (the last wraps to the first layer's c_attn)."""
        c, p = self.config, self.params32
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

    def graph(self, steps: int, prefetch: bool | None = None, pdl: bool | None = None):
        """A CUDA graph of `steps` decode steps in one launch variant (captured once, then kept)."""
        key = (steps, self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        if key not in self.graphs:
            launches = self.launches(*key[1:])
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

    def product(self, a, name: str, out, epi: int) -> None:
        """out = a @ params32[name + ".weight"], then + bias (GEMM_BIAS) or gelu(. + bias)
        (GEMM_BIAS_GELU): gemm.cu, or cuBLAS SGEMM and bias_act.cu (products="cublas")."""
        p, M, N = self.params32, a.shape[0], out.shape[1]
        w, b = p[name + ".weight"], p[name + ".bias"]
        if self.products == "cublas":
            self.sgemm(a, w, out)
            if epi != GEMM_NONE:
                self.fn["bias_gelu" if epi == GEMM_BIAS_GELU else "bias"](
                    (min(-(-M * N // 1024), 4 * self.sm_count),), (256,), (out, b, np.int32(M), np.int32(N)))
            return
        gemm(self.fn[f"gemm_{epi}"], a, self.gemm_weights[name + ".weight"], b, out, self.gemm_partials,
             self.gemm_tickets, self.sm_count)

    def sequence(self, T: int, attend, *, store_kv: bool) -> None:
        """The forward pass over history[0:T] (eager launches), then ln_f + lm_head + argmax on
        position T - 1, which writes the next token into history[T] and state. With store_kv, every
        layer's keys and values go into the cache (the prefill). Only position T - 1 reaches the
        logits, so the last layer runs its keys and values (and the attention) over every position,
        and everything after the attention on position T - 1 alone."""
        cp, c, p, fn = self.cp, self.config, self.params32, self.fn
        C, NH, HS = c.n_embd, c.n_head, c.head_size
        eps = self.eps
        x, h, qkv, merged, y, f = (a[:T] for a in (self.xs, self.hs, self.qkvs, self.merged, self.ys, self.fs))
        views = qkv.reshape(1, T, 3, NH, HS)  # (B, T, 3, NH, hs): columns [q | k | v]
        q, k, v = (views[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (B, NH, T, hs), a view
        # every layer reads the same views: a rung is validated once per pass (kernels.Attend.prepare)
        run_attention = attend.prepare(q, k, v) if hasattr(attend, "prepare") else (lambda: attend(q, k, v))
        grid = (min(-(-T * C // 256), 4 * self.sm_count),)
        if self.products == "cublas":
            self.sgemm.begin()
        fn["embed32"]((T,), (256,), (p["wte.weight"], p["wpe.weight"], self.history, NULL, np.int32(C), x, NULL,
                                     np.uint64(0)))
        for i in range(c.n_layer):
            pre = f"h.{i}."
            if i == 0:  # h = ln_1(x)
                residual = (NULL, NULL)
            else:  # x += mlp.c_proj output + bias (previous layer); h = ln_1(x)
                residual = (y, p[f"h.{i - 1}.mlp.c_proj.bias"])
            fn["add_layernorm"]((T,), (256,), (x, *residual, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], eps, h,
                                               np.int32(C)), shared_mem=4 * C)
            self.product(h, pre + "attn.c_attn", qkv, GEMM_BIAS)
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
            self.product(merged, pre + "attn.c_proj", y, GEMM_NONE)
            # x += attn.c_proj output + bias; h = ln_2(x)
            fn["add_layernorm"]((rows,), (256,), (x, y, p[pre + "attn.c_proj.bias"], p[pre + "ln_2.weight"],
                                                  p[pre + "ln_2.bias"], eps, h, np.int32(C)), shared_mem=4 * C)
            self.product(h, pre + "mlp.c_fc", f, GEMM_BIAS_GELU)
            self.product(f, pre + "mlp.c_proj", y, GEMM_NONE)
        # the last position: ln_f(x + mlp.c_proj output + bias), the logits, their argmax
        last = f"h.{c.n_layer - 1}.mlp.c_proj.bias"
        fn["lm_head32"]((self.lm32_blocks,), (self.lm32_warps * 32,),
                        (p["wte.weight"], x[-1], y[-1], p[last], p["ln_f.weight"], p["ln_f.bias"], eps,
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

    def _copy_back(self, first: int, count: int):
        """Queue history[first:first + count] -> pinned host memory; the event that says it is there."""
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.pinned.ptr + 4 * first, self.history.data.ptr + 4 * first, 4 * count,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return event, first, count

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


def by_kind(kernels_ms: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(kind, launches, total ms) from profile_step's rows: the layers' kernels summed by their name
    without the `h.N.` prefix, in order of first appearance."""
    totals: dict[str, list] = {}
    for name, ms in kernels_ms:
        kind = re.sub(r"^h\.\d+\.", "", name)
        entry = totals.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    return [(kind, n, ms) for kind, (n, ms) in totals.items()]


def copy_ceiling(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of `repeats`
    copies of `nbytes`, measured now on the current device."""
    import cupy as cp

    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats + 1):
        start.record()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    stream.ptr)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * nbytes / float(np.median(times[1:]))
