"""lab.py with Llama, as a user runs it: a subprocess on the golden fixtures with --device cpu; the
rung checks (head size, grouped-query attention, dtype) that need no GPU; every bad input one line
on stderr and exit 2."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import lab
import llama
from lm.errors import LabError
from tests.test_lab import assert_one_line_error, summary_rows
from tests.test_lab import lab as run_lab
from tests.test_llama import bad_checkpoint, write_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GQA, UNTIED = FIXTURES / "llama-gqa", FIXTURES / "llama-untied"


def golden(name):
    return np.load(FIXTURES / f"{name}-golden.npz")


@pytest.mark.parametrize("kv_cache", [False, True])
def test_runs_a_llama_folder_from_prompt_ids(tmp_path, kv_cache):
    g = golden("llama-gqa")
    out = tmp_path / "run.json"
    ids = ",".join(map(str, g["prompt"]))
    r = run_lab("--device", "cpu", "--model", GQA, "--prompt-ids", ids, "--tokens", 24, "--dtype", "float32",
                "--json", out, *(["--kv-cache"] if kv_cache else []))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["generated_tokens"] == g["greedy"].tolist() and s["prompt_tokens"] == g["prompt"].tolist()
    assert (s["family"], s["kernel"], s["engine"], s["dtype"]) == ("llama", "reference", "eager", "float32")
    assert s["config"]["num_key_value_heads"] == 2 and s["generated_text"] is None and s["prompt"] is None
    assert r.stdout.startswith(ids + "".join(f" {t}" for t in s["generated_tokens"]) + "\n")  # ids in, ids out
    rows = summary_rows(r.stdout)
    assert "token ids" in rows["tokenizer"] and "llama/model.py" in rows["engine"]
    assert r.stderr == ""


def test_bfloat16_is_llama_s_default_and_random_weights_take_a_size(tmp_path):
    out = tmp_path / "run.json"
    r = run_lab("--device", "cpu", "--model", UNTIED, "--prompt-ids", "0,5,9", "--tokens", 2, "--json", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["dtype"] == "bfloat16"
    r = run_lab("--device", "cpu", "--random-weights", "--size", "llama-3.2-1b", "--prompt", "Hi")
    assert_one_line_error(r, "random weights have no tokenizer.model: give the prompt as token ids, --prompt-ids")


def test_stop_at_eos_stops_at_the_config_s_eos_id(tmp_path):
    g = golden("llama-untied")
    greedy = g["greedy"].tolist()
    out = tmp_path / "run.json"
    r = run_lab("--device", "cpu", "--model", UNTIED, "--prompt-ids", ",".join(map(str, g["prompt"])), "--tokens",
                24, "--dtype", "float32", "--stop-at-eos", "--json", out)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["stopped_at_eos"] and s["eos_ids"] == [1] and s["generated_tokens"] == greedy[:greedy.index(1) + 1]
    assert not r.stdout.split("\n")[0].endswith(" 1")  # the end-of-text id is not shown


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    folder = Path(shutil.copytree(GQA, tmp_path_factory.mktemp("tok") / "llama-gqa"))
    write_tokenizer(folder / "tokenizer.model")
    return folder


@pytest.mark.parametrize("chat", [False, True])
def test_text_prompt_through_tokenizer_model(tmp_path, with_tokenizer, chat):
    out = tmp_path / "run.json"
    r = run_lab("--device", "cpu", "--model", with_tokenizer, "--prompt", "hello world", "--tokens", 3,
                "--dtype", "float32", "--json", out, *(["--chat"] if chat else []))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    enc = llama.load_tokenizer(with_tokenizer)
    expected = llama.tokenizer.chat(enc, "hello world") if chat else llama.tokenizer.encode(enc, "hello world")
    assert s["prompt_tokens"] == expected and s["prompt"] == "hello world"
    assert s["generated_text"] == enc.decode(s["generated_tokens"]) and r.stdout.startswith("hello world")


ERRORS = {
    "prompt ids that are not ids": (["--prompt-ids", "1,x"], "expected token ids separated by commas"),
    "prompt ids and a prompt": (["--prompt-ids", "1,2", "--prompt", "hi"], "--prompt-ids is the prompt"),
    "chat without a tokenizer": (["--chat", "--prompt", "hi"], "no tokenizer.model"),
    "id outside the vocabulary": (["--prompt-ids", "0,600", "--tokens", "4"], "token id 600 is outside the model's vocabulary of 512"),
    "context overflow": (["--prompt-ids", "0,1,2", "--tokens", "126"], "3 prompt tokens + --tokens 126 = 129 positions"),
    "profile step": (["--prompt-ids", "0", "--profile-step", "--kv-cache"], "--profile-step needs the GPU"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_exit_2_with_one_line(case):
    args, message = ERRORS[case]
    assert_one_line_error(run_lab("--device", "cpu", "--model", GQA, "--dtype", "float32", *args), message)


def test_chat_is_refused_for_gpt2():
    r = run_lab("--device", "cpu", "--random-weights", "--chat", "--tokens", 1)
    assert_one_line_error(r, "--chat wraps the prompt in Llama 3's instruct format; GPT-2 has none")


@pytest.mark.parametrize("case", ["missing shard", "index naming an absent file", "index misplacing a tensor",
                                  "unknown rope_type", "heads not dividing hidden", "unknown model_type",
                                  "shape disagrees with the config", "untied without lm_head"])
def test_bad_checkpoints_exit_2_with_one_line(tmp_path, case):
    folder, message = bad_checkpoint(tmp_path, case)
    r = run_lab("--device", "cpu", "--model", folder, "--prompt-ids", "0,5", "--tokens", 2)
    assert_one_line_error(r, message)


# --- which rung takes the model: declarations only, no GPU needed -----------------------------

GQA_64 = llama.SIZES["llama-3.2-1b"]  # 32 query heads over 8 key/value heads of 64
GQA_128 = llama.SIZES["llama-3.2-3b"]  # 24 over 8, of 128


def test_a_rung_without_gqa_is_refused_naming_those_with_it():
    with pytest.raises(LabError) as info:
        lab.fit_kernel("v12_o_in_registers", "v12", GQA_64, "float32", "gpu", "sm_90")
    message = str(info.value)
    assert "does not take grouped-query attention (8 key/value heads for 32 query heads)" in message
    assert "v13_fa2_partitioning" in message and "v20_tf32_wgmma" in message and "v12" not in message.split(";")[1]


def test_a_rung_without_the_head_size_is_refused_naming_those_with_it():
    with pytest.raises(LabError) as info:
        lab.fit_kernel("v20_tf32_wgmma", "v20", GQA_128, "float32", "gpu", "sm_90")
    assert "supports head sizes 64; this model's is 128; v13_fa2_partitioning, v14_tf32_mma" in str(info.value)
    with pytest.raises(LabError, match="takes bfloat16, float16, not --dtype float32; .*v13_fa2_partitioning"):
        lab.pick_kernel("v19", "gpu", dtype="float32")


def test_the_default_rung_takes_the_model():
    assert lab.fit_kernel("x", None, GQA_128, "bfloat16", "gpu", "sm_90") == "v40_wide_o_stores"
    assert lab.fit_kernel("x", None, GQA_128, "bfloat16", "gpu", "sm_80") == "v15_bf16_mma"
    assert lab.fit_kernel("x", None, GQA_128, "float32", "gpu", "sm_90") == "v14_tf32_mma"  # v20 has no 128
    assert lab.fit_kernel("x", None, GQA_64, "float32", "gpu", "sm_90") == "v20_tf32_wgmma"
    assert lab.fit_kernel("x", None, GQA_64, "float32", "cpu", None) == "reference"
    assert lab.fit_kernel("v13_fa2_partitioning", "v13", GQA_128, "float32", "gpu", "sm_90") == "v13_fa2_partitioning"
