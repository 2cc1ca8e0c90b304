"""bench.py train without a GPU: the FLOP count, the rows' tokens/s, MFU and speed-ups, which backward
rungs run, the table and the loss-curve plot from a synthetic result, docs/training.md's section written
by bench.py readme, and the command line."""

import json
import re
import shutil

import pytest

import gpt2
from benchmarks import cli, train
from benchmarks.results import SCHEMA, result_path, write_result
from benchmarks.rungs import add_speedups
from benchmarks.timing import Method
from tests.bench.helpers import FIXTURES, FakePyplot, cells_of, fixture_setup, outside_markers, run, table_rows


def test_step_flops_follow_llmc():
    config = gpt2.SIZES["gpt2"]
    n = 124_439_808
    assert train.step_flops(config, n, 16, 1024) == (6 * n + 6 * 12 * 768 * 1024) * 16 * 1024


def timed(name, kind, ms, B=16, dtype="bfloat16", peak=10 * 2**30):
    r = {"name": name, "kind": kind, "label": train.PEERS.get(name, name), "dtype": dtype, "B": B, "T": 1024,
         "status": "ok", "timing": {"median_ms": ms, "p20_ms": ms, "p80_ms": ms, "min_ms": ms, "max_ms": ms, "runs": 5},
         "peak_bytes": peak, "flops": train.step_flops(gpt2.SIZES["gpt2"], 124_439_808, B, 1024)}
    if kind == "rung":
        r["forward"] = "v19_wgmma_overlap"
    return r


def case_rows(B=16, dtype="bfloat16"):
    rows = [timed("b04_bf16_mma", "rung", 200.0, B, dtype), timed("b05_wgmma", "rung", 150.0, B, dtype),
            timed("torch_eager", "peer", 300.0, B, dtype), timed("torch_compile", "peer", 180.0, B, dtype),
            {"name": "b06_broken", "kind": "rung", "label": "b06_broken", "dtype": dtype, "B": B, "T": 1024,
             "status": "out of memory", "reason": "Out of memory allocating 1 GiB"}]
    for r in rows:
        train.finish_row(r, 800.0)
    add_speedups(rows)
    return rows


def test_rows_have_tokens_per_second_mfu_and_speedups_over_both_peers():
    rows = case_rows()
    b05 = rows[1]
    assert b05["tokens_per_s"] == pytest.approx(16 * 1024 / 0.150)
    assert b05["mfu"] == pytest.approx(b05["flops"] / 0.150 / 1e12 / 800.0)
    assert b05["speedup"]["torch_eager"] == pytest.approx(2.0) and b05["speedup"]["torch_compile"] == pytest.approx(1.2)
    assert b05["speedup"]["previous"] == pytest.approx(200 / 150)
    assert "tokens_per_s" not in rows[4] and rows[4]["speedup"] == {}
    assert train.finish_row(dict(timed("b05_wgmma", "rung", 100.0)), None)["mfu"] is None  # no ceiling measured


def test_the_per_tensor_row_is_measured_against_its_rung_and_says_so():
    mt = timed(f"b05_wgmma + {train.PER_TENSOR}", "rung", 120.0) | {"variant_of": "b05_wgmma",
                                                                  "optimizer": train.PER_TENSOR}
    rows = case_rows()
    rows.insert(2, train.finish_row(mt, 800.0))
    add_speedups(rows)
    assert mt["speedup"]["previous"] == pytest.approx(150 / 120) and mt["speedup"]["torch_compile"] == pytest.approx(1.5)
    assert train.note(mt) == f"forward v19_wgmma_overlap, {train.PER_TENSOR}"
    assert train.note(rows[1]) == "forward v19_wgmma_overlap" and train.note(rows[3]) == ""


def test_backward_rungs_that_run_here():
    assert train.rungs_for("bfloat16", "sm_90") == ["b04_bf16_mma", "b05_wgmma", "b06_wide_query_tiles", "b07_persistent",
                                                    "b08_pingpong", "b14_wide_stores_d64"]  # b10, b13: d = 128 only
    assert train.rungs_for("bfloat16", "sm_80") == ["b04_bf16_mma"]  # b05-b14 are wgmma
    assert train.rungs_for("float32", "sm_90") == ["b01_naive", "b02_fa2", "b03_tf32_mma"]


def train_result(date="2026-01-02T03:04:05Z"):
    rows = case_rows(16) + case_rows(64)
    steps = 5
    return {"schema": SCHEMA, "kind": "train", "setup": fixture_setup("python3 bench.py train", date),
            "model": "GPT-2 small (124M), random weights", "n_params": 124_439_808,
            "flop_convention": "llm.c's", "ceilings": {"bf16_tflops": 800.0, "ffma_tflops": 50.0},
            "method": Method(budget_ms=3000, min_runs=5, max_runs=50).describe(0) | {"timed": "one step",
                                                                                    "memory": "pool high-water"},
            "dtypes": ["bfloat16"], "T": 1024, "seed": 0, "rows": rows, "plot": None,
            "loss_curve": {"B": 8, "T": 1024, "steps": steps, "tokens": 60000, "text": "README.md and docs/*.md",
                           "forward": "v19_wgmma_overlap", "backward": "b05_wgmma",
                           "lab": [11.0, 9.0, 8.0, 7.5, 7.0], "torch_eager": [11.0, 9.1, 8.0, 7.4, 7.1]}}


def test_the_table():
    text = train.render_train(train_result(), "train.png")
    assert "Fixture GPU" in text and "bfloat16: bf16 tensor 800.0 TFLOP/s" in text
    rows = table_rows(text, "bfloat16")
    assert len(rows) == 10
    b05 = cells_of(rows[1])
    assert b05[:3] == ["bfloat16", "16", "`b05_wgmma`"]
    assert b05[4] == f"{16 * 1024 / 0.150:,.0f}" and b05[6] == "10.00" and b05[7:9] == ["2.00x", "1.20x"]
    assert cells_of(rows[4])[3] == "**out of memory**"
    assert "final loss 7.000 and 7.100" in text and "![loss curve](train.png)" in text


def test_the_loss_curve_plot():
    plt = FakePyplot()
    train.plot_loss_curve(plt, train_result())
    (xs, lab, label), (_, peer, _) = plt.ax.lines
    assert xs == [1, 2, 3, 4, 5] and lab[-1] == 7.0 and peer[-1] == 7.1
    assert "b05_wgmma" in label


def test_readme_writes_the_training_section(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\n<!-- bench:kernels:start -->\n<!-- bench:kernels:end -->\n")
    page = docs / "training.md"
    page.write_text("# Training\n\nBefore.\n\n<!-- bench:train:start -->\nstale\n<!-- bench:train:end -->\n\nAfter.\n")
    results = tmp_path / "results"
    result = train_result()
    result["plot"] = "train-fixture-gpu-20260102T030405Z.png"
    write_result(result, result_path("train", result["setup"], results))
    before = page.read_text()
    code, out, err = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc",
                          str(docs / "results.md"), "--training-doc", str(page)], capsys)
    assert code == 0, err
    text = page.read_text()
    assert outside_markers(text) == outside_markers(before) and "stale" not in text
    section = re.search(r"<!-- bench:train:start -->(.*)<!-- bench:train:end -->", text, re.S).group(1)
    assert "[train-fixture-gpu-20260102T030405Z.json](../results/train-fixture-gpu-20260102T030405Z.json)" in section
    assert "![loss curve](../results/train-fixture-gpu-20260102T030405Z.png)" in section


def test_the_docs_keep_the_newest_full_run_of_each_dtype(tmp_path):
    """A run per dtype (tools/train_device.sh) or one of both; a --quick run only for a dtype no full run has."""
    both = train_result("2026-01-01T00:00:00Z") | {"dtypes": ["bfloat16", "float32"],
                                                  "rows": case_rows(16) + case_rows(16, "float32")}
    bf16 = train_result("2026-01-02T00:00:00Z")
    quick = train_result("2026-01-03T00:00:00Z") | {"quick": True}
    files = {tmp_path / f"{name}.json": r for name, r in (("quick", quick), ("bf16", bf16), ("both", both))}
    chosen = train.newest_per_dtype(list(files), files.get)  # newest first
    assert [p.stem for p, _ in chosen] == ["bf16", "both"]
    (_, newest), (_, older) = chosen
    assert newest["dtypes"] == ["bfloat16"] and newest["loss_curve"] is not None
    assert older["dtypes"] == ["float32"] and older["loss_curve"] is None
    assert {r["dtype"] for r in older["rows"]} == {"float32"} and len(older["rows"]) == 5
    assert "Quick run" in train.render_train(quick) and "Quick run" not in train.render_train(bf16)
    only_quick = {p: r for p, r in files.items() if p.stem != "both"}  # float32 measured by no full run
    quick_f32 = train_result("2026-01-04T00:00:00Z") | {"quick": True, "dtypes": ["float32"],
                                                       "rows": case_rows(16, "float32")}
    only_quick[tmp_path / "quick32.json"] = quick_f32
    chosen = train.newest_per_dtype(sorted(only_quick, key=lambda p: only_quick[p]["setup"]["date"], reverse=True),
                                    only_quick.get)
    assert [p.stem for p, _ in chosen] == ["bf16", "quick32"]  # the full run first; the quick one fills float32


def test_result_is_strict_json(tmp_path):
    path = write_result(train_result(), result_path("train", fixture_setup(), tmp_path))
    assert path.name == "train-fixture-gpu-20260102T030405Z.json"
    loaded = json.loads(path.read_text())
    assert loaded["kind"] == "train" and len(loaded["rows"]) == 10


def test_the_command_line(monkeypatch):
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "train", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["train", "--dtypes", "bfloat16", "--max-batch", "128", "--curve-steps", "20"], "doc") == 0
    assert seen["dtypes"] == ["bfloat16"] and seen["max_batch"] == 128 and seen["curve_steps"] == 20
    assert not seen["quick"]
    assert cli.main(["train", "--quick"], "doc") == 0
    assert seen["quick"] and seen["dtypes"] is None  # cmd_train: bfloat16 alone when quick, else both
    with pytest.raises(SystemExit):
        cli.main(["train", "--max-batch", "100"], "doc")
