"""Llama 3's tokenizer: a tiktoken BPE read from the checkpoint's `tokenizer.model` (Meta's
`original/tokenizer.model` in the hub repos), one "base64-token rank" line per token, 128,000 ranks,
then 256 special tokens numbered from the last rank + 1 (128000): <|begin_of_text|> 128000,
<|end_of_text|> 128001, <|start_header_id|> 128006, <|end_header_id|> 128007, <|eot_id|> 128009,
the rest named as Llama 3.1/3.2's tokenizer names them, most of them reserved."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from lm.errors import CheckpointError, LabError

# the pre-tokenizer split: cl100k's, as Meta's tokenizer.py gives it
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL = 256
_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
          "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>"]
SPECIAL_TOKENS = _NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL - len(_NAMED))]
FILES = ("tokenizer.model", "original/tokenizer.model")


def find(folder: str | Path | None) -> Path | None:
    """The folder's tokenizer.model (or original/tokenizer.model), or None."""
    if folder is None:
        return None
    return next((Path(folder) / f for f in FILES if (Path(folder) / f).is_file()), None)


def load_tokenizer(folder: str | Path | None):
    """The folder's tokenizer as a tiktoken Encoding, or None if it has no tokenizer.model."""
    path = find(folder)
    return None if path is None else from_file(path)


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """tokenizer.model's "base64-token rank" lines; the ranks must be 0 .. n-1, each once."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    ranks = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}, each once (or a token repeats)")
    return ranks


def from_file(path: str | Path):
    """A tiktoken Encoding: the file's ranks, Llama 3's split pattern, its 256 special tokens after them."""
    import tiktoken

    ranks = read_ranks(path)
    special = {token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name=f"llama3 from {path}", pat_str=PATTERN, mergeable_ranks=ranks,
                             special_tokens=special)


def special(encoding, token: str) -> int:
    return encoding.encode_single_token(token)


def encode(encoding, text: str) -> list[int]:
    """<|begin_of_text|>, then the text (special tokens written in it are read as such)."""
    return [special(encoding, "<|begin_of_text|>")] + encoding.encode(text, allowed_special="all")


def chat(encoding, text: str) -> list[int]:
    """The Llama 3 instruct format: one user turn, then the assistant's header, to be continued:
    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{text}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n (the header's role and "\\n\\n" encoded apart
    from the text, as Meta's ChatFormat does)."""
    if not text.strip():
        raise LabError("--chat needs a prompt with some text in it")

    def header(role):
        return [special(encoding, "<|start_header_id|>"), *encoding.encode(role), special(encoding, "<|end_header_id|>"),
                *encoding.encode("\n\n")]

    return ([special(encoding, "<|begin_of_text|>"), *header("user"), *encoding.encode(text.strip()),
             special(encoding, "<|eot_id|>"), *header("assistant")])
