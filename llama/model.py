"""Llama 3's forward pass in array code: NumPy or CuPy (`xp`), attention passed in.

    logits = forward(params, config, idx, attend)          idx (B, T) token ids -> (B, T, vocab)

`params` maps checkpoint-native names (`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`,
...) to arrays, as llama.load makes them; nn.Linear weights are (out, in), so a projection is
`x @ weight.T` (no biases). Per layer: x += o_proj(attend(rope(q), rope(k), v)) of RMSNorm(x), then
x += down(silu(gate(h)) * up(h)) of h = RMSNorm(x). `attend(q, k, v) -> o` is causal attention
with q (B, NH, T, hs) and k, v (B, NH_kv, T_k, hs), NH a multiple of NH_kv (grouped-query
attention): a rung that declares gqa, or kernels.reference_attention. With a KVCache only the NH_kv
key/value heads are kept, and the causal mask is aligned bottom-right.

Precision, as gpt2/model.py: float32 weights give float32 everywhere. With 16-bit weights each
product takes its operands in the weights' dtype (accumulating in float32, lm/products.py: no
float32 copy of a weight), and so do q, k, v, the attention and the KV cache; the residual stream and
the logits stay float32, and RMSNorm, RoPE and SiLU compute in float32, writing the dtype the next
product takes (llama/pointwise.py: one launch each on CuPy).
"""

from __future__ import annotations

import functools

import numpy as np

from lm.arrays import array_module, run_dtype
from lm.attention import attention_bytes, takes_short_queries
from lm.kv_cache import KVCache
from lm.products import matmul

from .config import LlamaConfig, rope_inv_freq
from .pointwise import rms_norm, rope, silu_mul


def compute_dtype(params: dict):
    """The dtype of the blocks' products, of q, k, v and of the KV cache: the weights' own."""
    return params["model.layers.0.self_attn.q_proj.weight"].dtype


def linear(x, weight):
    """x (..., in) @ weight.T for weight (out, in), in the weights' dtype, accumulated in float32; a
    2-D product on the weight's transposed view (lm/products.py: no copy of it, whatever the dtype)."""
    shape = x.shape
    y = matmul(x.reshape(-1, shape[-1]), weight.T)  # (N, out)
    return y.reshape(*shape[:-1], weight.shape[0])  # (..., out)


@functools.lru_cache(maxsize=8)
def _inv_freq(config: LlamaConfig, xp):
    """rope_inv_freq(config) on xp, copied once a config: a graphed prefill (lm/prefill_graph.py) runs
    rope_tables inside a capture, which cannot copy from the host."""
    return xp.asarray(rope_inv_freq(config))


def rope_tables(config: LlamaConfig, start: int, T: int, xp):
    """cos and sin (T, hs) for positions start .. start + T - 1, float32: angle pos * inv_freq[i] in
    both halves of a head (HF's layout: element i is rotated with element i + hs / 2)."""
    inv_freq = _inv_freq(config, xp)  # (hs / 2,)
    pos = xp.arange(start, start + T, dtype=np.float32)  # (T,)
    angles = pos[:, None] * inv_freq[None, :]  # (T, hs / 2)
    angles = xp.concatenate([angles, angles], axis=-1)  # (T, hs)
    return xp.cos(angles), xp.sin(angles)


def attention(x, w, name: str, config: LlamaConfig, attend, cache: KVCache | None, layer: int, cos, sin,
              last_query: bool = False, tail: int = 1):
    """The attention block's output (B, T, C); (B, tail, C) for the last `tail` positions alone if
    last_query (every position's keys and values still computed and cached; those positions' queries
    alone, where the attention takes fewer queries than keys)."""
    B, T, C = x.shape
    NH, NKV, hs = config.num_attention_heads, config.num_key_value_heads, config.head_size
    dtype = w[name + ".q_proj.weight"].dtype  # q, k, v and the attention in the weights' dtype
    short = last_query and takes_short_queries(attend)
    xq, cq, sq = (x[:, -tail:], cos[-tail:], sin[-tail:]) if short else (x, cos, sin)
    q = linear(xq, w[name + ".q_proj.weight"]).reshape(B, -1, NH, hs).transpose(0, 2, 1, 3)  # (B, NH, T_q, hs)
    k = linear(x, w[name + ".k_proj.weight"]).reshape(B, T, NKV, hs).transpose(0, 2, 1, 3)  # (B, NKV, T, hs)
    v = linear(x, w[name + ".v_proj.weight"]).reshape(B, T, NKV, hs).transpose(0, 2, 1, 3)  # (B, NKV, T, hs)
    q, k = rope(q, cq, sq, dtype), rope(k, cos, sin, dtype)  # contiguous (B, H, T_q or T, hs)
    if cache is not None:
        k, v = cache.append(layer, k, v)  # each (B, NKV, past + T, hs)
    y = attend(q, k, v)  # (B, NH, T_q, hs): the mask aligned bottom-right, the last query sees every key
    if last_query and not short:
        y = y[:, :, -tail:]  # (B, NH, tail, hs)
    y = y.transpose(0, 2, 1, 3).reshape(B, -1, NH * hs)  # (B, tail or T, NH * hs): the heads side by side again
    return linear(y, w[name + ".o_proj.weight"])


def mlp(x, w, name: str):
    gate = linear(x, w[name + ".gate_proj.weight"])  # (B, T, F), in the weights' dtype
    up = linear(x, w[name + ".up_proj.weight"])  # (B, T, F)
    return linear(silu_mul(gate, up), w[name + ".down_proj.weight"])  # SiLU and the product in float32


def forward(params: dict, config: LlamaConfig, idx, attend, *, cache: KVCache | None = None, last_only: bool = False):
    """Logits (B, T, vocab) for token ids idx (B, T); (B, 1, vocab) for the last position only if
    last_only. With a cache, idx continues the cached sequence and its keys and values are added."""
    return logits_of(params, config, hidden_states(params, config, idx, attend, cache=cache, last_only=last_only))


def hidden_states(params: dict, config: LlamaConfig, idx, attend, *, cache: KVCache | None = None,
                  last_only: bool = False, tail: int = 1):
    """forward() up to the final norm: the residual stream after the last layer, (B, T, C) float32, or
    (B, tail, C) for the last `tail` positions if last_only (a graphed prefill's: its prompt ends
    somewhere in its bucket's last rows); the cache advanced by T."""
    w = params
    eps = config.rms_norm_eps
    dtype = compute_dtype(params)
    xp = array_module(w["model.embed_tokens.weight"])
    idx = xp.asarray(idx)
    B, T = idx.shape
    start = cache.length if cache is not None else 0
    if start + T > config.max_position_embeddings:
        raise ValueError(f"{start + T} positions, but the model has {config.max_position_embeddings}")
    if cache is not None and start + T > cache.max_len:
        raise ValueError(f"the KV cache holds {cache.max_len} positions; {start + T} needed")
    cos, sin = rope_tables(config, start, T, xp)  # each (T, hs), broadcast over (B, H, T, hs)
    x = w["model.embed_tokens.weight"][idx].astype(np.float32)  # (B, T, C), float32
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        # with last_only, only the last `tail` positions reach the logits: the last layer computes every
        # position's keys and values, and its queries, attention output and MLP for those alone
        last = last_only and i == config.num_hidden_layers - 1
        h = rms_norm(x, w[p + ".input_layernorm.weight"], eps, dtype)  # the products' operand
        a = attention(h, w, p + ".self_attn", config, attend, cache, i, cos, sin, last_query=last, tail=tail)
        x = (x[:, -tail:] if last else x) + a  # (B, T, C), or (B, tail, C) after the last layer if last_only
        x = x + mlp(rms_norm(x, w[p + ".post_attention_layernorm.weight"], eps, dtype), w, p + ".mlp")
    if cache is not None:
        cache.length += T
    return x[:, -tail:] if last_only else x  # (B, tail, C) already so after a last layer under last_only


def logits_of(params: dict, config: LlamaConfig, x):
    """The logits (B, T, vocab) float32 of the residual stream x (B, T, C) after the last layer: the final
    RMSNorm, then the head, a product like the others (operands in the weights' dtype), its output
    float32, so that no logit is rounded to 16 bits."""
    x = rms_norm(x, params["model.norm.weight"], config.rms_norm_eps, compute_dtype(params))  # the head's operand
    head = params["model.embed_tokens.weight"] if config.tie_word_embeddings else params["lm_head.weight"]  # (vocab, C)
    logits = matmul(x.reshape(-1, config.hidden_size), head.T, np.float32)  # (B * T, vocab)
    return logits.reshape(x.shape[0], -1, config.vocab_size)


def forward_activation_bytes(config: LlamaConfig, B: int, T: int, dtype, *, reference: bool,
                             last_only: bool = True) -> int:
    """The most bytes forward() over T positions without a cache holds at once beside the weights, as
    the code above allocates on CuPy (every temporary its own array; NumPy elides some, so holds at
    most this): the ids and RoPE's tables, and the largest of, per layer, the attention block (x,
    RMSNorm(x), q, k, v and RoPE's five temporaries of k in float32; then the attention's own,
    lm.attention.attention_bytes: `reference` or a rung; then its heads merged and o_proj) and the MLP
    (x, RMSNorm(x) and four (B, T, F) float32 arrays at once: gate, up and SiLU's temporaries), the
    last layer on one query row under last_only (where the attention takes it: a rung without short
    queries is counted over every row, a little more); and the logits (B, T or 1, vocab) float32.
    `dtype`: the weights', that of q, k, v and the products' outputs."""
    C, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    NH, NKV, hs = config.num_attention_heads, config.num_key_value_heads, config.head_size
    s, f = run_dtype(dtype).itemsize, 4

    def layer(rows: int) -> int:  # rows: the query rows and the positions after the attention
        x, kv = 2 * B * T * C * f, 2 * B * T * NKV * hs * s  # the residual stream and RMSNorm(x); k and v
        q = B * rows * NH * hs * s
        rope = x + 2 * q + kv + 5 * B * T * NKV * hs * f  # q before and after RoPE beside k's
        attend = x + q + kv + attention_bytes(B, NH, NKV, rows, T, hs, s, reference=reference)
        project = x + 3 * q + kv + B * rows * C * s  # the output, its heads merged, o_proj's product
        mlp = 2 * B * rows * C * f + 4 * B * rows * F * f  # x, RMSNorm(x); gate, up, SiLU's two
        return max(rope, attend, project, mlp)

    trimmed = 1 if last_only else T
    layers = max(layer(T) if config.num_hidden_layers > 1 else 0, layer(trimmed))
    logits = B * trimmed * (C * (f + s) + V * f)  # RMSNorm(x), its copy in the weights' dtype, the logits
    return B * T * 8 + 2 * T * hs * f + max(layers, logits)  # the ids (int64), cos and sin
