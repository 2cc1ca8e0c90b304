"""GPT-2 weights: from the Hugging Face hub, a local folder, or a seed.

Every checkpoint quirk lives here, so model.py sees one flat dict of checkpoint-native names
(`wte.weight`, `h.0.attn.c_attn.weight`, `ln_f.bias`, ...) holding float32 arrays:

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import config as config_mod
from .config import SIZES, GPT2Config
from .errors import CheckpointError, ModelSourceError

DEFAULT_MODEL = "openai-community/gpt2"
HUB_FILES = ["config.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
             "vocab.json", "merges.txt"]
_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


@dataclass
class Checkpoint:
    name: str  # what to call it in a summary: the hub id, the folder, or "random gpt2 (seed 0)"
    config: GPT2Config
    params: dict  # checkpoint-native name -> float32 array (NumPy or CuPy)
    folder: Path | None = None  # where config.json, vocab.json and merges.txt would be

    @property
    def n_params(self) -> int:
        return sum(int(p.size) for p in self.params.values())


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


def load(source: str | os.PathLike | None = None, *, xp=np) -> Checkpoint:
    """A hub id (default openai-community/gpt2) or a local folder (or .safetensors file)."""
    source = str(source or DEFAULT_MODEL)
    folder, file = locate(source)
    return load_folder(folder, xp=xp, name=source, file=file)


def locate(source: str) -> tuple[Path, Path | None]:
    """The local folder holding the checkpoint (downloading a hub model into the cache if need be),
    and the .safetensors file if one was named directly."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{source}: expected a folder or a .safetensors file")
        return path.parent, path
    if source.startswith((".", "/", "~")) or source.count("/") != 1 or path.suffix == ".safetensors":
        raise CheckpointError(f"{source}: no such folder or file (a hub id looks like owner/name)")
    return Path(download(source)), None


def download(repo_id: str) -> str:
    """Fetch (or find in the cache) a hub model's safetensors, config and tokenizer files.
    huggingface_hub honours HF_HUB_OFFLINE, HF_HOME and HF_HUB_CACHE itself."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelSourceError(f"cannot fetch {repo_id}: huggingface_hub is not installed; "
                               "use --model PATH for a local folder, or --random-weights") from None
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as exc:  # the hub raises many types (offline, DNS, HTTP, bad id): all mean the same here
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else f"{type(exc).__name__}: {_first_line(exc)}"
        raise ModelSourceError(
            f"cannot load {repo_id}: not in the Hugging Face cache and not downloadable ({why}); "
            "use --model PATH for a local folder with model.safetensors, or --random-weights"
        ) from None


def _first_line(exc: BaseException) -> str:
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    return lines[0] if lines else "no details"


def load_folder(folder: str | os.PathLike, *, xp=np, name: str | None = None, file: Path | None = None) -> Checkpoint:
    """config.json (if present) and model.safetensors (or its shards) from one folder."""
    folder = Path(folder)
    tensors = read_safetensors(safetensors_files(folder, file))
    params = normalize(tensors)
    config_path = folder / "config.json"
    config = config_mod.from_json(config_path) if config_path.is_file() else config_mod.from_shapes(
        {k: v.shape for k, v in params.items()})
    check_shapes(params, config)
    params = {k: xp.asarray(v) for k, v in params.items()}
    return Checkpoint(name=name or str(folder), config=config, params=params, folder=folder)


def safetensors_files(folder: Path, file: Path | None = None) -> list[Path]:
    if file is not None:
        return [file]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        return [folder / f for f in sorted(set(weight_map.values()))]
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".h5", ".msgpack"))
    hint = f" (it has {', '.join(others)}: re-save it with safetensors)" if others else ""
    raise CheckpointError(f"{folder}: no model.safetensors{hint}")


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor, as stored, into NumPy arrays (float32)."""
    from safetensors import SafetensorError, safe_open

    tensors = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (named by the checkpoint's index)")
        try:
            with safe_open(str(path), framework="numpy") as f:
                for key in f.keys():
                    if not _BUFFER.match(key.removeprefix("transformer.")):  # never read the mask buffers
                        tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
    for key, t in tensors.items():
        if t.dtype != np.float32:
            if not np.issubdtype(t.dtype, np.floating):
                raise CheckpointError(f"{key}: dtype {t.dtype}, expected floating point")
            tensors[key] = t.astype(np.float32)
    return tensors


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
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in params]
    unexpected = [k for k in params if k not in expected]
    if missing:
        raise CheckpointError(f"{_listed(missing)} missing for {config.n_layer} layers of width {config.n_embd}")
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) {_listed(unexpected)} for a {config.n_layer}-layer GPT-2")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise CheckpointError(f"{name}: shape {tuple(params[name].shape)} but the config says {shape}")


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def random_weights(config: GPT2Config | str = "gpt2", *, seed: int = 0, xp=np) -> Checkpoint:
    """GPT-2-shaped weights from a seed, initialised as GPT-2 was: normal with std 0.02 (the residual
    projections c_proj scaled by 1/sqrt(2 n_layer)), biases 0, LayerNorm weights 1. Drawn with the
    array module's own generator, so NumPy and CuPy give different weights for one seed."""
    if isinstance(config, str):
        if config not in SIZES:
            raise CheckpointError(f"unknown size {config!r}: choose from {', '.join(SIZES)}")
        label, config = config, SIZES[config]
    else:
        label = f"{config.n_layer}-layer, {config.n_embd}-wide"
    rng = xp.random.default_rng(seed)
    params = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            params[name] = xp.zeros(shape, dtype=np.float32)
        elif ".ln_" in name or name.startswith("ln_"):
            params[name] = xp.ones(shape, dtype=np.float32)
        else:
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            params[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return Checkpoint(name=f"random {label} (seed {seed})", config=config, params=params)


def save(checkpoint: Checkpoint, folder: str | os.PathLike, *, prefix: str = "transformer.") -> Path:
    """Write config.json and model.safetensors as transformers' save_pretrained does (prefix
    "transformer.", no lm_head), or as the hub's original file (prefix "")."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = checkpoint.config
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
              "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "vocab_size": c.vocab_size,
              "n_positions": c.n_positions, "n_ctx": c.n_positions, "n_inner": c.n_inner,
              "layer_norm_epsilon": c.layer_norm_epsilon, "bos_token_id": c.eos_token_id,
              "eos_token_id": c.eos_token_id, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {prefix + k: (v.get() if hasattr(v, "get") else np.ascontiguousarray(v))
               for k, v in checkpoint.params.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
