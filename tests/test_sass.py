"""bench.py sass without a GPU: source pages that ncu printed on an H200 (tests/fixtures/ncu/): v26 at
2x32x4096-d128 (its header and three stretches of the consumer's loop and the producer's) and b05's dK/dV
kernel at 4x16x4096, d=128, non-causal, before its dQ stores were made conflict-free (its header and 74 of
its instructions: the first 12, the 30 with the most samples, every shared store), parsed, summarized,
rendered; the command run on a fake ncu."""

import argparse
import json

import pytest

from benchmarks import sass
from benchmarks.device import CannotRun
from tests.test_profile import FIXTURES, fake_device, fake_ncu

PAGE = FIXTURES / "sass-v26-bfloat16-2x32x4096-d128.csv"
B05 = FIXTURES / "sass-b05-bfloat16-4x16x4096-d128-noncausal.csv"


def rows_of(path):
    (page,) = sass.parse_source(path.read_text())
    return page["rows"]


def test_the_source_page_is_parsed_instruction_by_instruction():
    (page,) = sass.parse_source(PAGE.read_text())
    assert page["kernel"] == "attention_forward<(int)128, (int)128, (int)128>"
    rows = page["rows"]
    assert len(rows) == 169 and all(set(r) == {"address", "sass", "opcode", "samples", "executed", "excessive",
                                               "stall"} for r in rows)
    by_sass = {r["sass"]: r for r in rows}
    depbar = by_sass["WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert depbar["opcode"] == "WARPGROUP" and depbar["executed"] == 253_952 and depbar["samples"] > 0
    spin = [r for r in rows if r["sass"].startswith("@!P0 BRA")]  # a predicate is not the opcode
    assert spin and {r["opcode"] for r in spin} == {"BRA"}
    assert {r["opcode"] for r in rows} >= {"QGMMA", "FMNMX", "FSEL", "SYNCS", "UTMALDG"}
    assert all(isinstance(r["samples"], int) and isinstance(r["executed"], int) for r in rows)


def test_the_summary_shares_add_up_and_list_the_hot_instructions_in_program_order():
    rows = rows_of(PAGE)
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
    assert s["excessive"] == 0 and s["conflicts"] == [] and "| % of the kernel's |" not in text


def test_each_instruction_keeps_its_top_stall_and_its_bank_conflicts():
    """b05's page: every excessive shared wavefront on the 16 64-bit stores of dQ's tile (2 wavefronts where
    1 would do, each), the wgmma waits stalled at the barrier, the mbarrier spins on long_scoreboard."""
    rows = rows_of(B05)
    assert len(rows) == 74
    conflicted = [r for r in rows if r["excessive"]]
    assert len(conflicted) == 16 and all(r["sass"].startswith("STS.64 ") for r in conflicted)
    assert {r["excessive"] for r in conflicted} == {2_097_152} and {r["executed"] for r in conflicted} == {1_048_576}
    assert not any(r["excessive"] for r in rows if r["sass"].startswith("STS ")), "dS^T's 32-bit stores conflict-free"
    by_sass = {r["sass"]: r for r in rows}
    assert by_sass["WARPGROUP.DEPBAR.LE gsb0, 0x0"]["stall"] == "barrier"
    assert by_sass["FENCE.VIEW.ASYNC.S"]["stall"] == "long_sb"
    assert by_sass["STS.64 [R13+0x2400], R182"]["stall"] == "mio"
    s = sass.summarize(rows, top=20)
    assert s["excessive"] == 16 * 2_097_152
    assert [c["sass"] for c in s["conflicts"]] == [r["sass"] for r in conflicted]  # program order
    assert sum(c["share"] for c in s["conflicts"]) == pytest.approx(1.0)
    assert {o["opcode"]: o["excessive"] for o in s["opcodes"]}["STS"] == pytest.approx(1.0)
    assert all(h["stall"] for h in s["hot"])
    text = sass.render({"name": "b05_wgmma", "kernel": "backward_dk_dv<(int)128, (int)64>", "case": "4x16x4096-d128-nc",
                        "summary": s})
    assert "**b05_wgmma** `backward_dk_dv<(int)128, (int)64>` 4x16x4096-d128-nc" in text
    assert "33,554,432 excessive shared wavefronts" in text
    assert "| excessive shared wavefronts | % of the kernel's |" in text and "| 2,097,152 | 6.2 |" in text
    assert "| barrier |" in text


def test_a_page_of_several_kernels_is_split_at_their_names():
    """A backward pass is several kernels: each table after its own "Kernel Name" row."""
    two = B05.read_text() + PAGE.read_text()
    first, second = sass.parse_source("==PROF== Disconnected\n" + two)
    assert first["kernel"].startswith("backward_dk_dv<") and len(first["rows"]) == 74
    assert second["kernel"].startswith("attention_forward<") and len(second["rows"]) == 169
    entries = sass.entries_of(sass.parse_source(two), {"name": "page", "case": None}, 5)
    assert [(e["kernel"].split("<")[0], e["status"]) for e in entries] == [("backward_dk_dv", "ok"),
                                                                          ("attention_forward", "ok")]


@pytest.mark.parametrize("text, message", [
    ("==PROF== nothing here\n", "no source page"),
    ('"Address","Source"\n"0x1","FADD R1, R2, R3"\n', "lacks the columns"),
    ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n', "no instructions"),
])
def test_a_page_that_is_not_one_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        sass.parse_source(text)


def test_no_samples_is_a_clear_error_and_such_a_kernel_is_skipped():
    rows = [{"address": "0x0", "sass": "NOP", "opcode": "NOP", "samples": 0, "executed": 3, "excessive": 0,
             "stall": None}]
    with pytest.raises(ValueError, match="no samples"):
        sass.summarize(rows)
    (entry,) = sass.entries_of([{"kernel": "backward_preprocess<64>", "rows": rows}], {"name": "b05", "case": "c"}, 5)
    assert entry["status"] == "skipped" and "no samples" in entry["reason"] and entry["kernel"] == "backward_preprocess<64>"


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
    assert sass.cmd_sass(parse(["sass", "--from-csv", str(B05)])) == 0
    assert "STS.64 [R11], R152" in capsys.readouterr().out


def run_on_a_fake_ncu(tmp_path, monkeypatch, page, argv: list[str]) -> dict:
    """cmd_sass on a fake device and a fake ncu (which logs its arguments to tmp_path/calls, writes nothing
    for the report and prints `page` for -i): the result file it wrote."""
    fake_device(monkeypatch, {})
    calls = tmp_path / "calls"
    ncu = fake_ncu(tmp_path, f'echo "$@" >> \'{calls}\'; for a in "$@"; do [ "$a" = -i ] && exec cat \'{page}\'; done; exit 0')
    args = parse(["sass", *argv, "--cases", "2x32x4096-d128", "--ncu", ncu, "--results", str(tmp_path / "results")])
    assert sass.cmd_sass(args) == 0
    (written,) = (tmp_path / "results").glob("sass-*.json")
    return json.loads(written.read_text())


def test_cmd_sass_end_to_end_with_a_fake_ncu(tmp_path, monkeypatch, capsys):
    """The whole command on a fake ncu: a rung that does not take the dtype skipped, two profiled, the
    result file."""
    saved = run_on_a_fake_ncu(tmp_path, monkeypatch, PAGE, ["--kernels", "v13,v24,v26"])
    assert saved["kind"] == "sass" and saved["dtype"] == "bfloat16" and "--set full" in saved["ncu"]["command"]
    assert [(e["name"], e["status"]) for e in saved["entries"]] == [
        ("v13_fa2_partitioning", "skipped"), ("v24_persistent", "ok"), ("v26_fp8_persistent", "ok")]
    assert saved["entries"][2]["summary"]["instructions"] == 169 and saved["entries"][2]["case"] == "2x32x4096-d128"
    assert saved["direction"] == "forward"
    out = capsys.readouterr().out
    assert out.count("| opcode |") == 2


def test_backward_rungs_run_their_pass_under_ncu(tmp_path, monkeypatch, capsys):
    """--backward: the target is the backward pass (profile_target --backward), a rung without the case's
    head size skipped, every kernel of the page an entry; --kernels beside it refused."""
    saved = run_on_a_fake_ncu(tmp_path, monkeypatch, B05, ["--backward", "b05,b06"])
    assert saved["direction"] == "backward"
    assert [(e["name"], e["status"]) for e in saved["entries"]] == [("b05_wgmma", "ok"), ("b06_wide_query_tiles", "skipped")]
    assert saved["entries"][0]["kernel"].startswith("backward_dk_dv<") and "d=128" in saved["entries"][1]["reason"]
    calls = (tmp_path / "calls").read_text()
    assert "--backward" in calls and "--kernel " not in calls
    assert "| excessive shared wavefronts |" in capsys.readouterr().out
    with pytest.raises(CannotRun, match="--kernels, --backward and --decode"):
        sass.cmd_sass(parse(["sass", "--kernels", "v26", "--backward", "b05"]))


def test_the_decode_step_of_each_size_runs_under_ncu(tmp_path, monkeypatch, capsys):
    """--decode: the target is one decode step of each GPT-2 size named (profile_target --decode --size),
    every kernel of the page an entry named by size, the cases ignored; an unknown size refused, and a
    rung beside it."""
    saved = run_on_a_fake_ncu(tmp_path, monkeypatch, PAGE, ["--decode", "gpt2,gpt2-xl", "--dtype", "float32"])
    assert saved["direction"] == "decode" and saved["dtype"] == "float32"
    assert [(e["name"], e["case"], e["status"]) for e in saved["entries"]] == [
        ("decode step gpt2", "float32", "ok"), ("decode step gpt2-xl", "float32", "ok")]
    calls = (tmp_path / "calls").read_text()
    assert "--decode --size gpt2\n" in calls and "--decode --size gpt2-xl\n" in calls and "--kernel " not in calls
    assert capsys.readouterr().out.count("| opcode |") == 2
    with pytest.raises(SystemExit):
        parse(["sass", "--decode", "gpt3"])
    with pytest.raises(CannotRun, match="one kind of target"):
        sass.cmd_sass(parse(["sass", "--kernels", "v26", "--decode", "gpt2"]))


def test_a_failing_ncu_names_the_rung(tmp_path, monkeypatch):
    fake_device(monkeypatch, {})
    ncu = fake_ncu(tmp_path, "echo '==ERROR== The application returned an error code (1).'; exit 1")
    args = parse(["sass", "--kernels", "v26", "--ncu", ncu, "--results", str(tmp_path)])
    assert sass.cmd_sass(args) == 1  # the result is written, the run failed
    (written,) = tmp_path.glob("sass-*.json")
    (entry,) = json.loads(written.read_text())["entries"]
    assert entry["status"] == "error"
    assert entry["reason"].startswith("v26_fp8_persistent 2x32x4096-d128: ncu exited with status 1: ==ERROR==")
