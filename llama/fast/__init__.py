"""Fast greedy generation of Llama on the GPU: weights laid out once, a static KV cache sized to the
run, and the decode step as a CUDA graph of fused kernels.

    out = fast.generate(params, config, prompt, n_new, attend=attend)           what llama.generate calls
    engine = fast.engine_for(params, config, positions=T)                        the cached engine
    engine.profile_step(position)                                                per-kernel milliseconds

llama/model.py stays the readable definition of Llama; this package runs the same network with fewer,
larger kernels (kernels/fused/*.cu, each tested against the CuPy code it replaces), as gpt2/fast does
for GPT-2. Its rooms: plan.py (when the fast path runs, the kernels it compiles, launch shapes),
weights.py (the layout chosen at load and the engine's views of it), engine.py (Engine: buffers and
the decode step's launches). What GPT-2's and Llama's engines share (launch variants, graphs,
generation, measurements) is lm/engine.py's FastEngine.

How a token runs, kernel by kernel, and why each piece is built as it is: docs/decode.md (Llama's fast
path).
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
