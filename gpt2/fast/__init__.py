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

How a token runs, layer by layer, and why each piece is built as it is: docs/decode.md (the fast path,
the persistent step, the whole sequence, memory).
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
    step_options,
    step_plan,
    step_proj_rounds,
    step_reduce_heads,
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
    "step_options", "step_plan", "step_proj_rounds", "step_reduce_heads", "unsupported_reason", "weight_bytes_per_token",
]
