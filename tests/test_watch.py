"""`lab.py watch` without a GPU: the watcher driven as a subprocess on a copy of a rung (a good save, a
broken one, the save that mends it, a header that does not parse, Ctrl-C), and the report's pure parts."""

import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kernels
from benchmarks import watch_report as report
from benchmarks.watch_worker import awkward_cases, parse_shape, previous_rung

ROOT = Path(__file__).resolve().parent.parent
REPORT = re.compile(r"^report [\d.]+ s after the save")


class Watcher:
    """`python lab.py watch ...` in the background, its output read line by line with timeouts."""

    def __init__(self, *args):
        self.process = subprocess.Popen([sys.executable, "lab.py", "watch", *map(str, args)], cwd=ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, pattern: re.Pattern, timeout: float = 120.0) -> list[str]:
        """The lines up to and including the first that matches, or a failure showing all output so far."""
        got, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"no line matching {pattern.pattern!r} within {timeout} s; output:\n" + "\n".join(self.seen))
            got.append(line)
            self.seen.append(line)
            if pattern.search(line):
                return got

    def report(self, timeout: float = 120.0) -> list[str]:
        return self.until(REPORT, timeout)

    def interrupt(self, timeout: float = 30.0) -> int:
        os.kill(self.process.pid, signal.SIGINT)
        rc = self.process.wait(timeout)
        self.seen += [line for line in iter(self.lines.get, None)]
        return rc

    def close(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def rung_copy(tmp_path):
    source = kernels.resolve("v05")
    path = tmp_path / source.name
    shutil.copy(source, path)
    return path


def save(path: Path, text: str):
    """A save as an editor makes it: a new file renamed over the old one."""
    temporary = path.with_name(path.name + ".saving")
    temporary.write_text(text)
    os.replace(temporary, path)


def line_of(text: str, fragment: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if fragment in line)


def test_watch_reports_breaks_and_mends_without_a_restart(rung_copy):
    good = rung_copy.read_text()
    target = "const int rows = min(B_r, T - row_start);"
    broken = good.replace(target, "const int rows = min(B_r, T - row_start) + undefined_rows;")
    watcher = Watcher(rung_copy, "--device", "cpu", "--shape", "1x256")
    try:
        first = watcher.report()
        for arch in ("sm_90", "sm_80"):
            assert any(re.search(rf"{arch} d_head=64, B_r=32, B_c=32 +\d+ registers +smem \d+ \+ \d+ +stack \d+ +"
                                 r"spills \d+/\d+", line) for line in first), first

        save(rung_copy, broken)
        error = watcher.report()
        where = f"{rung_copy}:{line_of(broken, 'undefined_rows')}: error"
        assert any(line.startswith(where) and "undefined_rows" in line for line in error), error
        assert not any("kern.cu" in line or "default_program" in line for line in error)

        save(rung_copy, good.replace("lab.configs    (64, 32, 32)", "lab.configs    (64, 32, 32), (64, 16, 32)"))
        mended = watcher.report()
        assert any("sm_90 d_head=64, B_r=16, B_c=32" in line for line in mended), mended
        assert any(line.startswith("since last save:") for line in mended), mended

        save(rung_copy, good.replace("lab.configs    (64, 32, 32)", "lab.configs    (64, 32, 32"))
        declaration = watcher.report()
        body = declaration[next(i for i, x in enumerate(declaration) if x.startswith("-- save")) + 1:-1]
        assert len(body) == 1, body  # one line
        assert body[0].startswith(f"{rung_copy}:{line_of(good, 'lab.configs')}: lab.configs is not a list of tuples")

        save(rung_copy, good)
        again = watcher.report()
        assert any("sm_80 d_head=64, B_r=32, B_c=32" in line for line in again), again
        assert watcher.process.poll() is None  # one watcher all along
        assert watcher.interrupt() == 130
        assert not any("Traceback" in line for line in watcher.seen), watcher.seen
    finally:
        watcher.close()


def test_once_exits_with_the_verdict(rung_copy):
    ok = subprocess.run([sys.executable, "lab.py", "watch", str(rung_copy), "--device", "cpu", "--once"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert REPORT.search(ok.stdout.splitlines()[-1])
    rung_copy.write_text(rung_copy.read_text().replace("lab.threads", "lab.thread"))
    bad = subprocess.run([sys.executable, "lab.py", "watch", str(rung_copy), "--device", "cpu", "--once"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert f"{rung_copy}:{line_of(rung_copy.read_text(), 'lab.thread')}: unknown declaration lab.thread" in bad.stdout


def test_unknown_rung_is_one_line():
    result = subprocess.run([sys.executable, "lab.py", "watch", "v99"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown kernel 'v99'" in result.stderr


# -- the pure parts ------------------------------------------------------------------------------


def test_locate_names_the_watched_file_and_line():
    log = ('/tmp/tmpab12cd/kern.cu(3): error: expected a ";"\n'
           '/home/me/v99.cu(57): error: identifier "x" is undefined\n'
           '/home/me/helpers.cuh(8): warning #177-D: variable "y" was declared but never referenced\n'
           '2 errors detected in the compilation of "/tmp/tmpab12cd/kern.cu".')
    assert report.locate(log, "/home/me/v99.cu").splitlines() == [
        '/home/me/v99.cu:3: error: expected a ";"',
        '/home/me/v99.cu:57: error: identifier "x" is undefined',
        '/home/me/helpers.cuh:8: warning #177-D: variable "y" was declared but never referenced',
        '2 errors detected in the compilation of "/home/me/v99.cu".']


def test_declaration_error_points_at_the_declaration(tmp_path):
    path = tmp_path / "v99_idea.cu"
    path.write_text("/*\n * lab.template d_head, B_r\n * lab.configs (64, 32\n * lab.smem 4 * B_x\n */\n")
    assert report.declaration_error(path, f"{path}: lab.configs is not a list of tuples: '(64, 32'") == \
        f"{path}:3: lab.configs is not a list of tuples: '(64, 32'"
    assert report.declaration_error(path, "cannot evaluate 'B_x' in '4 * B_x' (names: d_head, B_r)") == \
        f"{path}:4: cannot evaluate 'B_x' in '4 * B_x' (names: d_head, B_r)"
    assert report.declaration_error(path, f"{path}:2: unknown declaration lab.x") == f"{path}:2: unknown declaration lab.x"
    assert report.declaration_error(path, f"{path}: missing declaration(s)\nlab.threads") == \
        f"{path}: missing declaration(s) lab.threads"


def resources(registers=96, spills=0, warnings=(), config=(64, 64, 64), arch="sm_90"):
    return {"arch": arch, "config": dict(zip(("d_head", "B_r", "B_c"), config)), "registers": registers,
            "static_smem": 0, "dynamic_smem": 49152, "stack_bytes": spills, "spill_stores": spills,
            "spill_loads": spills, "performance_warnings": list(warnings)}


def test_diff_resources_names_what_changed():
    old = report.resource_rows([resources(), resources(config=(64, 32, 32))])
    new = report.resource_rows([resources(104, 8, ["(C7520) wgmma serialized"]), resources(config=(64, 128, 64))])
    key = "sm_90 d_head=64, B_r=64, B_c=64"
    assert report.diff_resources(old, new) == [
        "sm_90 d_head=64, B_r=128, B_c=64: new",
        "sm_90 d_head=64, B_r=32, B_c=32: no longer compiled",
        f"{key}: registers 96 -> 104 (+8); stack 0 -> 8 (+8); spill stores 0 -> 8 (+8); spill loads 0 -> 8 (+8); "
        "ptxas warning new: (C7520) wgmma serialized"]
    assert report.diff_resources(new, new) == []
    assert report.diff_resources(None, new) == []
    lines = report.format_resources(new)
    assert any(line.strip().startswith(key) and "104 registers" in line and "spills 8/8" in line for line in lines)
    assert "ptxas: (C7520) wgmma serialized" in lines[1]


def test_timing_table_and_change():
    assert report.change(2.0, 1.85) == "-0.150 ms (-7.5%)"
    assert report.change(None, 1.0) == "-"
    baseline = {"8x1024": {"v04_fast_math": 3.0, "SDPA efficient": 1.5}, "1x8192": {"v04_fast_math": "n/a: too long"}}
    lines = report.format_timing("v05", {"8x1024": 2.0, "1x8192": 4.0}, baseline, {"8x1024": 2.5},
                                 ["v04_fast_math", "SDPA efficient"])
    assert lines[0].split() == ["shape", "v05", "ms", "v04_fast_math", "ms", "SDPA", "efficient", "ms", "since",
                                "last", "save"]
    assert lines[1].split() == ["8x1024", "2.000", "3.000", "(1.50x)", "1.500", "(0.75x)", "-0.500", "ms", "(-20.0%)"]
    assert lines[2].split()[:4] == ["1x8192", "4.000", "n/a:", "too"] and lines[2].split()[-1] == "-"


def test_checks_and_verdict():
    good = {"case": "causal 2x97", "config": "64, 32, 32", "max_err": 1e-7, "nonfinite": 0, "plain": 1e-7,
            "factor": 8, "bound": 8e-7, "ok": True}
    unwritten = good | {"case": "cross 2x37/101", "max_err": math.inf, "nonfinite": 12, "ok": False}
    lines, ok = report.format_checks([good, unwritten])
    assert not ok and lines[0].endswith(": ok") and lines[1].endswith(": WRONG") and "12 elements NaN/inf" in lines[1]
    assert report.verdict([good]) == "verdict: CORRECT (1 cases within the bound)"
    assert report.verdict([good, unwritten]) == "verdict: WRONG (cross 2x37/101)"


def test_awkward_cases_follow_the_declared_features():
    assert [c.label for c in awkward_cases(kernels.load("v05"), 64)] == ["causal 2x97"]
    full = awkward_cases(kernels.load("v24"), 64)
    assert [c.part for c in full] == ["causal", "cross", "non-causal", "gqa"]
    assert all(c.T_q % 2 for c in full) and any(c.T_q != c.T_k for c in full)
    assert any(not c.causal for c in full) and any(c.NH_kv < c.NH for c in full)


def test_previous_rung_is_the_nearest_earlier_that_runs(tmp_path):
    assert previous_rung(kernels.load("v05"), "float32", 64, "sm_90") == "v04_fast_math"
    assert previous_rung(kernels.load("v24"), "bfloat16", 64, "sm_90") == "v23_pingpong"
    copy = tmp_path / "v19_mine.cu"
    shutil.copy(kernels.resolve("v19"), copy)
    assert previous_rung(kernels.load(copy), "bfloat16", 64, "sm_90") == "v18_wgmma"  # not v19 itself
    assert previous_rung(kernels.load(copy), "bfloat16", 64, "sm_80") not in ("v18_wgmma", None)
    unnumbered = tmp_path / "idea.cu"
    shutil.copy(kernels.resolve("v05"), unnumbered)
    newest = [n for n in kernels.names() if "float32" in kernels.load(n).dtypes and not kernels.load(n).fp8
              and 64 in kernels.load(n).head_sizes() and kernels.load(n).runs_on("sm_90")][-1]
    assert previous_rung(kernels.load(unnumbered), "float32", 64, "sm_90") == newest


def test_parse_shape():
    assert parse_shape("8x1024") == (8, 1024)
    for bad in ("8", "0x4", "ax3"):
        with pytest.raises(ValueError, match="at least 1" if bad == "0x4" else "BxT"):
            parse_shape(bad)


def test_reload_reads_a_save_that_changes_no_stamp(tmp_path):
    path = tmp_path / "v05_copy.cu"
    text = kernels.resolve("v05").read_text()
    path.write_text(text)
    stamp = path.stat().st_mtime_ns
    assert kernels.load(path).configs[0] == (64, 32, 32)
    path.write_text(text.replace("(64, 32, 32), (32", "(64, 16, 32), (32"))  # the same size
    os.utime(path, ns=(stamp, stamp))
    assert kernels.load(path).configs[0] == (64, 32, 32)  # load trusts the stamps
    assert kernels.ladder.reload(path).configs[0] == (64, 16, 32)
    assert kernels.load(path).configs[0] == (64, 16, 32)


# -- the GPU side's protocol, with a stand-in for the GPU process ---------------------------------

FAKE_WORKER = r'''
import json, sys, time
path = sys.argv[1]
send = lambda m: (sys.stdout.write(json.dumps(m) + "\n"), sys.stdout.flush())
send({"line": "GPU process: a stand-in"})
send({"ready": {"device": "stand-in", "arch": "sm_90", "previous": "v04_fast_math", "columns": ["v04_fast_math"],
                "baseline": {"1x64": {"v04_fast_math": 0.5}}}})
for _ in sys.stdin:
    text = open(path).read()
    if "CRASH" in text:
        send({"crash": "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered"})
        sys.exit(3)
    if "HANG" in text:
        time.sleep(60)
    ok = "WRONG" not in text
    check = {"case": "causal 2x97", "config": "64, 32, 32", "max_err": 1e-7 if ok else 1.0, "nonfinite": 0,
             "plain": 1e-7, "factor": 8, "bound": 8e-7, "ok": ok}
    send({"done": {"configs": {"1x64": "d_head=64, B_r=32, B_c=32"}, "checks": [check], "times": {"1x64": 0.25},
                   "seconds": {"compile": 0.1, "prepare": 0.1, "check": 0.1, "time": 0.1}}})
'''


def test_gpu_protocol_report_crash_and_hang(rung_copy, tmp_path, monkeypatch, capsys):
    from benchmarks import watch

    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    monkeypatch.setattr(watch, "worker_command", lambda path, args: [sys.executable, str(fake), str(path)])
    args = watch.parse_args([str(rung_copy), "--shape", "1x64", "--timeout", "3"])
    w = watch.Watch(rung_copy, args, gpu=True)
    good = rung_copy.read_text()
    try:
        assert w.check(time.time())
        out = capsys.readouterr().out
        assert "GPU process: a stand-in" in out and "verdict: CORRECT (1 cases within the bound)" in out
        assert re.search(r"1x64 +0\.250 +0\.500 \(2\.00x\) +-", out), out
        assert "sm_90 d_head=64, B_r=32, B_c=32" in out and re.search(r"checked and timed [\d.]+ s after the save", out)

        rung_copy.write_text(good + "// WRONG\n")
        assert not w.check(time.time())
        out = capsys.readouterr().out
        assert "verdict: WRONG (causal 2x97)" in out and "+0.000 ms (+0.0%)" in out

        for planted, first_word in (("CRASH", "crash:"), ("HANG", "hang:")):
            rung_copy.write_text(good + f"// {planted}\n")
            assert not w.check(time.time())
            out = capsys.readouterr().out.splitlines()
            assert [line.split()[0] for line in out if line.split()[0] in ("crash:", "hang:")] == [first_word], out
            assert REPORT.match(out[-1]), out
            rung_copy.write_text(good)
            assert w.check(time.time())  # a fresh process, warmed up for this save
            assert "verdict: CORRECT" in capsys.readouterr().out
    finally:
        w.close()


def test_the_demo_table_is_read_from_the_demo_output():
    """docs/watch.md's speed table comes from tools/watch_demo.py's lines, each against the 3 s aim."""
    from benchmarks.watch_report import render_demo

    text = ("v05 float32 8x1024: save 0: checked and timed after 0.39 s, whole report after 0.67 s\n"
            "Dev X: v05_warp_shuffles float32 8x1024: median save-to-report 0.40 s checked and timed, 0.66 s with resources\n"
            "Dev X: v24_persistent bfloat16 8x1024: median save-to-report 2.90 s checked and timed, 3.50 s with resources\n")
    table = render_demo(text, "../results/watch-x.txt")
    assert "| `v05_warp_shuffles` | float32 | 0.40 | 0.66 | yes |" in table
    assert "| `v24_persistent` | bfloat16 | 2.90 | 3.50 | **no** |" in table
    assert table.startswith("Dev X, [watch-x.txt](../results/watch-x.txt)")
    with pytest.raises(ValueError, match="no `median save-to-report` line"):
        render_demo("nothing measured\n", "x.txt")


def test_stopping_a_worker_that_has_just_ended():
    """The reader thread's wait() can reap the worker between stop()'s poll() and its kill (a race CI
    hit): stop() then finds no process group and must still return."""
    from benchmarks.watch import Worker

    w = Worker([sys.executable, "-c", "pass"])
    assert w.next(timeout=30) == {"exit": 0}  # the reader thread has reaped it
    w.process.poll = lambda: None  # as if poll() had run just before the exit
    w.stop()
    assert w.process.returncode == 0
