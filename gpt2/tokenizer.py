"""GPT-2's byte-level BPE through tiktoken: GPT-2's own, built from OpenAI's encoder.json and
vocab.bpe shipped in gpt2/bpe (no network), or one built from a model folder's vocab.json and
merges.txt (transformers' names for the same two files)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from lm.generate import StreamDecoder  # noqa: F401 (gpt2.tokenizer names it: every family's text out)

from .errors import CheckpointError

BPE_DIR = Path(__file__).resolve().parent / "bpe"  # OpenAI's encoder.json and vocab.bpe (MIT: LICENSE there)


def load_tokenizer(folder: str | Path | None = None):
    """The encoding for a model folder: built from its vocab.json and merges.txt when it has both,
    else GPT-2's (gpt2_encoding)."""
    if folder is not None:
        vocab, merges = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        if vocab.is_file() and merges.is_file():
            return from_files(vocab, merges)
    return gpt2_encoding()


# tiktoken's copies of the two files are named by the sha1 of the address it downloads them from
TIKTOKEN_SOURCES = tuple(f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
                         for name in ("vocab.bpe", "encoder.json"))


def gpt2_encoding():
    """GPT-2's encoding, the same ids as tiktoken's "gpt2" (tests/test_tokenizer.py checks both ways).

    Built from the files shipped in gpt2/bpe, unless TIKTOKEN_CACHE_DIR names a folder that holds
    tiktoken's own copies of them: then it is tiktoken's "gpt2" encoding, read from that cache. A cache
    without them is passed over rather than filled, so nothing here ever needs the network."""
    import tiktoken

    return tiktoken.get_encoding("gpt2") if tiktoken_cache_has_gpt2() else shipped_encoding()


def tiktoken_cache_has_gpt2() -> bool:
    folder = os.environ.get("TIKTOKEN_CACHE_DIR")
    if not folder:
        return False
    return all((Path(folder) / hashlib.sha1(url.encode()).hexdigest()).is_file() for url in TIKTOKEN_SOURCES)


@functools.cache
def shipped_encoding():
    """GPT-2's encoding from gpt2/bpe, under tiktoken's name for it, with its pre-tokenizer pattern
    and special tokens (tiktoken_ext.openai_public's)."""
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    enc = from_files(BPE_DIR / "encoder.json", BPE_DIR / "vocab.bpe", name="gpt2", pat_str=r50k_pat_str)
    if enc.special_tokens_set != {ENDOFTEXT}:
        raise CheckpointError(f"{BPE_DIR / 'encoder.json'}: special tokens {sorted(enc.special_tokens_set)}, "
                              f"expected {ENDOFTEXT} alone")
    return enc


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


def from_files(vocab_path: str | Path, merges_path: str | Path, *, name: str | None = None, pat_str: str | None = None):
    """A tiktoken Encoding from vocab.json (token -> id) and merges.txt (the merge order), or their
    original names, encoder.json and vocab.bpe. tiktoken merges by rank, so this relies on GPT-2's ids
    being the merge order: checked against merges.txt. pat_str: GPT-2's pre-tokenizer split, tiktoken's
    r50k pattern, unless given."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

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
    return tiktoken.Encoding(name=name or f"gpt2 from {Path(vocab_path).parent}", pat_str=pat_str or r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens=special)
