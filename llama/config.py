"""Llama 3's hyperparameters: the three sizes the lab knows, or a checkpoint's config.json.

Field names are transformers' (config.json's); the properties n_layer, n_head, kv_heads, head_size
and n_positions are what the shared code (lm/) reads of any model's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from lm.checkpoint import read_json
from lm.errors import CheckpointError

ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency scaling (rope_type "llama3"): long wavelengths slowed down by `factor`."""
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    vocab_size: int = 128256
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)  # None: plain RoPE
    tie_word_embeddings: bool = True
    bos_token_id: int = 128000  # <|begin_of_text|>
    eos_token_id: tuple[int, ...] = (128001,)  # <|end_of_text|>; instruct models add <|eot_id|> 128009

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(f"config: hidden_size={self.hidden_size} is not a multiple of "
                                  f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_size % 2:
            raise CheckpointError(f"config: head_dim={self.head_size} is odd; RoPE rotates pairs")

    @property
    def n_layer(self) -> int:
        return self.num_hidden_layers

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def n_positions(self) -> int:
        return self.max_position_embeddings


def _size(hidden, intermediate, layers, heads, factor, tied, head_dim=None):
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=head_dim,
                       rope_scaling=RopeScaling(factor=factor), tie_word_embeddings=tied)


SIZES = {
    "llama-3.2-1b": _size(2048, 8192, 16, 32, 32.0, True),  # 1.24B parameters, head_dim 64
    "llama-3.2-3b": _size(3072, 8192, 28, 24, 32.0, True),  # 3.21B, head_dim 128
    "llama-3.1-8b": _size(4096, 14336, 32, 32, 8.0, False),  # 8.03B, head_dim 128
}

# config.json settings that change the computation; only Llama's own values are supported
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """The rotary frequencies (head_dim / 2,), float32, in float64 arithmetic: theta^(-2i / head_dim),
    then Llama 3's scaling: with wavelen = 2 pi / inv_freq and orig its original context, keep inv_freq
    where wavelen < orig / high_freq_factor, divide it by factor where wavelen > orig / low_freq_factor,
    and in between interpolate with smooth = (orig / wavelen - low) / (high - low)."""
    hs = config.head_size
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hs, 2, dtype=np.float64) / hs)
    s = config.rope_scaling
    if s is not None:
        wavelen = 2 * math.pi / inv_freq
        orig, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
        smooth = (orig / wavelen - low) / (high - low)
        between = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = np.where(wavelen < orig / high, inv_freq, np.where(wavelen > orig / low, inv_freq / s.factor, between))
    return inv_freq.astype(np.float32)


def from_json(path: str | Path) -> LlamaConfig:
    """Read transformers' config.json for a Llama checkpoint: `rope_theta` and `rope_scaling` as the
    hub's configs write them, or `rope_parameters` (transformers 5) holding both."""
    path = Path(path)
    raw = read_json(path, "a readable JSON config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if raw.get("model_type") != "llama":
        raise CheckpointError(f"{path}: model_type is {raw.get('model_type')!r}; this loader reads Llama checkpoints")
    for key, want in _REQUIRED.items():
        if raw.get(key, want) != want:
            raise CheckpointError(f"{path}: {key}={raw[key]!r} is not supported (Llama uses {want!r})")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", LlamaConfig.rope_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{path}: rope_type {rope_type!r} is not supported (the lab knows "
                              f"{', '.join(ROPE_TYPES)})")
    try:
        scaling = None if rope_type == "default" else RopeScaling(
            **{f.name: type(f.default)(rope[f.name]) for f in fields(RopeScaling) if f.name in rope})
        eos = raw.get("eos_token_id", 128001)
        values = {f.name: raw[f.name] for f in fields(LlamaConfig) if raw.get(f.name) is not None}
        values |= {"rope_theta": float(theta), "rope_scaling": scaling,
                   "eos_token_id": tuple(eos) if isinstance(eos, list) else (int(eos),)}
        return LlamaConfig(**values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def to_json(config: LlamaConfig) -> dict:
    """config.json as the hub's Llama 3 checkpoints write it (rope_theta and rope_scaling)."""
    s = config.rope_scaling
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
            **{f.name: getattr(config, f.name) for f in fields(LlamaConfig) if f.name not in ("rope_scaling", "eos_token_id")},
            "rope_scaling": None if s is None else {"rope_type": "llama3", **{f.name: getattr(s, f.name) for f in fields(s)}},
            "eos_token_id": list(config.eos_token_id) if len(config.eos_token_id) > 1 else config.eos_token_id[0]}
