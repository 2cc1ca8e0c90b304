"""bench.py sass without a GPU: a source page that ncu printed on an H200 for v26 at 2x32x4096-d128 (its
header and three stretches of the consumer's loop and the producer's, tests/fixtures/ncu/), parsed,
summarized, rendered; the command run on a fake ncu."""

import argparse
import json

import pytest

from benchmarks import sass
from tests.test_profile import FIXTURES, fake_device, fake_ncu

PAGE = FIXTURES / "sass-v26-bfloat16-2x32x4096-d128.csv"


def test_the_source_page_is_parsed_instruction_by_instruction():
    rows = sass.parse_source(PAGE.read_text())
    assert len(rows) == 169 and all(set(r) == {"address", "sass", "opcode", "samples", "executed"} for r in rows)
    by_sass = {r["sass"]: r for r in rows}
    depbar = by_sass["WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert depbar["opcode"] == "WARPGROUP" and depbar["executed"] == 253_952 and depbar["samples"] > 0
    spin = [r for r in rows if r["sass"].startswith("@!P0 BRA")]  # a predicate is not the opcode
    assert spin and {r["opcode"] for r in spin} == {"BRA"}
    assert {r["opcode"] for r in rows} >= {"QGMMA", "FMNMX", "FSEL", "SYNCS", "UTMALDG"}
    assert all(isinstance(r["samples"], int) and isinstance(r["executed"], int) for r in rows)


def test_the_summary_shares_add_up_and_list_the_hot_instructions_in_program_order():
    rows = sass.parse_source(PAGE.read_text())
    s = sass.summarize(rows, top=5)
    assert s["instructions"] == 169 and s["samples"] == sum(r["samples"] for r in rows)
    assert sum(o["samples"] for o in s["opcodes"]) == pytest.approx(1.0)
    assert sum(o["executed"] for o in s["opcodes"]) == pytest.approx(1.0)
    shares = [o["samples"] for o in s["opcodes"]]
    assert shares == sorted(shares, reverse=True)
    assert len(s["hot"]) == 5 and [h["index"] for h in s["hot"]] == sorted(h["index"] for h in s["hot"])
    coldest_hot = min(h["samples"] for h in s["hot"]) * s["samples"]
    assert all(r["samples"] <= coldest_hot for i, r in enumerate(rows) if i not in {h["index"] for h in s["hot"]})
    # the producer's spin on V's empty barrier, and the consumers' wait for S, among the five
    assert {"@!P0 BRA 0x7f19417b15f0", "WARPGROUP.DEPBAR.LE gsb0, 0x1"} <= {h["sass"] for h in s["hot"]}
    text = sass.render({"name": "v26_fp8_persistent", "case": "2x32x4096-d128", "summary": s})
    assert "| opcode | % of samples | % of instructions executed |" in text and "| `WARPGROUP` |" in text
    assert "`WARPGROUP.DEPBAR.LE gsb0, 0x1`" in text


@pytest.mark.parametrize("text, message", [
    ("==PROF== nothing here\n", "no source page"),
    ('"Address","Source"\n"0x1","FADD R1, R2, R3"\n', "lacks the columns"),
    ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n', "no instructions"),
])
def test_a_page_that_is_not_one_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        sass.parse_source(text)


def test_no_samples_is_a_clear_error():
    rows = [{"address": "0x0", "sass": "NOP", "opcode": "NOP", "samples": 0, "executed": 3}]
    with pytest.raises(ValueError, match="no samples"):
        sass.summarize(rows)


def test_the_commands_ask_for_the_source_counters_and_the_sass_page(tmp_path):
    report = tmp_path / "rung.ncu-rep"
    command = sass.report_command("ncu", report, ["python", "-m", "benchmarks.profile_target"])
    assert command[:3] == ["ncu", "--profile-from-start", "off"] and "--set" in command and "full" in command
    assert command[command.index("-o") + 1] == str(tmp_path / "rung")  # ncu adds .ncu-rep itself
    assert command[-3:] == ["python", "-m", "benchmarks.profile_target"]
    assert sass.source_command("ncu", report) == ["ncu", "-i", str(report), "--page", "source", "--csv",
                                                  "--print-source", "sass"]


def parse(argv):
    parser = argparse.ArgumentParser()
    sass.add_sass_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    return args


def test_from_csv_needs_no_gpu(capsys):
    assert sass.cmd_sass(parse(["sass", "--from-csv", str(PAGE), "--top", "3"])) == 0
    out = capsys.readouterr().out
    assert "169 SASS instructions" in out and out.count("| `") >= 3
    with pytest.raises(SystemExit):
        parse(["sass", "--top", "0"])


def test_cmd_sass_end_to_end_with_a_fake_ncu(tmp_path, monkeypatch, capsys):
    """The whole command on a fake ncu (which writes nothing for the report and prints the fixture's page
    for -i): a rung that does not take the dtype skipped, two profiled, the result file."""
    fake_device(monkeypatch, {})
    ncu = fake_ncu(tmp_path, f'for a in "$@"; do [ "$a" = -i ] && exec cat \'{PAGE}\'; done; exit 0')
    args = parse(["sass", "--kernels", "v13,v24,v26", "--cases", "2x32x4096-d128", "--ncu", ncu,
                  "--results", str(tmp_path / "results")])
    assert sass.cmd_sass(args) == 0
    (written,) = (tmp_path / "results").glob("sass-*.json")
    saved = json.loads(written.read_text())
    assert saved["kind"] == "sass" and saved["dtype"] == "bfloat16" and "--set full" in saved["ncu"]["command"]
    assert [(e["name"], e["status"]) for e in saved["entries"]] == [
        ("v13_fa2_partitioning", "skipped"), ("v24_persistent", "ok"), ("v26_fp8_persistent", "ok")]
    assert saved["entries"][2]["summary"]["instructions"] == 169 and saved["entries"][2]["case"] == "2x32x4096-d128"
    out = capsys.readouterr().out
    assert out.count("| opcode |") == 2


def test_a_failing_ncu_names_the_rung(tmp_path, monkeypatch):
    fake_device(monkeypatch, {})
    ncu = fake_ncu(tmp_path, "echo '==ERROR== The application returned an error code (1).'; exit 1")
    args = parse(["sass", "--kernels", "v26", "--ncu", ncu, "--results", str(tmp_path)])
    assert sass.cmd_sass(args) == 1  # the result is written, the run failed
    (written,) = tmp_path.glob("sass-*.json")
    (entry,) = json.loads(written.read_text())["entries"]
    assert entry["status"] == "error"
    assert entry["reason"].startswith("v26_fp8_persistent 2x32x4096-d128: ncu exited with status 1: ==ERROR==")
