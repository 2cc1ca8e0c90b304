"""Llama's weights as the fast engine reads them: the layout chosen once at load (decode_layout: each
layer's q, k and v projections stacked into one matrix, gate and up into another, the checkpoint's
names kept as views of them) and the engine's views of it (decode_weights). Every function takes the
array module (`cp`: CuPy, or NumPy in the CPU tests).

Every matrix is stored (out, in) row-major, the layout rms_gemv.cu reads (a warp reads one output's
weights contiguously), so nothing else is re-laid: o_proj, down_proj, the embedding table and
lm_head are read where they lie. Tied embeddings (1B, 3B): the table is the head, read once per step
as its one copy. Stacking makes a layer's three (two) products one stream: one launch, one RMSNorm,
and the pairs the kernels combine (RoPE's halves of a head, gate's and up's rows) in one matrix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lm.arrays import address, array_module
from lm.bf16 import kernel_type, to_float32

from ..config import LlamaConfig

# the stacked matrices of a layer (engine key -> the projections stacked in it, in row order)
STACKS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj")}
SINGLE = {"o_proj": "self_attn.o_proj", "down_proj": "mlp.down_proj"}
NORMS = ("input_layernorm", "post_attention_layernorm")  # a layer's RMSNorm weights


def layer_name(i: int, part: str) -> str:
    return f"model.layers.{i}.{part}.weight"


def stacked(parts: list):
    """The one matrix of which `parts` are consecutive row blocks, in order (as decode_layout leaves
    them), as a view; None if they are not."""
    first = parts[0]
    base = first.base  # the array that owns the memory (NumPy and CuPy both name the owner, not a view)
    if base is None or not base.flags.c_contiguous or base.size % first.shape[-1]:
        return None
    if base.dtype != first.dtype:  # a stack made in another type of the same width (bfloat16 as bits)
        if base.dtype.itemsize != first.dtype.itemsize:
            return None
        base = base.view(first.dtype)
    base = base.reshape(-1, first.shape[-1])  # its rows, as wide as the parts' (a view: it is contiguous)
    row_bytes = first.shape[1] * first.dtype.itemsize
    offset = address(first) - address(base)
    at = address(first)
    for p in parts:
        if p.ndim != 2 or p.shape[1] != first.shape[1] or p.dtype != first.dtype or not p.flags.c_contiguous:
            return None
        if address(p) != at:
            return None
        at += p.nbytes
    rows = sum(p.shape[0] for p in parts)
    if offset < 0 or offset % row_bytes or offset // row_bytes + rows > base.shape[0]:
        return None
    return base[offset // row_bytes:offset // row_bytes + rows]


def decode_layout(params: dict, config: LlamaConfig) -> dict:
    """In place, the layout the engine reads without a copy: per layer, q_proj, k_proj and v_proj
    become consecutive row blocks of one ((NH + 2 NKV) HS, C) matrix, and gate_proj and up_proj of one
    (2F, C) matrix, each name a view of its rows (the same values, shapes and dtype: the eager model
    reads them as before). One stack at a time: at most one layer's projections exist twice at once.
    Already laid out, nothing moves. Returns params.

    On CuPy, the default memory pool's free blocks are handed back to the device before the first stack
    and after each layer's: a stack cut from a free block of a chunk that also holds live arrays (the
    float32 draws of random weights, a layer's freed originals) would pin the rest of that chunk for
    as long as the model lives."""
    release = _pool_release(next(iter(params.values())))
    release()
    for i in range(config.num_hidden_layers):
        for names in STACKS.values():
            keys = [layer_name(i, n) for n in names]
            parts = [params[k] for k in keys]
            if stacked(parts) is not None:
                continue
            xp = array_module(parts[0])
            dtype = parts[0].dtype
            bits = np.uint16 if dtype.name == "bfloat16" else dtype  # a plain copy, whatever the dtype
            stack = xp.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=bits)
            row = 0
            for k, p in zip(keys, parts, strict=True):
                stack[row:row + p.shape[0]] = p.view(bits) if dtype.name == "bfloat16" else p
                params[k] = stack[row:row + p.shape[0]].view(dtype)
                row += p.shape[0]
            del parts, p
        release()
    return params


def _pool_release(array):
    """A function that hands CuPy's default pool's free blocks back to the device (nothing on NumPy)."""
    if array_module(array) is np:
        return lambda: None
    import cupy

    pool = cupy.get_default_memory_pool()
    return lambda: (cupy.cuda.Device().synchronize(), pool.free_all_blocks())


@dataclass
class DecodeWeights:
    """The weights as the engine's kernels read them: the matrices in the run's element type (float32
    or bfloat16 bits), (out, in) row-major; the RMSNorm weights in float32."""

    embed: object  # (V, C): the embedding table
    head: object  # (V, C): the table itself when the embeddings are tied, else lm_head
    layers: list  # per layer, qkv / o_proj / gate_up / down_proj -> (out, in)
    norms: dict  # checkpoint-native name -> (C,) float32

    def arrays(self) -> dict:
        """Every array, by name (the layers' as layers.N.<key>)."""
        return {"embed": self.embed, "head": self.head, **self.norms,
                **{f"layers.{i}.{key}": a for i, layer in enumerate(self.layers) for key, a in layer.items()}}


def on_16_bytes(a):
    """a, or a copy of it where it does not start on a 16-byte boundary (rms_gemv.cu reads a norm's weight
    as float4s; a view into a larger array may start anywhere)."""
    return a if address(a) % 16 == 0 else a.copy()


def decode_weights(cp, params: dict, config: LlamaConfig, dtype: str) -> DecodeWeights:
    """The engine's weights from params: views of them where params already hold what the kernels read
    (the run's dtype; q/k/v and gate/up stacked by decode_layout), else one copy each."""

    def matrix(a):
        a = kernel_type(cp, a, dtype)
        return a if a.flags.c_contiguous else cp.ascontiguousarray(a)

    def stack(i, names):
        parts = [params[layer_name(i, n)] for n in names]
        whole = stacked(parts)
        if whole is not None:
            return matrix(whole)
        return cp.concatenate([matrix(p) for p in parts])  # one copy (a converted part is copied twice, briefly)

    embed = matrix(params["model.embed_tokens.weight"])
    layers = [{**{key: stack(i, names) for key, names in STACKS.items()},
               **{key: matrix(params[layer_name(i, name)]) for key, name in SINGLE.items()}}
              for i in range(config.num_hidden_layers)]
    norms = {name: on_16_bytes(to_float32(cp, a)) for name, a in params.items() if name.endswith("norm.weight")}
    head = embed if config.tie_word_embeddings else matrix(params["lm_head.weight"])
    return DecodeWeights(embed=embed, head=head, layers=layers, norms=norms)
