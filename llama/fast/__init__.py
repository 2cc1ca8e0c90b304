"""Fast greedy generation of Llama on the GPU: weights laid out once, a static KV cache sized to the
run, and the decode step as a CUDA graph of fused kernels.

    out = fast.generate(params, config, prompt, n_new, attend=attend)           what llama.generate calls
    engine = fast.engine_for(params, config, positions=T)                        the cached engine
    engine.profile_step(position)                                                per-kernel milliseconds

llama/model.py stays the readable definition of Llama; this package runs the same network with fewer,
larger kernels (kernels/fused/*.cu, each tested against the CuPy code it replaces), as gpt2/fast does
for GPT-2. Its rooms: plan.py (when the fast path runs, the kernels it compiles, launch shapes),
weights.py (the layout chosen at load and the engine's views of it), engine.py (Engine).

- Weights: decode_layout stacks each layer's q_proj, k_proj and v_proj into one ((NH + 2 NKV) HS, C)
  matrix and gate_proj and up_proj into one (2F, C) matrix, once at load; the checkpoint's names stay
  as views of their rows (the eager model reads them as before), the originals are dropped. Every
  matrix is (out, in) row-major as stored, which is what the kernels read: the engine holds views,
  no copies (weights.decode_weights; weights in another dtype or layout are copied once). In bfloat16
  the matrices and the KV cache are bfloat16; RMSNorm weights, activations and every accumulation
  float32. Tied embeddings (1B, 3B): the table is the head, read once per step. Engine.added_bytes()
  counts what the engine holds beside the weights.
- Decode (one token per step): a fixed sequence of launches on fixed buffers, reading its only inputs,
  the token and its position, from device memory (`state`), captured once as a CUDA graph
  (STEPS_PER_GRAPH steps per graph) and replayed with no host arguments. Per layer five kernels
  (kernels/fused/rms_gemv.cu's streams and gqa_decode_attention.cu):
      RMSNorm + qkv + RoPE + cache store   rms_gemv_rope: q to `q`, k and v into the cache at pos
      attention over the cache             gqa_decode_attention: a block per (key split, key/value head)
      o_proj + residual                    rms_gemv_residual
      RMSNorm + gate/up + silu(gate) * up  rms_gemv_silu
      down_proj + residual                 rms_gemv_residual
  plus embed at the start and RMSNorm + lm_head + argmax (rms_gemv_argmax) at the end, which writes the
  token into `history` and advances `state`: 5 * n_layer + 2 kernels per token (82 for Llama-3.2-1B).
  Each stream keeps two items of 16-byte loads in flight per lane over a one-wave grid; on Hopper the
  graphs are built from programmatic dependent launches (each kernel issues its first weight loads
  while the previous one finishes) and each stream asks L2 to prefetch the next matrix at its end,
  as gpt2/fast does. There is no persistent step for Llama.
- Prefill: the prompt through llama/model.py's forward (its products on cuBLAS in the weights' dtype,
  the attention under test) with the engine's cache as its KVCache, so the eager model writes the
  keys and values the decode kernels read; the first token is the argmax of its logits, on the device.
- Greedy only: tokens stay on the device (`history`), copied back in windows of STEPS_PER_GRAPH tokens
  through pinned memory while the GPU runs the next window, so on_token still streams.
- The static cache holds the run's positions (prompt + new tokens, rounded up to CACHE_QUANTUM), not
  the model's 131,072: engine_for rebuilds a cached engine that is too short for a run.
"""

from __future__ import annotations

from lm.engine import EngineCache
from lm.generate import Generation

from ..config import LlamaConfig
from ..load import weight_bytes_per_token
from .engine import STEP_KINDS, Engine
from .plan import (
    CACHE_QUANTUM,
    DEFAULT_POSITIONS,
    DTYPES,
    GEMV_WARPS,
    STEPS_PER_GRAPH,
    AttentionPlan,
    Matrix,
    attention_plan,
    cache_positions,
    gemv_grid,
    gemv_unroll,
    kernel_expressions,
    matrices,
    param_dtype,
    unsupported_reason,
)
from .weights import STACKS, DecodeWeights, decode_layout, decode_weights, stacked

CACHE_SIZE = 2  # engines kept (each holds a KV cache, and views or copies of the weights)


def generate(params: dict, config: LlamaConfig, prompt: list[int], n_new: int, *, attend, eos_ids=(),
             on_token=None, graph: bool = True, dtype: str | None = None, max_len: int | None = None) -> Generation:
    """Greedy generation as llama.generate does it, on the cached engine for these weights, whose cache
    holds at least max(prompt + n_new, max_len) positions."""
    positions = max(len(prompt) + n_new, max_len or 0)
    return engine_for(params, config, dtype, positions=positions).generate(
        prompt, n_new, attend=attend, eos_ids=tuple(eos_ids), on_token=on_token, graph=graph)


_engines = EngineCache(CACHE_SIZE)


def engine_for(params: dict, config: LlamaConfig, dtype: str | None = None, *, positions: int | None = None,
               **options) -> Engine:
    """The engine for these weights (by the arrays' addresses) holding at least `positions` positions
    (default DEFAULT_POSITIONS, or the model's if fewer), built once and kept (CACHE_SIZE most recent);
    one that is too short is dropped and built again for the longer run. The engine views or copies the
    weights: after editing params in place, call clear_cache()."""
    dtype = dtype or param_dtype(params)
    need = cache_positions(positions or min(DEFAULT_POSITIONS, config.n_positions), config)
    return _engines.get(lambda: Engine(params, config, dtype=dtype, max_len=need, **options), params, config, dtype,
                        options, fits=lambda engine: engine.max_len >= need)


def clear_cache() -> None:
    _engines.clear()


__all__ = [
    "CACHE_QUANTUM", "CACHE_SIZE", "DEFAULT_POSITIONS", "DTYPES", "GEMV_WARPS", "STACKS", "STEPS_PER_GRAPH",
    "STEP_KINDS", "AttentionPlan", "DecodeWeights", "Engine", "Generation", "Matrix", "attention_plan",
    "cache_positions", "clear_cache", "decode_layout", "decode_weights", "engine_for", "gemv_grid", "gemv_unroll",
    "generate", "kernel_expressions", "matrices", "param_dtype", "stacked", "unsupported_reason",
    "weight_bytes_per_token",
]
