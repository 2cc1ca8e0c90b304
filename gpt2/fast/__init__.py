"""Fast greedy generation on the GPU: fused kernels, a static KV cache, the decode step as one
persistent kernel (or CUDA graphs of per-operation kernels).

    out = fast.generate(params, config, prompt, n_new, attend=attend, kv_cache=True)   what generate() calls
    engine = fast.engine_for(params, config, dtype="bfloat16")                           the cached engine
    engine.profile_step(position)                                                        per-kernel milliseconds
    engine.profile_persistent(position)                                                  per-stage milliseconds

gpt2/model.py stays the readable definition of GPT-2; this package runs the same network with fewer,
larger kernels (kernels/fused/*.cu, each tested against the CuPy code it replaces). Its rooms: plan.py
(when the fast path runs, the kernels it compiles, launch shapes, the persistent step's plan),
weights.py (the weights as the engine reads them, bytes per token), engine.py (Engine: buffers and
the decode step's launches), sequence.py (the prefill and the mode without a cache; gemm.cu's
launcher), persistent.py (decode_step.cu's setup, launch and profile). What GPT-2's and Llama's engines
share (launch variants, graphs, generation, measurements) is lm/engine.py's FastEngine; driver-level
launches live in kernels/driver.py.


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
  from programmatic dependent launches (cuLaunchKernelEx, kernels/driver.py), so that a kernel starts, and issues its
  weight loads, while the previous one finishes; it waits (griddepcontrol.wait) before reading
  activations, and reads them through L2 (kernels/fused/common.cuh, fresh()): an SM's L1 may still
  hold lines of x that the previous kernel's blocks read there before other SMs wrote them, and
  with plain L1 loads PDL graphs parted from plain launches after a few dozen tokens. On by default
  where the device has it (compute capability 9.0) and one replayed step matches plain launches
  bit for bit; pdl=False keeps plain launches.
  The linear layers read the Conv1D weights as (out, in), so that a warp reads one output's weights
  contiguously. decode_layout lays each (in, out) weight out column-major once, at load (the same
  values and shape, so the eager model reads it as before): its transpose is that (out, in) matrix,
  and the engine holds views of the caller's weights, no copies (weights.decode_weights; weights in
  another dtype or layout are copied once). In bfloat16 the matrices (wte, wpe and the linear weights)
  are bfloat16 and so is the KV cache; LayerNorm parameters, biases, activations and every
  accumulation stay float32. Engine.added_bytes() counts what it holds beside the weights.
- The persistent step (the default where it runs: compute capability 9.0 with cooperative launch, a
  head size that is a multiple of 32, shapes that fit shared memory; step_plan says why not):
  kernels/fused/decode_step.cu runs the same operations for a whole window of steps in one
  cooperative launch, one block per SM, where the per-operation step has a kernel boundary a handoff
  of words that carry their step (the reader waits for the words it needs; one grid barrier per
  token, after the argmax), and each block's share of the weights copied into shared
  memory ahead of its use (a share larger than a slot as several items: step_plan's stage_items). Four stages per layer (STEP_STAGES): attn.c_proj is done per head inside
  the attention stage, from a head-major copy of its weight made here (the one second layout the
  engine keeps: n_layer * n_embd^2 weights, a twelfth of the layers', beside the (out, in) matrix the
  per-operation step reads). One launch per window of STEPS_PER_LAUNCH tokens; persistent=False
  keeps the graphs.
- Prefill, and every step of the no-cache mode: the whole sequence eagerly, the attention under test,
  and fused kernels around it (residual add + LayerNorm, head merge, KV store), on activations sized
  for the longest pass the run asks for (the prompt; the no-cache mode's last step). The prefill's
  products run on cuBLAS (lm/products.py's Blas) on the (out, in) matrices the decode step reads:
  float32 through SGEMM (no TF32), bfloat16 through gemmEx on inputs rounded to bfloat16 with float32
  accumulation, as the eager model's products; then bias_act.cu. The no-cache mode's float32 passes
  run on kernels/fused/gemm.cu where the device is sm_90 (products="3xtf32", the default there):
  float32 at float32 accuracy on TF32 wgmma, with the bias or bias + GELU in its epilogue and K split
  across blocks where the output tiles are fewer than the SMs; its weights are split and tiled on that
  mode's first pass (gemm_weight: two float32 copies of every linear weight, which that mode trades
  for its speed and a KV-cache run never makes); products="cublas" keeps cuBLAS there too. Only the
  last position reaches the logits, so the last layer runs its attention over every position and
  everything after it on the last position alone; then the same ln_f + lm_head + argmax kernel. The
  attention under test is validated once per pass (kernels.Attend.prepare): every layer reads the
  same qkv views.
- Greedy only: tokens stay on the device (`history`), copied back in windows (STEPS_PER_LAUNCH tokens,
  STEPS_PER_GRAPH with graphs) through pinned memory while the GPU runs the next window, so on_token
  still streams.
"""

from __future__ import annotations

from lm.bf16 import bf16_bits, round_to_bf16
from lm.engine import EngineCache, Launch
from lm.generate import Generation
from lm.measure import by_kind, copy_ceiling

from ..config import GPT2Config
from .engine import Engine
from .plan import (
    DTYPES,
    EPI_BIAS,
    EPI_GELU,
    EPI_RESIDUAL,
    GEMM_BIAS,
    GEMM_BIAS_GELU,
    GEMM_NONE,
    GEMM_OPTIONS,
    GEMM_SMEM,
    LAYER_POINTERS,
    STEP_SPLITS,
    STEP_STAGES,
    STEP_STATIC_SMEM,
    STEPS_PER_GRAPH,
    STEPS_PER_LAUNCH,
    StepPlan,
    attention_staging,
    gemm_expressions,
    gemm_splits,
    gemv_shape,
    kernel_expressions,
    lm_head_blocks,
    lm_head_shape,
    param_dtype,
    step_plan,
    unsupported_reason,
)
from .sequence import gemm
from .weights import (
    LINEAR,
    DecodeWeights,
    as_bfloat16,
    decode_layout,
    decode_weights,
    gemm_weight,
    is_matrix,
    kv_bytes_per_token,
    layernorm_fold,
    weight_bytes_per_token,
)

CACHE_SIZE = 2  # engines kept (each holds a KV cache of n_positions, and views or copies of the weights)


def generate(params: dict, config: GPT2Config, prompt: list[int], n_new: int, *, attend, kv_cache: bool,
             eos_id: int | None = None, on_token=None, graph: bool = True, dtype: str | None = None) -> Generation:
    """Greedy generation as gpt2.generate does it, on the cached engine for these weights."""
    return engine_for(params, config, dtype).generate(prompt, n_new, attend=attend, kv_cache=kv_cache,
                                                     eos_ids=() if eos_id is None else (eos_id,), on_token=on_token,
                                                     graph=graph)


_engines = EngineCache(CACHE_SIZE)


def engine_for(params: dict, config: GPT2Config, dtype: str | None = None, **options) -> Engine:
    """The engine for these weights (by the arrays' addresses), built once and kept (CACHE_SIZE most
    recent). The engine views or copies the weights: after editing params in place, call clear_cache()."""
    dtype = dtype or param_dtype(params)
    return _engines.get(lambda: Engine(params, config, dtype=dtype, **options), params, config, dtype, options)


def clear_cache() -> None:
    _engines.clear()


__all__ = [
    "CACHE_SIZE", "DTYPES", "LINEAR", "DecodeWeights", "decode_layout", "decode_weights", "EPI_BIAS", "EPI_GELU", "EPI_RESIDUAL", "GEMM_BIAS", "GEMM_BIAS_GELU", "GEMM_NONE",
    "GEMM_OPTIONS", "GEMM_SMEM", "LAYER_POINTERS", "STEPS_PER_GRAPH", "STEPS_PER_LAUNCH", "STEP_SPLITS",
    "STEP_STAGES", "STEP_STATIC_SMEM", "Engine", "Generation", "Launch", "StepPlan", "as_bfloat16",
    "attention_staging", "bf16_bits", "by_kind", "clear_cache", "copy_ceiling", "engine_for", "gemm",
    "gemm_expressions", "gemm_splits", "gemm_weight", "gemv_shape", "generate", "is_matrix", "kernel_expressions",
    "kv_bytes_per_token", "layernorm_fold", "lm_head_blocks", "lm_head_shape", "param_dtype", "round_to_bf16",
    "step_plan", "unsupported_reason", "weight_bytes_per_token",
]
