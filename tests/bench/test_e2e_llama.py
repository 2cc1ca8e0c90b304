"""bench.py e2e --model llama-3.2-1b on this machine: the plan (modes x rungs x HF) run end to end with
NumPy standing in for CuPy and a small Llama of the real vocabulary, the prompt ids, the flags, and the
tables and summaries naming the model beside GPT-2 results that name none."""

import dataclasses
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
import llama
from benchmarks import device, e2e, plots, tables
from benchmarks.results import E2E_MODELS, result_path, write_result
from tests.bench.helpers import FIXTURES, e2e_result, fixture_setup, install_stand_ins, run

TINY = llama.LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)  # head size 64, GQA, the real vocabulary


def test_the_models_are_gpt2_and_the_llama_sizes():
    assert list(E2E_MODELS) == ["gpt2", *llama.SIZES]


@pytest.mark.parametrize("size", E2E_MODELS)
def test_each_model_s_family_has_a_prompt_of_ids_in_its_vocabulary(size):
    family = e2e.family_of(size)
    ids = family.prompt_ids
    assert size in family.sizes and len(ids) > 1 and max(ids) < family.sizes[size].vocab_size
    assert ids[:len(family.bos_ids)] == family.bos_ids  # Llama's: <|begin_of_text|> (128000) first
    assert family.bos_ids == ((128000,) if family is llama.FAMILY else ())


def test_the_default_rung_takes_llama_1b_and_others_are_refused_naming_those_that_do():
    config = llama.SIZES["llama-3.2-1b"]
    able = kernels.rungs_for("bfloat16", config.head_size, True, "sm_90")
    assert able and all("gqa" in kernels.load(n).supports and 64 in kernels.load(n).head_sizes() for n in able)
    assert e2e.refusal(kernels.resolve(able[-1]), config, "bfloat16", able) is None
    why = e2e.refusal(kernels.resolve("v01"), config, "bfloat16", able)
    assert why.startswith("does not take grouped-query attention (8 key/value heads for 32 query heads) or bfloat16")
    assert why.endswith(f"; {', '.join(able)} take it")


@pytest.fixture
def llama_stand_in(monkeypatch):
    install_stand_ins(monkeypatch)
    tiny = dataclasses.replace(llama.FAMILY, random_weights=lambda size, *, seed, xp, dtype: llama.random_weights(
        TINY, seed=seed, xp=np, dtype=dtype))
    monkeypatch.setattr(e2e, "family_of", lambda size: tiny)
    monkeypatch.setattr(kernels, "Attend", lambda path: lambda q, k, v: kernels.reference_attention(q, k, v))
    monkeypatch.setattr(kernels, "device_limits", lambda: SimpleNamespace(arch="sm_90"))
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: None)


def test_llama_e2e_end_to_end_with_stand_ins(llama_stand_in, tmp_path, capsys):
    default = kernels.default_rung("bfloat16", TINY.head_size, TINY.kv_heads != TINY.n_head, "sm_90")
    code, out, err = run(["e2e", "--model", "llama-3.2-1b", "--kernels", f"v01,{default}", "--tokens", "3",
                          "--warmup", "2", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("e2e-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["setup"]["model"] == "llama-3.2-1b" and data["dtype"] == "bfloat16" and data["decode"] is None
    assert data["prompt"] == list(llama.FAMILY.prompt_ids) and data["prompt_tokens"] == len(llama.FAMILY.prompt_ids)
    assert data["modes"] == ["no-cache", "kv-cache"]
    # per mode: the reference, the rungs named (v01 refused), HF
    names = [(r["name"], r["mode"]) for r in data["rows"]]
    plan = ["reference", "v01_naive", default, "hf"]
    assert names == [(n, m) for m in ("no-cache", "kv-cache") for n in plan]
    rows = {(r["name"], r["mode"]): r for r in data["rows"]}
    for mode in ("no-cache", "kv-cache"):
        ours = rows[(default, mode)]
        assert ours["status"] == "ok" and len(ours["tokens"]) == 3 and ours["same_tokens_as_reference"] == 3
        assert rows[("v01_naive", mode)]["status"] == "unsupported"
        assert "grouped-query attention" in rows[("v01_naive", mode)]["reason"]
        hf = rows[("hf", mode)]  # no torch here: the row says why, and the run goes on
        assert hf["status"] == "unavailable" and hf["reason"] == "Unavailable: torch is not importable"
    assert "Llama 3.2 1B with random 2-layer, 128-wide Llama (seed 0), bfloat16, greedy" in out
    assert "prompt of token ids 128000,791," in out and "random weights have no tokenizer" in out
    assert f"| `{default}` | kv-cache |" in out


def test_without_rungs_named_every_rung_that_takes_the_model_runs(llama_stand_in):
    able = kernels.rungs_for("bfloat16", TINY.head_size, True, "sm_90")
    impls = e2e.attentions(TINY, "bfloat16", None)
    assert [(name, kind) for name, _, kind, _ in impls] == [("reference", "peer")] + [(n, "rung") for n in able]
    assert all(callable(attend) for *_, attend in impls)


def test_llama_e2e_refuses_a_text_prompt(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    code, _, err = run(["e2e", "--model", "llama-3.2-1b", "--prompt", "Hello", "--results", str(tmp_path)], capsys)
    assert code == 2 and list(tmp_path.iterdir()) == []
    assert err.strip() == ("bench.py: e2e: --prompt is text for a tokenizer; random llama weights have none (the "
                           "prompt is fixed token ids)")


def llama_result(date="2026-01-06T00:00:00Z"):
    """An e2e result as cmd_e2e writes Llama's, both modes, with HF."""
    rows = []
    for mode in ("no-cache", "kv-cache"):
        for name, kind, seconds in [("reference", "peer", 30.0), ("v19_wgmma_overlap", "rung", 20.0), ("hf", "peer", 10.0)]:
            rows.append({"name": name, "label": name if kind == "rung" else name.upper(), "kind": kind, "mode": mode,
                         "kv_cache": mode == "kv-cache", "status": "ok", "seconds": seconds, "tokens": [5, 6],
                         "peak_bytes": 3 * 2**30, "elapsed": [seconds / 2, seconds]})
    e2e.add_generation_comparisons(rows)
    setup = fixture_setup("python3 bench.py e2e --model llama-3.2-1b", date) | {"model": "llama-3.2-1b"}
    return {"schema": 1, "kind": "e2e", "setup": setup, "model": "random llama-3.2-1b (seed 0)",
            "prompt": list(llama.FAMILY.prompt_ids), "prompt_tokens": len(llama.FAMILY.prompt_ids), "new_tokens": 2,
            "sampling": "greedy", "dtype": "bfloat16", "modes": ["no-cache", "kv-cache"],
            "method": {"no-cache": "whole sequence", "kv-cache": "prefill then decode", "hf": "generate, static",
                       "prompt": "ids picked by hand"}, "rows": rows, "decode": None, "plot": None}


def test_e2e_tables_name_the_model():
    text = tables.render_e2e([(Path("/r/e2e.json"), llama_result(), {"no-cache", "kv-cache"})], Path("/"))
    assert "Llama 3.2 1B with random llama-3.2-1b (seed 0), bfloat16, greedy" in text
    assert f"prompt of token ids {','.join(map(str, llama.FAMILY.prompt_ids))} (ids picked by hand)" in text
    old = tables.render_e2e([(Path("/r/e2e.json"), e2e_result(), {"no-cache", "kv-cache"})], Path("/"))
    assert "model" not in e2e_result()["setup"]  # written before Llama: GPT-2 small
    assert f"prompt {e2e.PROMPT!r}; GPT-2 small with random gpt2 (seed 0), float32, greedy" in old


def test_readme_shows_gpt2_and_llama_e2e_side_by_side(tmp_path, capsys):
    readme, doc = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    shutil.copy(FIXTURES / "bench_front.md", readme)
    doc.parent.mkdir()
    shutil.copy(FIXTURES / "bench_results_doc.md", doc)
    results = tmp_path / "results"
    for result in (e2e_result(date="2026-01-01T00:00:00Z"), llama_result()):  # the Llama file is the newest
        write_result(result, result_path("e2e", result["setup"], results))
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results)],
                       capsys)
    assert code == 0, err
    full = re.search(r"bench:e2e:start -->(.*?)<!-- bench:e2e:end", doc.read_text(), re.S)[1]
    # both models' newest files, GPT-2's first: a Llama result does not replace GPT-2's
    assert full.index("GPT-2 small with") < full.index("Llama 3.2 1B with")
    summary = re.search(r"bench:e2e-summary:start -->(.*?)<!-- bench:e2e-summary:end", readme.read_text(), re.S)[1]
    assert "| no cache, float32: seconds for 4 tokens, `v03_fast` | 4.00 | 5.00 | 1.25x | - |" in summary
    assert "| Llama 3.2 1B | this lab | HF transformers | speed-up | results file |" in summary
    link = "[e2e-fixture-gpu-20260106T000000Z.json](results/e2e-fixture-gpu-20260106T000000Z.json)"
    assert f"| no cache, bfloat16: seconds for 2 tokens, `v19_wgmma_overlap` | 20.00 | 10.00 | 0.50x | {link} |" in summary
    assert f"| KV cache, bfloat16: seconds for 2 tokens, `v19_wgmma_overlap` | 20.00 | 10.00 | 0.50x | {link} |" in summary
