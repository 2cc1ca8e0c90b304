"""GPT-2's forward pass in array code: NumPy or CuPy (`xp`), attention passed in.

    logits = forward(params, config, idx, attend)          idx (B, T) token ids -> (B, T, vocab)
    params = cast_params(params, "bfloat16")               16-bit weights (float16 too), cast once

`params` maps checkpoint-native names (`wte.weight`, `h.0.attn.c_attn.weight`, ...) to arrays, as
gpt2.load makes them; the Conv1D weights are (in, out), so a projection is `x @ weight + bias`.
`attend(q, k, v) -> o` is causal attention over (B, NH, T, hs) arrays: any kernel rung, or
kernels.reference_attention. With a KVCache, k and v span the whole past (T_k >= T_q) and the
causal mask is aligned bottom-right, as reference_attention does.

Precision: float32 weights give float32 everywhere. With 16-bit weights each product takes its
operands in the weights' dtype and accumulates in float32 (lm/products.py: cuBLAS gemmEx on CuPy,
with no float32 copy of a weight), and so do q, k, v, the attention and the KV cache; the residual
stream, LayerNorm statistics, GELU and the logits stay float32.
"""

from __future__ import annotations

import math

import numpy as np

from lm.arrays import array_module, cast_params, run_dtype  # noqa: F401 (gpt2.model names the first two)
from lm.attention import attention_bytes, takes_short_queries
from lm.kv_cache import KVCache
from lm.products import matmul

from .config import GPT2Config

GELU_C = math.sqrt(2.0 / math.pi)


def gelu(x):
    """GPT-2's tanh approximation of GELU (transformers' gelu_new)."""
    xp = array_module(x)
    return 0.5 * x * (1.0 + xp.tanh(GELU_C * (x + 0.044715 * (x * x * x))))


def compute_dtype(params: dict):
    """The dtype of the blocks' products, of q, k, v and of the KV cache: the weights' own."""
    return params["h.0.attn.c_attn.weight"].dtype


def layer_norm(x, w, name: str, eps: float):
    """LayerNorm of the float32 residual stream; its statistics in float32 whatever the weights' dtype."""
    mean = x.mean(axis=-1, keepdims=True)  # (B, T, 1)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)  # (B, T, 1), biased like torch's LayerNorm
    return xc * (var + eps) ** -0.5 * w[name + ".weight"] + w[name + ".bias"]


def linear(x, w, name: str):
    weight = w[name + ".weight"]  # Conv1D: stored (in, out)
    *lead, K = x.shape
    y = matmul(x.reshape(-1, K), weight)  # (B * T, out) in the weights' dtype, accumulated in float32
    return y.reshape(*lead, weight.shape[1]) + w[name + ".bias"]  # (B, T, out)


def attention(x, w, name: str, config: GPT2Config, attend, cache: KVCache | None, layer: int,
              last_query: bool = False):
    """The attention block's output (B, T, C); (B, 1, C) for the last position alone if last_query
    (every position's keys and values still computed and cached; the attention over the last query
    alone, where the attention takes fewer queries than keys)."""
    B, T, C = x.shape
    NH, hs = config.n_head, config.head_size
    qkv = linear(x, w, name + ".c_attn")  # (B, T, 3C): columns are [q | k | v], each NH heads of hs
    qkv = qkv.astype(w[name + ".c_attn.weight"].dtype, copy=False)  # the attention in the weights' dtype
    qkv = qkv.reshape(B, T, 3, NH, hs)  # (B, T, 3, NH, hs)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (B, NH, T, hs), a view
    if cache is not None:
        k, v = cache.append(layer, k, v)  # each (B, NH, past + T, hs)
    one_query = last_query and takes_short_queries(attend)
    y = attend(q[:, :, -1:] if one_query else q, k, v)  # (B, NH, T_q, hs): T_q = 1 sees every key (mask bottom-right)
    if last_query and not one_query:
        y = y[:, :, -1:]  # (B, NH, 1, hs)
    y = y.transpose(0, 2, 1, 3).reshape(B, -1, C)  # (B, 1 or T, C): the heads side by side again
    return linear(y, w, name + ".c_proj")


def mlp(x, w, name: str):
    h = linear(x, w, name + ".c_fc").astype(np.float32, copy=False)  # (B, T, 4C): GELU in float32
    return linear(gelu(h), w, name + ".c_proj")


def forward(params: dict, config: GPT2Config, idx, attend, *, cache: KVCache | None = None, last_only: bool = False):
    """Logits (B, T, vocab) for token ids idx (B, T); (B, 1, vocab) for the last position only if
    last_only. With a cache, idx continues the cached sequence and its keys and values are added."""
    w = params
    xp = array_module(w["wte.weight"])
    idx = xp.asarray(idx)
    B, T = idx.shape
    start = cache.length if cache is not None else 0
    if start + T > config.n_positions:
        raise ValueError(f"{start + T} positions, but the model has {config.n_positions}")
    if cache is not None and start + T > cache.max_len:
        raise ValueError(f"the KV cache holds {cache.max_len} positions; {start + T} needed")
    x = w["wte.weight"][idx].astype(np.float32, copy=False) + w["wpe.weight"][start:start + T]  # (B, T, C), float32
    for i in range(config.n_layer):
        h = f"h.{i}"
        # with last_only, only the last position reaches the logits: the last layer computes every
        # position's keys and values, and its attention output and MLP for the last position alone
        last = last_only and i == config.n_layer - 1
        a = attention(layer_norm(x, w, h + ".ln_1", config.layer_norm_epsilon), w, h + ".attn",
                      config, attend, cache, i, last_query=last)
        x = (x[:, -1:] if last else x) + a  # (B, T, C), or (B, 1, C) after the last layer if last_only
        x = x + mlp(layer_norm(x, w, h + ".ln_2", config.layer_norm_epsilon), w, h + ".mlp")
    if cache is not None:
        cache.length += T
    if last_only:
        x = x[:, -1:]  # (B, 1, C) (already so after a last layer)
    x = layer_norm(x, w, "ln_f", config.layer_norm_epsilon)
    # lm_head is tied to wte, read through its transpose where it lies; a product like the others
    # (operands in the weights' dtype), its output float32, so that no logit is rounded to 16 bits
    logits = matmul(x.reshape(-1, config.n_embd), w["wte.weight"].T, np.float32)  # (B * T, vocab)
    return logits.reshape(B, -1, config.vocab_size)  # (B, T, vocab), or (B, 1, vocab) if last_only


def forward_activation_bytes(config: GPT2Config, B: int, T: int, dtype, *, reference: bool, last_only: bool = True) -> int:
    """The most bytes forward() over T positions without a cache holds at once beside the weights, as
    the code above allocates on CuPy (every temporary its own array; NumPy elides some, so holds at
    most this): the ids, and the largest of, per layer, the attention block (x, ln_1(x), qkv, then
    the attention's own, lm.attention.attention_bytes: `reference` or a rung; then its heads merged,
    c_proj and its bias) and the MLP (x, ln_2(x) and GELU's four (B, T, 4C) float32 temporaries at
    once), the last layer's output rows one under last_only; and the logits (B, T or 1, vocab) float32.
    `dtype`: the weights', that of qkv and the products' outputs."""
    C, NH, hs, V = config.n_embd, config.n_head, config.head_size, config.vocab_size
    s, f = run_dtype(dtype).itemsize, 4

    def layer(rows: int) -> int:  # rows: the positions after the attention (T, or 1 in a trimmed last layer)
        x, qkv = 2 * B * T * C * f, 3 * B * T * C * s  # the residual stream and ln_1(x); qkv
        attend = x + qkv + attention_bytes(B, NH, NH, rows, T, hs, s, reference=reference)
        project = x + qkv + 4 * B * rows * C * s  # the output, its heads merged, c_proj's product and + bias
        mlp = 2 * B * rows * C * f + 4 * B * rows * 4 * C * f  # x, ln_2(x); GELU's four
        return max(attend, project, mlp)

    trimmed = 1 if last_only else T
    layers = max(layer(T) if config.n_layer > 1 else 0, layer(trimmed))
    logits = B * trimmed * (C * (f + s) + V * f)  # ln_f(x), its copy in the weights' dtype, the logits
    return B * T * 8 + max(layers, logits)  # the ids, int64
