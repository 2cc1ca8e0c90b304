"""Checkpoint files, whatever the model: where they are (a folder, a file, or the Hugging Face hub)
and their tensors (safetensors, one file or sharded with model.safetensors.index.json).

The safetensors format is read here rather than through the safetensors package's NumPy loader,
which does not know bfloat16 (Llama's checkpoints are stored in it): an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arrays import run_dtype
from .errors import CheckpointError, ModelSourceError

# what a download fetches, for either model: weights, config, GPT-2's and Llama's tokenizer files
HUB_FILES = ["config.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
             "vocab.json", "merges.txt", "tokenizer.model", "original/tokenizer.model"]
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2**20  # bytes; a larger header length means the file is not safetensors


@dataclass
class Checkpoint:
    """A model's weights as a run holds them, whatever the family."""

    name: str  # what to call it in a summary: the hub id, the folder, or "random gpt2 (seed 0)"
    config: object  # the family's config dataclass
    params: dict  # checkpoint-native name -> array in the run's dtype (NumPy or CuPy)
    folder: Path | None = None  # where config.json and the tokenizer's files would be

    @property
    def n_params(self) -> int:
        return sum(int(p.size) for p in self.params.values())


def locate(source: str, hub_files: list[str] = HUB_FILES) -> tuple[Path, Path | None]:
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
    return Path(download(source, hub_files)), None


def download(repo_id: str, hub_files: list[str] = HUB_FILES) -> str:
    """Fetch (or find in the cache) a hub model's safetensors, config and tokenizer files.
    huggingface_hub honours HF_HUB_OFFLINE, HF_HOME and HF_HUB_CACHE itself."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ModelSourceError(f"cannot fetch {repo_id}: huggingface_hub is not installed; "
                               "use --model PATH for a local folder, or --random-weights") from None
    try:
        return snapshot_download(repo_id, allow_patterns=hub_files)
    except Exception as exc:  # the hub raises many types (offline, DNS, HTTP, bad id): all mean the same here
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else f"{type(exc).__name__}: {first_line(exc)}"
        raise ModelSourceError(
            f"cannot load {repo_id}: not in the Hugging Face cache and not downloadable ({why}); "
            "use --model PATH for a local folder with model.safetensors, or --random-weights"
        ) from None


def first_line(exc: BaseException) -> str:
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    return lines[0] if lines else "no details"


def listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def model_type(folder: Path) -> str | None:
    """config.json's model_type ("gpt2", "llama"), or None for a folder without config.json."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    raw = read_json(path, "a readable JSON config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw.get("model_type")


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not {what} ({exc})") from None


def safetensors_files(folder: Path, file: Path | None = None) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read, and for a sharded checkpoint the index's weight map (tensor -> file name)."""
    if file is not None:
        return [file], None
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None
    index = folder / INDEX
    if index.is_file():
        raw = read_json(index, "a safetensors index")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map of tensor -> file)")
        return [folder / f for f in sorted(set(weight_map.values()))], weight_map
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".h5", ".msgpack"))
    hint = f" (it has {', '.join(others)}: re-save it with safetensors)" if others else ""
    raise CheckpointError(f"{folder}: no model.safetensors{hint}")


def read_checkpoint(folder: Path, file: Path | None = None, *, skip=None, dtype=np.float32) -> dict[str, np.ndarray]:
    """Every tensor of a folder's checkpoint (or of one named file) as NumPy arrays in dtype (float32,
    float16 or bfloat16); a sharded one is checked against its index: every file it names present,
    every tensor where it says."""
    files, weight_map = safetensors_files(folder, file)
    tensors = read_safetensors(files, skip=skip, index=folder / INDEX if weight_map else None, dtype=dtype)
    if weight_map is not None:
        placed = {}
        for path in files:
            placed |= {k: path.name for k in read_header(path)[0] if k != "__metadata__"}
        for name, shard in weight_map.items():
            if placed.get(name) != shard:
                where = f"it is in {placed[name]}" if name in placed else "no shard holds it"
                raise CheckpointError(f"{folder / INDEX}: names {name} in {shard}, but {where}")
    return tensors


def read_safetensors(files: list[Path], *, skip=None, index: Path | None = None,
                     dtype=np.float32) -> dict[str, np.ndarray]:
    """Every tensor into NumPy arrays in dtype (float32 unless asked; stored in it, none is converted);
    skip(name) -> True leaves a tensor unread."""
    dtype = run_dtype(dtype)
    tensors = {}
    for path in files:
        if not path.is_file():
            named = f"named by {index}" if index else "named by the checkpoint's index"
            raise CheckpointError(f"{path}: missing ({named})")
        tensors |= read_file(path, skip)
    for key, t in tensors.items():
        if t.dtype != dtype:
            if not np.issubdtype(t.dtype, np.floating) and t.dtype.name != "bfloat16":
                raise CheckpointError(f"{key}: dtype {t.dtype}, expected floating point")
            tensors[key] = t.astype(dtype)
    return tensors


def _dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
            "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header and the offset where the tensors' bytes begin."""
    bad = f"{path}: not a readable safetensors file"
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= MAX_HEADER:
                raise CheckpointError(f"{bad} (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{bad} ({first_line(exc)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad} (the header is not a JSON object)")
    return header, 8 + n


def read_file(path: Path, skip=None) -> dict[str, np.ndarray]:
    header, start = read_header(path)
    bad = f"{path}: not a readable safetensors file"
    size = path.stat().st_size - start
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(size,)) if size > 0 else np.empty(0, np.uint8)
    dtypes = _dtypes()
    out = {}
    for key, info in header.items():
        if key == "__metadata__" or (skip is not None and skip(key)):
            continue
        try:
            dtype = dtypes[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{bad} (tensor {key}: dtype {info.get('dtype')!r} or its shape or offsets "
                                  "not understood)") from None
        if not 0 <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{bad} (tensor {key}: bytes {begin}..{end} of {size}, for shape {shape} "
                                  f"of {dtype.name}: truncated or inconsistent)")
        out[key] = np.array(data[begin:end].view(dtype).reshape(shape))  # a copy: the file may go away
    return out


def random_params(config, sizes: dict, shapes, draw, *, seed: int, xp, dtype) -> tuple[str, object, dict]:
    """Weights from a seed for a config or a size's name: (the size's name, or None for a config given
    whole; the config; the params, each tensor drawn in float32 by draw(rng, config, name, shape) and cast
    to dtype before the next: one float32 tensor at a time). Drawn with the array module's own
    generator, so NumPy and CuPy give different weights for one seed.

    Every tensor's memory is allocated before the first draw. CuPy's pool cuts a request from a larger
    free block, and a chunk that holds one live array cannot go back to the device: a tensor cast into
    the freed block of the draw before it would pin the rest of that block for the model's life
    (Llama 3.2 3B's random weights in bfloat16: the pool held close to 2 GB beside the live arrays).
    Allocated first, the tensors never sit in a draw's block, and the draws' blocks go back whole."""
    dtype = run_dtype(dtype)
    label = None
    if isinstance(config, str):
        if config not in sizes:
            raise CheckpointError(f"unknown size {config!r}: choose from {', '.join(sizes)}")
        label, config = config, sizes[config]
    rng = xp.random.default_rng(seed)
    shapes = shapes(config)
    params = {name: xp.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    for name, shape in shapes.items():
        params[name][...] = draw(rng, config, name, shape)  # cast to dtype as astype rounds
    return label, config, params


def check_tensors(params: dict, expected: dict, *, missing_for: str, unexpected_for: str) -> None:
    """Every expected tensor present with its shape, and no other; a CheckpointError naming the first
    problem (`missing_for`, `unexpected_for`: what the model is, in words, for its messages)."""
    missing = [k for k in expected if k not in params]
    unexpected = [k for k in params if k not in expected]
    if missing:
        raise CheckpointError(f"{listed(missing)} missing for {missing_for}")
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) {listed(unexpected)} for {unexpected_for}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise CheckpointError(f"{name}: shape {tuple(params[name].shape)} but the config says {shape}")

