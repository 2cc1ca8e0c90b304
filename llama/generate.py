"""Autoregressive generation with Llama: lm/generate.py's eager loop, in both modes (no KV cache:
the whole sequence every step; KV cache: a prefill with the rung, then one query per step over the
cached key/value heads, by default with the split-KV decode rung that takes the config on the GPU).

On the GPU, greedy KV-cache generation takes the fast path by default (llama/fast: weights laid out
once, a static cache, the decode step a CUDA graph of fused kernels). `fast=False` runs the readable
eager loop, model.forward step by step."""

from __future__ import annotations

import numpy as np

from lm import generate as eager
from lm.arrays import array_module
from lm.generate import Generation, Sampler, check_request

from .config import LlamaConfig
from .model import compute_dtype, forward


def generate(params: dict, config: LlamaConfig, prompt: list[int], n_new: int, *, attend, kv_cache: bool = False,
             decode_attend=None, sampler: Sampler | None = None, eos_ids=(), on_token=None,
             record_logits: bool = False, fast: bool = True, max_len: int | None = None) -> Generation:
    """n_new tokens after `prompt` (one sequence); stops early after any of `eos_ids` (e.g. the
    config's eos_token_id). See lm.generate.generate. fast: greedy KV-cache runs on the GPU go through
    llama/fast (llama.fast.unsupported_reason says when they cannot), on an engine whose cache holds
    at least max_len positions (default prompt + n_new: give the longest run's to keep one engine for
    several runs); False forces the eager path, whose decode steps use `decode_attend`."""
    check_request(config, prompt, n_new)
    if fast and array_module(params["model.embed_tokens.weight"]) is not np:
        from . import fast as fast_path

        if fast_path.unsupported_reason(params, config, kv_cache=kv_cache, sampler=sampler,
                                        record_logits=record_logits) is None:
            return fast_path.generate(params, config, prompt, n_new, attend=attend, eos_ids=eos_ids,
                                      on_token=on_token, max_len=max_len)
    return eager.generate(forward, params, config, prompt, n_new, attend=attend, dtype=compute_dtype(params),
                          kv_cache=kv_cache, decode_attend=decode_attend, sampler=sampler, eos_ids=tuple(eos_ids),
                          on_token=on_token, record_logits=record_logits)
