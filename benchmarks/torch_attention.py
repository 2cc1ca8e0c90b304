"""Attention as one writes it in PyTorch, the first of seed 004's levels: scores, causal mask, softmax,
product, each a whole (B, NH, T_q, T_k) tensor. The `torch_naive` peer runs it eagerly; the
torch.compile peers compile this same function (peers.py). Imported only where torch is: it imports
torch at the top, as such code does."""

import math

import torch


def plain_attention(q, k, v, causal: bool = True):
    """softmax(q k^T / sqrt(d) + mask) v for q (B, NH, T_q, d) and k, v (B, NH, T_k, d); causal
    aligned bottom-right, as the rungs. Its lines are the "naive PyTorch" level's lines of code."""
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))  # (B, NH, T_q, T_k)
    if causal:
        T_q, T_k = scores.shape[-2:]
        visible = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(T_k - T_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def compiled(mode: str):
    """plain_attention compiled with torch.compile in `mode` ("default", "max-autotune-no-cudagraphs"),
    static shapes (each shape and dtype compiled, and autotuned, for itself). Dynamo caches compiled
    graphs on the function's code object, so each mode gets a copy of the code under its own name (the
    modes do not share graphs), and the recompile limit is raised above the shapes x dtypes one run
    compiles (past it Dynamo would silently run the function eagerly)."""
    for limit in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    tag = mode.replace("-", "_")
    code = plain_attention.__code__.replace(co_name=f"plain_attention_{tag}")
    own = type(plain_attention)(code, plain_attention.__globals__, code.co_name, plain_attention.__defaults__)
    return torch.compile(own, mode=mode, dynamic=False, fullgraph=True)
