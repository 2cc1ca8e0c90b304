"""The subcommands on this machine: resources through NVRTC, the GPU gate, and the GPU paths' control flow
with NumPy standing in for CuPy.

No GPU here, so these run kernels/sweep/e2e/features end to end with a stand-in for CuPy made of NumPy
and a host clock for its events, and stand-in rungs: one right, one slightly wrong, one that leaves rows
unwritten, one that refuses the inputs. What they check is the benchmarks' own logic: poisoning, the
gate, what gets timed, the rows, the result file and the tables."""

import dataclasses
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
from benchmarks import cases, device, e2e, features, peers, plots, results, rungs, timing
from benchmarks.cases import FEATURE_FLOP_CONVENTION, Case, Shape, attention_flops, attention_flops_qk
from tests.bench.helpers import RUNGS, FakePyplot, install_stand_ins, run


def test_resources_for_sm90_through_nvrtc_without_a_gpu(tmp_path, capsys):
    code, out, _ = run(["resources", "--arch", "sm_90", "--results", str(tmp_path)], capsys)
    assert code == 0
    (path,) = tmp_path.glob("resources-sm-90-nvrtc-*.json")
    data = json.loads(path.read_text())
    assert data["arch"] == "sm_90" and data["on_device"] is False and data["setup"]["device"] is None
    expected = [(name, c) for name in RUNGS for c in kernels.load(name).configs]
    assert [(r["kernel"], tuple(r["config"].values())) for r in data["rows"]] == expected
    for r in data["rows"]:
        assert 0 < r["registers"] <= 255
        assert r["blocks_per_sm"] is None  # no device to ask
        assert r["dynamic_smem"] == kernels.load(r["kernel"]).shared_bytes(tuple(r["config"].values()))
    assert f"wrote {path}" in out and "| kernel | config | threads | registers |" in out


@pytest.mark.parametrize("command", [["kernels"], ["sweep", "--t-max", "256"], ["e2e", "--tokens", "4"],
                                     ["features", "--parts", "decode"]])
def test_gpu_subcommands_exit_2_with_one_line_without_a_gpu(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(device, "gpu_problem", lambda: "no CUDA device visible")
    code, out, err = run([*command, "--results", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"bench.py: {command[0]}: needs a CUDA GPU, and none is usable here (no CUDA device visible); "
        "run it on the GPU machine"]
    assert out == "" and list(tmp_path.iterdir()) == []


def test_e2e_without_the_model_packages_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "lab", None)  # import lab (and with it gpt2/, llama/) raises ImportError
    code, _, err = run(["e2e", "--results", str(tmp_path)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "needs the model packages gpt2/ and llama/" in err


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """bench.py with NumPy for CuPy, no torch, and four stand-in rung files."""
    install_stand_ins(monkeypatch)
    rung_dir = tmp_path / "rungs"
    rung_dir.mkdir()
    paths = []
    for name in ("v01_good", "v02_noisy", "v03_lazy", "v04_picky"):
        (rung_dir / f"{name}.cu").write_text("// stand-in\n")
        paths.append(str(rung_dir / f"{name}.cu"))
    return paths


def test_bench_shape_checks_before_timing(stand_in, capsys):
    shape = Shape(2, 37, NH=3, d=16)
    method = timing.Method(budget_ms=1.0, min_runs=3, max_runs=3, warmup=1)
    rows = rungs.bench_shape(shape, "float32", [Path(p) for p in stand_in], ["reference", "sdpa_efficient"],
                             flush=timing.no_flush, method=method, ffma_tflops=50.0, seed=0, counter=[0], total=6)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["v01_good", "v02_noisy", "v03_lazy", "v04_picky", "reference",
                                         "sdpa_efficient"]
    good = by["v01_good"]
    assert good["status"] == "ok" and good["timing"]["runs"] == 3 and good["config"] == "stand-in"
    assert good["max_err"] <= good["bound"] == pytest.approx(8 * max(good["plain32_err"], good["bound"] / 8))
    assert good["tflops"] == pytest.approx(good["flops"] / (good["timing"]["median_ms"] * 1e-3) / 1e12)
    assert good["flops"] == attention_flops(2, 3, 37, 16)
    noisy = by["v02_noisy"]
    assert noisy["status"] == "wrong" and "timing" not in noisy
    assert noisy["max_err"] == pytest.approx(1e-3, rel=0.01) and "> bound" in noisy["reason"]
    lazy = by["v03_lazy"]
    assert lazy["status"] == "wrong" and lazy["nonfinite"] == 2 * 3 * (37 - 18) * 16  # the poison stayed
    assert "unwritten" in lazy["reason"] and "timing" not in lazy
    assert by["v04_picky"]["status"] == "unsupported" and "float16 only" in by["v04_picky"]["reason"]
    assert by["reference"]["status"] == "ok" and by["reference"]["kind"] == "peer"
    assert by["sdpa_efficient"]["status"] == "unavailable" and "torch" in by["sdpa_efficient"]["reason"]
    assert good["speedup"]["reference"] == pytest.approx(
        by["reference"]["timing"]["median_ms"] / good["timing"]["median_ms"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 6 and lines[0].startswith("[  1/6]") and "wrong" in lines[1]


def test_kernels_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, capsys):
    code, out, err = run(["kernels", "--kernels", ",".join(stand_in[:2]), "--shape", "1x40", "--shape", "2x17",
                          "--nh", "2", "--d", "8", "--budget-ms", "1", "--results", str(tmp_path / "out")], capsys)
    assert code == 0, err
    (path,) = (tmp_path / "out").glob("kernels-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "kernels" and data["setup"]["device"]["name"] == "Stand-in GPU"
    assert data["setup"]["command"].startswith("python3 bench.py kernels --kernels")
    assert data["shapes"] == [{"B": 1, "T": 40, "NH": 2, "d": 8}, {"B": 2, "T": 17, "NH": 2, "d": 8}]
    assert [(r["name"], r["status"]) for r in data["rows"]][:5] == [
        ("v01_good", "ok"), ("v02_noisy", "wrong"), ("reference", "ok"), ("sdpa_math", "unavailable"),
        ("sdpa_efficient", "unavailable")]
    assert "**B=2, T=17** (NH=2, d=8, float32" in out and f"wrote {path}" in out


def test_sweep_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "_pyplot", FakePyplot)  # a stand-in matplotlib: no file, but the call is made
    saved = []
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: saved.append(path) or path.name)
    code, out, err = run(["sweep", "--kernels", stand_in[0], "--peers", "reference", "--t-min", "16", "--t-max",
                          "64", "--tokens", "128", "--nh", "2", "--d", "8", "--budget-ms", "1", "--results",
                          str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("sweep-*.json")
    data = json.loads(path.read_text())
    assert [(s["B"], s["T"]) for s in data["shapes"]] == [(8, 16), (4, 32), (2, 64)]
    assert data["tokens"] == 128 and data["plot"] == path.with_suffix(".png").name == saved[0].name
    assert all(r["status"] == "ok" for r in data["rows"])
    assert "| T | B | `v01_good` | CuPy reference |" in out


def test_sweep_without_the_mask_counts_every_pair(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "_pyplot", FakePyplot)
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: None)
    code, out, err = run(["sweep", "--noncausal", "--kernels", stand_in[0], "--peers", "reference", "--t-min", "16",
                          "--t-max", "32", "--tokens", "64", "--nh", "2", "--d", "8", "--budget-ms", "1", "--results",
                          str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("sweep-*.json")
    data = json.loads(path.read_text())
    assert data["shapes"] == [{"B": 4, "T": 16, "NH": 2, "d": 8, "causal": False},
                              {"B": 2, "T": 32, "NH": 2, "d": 8, "causal": False}]
    assert data["flop_convention"] == cases.NONCAUSAL_FLOP_CONVENTION
    for r in data["rows"]:
        assert r["status"] == "ok" and r["flops"] == 4 * r["shape"]["B"] * 2 * r["shape"]["T"] ** 2 * 8
    assert "non-causal forward = 4 * B * NH * T^2 * d FLOPs" in out


def test_e2e_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, monkeypatch, capsys):
    import gpt2

    tiny = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=64)  # head size 64, as every rung takes
    family = dataclasses.replace(gpt2.FAMILY, random_weights=lambda size, *, seed, xp, dtype: gpt2.random_weights(
        tiny, seed=seed, xp=np, dtype=dtype))
    monkeypatch.setattr(e2e, "family_of", lambda size: family)
    monkeypatch.setattr(kernels, "Attend", lambda path: lambda q, k, v: kernels.reference_attention(q, k, v))
    monkeypatch.setattr(kernels, "device_limits", lambda: SimpleNamespace(arch="sm_90"))
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: None)
    code, out, err = run(["e2e", "--kernels", "v01", "--tokens", "5", "--warmup", "2", "--no-hf",
                          "--no-decode", "--results", str(tmp_path)], capsys)  # the decode table needs the GPU
    assert code == 0, err
    (path,) = tmp_path.glob("e2e-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["modes"] == ["no-cache", "kv-cache"] and data["prompt"] == e2e.PROMPT and data["decode"] is None
    assert data["prompt_tokens"] == 8  # "Hello, I'm a language model," in GPT-2's BPE
    rows = {(r["name"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {("reference", "no-cache"), ("v01_naive", "no-cache"), ("reference", "kv-cache"),
                         ("v01_naive", "kv-cache")}
    for r in rows.values():
        assert r["status"] == "ok" and len(r["tokens"]) == 5 and len(r["elapsed"]) == 5
        assert r["elapsed"] == sorted(r["elapsed"]) and r["elapsed"][-1] <= r["seconds"]
        assert r["same_tokens_as_reference"] == 5  # the stand-in rung is the reference
    assert "| `v01_naive` | kv-cache |" in out


def fake_prepare_declared(q, k, v, *, kernel, causal=True):
    """kernels.prepare for NumPy arrays: the real rung's declarations decide what it takes (check_layout
    raises what prepare raises), the reference computes the output."""
    kernels.runtime.check_layout(q, k, v, kernels.load(kernel), causal, None)
    out = np.empty(q.shape, dtype=q.dtype)

    def run():
        out[...] = kernels.reference_attention(q, k, v, causal=causal)
        return out

    run.instance = SimpleNamespace(describe=lambda: "stand-in")
    return run


TINY_CASES = {  # the same parts at shapes NumPy checks in a moment
    "decode": [Case("decode", 1, 2, 2, 1, T_k, 32) for T_k in (1, 9)],
    "long": [Case("long", 2, 2, 2, 1, 40, 32)],
    "noncausal": [Case("noncausal", 1, 2, 2, 17, 17, 32, causal=False)],
    "cross": [Case("cross", 1, 2, 2, 5, 23, 32)],
    "gqa": [Case("gqa", 1, 4, 2, 13, 13, 32)],
    "heads": [Case("heads", 1, 2, 2, 11, 11, d) for d in (32, 96)],
}


@pytest.fixture
def features_stand_in(stand_in, monkeypatch):
    """bench.py features with NumPy for CuPy, no torch, real rung declarations and tiny cases; CUPTI and
    the graph replaced by host clocks over the same calls."""
    monkeypatch.setattr(kernels, "prepare", fake_prepare_declared)
    monkeypatch.setattr(features, "FEATURE_CASES", TINY_CASES)

    def kernel_timing(runs, reps=10, name=None):
        records = []
        for _ in range(reps):
            for call in runs:
                start = time.perf_counter()
                call()
                records.append((start * 1e6, (time.perf_counter() - start) * 1e6, "attention_forward"))
        return timing.per_call_us(records, reps * len(runs))

    def graph_us(runs, reps=10):
        start = time.perf_counter()
        for _ in range(reps):
            for call in runs:
                call()
        return (time.perf_counter() - start) * 1e6 / (reps * len(runs))

    monkeypatch.setattr(timing, "kernel_timing", kernel_timing)
    monkeypatch.setattr(timing, "graph_us", graph_us)
    monkeypatch.setattr(timing, "torch_graph_us", graph_us)


def test_features_end_to_end_with_stand_ins(features_stand_in, tmp_path, capsys):
    v12, v13, v16 = (kernels.resolve(n).stem for n in ("v12", "v13", "v16"))
    code, out, err = run(["features", "--kernels", "v12,v13,v16", "--dtypes", "float32", "--caches", "3", "--reps",
                          "2", "--budget-ms", "1", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("features-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    # the JSON: setup, method, ceilings, targets, the plan, and rows that name their case
    assert data["schema"] == results.SCHEMA and data["kind"] == "features"
    assert data["setup"]["device"]["name"] == "Stand-in GPU"
    assert data["setup"]["command"].startswith("python3 bench.py features --kernels v12,v13,v16")
    assert data["flop_convention"] == FEATURE_FLOP_CONVENTION
    assert {"tolerance", "decode", "caches", "reps", "l2_flush"} <= set(data["method"])
    assert data["method"]["caches"] == 3 and data["method"]["reps"] == 2
    assert data["ceilings"]["copy_tbps"] == 3.0
    assert data["targets"] == {"decode_kernel_us": 5.0, "long_pct_copy": 75.0}
    assert data["parts"] == list(features.FEATURE_PARTS) and data["kernels"] == [v12, v13, v16]
    assert data["kernels_named"] is True and data["dtypes"] == ["float32"]
    cases = {c["id"]: c for c in data["cases"]}
    assert [c["part"] for c in data["cases"]] == ["decode", "decode", "long", "long", "long", "noncausal", "cross",
                                                 "gqa", "heads", "heads"]
    assert [c["dtype"] for c in data["cases"] if c["part"] == "long"] == ["bfloat16", "float32", "float16"]
    for c in data["cases"]:
        s = c["shape"]
        assert c["flops"] == attention_flops_qk(s["B"], s["NH"], s["T_q"], s["T_k"], s["d"], s["causal"])
        assert c["peer"] == peers.FEATURE_PEER[c["dtype"]] and c["kernels"] == [v12, v13, v16]
    rows = {(cases[r["case"]]["part"], r["shape"]["T_k"], r["shape"]["d"], r["dtype"], r["name"]): r
            for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == 4 * len(data["cases"])  # three rungs and the peer per case
    for r in data["rows"]:
        assert r["case"] in cases and r["shape"] == cases[r["case"]]["shape"]
        if r["kind"] == "peer":  # no torch here: reported, not fatal
            assert r["status"] == "unavailable" and "torch" in r["reason"]

    def row(part, name, dtype="float32", T_k=None, d=32):
        return next(r for k, r in rows.items() if k[0] == part and k[4] == name and k[3] == dtype
                    and (T_k is None or k[1] == T_k) and k[2] == d)

    # rungs not declaring a feature are reported unsupported, with the launcher's reason, and not timed
    assert row("noncausal", v12)["status"] == "unsupported" and "causal=False" in row("noncausal", v12)["reason"]
    assert row("cross", v12)["status"] == "unsupported" and "query length 5 != key length 23" in row("cross", v12)["reason"]
    assert row("gqa", v12)["status"] == "unsupported" and "key/value heads" in row("gqa", v12)["reason"]
    assert row("heads", v12, d=96)["status"] == "unsupported" and "head sizes" in row("heads", v12, d=96)["reason"]
    assert row("long", v13, "bfloat16")["status"] == "unsupported"
    assert all("timing" not in r and "kernel_us" not in r for r in data["rows"] if r["status"] == "unsupported")
    # those that declare it are checked, then timed
    for part in ("noncausal", "cross", "gqa", "heads"):
        for name in (v13, v16):
            r = row(part, name)
            assert r["status"] == "ok" and r["max_err"] <= r["bound"], r
            assert r["tflops"] == pytest.approx(r["flops"] / (r["timing"]["median_ms"] * 1e-3) / 1e12)
            assert r["flops"] == cases[r["case"]]["flops"] and r["vs_peer"] is None  # the peer could not run
    assert row("heads", v12, d=32)["status"] == "ok"
    # decode: CUPTI kernel time and graph time per call, the target computed from the kernel time
    first = row("decode", v12, T_k=1)
    assert first["status"] == "ok" and first["kernel_timing"]["calls"] == 2 * 3
    assert row("decode", v12, T_k=9)["status"] == "unsupported"
    for T_k in (1, 9):
        r = row("decode", v16, T_k=T_k)
        assert r["status"] == "ok" and r["kernel_us"] > 0 and r["graph_us"] > 0
        assert r["target_met"] == (r["kernel_us"] <= 5.0)
        assert r["kv_bytes"] == 2 * 1 * 2 * T_k * 32 * 4
    # long context: bandwidth of K + V against the copy ceiling of the same run
    for dtype, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        r = row("long", v16, dtype)
        assert r["status"] == "ok" and r["kv_bytes"] == 2 * 2 * 2 * 40 * 32 * size
        assert r["kv_tbps"] == pytest.approx(r["kv_bytes"] / (r["timing"]["median_ms"] * 1e-3) / 1e12)
        assert r["pct_copy"] == pytest.approx(100 * r["kv_tbps"] / 3.0)
        assert r["target_met"] == (r["pct_copy"] >= 75.0)
    # progress lines while running, the tables at the end
    assert "[  1/40] decode float32  T_k     1" in out
    assert "unsupported: ValueError: kernel" in out
    assert "| T_k | kernel | kernel us |" in out and f"wrote {path}" in out


def test_a_rung_not_declaring_a_feature_is_unsupported_not_fatal(features_stand_in, capsys):
    case = Case("gqa", 1, 4, 2, 13, 13, 32)
    method = timing.Method(budget_ms=1.0, min_runs=3, max_runs=3, warmup=1)
    rows = rungs.bench_shape(case, "float32", [kernels.resolve("v12"), kernels.resolve("v13")], ["sdpa_efficient"],
                             flush=timing.no_flush, method=method, ffma_tflops=50.0, seed=0, counter=[0], total=3)
    by = {r["kind"] + ":" + r["name"][:3]: r for r in rows}
    assert by["rung:v12"]["status"] == "unsupported" and "gqa" not in kernels.load("v12").supports
    assert "2 key/value heads for 4 query heads" in by["rung:v12"]["reason"]
    assert by["rung:v13"]["status"] == "ok" and by["rung:v13"]["flops"] == attention_flops(1, 4, 13, 32)
    assert by["peer:sdp"]["status"] == "unavailable"


def test_a_run_writes_into_scratch_by_default_and_into_results_with_save(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(results, "SCRATCH", tmp_path / "results" / "scratch")
    argv = ["kernels", "--kernels", stand_in[0], "--peers", "none", "--shape", "1x16", "--nh", "1", "--d", "8",
            "--budget-ms", "1"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    (path,) = (tmp_path / "results" / "scratch").glob("kernels-*.json")
    assert f"wrote {path} (scratch, git-ignored: --save writes into results/)" in out
    code, out, err = run([*argv, "--save"], capsys)
    assert code == 0, err
    (saved,) = (tmp_path / "results").glob("kernels-*.json")
    assert out.rstrip().endswith(f"wrote {saved}")
