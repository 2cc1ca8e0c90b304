"""Llama 3 weights: from the Hugging Face hub, a local folder, or a seed.

model.py sees one flat dict of checkpoint-native names (`model.embed_tokens.weight`,
`model.layers.0.self_attn.q_proj.weight`, `model.norm.weight`, `lm_head.weight`) holding arrays in
the run's dtype (float32 unless asked; each tensor cast on the host as it is read, so bfloat16 on
disk reaches a bfloat16 run unconverted). The quirks:

- nn.Linear weights are stored (out, in): a projection is `x @ weight.T`; used as stored.
- q_proj and k_proj rows are stored permuted for HF's rotate_half RoPE (element i of a head paired
  with i + head_dim / 2), not Meta's interleaved pairs: model.py rotates that way, nothing is undone.
- `lm_head.weight` exists only when tie_word_embeddings is false; a tied checkpoint that stores it
  anyway must store embed_tokens' values, and it is dropped.
- `model.layers.N.self_attn.rotary_emb.inv_freq` (old transformers' buffer) is not a weight: dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from lm.arrays import run_dtype, to_device
from lm.checkpoint import INDEX, Checkpoint, check_tensors, listed, locate, random_params, read_checkpoint
from lm.errors import CheckpointError

from . import config as config_mod
from .config import SIZES, LlamaConfig

_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint, with its shape as stored ((out, in) for a projection)."""
    C, F, hs = config.hidden_size, config.intermediate_size, config.head_size
    q, kv = config.num_attention_heads * hs, config.num_key_value_heads * hs
    shapes = {"model.embed_tokens.weight": (config.vocab_size, C)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
            p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, q),
            p + "post_attention_layernorm.weight": (C,),
            p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C), p + "mlp.down_proj.weight": (C, F),
        }
    shapes["model.norm.weight"] = (C,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, C)
    return shapes


def weight_bytes_per_token(config: LlamaConfig, dtype) -> int:
    """Bytes of weights one decode step reads, every tensor in dtype: each once, the embedding table
    whole where it is the (tied) head, else one row of it and lm_head whole. The KV cache is not counted."""
    elements = sum(math.prod(shape) for shape in expected_shapes(config).values())
    if not config.tie_word_embeddings:  # only the token's row of embed_tokens
        elements -= (config.vocab_size - 1) * config.hidden_size
    return elements * run_dtype(dtype).itemsize


def load(source: str | os.PathLike, *, xp=np, dtype=np.float32) -> Checkpoint:
    """A hub id or a local folder (or .safetensors file, with config.json beside it)."""
    folder, file = locate(str(source))
    return load_folder(folder, xp=xp, name=str(source), file=file, dtype=dtype)


def load_folder(folder: str | os.PathLike, *, xp=np, name: str | None = None, file: Path | None = None,
                dtype=np.float32) -> Checkpoint:
    """config.json and model.safetensors (or the shards its index names) from one folder, in dtype."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json (a Llama checkpoint's sizes cannot be read off its shapes)")
    config = config_mod.from_json(config_path)
    if file is None and not (folder / "model.safetensors").is_file() and not (folder / INDEX).is_file():
        shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
        if shards:
            raise CheckpointError(f"{folder}: shards {listed(shards)} but no {INDEX} to say what is in them")
    params = normalize(read_checkpoint(folder, file, skip=_BUFFER.match, dtype=dtype), config)
    check_shapes(params, config)
    params = {k: to_device(xp, v) for k, v in params.items()}
    return Checkpoint(name=name or str(folder), config=config, params=params, folder=folder)


def normalize(tensors: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """A tied checkpoint's stored lm_head (if any) checked against embed_tokens and dropped."""
    params = dict(tensors)
    if config.tie_word_embeddings and "lm_head.weight" in params:
        lm_head, embed = params.pop("lm_head.weight"), params.get("model.embed_tokens.weight")
        if embed is None or lm_head.shape != embed.shape or not np.array_equal(lm_head, embed):
            raise CheckpointError("lm_head.weight differs from model.embed_tokens.weight, but config.json says "
                                  "tie_word_embeddings: true")
    return params


def check_shapes(params: dict, config: LlamaConfig) -> None:
    where = (f"{config.num_hidden_layers} layers of width {config.hidden_size}"
             f"{'' if config.tie_word_embeddings else ', lm_head untied'}")
    check_tensors(params, expected_shapes(config), missing_for=where, unexpected_for=where)


def random_weights(config: LlamaConfig | str = "llama-3.2-1b", *, seed: int = 0, xp=np,
                   dtype=np.float32) -> Checkpoint:
    """Llama-shaped weights from a seed: normal with std 0.02 (transformers' initializer_range), the
    RMSNorm weights 1. Drawn with the array module's own generator, so NumPy and CuPy differ; drawn
    in float32 and cast to dtype tensor by tensor (the values cast_params would give)."""
    def draw(rng, config, name, shape):  # float32
        if name.endswith("norm.weight"):
            return xp.ones(shape, dtype=np.float32)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    label, config, params = random_params(config, SIZES, expected_shapes, draw, seed=seed, xp=xp, dtype=dtype)
    label = label or f"{config.num_hidden_layers}-layer, {config.hidden_size}-wide Llama"
    return Checkpoint(name=f"random {label} (seed {seed})", config=config, params=params)


def save(checkpoint: Checkpoint, folder: str | os.PathLike, *, shards: int = 1) -> Path:
    """Write config.json and model.safetensors as save_pretrained does; with shards > 1, the tensors
    split over model-0000i-of-0000n.safetensors and named in model.safetensors.index.json."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_mod.to_json(checkpoint.config), indent=2) + "\n")
    tensors = {k: (v.get() if hasattr(v, "get") else np.ascontiguousarray(v)).astype(np.float32)
               for k, v in checkpoint.params.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, str(folder / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in part}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    return folder
