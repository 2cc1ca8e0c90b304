"""GPT-2's hyperparameters: the four released sizes, or a checkpoint's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from .errors import CheckpointError


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    n_positions: int = 1024  # the context: learned position embeddings for this many tokens
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    eos_token_id: int = 50256  # <|endoftext|>

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config: n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:  # what the shared KV cache keeps: GPT-2 has a key/value head per query head
        return self.n_head

    @property
    def mlp_width(self) -> int:
        return self.n_inner or 4 * self.n_embd


SIZES = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),  # 124M parameters
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# config.json settings that change the computation; only GPT-2's own values are supported
_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh"}  # both the tanh approximation, constant 0.044715
_REQUIRED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


def from_json(path: str | Path) -> GPT2Config:
    """Read transformers' config.json for a GPT-2 checkpoint."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if raw.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{path}: model_type is {raw['model_type']!r}; this loader reads GPT-2 checkpoints")
    activation = raw.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_function {activation!r} is not GPT-2's tanh GELU (gelu_new)")
    for key, want in _REQUIRED.items():
        if raw.get(key, want) != want:
            raise CheckpointError(f"{path}: {key}={raw[key]!r} is not supported (GPT-2 uses {want})")
    if raw.get("tie_word_embeddings", True) is not True:
        raise CheckpointError(f"{path}: tie_word_embeddings is false; GPT-2 ties lm_head to wte")
    if "n_ctx" in raw and "n_positions" not in raw:  # the oldest configs name the context n_ctx
        raw["n_positions"] = raw["n_ctx"]
    known = {f.name for f in fields(GPT2Config)}
    values = {k: raw[k] for k in known if raw.get(k) is not None}
    try:
        return GPT2Config(**values)
    except TypeError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def from_shapes(shapes: dict[str, tuple[int, ...]]) -> GPT2Config:
    """A checkpoint without config.json: match its tensor shapes to one of the released sizes
    (n_head cannot be read off the shapes)."""
    vocab_size, n_embd = shapes["wte.weight"]
    n_positions = shapes["wpe.weight"][0]
    n_layer = len({name.split(".")[1] for name in shapes if name.startswith("h.")})
    for config in SIZES.values():
        if (config.n_layer, config.n_embd) == (n_layer, n_embd):
            return GPT2Config(n_layer=n_layer, n_head=config.n_head, n_embd=n_embd,
                              vocab_size=vocab_size, n_positions=n_positions)
    raise CheckpointError(
        f"no config.json, and {n_layer} layers of width {n_embd} match none of {', '.join(SIZES)}: "
        "add the checkpoint's config.json"
    )
