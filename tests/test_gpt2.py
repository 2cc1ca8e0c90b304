"""GPT-2 on the CPU (NumPy): loader, config, tokenizer, forward pass against transformers' golden
logits, and generation in both modes. The same model code runs on CuPy in test_gpt2_gpu.py."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import gpt2
from gpt2 import CheckpointError, GPT2Config, LabError, Sampler, forward, generate, reference_attend
from gpt2.config import SIZES, from_json, from_shapes
from gpt2.load import expected_shapes, random_weights, save
from gpt2.model import KVCache, gelu
from gpt2.tokenizer import load_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = FIXTURES / "gpt2-tiny"
GOLDEN = FIXTURES / "gpt2-tiny-golden.npz"
EPS32 = float(np.finfo(np.float32).eps)
SMALL = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64)


def max_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def tiny():
    return gpt2.load(TINY)


@pytest.fixture(scope="module")
def small():
    """A random checkpoint with GPT-2's real vocabulary, so the tokenizer's ids fit."""
    return random_weights(SMALL, seed=1)


# --- config -----------------------------------------------------------------------------------


def test_sizes_are_the_released_family():
    assert {k: (c.n_layer, c.n_head, c.n_embd) for k, c in SIZES.items()} == {
        "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}
    assert all(c.head_size == 64 and c.n_positions == 1024 and c.vocab_size == 50257 for c in SIZES.values())


def test_config_from_config_json(tiny):
    assert from_json(TINY / "config.json") == tiny.config == GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=32, eos_token_id=255)


@pytest.mark.parametrize("key,value", [("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True),
                                       ("model_type", "llama"), ("tie_word_embeddings", False)])
def test_config_json_with_unsupported_settings_is_refused(tmp_path, key, value):
    raw = json.loads((TINY / "config.json").read_text()) | {key: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=key if key != "model_type" else "llama"):
        from_json(tmp_path / "config.json")


def test_config_from_shapes_when_no_config_json():
    shapes = expected_shapes(SIZES["gpt2-medium"])
    assert from_shapes(shapes) == SIZES["gpt2-medium"]  # n_head=16 comes from the size table
    with pytest.raises(CheckpointError, match="match none of"):
        from_shapes(expected_shapes(SMALL))


# --- loader -----------------------------------------------------------------------------------


def params_equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_transformers_names_load_without_prefix_and_lm_head(tiny):
    stored = load_file(TINY / "model.safetensors")
    assert all(k.startswith("transformer.") for k in stored) and "lm_head.weight" not in stored
    assert set(tiny.params) == set(expected_shapes(tiny.config))
    assert params_equal(tiny.params, {k.removeprefix("transformer."): v for k, v in stored.items()})


def test_both_naming_schemes_give_the_same_params(tmp_path, tiny):
    save(tiny, tmp_path / "hub", prefix="")  # the hub's openai-community/gpt2 file: no prefix
    save(tiny, tmp_path / "hf", prefix="transformer.")
    assert not any(k.startswith("transformer.") for k in load_file(tmp_path / "hub" / "model.safetensors"))
    assert params_equal(gpt2.load(tmp_path / "hub").params, tiny.params)
    assert params_equal(gpt2.load(tmp_path / "hf").params, tiny.params)


def write_variant(tmp_path, edit, config=True):
    tensors = load_file(TINY / "model.safetensors")
    edit(tensors)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config:
        shutil.copy(TINY / "config.json", tmp_path / "config.json")
    return tmp_path


def test_tied_lm_head_is_accepted_and_dropped(tmp_path, tiny):
    def add_lm_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"].copy()

    loaded = gpt2.load(write_variant(tmp_path, add_lm_head))
    assert "lm_head.weight" not in loaded.params
    assert params_equal(loaded.params, tiny.params)


def test_untied_lm_head_is_refused(tmp_path):
    def add_lm_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"] + 1

    with pytest.raises(CheckpointError, match="lm_head.weight differs from wte.weight"):
        gpt2.load(write_variant(tmp_path, add_lm_head))


def test_attention_mask_buffers_are_dropped(tmp_path, tiny):
    P = tiny.config.n_positions

    def add_buffers(t):
        for i in range(tiny.config.n_layer):
            t[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((P, P), np.float32))[None, None]
            t[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)

    loaded = gpt2.load(write_variant(tmp_path, add_buffers))
    assert params_equal(loaded.params, tiny.params)  # and c_attn.bias, a real bias, is kept
    assert "h.0.attn.c_attn.bias" in loaded.params


def test_shape_mismatch_names_the_tensor(tmp_path):
    def shrink(t):
        t["transformer.h.1.mlp.c_fc.weight"] = t["transformer.h.1.mlp.c_fc.weight"][:, :-1].copy()

    with pytest.raises(CheckpointError, match=r"h\.1\.mlp\.c_fc\.weight: shape \(32, 127\) but the config says \(32, 128\)"):
        gpt2.load(write_variant(tmp_path, shrink))


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"h\.0\.ln_2\.bias missing"):
        gpt2.load(write_variant(tmp_path / "a", lambda t: t.pop("transformer.h.0.ln_2.bias")))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) h\.0\.extra"):
        gpt2.load(write_variant(tmp_path / "b", lambda t: t.update({"h.0.extra": np.zeros(3, np.float32)})))


def test_conv1d_weights_are_used_as_stored(tiny):
    """(in, out): the projection is x @ weight, no transpose anywhere."""
    C = tiny.config.n_embd
    assert tiny.params["h.0.attn.c_attn.weight"].shape == (C, 3 * C)
    assert tiny.params["h.0.mlp.c_proj.weight"].shape == (4 * C, C)


def test_corrupt_and_truncated_files_give_clear_errors(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x07not a safetensors file at all")
    (tmp_path / "cut").mkdir()
    data = (TINY / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    for folder in ("garbage", "cut"):
        with pytest.raises(CheckpointError, match="not a readable safetensors file"):
            gpt2.load(tmp_path / folder)


def test_missing_checkpoint_gives_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        gpt2.load(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: re-save it with safetensors"):
        gpt2.load(tmp_path)
    with pytest.raises(CheckpointError, match="no such folder"):
        gpt2.load(str(tmp_path / "nowhere"))


def test_sharded_checkpoint_with_index(tmp_path, tiny):
    stored = load_file(TINY / "model.safetensors")
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: stored[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    assert params_equal(gpt2.load(tmp_path).params, tiny.params)


def test_a_safetensors_file_can_be_named_directly(tiny):
    assert params_equal(gpt2.load(TINY / "model.safetensors").params, tiny.params)


def test_random_weights_are_gpt2_shaped_and_seeded():
    a, b, c = (random_weights(SMALL, seed=s) for s in (3, 3, 4))
    assert {k: v.shape for k, v in a.params.items()} == expected_shapes(SMALL)
    assert all(v.dtype == np.float32 for v in a.params.values())
    assert params_equal(a.params, b.params) and not params_equal(a.params, c.params)
    assert np.all(a.params["h.1.ln_2.weight"] == 1) and np.all(a.params["h.1.attn.c_attn.bias"] == 0)
    assert abs(float(a.params["wte.weight"].std()) - 0.02) < 1e-3
    assert abs(float(a.params["h.0.mlp.c_proj.weight"].std()) - 0.02 / 2) < 1e-3  # 0.02 / sqrt(2 n_layer)
    with pytest.raises(CheckpointError, match="unknown size"):
        random_weights("gpt3")


def test_random_weights_in_bfloat16_are_the_float32_draws_rounded():
    """Each tensor allocated before the draws and the draw cast into it: the same values as the float32
    draw cast by astype, tensor by tensor, for one seed."""
    import ml_dtypes

    wide, narrow = (random_weights(SMALL, seed=5, dtype=d) for d in (np.float32, ml_dtypes.bfloat16))
    assert {k: v.dtype for k, v in narrow.params.items()} == {k: np.dtype(ml_dtypes.bfloat16) for k in wide.params}
    for name, a in wide.params.items():
        assert np.array_equal(narrow.params[name].view(np.uint16), a.astype(ml_dtypes.bfloat16).view(np.uint16)), name


def test_hub_id_is_read_from_the_cache_offline(tmp_path, monkeypatch, tiny):
    """A hub id resolves through huggingface_hub's cache layout (HF_HUB_CACHE) without network."""
    import huggingface_hub.constants as hub_constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--lab-test--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(TINY, repo / "snapshots" / commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    loaded = gpt2.load("lab-test/tiny-gpt2")
    assert loaded.name == "lab-test/tiny-gpt2" and params_equal(loaded.params, tiny.params)
    with pytest.raises(gpt2.ModelSourceError, match="--model PATH .* or --random-weights"):
        gpt2.load("lab-test/not-cached")


# --- forward pass -----------------------------------------------------------------------------


def test_gelu_is_the_tanh_approximation():
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    assert gelu(x).dtype == np.float32
    assert max_err(gelu(x), expected) < 1e-6
    assert abs(float(gelu(np.float32([1.0]))[0]) - 0.8411920) < 1e-6


def test_logits_match_transformers_golden(tiny, golden):
    logits = forward(tiny.params, tiny.config, golden["ids"], reference_attend)
    assert logits.shape == golden["logits"].shape and logits.dtype == np.float32
    bound = 32 * EPS32 * float(np.abs(golden["logits"]).max())
    err = max_err(logits, golden["logits"])
    assert err <= bound, f"max |logits - transformers| = {err:.3g} > {bound:.3g} ({golden['made_with']})"


def test_last_only_is_the_last_row(tiny, golden):
    full = forward(tiny.params, tiny.config, golden["ids"], reference_attend)
    last = forward(tiny.params, tiny.config, golden["ids"], reference_attend, last_only=True)
    assert last.shape == (2, 1, tiny.config.vocab_size)
    assert max_err(last[:, 0], full[:, -1]) <= 1e-6


def test_kv_cache_forward_matches_full_forward(tiny, golden):
    ids = golden["ids"]
    full = forward(tiny.params, tiny.config, ids, reference_attend)
    cache = KVCache(tiny.config, batch=2, max_len=ids.shape[1])
    pieces = [forward(tiny.params, tiny.config, ids[:, :11], reference_attend, cache=cache)]
    for t in range(11, ids.shape[1]):
        pieces.append(forward(tiny.params, tiny.config, ids[:, t:t + 1], reference_attend, cache=cache))
    assert cache.length == ids.shape[1]
    assert max_err(np.concatenate(pieces, axis=1), full) <= 32 * EPS32 * float(np.abs(full).max())


def test_attention_gets_views_of_the_packed_projection(tiny, golden):
    seen = []

    def spy(q, k, v):
        seen.append((q.shape, q.strides[-1], q.flags.c_contiguous))
        return reference_attend(q, k, v)

    forward(tiny.params, tiny.config, golden["ids"], spy)
    B, T = golden["ids"].shape
    assert len(seen) == tiny.config.n_layer
    assert all(s == ((B, 2, T, 16), 4, False) for s in seen)  # (B, NH, T, hs), unit last stride, strided


def test_forward_beyond_the_context_is_refused(tiny):
    with pytest.raises(ValueError, match="33 positions, but the model has 32"):
        forward(tiny.params, tiny.config, np.zeros((1, 33), np.int64), reference_attend)


# --- generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache", [False, True])
def test_greedy_generation_matches_transformers(tiny, golden, kv_cache):
    out = generate(tiny.params, tiny.config, golden["prompt"].tolist(), len(golden["greedy"]),
                   attend=reference_attend, kv_cache=kv_cache)
    assert out.tokens == golden["greedy"].tolist()


def test_both_modes_give_identical_greedy_tokens(small):
    prompt = load_tokenizer().encode("Hello, I'm a language model,")
    a = generate(small.params, small.config, prompt, 40, attend=reference_attend, record_logits=True)
    b = generate(small.params, small.config, prompt, 40, attend=reference_attend, kv_cache=True, record_logits=True)
    assert a.tokens == b.tokens and len(a.tokens) == 40
    assert max(max_err(x, y) for x, y in zip(a.logits, b.logits, strict=True)) < 1e-4


def test_sampling_is_seeded(small):
    prompt = [15496, 11]

    def sample(seed, **kw):
        return generate(small.params, small.config, prompt, 20, attend=reference_attend, kv_cache=True,
                        sampler=Sampler(**({"temperature": 1.0, "seed": seed} | kw))).tokens

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)
    greedy = generate(small.params, small.config, prompt, 20, attend=reference_attend, kv_cache=True).tokens
    assert sample(7, top_k=1) == greedy  # top-1 sampling is greedy


def test_top_k_samples_only_among_the_k_likeliest(small):
    out = generate(small.params, small.config, [15496, 11], 30, attend=reference_attend, kv_cache=True,
                   sampler=Sampler(temperature=5.0, top_k=3, seed=0), record_logits=True)
    for token, logits in zip(out.tokens, out.logits, strict=True):
        assert token in np.argsort(logits)[-3:]
    assert len(set(out.tokens)) > 1  # a high temperature really samples


def test_stop_at_end_of_text(small):
    """A model that always prefers <|endoftext|>: generation stops after it when asked."""
    params = dict(small.params)
    eos = small.config.eos_token_id
    params["wte.weight"] = params["wte.weight"].copy()
    params["wte.weight"][eos] *= 20
    params["ln_f.weight"] = np.zeros_like(params["ln_f.weight"])
    params["ln_f.bias"] = params["wte.weight"][eos] / np.linalg.norm(params["wte.weight"][eos])
    stopped = generate(params, small.config, [15496], 10, attend=reference_attend, eos_id=eos)
    assert stopped.tokens == [eos] and stopped.stopped_at_eos
    unstopped = generate(params, small.config, [15496], 10, attend=reference_attend)
    assert unstopped.tokens == [eos] * 10 and not unstopped.stopped_at_eos


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -1.0}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": 1.0, "top_k": 0}, "top-k must be at least 1"),
    ({"top_k": 5}, "top-k needs a temperature"),
])
def test_bad_sampling_settings_are_refused(kw, match):
    with pytest.raises(LabError, match=match):
        Sampler(**kw)


def test_generation_checks_its_inputs(tiny):
    def gen(prompt, n):
        return generate(tiny.params, tiny.config, prompt, n, attend=reference_attend)

    with pytest.raises(LabError, match="30 prompt tokens \\+ 3 new tokens = 33 positions, but the model has 32"):
        gen([1] * 30, 3)
    with pytest.raises(LabError, match="at least one token"):
        gen([], 3)
    with pytest.raises(LabError, match="at least 1"):
        gen([1], 0)
    with pytest.raises(LabError, match="token id 300 is outside the model's vocabulary of 256"):
        gen([1, 300], 1)
    assert len(gen([1] * 31, 1).tokens) == 1  # exactly the context is fine
