"""Token files for training, and the batches llm.c draws from them.

    tokens = read_tokens("train.bin", vocab_size=50257)   a .bin, .npy or .txt: a 1-D array of ids
    batches = Batches(tokens, B=4, T=64)
    x, y = batches[i]                                      (B, T) inputs and next-token targets
    write_bin("out.bin", ids)                              llm.c's format, for tests and users

Formats:
- `.bin`, llm.c's: a 1,024-byte header of 256 little-endian int32 (magic 20240520, version 1, the
  token count, the rest 0), then the ids as uint16; memory-mapped, never read whole.
- `.npy`: a 1-D array of integer ids, memory-mapped.
- `.txt`: UTF-8 text, tokenized with GPT-2's BPE (gpt2.tokenizer; <|endoftext|> is the special token).

Order (llm.c's DataLoader): batch i starts at token (i mod n) * B * T, n = (len - 1) // (B * T) the
batches that fit; it takes B * T + 1 tokens, row b's inputs are tokens [b T, (b + 1) T) of them and
its targets the same shifted by one. Past the last batch that fits it starts over at token 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import LabError

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256  # 1,024 bytes
SUFFIXES = (".bin", ".npy", ".txt")


def write_bin(path: str | Path, ids) -> Path:
    """Token ids (each below 2^16) as an llm.c .bin file."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= 2**16)):
        raise ValueError("a .bin holds a 1-D sequence of ids in [0, 65536)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, ids.size
    path = Path(path)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.astype("<u2").tobytes())
    return path


def read_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size < 4 * HEADER_INTS:
        raise LabError(f"{path}: {size} bytes, shorter than a .bin token file's 1,024-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise LabError(f"{path}: not a .bin token file (magic {header[0]}, expected {MAGIC})")
    if header[1] != VERSION:
        raise LabError(f"{path}: .bin version {header[1]}; GPT-2's token files are version {VERSION} (uint16 ids)")
    count = int(header[2])
    if size != 4 * HEADER_INTS + 2 * count:
        raise LabError(f"{path}: the header says {count} tokens ({4 * HEADER_INTS + 2 * count} bytes), "
                       f"the file has {size} bytes")
    return np.memmap(path, dtype="<u2", mode="r", offset=4 * HEADER_INTS, shape=(count,))


def read_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise LabError(f"{path}: not a readable .npy ({exc})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise LabError(f"{path}: a .npy of tokens is a 1-D array of integer ids; this one is {tokens.dtype} "
                       f"of shape {tokens.shape}")
    return tokens


def read_txt(path: Path) -> np.ndarray:
    from gpt2.tokenizer import gpt2_encoding

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LabError(f"{path}: not readable UTF-8 text ({exc})") from None
    return np.array(gpt2_encoding().encode(text, allowed_special="all"), dtype=np.int32)


def read_tokens(path: str | Path, *, vocab_size: int) -> np.ndarray:
    """A file's token ids, checked to lie in [0, vocab_size)."""
    path = Path(path)
    if not path.is_file():
        raise LabError(f"{path}: no such file")
    readers = {".bin": read_bin, ".npy": read_npy, ".txt": read_txt}
    if path.suffix not in readers:
        raise LabError(f"{path}: token files are {', '.join(SUFFIXES)}")
    tokens = readers[path.suffix](path)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise LabError(f"{path}: token ids from {int(tokens.min())} to {int(tokens.max())}, "
                       f"but the model's vocabulary is [0, {vocab_size})")
    return tokens


class Batches:
    """llm.c's batches over a token array: batches[i] for any step i >= 0, starting over when past the end."""

    def __init__(self, tokens: np.ndarray, B: int, T: int, *, name: str = "the data"):
        if len(tokens) < B * T + 1:
            raise LabError(f"{name}: {len(tokens)} tokens, fewer than one batch of B x T + 1 = {B * T + 1}")
        self.tokens, self.B, self.T = tokens, B, T
        self.per_pass = (len(tokens) - 1) // (B * T)  # batches before it starts over

    def __len__(self) -> int:
        return self.per_pass

    def start(self, i: int) -> int:
        return (i % self.per_pass) * self.B * self.T

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        B, T = self.B, self.T
        s = self.start(i)
        chunk = np.asarray(self.tokens[s:s + B * T + 1], dtype=np.int32)  # B * T + 1 ids, off the memory map
        return chunk[:-1].reshape(B, T), chunk[1:].reshape(B, T)  # inputs, next-token targets, each (B, T)
