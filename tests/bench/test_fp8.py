"""bench.py fp8: its shapes and targets, the verdict and tables from a synthetic result, its flags, a run
end to end with NumPy stand-ins (the FP8 rung emulated by kernels.fp8), and `bench.py readme` writing its
section into docs/results.md."""

import json
import re
import shutil
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import kernels
from benchmarks import cli, device, results, timing
from benchmarks import fp8 as bench_fp8
from benchmarks.cases import Case, shape_flops
from benchmarks.frontier import FLOPS
from benchmarks.peers import PEERS
from benchmarks.results import result_path, write_result
from benchmarks.tables import fmt_tflops
from benchmarks.timing import Method
from kernels import fp8
from tests.bench.helpers import FIXTURES, cells_of, fake_cupy, fixture_setup, install_stand_ins, run

V22, V24, V25 = (kernels.resolve(n).stem for n in ("v22", "v24", "v25"))


def test_the_shapes_and_targets():
    ids = [bench_fp8.case_id(c) for c in bench_fp8.CASES]
    assert ids[:3] == ["4x16x4096-d128", "2x16x8192-d128", "1x16x16384-d128"]  # 16k tokens, 2048 channels
    assert ids[3:] == ["8x12x1024-d64", "16x12x2048-d64", "6x12x4096-d64", "1x12x8192-d64", "4x16x2048-d64-noncausal"]
    assert [bench_fp8.target_applies(c.as_dict()) for c in bench_fp8.CASES] == [True] * 3 + [False] * 5
    assert [p.stem for p in bench_fp8.fp8_rungs()] == [n for n in kernels.names() if kernels.load(n).fp8]
    assert [p.stem for p in bench_fp8.fp8_rungs()][:4] == [V25, "v26_fp8_persistent", "v27_fp8_row_sums",
                                                           "v28_fp8_bf16_scores"]
    assert [kernels.resolve(n).stem for n in bench_fp8.BF16_RUNGS] == [V22, V24]
    newest = kernels.default_rung("bfloat16", 128)  # the ladder's best at d=128 is measured beside them
    assert [p.stem for p in bench_fp8.bf16_rungs()] == [V22, V24, newest] and newest not in (V22, V24)
    assert (bench_fp8.VS_BF16, bench_fp8.RMSE_TARGET) == (1.5, 1.0e-2)


# --- the verdict and the tables, from a synthetic result ---------------------------------------------


def timed(case: Case, name: str, kind: str, tflops: float, **extra) -> dict:
    flops = shape_flops(case)
    ms = flops / (tflops * 1e12) * 1e3
    return {"shape": case.as_dict(), "dtype": "bfloat16", "name": name, "kind": kind, "status": "ok",
            "label": PEERS[name].label if kind == "peer" else name, "flops": flops, "case": bench_fp8.case_id(case),
            "config": "d_head=128" if kind == "rung" else "",
            "timing": {"median_ms": ms, "p20_ms": ms * 0.99, "p80_ms": ms * 1.01, "min_ms": ms, "max_ms": ms, "runs": 9},
            "tflops": tflops} | extra


def fp8_result() -> dict:
    """Three cases: met (d=128, 4096: 900 against 580), missed (d=128, 16384: 800 against 620), not judged
    (d=64: 500 against 420, and the FP8 rung wrong at the non-causal one); two accuracy rows, one met."""
    met, missed, small = Case("causal", 4, 16, 16, 4096, 4096, 128), Case("causal", 1, 16, 16, 16384, 16384, 128), \
        Case("causal", 8, 12, 12, 1024, 1024, 64)
    wrong = Case("noncausal", 4, 16, 16, 2048, 2048, 64, causal=False)
    rows = [timed(met, V25, "rung", 900.0, fp8=True, rmse=3e-3, ref_rms=6e-2), timed(met, V22, "rung", 580.0),
            timed(met, V24, "rung", 560.0), timed(met, "sdpa_flash", "peer", 330.0), timed(met, "sdpa_cudnn", "peer", 560.0),
            timed(missed, V25, "rung", 800.0, fp8=True, rmse=2e-3, ref_rms=4e-2), timed(missed, V22, "rung", 620.0),
            timed(missed, V24, "rung", 600.0), timed(missed, "sdpa_flash", "peer", 320.0),
            {"shape": missed.as_dict(), "dtype": "bfloat16", "name": "sdpa_cudnn", "label": "SDPA cuDNN", "kind": "peer",
             "status": "unavailable", "reason": "RuntimeError: No available kernel", "case": bench_fp8.case_id(missed)},
            timed(small, V25, "rung", 500.0, fp8=True, rmse=5e-3, ref_rms=1e-1), timed(small, V22, "rung", 300.0),
            timed(small, V24, "rung", 420.0), timed(small, "sdpa_flash", "peer", 160.0),
            timed(small, "sdpa_cudnn", "peer", 260.0),
            {"shape": wrong.as_dict(), "dtype": "bfloat16", "name": V25, "label": V25, "kind": "rung", "fp8": True,
             "status": "wrong", "rmse": 0.5, "ref_rms": 0.05, "case": bench_fp8.case_id(wrong),
             "reason": "RMSE 5.00e-01 > 0.15 x the reference's RMS 5.00e-02"},
            timed(wrong, V22, "rung", 330.0), timed(wrong, V24, "rung", 400.0)]
    cases = [{"id": bench_fp8.case_id(c), "shape": c.as_dict(), "flops": shape_flops(c)} for c in (met, missed, small, wrong)]
    for case in cases:
        case["verdict"] = bench_fp8.verdict(case, [r for r in rows if r["case"] == case["id"]])
    accuracy = [{"shape": {"B": 1, "NH": 8, "T": 1024, "d": 128}, "name": V25, "status": "ok", "rmse": 9.5e-3,
                 "rmse_emulated": 9.4e-3, "rmse_per_tensor": 1.5e-2, "met": True},
                {"shape": {"B": 1, "NH": 8, "T": 1024, "d": 64}, "name": V25, "status": "ok", "rmse": 1.36e-2,
                 "rmse_emulated": 1.35e-2, "rmse_per_tensor": 2.2e-2, "met": False}]
    return {"schema": results.SCHEMA, "kind": "fp8", "setup": fixture_setup("python3 bench.py fp8"),
            "flop_convention": FLOPS, "method": Method(budget_ms=300).describe(100 * 2**20),
            "ceilings": {"ffma_tflops": 50.0, "ffma_what": "fixture", "bf16_tflops": 800.0, "bf16_what": "fixture"},
            "dtype": "bfloat16", "fp8_kernels": [V25], "bf16_kernels": [V22, V24], "peers": ["sdpa_flash", "sdpa_cudnn"],
            "targets": {"vs_bf16": 1.5, "d": 128, "from_T": 4096, "gate": 0.15}, "cases": cases, "seed": 0,
            "rows": rows, "accuracy": {"target": 1e-2, "seed": 0, "causal": True, "rows": accuracy}}


def test_the_verdict_of_each_case():
    got = {case["id"]: case["verdict"] for case in fp8_result()["cases"]}
    met, missed, small, wrong = got.values()
    assert met == {"fp8": V25, "fp8_tflops": 900.0, "best_bf16": V22, "best_bf16_tflops": 580.0,
                   "vs_best_bf16": pytest.approx(900 / 580), "met": True}
    assert missed["best_bf16"] == V22 and missed["vs_best_bf16"] == pytest.approx(800 / 620) and missed["met"] is False
    assert small["best_bf16"] == V24 and small["vs_best_bf16"] == pytest.approx(500 / 420) and small["met"] is None
    assert wrong["fp8"] is None and wrong["vs_best_bf16"] is None and wrong["met"] is None
    case = fp8_result()["cases"][0]  # the FP8 rung wrong where the target applies: missed; no bfloat16 rung: not judged
    rows = [r | {"status": "wrong"} if r.get("fp8") else r for r in fp8_result()["rows"] if r["case"] == case["id"]]
    assert bench_fp8.verdict(case, rows)["met"] is False
    assert bench_fp8.verdict(case, [r for r in rows if r["kind"] == "peer"])["met"] is None


def test_the_tables_mark_the_targets_and_the_accuracy():
    text = bench_fp8.render_fp8(fp8_result())
    assert "Fixture GPU" in text and "Command: `python3 bench.py fp8`" in text
    assert "Target: the FP8 rung at least 1.5x the best bfloat16 rung" in text and "at d=128, T >= 4096, causal" in text
    header = (f"| shape | `{V25}` | `{V22}` | `{V24}` | SDPA flash | SDPA cuDNN | best bfloat16 rung | FP8 vs best bfloat16 "
              "| >= 1.5x best bfloat16 |")
    assert header in text
    rows = {cells_of(line)[0]: cells_of(line) for line in text.splitlines()
            if line.count("|") == header.count("|") and re.match(r"\| \d+x\d+x\d+, d\d+", line)}
    assert rows["4x16x4096, d128, causal"] == ["4x16x4096, d128, causal", "900.0", "580.0", "560.0", "330.0", "560.0",
                                               f"`{V22}`", "1.55x", "met"]
    assert rows["1x16x16384, d128, causal"][5:] == ["unavailable", f"`{V22}`", "1.29x", "**missed**"]
    assert rows["8x12x1024, d64, causal"][6:] == [f"`{V24}`", "1.19x", "-"]
    assert rows["4x16x2048, d64, non-causal"][1] == "wrong" and rows["4x16x2048, d64, non-causal"][6:] == [f"`{V24}`", "-", "-"]
    assert "Targets met: 1 of 2." in text
    detail = [c for c in (cells_of(line) for line in text.splitlines() if line.startswith("| ")) if len(c) == 8
              and c[1] == f"`{V25}`"]  # the FP8 rung per shape
    assert detail[0][:2] == ["4x16x4096, d128, causal", f"`{V25}`"] and detail[0][4:7] == ["900.0", "3.0e-03", "6.0e-02"]
    assert detail[3][2] == "**wrong**" and detail[3][5] == "5.0e-01"
    assert "| 1x8x1024, d128 | `v25_fp8` | 9.50e-03 | 9.40e-03 | 1.50e-02 | 1.58x | met |" in text
    assert "| 1x8x1024, d64 | `v25_fp8` | 1.36e-02 | 1.35e-02 | 2.20e-02 | 1.62x | **missed** |" in text
    assert fmt_tflops(500.0) in rows["8x12x1024, d64, causal"]


# --- the command line --------------------------------------------------------------------------------


def test_fp8_flags_and_defaults(monkeypatch, capsys):
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "fp8", lambda args: seen.append(args) or 0)
    code, out, _ = run(["fp8", "--help"], capsys)
    assert code == 0 and ">= 1.5x the best bfloat16 rung" in out and "--kernels" in out
    assert run(["fp8"], capsys)[0] == 0
    args = seen.pop()
    assert args.kernels is None and (args.budget_ms, args.seed, args.results) == (300.0, 0, results.SCRATCH)
    assert run(["fp8", "--kernels", "v25", "--budget-ms", "50", "--seed", "2", "--save"], capsys)[0] == 0
    args = seen.pop()
    assert [p.stem for p in args.kernels] == [V25] and (args.budget_ms, args.seed, args.results) == (50.0, 2, results.RESULTS)


def test_a_bfloat16_rung_named_as_fp8_exits_2(monkeypatch, tmp_path, capsys):
    install_stand_ins(monkeypatch)
    code, _, err = run(["fp8", "--kernels", "v24", "--results", str(tmp_path)], capsys)
    assert code == 2 and "v24_persistent do not declare lab.fp8" in err and list(tmp_path.iterdir()) == []


# --- end to end, with NumPy for CuPy, the reference for the bfloat16 rungs and the emulation for FP8 ---


def prepare_stand_in(q, k, v, *, kernel, causal=True):
    """kernels.prepare on NumPy bfloat16: a bfloat16 rung computes the float32 reference, an FP8 rung its
    emulation on inputs quantized with its first configuration's tiles; rounded to bfloat16."""
    rung = kernels.load(kernel)
    kernels.runtime.check_layout(q, k, v, rung, causal, None)
    out = np.empty(q.shape, dtype=q.dtype)

    def launch():
        if rung.fp8:
            tiles = rung.params(rung.configs_for(q.shape[3])[0])
            o = fp8.emulated_attention(kernels.quantize_fp8(q, k, v, block_q=tiles["B_r"], block_k=tiles["B_c"]),
                                       causal=causal)
        else:
            o = kernels.reference_attention(*(x.astype(np.float32) for x in (q, k, v)), causal=causal)
        out[...] = o.astype(q.dtype)
        return out

    launch.instance = SimpleNamespace(describe=lambda: "stand-in")
    return launch


def test_fp8_end_to_end_with_stand_ins(monkeypatch, tmp_path, capsys):
    install_stand_ins(monkeypatch)
    monkeypatch.setattr(device, "get_cupy", lambda: SimpleNamespace(**vars(fake_cupy()), asarray=np.asarray))
    monkeypatch.setattr(kernels, "prepare", prepare_stand_in)
    monkeypatch.setattr(kernels, "attention_fp8", lambda inputs, kernel, causal=True:
                        fp8.emulated_attention(inputs, causal=causal).astype(ml_dtypes.bfloat16))
    monkeypatch.setattr(bench_fp8, "CASES", (Case("causal", 1, 2, 2, 40, 40, 128), Case("causal", 1, 2, 2, 33, 33, 64),
                                             Case("noncausal", 2, 2, 2, 17, 17, 64, causal=False)))
    monkeypatch.setattr(bench_fp8, "VS_BF16_FROM_T", 32)
    monkeypatch.setattr(bench_fp8, "ACCURACY_SHAPES", ((1, 2, 64, 64), (1, 2, 64, 128)))
    code, out, err = run(["fp8", "--kernels", "v25", "--budget-ms", "1", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("fp8-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "fp8" and data["fp8_kernels"] == [V25] and data["bf16_kernels"] == [V22, V24, kernels.default_rung("bfloat16", 128)]
    assert [c["id"] for c in data["cases"]] == ["1x2x40-d128", "1x2x33-d64", "2x2x17-d64-noncausal"]
    by = {(r["case"], r["name"]): r for r in data["rows"]}
    assert len(by) == len(data["rows"]) == 3 * 6  # the FP8 rung, three bfloat16 rungs, two peers per case
    for case in data["cases"]:
        ours = by[(case["id"], V25)]
        assert ours["status"] == "ok" and ours["fp8"] and ours["rmse"] <= 0.15 * ours["ref_rms"]
        assert 0.01 * ours["ref_rms"] < ours["rmse"]  # FP8's own error, not a bfloat16 rung's
        assert ours["tflops"] == pytest.approx(case["flops"] / (ours["timing"]["median_ms"] * 1e-3) / 1e12)
        for name in (V22, V24, kernels.default_rung("bfloat16", 128)):
            row = by[(case["id"], name)]
            if case["shape"]["d"] in kernels.load(name).head_sizes():
                assert row["status"] == "ok" and row["math"] == "bf16"
            else:  # the d = 128 default need not take d = 64 (v40 does not): told, not dropped
                assert row["status"] == "unsupported" and "head size" in row["reason"]
        assert all(by[(case["id"], p)]["status"] == "unavailable" for p in ("sdpa_flash", "sdpa_cudnn"))  # no torch
        v = case["verdict"]
        assert v["fp8"] == V25 and v["best_bf16"] in (V22, V24, kernels.default_rung("bfloat16", 128))
        assert (v["met"] is None) == (case["id"] != "1x2x40-d128")
    accuracy = data["accuracy"]["rows"]
    assert [(r["shape"]["d"], r["status"]) for r in accuracy] == [(64, "ok"), (128, "ok")]
    for r in accuracy:  # the stand-in kernel is the emulation: the same RMSE; one scale per tensor is worse
        assert r["rmse"] == pytest.approx(r["rmse_emulated"], rel=0.02) and r["rmse_per_tensor"] > r["rmse"]
        assert r["met"] == (r["rmse"] <= 1e-2)
    assert "| shape |" in out and "Targets met:" in out and f"wrote {path}" in out


def test_fp8_interleave_times_the_fp8_rungs_together_and_the_bfloat16_rungs_together(monkeypatch, tmp_path, capsys):
    install_stand_ins(monkeypatch)
    monkeypatch.setattr(device, "get_cupy", lambda: SimpleNamespace(**vars(fake_cupy()), asarray=np.asarray))
    monkeypatch.setattr(kernels, "prepare", prepare_stand_in)
    monkeypatch.setattr(bench_fp8, "CASES", (Case("causal", 1, 2, 2, 40, 40, 128),))
    monkeypatch.setattr(bench_fp8, "ACCURACY_SHAPES", ())
    monkeypatch.setattr(timing, "Method", lambda budget_ms: Method(budget_ms=budget_ms, min_runs=3, max_runs=3, warmup=1))
    sizes, together = [], timing.time_interleaved
    monkeypatch.setattr(timing, "time_interleaved", lambda entries, **kw: sizes.append(len(entries)) or together(entries, **kw))
    code, out, err = run(["fp8", "--kernels", "v25,v26", "--interleave", "--budget-ms", "1", "--results", str(tmp_path)],
                         capsys)
    assert code == 0, err
    data = json.loads(next(tmp_path.glob("fp8-*.json")).read_text())
    assert sizes == [3, 2] and "rotated" in data["method"]["interleave"]  # v22, v24 and the newest, then v25 and v26
    timed = [r for r in data["rows"] if r["kind"] == "rung"]
    assert {r["name"] for r in timed} == {V22, V24, kernels.default_rung("bfloat16", 128), V25, kernels.resolve("v26").stem}
    assert all(r["status"] == "ok" and len(r["timing"]["round_ms"]) == 3 for r in timed)


# --- bench.py readme: the fp8 section ----------------------------------------------------------------


def test_readme_writes_the_fp8_section(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    doc.write_text((FIXTURES / "bench_results_doc.md").read_text().replace(
        "The end of the page.", "<!-- bench:fp8:start -->\nNot measured yet.\n<!-- bench:fp8:end -->\n\nThe end of the page."))
    found = tmp_path / "results"
    older = fp8_result()
    older["setup"] |= {"date": "2025-12-01T00:00:00Z"}
    older["setup"]["device"] = dict(older["setup"]["device"], name="Older GPU")
    for result in (older, fp8_result()):
        write_result(result, result_path("fp8", result["setup"], found))
    code, out, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(found)], capsys)
    assert code == 0, err
    block = re.search(r"<!-- bench:fp8:start -->(.*?)<!-- bench:fp8:end -->", doc.read_text(), re.S)[1]
    newest = "fp8-fixture-gpu-20260102T030405Z.json"
    assert f"from `../results/{newest}`" in block and f"Results file: [{newest}](../results/{newest})." in block
    assert "Not measured yet" not in block and "Older GPU" not in block and "Targets met: 1 of 2." in block
    assert "**Accuracy** on N(0,1) + N(0,100) x Bernoulli(0.001)" in block


def test_the_fp8_detail_shows_the_clock_where_it_was_read():
    result = fp8_result()
    assert "SM MHz" not in bench_fp8.render_fp8(result)
    first = next(r for r in result["rows"] if r.get("fp8") and r["status"] == "ok")
    first["timing"]["sm_clock"] = {"median_mhz": 1845.0, "min_mhz": 1800, "max_mhz": 1980, "samples": 60}
    text = bench_fp8.render_fp8(result)
    assert "| shape | kernel | ms | p20-p80 | TFLOP/s | SM MHz | RMSE | reference RMS | note |" in text
    detail = text.split("| shape | kernel | ms | p20-p80 | TFLOP/s | SM MHz |", 1)[1].split("\n\n", 1)[0]
    clocked_rows = [cells_of(line) for line in detail.splitlines()[2:]]  # the FP8 rung per shape
    assert clocked_rows[0][5] == "1,845" and all(c[5] == "-" for c in clocked_rows[1:])
