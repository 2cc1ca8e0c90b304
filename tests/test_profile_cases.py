"""bench.py profile at the frontier's shapes (--cases): the flags, the rows' shapes and FLOPs, where the
counters go in the docs. CPU only: ncu is a fake that answers with a recorded report."""

from __future__ import annotations

import pytest

from benchmarks import frontier, profile, profile_render, results
from benchmarks.cases import shape_flops
from benchmarks.device import CannotRun
from tests.test_profile import FIXTURES, fake_device, fake_ncu, ladder_result, make_result, parse


def test_cases_flag_takes_frontier_ids():
    args = parse(["profile", "--cases", "16x12x2048-d64,2x32x4096-d128-gqa8", "--dtype", "bfloat16"])
    assert [frontier.case_id(c) for c in args.cases] == ["16x12x2048-d64", "2x32x4096-d128-gqa8"]
    assert len(parse(["profile", "--cases", "all"]).cases) == len(frontier.CASES)
    assert parse(["profile"]).cases is None


def test_unknown_case_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["profile", "--cases", "16x12x2048-d64,8x8x8-d8"])
    err = capsys.readouterr().err
    assert "8x8x8-d8" in err and "2x32x4096-d128-gqa8" in err  # names the bad id and lists the good ones


def test_shape_and_cases_together_are_refused():
    args = parse(["profile", "--cases", "16x12x2048-d64", "--shape", "8x1024"])
    with pytest.raises(CannotRun, match="--shape and --cases"):
        profile.cmd_profile(args)


def test_the_target_is_told_the_case():
    target = profile.target_args("kernels/v24_persistent.cu", "2x32x4096-d128-gqa8", "bfloat16")
    assert target[-4:] == ["--kernel", "kernels/v24_persistent.cu", "--case", "2x32x4096-d128-gqa8"]
    assert profile.target_args("v13", (8, 1024), "float32")[-2:] == ["--shape", "8x1024"]


def test_profiled_shapes_carry_heads_head_size_and_mask():
    gqa, noncausal = (c for c in frontier.CASES if frontier.case_id(c) in ("2x32x4096-d128-gqa8",
                                                                            "4x16x2048-d64-noncausal"))
    (shape, told, flops), (shape2, _, flops2) = profile.profiled_shapes(parse(
        ["profile", "--cases", "2x32x4096-d128-gqa8,4x16x2048-d64-noncausal"]))
    assert shape == {"B": 2, "NH": 32, "NH_kv": 8, "T_q": 4096, "T_k": 4096, "d": 128, "causal": True,
                     "case": "2x32x4096-d128-gqa8"} and told == "2x32x4096-d128-gqa8"
    assert flops == shape_flops(gqa) and flops2 == shape_flops(noncausal) == 4 * 4 * 16 * 2048**2 * 64
    assert not shape2["causal"]


def test_cmd_profile_at_the_cases(tmp_path, monkeypatch, capsys):
    fake_device(monkeypatch, {"bf16_tflops": 700.0, "copy_tbps": 3.0})
    ncu = fake_ncu(tmp_path, f"cat '{FIXTURES / 'ncu-v18-bfloat16.csv'}'")
    args = parse(["profile", "--kernels", "v18", "--dtype", "bfloat16", "--no-decode", "--ncu", ncu,
                  "--cases", "16x12x2048-d64,1x16x16384-d128", "--results", str(tmp_path / "results")])
    assert profile.cmd_profile(args) == 0
    saved = results.load_result(next((tmp_path / "results").glob("profile-*.json")))
    assert [s["case"] for s in saved["shapes"]] == ["16x12x2048-d64", "1x16x16384-d128"]
    assert [r["shape"]["case"] for r in saved["rows"]] == ["16x12x2048-d64", "1x16x16384-d128"]
    assert saved["rows"][1]["flops"] == 4 * 16 * 16384**2 * 128 // 2
    out = capsys.readouterr().out
    assert "frontier shapes (B x NH x T-d) 16x12x2048-d64, 1x16x16384-d128" in out
    assert "v18_wgmma` 1x16x16384-d128" in out  # each row names its case


def test_counters_at_the_cases_go_to_their_own_section(tmp_path):
    from benchmarks import cli
    from tests.bench.helpers import FIXTURES as BENCH_FIXTURES

    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text((BENCH_FIXTURES / "bench_readme.md").read_text())
    (docs / "results.md").write_text((BENCH_FIXTURES / "bench_results_doc.md").read_text()
                                     + "\n<!-- bench:frontier-counters:start -->\nold\n"
                                       "<!-- bench:frontier-counters:end -->\n")
    (docs / "profile.md").write_text("<!-- bench:profile:start -->\nold\n<!-- bench:profile:end -->\n")
    store = tmp_path / "results"
    gpt2 = make_result()
    at_cases = ladder_result() | {"dtype": "bfloat16"}
    case = {"B": 16, "NH": 12, "NH_kv": 12, "T_q": 2048, "T_k": 2048, "d": 64, "causal": True, "case": "16x12x2048-d64"}
    at_cases["shapes"] = [case]
    at_cases["rows"] = [r | {"shape": case} if r.get("shape") else r for r in at_cases["rows"]]
    at_cases["setup"] = at_cases["setup"] | {"date": "2026-11-26T11:00:00Z"}
    at_cases["plot"] = "roofline-cases.png"
    for r in (gpt2, at_cases):
        results.write_result(r, results.result_path("profile", r["setup"], store))
    argv = ["readme", "--readme", str(tmp_path / "README.md"), "--results-doc", str(docs / "results.md"),
            "--results", str(store)]
    assert cli.main(argv, "doc") == 0
    block = (docs / "results.md").read_text().partition("<!-- bench:frontier-counters:start -->")[2]
    assert "old" not in block and "**bfloat16**, frontier shapes (B x NH x T-d) 16x12x2048-d64" in block
    assert "20261126T110000Z" in block and "20261126T100000Z" not in block
    assert "[`v12_o_in_registers`](ladder.md#v12)" in block  # the rung's story is on another page
    assert "(../results/roofline-cases.png)" in block
    page = (docs / "profile.md").read_text()  # the GPT-2 shapes' profile stays the profile page's
    assert "20261126T100000Z" in page and "20261126T110000Z" not in page
    assert profile_render.shapes_header(gpt2) == "B x T 8x1024, NH=12, d=64"
