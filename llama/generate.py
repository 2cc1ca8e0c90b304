"""Autoregressive generation with Llama: lm/generate.py's eager loop, in both modes (no KV cache:
the whole sequence every step; KV cache: a prefill with the rung, then one query per step over the
cached key/value heads, by default with the split-KV decode rung that takes the config on the GPU).
There is no fast path for Llama yet: every run is model.forward step by step."""

from __future__ import annotations

from lm import generate as eager
from lm.generate import Generation, Sampler

from .config import LlamaConfig
from .model import compute_dtype, forward


def generate(params: dict, config: LlamaConfig, prompt: list[int], n_new: int, *, attend, kv_cache: bool = False,
             decode_attend=None, sampler: Sampler | None = None, eos_ids=(), on_token=None,
             record_logits: bool = False) -> Generation:
    """n_new tokens after `prompt` (one sequence); stops early after any of `eos_ids` (e.g. the
    config's eos_token_id). See lm.generate.generate."""
    return eager.generate(forward, params, config, prompt, n_new, attend=attend, dtype=compute_dtype(params),
                          kv_cache=kv_cache, decode_attend=decode_attend, sampler=sampler, eos_ids=tuple(eos_ids),
                          on_token=on_token, record_logits=record_logits)
