"""Llama 3 on the CPU (NumPy): config and sizes, RoPE scaling against its formula, the loader (one
file, sharded, and every bad checkpoint), the forward pass and greedy generation against
transformers' golden fixtures, and the tokenizer on a synthetic tiktoken file. The same model code
runs on CuPy in test_llama_gpu.py."""

import base64
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

import llama
from llama import tokenizer
from llama.config import SIZES, LlamaConfig, RopeScaling, from_json, rope_inv_freq, to_json
from llama.load import expected_shapes
from lm.arrays import cast_params
from lm.checkpoint import read_file
from lm.errors import CheckpointError, LabError
from lm.generate import reference_attend
from lm.kv_cache import KVCache

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EPS32 = float(np.finfo(np.float32).eps)
TOLERANCE_FACTOR = 8.0  # our error against the peer's float64 run, in multiples of its own float32 error
NAMES = ["llama-gqa", "llama-untied"]


def max_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    name = request.param
    return llama.load(FIXTURES / name), dict(np.load(FIXTURES / f"{name}-golden.npz"))


@pytest.fixture(scope="module")
def gqa():
    return llama.load(FIXTURES / "llama-gqa")


# --- config -----------------------------------------------------------------------------------


def test_sizes_are_the_released_family():
    got = {k: (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
               c.vocab_size, c.rope_scaling.factor, c.tie_word_embeddings, c.head_size) for k, c in SIZES.items()}
    assert got == {"llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, 32.0, True, 64),
                   "llama-3.2-3b": (3072, 8192, 28, 24, 8, 128256, 32.0, True, 128),
                   "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, 8.0, False, 128)}
    n_params = {k: sum(math.prod(s) for s in expected_shapes(c).values()) for k, c in SIZES.items()}
    assert [round(n / 1e9, 2) for n in n_params.values()] == [1.24, 3.21, 8.03]  # as Meta gives them


def test_config_from_transformers_5_and_from_the_hub_layout(tmp_path):
    config = from_json(FIXTURES / "llama-gqa" / "config.json")  # rope_parameters, as transformers 5 writes it
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_size, config.tie_word_embeddings) == (
        8, 2, 64, True)
    assert config.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=64)
    assert config.rope_theta == 500000.0 and config.eos_token_id == (1,)
    (tmp_path / "config.json").write_text(json.dumps(to_json(config)))  # rope_theta and rope_scaling, as the hub's
    assert "rope_parameters" not in to_json(config) and from_json(tmp_path / "config.json") == config
    untied = from_json(FIXTURES / "llama-untied" / "config.json")
    assert untied.rope_scaling is None and not untied.tie_word_embeddings and untied.head_size == 128


def write_config(tmp_path, **changes):
    raw = json.loads((FIXTURES / "llama-gqa" / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path / "config.json"


@pytest.mark.parametrize("changes,message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn' is not supported"),
    ({"num_attention_heads": 7}, "hidden_size=32 is not a multiple of num_attention_heads=7"),
    ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"model_type": "mistral"}, "model_type is 'mistral'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
])
def test_config_json_with_unsupported_settings_is_refused(tmp_path, changes, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_json(write_config(tmp_path, **changes))


# --- RoPE -------------------------------------------------------------------------------------


def llama3_formula(theta, dim, factor, low, high, orig):
    """Llama 3's frequency scaling, one frequency at a time in float64, as the issue states it."""
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


@pytest.mark.parametrize("size", list(SIZES))
def test_rope_scaling_matches_the_formula(size):
    c = SIZES[size]
    s = c.rope_scaling
    expected = llama3_formula(c.rope_theta, c.head_size, s.factor, s.low_freq_factor, s.high_freq_factor,
                              s.original_max_position_embeddings)
    got = rope_inv_freq(c)
    assert got.dtype == np.float32 and got.shape == (c.head_size // 2,)
    assert max_err(got / expected, 1) <= EPS32  # each frequency rounded once to float32
    plain = 1.0 / c.rope_theta ** (np.arange(0, c.head_size, 2) / c.head_size)
    kept, divided = got == plain.astype(np.float32), np.isclose(got, plain / s.factor, rtol=2 * EPS32)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three branches taken


def test_rope_without_scaling_is_plain_and_the_rotation_pairs_halves():
    c = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, rope_scaling=None, rope_theta=1e4)
    assert max_err(rope_inv_freq(c), 1e4 ** -(np.arange(0, 16, 2) / 16)) <= 1e-7
    cos, sin = llama.model.rope_tables(c, 5, 3, np)  # positions 5, 6, 7
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 16)).astype(np.float32)
    y = llama.model.rope(x, cos, sin)
    angle = 6 * rope_inv_freq(c)[2].astype(np.float64)  # position 6: element 2 turns with element 2 + 8
    a, b = x[0, 0, 1, 2], x[0, 0, 1, 10]
    assert max_err([y[0, 0, 1, 2], y[0, 0, 1, 10]],
                   [a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle)]) <= 1e-6


# --- loader -----------------------------------------------------------------------------------


def test_sharded_bfloat16_checkpoint_loads_with_checkpoint_native_names(gqa):
    folder = FIXTURES / "llama-gqa"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # the index is exercised
    assert set(gqa.params) == set(expected_shapes(gqa.config)) and "lm_head.weight" not in gqa.params
    stored = read_file(folder / index["weight_map"]["model.norm.weight"])["model.norm.weight"]
    assert stored.dtype.name == "bfloat16"
    assert gqa.params["model.norm.weight"].dtype == np.float32
    assert np.array_equal(gqa.params["model.norm.weight"], stored.astype(np.float32))
    q = gqa.params["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (8 * 64, 32)  # (out, in), as nn.Linear stores it


def copy_fixture(tmp_path, name="llama-gqa"):
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def test_a_single_file_checkpoint_and_a_tied_lm_head_stored_anyway(tmp_path, gqa):
    folder = llama.save(gqa, tmp_path / "one")
    assert (folder / "model.safetensors").is_file()
    assert all(np.array_equal(llama.load(folder).params[k], v) for k, v in gqa.params.items())
    tied = dict(gqa.params, **{"lm_head.weight": gqa.params["model.embed_tokens.weight"]})
    again = llama.load(llama.save(llama.Checkpoint("x", gqa.config, tied), tmp_path / "tied", shards=3))
    assert "lm_head.weight" not in again.params
    tied["lm_head.weight"] = tied["lm_head.weight"] + 1
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        llama.load(llama.save(llama.Checkpoint("x", gqa.config, tied), tmp_path / "differs"))


def bad_checkpoint(tmp_path, case: str) -> tuple[Path, str]:
    """A broken copy of the GQA fixture, and the message it must give."""
    folder = copy_fixture(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    if case == "missing shard":
        (folder / "model-00003-of-00005.safetensors").unlink()
        return folder, "model-00003-of-00005.safetensors: missing (named by"
    if case == "index naming an absent file":
        index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder, "model-00009-of-00009.safetensors: missing (named by"
    if case == "index misplacing a tensor":
        first, second = sorted(set(index["weight_map"].values()))[:2]
        name = next(k for k, f in index["weight_map"].items() if f == first)
        index["weight_map"][name] = second
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder, f"names {name} in {second}, but it is in {first}"
    if case == "shards without an index":
        (folder / "model.safetensors.index.json").unlink()
        return folder, "but no model.safetensors.index.json"
    if case == "unknown rope_type":
        write_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
        return folder, "rope_type 'dynamic' is not supported"
    if case == "heads not dividing hidden":
        write_config(folder, num_attention_heads=6)
        return folder, "hidden_size=32 is not a multiple of num_attention_heads=6"
    if case == "unknown model_type":
        write_config(folder, model_type="mistral")
        return folder, "model_type 'mistral' is not a model the lab runs (gpt2, llama)"
    if case == "shape disagrees with the config":
        write_config(folder, intermediate_size=48)
        return folder, "model.layers.0.mlp.gate_proj.weight: shape (64, 32) but the config says (48, 32)"
    if case == "untied without lm_head":
        write_config(folder, tie_word_embeddings=False)
        return folder, "lm_head.weight missing for 4 layers of width 32, lm_head untied"
    raise AssertionError(case)


BAD = ["missing shard", "index naming an absent file", "index misplacing a tensor", "shards without an index",
       "unknown rope_type", "heads not dividing hidden", "shape disagrees with the config", "untied without lm_head"]


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_give_one_clear_error(tmp_path, case):
    folder, message = bad_checkpoint(tmp_path, case)
    with pytest.raises(CheckpointError) as info:
        llama.load(folder)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_corrupt_and_truncated_files_give_clear_errors(tmp_path, gqa):
    folder = llama.save(gqa, tmp_path / "cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file .*truncated"):
        llama.load(folder)
    (folder / "model.safetensors").write_bytes(b"\x07not a safetensors file at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        llama.load(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        llama.load(folder)


def test_random_weights_are_llama_shaped_and_seeded():
    c = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    a, b, d = (llama.random_weights(c, seed=s) for s in (3, 3, 4))
    assert {k: v.shape for k, v in a.params.items()} == expected_shapes(c) and "lm_head.weight" in a.params
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not np.array_equal(a.params["lm_head.weight"], d.params["lm_head.weight"])
    assert np.all(a.params["model.layers.1.input_layernorm.weight"] == 1)
    assert abs(float(a.params["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 1e-3
    with pytest.raises(CheckpointError, match="unknown size"):
        llama.random_weights("llama-4")


# --- forward pass and generation ------------------------------------------------------------


def test_logits_match_transformers_golden(fixture):
    ckpt, golden = fixture
    logits = llama.forward(ckpt.params, ckpt.config, golden["ids"], reference_attend)
    assert logits.shape == golden["logits64"].shape and logits.dtype == np.float32
    bound = TOLERANCE_FACTOR * max(float(golden["peer_error"]), EPS32 * float(np.abs(golden["logits64"]).max()))
    err = max_err(logits, golden["logits64"])
    assert err <= bound, f"max |ours - transformers float64| = {err:.3g} > {bound:.3g} ({golden['made_with']})"


@pytest.mark.parametrize("kv_cache", [False, True])
def test_greedy_generation_matches_transformers(fixture, kv_cache):
    ckpt, golden = fixture
    out = llama.generate(ckpt.params, ckpt.config, golden["prompt"].tolist(), len(golden["greedy"]),
                         attend=reference_attend, kv_cache=kv_cache)
    assert out.tokens == golden["greedy"].tolist()


def test_kv_cache_keeps_only_the_key_value_heads(gqa):
    ids = np.load(FIXTURES / "llama-gqa-golden.npz")["ids"]
    seen = []

    def spy(q, k, v):
        seen.append((q.shape, k.shape, v.shape))
        return reference_attend(q, k, v)

    full = llama.forward(gqa.params, gqa.config, ids, reference_attend)
    cache = KVCache(gqa.config, batch=1, max_len=ids.shape[1])
    assert cache.k.shape == (4, 1, 2, ids.shape[1], 64)  # (layers, B, NH_kv, T, hs)
    pieces = [llama.forward(gqa.params, gqa.config, ids[:, :9], spy, cache=cache)]
    for t in range(9, ids.shape[1]):
        pieces.append(llama.forward(gqa.params, gqa.config, ids[:, t:t + 1], spy, cache=cache))
    assert seen[0] == ((1, 8, 9, 64), (1, 2, 9, 64), (1, 2, 9, 64))  # q over 8 heads, k and v over 2
    assert seen[-1] == ((1, 8, 1, 64), (1, 2, ids.shape[1], 64), (1, 2, ids.shape[1], 64))
    assert max_err(np.concatenate(pieces, axis=1), full) <= 32 * EPS32 * float(np.abs(full).max())


def test_bfloat16_weights_stay_near_float32(gqa):
    ids = np.load(FIXTURES / "llama-gqa-golden.npz")["ids"]
    full = llama.forward(gqa.params, gqa.config, ids, reference_attend)
    params16 = cast_params(gqa.params, "bfloat16")
    assert llama.compute_dtype(params16).name == "bfloat16"
    low = llama.forward(params16, gqa.config, ids, reference_attend)
    assert low.dtype == np.float32  # logits in float32 whatever the weights
    # the weights are bfloat16 values already: only q, k, v, the products' inputs and P are rounded
    assert 0 < max_err(low, full) <= 0.1 * float(np.abs(full).max())


def test_generation_stops_at_any_eos_id():
    ckpt, golden = llama.load(FIXTURES / "llama-untied"), np.load(FIXTURES / "llama-untied-golden.npz")
    greedy = golden["greedy"].tolist()  # its 23rd token is 1, the config's eos_token_id
    out = llama.generate(ckpt.params, ckpt.config, golden["prompt"].tolist(), 24, attend=reference_attend,
                         eos_ids=ckpt.config.eos_token_id)
    assert out.stopped_at_eos and out.tokens == greedy[:greedy.index(1) + 1]
    with pytest.raises(LabError, match="token id 999 is outside the model's vocabulary of 256"):
        llama.generate(ckpt.params, ckpt.config, [999], 2, attend=reference_attend)


# --- tokenizer --------------------------------------------------------------------------------

MERGES = [b"34", b"345", b"12", b"123", b"45", b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world",
          b"'M", b"I'"]


def write_tokenizer(path: Path, merges=MERGES, extra: int = 0) -> Path:
    """A tiktoken file: the 256 bytes at ranks 0-255, then the merges, then `extra` filler tokens."""
    tokens = [bytes([b]) for b in range(256)] + merges
    tokens += [b"\xff\xfe" + i.to_bytes(3, "big") for i in range(extra)]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return tokenizer.from_file(write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model"))


def pieces(enc, text):
    return [enc.decode_single_token_bytes(t) for t in enc.encode(text)]


def test_tokenizer_merges_by_rank_within_the_pattern_pieces(enc):
    assert pieces(enc, "hello world") == [b"hello", b" world"]
    # \p{N}{1,3}: "12345" is split into "123" and "45" before merging (unsplit, "34" would merge first)
    assert pieces(enc, "12345") == [b"123", b"45"]
    # (?i:'s|'t|'re|'ve|'m|'ll|'d): "'M" is a piece of its own, though "I'" is a merge
    assert pieces(enc, "I'M") == [b"I", b"'M"]
    text = "hello world, I'M 12345\n\n  naïve 日本 🤗"
    assert enc.decode(enc.encode(text)) == text


def test_special_tokens_follow_the_ranks(enc):
    n = 256 + len(MERGES)
    assert tokenizer.special(enc, "<|begin_of_text|>") == n and tokenizer.special(enc, "<|eot_id|>") == n + 9
    assert enc.encode("<|eot_id|>", allowed_special="all") == [n + 9]
    assert tokenizer.encode(enc, "hello") == [n, enc.encode("hello")[0]]
    assert len(tokenizer.SPECIAL_TOKENS) == len(set(tokenizer.SPECIAL_TOKENS)) == 256


def test_special_token_ids_of_a_full_size_file(tmp_path):
    enc = tokenizer.from_file(write_tokenizer(tmp_path / "tokenizer.model", merges=[], extra=128000 - 256))
    ids = {t: tokenizer.special(enc, t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                  "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_245|>")}
    assert ids == {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
                   "<|end_header_id|>": 128007, "<|eot_id|>": 128009, "<|reserved_special_token_245|>": 128255}


def test_chat_format(enc):
    ids = tokenizer.chat(enc, "  hello  ")
    assert enc.decode(ids) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    header = [tokenizer.special(enc, "<|start_header_id|>"), *enc.encode("user"),
              tokenizer.special(enc, "<|end_header_id|>"), *enc.encode("\n\n")]
    assert ids[1:1 + len(header)] == header  # the role and "\n\n" encoded apart from the text
    with pytest.raises(LabError, match="--chat needs a prompt"):
        tokenizer.chat(enc, "   ")


def test_tokenizer_file_is_found_where_the_hub_keeps_it(tmp_path):
    assert tokenizer.load_tokenizer(tmp_path) is None
    (tmp_path / "original").mkdir()
    write_tokenizer(tmp_path / "original" / "tokenizer.model")
    assert tokenizer.find(tmp_path) == tmp_path / "original" / "tokenizer.model"
    assert tokenizer.load_tokenizer(tmp_path).encode("hello") == [256 + MERGES.index(b"hello")]


@pytest.mark.parametrize("content,message", [("aGVsbG8= x\n", ":1: expected 'base64-token rank'"),
                                             ("!!notbase64 0\n", ":1: expected 'base64-token rank'"),
                                             ("AA== 0\nAQ== 2\n", "ranks are not 0 .. 1")])
def test_bad_tokenizer_files_are_refused(tmp_path, content, message):
    (tmp_path / "tokenizer.model").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        tokenizer.from_file(tmp_path / "tokenizer.model")
