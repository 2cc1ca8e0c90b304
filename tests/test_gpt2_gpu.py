"""GPT-2 on the GPU against transformers' GPT2LMHeadModel, for the reference and every rung.

A random-weight GPT2LMHeadModel (4 layers, 4 heads, width 256, 256 positions), run on the device in
float32 (no TF32) and float64, is saved with save_pretrained and read back with our loader. Logits
on a 64-token prompt: our error against the peer run in float64 may be at most TOLERANCE_FACTOR
times the peer's own float32 error against its float64 run (floored at float32 epsilon times the
largest logit). Greedy generation of 64 tokens must give the peer's tokens exactly, with and
without the KV cache. The seed is chosen so that no greedy step is a near tie (the peer's float32 and
float64 runs agree, with a clear margin).
"""

import json
from pathlib import Path

import numpy as np
import pytest

import gpt2
import kernels
import lab
from tests.tiers import tiered

pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOLERANCE_FACTOR = 8.0
PROMPT_LEN, NEW_TOKENS = 64, 64
MIN_MARGIN = 1e-3
PEER_CONFIG = dict(n_layer=4, n_head=4, n_embd=256, n_positions=256, vocab_size=50257)
ATTENTIONS = ["reference"] + [n for n in kernels.names()  # the float32 rungs: these weights are float32
                               if 64 in kernels.load(n).head_sizes() and "float32" in kernels.load(n).dtypes]


def attend_with(name):
    return gpt2.reference_attend if name == "reference" else lab.make_attend(name)


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("peer-gpt2")
    torch.backends.cuda.matmul.allow_tf32 = False  # the peer's float32 is float32's rounding
    for seed in range(20):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**PEER_CONFIG)).eval()
        with torch.no_grad():  # LayerNorms and biases random too, so that every parameter matters
            for name, p in model.named_parameters():
                if "ln_" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.02 * torch.randn_like(p))
        model = model.to("cuda")  # on the device: the host runs made this the quick tier's slowest setup
        ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 50257, (1, PROMPT_LEN))).cuda()
        with torch.no_grad():
            logits32 = model(ids).logits[0].cpu().numpy()
            model64 = transformers.GPT2LMHeadModel(model.config).eval().to("cuda")
            model64.load_state_dict(model.state_dict())
            model64 = model64.double()
            logits64 = model64(ids).logits[0].cpu().numpy()
        greedy32, margin = peer_greedy(model, ids)
        greedy64, _ = peer_greedy(model64, ids)
        if greedy32 == greedy64 and margin >= MIN_MARGIN:
            break
    else:
        raise AssertionError("no seed gave a greedy run clear of near ties")
    model.save_pretrained(folder, safe_serialization=True)
    return {"folder": folder, "ids": ids[0].tolist(), "logits32": logits32, "logits64": logits64,
            "greedy": greedy32, "margin": margin}


def peer_greedy(model, ids):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=50256)
    top2 = np.sort(np.stack([s[0].float().cpu().numpy() for s in out.scores]), axis=-1)[:, -2:]
    return out.sequences[0, ids.shape[1]:].tolist(), float((top2[:, 1] - top2[:, 0]).min())


@pytest.fixture(scope="module")
def ours(peer):
    import cupy

    ckpt = gpt2.load(peer["folder"], xp=cupy)
    assert isinstance(ckpt.params["wte.weight"], cupy.ndarray)
    return ckpt


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_logits_match_transformers(peer, ours, attention):
    import cupy

    logits = gpt2.forward(ours.params, ours.config, cupy.asarray([peer["ids"]]), attend_with(attention))
    got = cupy.asnumpy(logits[0]).astype(np.float64)
    ref64, plain32 = peer["logits64"], peer["logits32"]
    err = float(np.abs(got - ref64).max())
    plain = float(np.abs(plain32 - ref64).max())
    floor = np.finfo(np.float32).eps * float(np.abs(ref64).max())
    bound = TOLERANCE_FACTOR * max(plain, floor)
    assert err <= bound, f"{attention}: max |logits - fp64 peer| {err:.3e} > {bound:.3e} (peer fp32: {plain:.3e})"


# quick: the KV cache (one query row a step; without it every step runs the whole prefix again), with the
# reference, the decode rungs and the newest rung (test_logits_match_transformers takes every rung)
@pytest.mark.parametrize("kv_cache", tiered([False, True], quick=[True]), ids=["no-cache", "kv-cache"])
@pytest.mark.parametrize("attention", tiered(ATTENTIONS, quick=lambda name: name in ("reference", ATTENTIONS[-1])
                                             or kernels.load(name).split_kv))
def test_greedy_tokens_match_transformers(peer, ours, attention, kv_cache):
    out = gpt2.generate(ours.params, ours.config, peer["ids"], NEW_TOKENS, attend=attend_with(attention),
                        kv_cache=kv_cache)
    first = next((i for i, (a, b) in enumerate(zip(out.tokens, peer["greedy"], strict=False)) if a != b), None)
    assert out.tokens == peer["greedy"], f"{attention}: first difference at new token {first} (peer margin {peer['margin']:.2e})"


def test_cupy_and_numpy_share_the_model_code():
    """The CPU golden fixture through CuPy: the same forward pass on the other array module."""
    import cupy

    golden = np.load(FIXTURES / "gpt2-tiny-golden.npz")
    ckpt = gpt2.load(FIXTURES / "gpt2-tiny", xp=cupy)
    logits = cupy.asnumpy(gpt2.forward(ckpt.params, ckpt.config, cupy.asarray(golden["ids"]), gpt2.reference_attend))
    bound = 32 * np.finfo(np.float32).eps * float(np.abs(golden["logits"]).max())
    assert float(np.abs(logits - golden["logits"]).max()) <= bound


@pytest.mark.parametrize("kv_cache", [False, True], ids=["no-cache", "kv-cache"])
def test_lab_runs_gpt2_small_on_the_newest_float32_rung(tmp_path, capsys, kv_cache):
    """GPT-2 small shapes through lab.py's own code path, with --check against the reference."""
    out = tmp_path / "run.json"
    rung = [n for n in kernels.names() if "float32" in kernels.load(n).dtypes][-1]
    rc = lab.main(["--random-weights", "--kernel", rung, "--tokens", "32", "--check", "--json", str(out),
                   *(["--kv-cache"] if kv_cache else [])])
    printed = capsys.readouterr().out
    s = json.loads(out.read_text())
    assert rc == 0, printed
    assert s["device"] == "gpu" and s["kernel"] == rung and s["n_new_tokens"] == 32
    assert s["mode"] == ("kv-cache" if kv_cache else "no-kv-cache")
    assert s["check"]["identical"] and s["check"]["rerun_matches_timed_run"], s["check"]
    assert s["check"]["max_logit_diff"] < 1e-3
    assert s["peak_gpu_memory_bytes"] >= 4 * s["n_params"]  # the float32 weights at least
    assert s["compile_seconds"] >= 0 and s["seconds"] > 0
    assert "peak GPU memory" in printed and kernels.device_limits().name in printed
