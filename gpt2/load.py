"""GPT-2 weights: from the Hugging Face hub, a local folder, or a seed.

Every checkpoint quirk lives here, so model.py sees one flat dict of checkpoint-native names
(`wte.weight`, `h.0.attn.c_attn.weight`, `ln_f.bias`, ...) holding arrays in the run's dtype (float32
unless asked: each tensor is cast as it is loaded or drawn, so a 16-bit run's weights never exist
on the device in float32):

- The hub's `openai-community/gpt2` `model.safetensors` names tensors without a prefix;
  transformers' `save_pretrained` writes `transformer.wte.weight`, ... Both are read.
- `lm_head.weight` is tied to `wte.weight`: dropped when present (after checking it is the same).
- `h.N.attn.bias` and `h.N.attn.masked_bias` are the causal-mask buffers of old transformers
  versions, not weights: dropped.
- The Conv1D weights (`c_attn`, `c_proj`, `c_fc`) are stored (in, out), so `x @ w` is the
  projection: they are used as stored, never transposed.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from lm.arrays import to_device
from lm.checkpoint import HUB_FILES, Checkpoint, check_tensors, download, listed, locate, random_params, read_checkpoint  # noqa: F401 (gpt2.load names them)

from . import config as config_mod
from .config import SIZES, GPT2Config
from .errors import CheckpointError

DEFAULT_MODEL = "openai-community/gpt2"
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT-2 checkpoint, with its shape as stored."""
    C, F = config.n_embd, config.mlp_width
    shapes = {"wte.weight": (config.vocab_size, C), "wpe.weight": (config.n_positions, C)}
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (C, F), p + "mlp.c_fc.bias": (F,),
            p + "mlp.c_proj.weight": (F, C), p + "mlp.c_proj.bias": (C,),
        }
    shapes |= {"ln_f.weight": (C,), "ln_f.bias": (C,)}
    return shapes


def load(source: str | os.PathLike | None = None, *, xp=np, dtype=np.float32) -> Checkpoint:
    """A hub id (default openai-community/gpt2) or a local folder (or .safetensors file)."""
    source = str(source or DEFAULT_MODEL)
    folder, file = locate(source)
    return load_folder(folder, xp=xp, name=source, file=file, dtype=dtype)


def load_folder(folder: str | os.PathLike, *, xp=np, name: str | None = None, file: Path | None = None,
                dtype=np.float32) -> Checkpoint:
    """config.json (if present) and model.safetensors (or its shards) from one folder, in dtype."""
    folder = Path(folder)
    tensors = read_checkpoint(folder, file, skip=lambda key: _BUFFER.match(key.removeprefix("transformer.")),
                              dtype=dtype)
    params = normalize(tensors)
    config_path = folder / "config.json"
    config = config_mod.from_json(config_path) if config_path.is_file() else config_mod.from_shapes(
        {k: v.shape for k, v in params.items()})
    check_shapes(params, config)
    params = {k: to_device(xp, v) for k, v in params.items()}
    return Checkpoint(name=name or str(folder), config=config, params=params, folder=folder)


def normalize(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Both naming schemes to checkpoint-native names; buffers and the tied lm_head dropped."""
    params = {}
    lm_head = tensors.get("lm_head.weight")
    for key, t in tensors.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" or _BUFFER.match(name):
            continue
        if name in params:
            raise CheckpointError(f"{name}: stored twice (with and without the transformer. prefix)")
        params[name] = t
    for required in ("wte.weight", "wpe.weight"):
        if required not in params:
            raise CheckpointError(f"{required}: missing; this does not look like a GPT-2 checkpoint")
    if lm_head is not None and not (lm_head.shape == params["wte.weight"].shape
                                     and np.array_equal(lm_head, params["wte.weight"])):
        raise CheckpointError("lm_head.weight differs from wte.weight; GPT-2 ties the two")
    return params


def check_shapes(params: dict, config: GPT2Config) -> None:
    check_tensors(params, expected_shapes(config), missing_for=f"{config.n_layer} layers of width {config.n_embd}",
                  unexpected_for=f"a {config.n_layer}-layer GPT-2")


def random_weights(config: GPT2Config | str = "gpt2", *, seed: int = 0, xp=np, dtype=np.float32) -> Checkpoint:
    """GPT-2-shaped weights from a seed, initialised as GPT-2 was: normal with std 0.02 (the residual
    projections c_proj scaled by 1/sqrt(2 n_layer)), biases 0, LayerNorm weights 1. Drawn with the
    array module's own generator, so NumPy and CuPy give different weights for one seed; drawn in
    float32 and cast to dtype tensor by tensor (the values cast_params would give)."""
    def draw(rng, config, name, shape):  # float32
        if name.endswith(".bias"):
            return xp.zeros(shape, dtype=np.float32)
        if ".ln_" in name or name.startswith("ln_"):
            return xp.ones(shape, dtype=np.float32)
        std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    label, config, params = random_params(config, SIZES, expected_shapes, draw, seed=seed, xp=xp, dtype=dtype)
    label = label or f"{config.n_layer}-layer, {config.n_embd}-wide"
    return Checkpoint(name=f"random {label} (seed {seed})", config=config, params=params)


def to_json(c: GPT2Config) -> dict:
    """config.json as transformers' save_pretrained writes it for GPT2LMHeadModel."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
            "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
            "n_positions": c.n_positions, "n_ctx": c.n_positions, "n_inner": c.n_inner,
            "layer_norm_epsilon": c.layer_norm_epsilon, "bos_token_id": c.eos_token_id,
            "eos_token_id": c.eos_token_id, "tie_word_embeddings": True}


def save(checkpoint: Checkpoint, folder: str | os.PathLike, *, prefix: str = "transformer.") -> Path:
    """Write config.json and model.safetensors as transformers' save_pretrained does (prefix
    "transformer.", no lm_head), or as the hub's original file (prefix "")."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(to_json(checkpoint.config), indent=2) + "\n")
    tensors = {prefix + k: np.ascontiguousarray(v.get() if hasattr(v, "get") else v, dtype=np.float32)
               for k, v in checkpoint.params.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
