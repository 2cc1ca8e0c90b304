"""Llama on the GPU against transformers' LlamaForCausalLM, for the reference and every rung that
takes the config, and lab.py on Llama-3.2-1B's shapes.

Two random-weight peers are built on the device and saved with save_pretrained and a small
max_shard_size (so that the index is read), all offline: "gqa" (4 layers, hidden 512, 8 query heads
over 2 key/value heads of head_dim 64, llama3 RoPE scaling, tied embeddings) and "untied-128"
(4 layers, hidden 512, 4 query heads over 2 key/value heads of head_dim 128, factor-8 scaling, an
lm_head of its own). The seed is chosen so that the peer's float32 and float64 greedy runs agree
with a clear margin at every step.

float32 (the reference and every float32 rung that takes the head size and GQA and runs here):
logits on a 64-token prompt may be off the peer's float64 run by at most TOLERANCE_FACTOR times
the peer's own float32 error (floored at float32 epsilon times the largest logit); 64 greedy tokens
must be the peer's exactly, without and with the KV cache (decode steps on llama/fast's fused kernels:
llama.generate's default for greedy KV-cache runs on the GPU).
bfloat16 (every bfloat16 rung that takes the config): logits at most BF16_FACTOR times the peer's
own bfloat16 error against float64; greedy tokens those of our reference attention in bfloat16 up
to a step where that run's top two logits lie within the logits' error bound of each other.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kernels
import lab
import llama
from lm.arrays import cast_params
from lm.generate import reference_attend
from tests.tiers import tiered

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE_FACTOR = 8.0
BF16_FACTOR = 2.0
PROMPT_LEN, NEW_TOKENS = 64, 64
MIN_MARGIN = 1e-3
COMMON = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=2048,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=0, eos_token_id=1)
PEERS = {
    "gqa": dict(COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64)),
    "untied-128": dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64)),
}


# quick: the KV cache (one query row a step); without it every step runs the whole prefix again
NO_CACHE_EXHAUSTIVE = tiered([False, True], quick=[True])


def rungs(config, dtype):
    """The rungs that take the config (head size, grouped-query attention) in dtype and run here."""
    arch = kernels.device_limits().arch
    return [n for n in lab.rungs_taking(config, dtype) if kernels.load(n).runs_on(arch)]


def peer_greedy(model, ids, torch):
    """NEW_TOKENS argmax steps over a KV cache; the smallest top-1 minus top-2 margin."""
    out_ids, past, margins = ids, None, []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(out_ids if past is None else out_ids[:, -1:], past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1].double(), out.past_key_values
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            out_ids = torch.cat([out_ids, logits.argmax().view(1, 1)], dim=1)
    return out_ids[0, ids.shape[1]:].tolist(), min(margins)


@pytest.fixture(scope="module", params=list(PEERS))
def peer(request, tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(f"peer-llama-{request.param}")
    for seed in range(10):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(**PEERS[request.param])
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # RMSNorm weights random too, so that every parameter matters
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.1 if ("embed" in name or "lm_head" in name) else 0.05)
        model = model.to("cuda")
        ids = torch.from_numpy(np.random.default_rng(seed).integers(2, config.vocab_size, (1, PROMPT_LEN))).cuda()
        models = {"float32": model}
        for dtype in (torch.float64, torch.bfloat16):
            copy = transformers.LlamaForCausalLM(config).eval().to("cuda")
            copy.load_state_dict(model.state_dict())
            models[str(dtype).removeprefix("torch.")] = copy.to(dtype)
        with torch.no_grad():
            logits = {k: m(ids).logits[0].double().cpu().numpy() for k, m in models.items()}
        greedy32, margin = peer_greedy(models["float32"], ids, torch)
        greedy64, _ = peer_greedy(models["float64"], ids, torch)
        if greedy32 == greedy64 and margin >= MIN_MARGIN:
            break
    else:
        raise AssertionError("no seed gave a greedy run clear of near ties")
    model.save_pretrained(folder, max_shard_size="2MB")
    assert (folder / "model.safetensors.index.json").is_file()
    return {"name": request.param, "folder": folder, "ids": ids[0].tolist(), "logits": logits, "greedy": greedy32}


@pytest.fixture(scope="module")
def ours(peer):
    import cupy

    ckpt = llama.load(peer["folder"], xp=cupy)
    assert isinstance(ckpt.params["model.embed_tokens.weight"], cupy.ndarray)
    assert ckpt.config.tie_word_embeddings == (peer["name"] == "gqa")
    return ckpt


def attend_with(name, dtype="float32"):
    return reference_attend if name == "reference" else lab.make_attend(name, dtype)


def peer_error(peer, dtype):
    lg = peer["logits"]
    return max(float(np.abs(lg[dtype] - lg["float64"]).max()),
               float(np.finfo(np.float32).eps * np.abs(lg["float64"]).max()))


def logits_error(ckpt, params, peer, attend):
    import cupy

    logits = llama.forward(params, ckpt.config, cupy.asarray([peer["ids"]]), attend)[0]
    return float(np.abs(cupy.asnumpy(logits).astype(np.float64) - peer["logits"]["float64"]).max())


def test_every_rung_and_head_size_is_covered(ours):
    expected = {64: {"v13_fa2_partitioning", "v14_tf32_mma"}, 128: {"v13_fa2_partitioning", "v14_tf32_mma"}}
    assert expected[ours.config.head_size] <= set(rungs(ours.config, "float32"))
    assert {"v15_bf16_mma"} <= set(rungs(ours.config, "bfloat16"))


def test_float32_logits_match_transformers(peer, ours):
    bound = TOLERANCE_FACTOR * peer_error(peer, "float32")
    for name in ["reference", *rungs(ours.config, "float32")]:
        err = logits_error(ours, ours.params, peer, attend_with(name))
        assert err <= bound, f"{peer['name']}, {name}: max |logits - transformers float64| = {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("kv_cache", NO_CACHE_EXHAUSTIVE)
def test_float32_greedy_matches_transformers(peer, ours, kv_cache):
    for name in ["reference", *rungs(ours.config, "float32")]:
        out = llama.generate(ours.params, ours.config, peer["ids"], NEW_TOKENS, attend=attend_with(name),
                             kv_cache=kv_cache)
        first = next((i for i, (a, b) in enumerate(zip(out.tokens, peer["greedy"])) if a != b), None)
        assert out.tokens == peer["greedy"], f"{peer['name']}, {name}, kv_cache={kv_cache}: differs from token {first}"


@pytest.fixture(scope="module")
def ours16(ours):
    return cast_params(ours.params, "bfloat16")


def test_bfloat16_logits_within_the_peer_s_own_error(peer, ours, ours16):
    bound = BF16_FACTOR * peer_error(peer, "bfloat16")
    for name in ["reference", *rungs(ours.config, "bfloat16")]:
        err = logits_error(ours, ours16, peer, attend_with(name, "bfloat16"))
        assert err <= bound, f"{peer['name']}, {name} bfloat16: max |logits - float64| = {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("kv_cache", NO_CACHE_EXHAUSTIVE)
def test_bfloat16_greedy_follows_the_reference_attention(peer, ours, ours16, kv_cache):
    tie = 2 * BF16_FACTOR * peer_error(peer, "bfloat16")
    ref = llama.generate(ours16, ours.config, peer["ids"], NEW_TOKENS, attend=reference_attend, kv_cache=kv_cache,
                         decode_attend=reference_attend, record_logits=True)
    margins = [float(np.diff(np.sort(row.get())[-2:])[0]) for row in ref.logits]
    for name in rungs(ours.config, "bfloat16"):
        out = llama.generate(ours16, ours.config, peer["ids"], NEW_TOKENS, attend=attend_with(name, "bfloat16"),
                             kv_cache=kv_cache)
        first = next((i for i, (a, b) in enumerate(zip(out.tokens, ref.tokens)) if a != b), None)
        assert first is None or margins[first] < tie, (
            f"{peer['name']}, {name}, kv_cache={kv_cache}: differs from token {first}, where the reference's "
            f"margin {margins[first]:.3g} is no near tie (< {tie:.3g})")


def lab_run(*args, tmp_path):
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, str(ROOT / "lab.py"), *map(str, args), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["no-cache", "kv-cache", "kv-cache-eager"])
def test_lab_runs_llama_3_2_1b_shapes_from_random_weights(tmp_path, mode):
    flags = {"no-cache": [], "kv-cache": ["--kv-cache"], "kv-cache-eager": ["--kv-cache", "--no-graph"]}[mode]
    s = lab_run("--random-weights", "--size", "llama-3.2-1b", "--prompt-ids", "128000,791,1888", "--tokens", 4,
                *flags, tmp_path=tmp_path)
    config = llama.SIZES["llama-3.2-1b"]
    assert (s["family"], s["dtype"], s["device"], s["n_new_tokens"]) == ("llama", "bfloat16", "gpu", 4)
    prefill = [n for n in rungs(config, "bfloat16") if not kernels.load(n).split_kv]
    assert s["kernel"] == prefill[-1] and s["generated_text"] is None
    assert s["n_params"] == 1_235_814_400 and s["peak_gpu_memory_bytes"] > 0
    if mode == "kv-cache":  # greedy KV-cache runs take the fast path
        assert (s["engine"], s["decode_attention"]) == ("fast", "fused gqa_decode_attention")
    if mode == "kv-cache-eager":
        assert s["engine"] == "eager" and s["engine_note"] == "--no-graph"
        assert s["decode_attention"] != "reference" and "gqa" in kernels.load(s["decode_attention"]).supports


def test_lab_check_on_a_rung_with_gqa(tmp_path):
    fixture = ROOT / "tests" / "fixtures" / "llama-gqa"
    s = lab_run("--model", fixture, "--prompt-ids", "0,5,9,13", "--tokens", 16, "--dtype", "float32", "--kernel", "v13",
                "--kv-cache", "--check", tmp_path=tmp_path)
    assert s["kernel"] == "v13_fa2_partitioning" and s["check"]["identical"]
