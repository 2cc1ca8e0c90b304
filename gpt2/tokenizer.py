"""GPT-2's byte-level BPE through tiktoken: its "gpt2" encoding, or one built from a model folder's
vocab.json and merges.txt (transformers' names for OpenAI's encoder.json and vocab.bpe)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from .errors import CheckpointError, LabError

ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer split (tiktoken's r50k pattern)
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def load_tokenizer(folder: str | Path | None = None):
    """The encoding for a model folder: built from its vocab.json and merges.txt when it has both,
    else tiktoken's "gpt2" (downloaded once, or read from TIKTOKEN_CACHE_DIR)."""
    if folder is not None:
        vocab, merges = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        if vocab.is_file() and merges.is_file():
            return from_files(vocab, merges)
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as exc:  # tiktoken downloads its files on first use: offline that raises
        raise LabError(
            f"cannot load tiktoken's gpt2 encoding ({type(exc).__name__}); set TIKTOKEN_CACHE_DIR to a folder "
            "holding its files (e.g. .cache/tiktoken), or give --model a folder with vocab.json and merges.txt"
        ) from None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, as vocab.json spells tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def from_files(vocab_path: str | Path, merges_path: str | Path):
    """A tiktoken Encoding from vocab.json (token -> id) and merges.txt (the merge order). tiktoken
    merges by rank, so this relies on GPT-2's ids being the merge order: checked against merges.txt."""
    import tiktoken

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    try:
        vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"tokenizer files {vocab_path}, {merges_path}: unreadable ({exc})") from None

    def decode(token: str) -> bytes:
        try:
            return bytes(to_byte[c] for c in token)
        except KeyError:
            raise CheckpointError(f"{vocab_path}: token {token!r} is not in GPT-2's byte alphabet") from None

    special = {t: i for t, i in vocab.items() if t.startswith("<|") and t.endswith("|>")}
    ranks = {decode(t): i for t, i in vocab.items() if t not in special}
    merges = [line.split() for line in lines if line and not line.startswith("#version")]
    n_single = sum(1 for t in ranks if len(t) == 1)
    for i, pair in enumerate(merges):
        if len(pair) != 2 or ranks.get(decode(pair[0]) + decode(pair[1])) != n_single + i:
            raise CheckpointError(f"{merges_path}: merge {i} ({' '.join(pair)}) does not match vocab.json's ids")
    return tiktoken.Encoding(name=f"gpt2 from {Path(vocab_path).parent}", pat_str=PATTERN,
                             mergeable_ranks=ranks, special_tokens=special)


class StreamDecoder:
    """Token ids in, text out as soon as it is whole: a character split across two tokens is held
    back until its last byte arrives."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> str:
        try:
            data = self.encoding.decode_single_token_bytes(token)
        except KeyError:  # an id past the tokenizer's vocabulary (a padded embedding row)
            data = "\ufffd".encode()
        return self.utf8.decode(data)

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
