"""bench.py backward without a GPU: the cases, the FLOP convention, which rungs, forward rung and peers
run, the table and its targets from a synthetic result, docs/results.md's backward section written by
bench.py readme, and the command line."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest

import kernels
from benchmarks import backward, cli, timing
from benchmarks.cases import Case, attention_flops
from benchmarks.results import SCHEMA, result_path, write_result
from benchmarks.rungs import add_speedups
from benchmarks.timing import Method
from tests.bench.helpers import FIXTURES, cells_of, fixture_setup, install_stand_ins, outside_markers, run, table_rows


def test_cases_are_the_gpt2_shapes_d128_and_noncausal_and_asked_for_gqa_and_long():
    gpt2 = backward.CASE_SETS["gpt2"]
    assert [(c.B, c.T_q) for c in gpt2] == [(1, 512), (8, 1024), (16, 2048), (6, 4096), (1, 8192)]
    assert all(c.NH == 12 and c.d == 64 and c.causal and c.T_k == c.T_q for c in gpt2)
    assert {c.d for c in backward.CASE_SETS["d128"]} == {128}
    assert not any(c.causal for c in backward.CASE_SETS["noncausal"])
    assert {c.d for c in backward.CASE_SETS["noncausal"]} == {64, 128}
    gqa = backward.CASE_SETS["gqa"]
    assert {(c.NH, c.NH_kv, c.d) for c in gqa} == {(32, 8, 128)} and {c.causal for c in gqa} == {True, False}
    assert all(c.needs() == ({"gqa"} if c.causal else {"gqa", "noncausal"}) for c in gqa)
    long = backward.CASE_SETS["long"]
    assert [(c.B, c.T_q) for c in long] == [(4, 4096), (2, 8192), (1, 16384)]
    assert all(c.d == 128 and not c.causal and c.NH == c.NH_kv == 16 for c in long)
    assert backward.DEFAULT_CASES == ("gpt2", "d128", "noncausal")


def test_backward_flops_are_two_and_a_half_forwards():
    case = Case("gpt2", 8, 12, 12, 1024, 1024, 64)
    assert backward.backward_flops(case) == 2.5 * attention_flops(8, 12, 1024, 64)
    noncausal = Case("noncausal", 4, 12, 12, 2048, 2048, 64, causal=False)
    assert backward.backward_flops(noncausal) == 2.5 * 4 * 4 * 12 * 2048 * 2048 * 64


def test_the_rungs_forward_rung_and_peers_of_each_dtype():
    assert backward.rungs_for("float32") == ["b01_naive", "b02_fa2", "b03_tf32_mma"]
    assert backward.rungs_for("bfloat16") == backward.rungs_for("float16") == [
        "b04_bf16_mma", "b05_wgmma", "b06_wide_query_tiles", "b07_persistent", "b08_pingpong", "b10_tiles_of_80",
        "b13_wide_stores", "b14_wide_stores_d64"]
    assert backward.rungs_for("float32", ["b03_tf32_mma"]) == ["b03_tf32_mma"]
    gpt2 = backward.CASE_SETS["gpt2"][1]
    assert backward.forward_rung(gpt2, "float32", "sm_90") == "v20_tf32_wgmma"
    assert backward.forward_rung(gpt2, "float32", "sm_80") == "v14_tf32_mma"  # v20 is wgmma: sm_90 only
    d128 = backward.CASE_SETS["d128"][0]
    assert backward.forward_rung(d128, "float32", "sm_90") == "v14_tf32_mma"  # v20 declares d=64 only
    assert backward.forward_rung(d128, "bfloat16", "sm_90") == "v19_wgmma_overlap"
    assert backward.forward_rung(Case("x", 1, 1, 1, 8, 8, 48), "float32", "sm_90") is None
    assert backward.PEERS_OF["float32"] == ("sdpa_efficient",)
    assert backward.PEERS_OF["bfloat16"] == ("sdpa_flash", "sdpa_cudnn")


def test_a_rung_with_a_deterministic_configuration_runs_again_deterministic():
    """b01 is deterministic in every configuration: one row; b02-b14 declare both kinds: a second row (b06
    and b14 at d = 64 only: at d = 128 their one row says they do not take the case; b10 and b13 at d = 128
    only)."""
    gpt2 = backward.CASE_SETS["gpt2"][0]
    assert backward.entries(gpt2, "float32", backward.rungs_for("float32")) == [
        ("b01_naive", False), ("b02_fa2", False), ("b02_fa2", True), ("b03_tf32_mma", False), ("b03_tf32_mma", True)]
    d128 = backward.CASE_SETS["d128"][0]
    assert backward.entries(d128, "bfloat16", backward.rungs_for("bfloat16")) == [
        ("b04_bf16_mma", False), ("b04_bf16_mma", True), ("b05_wgmma", False), ("b05_wgmma", True),
        ("b06_wide_query_tiles", False), ("b07_persistent", False), ("b07_persistent", True),
        ("b08_pingpong", False), ("b08_pingpong", True), ("b10_tiles_of_80", False), ("b10_tiles_of_80", True),
        ("b13_wide_stores", False), ("b13_wide_stores", True), ("b14_wide_stores_d64", False)]
    assert backward.entries(gpt2, "bfloat16", ["b06_wide_query_tiles"]) == [
        ("b06_wide_query_tiles", False), ("b06_wide_query_tiles", True)]
    assert backward.entries(gpt2, "bfloat16", ["b02_fa2"]) == [("b02_fa2", False)]  # b02 has no bfloat16
    assert backward.entries(Case("x", 1, 1, 1, 8, 8, 96), "float32", ["b02_fa2"]) == [("b02_fa2", False)]


def timed(case, name, kind, ms, err=1e-6, status="ok"):
    r = {"shape": case.as_dict(), "dtype": "float32", "name": name, "kind": kind, "status": status,
         "label": {"sdpa_efficient": "SDPA efficient", "sdpa_cudnn": "SDPA cuDNN"}.get(name, name),
         "flops": backward.backward_flops(case), "max_err": {"dq": err, "dk": 2 * err, "dv": 3 * err}}
    if status == "ok":
        r |= {"timing": {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "min_ms": ms, "max_ms": ms,
                         "runs": 20},
              "tflops": backward.backward_flops(case) / (ms * 1e-3) / 1e12}
    if kind == "rung":
        r |= {"config": "d_head=64, B_r=32, B_c=64, deterministic=0", "forward": "v20_tf32_wgmma"}
    return r


def deterministic(row):
    """A rung's deterministic run, as bench_case writes it."""
    return row | {"variant_of": row["name"].split()[0], "deterministic": True,
                  "config": row["config"].replace("deterministic=0", "deterministic=1")}


def backward_result(dtype="float32", date="2026-01-02T03:04:05Z"):
    """Two GPT-2 cases: b01 slow, b02 wrong and its deterministic run right, b03 faster than SDPA efficient
    (2x at 8x1024, 1.2x at 1x512) and its deterministic run 1.25x slower, b04 not taking float32."""
    small, big = backward.CASE_SETS["gpt2"][:2]
    rows = []
    for case, scale in ((small, 1.0), (big, 4.0)):
        part = [timed(case, "b01_naive", "rung", 10 * scale),
                timed(case, "b02_fa2", "rung", 0, err=0.5, status="wrong") | {"reason": "dq max error 5.00e-01 > bound"},
                deterministic(timed(case, "b02_fa2 deterministic", "rung", 8 * scale)),
                timed(case, "b03_tf32_mma", "rung", (0.5 if case is big else 1.0) * scale),
                deterministic(timed(case, "b03_tf32_mma deterministic", "rung", 1.25 * (0.5 if case is big else 1.0) * scale)),
                {"shape": case.as_dict(), "dtype": dtype, "name": "b04_bf16_mma", "kind": "rung", "label": "b04_bf16_mma",
                 "status": "unsupported", "reason": "TypeError: q has dtype float32; kernel b04_bf16_mma supports "
                                                    "bfloat16, float16"},
                timed(case, "sdpa_efficient", "peer", 1.2 * scale)]
        add_speedups(part)
        rows += part
    return {"schema": SCHEMA, "kind": "backward", "setup": fixture_setup("python3 bench.py backward", date),
            "flop_convention": backward.FLOP_CONVENTION,
            "method": Method().describe(100 * 2**20) | {"tolerance": backward.TOLERANCE, "timed": "all its kernels"},
            "dtype": dtype, "cases": [small.as_dict(), big.as_dict()],
            "kernels": ["b01_naive", "b02_fa2", "b03_tf32_mma", "b04_bf16_mma"], "peers": ["sdpa_efficient"],
            "seed": 0, "rows": rows}


def test_the_table_of_a_backward_result():
    text = backward.render_backward(backward_result())
    assert "Fixture GPU" in text and "2.5 x the forward's FLOPs" in text
    assert "**B=1, T=512** (NH=12, d=64, causal, float32," in text and "**B=8, T=1024**" in text
    rows = table_rows(text, "`b03_tf32_mma` |")  # not its deterministic rows
    assert len(rows) == 2
    cells = cells_of(rows[1])  # 8x1024: 2 ms against SDPA's 4.8 ms
    assert cells[1] == "2.000" and cells[5] == "2.40x" and cells[6] == "1.0e-06 / 2.0e-06 / 3.0e-06"
    assert "forward v20_tf32_wgmma" in cells[7] and cells[4] == "20.00x"  # vs b01: b02's deterministic run is no one's previous
    fixed = cells_of(table_rows(text, "`b03_tf32_mma` deterministic")[1])
    assert fixed[4] == "0.80x" and fixed[5] == "1.92x" and "deterministic=1" in fixed[7]  # vs b03's own row, vs SDPA
    assert "its \"vs previous\" is against that rung's row: the cost of the fixed order" in text
    wrong = cells_of(table_rows(text, "`b02_fa2` |")[0])
    assert wrong[1] == "**wrong**" and "dq max error" in wrong[-1]
    assert not table_rows(text, "`b04_bf16_mma`")
    assert "Not run: `b04_bf16_mma` (TypeError: q has dtype float32" in text
    # the fp32 target applies to GPT-2 shapes with T >= 1024: only 8x1024 here, where b03 is 2.4x
    assert "at least 1.5x SDPA efficient's backward at every GPT-2 shape with T >= 1024: the fastest rung at " \
           "each case, at worst 2.40x (`b03_tf32_mma` at 8x12x1024, d=64): met." in text


def test_targets_say_missed_and_skip_dtypes_without_one():
    result = backward_result()
    for r in result["rows"]:
        if r["name"] == "b03_tf32_mma" and r["shape"]["T_q"] == 1024:
            r["speedup"]["sdpa_efficient"] = 1.3
    assert backward.targets(result)[0].endswith("at worst 1.30x (`b03_tf32_mma` at 8x12x1024, d=64): missed.")
    assert backward.targets(backward_result(dtype="float16")) == []


def test_bfloat16_targets_each_cover_their_cases_and_a_gqa_title_names_its_heads():
    """bfloat16's two targets: 1x cuDNN at T >= 2048, and 1.2x at d=128 without the mask from T = 4096 (a
    run without such a case says nothing of it); a GQA case's title gives its key/value heads."""
    cases = [backward.CASE_SETS["d128"][1], backward.CASE_SETS["gqa"][1], backward.CASE_SETS["long"][0]]
    rows = []
    for case, speedup in zip(cases, (0.9, 1.3, 1.25), strict=True):
        r = timed(case, "b05_wgmma", "rung", 1.0) | {"speedup": {"sdpa_cudnn": speedup}}
        rows += [r, timed(case, "sdpa_cudnn", "peer", speedup) | {"speedup": {}}]
    result = {"dtype": "bfloat16", "cases": [c.as_dict() for c in cases], "kernels": ["b05_wgmma"], "rows": rows}
    first, second = backward.targets(result)
    assert first.startswith("Target: at least 1x SDPA cuDNN's backward at every case with T >= 2048") and \
        first.endswith("at worst 0.90x (`b05_wgmma` at 2x16x4096, d=128): missed.")
    assert "at least 1.2x SDPA cuDNN's backward at d=128 without the mask, T >= 4096" in second and \
        second.endswith("at worst 1.25x (`b05_wgmma` at 4x16x4096, d=128): met.")  # not the causal d128 case
    # a rung that ran only some cases (b06 takes d = 64 alone) counts where it ran: each case's fastest
    b06 = timed(cases[0], "b06_wide_query_tiles", "rung", 0.8) | {"speedup": {"sdpa_cudnn": 1.1}}
    faster = result | {"kernels": ["b05_wgmma", "b06_wide_query_tiles"], "rows": [*rows, b06]}
    assert backward.targets(faster)[0].endswith("at worst 1.10x (`b06_wide_query_tiles` at 2x16x4096, d=128): met.")
    nobody = result | {"rows": rows[2:]}  # no rung ran the first case
    assert backward.targets(nobody)[0].endswith("no rung ran 2x16x4096, d=128.")
    result["cases"], result["rows"] = result["cases"][:1], rows[:2]
    assert len(backward.targets(result)) == 1  # no non-causal d=128 case: no second line
    assert "(NH=32, NH_kv=8, d=128, non-causal, bfloat16," in backward.case_title(cases[1].as_dict(), "bfloat16")
    assert "(NH=16, d=128, non-causal" in backward.case_title(cases[2].as_dict(), "bfloat16")


def test_readme_writes_the_backward_section(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    page.write_text("# Results\n\nBefore.\n\n<!-- bench:backward:start -->\nstale\n<!-- bench:backward:end -->\n\nAfter.\n")
    results = tmp_path / "results"
    older = backward_result(date="2025-12-01T00:00:00Z")
    older["setup"]["device"]["name"] = "Older GPU"
    bf16 = backward_result(dtype="bfloat16", date="2026-01-03T00:00:00Z")
    for result in (older, backward_result(), bf16):
        write_result(result, result_path("backward", result["setup"], results))
    before = page.read_text()
    code, out, err = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc", str(page)],
                         capsys)
    assert code == 0, err
    text = page.read_text()
    assert outside_markers(text) == outside_markers(before) and "stale" not in text
    section = re.search(r"<!-- bench:backward:start -->(.*)<!-- bench:backward:end -->", text, re.S).group(1)
    assert "Older GPU" not in section  # the newest float32 result, and the bfloat16 one after it
    assert section.index("backward-fixture-gpu-20260102T030405Z.json") < section.index(
        "backward-fixture-gpu-20260103T000000Z.json")
    assert "[backward-fixture-gpu-20260102T030405Z.json](../results/backward-fixture-gpu-20260102T030405Z.json)" in section


def test_the_command_line(monkeypatch):
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "backward", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["backward", "--kernels", "b01,b3", "--dtype", "bfloat16", "--cases", "d128,noncausal",
                     "--peers", "sdpa_cudnn"], "doc") == 0
    assert seen["kernels"] == ["b01_naive", "b03_tf32_mma"] and seen["dtype"] == "bfloat16"
    assert seen["cases"] == ["d128", "noncausal"] and seen["peers"] == ["sdpa_cudnn"]
    assert cli.main(["backward"], "doc") == 0
    assert seen["kernels"] is None and seen["cases"] == ["gpt2", "d128", "noncausal"] and seen["peers"] is None


@pytest.mark.parametrize("argv,message", [
    (["backward", "--kernels", "b99"], "unknown backward kernel 'b99'"),
    (["backward", "--cases", "gpt3"], "unknown case set"),
    (["backward", "--peers", "reference"], "unknown SDPA peer"),
])
def test_bad_backward_arguments_are_clear(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


def backward_on_stand_ins(monkeypatch, runs):
    """bench.py backward on the stand-in device: one small GPT-2 case, the forward and every backward rung
    the plain recipe in float32 (so every rung passes its check), `runs` timed runs each."""
    install_stand_ins(monkeypatch)
    monkeypatch.setitem(backward.CASE_SETS, "gpt2", [Case("gpt2", 1, 2, 2, 17, 17, 64)])
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, *, kernel, causal, return_lse: (
        kernels.reference_attention(q, k, v, causal=causal), None))

    def prepare_backward(q, k, v, o, lse, do, *, kernel, causal, deterministic):
        def run():
            return kernels.reference_attention_backward(q, k, v, None, None, do, causal=causal)
        rung = SimpleNamespace(tolerance_factor=lambda config: 3.0)
        run.instance = SimpleNamespace(rung=rung, config=None, describe=lambda: f"stand-in {kernel}")
        return run

    monkeypatch.setattr(backward.launcher, "prepare_backward", prepare_backward)
    monkeypatch.setattr(timing, "Method", lambda budget_ms: Method(budget_ms=budget_ms, min_runs=runs, max_runs=runs,
                                                                   warmup=1))


def test_backward_interleave_times_the_rungs_together(monkeypatch, tmp_path, capsys):
    backward_on_stand_ins(monkeypatch, runs=3)
    calls, together = [], timing.time_interleaved
    monkeypatch.setattr(timing, "time_interleaved", lambda entries, **kw: calls.append(len(entries)) or together(entries, **kw))
    code, out, err = run(["backward", "--kernels", "b02,b03", "--cases", "gpt2", "--peers", "none", "--interleave",
                          "--budget-ms", "1", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    data = json.loads(next(tmp_path.glob("backward-*.json")).read_text())
    assert calls == [4] and "rotated" in data["method"]["interleave"]  # b02, b03 and their deterministic runs
    rows = [r for r in data["rows"] if r["kind"] == "rung"]
    assert [r["name"] for r in rows] == ["b02_fa2", "b02_fa2 deterministic", "b03_tf32_mma", "b03_tf32_mma deterministic"]
    assert all(r["status"] == "ok" and r["timing"]["interleaved"] == 4 and len(r["timing"]["round_ms"]) == 3
               for r in rows)


def test_backward_times_the_rungs_one_by_one_without_interleave_or_when_it_fails(monkeypatch, tmp_path, capsys):
    backward_on_stand_ins(monkeypatch, runs=2)

    def broken(entries, **kw):
        raise RuntimeError("stream refused")

    monkeypatch.setattr(timing, "time_interleaved", broken)
    for flags in ([], ["--interleave"]):
        code, out, err = run(["backward", "--kernels", "b02,b03", "--cases", "gpt2", "--peers", "none", *flags,
                              "--budget-ms", "1", "--results", str(tmp_path / str(len(flags)))], capsys)
        assert code == 0, err
        assert ("interleaved timing failed (RuntimeError: stream refused); timing the rungs one by one" in out + err) \
            == bool(flags)
        data = json.loads(next((tmp_path / str(len(flags))).glob("backward-*.json")).read_text())
        assert "interleave" not in data["method"] or flags
        rows = [r for r in data["rows"] if r["kind"] == "rung"]
        assert len(rows) == 4 and all(r["status"] == "ok" and "round_ms" not in r["timing"] for r in rows)


def test_the_backward_tables_show_the_clock_where_it_was_read():
    result = backward_result()
    assert "SM MHz" not in backward.render_backward(result)
    row = next(r for r in result["rows"] if r["status"] == "ok" and r["name"] == "b03_tf32_mma")
    row["timing"]["sm_clock"] = {"median_mhz": 1755.0, "min_mhz": 1700, "max_mhz": 1980, "samples": 30}
    text = backward.render_backward(result)
    assert "| kernel | ms | p20-p80 | TFLOP/s | SM MHz | vs previous |" in text
    cells = [cells_of(r) for r in table_rows(text, "`b03_tf32_mma` |")]
    assert "1,755" in [c[4] for c in cells] and all(len(c) == len(cells[0]) for c in cells)
    wrong = cells_of(table_rows(text, "`b02_fa2` |")[0])
    assert wrong[1] == "**wrong**" and wrong[4] == "-"  # a row that was not timed keeps the column
