"""tools/sanitize.py without a GPU: its arguments, its reading of compute-sanitizer's output (samples in
the tool's format), the table, the child processes it restarts (a stand-in for compute-sanitizer), and
what its targets cover; tools/synccheck_cluster.py's kernel compiled for sm_90."""

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2
from kernels import fused, nvrtc

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS_DIR))

import initcheck_library  # noqa: E402
import sanitize  # noqa: E402
import sanitize_targets as targets  # noqa: E402
import synccheck_cluster  # noqa: E402

GEMV = "gemv<float, 768, 8, 1, true, 0>"

MEMCHECK = textwrap.dedent(f"""\
    ========= COMPUTE-SANITIZER
    @@ sanitize begin v01_naive
      v01_naive                    float32  B=2 NH=3 T_q=  97 T_k=  97 d=64: max |out - ref| = 2.38e-07
    @@ sanitize end v01_naive ok
    @@ sanitize begin fused-float32
    ========= Invalid __global__ read of size 16 bytes
    =========     at {GEMV}(const float *, const float *, const float *, const float *, const float *, float, float *, int, const char *, unsigned long long)+0x4d0 in /lab/kernels/fused/gemv.cu:61
    =========     by thread (31,0,0) in block (287,0,0)
    =========     Address 0x7f3a2c000000 is out of bounds
    =========     Saved host backtrace up to driver entry point at kernel launch time
    =========         Host Frame: [0x2f8b3c] in libcuda.so.1
    =========
    ========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFuncGetAttributes.
    =========     Saved host backtrace up to driver entry point at error
    =========
      fused-float32: KV-cache tokens [3, 9, 27, 81] (plain per-operation launches)
    @@ sanitize covers fused-float32 bias_act decode_attention embed gemm gemv kv_store layernorm lm_head_argmax merge_heads spin
    @@ sanitize end fused-float32 ok
    ========= ERROR SUMMARY: 2 errors
    """).splitlines()

SYNCCHECK = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    @@ sanitize begin v16_decode_split_kv
    @@ sanitize end v16_decode_split_kv ok
    @@ sanitize begin v17_decode_cluster
    ========= Barrier error detected. Divergent thread(s) in warp
    =========     at 0xcb50 in attention_forward<64, 8, 64, 0, 16>
    =========     by thread (0,0,0) in block (192,2,1)
    =========
    ========= Barrier error detected. Divergent thread(s) in warp
    =========     at 0xcb50 in attention_forward<64, 8, 64, 0, 16>
    =========     by thread (32,0,0) in block (192,2,1)
    =========
    Traceback (most recent call last):
    cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorLaunchFailure: unspecified launch failure
    @@ sanitize end v17_decode_cluster failed: CUDARuntimeError: cudaErrorLaunchFailure: unspecified launch failure
    ========= Target application returned an error
    ========= ERROR SUMMARY: 3 errors
    """).splitlines()

RACECHECK = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    @@ sanitize begin step-float32
    ========= Error: Race reported between Write access at decode_step<float, 768, 12, 64, 3072, 320>(const Layer<float> *, int)+0x1a30 in /lab/kernels/fused/decode_step.cu:412
    =========     and Read access at decode_step<float, 768, 12, 64, 3072, 320>(const Layer<float> *, int)+0x1c80 in /lab/kernels/fused/decode_step.cu:430 [256 hazards]
    =========
    ========= Warning: Race reported between Read access at rows_dot(float const *, int)+0x90 in /lab/kernels/fused/decode_step.cu:300
    =========     and Write access at rows_dot(float const *, int)+0xa0 in /lab/kernels/fused/decode_step.cu:310 [4 hazards]
    =========     Device Frame: decode_step<float, 768, 12, 64, 3072, 320>(const Layer<float> *, int)+0x2000 in /lab/kernels/fused/decode_step.cu:900
    =========
    @@ sanitize covers step-float32 bias_act decode_step embed kv_store layernorm lm_head_argmax merge_heads
    @@ sanitize end step-float32 ok
    ========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
    """).splitlines()


def test_function_at_reads_every_location_form():
    assert sanitize.function_at(f"{GEMV}(const float *, int)+0x4d0 in /lab/gemv.cu:61") == GEMV
    assert sanitize.function_at("0xcb50 in attention_forward<64, 8, 64, 0, 16>") == "attention_forward<64, 8, 64, 0, 16>"
    assert sanitize.function_at("stencil.cu:27 in update(float const*, float*)") == "update"
    assert sanitize.function_at("kernel_name+0x15520") == "kernel_name"
    assert sanitize.function_at("0x00000058 in test(int*, int*)") == "test"
    assert sanitize.kernel_of("by thread (0,0,0) in block (0,0,0)") == ""
    assert sanitize.kernel_of("Invalid __global__ read of size 16 bytes") == ""
    assert sanitize.base("attention_forward<64, 8, 64, 0, 16>") == "attention_forward"


def test_parse_assigns_reports_to_targets_and_kernels():
    child = sanitize.parse(MEMCHECK)
    assert child.status == {"v01_naive": "ok", "fused-float32": "ok"}
    assert child.summary == 2
    read, api = child.reports
    assert (read.target, read.kernel, read.error) == ("fused-float32", GEMV, True)
    assert read.text == "Invalid __global__ read of size 16 bytes"
    assert (api.target, api.kernel) == ("fused-float32", "")
    assert api.text.startswith("Program hit cudaErrorInvalidValue")
    assert child.covers["fused-float32"] == ["bias_act", "decode_attention", "embed", "gemm", "gemv", "kv_store",
                                             "layernorm", "lm_head_argmax", "merge_heads", "spin"]


def test_parse_keeps_the_failure_and_skips_what_is_not_a_report():
    child = sanitize.parse(SYNCCHECK)
    assert child.status["v16_decode_split_kv"] == "ok"
    assert child.status["v17_decode_cluster"].startswith("failed: CUDARuntimeError")
    assert [(r.target, r.kernel) for r in child.reports] == [("v17_decode_cluster", "attention_forward<64, 8, 64, 0, 16>")] * 2
    assert all(r.text == "Barrier error detected. Divergent thread(s) in warp" for r in child.reports)
    assert child.summary == 3  # one more than printed: the summary is the tool's own count


def test_parse_racecheck_errors_warnings_and_the_outermost_device_frame():
    child = sanitize.parse(RACECHECK)
    error, warning = child.reports
    assert error.error and error.kernel == "decode_step<float, 768, 12, 64, 3072, 320>"
    assert not warning.error and warning.kernel == "decode_step<float, 768, 12, 64, 3072, 320>"  # the frame, not rows_dot
    assert child.summary == 1 and child.status["step-float32"] == "ok"


def runs(**outputs):
    return {tool: [sanitize.parse(lines)] for tool, lines in outputs.items()}


def test_summarize_counts_per_kernel_and_tool_and_says_what_failed():
    fused_names = sanitize.fused_kernels()
    chosen = ["v01_naive", "v16_decode_split_kv", "v17_decode_cluster", "fused-float32", "step-float32"]
    rows, problems = sanitize.summarize(["memcheck", "synccheck", "racecheck"],
                                        runs(memcheck=MEMCHECK, synccheck=SYNCCHECK, racecheck=RACECHECK), chosen,
                                        fused_names)
    assert rows["fused/gemv"]["memcheck"] == "1"
    assert rows["fused-float32"]["memcheck"] == "1"  # the API error: no kernel, the target's
    assert rows["v01_naive"]["memcheck"] == "0"
    assert rows["v17_decode_cluster"]["synccheck"] == "2 failed"
    assert rows["v16_decode_split_kv"]["synccheck"] == "0"
    assert rows["v01_naive"]["synccheck"] == "0 not run"
    assert rows["fused/decode_step"]["racecheck"] == "1 +1w"
    assert rows["fused/gemm"]["racecheck"] == "0 not launched"  # only the step target ran under racecheck
    assert rows["fused/gemm"]["memcheck"] == "0"
    assert "memcheck fused/gemv: 1 error" in problems
    assert "synccheck v17_decode_cluster: 2 errors" in problems
    assert "synccheck: the tool counted 3 errors and printed 2 (--print-limit)" in problems
    assert any(p.startswith("synccheck v17_decode_cluster: failed: CUDARuntimeError") for p in problems)
    assert not any("not launched" in p or "launched it" in p for p in problems)  # not every engine target chosen
    text = sanitize.table(["memcheck", "synccheck", "racecheck"], rows)
    assert text.splitlines()[0].split() == ["kernel", "memcheck", "synccheck", "racecheck"]


def test_a_fused_file_with_a_report_counts_as_launched_though_its_child_named_no_files():
    stopped = [line for line in RACECHECK if "covers" not in line]  # as a child stopped by its timeout
    rows, problems = sanitize.summarize(["racecheck"], runs(racecheck=stopped), ["step-float32"],
                                        sanitize.fused_kernels())
    assert rows["fused/decode_step"]["racecheck"] == "1 +1w"
    assert rows["fused/gemm"]["racecheck"] == "0 not launched"
    assert "racecheck fused/decode_step: 1 error" in problems


def test_summarize_is_clean_for_clean_runs_and_wants_every_fused_file_launched():
    clean = [line for line in MEMCHECK if not line.startswith("=========") or "COMPUTE" in line]
    clean.append("========= ERROR SUMMARY: 0 errors")
    rows, problems = sanitize.summarize(["memcheck"], runs(memcheck=clean), ["v01_naive"], sanitize.fused_kernels())
    assert problems == [] and rows == {"v01_naive": {"memcheck": "0"}}
    every = ["v01_naive", *targets.ENGINE]
    _, problems = sanitize.summarize(["memcheck"], runs(memcheck=clean), every, sanitize.fused_kernels())
    assert "memcheck fused/decode_step: no engine target launched it" in problems  # no step target ended here
    assert "memcheck step-float32: not run" in problems


def test_fused_kernels_names_a_kernel_in_every_file():
    found = sanitize.fused_kernels()
    assert set(found.values()) == set(fused.names())
    assert found["add_layernorm"] == "layernorm" and found["gemm_tf32x3"] == "gemm" and found["spin"] == "spin"


def test_the_engine_targets_launch_every_fused_file():
    config = gpt2.GPT2Config(n_layer=2)
    launched = set()
    for name in targets.ENGINE:
        kind, dtype, *_ = name.split("-")
        model = targets.llama_config() if kind == "llama" else config
        launched.update(targets.launched_files(kind, model, dtype, gemm=dtype == "float32"))
    assert launched == set(fused.names())
    assert "decode_step" not in targets.launched_files("fused", config, "float32", gemm=True)


def test_select_takes_groups_names_globs_and_short_names():
    groups = {"forward": ["v01_naive", "v16_decode_split_kv", "v17_decode_cluster"], "backward": ["b02_fa2"],
              "fused": ["fused-float32", "fused-bfloat16"]}
    every = [n for names in groups.values() for n in names]
    assert sanitize.select(None, groups, targets.resolve) == every
    assert sanitize.select("fused,v17", groups, targets.resolve) == ["v17_decode_cluster", "fused-float32",
                                                                      "fused-bfloat16"]
    assert sanitize.select("v1*, b2", groups, targets.resolve) == ["v16_decode_split_kv", "v17_decode_cluster",
                                                                   "b02_fa2"]
    assert sanitize.select("fused-bfloat16", groups, targets.resolve) == ["fused-bfloat16"]
    with pytest.raises(ValueError, match="matches no target"):
        sanitize.select("x*", groups, targets.resolve)
    with pytest.raises(ValueError, match="unknown kernel 'v99'"):
        sanitize.select("v99", groups, targets.resolve)
    with pytest.raises(ValueError, match="own rungs"):
        sanitize.select("my.cu", groups, targets.resolve)


def test_every_target_name_resolves_to_itself():
    for names in targets.groups().values():
        for name in names:
            if name not in targets.ENGINE:
                assert targets.resolve(name) == name


def test_arguments():
    args = sanitize.parse_args([])
    assert args.tools == list(sanitize.TOOLS) and args.only is None and not args.quick and args.timeout == 540
    args = sanitize.parse_args(["--kernels", "v01,b02", "--tools", "memcheck, synccheck", "--quick"])
    assert args.only == "v01,b02" and args.tools == ["memcheck", "synccheck"] and args.quick
    for bad in (["--tools", "memcheck,helgrind"], ["--tools", ","], ["--timeout", "0"], ["--print-limit", "-3"]):
        with pytest.raises(SystemExit):
            sanitize.parse_args(bad)
    cmd = sanitize.command("/cs", "racecheck", ["v01_naive", "fused-float32"], True, 50)
    assert cmd[:7] == ["/cs", "--tool", "racecheck", "--error-exitcode", "99", "--print-limit", "50"]
    assert cmd[-4:] == ["--tool=racecheck", "--quick", "v01_naive", "fused-float32"]
    assert cmd[-5].endswith("sanitize_targets.py")
    assert "--kernel-name-exclude" not in cmd  # a kernel is left out of initcheck alone
    cmd = sanitize.command("/cs", "initcheck", ["fused-bfloat16"], False, 50, "excluded")
    assert cmd[7:11] == ["--kernel-name-exclude", "kns=nvjet", "--kernel-name-exclude", "kns=cublas"]
    assert sanitize.command("/cs", "initcheck", ["fused-bfloat16"], False, 50) == sanitize.command(
        "/cs", "initcheck", ["fused-bfloat16"], False, 50, "zeroed")  # the default
    for mode in ("checked", "small-workspace"):  # cuBLAS's kernels checked: no exclusion
        assert "--kernel-name-exclude" not in sanitize.command("/cs", "initcheck", ["fused-bfloat16"], False, 50, mode)
    assert sanitize.child_env("initcheck", "small-workspace")["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in sanitize.child_env("racecheck", "small-workspace")  # initcheck's alone
    zeroed = sanitize.command("/cs", "initcheck", ["llama-bfloat16"], False, 50, "zeroed")
    assert zeroed[7:9] == ["--kernel-name-exclude", "kns=splitKreduce"]  # cuBLAS's split-K reduction alone
    assert zeroed.count("--kernel-name-exclude") == 1
    assert sanitize.child_env("initcheck", "zeroed")["LAB_ZERO_PRODUCTS"] == "1"  # lm.products.ZERO_OUTPUTS
    assert "LAB_ZERO_PRODUCTS" not in sanitize.child_env("memcheck", "zeroed")
    assert sanitize.parse_args([]).initcheck_library == "zeroed"
    with pytest.raises(SystemExit):
        sanitize.parse_args(["--initcheck-library", "ignored"])


def test_main_lists_targets_and_refuses_unknown_ones(capsys):
    assert sanitize.main(["--list", "--only", "v17,step"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["forward   v17_decode_cluster",
                   "step      step-float32 step-bfloat16 step-float32-ring3 step-bfloat16-ring2 step-float32-reduce "
                   "step-bfloat16-reduce"]
    assert sanitize.main(["--only", "nothing*"]) == 2
    assert "matches no target" in capsys.readouterr().err


FAKE_TOOL = """\
import sys, time
names = [a for a in sys.argv[[a.endswith("sanitize_targets.py") for a in sys.argv].index(True) + 1:] if not a.startswith("--")]
print("========= COMPUTE-SANITIZER", flush=True)
for name in names:
    print("@@ sanitize begin " + name, flush=True)
    if name == "crash":
        sys.exit(3)
    if name == "hang":
        time.sleep(60)
    print("@@ sanitize end " + name + " ok", flush=True)
print("========= ERROR SUMMARY: 0 errors", flush=True)
"""


def test_run_tool_goes_on_after_a_child_that_dies_or_hangs(tmp_path, capsys):
    """A stand-in for compute-sanitizer runs the child's protocol itself: a target that kills its process,
    and one that outlives the timeout; the next child starts after each."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_TOOL)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = argparse.Namespace(quick=False, print_limit=10, timeout=3.0, initcheck_library="excluded")
    children = sanitize.run_tool(str(fake), "memcheck", ["a", "crash", "b", "hang", "c"], args)
    assert [list(c.status) for c in children] == [["a", "crash"], ["b", "hang"], ["c"]]
    assert children[0].status["crash"] == "crashed (exit 3)"
    assert children[1].status["hang"] == "timed out after 3 s"
    assert children[2].status == {"c": "ok"} and children[2].summary == 0
    assert "[memcheck] c: ok" in capsys.readouterr().out


def test_stopping_sanitize_stops_its_children(tmp_path):
    """Each child runs in a session of its own, and its timeout is sanitize.py's to keep: stopped by a
    signal (timeout's SIGTERM), sanitize.py kills every running child first, or they would run on beside
    whatever the machine does next. Two tools at once, each child hanging in its target."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_TOOL.replace(
        'if name == "hang":', 'if name == "hang":\n        import os; (Path(os.environ["FAKE_PIDS"]) / str(os.getpid())).touch()')
        .replace("import sys, time", "import sys, time\nfrom pathlib import Path"))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    pids = tmp_path / "pids"
    pids.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""\
        import argparse, sys
        sys.path.insert(0, {str(TOOLS_DIR)!r})
        import sanitize
        sanitize.stop_children_with_me()
        args = argparse.Namespace(quick=True, print_limit=10, timeout=120.0, initcheck_library="excluded",
                                  parallel=True, tools=["memcheck", "racecheck"])
        sanitize.run_tools({str(fake)!r}, ["hang"], args)
        """))
    proc = subprocess.Popen([sys.executable, str(driver)], env={**os.environ, "FAKE_PIDS": str(pids)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p.name) for p in pids.iterdir()]
    assert len(children) == 2, children
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert "stopped by signal 15; 2 running children killed" in proc.stderr.read()

    def alive(pid: int) -> bool:  # a zombie whose parent is gone counts as stopped
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)]


def test_the_reproducer_kernel_compiles_for_sm_90():
    source = (TOOLS_DIR / "synccheck_cluster.cu").read_text()
    for cluster, aligned in ((8, "false"), (16, "false"), (16, "true")):
        (result,) = nvrtc.compile_isolated(source, "synccheck_cluster.cu", ["-arch=sm_90", "-Xptxas=-v"],
                                           [f"cluster_skeleton<{cluster}, {aligned}>"])
        assert "registers" in result["log"]


def test_the_reproducer_expects_every_push_and_nothing_else():
    case = synccheck_cluster.Skeleton("", cluster=16, clusters=26, small_every=13)
    want = synccheck_cluster.skeleton_expected(case)
    assert want.shape == (26, 128)
    assert want[0, 5] == 16 * 5 + 120 and not (want != want)[0].any()  # a full cluster: no NaN
    assert (want[12, :16] == 16 * np.arange(16) + 120).all()  # cluster 12 pushes 16 items
    assert (want[12, 16:] != want[12, 16:]).all() and (want[25, 16:] != want[25, 16:]).all()  # NaN above 16 items


def test_the_reproducer_verdict():
    rows = [{"case": "skeleton-waves", "errors": 0}, {"case": "skeleton-waves-mixed-aligned", "errors": 0},
            {"case": "v17-97", "errors": 4}]
    assert synccheck_cluster.verdict(rows).startswith("Only v17 draws the report (v17-97)")
    rows[0]["errors"] = 2
    assert "not with the .aligned forms: v17 draws it (v17-97)" in synccheck_cluster.verdict(rows)
    rows[2]["errors"] = 0
    assert "v17 is clean;" in synccheck_cluster.verdict(rows)
    rows[1]["errors"] = 3
    assert "the report is the tool's" in synccheck_cluster.verdict(rows)
    assert synccheck_cluster.verdict([{"case": "v17-97", "errors": 0}]) == "No case draws the report."


LIBRARY = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    @@ sanitize begin fused-bfloat16
    ========= Error: Race reported between Read access at nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT+0xb30
    =========     and Write access at nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT+0x2f60 [96 hazards]
    =========
    ========= Error: Race reported between Write access at decode_step<float, 768, 12, 64, 3072, 320>(const Layer<float> *, int)+0x1a30 in /lab/kernels/fused/decode_step.cu:412
    =========     and Read access at decode_step<float, 768, 12, 64, 3072, 320>(const Layer<float> *, int)+0x1c80 in /lab/kernels/fused/decode_step.cu:430 [256 hazards]
    =========
    @@ sanitize end fused-bfloat16 ok
    ========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
    """).splitlines()


def test_reports_in_library_kernels_get_rows_of_their_own_and_fail_nothing():
    """cuBLAS's kernels (the bfloat16 products) are not the lab's: their reports are shown, not failed on."""
    rows, problems = sanitize.summarize(["racecheck"], runs(racecheck=LIBRARY), ["fused-bfloat16"],
                                        sanitize.fused_kernels())
    library = "library/nvjet_sm90_tss_64x8_64x16_4x1_v_bz_splitK_TNT"
    assert rows[library]["racecheck"] == "1" and rows["fused/decode_step"]["racecheck"].startswith("1")
    assert rows["fused-bfloat16"]["racecheck"] == "0"
    assert problems == ["racecheck fused/decode_step: 1 error"]  # the lab's kernel fails the run, cuBLAS's does not
    assert sanitize.LIBRARY.match("cublasLt") and not sanitize.LIBRARY.match("attention_forward")


SETUP_REPORT = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    @@ sanitize begin setup
    ========= Uninitialized __global__ memory read of size 4 bytes
    =========     at cupy_multiply__float32_float_float32+0x1f0
    =========
    @@ sanitize end setup ok
    @@ sanitize begin v21_tma_loads
    @@ sanitize end v21_tma_loads ok
    ========= ERROR SUMMARY: 1 error
    """).splitlines()


def test_the_childs_first_random_draws_are_not_a_targets():
    """CuPy's first random draws in a process draw initcheck reports of their own: on a row of their own,
    not the first target's, and not failing the run."""
    rows, problems = sanitize.summarize(["initcheck"], runs(initcheck=SETUP_REPORT), ["v21_tma_loads"],
                                        sanitize.fused_kernels())
    assert rows["v21_tma_loads"]["initcheck"] == "0" and rows["library/setup"]["initcheck"] == "1"
    assert problems == []


FLOODING_TOOL = """\
import sys
names = [a for a in sys.argv[[a.endswith("sanitize_targets.py") for a in sys.argv].index(True) + 1:] if not a.startswith("--")]
print("========= COMPUTE-SANITIZER", flush=True)
for name in names:
    print("@@ sanitize begin " + name, flush=True)
    for _ in range(4 if name.startswith("flood") else 0):
        print("========= Uninitialized __global__ memory read of size 2 bytes", flush=True)
        print("=========     at attention_forward<64, 192, 128, 0>+0x10", flush=True)
    print("@@ sanitize end " + name + " ok", flush=True)
print("========= ERROR SUMMARY: 0 errors", flush=True)
"""


def test_a_child_stops_after_the_target_that_reaches_the_print_limit(tmp_path):
    """Past --print-limit the tool counts without printing: the child is stopped at the end of the target
    that reached it (its count a floor, `3+`), and a new one goes on, so no later target's errors hide."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + FLOODING_TOOL)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = argparse.Namespace(quick=False, print_limit=3, timeout=30.0, initcheck_library="excluded")
    children = sanitize.run_tool(str(fake), "initcheck", ["a", "flood", "b", "flood2"], args)
    assert [list(c.status) for c in children] == [["a", "flood"], ["b", "flood2"]]
    assert [c.capped for c in children] == ["flood", "flood2"]
    assert set(children[0].seconds) == {"a", "flood"}
    rows, problems = sanitize.summarize(["initcheck"], {"initcheck": children}, ["a", "flood", "b", "flood2"], {})
    assert [rows[n]["initcheck"] for n in ("a", "flood", "b", "flood2")] == ["0", "4+", "0", "4+"]
    assert problems == ["initcheck flood: 4 errors", "initcheck flood2: 4 errors"]
    cells = sanitize.cells(["initcheck"], rows, {"initcheck": children})
    assert cells["a"] == {"initcheck": 0} and cells["flood"] == {"initcheck": "4+"}
    assert sanitize.per_target(["initcheck"], {"initcheck": children}, "seconds").keys() == {"a", "flood", "b", "flood2"}
    reports = sanitize.first_reports(["initcheck"], {"initcheck": children}, {})
    assert len(reports["flood"]["initcheck"]) == 3 and "attention_forward<64, 192, 128, 0>" in reports["flood"]["initcheck"][0]


def test_a_skipped_cell_keeps_its_reason_and_cupy_kernels_are_named_apart():
    child = sanitize.parse(textwrap.dedent("""\
        @@ sanitize begin t01
        @@ sanitize end t01 skipped: Triton is not installed
        @@ sanitize begin v23_pingpong
        ========= Uninitialized __global__ memory read of size 2 bytes
        =========     at cupy_copy__bfloat16_bfloat16+0x40
        =========
        @@ sanitize end v23_pingpong ok
        ========= ERROR SUMMARY: 1 error
        """).splitlines())
    rows, problems = sanitize.summarize(["initcheck"], {"initcheck": [child]}, ["t01", "v23_pingpong"], {})
    cells = sanitize.cells(["initcheck"], rows, {"initcheck": [child]})
    assert cells["t01"] == {"initcheck": "skipped: Triton is not installed"}
    assert cells["v23_pingpong"] == {"initcheck": 0}
    assert cells["v23_pingpong in cupy_copy__bfloat16_bfloat16"] == {"initcheck": 1}
    assert problems == ["initcheck v23_pingpong in cupy_copy__bfloat16_bfloat16: 1 error"]  # still the lab's


def test_group_chooses_whole_groups_and_refuses_unknown_ones(capsys):
    assert sanitize.main(["--list", "--group", "step,backward"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["backward", "step"]
    assert out[0].split()[1:] == kernels_backward_names()
    assert sanitize.main(["--group", "forwards"]) == 2
    assert "unknown group forwards" in capsys.readouterr().err


def kernels_backward_names():
    import kernels

    return kernels.backward_names()


def test_the_targets_cover_every_rung_dtype_and_declared_feature():
    """Checked against the registries: every rung in every dtype it declares, cross and GQA shapes where it
    declares them, a decode step for a split-KV rung; --quick one launch as awkward as the rung allows."""
    import kernels

    groups = targets.groups()
    assert groups["forward"] == kernels.names() and groups["backward"] == kernels.backward_names()
    assert groups["triton"] == kernels.triton_names()
    assert {"step-float32", "step-bfloat16", "step-float32-ring3", "step-bfloat16-ring2", "step-float32-reduce",
            "step-bfloat16-reduce"} == set(groups["step"])
    rungs = [kernels.load(n) for n in kernels.names()] + [kernels.backward.load(n) for n in kernels.backward_names()]
    for rung in rungs:
        assert targets.rung_dtypes(rung, quick=False) == tuple(rung.dtypes)
        assert targets.rung_dtypes(rung, quick=True) == tuple(rung.dtypes[:1])
        full, quick = targets.case_shapes(rung, quick=False), targets.case_shapes(rung, quick=True)
        assert {s[5] for s in full + quick} <= set(rung.head_sizes())  # no launch at a head size it lacks
        base = targets.base_head_size(rung)  # 64, or the smallest a rung takes without 64 (b10: 128)
        assert base == (64 if 64 in rung.head_sizes() else min(rung.head_sizes()))
        cross, gqa, decode = (s[:5] + (base,) for s in (targets.CROSS, targets.GQA, targets.DECODE))
        split_kv = bool(getattr(rung, "split_kv", False))
        assert (cross in full) == ("cross" in rung.supports) and (gqa in full) == ("gqa" in rung.supports)
        assert (decode in full) == (decode in quick) == split_kv
        persistent = targets.persistent(rung)
        for _, NH, NH_kv, T_q, T_k, _ in quick[: 1 + persistent]:
            assert T_q % 16 and (T_q != T_k) == ("cross" in rung.supports) and (NH != NH_kv) == ("gqa" in rung.supports)
        sizes = [d for d in rung.head_sizes() if d != base]
        heads = len(sizes[-1:])  # --quick: the largest other head size; a full run: every one
        assert [s[5] for s in quick[len(quick) - heads:]] == sizes[-1:]
        assert all(s[:5] == quick[0][:5] for s in quick[len(quick) - heads:])  # QUICK's awkward shape, as declared
        tail = full[len(full) - len(sizes) * (1 + persistent):]  # QUICK's shape at each, and MANY_TILES where persistent
        assert tail == [s for d in sizes for s in [quick[0][:5] + (d,)] + [quick[1][:5] + (d,)] * persistent]
        assert len(quick) == 1 + persistent + split_kv + heads and (quick[-1 - split_kv - heads] in full) == persistent
        if persistent:  # every block walks two tiles at least on a device of 132 SMs: key tiles of 128 (the
            B, NH, NH_kv, T_q, T_k, d = quick[1]  # backward), query tiles of at most 192 (the forward)
            assert min(-(-T_k // 128) * NH_kv, -(-T_q // 192) * NH) * B >= 2 * 132


def test_under_synccheck_v17_runs_where_the_tool_is_sound():
    """Clusters of 16 where the grid fits in one wave, else the dtype's first config of portable clusters (at
    the shape's d where declared, else at its own); a note says so; the other rungs run as under every tool."""
    import kernels

    v17 = kernels.load("v17")
    assert targets.non_portable(v17) and not any(targets.non_portable(kernels.load(n)) for n in kernels.names()
                                                  if n != "v17_decode_cluster")
    resident = 28

    def waves(config, shape):
        B, NH, _, T_q, _, _ = shape
        return -(-T_q // v17.params(config)["B_r"]) * NH * B, resident

    every = targets.case_shapes(v17, quick=False)
    for dtype in v17.dtypes:  # the other head sizes' shapes too: each launched at its config's d, the rest kept
        for (s, c, why), want in zip(targets.synccheck_launches(v17, dtype, every, waves), every, strict=True):
            assert s[:5] == want[:5] and s[5] == c[0] and (s == want or "in place of" in why)
    shapes = every[:5]  # SHAPES, CROSS, GQA, DECODE
    launches = targets.synccheck_launches(v17, "float32", shapes, waves)
    assert [s for s, _, _ in launches] == shapes
    for (shape, config, why), clusters in zip(launches, [16, 78, 10, 52, 12]):  # SHAPES, CROSS, GQA, DECODE
        assert waves((64, 8, 64, 0, 16), shape)[0] == clusters
        assert config == ((64, 8, 64, 0, 16) if clusters <= resident else (64, 8, 64, 0, 8)), why
        assert (f"in place of 16 ({clusters} clusters of 16, {resident} resident)" in why) == (clusters > resident)
    for dtype, dtype_id in (("bfloat16", 1), ("float16", 2)):  # no portable config at d = 64: d = 32's
        launches = targets.synccheck_launches(v17, dtype, shapes, waves)
        far = [(s, c) for s, c, _ in launches if v17.cluster_size(c) == 8]
        assert far and all(c == (32, 4, 128, dtype_id, 8) and s[-1] == 32 for s, c in far)
        near = [s for s, c, _ in launches if v17.cluster_size(c) == 16]
        assert all(waves((64, 4, 64, dtype_id, 16), s)[0] <= resident for s in near) and targets.DECODE in near
    none_fits = targets.synccheck_launches(v17, "float32", shapes, lambda c, s: (resident + 1, resident))
    assert [(s, c) for s, c, _ in none_fits] == [(s, (64, 8, 64, 0, 8)) for s in shapes]
    assert "tools/synccheck_cluster.py" in targets.SYNCCHECK_NOTE


def test_parallel_runs_the_tools_at_once_each_with_its_own_children(tmp_path, capsys):
    """--parallel: each tool's children as a run one after another makes them, the tools side by side (two
    tools over a target that takes two seconds finish a second or more sooner than one after the other)."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_TOOL.replace('if name == "hang":', 'if name == "slow":\n        time.sleep(2)\n    if name == "hang":'))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    took = {}
    for parallel in (False, True):
        args = argparse.Namespace(quick=True, print_limit=10, timeout=20.0, initcheck_library="excluded",
                                  parallel=parallel, tools=["memcheck", "racecheck"])
        began = time.monotonic()
        runs, seconds = sanitize.run_tools(str(fake), ["a", "crash", "slow"], args)
        took[parallel] = time.monotonic() - began
        assert [list(c.status) for c in runs["memcheck"]] == [["a", "crash"], ["slow"]]
        assert runs["memcheck"][1].status == {"slow": "ok"}
        raced = sorted(list(c.status) for c in runs["racecheck"])  # under --parallel a child a target here
        assert raced == ([["a"], ["crash"], ["slow"]] if parallel else [["a", "crash"], ["slow"]]), raced
        assert {name: state for c in runs["racecheck"] for name, state in c.status.items()}["slow"] == "ok"
        assert set(seconds) == {"memcheck", "racecheck"} and all(s >= 2.0 for s in seconds.values())
    assert took[False] >= 4.0 and took[True] < took[False] - 1.0, took
    out = capsys.readouterr().out
    assert "[racecheck] slow: ok" in out and "    [memcheck] ========= COMPUTE-SANITIZER" in out


def test_shards_balance_a_tool_s_targets_by_their_committed_seconds(tmp_path):
    cost = {"llama": 54.0, "train": 57.0, "step": 29.0, "fused": 25.0, "v01": 1.4, "v02": 1.7}
    names = ["v01", "v02", "fused", "step", "llama", "train", "new"]  # "new": no seconds yet, the mean's
    parts = sanitize.shards(names, 4, cost)
    assert sorted(n for part in parts for n in part) == sorted(names) and len(parts) == 4
    assert all(part == [n for n in names if n in part] for part in parts)  # each in the run's order
    mean = sum(cost.values()) / len(cost)
    totals = sorted(sum(cost.get(n, mean) for n in part) for part in parts)
    assert totals[-1] == 57.0 and totals[0] >= 25.0, totals  # no part above the costliest target's own
    assert sanitize.shards(["a", "b"], 4, {}) == [["a"], ["b"]] and sanitize.shards(["a"], 1, {}) == [["a"]]
    for stamp, quick, seconds in (("2026-01-01", True, {"v01": {"racecheck": 9.0}, "v02": {"racecheck": 2.0}}),
                                  ("2026-02-01", True, {"v01": {"racecheck": 1.0}}),
                                  ("2026-03-01", False, {"v01": {"racecheck": 50.0}})):
        (tmp_path / f"sanitize-{stamp}.json").write_text(json.dumps({"quick": quick, "setup": {"date": stamp},
                                                                     "seconds": seconds}))
    assert sanitize.past_seconds(True, tmp_path) == {"v01": {"racecheck": 1.0}, "v02": {"racecheck": 2.0}}
    assert sanitize.past_seconds(False, tmp_path) == {"v01": {"racecheck": 50.0}}


def test_the_child_learns_its_tool_and_a_note_reaches_the_json():
    cmd = sanitize.command("compute-sanitizer", "synccheck", ["v17_decode_cluster"], quick=True, print_limit=5)
    assert cmd[cmd.index(str(Path(targets.__file__).resolve())) + 1:] == ["--tool=synccheck", "--quick",
                                                                          "v17_decode_cluster"]
    child = sanitize.parse(textwrap.dedent(f"""\
        @@ sanitize begin v17_decode_cluster
        @@ sanitize note v17_decode_cluster {targets.SYNCCHECK_NOTE}
        @@ sanitize end v17_decode_cluster ok
        ========= ERROR SUMMARY: 0 errors
        """).splitlines())
    assert child.status == {"v17_decode_cluster": "ok"} and not child.reports
    rows, problems = sanitize.summarize(["synccheck"], {"synccheck": [child]}, ["v17_decode_cluster"], {})
    assert sanitize.cells(["synccheck"], rows, {"synccheck": [child]}) == {"v17_decode_cluster": {"synccheck": 0}}
    assert sanitize.per_target(["synccheck"], {"synccheck": [child]}, "notes") == {
        "v17_decode_cluster": {"synccheck": targets.SYNCCHECK_NOTE}}
    assert problems == []


def test_the_initcheck_reproducer_says_whose_the_reports_are():
    """tools/initcheck_library.py's verdict, mode by mode: the tool's when, with cuBLAS excluded, only reads of
    what cuBLAS alone wrote draw reports; the mode to run the groups in is the clean one."""
    def rows(mode, drew, library=()):
        return [{"case": c, "mode": mode, "errors": 3 if c in drew else 0, "library": c in library}
                for c in initcheck_library.CASES]

    said = initcheck_library.verdict(rows("excluded", {"matmul-new", "bf16-prefill"}) + rows("checked", set()))
    assert "excluded: only reads of what cuBLAS alone wrote draw reports (bf16-prefill, matmul-new)" in said
    assert "checked: no case draws a report." in said
    assert said.endswith("sound here with --initcheck-library checked.")
    said = initcheck_library.verdict(rows("checked", {"bf16-prefill"}, library={"bf16-prefill"})
                                     + rows("small-workspace", set()))
    assert "checked: reports in bf16-prefill; inside cuBLAS's own kernels in bf16-prefill." in said
    assert said.endswith("--initcheck-library small-workspace.")
    said = initcheck_library.verdict(rows("excluded", {"matmul-new", "kernel-empty"}))
    assert "the controls draw reports (kernel-empty)" in said and said.endswith("stay open.")
    # a failed case reads as errors unknown (None), not as a report
    said = initcheck_library.verdict([{"case": "matmul-new", "mode": "checked", "errors": None, "library": False}])
    assert said == "checked: no case draws a report.\nA full run's initcheck is sound here with --initcheck-library checked."


def test_the_initcheck_reproducer_tells_whether_the_tool_sees_bulk_stores():
    """The bulk-store case is the tool's reach, not a mode's fault: it does not decide the mode, and the
    verdict says whether stores through the async proxy are seen (its plain-store control clean)."""
    def row(case, mode, errors):
        return {"case": case, "mode": mode, "errors": errors, "library": False}

    unseen = [row("bulk-store", m, 1024) for m in ("excluded", "checked")] + [
        row("plain-store", m, 0) for m in ("excluded", "checked")] + [row("matmul-new", "excluded", 5),
                                                                      row("matmul-new", "checked", 0)]
    said = initcheck_library.verdict(unseen)
    assert "does not see stores through the async proxy" in said
    assert said.endswith("sound here with --initcheck-library checked.")
    seen = [row(c, "checked", 0) for c in ("bulk-store", "plain-store", "matmul-new")]
    assert "sees stores through the async proxy" in initcheck_library.verdict(seen)
    control = unseen[:2] + [row("plain-store", "checked", 3)]  # a plain store drawing reports: no claim
    assert "does not see" not in initcheck_library.verdict(control)


def test_the_initcheck_reproducer_knows_every_case_and_its_product():
    """Each case's operands and expected c, on NumPy standing in for CuPy (the shapes the product takes)."""
    fake = SimpleNamespace(asarray=np.asarray, random=np.random)
    for name in initcheck_library.CASES:
        a, b, want = initcheck_library.operands(fake, name)
        if name == "random-ints":  # the draw is c itself: no product
            assert a.shape == (2, 97) and b is None and 0 <= a.min() and a.max() < 1000
            continue
        if name in ("bulk-store", "plain-store"):  # no operands: the kernel writes 0, 1, 2, ...
            assert a is None and b is None and want.tolist() == list(range(initcheck_library.STORE_N))
            continue
        if name.startswith("bf16"):  # c = a @ W^T, W (out, in); want made on the device from the rounded operands
            assert (a @ b.T).shape == (256 if name == "bf16-rows" else 5, 2304) and want is None
            continue
        assert want.shape == (a.shape if name == "kernel-empty" else (a @ b).shape)


def test_engine_targets_take_weights_drawn_on_the_host():
    """host_drawn: the engine targets' weights are NumPy's draws, copied and cast on the device (NumPy stands
    in for CuPy here), so nothing of CuPy's random generator runs under the tool."""
    import ml_dtypes

    host = gpt2.random_weights(gpt2.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=96, n_positions=32)).params
    fake = SimpleNamespace(asarray=np.asarray)
    for dtype in ("float32", "bfloat16"):
        drawn = targets.host_drawn(fake, host, dtype)
        assert drawn.keys() == host.keys()
        for k, v in drawn.items():
            assert v.dtype == np.dtype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
            np.testing.assert_array_equal(v, host[k].astype(v.dtype))


def test_a_reproducers_cases_run_in_order_and_print_as_they_come(monkeypatch, capsys):
    """sanitize.cases_under_tool, the loop of the three reproducers: a row per case in order, its line printed,
    and None (exit 2) where compute-sanitizer is missing."""
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: "/bin/cs")
    rows = sanitize.cases_under_tool(["a", "b"], lambda tool, name: {"case": name, "tool": tool},
                                     lambda name, r: f"{name} under {r['tool']}")
    assert rows == [{"case": "a", "tool": "/bin/cs"}, {"case": "b", "tool": "/bin/cs"}]
    assert capsys.readouterr().out.splitlines() == ["a under /bin/cs", "b under /bin/cs"]
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: None)
    assert sanitize.cases_under_tool(["a"], lambda tool, name: {}, lambda name, r: "") is None


def test_an_fp8_target_quantizes_on_the_host_and_launches_the_rung_alone(monkeypatch):
    """An FP8 rung's inputs are quantized on the host and copied (on the device the Hadamard products are
    cuBLAS's, whose stores initcheck does not see by default); the rung gets those copies, and the reference
    is the emulation of the same quantized inputs. NumPy stands in for CuPy, and the rung's launch for the
    emulation (the launch itself runs on the GPU, under the tools)."""
    import kernels

    seen = {"copied": []}

    class HostArrays:  # the parts of CuPy that attend_case uses
        nan = np.nan
        full = staticmethod(np.full)
        asnumpy = staticmethod(np.asarray)

        @staticmethod
        def asarray(x):
            seen["copied"].append(x.dtype)
            return np.array(x)

    def prepare_fp8(inputs, *, kernel, out, config):
        seen["inputs"], seen["kernel"] = inputs, kernel

        def run():
            out[...] = kernels.fp8.emulated_attention(inputs).astype(out.dtype)

        return run

    monkeypatch.setattr(kernels, "prepare_fp8", prepare_fp8)
    monkeypatch.setattr(kernels, "prepare", lambda *a, **k: pytest.fail("an FP8 target quantizes on the host"))
    assert targets.attend_case(HostArrays, "v26", "bfloat16", targets.QUICK, fp8=True)
    inputs = seen["inputs"]
    assert seen["kernel"] == "v26" and (inputs.block_q, inputs.block_k, inputs.hadamard) == (192, 128, True)
    assert len(seen["copied"]) == 6 and inputs.q.dtype == np.uint8 and inputs.q_scale.dtype == np.float32
