"""Autoregressive generation, in the two modes the lab compares (lm/generate.py: the eager loop,
the Sampler and the decode rung, shared with llama/).

- no KV cache (the seed's setup): every step runs the whole sequence so far through the model,
  so the attention under test runs on every token, at every length up to prompt + new tokens;
- KV cache: one prefill of the prompt with the attention under test, then one token per step,
  each a single query over the cached keys (`decode_attend`: by default the decode rung,
  kernels/v16_decode_split_kv.cu, on CuPy arrays, and the reference on NumPy ones).

On the GPU, greedy generation takes the fast path by default (gpt2/fast: fused kernels, a static
KV cache and the decode step replayed as a CUDA graph; its own decode attention). `fast=False` runs
the readable eager loop of lm/generate.py, model.forward step by step.
"""

from __future__ import annotations

import numpy as np

from lm import generate as eager
from lm.generate import (  # noqa: F401 (gpt2.generate names them)
    Generation,
    Sampler,
    check_request,
    decode_attention_name,
    decode_rung,
    decode_rung_attend,
    reference_attend,
)

from .config import GPT2Config
from .model import array_module, compute_dtype, forward


def generate(params: dict, config: GPT2Config, prompt: list[int], n_new: int, *, attend,
             kv_cache: bool = False, decode_attend=None, sampler: Sampler | None = None,
             eos_id: int | None = None, on_token=None, record_logits: bool = False, fast: bool = True) -> Generation:
    """n_new tokens after `prompt` (one sequence); on_token(token) is called as each is chosen.
    Stops early after `eos_id` if it is given. fast: greedy runs on the GPU go through gpt2/fast.py
    (gpt2.fast.unsupported_reason says when they cannot); False forces the eager path, whose decode
    steps use `decode_attend`, by default as decode_attention_name says."""
    check_request(config, prompt, n_new)
    xp = array_module(params["wte.weight"])
    if fast and xp is not np:
        from . import fast as fast_path

        if fast_path.unsupported_reason(params, config, kv_cache=kv_cache, sampler=sampler,
                                        record_logits=record_logits) is None:
            return fast_path.generate(params, config, prompt, n_new, attend=attend, kv_cache=kv_cache,
                                      eos_id=eos_id, on_token=on_token)
    return eager.generate(forward, params, config, prompt, n_new, attend=attend, dtype=compute_dtype(params),
                          kv_cache=kv_cache, decode_attend=decode_attend, sampler=sampler,
                          eos_ids=() if eos_id is None else (eos_id,), on_token=on_token, record_logits=record_logits)
