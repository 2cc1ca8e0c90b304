"""lab.py end to end, as a user runs it: a subprocess on a tiny random checkpoint with --device cpu.
Every user error exits 2 with one line on stderr and no traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt2
from gpt2 import GPT2Config, generate, reference_attend
from gpt2.load import random_weights, save

ROOT = Path(__file__).resolve().parent.parent
HAS_GPU = __import__("kernels").gpu_available()
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64)
PROMPT_IDS = [15496, 11, 314, 1101, 257, 3303, 2746, 11]  # "Hello, I'm a language model,"


@pytest.fixture(scope="module")
def checkpoint():
    return random_weights(TINY, seed=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, checkpoint):
    return save(checkpoint, tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def eos_folder(tmp_path_factory, checkpoint):
    """A checkpoint whose every next token is <|endoftext|>: ln_f outputs wte[eos]'s direction."""
    params = dict(checkpoint.params)
    eos = TINY.eos_token_id
    params["wte.weight"] = params["wte.weight"].copy()
    params["wte.weight"][eos] *= 20
    params["ln_f.weight"] = np.zeros_like(params["ln_f.weight"])
    params["ln_f.bias"] = params["wte.weight"][eos] / np.linalg.norm(params["wte.weight"][eos])
    return save(gpt2.Checkpoint("eos", TINY, params), tmp_path_factory.mktemp("eos-gpt2"))


def lab(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "lab.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)


def summary_rows(stdout):
    rows = stdout.split("-" * 60 + "\n", 1)[1].splitlines()
    return {line[:17].strip(): line[17:] for line in rows}


def test_generates_streams_and_summarises(folder, checkpoint, tmp_path):
    out = tmp_path / "run.json"
    r = lab("--device", "cpu", "--model", folder, "--tokens", 12, "--json", out)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    expected = generate(checkpoint.params, TINY, PROMPT_IDS, 12, attend=reference_attend).tokens
    assert s["prompt_tokens"] == PROMPT_IDS and s["generated_tokens"] == expected
    assert s["prompt"] == "Hello, I'm a language model," and s["generated_text"] == gpt2.load_tokenizer().decode(expected)
    assert r.stdout.startswith(s["prompt"] + s["generated_text"] + "\n")  # the text, streamed, before the summary
    assert (s["kernel"], s["mode"], s["decode_attention"], s["device"]) == ("reference", "no-kv-cache", None, "cpu")
    assert s["kernel_unverified"] is None
    assert (s["n_prompt_tokens"], s["n_new_tokens"], s["model"]) == (8, 12, str(folder))
    assert s["seconds"] > 0 and s["tokens_per_second"] == pytest.approx(12 / s["seconds"])
    assert s["compile_seconds"] == 0 and s["peak_gpu_memory_bytes"] is None and s["check"] is None
    assert s["config"]["n_layer"] == 2 and s["n_params"] == checkpoint.n_params
    rows = summary_rows(r.stdout)
    for key in ("model", "attention", "mode", "prompt tokens", "new tokens", "seconds", "tokens/s",
                "compile time", "peak GPU memory", "device"):
        assert key in rows, f"summary lacks {key!r}:\n{r.stdout}"
    assert rows["new tokens"] == "12" and "every step recomputes the whole sequence" in rows["mode"]
    assert "not in the timing" in rows["compile time"] and rows["peak GPU memory"] == "n/a (cpu)"
    assert r.stderr == ""


def test_kv_cache_mode_gives_the_same_tokens(folder, tmp_path):
    runs = {}
    for mode in ("no", "kv"):
        out = tmp_path / f"{mode}.json"
        r = lab("--device", "cpu", "--model", folder, "--tokens", 20, "--json", out, *(["--kv-cache"] if mode == "kv" else []))
        assert r.returncode == 0, r.stderr
        runs[mode] = (json.loads(out.read_text()), summary_rows(r.stdout))
    assert runs["kv"][0]["generated_tokens"] == runs["no"][0]["generated_tokens"]
    assert runs["kv"][0]["mode"] == "kv-cache" and runs["kv"][0]["decode_attention"] == "reference"
    assert runs["kv"][1]["mode"] == "KV cache: prefill with reference, decode attention: reference"


def test_check_reruns_with_the_reference(folder, tmp_path):
    out = tmp_path / "check.json"
    r = lab("--device", "cpu", "--model", folder, "--tokens", 10, "--check", "--json", out)
    assert r.returncode == 0, r.stderr
    c = json.loads(out.read_text())["check"]
    assert c["identical"] and c["first_difference"] is None and c["steps_compared"] == 10
    assert c["max_logit_diff"] == 0.0  # the same NumPy code twice
    assert c["reference_tokens"] == json.loads(out.read_text())["generated_tokens"]
    assert summary_rows(r.stdout)["check"].startswith("tokens identical to the reference attention's (10 of 10)")


def test_sampling_is_reproducible_from_the_command_line(folder, tmp_path):
    def sampled(seed):
        out = tmp_path / f"s{seed}.json"
        r = lab("--device", "cpu", "--model", folder, "--tokens", 15, "--temperature", 1.5, "--top-k", 40,
                "--seed", seed, "--json", out)
        assert r.returncode == 0, r.stderr
        return json.loads(out.read_text())["generated_tokens"]

    assert sampled(1) == sampled(1) != sampled(2)


def test_stop_at_eos(eos_folder, tmp_path):
    out = tmp_path / "eos.json"
    r = lab("--device", "cpu", "--model", eos_folder, "--tokens", 10, "--stop-at-eos", "--json", out)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["generated_tokens"] == [50256] and s["stopped_at_eos"]
    assert "<|endoftext|>" not in r.stdout.split("-" * 60)[0]
    assert summary_rows(r.stdout)["new tokens"] == "1 (stopped at end-of-text)"
    r = lab("--device", "cpu", "--model", eos_folder, "--tokens", 3)
    assert r.returncode == 0 and r.stdout.startswith("Hello, I'm a language model," + "<|endoftext|>" * 3 + "\n")


def test_random_weights_run(tmp_path):
    out = tmp_path / "random.json"
    r = lab("--device", "cpu", "--random-weights", "--tokens", 3, "--kv-cache", "--json", out)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["model"] == "random gpt2 (seed 0)" and s["n_params"] == 124439808 and len(s["generated_tokens"]) == 3


def test_offline_hub_model_from_the_cache(folder, tmp_path):
    commit = "1" * 40
    repo = tmp_path / "hf" / "hub" / "models--lab-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(folder, target_is_directory=True)
    r = lab("--device", "cpu", "--model", "lab-test/tiny", "--tokens", 2,
            env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 0, r.stderr
    assert summary_rows(r.stdout)["model"].startswith("lab-test/tiny, ")


def corrupt_folder(tmp_path):
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\xff" * 64)
    return tmp_path / "corrupt"


def mismatched_folder(tmp_path, folder):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.0.attn.c_proj.weight"] = tensors["transformer.h.0.attn.c_proj.weight"][:-1].copy()
    (tmp_path / "mismatch").mkdir()
    save_file(tensors, str(tmp_path / "mismatch" / "model.safetensors"))
    (tmp_path / "mismatch" / "config.json").write_text((folder / "config.json").read_text())
    return tmp_path / "mismatch"


ERRORS = {
    "unknown kernel": (["--kernel", "v99"], "unknown kernel 'v99': known kernels are"),
    "kernel on cpu": (["--kernel", "v01", "--device", "cpu"], "runs on the GPU"),
    "zero tokens": (["--tokens", "0"], "--tokens must be at least 1"),
    "negative tokens": (["--tokens", "-3"], "--tokens must be at least 1"),
    "non-integer tokens": (["--tokens", "many"], "invalid int value"),
    "empty prompt": (["--prompt", ""], "--prompt is empty"),
    "context overflow": (["--tokens", "60"], "8 prompt tokens + --tokens 60 = 68 positions, but the model has 64"),
    "negative temperature": (["--temperature", "-0.5"], "temperature must be a finite number >= 0"),
    "nan temperature": (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    "zero top-k": (["--temperature", "1", "--top-k", "0"], "top-k must be at least 1"),
    "top-k while greedy": (["--top-k", "5"], "top-k needs a temperature > 0"),
    "size without random weights": (["--size", "gpt2-xl"], "--size chooses the size of --random-weights"),
    "unknown size": (["--random-weights", "--size", "gpt5"], "invalid choice: 'gpt5'"),
    "unknown option": (["--fast"], "unrecognized arguments: --fast"),
    "json into a missing folder": (["--json", "/nonexistent/dir/x.json"], "does not exist"),
}
if not HAS_GPU:
    ERRORS["gpu without one"] = (["--device", "gpu"], "no CUDA device")
    ERRORS["rung without a gpu"] = (["--kernel", "v01", "--device", "auto"], "there is no CUDA device here")


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_exit_2_with_one_line(folder, case):
    args, message = ERRORS[case]
    model = [] if "--random-weights" in args else ["--model", folder]
    r = lab(*model, *args, *([] if "--device" in args else ["--device", "cpu"]))
    assert_one_line_error(r, message)


def assert_one_line_error(r, message):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lab.py: error: "), r.stderr
    assert message in lines[0], lines[0]


@pytest.mark.parametrize("case", ["missing folder", "no safetensors", "corrupt", "shape mismatch", "offline"])
def test_checkpoint_errors_exit_2_with_one_line(folder, tmp_path, case):
    env = {}
    if case == "missing folder":
        model, message = tmp_path / "nowhere", "no such folder"
    elif case == "no safetensors":
        model, message = tmp_path, "no model.safetensors"
    elif case == "corrupt":
        model, message = corrupt_folder(tmp_path), "not a readable safetensors file"
    elif case == "shape mismatch":
        model, message = mismatched_folder(tmp_path, folder), "h.0.attn.c_proj.weight: shape (31, 32)"
    else:  # nothing cached, no network: the default hub model
        (tmp_path / "empty-hf").mkdir()
        model, message = None, "cannot load openai-community/gpt2"
        env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf")}
    r = lab("--device", "cpu", "--tokens", 2, *(["--model", model] if model else []), env=env)
    assert_one_line_error(r, message)
    if case == "offline":
        assert "--model PATH" in r.stderr and "--random-weights" in r.stderr


def test_a_rung_not_yet_run_on_a_gpu_says_so_in_the_summary(unverified_rung):
    """Named with --kernel, a rung declaring lab.unverified runs (no default picks it); its attention row says
    so. The ladder holds no such forward rung now: a copy of v31 that declares it."""
    import lab
    from lm.summary import attention_line
    name = unverified_rung("v31", "v99_unverified")
    assert lab.unverified("reference") is None and lab.unverified("v31_pinned_softmax") is None
    picked = lab.pick_kernel(name, "gpu", dtype="bfloat16")
    assert lab.pick_kernel(None, "gpu", dtype="bfloat16") not in (name, picked)
    why = lab.unverified(picked)
    assert why == lab.unverified(name) == "not yet run on a GPU"
    assert attention_line({"kernel": name, "kernel_unverified": why}) == f"{name} ({why}: lab.unverified)"
    assert attention_line({"kernel": "v31_pinned_softmax", "kernel_unverified": None}) == "v31_pinned_softmax"
