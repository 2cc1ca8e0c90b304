"""bench.py profile --backward without a GPU: the backward rungs' targets and skip reasons, the whole command
on a fake ncu (every phase a kernel of its row, 2.5 x the forward's FLOPs, no decode step), and bench.py
readme putting the newest backward profile into docs/backward.md and nowhere the forward ones go."""


import pytest

from benchmarks import backward as backward_bench
from benchmarks import profile, profile_target, results
from benchmarks.cases import attention_flops
from benchmarks.device import CannotRun
from kernels import backward
from tests.test_profile import FIXTURES, docs_folder, fake_device, fake_ncu, make_result, parse


def test_the_target_of_a_backward_rung():
    target = profile.target_args("kernels/backward/b05_wgmma.cu", "16x12x2048-d64", "bfloat16", backward=True)
    assert target[1:] == ["-m", "benchmarks.profile_target", "--dtype", "bfloat16", "--backward",
                          "kernels/backward/b05_wgmma.cu", "--case", "16x12x2048-d64"]
    assert profile.backward_list("b2,b05") == [backward.resolve("b02"), backward.resolve("b05")]
    assert profile.backward_list("all") == [backward.resolve(n) for n in backward.names()]
    with pytest.raises(Exception, match="b99"):
        profile.backward_list("b99")


def test_backward_skip_reasons():
    assert profile.skip_reason(backward.resolve("b02"), "float32", "sm_90", 64, backward=True) is None
    assert "does not take float32" in profile.skip_reason(backward.resolve("b05"), "float32", "sm_90", 64, backward=True)
    assert "needs sm_90" in profile.skip_reason(backward.resolve("b05"), "bfloat16", "sm_80", 64, backward=True)
    assert "no configuration for d=96" in profile.skip_reason(backward.resolve("b05"), "bfloat16", "sm_90", 96,
                                                              backward=True)


def test_the_target_refuses_what_it_cannot_run(capsys):
    pytest.importorskip("cupy")
    assert profile_target.main(["--backward", "b99", "--dtype", "bfloat16"]) == 2
    assert "b99" in capsys.readouterr().err
    assert profile_target.main(["--kernel", "v13", "--deterministic"]) == 2
    assert capsys.readouterr().err == "profile_target: --deterministic goes with --backward\n"


def run_backward_profile(tmp_path, monkeypatch, argv: list[str]) -> dict:
    """cmd_profile on a fake ncu that answers every target with v13's report (one kernel)."""
    fake_device(monkeypatch, {"ffma_tflops": 51.0, "copy_tbps": 4.27})
    ncu = fake_ncu(tmp_path, f"cat '{FIXTURES / 'ncu-v13-float32.csv'}'")
    args = parse(["profile", *argv, "--ncu", ncu, "--results", str(tmp_path / "results")])
    assert profile.cmd_profile(args) == 0
    (written,) = (tmp_path / "results").glob("profile-nvidia-h200-*.json")
    return results.load_result(written)


def test_cmd_profile_backward_on_a_fake_ncu(tmp_path, monkeypatch):
    saved = run_backward_profile(tmp_path, monkeypatch, ["--backward", "b02,b05", "--dtype", "float32"])
    assert saved["direction"] == "backward" and saved["flop_convention"] == backward_bench.FLOP_CONVENTION
    assert saved["decode"] is False and saved["kernels"] == ["b02_fa2", "b05_wgmma"]
    assert [(r["name"], r["status"]) for r in saved["rows"]] == [("b02_fa2", "ok"), ("b05_wgmma", "skipped")]
    b02 = saved["rows"][0]
    assert len(b02["kernels"]) == 1 and b02["flops"] == attention_flops(8, 12, 1024, 64) * 5 // 2
    assert b02["tflops"] == pytest.approx(2.5 * 35.367, rel=1e-4)  # v13's report's time, the backward's FLOPs
    assert b02["math"] is None and "does not take float32" in saved["rows"][1]["reason"]


def test_backward_and_forward_rungs_are_named_one_way_at_a_time(tmp_path):
    args = parse(["profile", "--backward", "b05", "--kernels", "v24", "--ncu", fake_ncu(tmp_path, "exit 0")])
    with pytest.raises(CannotRun, match="--kernels and --backward"):
        profile.cmd_profile(args)


def test_readme_puts_the_backward_profile_in_docs_backward_only(tmp_path, monkeypatch):
    from benchmarks import cli

    docs = docs_folder(tmp_path)
    profile_page = docs / "profile.md"
    profile_page.write_text("# Profile\n\n<!-- bench:profile:start -->\nold\n<!-- bench:profile:end -->\n")
    backward_page = docs / "backward.md"
    backward_page.write_text("# Backward\n\n<!-- bench:backward-profile:start -->\nnone yet\n"
                             "<!-- bench:backward-profile:end -->\n\nEnd.\n")
    store = tmp_path / "results"
    forward = make_result()
    forward["setup"]["date"] = "2026-11-25T10:00:00Z"
    results.write_result(forward, results.result_path("profile", forward["setup"], store))
    (tmp_path / "run").mkdir()
    bwd = run_backward_profile(tmp_path / "run", monkeypatch, ["--backward", "b02", "--dtype", "float32"])
    results.write_result(bwd, results.result_path("profile", bwd["setup"], store))  # newer than the forward one
    argv = ["readme", "--readme", str(tmp_path / "README.md"), "--results-doc", str(docs / "results.md"),
            "--results", str(store)]
    assert cli.main(argv, "doc") == 0
    text = backward_page.read_text()
    assert "none yet" not in text and text.endswith("End.\n") and "`b02_fa2`" in text
    assert "one backward pass per rung (every phase its kernel)" in text and "2.5 x the forward" in text
    assert "(../results/profile-nvidia-h200-20261126T100000Z.json)" in text
    shown = profile_page.read_text()  # the forward page keeps the forward run, though older
    assert "b02_fa2" not in shown and "20261125T100000Z" in shown
