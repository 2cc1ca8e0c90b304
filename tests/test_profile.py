"""bench.py profile without a GPU: ncu's CSV recorded on an H200 (tests/fixtures/ncu/), the units, the stall
ranking, the messages where ncu is missing or may not read the counters, the command line, the table,
the roofline's arithmetic and its plot."""

import argparse
import copy
import math
from pathlib import Path

import pytest

import kernels
from benchmarks import device, plots, profile, profile_render, profile_target, results, timing
from benchmarks.cases import FLOP_CONVENTION, attention_flops
from benchmarks.device import CannotRun

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ncu"


def fixture_text(name: str) -> str:
    return (FIXTURES / f"ncu-{name}.csv").read_text()


def fixture_raw(name: str) -> dict:
    rows = profile.parse_csv(fixture_text(name))
    assert len(rows) == 1
    return rows[0]


def fixture_kernel(name: str) -> dict:
    return profile.kernel_fields(fixture_raw(name))


def fake_ncu(tmp_path: Path, body: str) -> str:
    script = tmp_path / "ncu"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, unit, expected", [
    ("364,320", "ns", 364.32e-6),
    ("364.32", "usecond", 364.32e-6),
    ("1.5", "ms", 1.5e-3),
    ("2", "msecond", 2e-3),
    ("121,219,072", "byte", 121_219_072),
    ("118.38", "Kbyte", 118_380),
    ("121.22", "Mbyte", 121.22e6),
    ("1", "Kibyte", 1024),
    ("3,522,883,794,466.40", "byte/s", 3_522_883_794_466.40),
    ("3.52", "Tbyte/s", 3.52e12),
    ("729.62", "Gbyte/second", 729.62e9),
    ("2", "byte/usecond", 2e6),
    ("1,966,285,477.05", "hz", 1_966_285_477.05),
    ("1.97", "Ghz", 1.97e9),
    ("1.97", "cycle/nsecond", 1.97e9),
    ("12.15", "%", 12.15),
    ("254", "register/thread", 254),
    ("81,866", "", 81_866),
])
def test_units_convert_to_base(text, unit, expected):
    assert profile.parse_value(text, unit) == pytest.approx(expected, rel=1e-12)


def test_every_unit_of_the_recorded_reports_parses():
    units = {unit for name in ("v13-float32", "v16-float32", "v18-bfloat16")
             for row in profile.parse_csv(fixture_text(name)) for _, unit in row.values()}
    assert {"ns", "%", "byte", "byte/s", "hz", "SM", "%/byte"} <= units
    for unit in units:
        assert profile.unit_scale(unit) > 0, unit


def test_empty_and_text_cells_are_none():
    assert profile.parse_value("", "ns") is None
    assert profile.parse_value("n/a", "%") is None
    assert profile.parse_value("(8, 12, 8)") is None


def test_unknown_unit_is_an_error():
    with pytest.raises(ValueError, match="unknown unit 'furlong!'"):
        profile.unit_scale("furlong!")


# ---------------------------------------------------------------------------------------------
# The recorded CSVs
# ---------------------------------------------------------------------------------------------


def test_v13_float32():
    k = fixture_kernel("v13-float32")
    assert k["kernel"] == "attention_forward<64, 128, 64>"
    assert (k["grid"], k["block"]) == ("(8, 12, 8)", "(128, 1, 1)")
    assert k["duration_s"] * 1e6 == pytest.approx(364.32)
    assert k["occupancy_achieved_pct"] == pytest.approx(12.15)
    assert k["occupancy_theoretical_pct"] == pytest.approx(12.50)
    assert k["occupancy_limiter"] == ["registers", "shared memory"]  # 2 blocks each; warps 16, blocks 32
    assert k["occupancy_limits"] == {"registers": 2, "shared memory": 2, "warps": 16, "blocks": 32}
    assert k["sm_pct"] == pytest.approx(66.81)
    assert k["memory_pct"] == pytest.approx(46.22)
    assert (k["dram_read_bytes"], k["dram_write_bytes"]) == (121_219_072, 14_125_056)
    assert k["dram_pct"] == pytest.approx(7.72)  # gpu__dram_throughput: the SpeedOfLight section's name
    assert k["dram_bytes_per_s"] == pytest.approx(371_497_935_880.54)
    assert k["l2_hit_pct"] == pytest.approx(54.74)
    assert k["shared_ld_bytes_per_s"] == pytest.approx(3_522_883_794_466.40)
    assert k["shared_st_bytes_per_s"] == pytest.approx(656_223_451_910.41)
    assert (k["bank_conflicts_ld"], k["bank_conflicts_st"]) == (81_866, 33_650)
    assert k["global_ld_bytes_per_s"] == pytest.approx(729_616_864_295.13)
    assert k["global_st_bytes_per_s"] == pytest.approx(172_690_382_081.69)
    assert k["tensor_pct"] == pytest.approx(0.24)
    assert k["tensor_kind"] is None  # HFMA2.MMA constant moves, no MMA
    assert k["issue_pct"] == pytest.approx(72.00)
    assert k["sm_clock_hz"] == pytest.approx(1_966_285_477.05)
    assert k["registers"] == 254


def test_v18_bfloat16():
    k = fixture_kernel("v18-bfloat16")
    assert k["duration_s"] * 1e6 == pytest.approx(48.864)
    assert k["tensor_pct"] == pytest.approx(32.63)
    assert (k["hmma_pct"], k["gmma_pct"]) == (pytest.approx(1.53), pytest.approx(3.06))
    assert k["tensor_kind"] == "GMMA"
    assert k["occupancy_limiter"] == ["registers", "shared memory"]
    assert (k["occupancy_achieved_pct"], k["occupancy_theoretical_pct"]) == (pytest.approx(18.25), pytest.approx(18.75))
    # stall ratios per issue, "selected" left out: their sum is 5.02, wait 1.68 of it
    assert [r for r, _ in k["stalls_top"]] == ["wait", "long_scoreboard", "not_selected"]
    assert [s for _, s in k["stalls_top"]] == pytest.approx([1.68 / 5.02, 0.78 / 5.02, 0.67 / 5.02])
    assert sum(k["stalls"].values()) == pytest.approx(1.0)
    assert "selected" not in k["stalls"]


def test_v16_float32_one_kernel_registers_limit():
    k = fixture_kernel("v16-float32")
    assert k["duration_s"] * 1e6 == pytest.approx(202.976)
    assert k["occupancy_limiter"] == ["registers"]  # 4 blocks; shared memory 8
    assert k["dram_write_bytes"] == 0
    assert k["grid"] == "(128, 12, 1)"


def test_v13_stall_ranking_breaks_ties_by_name():
    stalls = fixture_kernel("v13-float32")["stalls_top"]
    # not_selected 0.70 of 1.69; dispatch_stall and short_scoreboard tie at 0.26
    assert [r for r, _ in stalls] == ["not_selected", "dispatch_stall", "short_scoreboard"]
    assert stalls[0][1] == pytest.approx(0.70 / 1.69)


def test_stall_shares_synthetic():
    name = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio".format
    raw = {name("barrier"): ("3", "inst"), name("long_scoreboard"): ("1", "inst"), name("wait"): ("1", "inst"),
           name("selected"): ("1", "inst"), name("mio_throttle"): ("", "inst"), "other.metric": ("9", "")}
    assert profile.stall_shares(raw) == [("barrier", 0.6), ("long_scoreboard", 0.2), ("wait", 0.2)]
    assert profile.stall_shares({name("selected"): ("1", "inst")}) == []


def test_missing_metric_is_none_and_a_dash():
    raw = fixture_raw("v13-float32")
    for name in ("lts__t_sector_hit_rate.pct", "dram__bytes_read.sum", "launch__occupancy_limit_registers",
                 "launch__occupancy_limit_shared_mem", "launch__occupancy_limit_warps",
                 "launch__occupancy_limit_blocks", "gpc__cycles_elapsed.avg.per_second"):
        del raw[name]
    k = profile.kernel_fields(raw)
    assert k["l2_hit_pct"] is None and k["dram_read_bytes"] is None and k["sm_clock_hz"] is None
    assert k["occupancy_limiter"] == [] and k["occupancy_limits"] == {}
    totals = profile.rung_totals([k])
    assert totals["dram_read_bytes"] is None and totals["duration_s"] == pytest.approx(364.32e-6)
    point = profile_render.roofline_point(10**9, totals["dram_read_bytes"], totals["dram_write_bytes"],
                                          totals["duration_s"])
    assert point["intensity"] is None and point["tflops"] == pytest.approx(1e9 / 364.32e-6 / 1e12)
    cells = profile_render.kernel_cells(k)
    assert cells[0] == "12.2 / 12.5"  # no limiter to name
    assert cells[3] == "- / 14.1"  # DRAM read / write MB
    assert cells[5] == "-"  # L2 hit


def test_parse_csv_without_a_report():
    assert profile.parse_csv("==PROF== Connected\n==WARNING== No kernels were profiled.\n") == []


def test_short_kernel_name_keeps_template_arguments():
    assert profile.short_kernel_name("void f<64, (int)2>(const float *, int)") == "f<64, (int)2>"
    assert profile.short_kernel_name("decode_step") == "decode_step"


# ---------------------------------------------------------------------------------------------
# Running ncu (a fake one) and its failures
# ---------------------------------------------------------------------------------------------


def test_run_ncu_reads_the_report_among_other_output(tmp_path):
    ncu = fake_ncu(tmp_path, f"cat '{FIXTURES / 'ncu-v18-bfloat16.csv'}'; echo 'a line of the target' >&2")
    rows = profile.run_ncu([ncu, "--csv"])
    assert len(rows) == 1 and rows[0]["gpu__time_duration.sum"] == ("48,864", "ns")


def test_permission_error_says_how_to_fix_it(tmp_path):
    ncu = fake_ncu(tmp_path, 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access '
                             'NVIDIA GPU Performance Counters on the target device 0."; exit 1')
    with pytest.raises(CannotRun) as info:
        profile.run_ncu([ncu])
    message = str(info.value)
    assert "ERR_NVGPUCTRPERM" in message and "root" in message
    assert "NVreg_RestrictProfilingToAdminUsers=0" in message
    assert "\n" not in message


def test_a_failing_rung_is_an_error_row(tmp_path):
    ncu = fake_ncu(tmp_path, "echo '==PROF== Connected'; echo 'profile_target: v99: no such rung' >&2; exit 2")
    row = profile.profile_row(ncu, "v99", "rung", ["python"], 10)
    assert row["status"] == "error" and row["reason"] == "profile_target: v99: no such rung"
    ncu = fake_ncu(tmp_path, "echo '==ERROR== The application returned an error code (1).'; exit 1")
    assert profile.profile_row(ncu, "v1", "rung", ["python"], 10)["reason"] == \
        "The application returned an error code (1)."
    ncu = fake_ncu(tmp_path, "echo '==ERROR== The application returned an error code (1).'; "
                             "echo 'Traceback (most recent call last):' >&2; echo 'RuntimeError: CUDA out of memory' >&2")
    assert profile.profile_row(ncu, "v1", "rung", ["python"], 10)["reason"] == "RuntimeError: CUDA out of memory"
    broken = fixture_text("v13-float32").replace('"ns"', '"fortnight"')
    (tmp_path / "broken.csv").write_text(broken)
    ncu = fake_ncu(tmp_path, f"cat '{tmp_path / 'broken.csv'}'")
    assert profile.profile_row(ncu, "v1", "rung", ["python"], 10)["reason"] == "unknown unit 'fortnight' in ncu's output"
    ncu = fake_ncu(tmp_path, "echo '==WARNING== No kernels were profiled.'")
    assert "no kernel" in profile.profile_row(ncu, "v1", "rung", ["python"], 10)["reason"]


def test_profile_row_from_a_fake_ncu(tmp_path):
    ncu = fake_ncu(tmp_path, f"cat '{FIXTURES / 'ncu-v13-float32.csv'}'")
    flops = attention_flops(8, 12, 1024, 64)
    row = profile.profile_row(ncu, "v13_fa2_partitioning", "rung", ["python"], flops)
    assert row["status"] == "ok" and len(row["kernels"]) == 1
    assert row["dram_bytes"] == 121_219_072 + 14_125_056
    assert row["intensity"] == pytest.approx(flops / row["dram_bytes"])
    assert row["tflops"] == pytest.approx(flops / 364.32e-6 / 1e12)


def test_missing_ncu(tmp_path, monkeypatch):
    with pytest.raises(CannotRun, match=r"--ncu .*nope: no such executable"):
        profile.find_ncu(str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(profile, "NCU_FALLBACK", tmp_path / "cuda" / "bin" / "ncu")
    with pytest.raises(CannotRun) as info:
        profile.find_ncu(None)
    assert "not on PATH" in str(info.value) and "--ncu PATH" in str(info.value)
    ncu = fake_ncu(tmp_path, "exit 0")
    assert profile.find_ncu(None) == ncu  # on PATH now
    assert profile.find_ncu(ncu) == ncu


def test_cmd_profile_without_ncu_exits_before_the_gpu(tmp_path):
    args = parse(["profile", "--ncu", str(tmp_path / "nope")])
    with pytest.raises(CannotRun, match="no such executable"):
        profile.cmd_profile(args)


def test_ncu_command_for_a_rung():
    target = profile.target_args("kernels/v13_fa2_partitioning.cu", (8, 1024), "float32")
    assert target[1:] == ["-m", "benchmarks.profile_target", "--dtype", "float32", "--kernel",
                          "kernels/v13_fa2_partitioning.cu", "--shape", "8x1024"]
    command = profile.ncu_command("/usr/local/cuda/bin/ncu", target)
    text = " ".join(command)
    assert command[0] == "/usr/local/cuda/bin/ncu"
    for part in ("--profile-from-start off", "--clock-control none", "--csv --page raw", "--section SpeedOfLight",
                 "--section Occupancy", "--section WarpStateStats", "--section MemoryWorkloadAnalysis_Tables"):
        assert part in text
    metrics = command[command.index("--metrics") + 1].split(",")
    assert "dram__bytes_read.sum" in metrics and "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum" in metrics
    assert not any("gmma_cycles_active" in m for m in metrics)  # no such metric on gh100
    assert command[-len(target):] == target
    assert profile.target_args(None, None, "bfloat16")[-3:] == ["--dtype", "bfloat16", "--decode"]
    assert profile.target_args(None, None, "float32", size="gpt2-xl")[-3:] == ["--decode", "--size", "gpt2-xl"]


def test_every_metric_is_in_the_recorded_report():
    """The H200 run asked for these metrics and sections: each extra metric and each field is in its CSV."""
    header = fixture_raw("v18-bfloat16")
    for metric in profile.EXTRA_METRICS:
        assert metric in header, metric
    for field, names in profile.METRICS.items():
        assert any(name in header for name in names), field
    for name in profile.LIMITERS.values():
        assert name in header


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile.add_profile_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    return args


def test_flags_and_defaults():
    args = parse(["profile"])
    assert (args.kernels, args.shape, args.dtype, args.decode, args.ncu, args.results) == \
        (None, None, "float32", True, None, results.SCRATCH)  # the shared --save / --results of every subcommand
    args = parse(["profile", "--kernels", "v13,v18", "--shape", "1x512", "--shape", "8x1024", "--dtype", "bfloat16",
                  "--no-decode", "--ncu", "/opt/ncu", "--save"])
    assert [p.stem for p in args.kernels] == ["v13_fa2_partitioning", "v18_wgmma"]
    assert args.shape == [(1, 512), (8, 1024)]
    assert (args.dtype, args.decode, args.ncu) == ("bfloat16", False, "/opt/ncu")
    assert args.results == results.RESULTS
    assert parse(["profile", "--results", "/tmp/r"]).results == Path("/tmp/r")


def test_bad_flags_are_refused(capsys):
    for argv in (["profile", "--shape", "8by1024"], ["profile", "--dtype", "float64"], ["profile", "--kernels", "v99"]):
        with pytest.raises(SystemExit):
            parse(argv)
    assert "v99" in capsys.readouterr().err


def test_skip_reasons():
    assert profile.skip_reason(kernels.resolve("v13"), "float32", "sm_90") is None
    assert "does not take float32" in profile.skip_reason(kernels.resolve("v18"), "float32", "sm_90")
    assert "needs sm_90" in profile.skip_reason(kernels.resolve("v18"), "bfloat16", "sm_80")


def test_roofs_of_the_ceilings():
    assert profile.roofs_of({"ffma_tflops": 51.0, "copy_tbps": 4.27}) == {"fp32 FFMA": 51.0}
    assert profile.roofs_of({"ffma_tflops": 51.0, "bf16_tflops": 679.0, "tf32_tflops": None}) == \
        {"fp32 FFMA": 51.0, "bf16 tensor": 679.0}


def test_target_refuses_an_unknown_rung(capsys):
    pytest.importorskip("cupy")
    assert profile_target.main(["--kernel", "v99", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("profile_target: ") and "v99" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        profile_target.main(["--kernel", "v13", "--shape", "0x1024"])
    assert profile_target.main(["--kernel", "v13", "--size", "gpt2-xl"]) == 2
    assert "--size goes with --decode" in capsys.readouterr().err
    assert profile_target.main(["--decode", "--size", "gpt3"]) == 2
    assert "no GPT-2 size 'gpt3'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The result: table, roofline, docs section
# ---------------------------------------------------------------------------------------------


def ok_row(name: str, fixtures: list[str], flops: int) -> dict:
    row = {"name": name, "kind": "rung", "flops": flops, "status": "ok", "shape": {"B": 8, "T": 1024, "NH": 12, "d": 64},
           "kernels": [fixture_kernel(f) for f in fixtures]}
    row.update(profile.rung_totals(row["kernels"]))
    row.update(profile_render.roofline_point(flops, row["dram_read_bytes"], row["dram_write_bytes"],
                                             row["duration_s"]))
    return row


def make_result() -> dict:
    flops = attention_flops(8, 12, 1024, 64)
    rows = [ok_row("v13_fa2_partitioning", ["v13-float32"], flops),
            ok_row("v16_decode_split_kv", ["v16-float32", "v16-float32"], flops),  # as a split and a combine
            {"name": "v18_wgmma", "kind": "rung", "shape": {"B": 8, "T": 1024, "NH": 12, "d": 64},
             "status": "skipped", "reason": "does not take float32 (lab.dtypes bfloat16)"},
            {"name": "decode step", "kind": "decode", "shape": None, "status": "error", "reason": "ncu timed out"}]
    setup = {"date": "2026-11-26T10:00:00Z", "command": "python3 bench.py profile", "git": "abc123", "cupy": "14.2.0",
             "torch": "2.11", "device": {"name": "NVIDIA H200", "arch": "sm_90", "sm_count": 132,
                                         "memory_bytes": 150 * 2**30, "driver": "580.65.06", "driver_cuda": "13.0",
                                         "cuda_runtime": "13.0"}}
    return {"schema": results.SCHEMA, "kind": "profile", "setup": setup, "flop_convention": FLOP_CONVENTION,
            "ceilings": {"ffma_tflops": 51.0, "copy_tbps": 4.27}, "roofs": {"fp32 FFMA": 51.0, "TF32 tensor": 349.0},
            "dtype": "float32", "shapes": [{"B": 8, "T": 1024, "NH": 12, "d": 64}], "decode": True,
            "ncu": {"version": "2025.3.1.0", "clock_control": "none"}, "sm_clock_hz": profile_render.median_clock(rows),
            "rows": rows}


def test_median_clock():
    result = make_result()
    assert result["sm_clock_hz"] == pytest.approx(1_959_136_178.66)  # v13's, v16's twice: the median is v16's


def test_roofline_arithmetic():
    flops = attention_flops(8, 12, 1024, 64)
    assert flops == 4 * 8 * 12 * 1024 * 1024 * 64 // 2
    point = profile_render.roofline_point(flops, 121_219_072, 14_125_056, 364.32e-6)
    assert point["dram_bytes"] == 135_344_128
    assert point["intensity"] == pytest.approx(12_884_901_888 / 135_344_128)  # about 95 FLOP per byte
    assert point["tflops"] == pytest.approx(35.367, rel=1e-4)
    assert profile_render.roofline_point(flops, 0, 0, 1e-3)["intensity"] is None  # nothing from DRAM
    assert profile_render.roofline_point(None, 1, 1, 1e-3) == {"dram_bytes": 2, "intensity": None, "tflops": None}
    several = make_result()["rows"][1]
    assert several["duration_s"] == pytest.approx(2 * 202.976e-6)
    assert profile_render.roofline_points(make_result()) == [
        ("v13_fa2_partitioning", pytest.approx(95.2, rel=1e-3), pytest.approx(35.367, rel=1e-4), "ffma"),
        ("v16_decode_split_kv", pytest.approx(flops / 19_006_464), pytest.approx(flops / 405.952e-6 / 1e12), "ffma")]


def test_table():
    result = make_result()
    text = profile_render.render_profile(result)
    assert "**SM clock 1.96 GHz**" in text and "--clock-control none" in text and "NVIDIA H200" in text
    assert "fp32 FFMA 51.0 TFLOP/s; TF32 tensor 349.0 TFLOP/s; copy 4.27 TB/s" in text
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert {line.count("|") - line.count("\\|") for line in lines} == {len(profile_render.COLUMNS) + 1}
    assert len(lines) == 2 + 1 + 3 + 1 + 1  # header, rule; v13; v16's two kernels and its total; skipped; error
    v13 = next(line for line in lines if "v13_fa2" in line)
    for cell in ("`attention_forward<64, 128, 64>` (8, 12, 8)x(128, 1, 1)", "364.3", "35.37",
                 "12.2 / 12.5 (registers = shared memory)", "66.8", "121.2 / 14.1", "0.37 (7.7%)", "54.7",
                 "3.52 / 0.66", "81,866 / 33,650", "0.73 / 0.17", "| 0.2 |", "72.0",
                 "not_selected 41%, dispatch_stall 15%, short_scoreboard 15%"):
        assert cell in v13, cell
    total = next(line for line in lines if "all 2 kernels" in line)
    assert "406.0" in total and "19.0 / 0.0" in total
    assert "**skipped**: does not take float32" in text and "**error**: ncu timed out" in text


def test_tensor_cell_names_the_kind():
    assert profile_render.tensor_cell(fixture_kernel("v18-bfloat16")) == "32.6 (GMMA)"
    assert profile_render.tensor_cell({"tensor_pct": None}) == "-"


def test_progress_lines():
    result = make_result()
    assert profile_render.progress_line(result["rows"][0]).startswith("v13_fa2_partitioning 8x1024: 364.3 us, 35.37")
    assert "(2 kernels)" in profile_render.progress_line(result["rows"][1])
    assert profile_render.progress_line(result["rows"][3]) == "decode step : error: ncu timed out"


def test_docs_section():
    text = profile_render.render_profile_doc(make_result(), "../results/profile-nvidia-h200-20261126T100000Z.json",
                                             "../results/profile-nvidia-h200-20261126T100000Z.png")
    assert text.startswith("<!-- generated by `python3 bench.py profile` from "
                           "`../results/profile-nvidia-h200-20261126T100000Z.json`")
    assert "(../results/profile-nvidia-h200-20261126T100000Z.png)" in text and "SM clock 1.96 GHz" in text
    assert "](" not in profile_render.render_profile_doc(make_result(), "r.json", None)


def test_result_is_strict_json(tmp_path):
    result = copy.deepcopy(make_result())
    path = results.write_result(result, results.result_path("profile", result["setup"], tmp_path))
    assert path.name == "profile-nvidia-h200-20261126T100000Z.json"
    assert '"stalls_top"' in path.read_text()


def test_roofline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    result = make_result()
    name = plots.plot_or_none(profile_render.plot_result, result, tmp_path / "roofline.png")
    png = (tmp_path / name).read_bytes()
    assert name == "roofline.png" and len(png) > 10_000 and png.startswith(b"\x89PNG")
    plt = plots._pyplot()
    fig = profile_render.plot_roofline(plt, [], {"fp32 FFMA": 51.0}, 4.27, "no points")  # roofs only
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    lo, hi = ax.get_xlim()
    assert lo < 51.0 / 4.27 < hi and not math.isnan(lo)
    plt.close(fig)


def test_spread_keeps_labels_apart_and_near_their_points():
    assert profile_render.spread([0.0, 1.0, 2.0, 10.0], 3.0) == [-2.0, 1.0, 4.0, 10.0]  # a crowd centred on itself
    assert profile_render.spread([5.0, 5.0, 5.0], 2.0) == [3.0, 5.0, 7.0]
    assert profile_render.spread([9.0, 0.0], 1.0) == [9.0, 0.0]  # apart already: left where they are, in order
    assert profile_render.columns([(0, 5), (3, 8), (10, 12), (11, 13), (20, 21)]) == [[0, 1], [2, 3], [4]]
    # moved up past an obstacle (a roof's label) that a label would cross, in order, each clear of the last
    assert profile_render.clear_of([0.0, 10.0, 30.0], 4.0, [(2.0, 8.0), (12.0, 20.0)]) == [8.0, 20.0, 30.0]
    assert profile_render.clear_of([5.0], 4.0, [(0.0, 1.0)]) == [5.0]  # clear already: left where it is


def test_roofline_labels_do_not_print_over_each_other():
    """A crowd of points at one intensity (as the scalar rungs are) and two roofs a few TFLOP/s apart (fp16's
    and bf16's): no two labels' boxes intersect once drawn."""
    pytest.importorskip("matplotlib")
    plt = plots._pyplot()
    points = [(f"v{i:02d}_a_rung_name", 135.0 + i % 3, 6.0 + 0.15 * i, "ffma") for i in range(12)]
    points += [("v14_tf32_mma", 66.0, 55.0, "tf32x3"), ("v20_tf32_wgmma", 95.0, 60.0, "tf32x3")]
    fig = profile_render.plot_roofline(plt, points, {"fp16 tensor": 753.0, "bf16 tensor": 740.0, "FFMA": 51.0},
                                       4.24, "crowded")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].texts if "TFLOP/s" in t.get_text() or t.get_text().startswith("v")]
    assert len(labels) == len(points) + 3
    boxes = [t.get_window_extent(renderer) for t in labels]
    crossing = [(labels[i].get_text(), labels[j].get_text()) for i in range(len(boxes)) for j in range(i)
                if boxes[i].overlaps(boxes[j])]
    assert not crossing, crossing
    plt.close(fig)


def test_point_labels_do_not_print_over_the_roofs_labels():
    """FP8 points just under the bf16 and fp16 roofs, near the right edge where the roofs' labels are
    (H200, v27 and v29 at 2x32x4096-d128 and 16x12x2048-d64): no label's box crosses another's."""
    pytest.importorskip("matplotlib")
    plt = plots._pyplot()
    points = [("v27_fp8_row_sums 2x32x4096-d128", 1774.1, 759.2, "fp8"), ("v29_fp8_wide_keys 2x32x4096-d128", 1753.0, 748.9, "fp8"),
              ("v27_fp8_row_sums 16x12x2048-d64", 914.1, 434.0, "fp8"), ("v29_fp8_wide_keys 16x12x2048-d64", 914.7, 432.9, "fp8")]
    roofs = {"fp32 FFMA": 51.3, "TF32 tensor": 360.3, "bf16 tensor": 800.8, "fp16 tensor": 769.4, "fp8 tensor (e4m3)": 1465.7}
    fig = profile_render.plot_roofline(plt, points, roofs, 4.26, "fp8 under the roofs")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].texts if "TFLOP/s" in t.get_text() or t.get_text().startswith("v")]
    assert len(labels) == len(points) + len(roofs)
    boxes = [t.get_window_extent(renderer) for t in labels]
    crossing = [(labels[i].get_text(), labels[j].get_text()) for i in range(len(boxes)) for j in range(i)
                if boxes[i].overlaps(boxes[j])]
    assert not crossing, crossing
    plt.close(fig)


def fake_device(monkeypatch, ceilings: dict) -> None:
    """cmd_profile on no GPU: make_result()'s setup, these ceilings, no plot."""
    setup = make_result()["setup"]
    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(device, "setup_info", lambda argv: copy.deepcopy(setup))
    monkeypatch.setattr(timing, "measure_ceilings", lambda method: dict(ceilings))
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, r, path: None)


def test_cmd_profile_end_to_end_with_a_fake_ncu(tmp_path, monkeypatch, capsys):
    """The whole command on a fake ncu (which answers every target with v13's report) and a fake device:
    a skipped rung, a profiled one, the decode step, the result file, the table."""
    fake_device(monkeypatch, {"ffma_tflops": 51.0, "copy_tbps": 4.27})
    ncu = fake_ncu(tmp_path, f"cat '{FIXTURES / 'ncu-v13-float32.csv'}'")
    args = parse(["profile", "--kernels", "v13,v18", "--ncu", ncu, "--results", str(tmp_path / "results")])
    assert profile.cmd_profile(args) == 0
    written = list((tmp_path / "results").glob("profile-nvidia-h200-*.json"))
    assert len(written) == 1
    saved = results.load_result(written[0])
    assert saved["kind"] == "profile" and saved["schema"] == results.SCHEMA and saved["plot"] is None
    assert [(r["name"], r["status"]) for r in saved["rows"]] == [
        ("v13_fa2_partitioning", "ok"), ("v18_wgmma", "skipped"), ("decode step", "ok")]
    assert saved["rows"][0]["tflops"] == pytest.approx(35.367, rel=1e-4)
    assert saved["rows"][2]["flops"] is None and saved["rows"][2]["tflops"] is None
    assert saved["roofs"] == {"fp32 FFMA": 51.0} and saved["sm_clock_hz"] == pytest.approx(1_966_285_477.05)
    out = capsys.readouterr().out
    assert "SM clock 1.97 GHz" in out and f"wrote {written[0]}" in out


def test_decode_step_dtypes():
    assert profile.decode_skip_reason("bfloat16") is None and profile.decode_skip_reason("float32") is None
    assert "float32 and bfloat16" in profile.decode_skip_reason("float16")


def docs_folder(tmp_path: Path) -> Path:
    """A checkout's README.md and docs/results.md (bench's fixtures) under tmp_path: the docs folder."""
    from tests.bench.helpers import FIXTURES as BENCH_FIXTURES

    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text((BENCH_FIXTURES / "bench_readme.md").read_text())
    (docs / "results.md").write_text((BENCH_FIXTURES / "bench_results_doc.md").read_text())
    return docs


def test_readme_writes_the_newest_profile_of_each_dtype_into_docs_profile(tmp_path, capsys):
    from benchmarks import cli

    docs = docs_folder(tmp_path)
    page = docs / "profile.md"
    page.write_text("# Profile\n\nIntro.\n\n<!-- bench:profile:start -->\nold\n<!-- bench:profile:end -->\n\nEnd.\n")
    store = tmp_path / "results"
    older = make_result()
    older["setup"]["date"] = "2026-11-25T10:00:00Z"
    bf16 = make_result() | {"dtype": "bfloat16", "plot": "profile-bf16.png"}
    for result in (older, make_result(), bf16):
        results.write_result(result, results.result_path("profile", result["setup"], store))
    argv = ["readme", "--readme", str(tmp_path / "README.md"), "--results-doc", str(docs / "results.md"),
            "--results", str(store)]
    assert cli.main(argv, "doc") == 0
    text = page.read_text()
    assert text.startswith("# Profile\n\nIntro.\n\n<!-- bench:profile:start -->\n") and text.endswith("End.\n")
    assert "old" not in text and text.count("Results file: [profile-nvidia-h200-") == 2
    assert "(../results/profile-nvidia-h200-20261126T100000Z.json)" in text  # the newer float32 one
    assert "20261125T100000Z" not in text
    assert text.index("float32, B x T") < text.index("bfloat16, B x T")
    assert "![roofline of the bfloat16 rungs" in text and "(../results/profile-bf16.png)" in text
    assert "SM clock 1.96 GHz" in text
    page.unlink()  # without profile results, a docs folder needs no profile page
    capsys.readouterr()
    assert cli.main(argv[:-2] + ["--results", str(tmp_path / "none")], "doc") == 0
    assert not page.exists() and "profile.md" not in capsys.readouterr().out


def test_bench_py_lists_profile():
    from benchmarks import cli

    assert cli.COMMANDS["profile"] is profile.cmd_profile
    args = cli.build_parser("doc\n\nmore").parse_args(["profile"])
    assert args.kernels is None and args.results == results.SCRATCH  # cmd_profile takes every rung


# ---------------------------------------------------------------------------------------------
# docs/ladder.md's counters: a short row per rung
# ---------------------------------------------------------------------------------------------


def ladder_result() -> dict:
    """v12 and v14 around a skipped v13, the split-KV v16 (two kernels) and v17, an errored v18, the decode step."""
    flops = attention_flops(8, 12, 1024, 64)
    result = make_result()
    result["rows"] = [
        ok_row("v12_o_in_registers", ["v13-float32"], flops),  # 364.32 us
        {"name": "v13_fa2_partitioning", "kind": "rung", "shape": {"B": 8, "T": 1024, "NH": 12, "d": 64},
         "status": "skipped", "reason": "does not take float32"},
        ok_row("v14_tf32_mma", ["v16-float32"], flops),  # 202.976 us
        ok_row("v16_decode_split_kv", ["v16-float32", "v13-float32"], flops),  # 567.296 us: v13's kernel the longest
        ok_row("v17_decode_cluster", ["v13-float32"], flops),
        {"name": "v18_wgmma", "kind": "rung", "shape": {"B": 8, "T": 1024, "NH": 12, "d": 64},
         "status": "error", "reason": "ncu timed out"},
        ok_row("decode step", ["v13-float32"], None) | {"kind": "decode", "shape": None}]
    return result


def test_counter_rows_compare_each_rung_with_the_one_before_it_that_ran():
    rows = profile_render.counter_rows(ladder_result())
    assert [r[0] for r in rows] == ["[`v12_o_in_registers`](#v12)", "[`v14_tf32_mma`](#v14)",
                                    "[`v16_decode_split_kv`](#v16) (2 kernels)", "[`v17_decode_cluster`](#v17)"]
    v12, v14, v16, v17 = rows
    assert v12[1:3] == ["364.3", "-"]
    assert v14[1:3] == ["203.0", f"{364.32 / 202.976:.2f}x (v12)"]  # past the skipped v13
    assert v16[1:3] == ["567.3", "-"]  # the split-KV rungs are a line of their own: none before v16
    assert v17[2] == f"{567.296 / 364.32:.2f}x (v16)"
    assert v12[3:] == ["12.2 / 12.5 (registers = shared memory)", "81,866 / 33,650", "3.52 / 0.66", "0.2", "72.0",
                       "121.2", "not_selected 41%"]
    assert v16[3] == v12[3] and v16[4] == "81,866 / 33,650"  # the longest kernel's counters
    assert v16[8] == "130.7"  # DRAM reads: the rung's, both kernels' (121.2 + 9.5 MB)
    one_line = profile_render.counter_rows(ladder_result(), line=lambda name: False)
    assert one_line[2][2] == f"{202.976 / 567.296:.2f}x (v14)"


def test_counter_rows_compare_at_the_same_shape():
    flops = attention_flops(8, 12, 1024, 64)
    result = make_result()
    result["shapes"] = [{"B": 8, "T": 1024, "NH": 12, "d": 64}, {"B": 1, "T": 512, "NH": 12, "d": 64}]
    small = {"B": 1, "T": 512, "NH": 12, "d": 64}
    result["rows"] = [ok_row("v12_o_in_registers", ["v13-float32"], flops),
                      ok_row("v12_o_in_registers", ["v16-float32"], flops) | {"shape": small},
                      ok_row("v14_tf32_mma", ["v16-float32"], flops),
                      ok_row("v14_tf32_mma", ["v13-float32"], flops) | {"shape": small}]
    rows = profile_render.counter_rows(result)
    assert [r[0] for r in rows] == ["[`v12_o_in_registers`](#v12) 8x1024", "[`v12_o_in_registers`](#v12) 1x512",
                                    "[`v14_tf32_mma`](#v14) 8x1024", "[`v14_tf32_mma`](#v14) 1x512"]
    assert [r[2] for r in rows] == ["-", "-", f"{364.32 / 202.976:.2f}x (v12)", f"{202.976 / 364.32:.2f}x (v12)"]


def test_split_kv_rungs_come_from_the_ladder():
    assert profile_render.splits_keys("v16_decode_split_kv") and profile_render.splits_keys("v17_decode_cluster")
    assert not profile_render.splits_keys("v13_fa2_partitioning")
    assert not profile_render.splits_keys("v99_no_longer_there")


def test_render_counters():
    text = profile_render.render_counters(ladder_result())
    assert text.startswith("**float32**, B x T 8x1024, NH=12, d=64: NVIDIA H200, 2026-11-26, SM clock 1.96 GHz")
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 4 and {line.count("|") for line in lines} == {len(profile_render.COUNTER_COLUMNS) + 1}
    assert text.endswith("Not in this table: `v13_fa2_partitioning`: skipped, does not take float32; "
                         "`v18_wgmma`: error, ncu timed out.")
    assert "decode step" not in text  # the decode step is a model's kernel, not a rung: profile.md has it
    assert "Not in this table" not in profile_render.render_counters(make_result() | {"rows": make_result()["rows"][:2]})


def test_readme_writes_the_counters_into_the_ladder_page(tmp_path, capsys):
    from benchmarks import cli
    from tests.bench.helpers import FIXTURES as BENCH_FIXTURES

    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text((BENCH_FIXTURES / "bench_readme.md").read_text())
    (docs / "results.md").write_text((BENCH_FIXTURES / "bench_results_doc.md").read_text())
    ladder = docs / "ladder.md"
    before = ("# The ladder\n\n<a id=\"v12\"></a>\n\n## v12\n\nSee [its row](#counters).\n\n<a id=\"counters\"></a>\n\n"
              "## Counters\n\n<!-- bench:counters:start -->\nold\n<!-- bench:counters:end -->\n\nEnd.\n")
    ladder.write_text(before)
    (docs / "profile.md").write_text("<!-- bench:profile:start -->\n<!-- bench:profile:end -->\n")
    argv = ["readme", "--readme", str(tmp_path / "README.md"), "--results-doc", str(docs / "results.md")]
    assert cli.main(argv + ["--results", str(tmp_path / "none")], "doc") == 0  # no profile: the page is left alone
    assert ladder.read_text() == before
    store = tmp_path / "results"
    bf16 = ladder_result() | {"dtype": "bfloat16"}
    bf16["setup"] = bf16["setup"] | {"date": "2026-11-26T10:05:00Z"}
    for result in (ladder_result(), bf16):
        results.write_result(result, results.result_path("profile", result["setup"], store))
    capsys.readouterr()
    assert cli.main(argv + ["--results", str(store)], "doc") == 0
    assert "ladder.md: rewrote counters" in capsys.readouterr().out
    text = ladder.read_text()
    head, _, rest = text.partition("<!-- bench:counters:start -->\n")
    block, _, tail = rest.partition("<!-- bench:counters:end -->")
    assert head == before.partition("<!-- bench:counters:start -->\n")[0] and tail == "\n\nEnd.\n"
    assert "old" not in block and block.count("Results file: [profile-nvidia-h200-") == 2
    assert "(../results/profile-nvidia-h200-20261126T100000Z.json)" in block
    assert "(../results/profile-nvidia-h200-20261126T100500Z.json)" in block
    assert block.index("**float32**") < block.index("**bfloat16**") and "[`v12_o_in_registers`](#v12)" in block
    assert "| occupancy" in block and "bench:profile" not in text  # the ladder page gets the counters only
    elsewhere = tmp_path / "elsewhere.md"  # --ladder-doc names another page
    elsewhere.write_text("<!-- bench:counters:start -->\n<!-- bench:counters:end -->\n")
    assert cli.main(argv + ["--results", str(store), "--ladder-doc", str(elsewhere)], "doc") == 0
    assert "**bfloat16**" in elsewhere.read_text()


def test_an_fp8_rung_is_drawn_against_the_e4m3_roof():
    """v25 (lab.fp8) computes on e4m3: its point takes the e4m3 roof's color and marker, a legend says so;
    an older result's row without "math" is read from its rung."""
    pytest.importorskip("matplotlib")
    assert profile_render.point_math({"name": "v25_fp8", "kind": "rung"}, "bfloat16") == "fp8"
    assert profile_render.point_math({"name": "v24_persistent", "kind": "rung"}, "bfloat16") == "bf16"
    assert profile_render.point_math({"name": "v99_gone", "kind": "rung"}, "bfloat16") is None
    plt = plots._pyplot()
    roofs = {"bf16 tensor": 740.0, "fp8 tensor (e4m3)": 1450.0}
    fig = profile_render.plot_roofline(plt, [("v24_persistent", 300.0, 480.0, "bf16"), ("v25_fp8", 400.0, 700.0, "fp8")],
                                       roofs, 4.24, "fp8")
    ax = fig.axes[0]
    marks = {line.get_marker(): line.get_color() for line in ax.lines if line.get_marker() in ("o", "D")}
    roof = next(line for line in ax.lines if line.get_ydata()[0] == 1450.0)
    assert marks == {"o": "C0", "D": profile_render.FP8_COLOR} and roof.get_color() == profile_render.FP8_COLOR
    assert "against the fp8 tensor (e4m3) roof" in [t.get_text() for t in ax.get_legend().get_texts()][1]
    plt.close(fig)
    fig = profile_render.plot_roofline(plt, [("v24_persistent", 300.0, 480.0, "bf16")], roofs, 4.24, "no fp8 point")
    assert fig.axes[0].get_legend() is None
    plt.close(fig)
