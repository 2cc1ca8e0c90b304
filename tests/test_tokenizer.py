"""GPT-2's tokenizer: the BPE files shipped in gpt2/bpe give tiktoken's "gpt2" ids with no network
and no cache; TIKTOKEN_CACHE_DIR, where set, means tiktoken's own encoding when that cache holds
its copies of the two files, and the shipped ones otherwise;
a model folder's vocab.json and merges.txt build the same encoding; decoding streams whole characters."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from gpt2 import CheckpointError
from gpt2.tokenizer import (
    BPE_DIR,
    TIKTOKEN_SOURCES,
    StreamDecoder,
    from_files,
    gpt2_encoding,
    load_tokenizer,
    shipped_encoding,
    tiktoken_cache_has_gpt2,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello, I'm a language model, naïve café 日本語 🤗\n\n\tit's  12345 <|endoftext|> done"
# tiktoken's "gpt2" ids for TEXT (allowed_special="all")
TEXT_IDS = [15496, 11, 314, 1101, 257, 3303, 2746, 11, 41492, 40304, 10545, 245, 98, 17312, 105, 45739, 252, 12520,
            97, 245, 628, 197, 270, 338, 220, 17031, 2231, 220, 50256, 1760]
VARIED = ("def f(x):\n    return x ** 2  # squares\n\nÀ bientôt! Привет, мир. 東京は晴れ。 \u200b\u00a0 e=mc² — "
          "\"quotes\" ‘curly’ 3.14159e-10 https://example.com/a?b=c&d=e\r\n  trailing   spaces\t\t\n"
          "I'LL they're we've you'd 1234567890 ...!!! <|endoftext|> \U0001f600\U0001f3fd")
# tiktoken_ext.openai_public.gpt2's sha256 of the two files, as downloaded from OpenAI
SHA256 = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
          "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def tiktoken_cache() -> Path | None:
    """A folder holding tiktoken's cached copies of the two files: TIKTOKEN_CACHE_DIR, or
    shared/tiktoken-cache beside the checkout, or a copy carried inside it (.cache/tiktoken)."""
    for folder in (os.environ.get("TIKTOKEN_CACHE_DIR"), ROOT.parent / "shared" / "tiktoken-cache",
                   ROOT / ".cache" / "tiktoken"):
        if folder and all((Path(folder) / hashlib.sha1((URL + n).encode()).hexdigest()).is_file() for n in SHA256):
            return Path(folder)
    return None


def test_the_shipped_files_are_openais():
    for name, digest in SHA256.items():
        assert hashlib.sha256((BPE_DIR / name).read_bytes()).hexdigest() == digest, name
    assert "MIT" in (BPE_DIR / "LICENSE").read_text(encoding="utf-8")


def test_the_shipped_encoding_needs_no_cache(monkeypatch):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    enc = load_tokenizer()
    assert enc is shipped_encoding() and enc.name == "gpt2" and enc.n_vocab == 50257
    assert enc.encode(TEXT, allowed_special="all") == TEXT_IDS
    assert enc.decode(TEXT_IDS) == TEXT


def test_the_shipped_ranks_are_tiktokens(monkeypatch):
    """tiktoken's own reading of OpenAI's two files (data_gym_to_mergeable_bpe_ranks, the cache turned
    off so that it reads the shipped files) gives the ranks that from_files builds."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken: no cache, read the paths as they are
    ranks = data_gym_to_mergeable_bpe_ranks(str(BPE_DIR / "vocab.bpe"), str(BPE_DIR / "encoder.json"),
                                            vocab_bpe_hash=SHA256["vocab.bpe"], encoder_json_hash=SHA256["encoder.json"])
    assert ranks == shipped_encoding()._mergeable_ranks


def test_the_shipped_encoding_is_tiktokens_gpt2(monkeypatch):
    """The same name, pattern, special tokens and ids as tiktoken's "gpt2", read through its cache."""
    cache = tiktoken_cache()
    if cache is None:
        pytest.skip("no tiktoken cache of the gpt2 files here (TIKTOKEN_CACHE_DIR or shared/tiktoken-cache)")
    import tiktoken

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    reference, shipped = tiktoken.get_encoding("gpt2"), shipped_encoding()
    assert gpt2_encoding() is reference  # TIKTOKEN_CACHE_DIR set: tiktoken's own
    assert (shipped.name, shipped._pat_str, shipped._special_tokens, shipped.n_vocab) == (
        reference.name, reference._pat_str, reference._special_tokens, reference.n_vocab)
    for text in (TEXT, VARIED, VARIED * 3):
        assert shipped.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all")
    assert shipped.encode_ordinary(VARIED) == reference.encode_ordinary(VARIED)


def test_a_cache_without_the_files_is_passed_over(monkeypatch, tmp_path):
    """TIKTOKEN_CACHE_DIR naming a folder without tiktoken's copies (a fresh machine, a device with no
    network) gives the shipped encoding, and tiktoken is never asked, so nothing waits on the network."""
    import tiktoken

    def offline(name):
        raise AssertionError("tiktoken.get_encoding was called: it would try to download")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    for folder in ("", str(tmp_path), "/nowhere"):
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", folder)
        assert gpt2_encoding() is shipped_encoding()
    (tmp_path / hashlib.sha1(TIKTOKEN_SOURCES[0].encode()).hexdigest()).write_text("")  # one of two files
    assert not tiktoken_cache_has_gpt2()


def test_tokenizer_round_trip():
    enc = load_tokenizer()
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    ids = enc.encode(TEXT, allowed_special="all")
    assert enc.decode(ids) == TEXT and 50256 in ids


def test_tokenizer_from_vocab_json_and_merges_txt(tmp_path):
    shutil.copy(BPE_DIR / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(BPE_DIR / "vocab.bpe", tmp_path / "merges.txt")
    built, reference = load_tokenizer(tmp_path), load_tokenizer()
    assert built.name.startswith("gpt2 from")
    assert built.encode(TEXT, allowed_special="all") == reference.encode(TEXT, allowed_special="all")
    assert built.n_vocab == 50257
    lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    lines[1], lines[2] = lines[2], lines[1]  # two merges swapped: ranks no longer match the ids
    (tmp_path / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(CheckpointError, match="merge 0 .* does not match vocab.json"):
        from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_stream_decoder_holds_split_characters_back():
    enc = load_tokenizer()
    ids = enc.encode("日本語🤗 ok")
    stream = StreamDecoder(enc)
    pieces = [stream(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == "日本語🤗 ok" and "\ufffd" not in "".join(pieces)
    assert any(p == "" for p in pieces)  # at least one token ended mid-character
