"""bench.py frontier: its plan (shapes, rungs, peers), its verdict and table from a synthetic result, its
flags, a run end to end with stand-ins, and `bench.py readme` writing its section and the README's line."""

import json
import re
import shutil

import numpy as np
import pytest

import kernels
from benchmarks import ceilings, cli, frontier, results, rungs, timing
from benchmarks.cases import Case, attention_flops, shape_flops
from benchmarks.peers import PEERS
from benchmarks.results import result_path, write_result
from benchmarks.tables import fmt_tflops
from benchmarks.timing import Method
from tests.bench.helpers import FIXTURES, cells_of, fixture_setup, install_stand_ins, kernels_result, run, table_rows

V19, V21, V22, V23, V24 = (kernels.resolve(n).stem for n in ("v19", "v21", "v22", "v23", "v24"))


# --- the plan --------------------------------------------------------------------------------------


def test_the_shapes_are_the_issues_table_in_bfloat16():
    assert frontier.case_ids() == ["8x12x1024-d64", "16x12x2048-d64", "6x12x4096-d64", "1x12x8192-d64",
                                   "2x32x4096-d128", "2x32x4096-d128-gqa8", "1x16x16384-d128",
                                   "4x16x2048-d64-noncausal", "4x16x4096-d128-noncausal"]
    assert [frontier.case_title(c.as_dict()) for c in frontier.CASES[4:]] == [
        "2x32x4096, d128, causal", "2x32x4096, d128, causal, GQA 8 KV heads", "1x16x16384, d128, causal",
        "4x16x2048, d64, non-causal", "4x16x4096, d128, non-causal"]
    assert frontier.DTYPE == "bfloat16" and frontier.PEER_NAMES == ("sdpa_flash", "sdpa_cudnn")
    for case in frontier.CASES:  # 4 * B * NH * T^2 * d, halved for causal; every query head counts
        full = 4 * case.B * case.NH * case.T_q**2 * case.d
        assert shape_flops(case) == (full // 2 if case.causal else full)
    assert "halves" in frontier.FLOPS and "non-causal: 4 * B * NH * T^2 * d" in frontier.FLOPS


def test_default_rungs_are_the_tma_rungs_and_their_baseline():
    """v19 (the newest bfloat16 rung before TMA) and every rung that loads through TMA (v21 on) but the
    FP8 rungs, which have a table of their own."""
    chosen = [p.stem for p in frontier.default_rungs()]
    assert chosen[:5] == [V19, V21, V22, V23, V24]
    assert chosen[1:] == [n for n in kernels.names() if kernels.load(n).tma and not kernels.load(n).fp8]
    assert all("bfloat16" in kernels.load(n).dtypes and not kernels.load(n).split_kv for n in chosen)


def test_the_plan_runs_declared_rungs_by_default_and_named_rungs_everywhere():
    candidates = [kernels.resolve(n) for n in ("v13", "v15", "v19")]
    plan = frontier.frontier_plan(frontier.case_ids(), candidates, named=False)
    assert [e["id"] for e in plan] == frontier.case_ids()
    for e in plan:  # v13 takes float32 only; v15 and v19 take bfloat16 at d=64 and 128, non-causal and GQA
        assert e["rungs"] == [kernels.resolve("v15"), kernels.resolve("v19")]
        assert all(frontier.declares(kernels.load(p), e["case"], "bfloat16") for p in e["rungs"])
    named = frontier.frontier_plan(["4x16x2048-d64-noncausal", "8x12x1024-d64"], candidates, named=True)
    assert [e["id"] for e in named] == ["8x12x1024-d64", "4x16x2048-d64-noncausal"]  # table order
    assert all(e["rungs"] == candidates for e in named)


# --- the verdict and the table, from a synthetic result ----------------------------------------------


def timed(case: Case, name: str, kind: str, ms: float, **extra) -> dict:
    flops = shape_flops(case)
    return {"shape": case.as_dict(), "dtype": "bfloat16", "name": name, "kind": kind, "status": "ok",
            "label": PEERS[name].label if kind == "peer" else name, "flops": flops, "max_err": 4e-3, "bound": 2e-2,
            "config": "d_head=64" if kind == "rung" else "",
            "timing": {"median_ms": ms, "p20_ms": ms * 0.99, "p80_ms": ms * 1.01, "min_ms": ms, "max_ms": ms, "runs": 9},
            "tflops": flops / (ms * 1e-3) / 1e12} | extra


def ms_for(case: Case, tflops: float) -> float:
    return shape_flops(case) / (tflops * 1e12) * 1e3


def frontier_result() -> dict:
    """Four cases: one met (8x1024), one missed (GQA, v24 wrong there, cuDNN through enable_gqa), the long
    one with cuDNN unavailable (its speed-up not judged; 620 TFLOP/s meets 600), one below T = 1024 (no
    speed-up target)."""
    short = Case("causal", 8, 12, 12, 1024, 1024, 64)
    gqa = Case("gqa", 2, 32, 8, 4096, 4096, 128)
    long = Case("causal", 1, 16, 16, 16384, 16384, 128)
    small = Case("noncausal", 4, 16, 16, 512, 512, 64, causal=False)
    rows = {}
    rows["short"] = [timed(short, V19, "rung", 1.0), timed(short, V24, "rung", 0.8),
                     timed(short, "sdpa_flash", "peer", 1.5), timed(short, "sdpa_cudnn", "peer", 1.0)]
    rows["gqa"] = [timed(gqa, V19, "rung", 2.0),
                   {"shape": gqa.as_dict(), "dtype": "bfloat16", "name": V24, "label": V24, "kind": "rung",
                    "status": "wrong", "max_err": 0.5, "bound": 2e-2, "reason": "max error 5.00e-01 > bound 2.00e-02"},
                   timed(gqa, "sdpa_flash", "peer", 3.0, note="enable_gqa=True"),
                   timed(gqa, "sdpa_cudnn", "peer", 1.9, note="enable_gqa=True")]
    rows["long"] = [timed(long, V19, "rung", ms_for(long, 500.0)), timed(long, V24, "rung", ms_for(long, 620.0)),
                    timed(long, "sdpa_flash", "peer", ms_for(long, 320.0)),
                    {"shape": long.as_dict(), "dtype": "bfloat16", "name": "sdpa_cudnn", "label": "SDPA cuDNN",
                     "kind": "peer", "status": "unavailable", "reason": "RuntimeError: No available kernel"}]
    rows["small"] = [timed(small, V19, "rung", 0.1), timed(small, V24, "rung", 0.2),
                     timed(small, "sdpa_flash", "peer", 0.1), timed(small, "sdpa_cudnn", "peer", 0.05)]
    cases, all_rows = [], []
    for key, case in (("short", short), ("gqa", gqa), ("long", long), ("small", small)):
        rungs.add_speedups(rows[key])
        for r in rows[key]:
            r["case"] = frontier.case_id(case)
        all_rows += rows[key]
        cases.append({"id": frontier.case_id(case), "shape": case.as_dict(), "kernels": [V19, V24],
                      "flops": shape_flops(case)})
    ceiling = {"ffma_tflops": 50.0, "ffma_what": "fixture", "bf16_tflops": 800.0, "bf16_what": "fixture GEMM",
               "copy_tbps": 4.0, "copy_what": "fixture"}
    ceilings.annotate(all_rows, ceiling, [])
    return {"schema": results.SCHEMA, "kind": "frontier", "setup": fixture_setup("python3 bench.py frontier"),
            "flop_convention": frontier.FLOPS, "method": Method(budget_ms=300).describe(100 * 2**20),
            "ceilings": ceiling, "dtype": "bfloat16", "kernels": [V19, V24], "kernels_named": False,
            "peers": ["sdpa_flash", "sdpa_cudnn"], "compare_to": ["sdpa_flash", "sdpa_cudnn"],
            "targets": {"vs_cudnn": 1.1, "vs_cudnn_from_T": 1024, "tflops": {"1x16x16384-d128": 600.0}},
            "cases": cases, "seed": 0, "rows": all_rows}


def test_the_verdict_of_each_case():
    got = {case["id"]: v for case, _, v in frontier.verdicts(frontier_result())}
    short, gqa, long, small = (got[k] for k in ("8x12x1024-d64", "2x32x4096-d128-gqa8", "1x16x16384-d128",
                                                  "4x16x512-d64-noncausal"))
    assert short["best"] == V24 and short["vs_cudnn"] == pytest.approx(1.25) and short["vs_cudnn_met"] is True
    assert gqa["best"] == V19 and gqa["vs_cudnn"] == pytest.approx(0.95) and gqa["vs_cudnn_met"] is False
    assert long["best"] == V24 and long["best_tflops"] == pytest.approx(620.0)
    assert long["vs_cudnn"] is None and long["vs_cudnn_met"] is None  # cuDNN did not run: not judged
    assert long["tflops_target"] == 600.0 and long["tflops_met"] is True
    assert small["vs_cudnn"] == pytest.approx(0.5) and small["vs_cudnn_met"] is None  # T < 1024: no target
    assert short["tflops_target"] is None and short["tflops_met"] is None
    # the 600 TFLOP/s target missed, and no rung correct at all
    case = {"id": "1x16x16384-d128", "shape": Case("causal", 1, 16, 16, 16384, 16384, 128).as_dict()}
    result = frontier_result()
    slow = [r for r in result["rows"] if r["case"] == "1x16x16384-d128" and r["name"] != V24]
    assert frontier.verdict(case, slow, result["targets"])["tflops_met"] is False
    none = [r | {"status": "wrong"} if r["kind"] == "rung" else r for r in slow]
    v = frontier.verdict(case, none, result["targets"])
    assert v["best"] is None and v["tflops_met"] is False


def test_the_table_marks_each_target_met_or_missed():
    text = frontier.render_frontier(frontier_result())
    assert "Fixture GPU" in text and "Command: `python3 bench.py frontier`" in text
    assert "FLOPs: causal: 4 * B * NH * T^2 * d / 2" in text and "bf16 tensor 800.0 TFLOP/s" in text
    assert ("Targets: the best rung at least 1.1x SDPA cuDNN (cuDNN's time over the rung's) at every shape with "
            "T >= 1024; at least 600 TFLOP/s at 1x16x16384-d128.") in text
    header = f"| shape | `{V19}` | `{V24}` | SDPA flash | SDPA cuDNN | best rung | vs SDPA cuDNN | >= 1.1x cuDNN | >= 600 TFLOP/s |"
    assert header in text
    rows = {cells_of(line)[0]: cells_of(line) for line in text.splitlines()
            if re.match(r"\| \d+x\d+x\d+, d\d+", line) and line.count("|") == header.count("|")}
    short = Case("causal", 8, 12, 12, 1024, 1024, 64)
    tflops = [fmt_tflops(shape_flops(short) / (ms * 1e-3) / 1e12) for ms in (1.0, 0.8, 1.5, 1.0)]
    assert rows["8x12x1024, d64, causal"] == ["8x12x1024, d64, causal", *tflops, f"`{V24}`", "1.25x", "met", "-"]
    assert rows["2x32x4096, d128, causal, GQA 8 KV heads"][2] == "wrong"
    assert rows["2x32x4096, d128, causal, GQA 8 KV heads"][5:] == [f"`{V19}`", "0.95x", "**missed**", "-"]
    assert rows["1x16x16384, d128, causal"][4:] == ["unavailable", f"`{V24}`", "-", "n/a", "met"]
    assert rows["4x16x512, d64, non-causal"][5:] == [f"`{V19}`", "0.50x", "-", "-"]
    assert "Targets met: 2 of 3." in text  # 8x1024 and 600 TFLOP/s met; GQA missed; cuDNN absent: not judged
    assert "SDPA cuDNN at 2x32x4096, d128, causal, GQA 8 KV heads: enable_gqa=True." in text  # how GQA ran
    # each case in full, as `kernels` prints it: ms, spread, % of the bf16 ceiling, max error
    assert "**1x16x16384, d128, causal** (" in text
    assert len(table_rows(text, f"`{V24}`")) == 4
    assert f"| `{V24}` | 0.8000 | 0.7920-0.8080 |" in text


# --- the command line --------------------------------------------------------------------------------


def test_frontier_flags_and_defaults(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "frontier", lambda args: seen.append(args) or 0)
    code, out, _ = run(["frontier", "--help"], capsys)
    assert code == 0 and "--shapes" in out and "1x16x16384-d128" in out and ">= 1.1x cuDNN" in out
    assert run(["frontier"], capsys)[0] == 0
    args = seen.pop()
    assert args.kernels is None and args.shapes is None  # cmd_frontier: the default rungs, every shape
    assert (args.budget_ms, args.seed, args.results) == (300.0, 0, results.SCRATCH)
    argv = ["frontier", "--kernels", "v24,v19", "--shapes", "1x16x16384-d128,8x12x1024-d64,8x12x1024-d64",
            "--budget-ms", "50", "--seed", "3", "--save"]
    assert run(argv, capsys)[0] == 0
    args = seen.pop()
    assert [p.stem for p in args.kernels] == [V24, V19]
    assert args.shapes == ["1x16x16384-d128", "8x12x1024-d64"] and (args.budget_ms, args.seed) == (50.0, 3)
    assert args.results == results.RESULTS and args.argv == argv
    assert run(["frontier", "--shapes", "all", "--results", str(tmp_path)], capsys)[0] == 0
    assert seen.pop().shapes == frontier.case_ids()


@pytest.mark.parametrize("argv,message", [
    (["frontier", "--shapes", "8x12x1024"], "unknown shape(s) 8x12x1024: choose from 8x12x1024-d64, "),
    (["frontier", "--shapes", ","], "unknown shape(s)"),
    (["frontier", "--kernels", "v99"], "unknown kernel 'v99'"),
    (["frontier", "--save", "--results", "x"], "not allowed with"),
])
def test_bad_frontier_arguments_exit_2_with_a_message(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


def test_frontier_without_a_gpu_exits_2(monkeypatch, tmp_path, capsys):
    from benchmarks import device

    monkeypatch.setattr(device, "gpu_problem", lambda: "no CUDA device visible")
    code, out, err = run(["frontier", "--results", str(tmp_path)], capsys)
    assert code == 2 and out == "" and list(tmp_path.iterdir()) == []
    assert err.strip() == ("bench.py: frontier: needs a CUDA GPU, and none is usable here (no CUDA device visible); "
                           "run it on the GPU machine")


# --- end to end, with NumPy for CuPy and the reference for the rungs ----------------------------------


def prepare_by_declaration(q, k, v, *, kernel, causal=True):
    """kernels.prepare on NumPy bfloat16: the rung's declarations decide what it takes, the float32
    reference computes the output (rounded to bfloat16, as a rung stores it)."""
    kernels.runtime.check_layout(q, k, v, kernels.load(kernel), causal, None)
    out = np.empty(q.shape, dtype=q.dtype)

    def launch():
        ref = kernels.reference_attention(*(x.astype(np.float32) for x in (q, k, v)), causal=causal)
        out[...] = ref.astype(q.dtype)
        return out

    launch.instance = type("Instance", (), {"describe": lambda self: "stand-in"})()
    return launch


def test_frontier_end_to_end_with_stand_ins(monkeypatch, tmp_path, capsys):
    install_stand_ins(monkeypatch)
    monkeypatch.setattr(kernels, "prepare", prepare_by_declaration)
    tiny = (Case("causal", 1, 2, 2, 33, 33, 64), Case("gqa", 1, 4, 2, 20, 20, 128),
            Case("noncausal", 2, 2, 2, 17, 17, 64, causal=False))
    monkeypatch.setattr(frontier, "CASES", tiny)
    monkeypatch.setattr(frontier, "VS_CUDNN_FROM_T", 16)
    monkeypatch.setattr(frontier, "TFLOPS_TARGETS", {"1x4x20-d128-gqa2": 1e9})  # out of any stand-in's reach
    code, out, err = run(["frontier", "--kernels", "v13,v19,v24", "--budget-ms", "1", "--results", str(tmp_path)],
                         capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("frontier-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "frontier" and data["dtype"] == "bfloat16" and data["kernels_named"] is True
    assert data["kernels"] == [kernels.resolve("v13").stem, V19, V24] and data["peers"] == ["sdpa_flash", "sdpa_cudnn"]
    assert data["targets"] == {"vs_cudnn": 1.1, "vs_cudnn_from_T": 16, "tflops": {"1x4x20-d128-gqa2": 1e9}}
    assert [c["id"] for c in data["cases"]] == ["1x2x33-d64", "1x4x20-d128-gqa2", "2x2x17-d64-noncausal"]
    assert [c["flops"] for c in data["cases"]] == [attention_flops(1, 2, 33, 64), attention_flops(1, 4, 20, 128),
                                                   4 * 2 * 2 * 17 * 17 * 64]
    by = {(r["case"], r["name"]): r for r in data["rows"]}
    assert len(by) == len(data["rows"]) == 3 * 5  # three rungs and two peers per case
    for case in data["cases"]:
        v13 = by[(case["id"], kernels.resolve("v13").stem)]
        assert v13["status"] == "unsupported" and "bfloat16" in v13["reason"]  # float32 only: reported, not fatal
        for name in (V19, V24):
            r = by[(case["id"], name)]
            assert r["status"] == "ok" and r["max_err"] <= r["bound"] and r["math"] == "bf16"
            assert r["tflops"] == pytest.approx(case["flops"] / (r["timing"]["median_ms"] * 1e-3) / 1e12)
        for peer in ("sdpa_flash", "sdpa_cudnn"):  # no torch here
            assert by[(case["id"], peer)]["status"] == "unavailable"
        v = case["verdict"]
        assert v["best"] in (V19, V24) and v["vs_cudnn"] is None and v["vs_cudnn_met"] is None
        assert v["tflops_met"] is (False if case["id"] == "1x4x20-d128-gqa2" else None)
    assert "[  1/15]" in out and "| shape |" in out and "**missed**" in out and f"wrote {path}" in out
    assert "Targets met: 0 of 1." in out


def one_case_on_stand_ins(monkeypatch, runs: int | None = None):
    """The stand-in device, rungs launched as they declare, one d=128 case; with `runs`, that many timed runs."""
    install_stand_ins(monkeypatch)
    monkeypatch.setattr(kernels, "prepare", prepare_by_declaration)
    monkeypatch.setattr(frontier, "CASES", (Case("causal", 1, 2, 2, 24, 24, 128),))
    if runs is not None:
        monkeypatch.setattr(timing, "Method", lambda budget_ms: Method(budget_ms=budget_ms, min_runs=runs,
                                                                       max_runs=runs, warmup=1))


def test_frontier_default_rungs_take_every_case(monkeypatch, tmp_path, capsys):
    one_case_on_stand_ins(monkeypatch, runs=1)
    code, _, err = run(["frontier", "--budget-ms", "1", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    data = json.loads(next(tmp_path.glob("frontier-*.json")).read_text())
    assert data["kernels_named"] is False and data["kernels"] == [p.stem for p in frontier.default_rungs()]
    assert [r["name"] for r in data["rows"] if r["kind"] == "rung"] == data["kernels"]
    assert all(r["status"] == "ok" for r in data["rows"] if r["kind"] == "rung")


def test_frontier_interleave_times_the_rungs_together_and_the_peers_alone(monkeypatch, tmp_path, capsys):
    one_case_on_stand_ins(monkeypatch, runs=3)
    calls = []
    together = timing.time_interleaved
    monkeypatch.setattr(timing, "time_interleaved", lambda entries, **kw: calls.append(len(entries)) or together(entries, **kw))
    code, out, err = run(["frontier", "--kernels", "v19,v24", "--interleave", "--budget-ms", "1", "--results",
                          str(tmp_path)], capsys)
    assert code == 0, err
    data = json.loads(next(tmp_path.glob("frontier-*.json")).read_text())
    assert calls == [2] and "rotated" in data["method"]["interleave"]
    timed = {r["name"]: r["timing"] for r in data["rows"] if r["kind"] == "rung"}
    assert set(timed) == {V19, V24}
    assert all(t["interleaved"] == 2 and len(t["round_ms"]) == t["runs"] == 3 for t in timed.values())


def test_frontier_times_the_rungs_one_by_one_when_interleaving_fails(monkeypatch, tmp_path, capsys):
    one_case_on_stand_ins(monkeypatch)

    def broken(entries, **kw):
        raise RuntimeError("stream refused")

    monkeypatch.setattr(timing, "time_interleaved", broken)
    code, out, err = run(["frontier", "--kernels", "v19,v24", "--interleave", "--budget-ms", "1", "--results",
                          str(tmp_path)], capsys)
    assert code == 0, err
    assert "interleaved timing failed (RuntimeError: stream refused); timing the rungs one by one" in out + err
    data = json.loads(next(tmp_path.glob("frontier-*.json")).read_text())
    rungs_timed = [r for r in data["rows"] if r["kind"] == "rung"]
    assert all(r["status"] == "ok" and "round_ms" not in r["timing"] for r in rungs_timed)


# --- bench.py readme: the frontier section, the README's line, a sweep per dtype and head size --------


def sweep_result(dtype, d, date, nh=12, causal=True):
    result = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep", date=date)
    mask = {} if causal else {"causal": False}
    for s in result["shapes"]:
        s |= {"d": d, "NH": nh} | mask
    for r in result["rows"]:
        r["shape"] |= {"d": d, "NH": nh} | mask
        r["dtype"] = dtype
    stamp = date.replace("-", "").replace(":", "")
    return result | {"dtype": dtype, "tokens": 16384, "plot": f"sweep-fixture-gpu-{stamp}.png"}


@pytest.fixture
def pages_with_frontier(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_front.md", readme)
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    doc.write_text((FIXTURES / "bench_results_doc.md").read_text().replace(
        "The end of the page.", "<!-- bench:frontier:start -->\nstale frontier\n<!-- bench:frontier:end -->\n\n"
                                "The end of the page."))
    found = tmp_path / "results"
    write_result(kernels_result(shapes=((1, 512), (8, 1024))), result_path("kernels", fixture_setup(), found))
    for dtype, d, date, nh, causal in (("float32", 64, "2026-01-01T00:00:00Z", 12, True),
                                       ("bfloat16", 64, "2026-01-02T00:00:00Z", 12, True),
                                       ("bfloat16", 64, "2026-01-03T00:00:00Z", 12, True),
                                       ("bfloat16", 128, "2026-01-04T00:00:00Z", 16, True),
                                       ("bfloat16", 128, "2026-01-05T00:00:00Z", 16, False)):
        path = write_result(sweep_result(dtype, d, date, nh, causal), result_path("sweep", fixture_setup(date=date),
                                                                                  found))
        path.with_suffix(".png").write_bytes(b"")
    older = frontier_result()
    older["setup"] |= {"date": "2025-12-01T00:00:00Z"}
    older["setup"]["device"]["name"] = "Older GPU"
    for result in (older, frontier_result()):
        write_result(result, result_path("frontier", result["setup"], found))
    return readme, doc, found


def blocks_of(text):
    return {m[0]: m[1] for m in re.findall(r"<!-- bench:([\w-]+):start -->(.*?)<!-- bench:\1:end -->", text, re.S)}


def test_readme_writes_the_frontier_section_and_the_summary_line(pages_with_frontier, capsys):
    readme, doc, found = pages_with_frontier
    argv = ["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(found)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    full, front = blocks_of(doc.read_text()), blocks_of(readme.read_text())
    newest = "frontier-fixture-gpu-20260102T030405Z.json"
    block = full["frontier"]
    assert f"from `../results/{newest}`" in block and f"Results file: [{newest}](../results/{newest})." in block
    assert "stale" not in block and "Older GPU" not in block and "Targets met: 2 of 3." in block
    line = next(p for p in front["summary"].split("\n\n") if p.startswith("**bfloat16 frontier**"))
    assert line.startswith("**bfloat16 frontier**: the best rung >= "
                           "1.1x SDPA cuDNN at 1 of 2 shapes (0.50x-1.25x); 620.0 TFLOP/s at 1x16x16384-d128 "
                           f"(target 600: met); fastest: `{V24}` at 2 of 4. Fixture GPU, 2026-01-02. Results file: ")
    assert line.endswith(f"Results file: [{newest}](results/{newest}).") and f"`results/{newest}`" in front["summary"]
    code, out, _ = run(argv, capsys)  # once more: nothing to change
    assert code == 0 and out.count("already current") == 2


def test_readme_shows_the_newest_sweep_of_each_dtype_and_head_size(pages_with_frontier, capsys):
    readme, doc, found = pages_with_frontier
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(found)], capsys)
    assert code == 0, err
    sweep = blocks_of(doc.read_text())["sweep"]
    images = re.findall(r"!\[TFLOP/s against sequence length\]\(\.\./results/([^)]+)\)", sweep)
    assert images == ["sweep-fixture-gpu-20260101T000000Z.png", "sweep-fixture-gpu-20260103T000000Z.png",
                      "sweep-fixture-gpu-20260104T000000Z.png", "sweep-fixture-gpu-20260105T000000Z.png"]
    # float32; bfloat16 d=64 (the newer); d=128; d=128 without the mask (newer, but not in d=128's place)
    titles = re.findall(r"^\*\*(\w+, d=\d+(?:, non-causal)?)\*\*$", sweep, re.M)
    assert titles == ["float32, d=64", "bfloat16, d=64", "bfloat16, d=128", "bfloat16, d=128, non-causal"]
    assert "NH=16, d=128, bfloat16" in sweep and "20260102T000000Z" not in sweep
    # the README: one plot per dtype, at GPT-2's head size where there is one
    summary = blocks_of(readme.read_text())["summary"]
    assert re.findall(r"!\[TFLOP/s against sequence length, (\w+)\]\(results/([^)]+)\)", summary) == [
        ("float32", "sweep-fixture-gpu-20260101T000000Z.png"), ("bfloat16", "sweep-fixture-gpu-20260103T000000Z.png")]
    assert "TFLOP/s against sequence length, bfloat16, d=64: Fixture GPU, 2026-01-03." in summary
    (found / "sweep-fixture-gpu-20260103T000000Z.json").unlink()
    (found / "sweep-fixture-gpu-20260102T000000Z.json").unlink()  # no bfloat16 sweep at d=64 left: d=128's
    (found / "sweep-fixture-gpu-20260105T000000Z.json").unlink()  # (the newest, non-causal, is not GPT-2's kind
    # either, so the newest of the two is shown: d=128's causal one here, without the newer non-causal file)
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(found)], capsys)
    assert code == 0, err
    summary = blocks_of(readme.read_text())["summary"]
    assert "(results/sweep-fixture-gpu-20260104T000000Z.png)" in summary
    assert "TFLOP/s against sequence length, bfloat16, d=128:" in summary
