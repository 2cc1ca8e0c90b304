"""`python lab.py watch RUNG_OR_PATH`: compile, check and time a rung on every save.

    python lab.py watch v24                             a rung of the ladder, on the GPU
    python lab.py watch kernels/v26_idea.cu --shape 8x1024
    python lab.py watch ~/mine/v99_idea.cu --dtype float16 --device cpu
    python lab.py watch v05 --once                      one report, then exit (scripts, tests)

RUNG_OR_PATH is a rung's name or a .cu file anywhere with its `lab.*` header (kernels.resolve). The
watcher polls the file and the files it includes (mtime, size, inode: no dependency) and reports on
every save: an NVRTC error at the file's own lines, a declaration that does not parse in one line;
then, without a GPU (--device cpu, or none here), registers, shared memory, stack, spills and ptxas's
performance warnings per configuration for sm_90 and sm_80, and what changed since the last save. On
a GPU, a warm child process (benchmarks/watch_worker.py) checks the configurations the shapes choose
against float64 at awkward shapes and times the rung at the shapes beside the rung before it and SDPA,
while this process compiles the resource report for the device's architecture; a crash or a hang in
the kernel is reported in one line and the next save is checked in a fresh process. Each report ends
with the seconds from the save to the report. Ctrl-C ends the watch.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kernels
from kernels import ladder
from lm.cli import Parser

from . import watch_report as report
from .device import ROOT
from .watch_worker import parse_shape

CPU_ARCHES = ("sm_90", "sm_80")  # as the CPU tests compile
DEFAULT_SHAPES = ("8x1024", "1x8192")
SETTLE = 0.05  # seconds a save must rest before it is read: an editor may write it in pieces


def parse_args(argv) -> argparse.Namespace:
    p = Parser(prog="lab.py watch", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("rung", metavar="RUNG_OR_PATH", help="v24, v24_persistent, or a path to a .cu file")
    p.add_argument("--shape", action="append", metavar="BxT",
                   help=f"a shape to time, NH=12 and d=64 unless --nh/--d say otherwise; repeat for more "
                        f"(default {' and '.join(DEFAULT_SHAPES)})")
    p.add_argument("--dtype", choices=list(ladder.DTYPES), help="default: the rung's first lab.dtypes")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: check and time; cpu: compile for sm_90 and sm_80 only; auto: gpu if there is one")
    p.add_argument("--nh", type=int, default=12, help="query heads of the timed shapes (default 12)")
    p.add_argument("--d", type=int, default=64, help="head size (default 64)")
    p.add_argument("--once", action="store_true", help="report on the file as it is, then exit: 0 if it "
                                                       "compiled (and on the GPU checked correct), else 1")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between polls (default 0.1)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a GPU check may go without a word before it is taken as hung (default 60)")
    args = p.parse_args(argv)
    try:
        args.shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    except ValueError as exc:
        p.error(str(exc))
    return args


def stamps(paths: list[Path]) -> dict[Path, tuple | None]:
    """What a save changes: each file's mtime, size and inode (None while a save replaces it)."""
    out = {}
    for p in paths:
        try:
            st = p.stat()
            out[p] = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            out[p] = None
    return out


def worker_command(path: Path, args) -> list[str]:
    shapes = ",".join(f"{B}x{T}" for B, T in args.shapes)
    return [sys.executable, "-m", "benchmarks.watch_worker", str(path), "--dtype", args.dtype, "--shapes", shapes,
            "--nh", str(args.nh), "--d", str(args.d)]


class Worker:
    """The GPU process: started once and kept warm across saves; after a crash or a hang, a fresh one.
    Its JSON lines arrive on a queue (a reader thread), so that a silent process can time out."""

    def __init__(self, command: list[str]):
        # a session of its own: Ctrl-C in the terminal reaches the watcher, which ends the worker quietly
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=ROOT, start_new_session=True)
        self.messages: queue.Queue = queue.Queue()
        self.ready: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            try:
                self.messages.put(json.loads(line))
            except json.JSONDecodeError:
                self.messages.put({"line": line.rstrip()})
        self.messages.put({"exit": self.process.wait()})

    def next(self, timeout: float) -> dict | None:
        """The next message, or None after `timeout` seconds of silence; a `ready` message is kept."""
        try:
            message = self.messages.get(timeout=timeout)
        except queue.Empty:
            return None
        if "ready" in message:
            self.ready = message["ready"]
        return message

    def request(self) -> bool:
        try:
            self.process.stdin.write("check\n")
            self.process.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):
            return False

    def stop(self):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the worker and nothing else
            except ProcessLookupError:
                pass  # it ended after poll(), and the reader thread's wait() reaped it
        self.process.wait()


class Watch:
    def __init__(self, path: Path, args, gpu: bool):
        self.path, self.args, self.gpu = path, args, gpu
        self.files = [path]  # the file and its includes, from the last parse
        self.saves = 0
        self.last_resources: dict | None = None
        self.last_times: dict | None = None
        self.worker: Worker | None = None
        self.started = time.time()

    def run(self) -> int:
        seen: dict = {}
        while True:
            now = stamps(self.files)
            if now == seen:
                self.idle(self.args.interval)
                continue
            time.sleep(SETTLE)
            if stamps(self.files) != now or None in now.values():
                continue
            seen = now
            saved = max(stamp[0] for stamp in now.values()) / 1e9
            ok = self.check(saved if saved > self.started else time.time())  # the first report: from now
            if self.args.once:
                return 0 if ok else 1
            # includes this parse found are watched from their state now; the rest as they were when read
            seen = stamps(self.files) | {p: seen[p] for p in self.files if p in seen}

    def idle(self, seconds: float):
        """Wait between polls, showing what a warming GPU process says meanwhile."""
        if self.worker is None:
            time.sleep(seconds)
            return
        message = self.worker.next(seconds)
        if message is not None:
            self.show(message)

    def check(self, saved: float) -> bool:
        """One save's report; whether it compiled (and on the GPU checked correct)."""
        self.saves += 1
        print(f"-- save {self.saves}: {self.path} at {time.strftime('%H:%M:%S', time.localtime(saved))} --", flush=True)
        try:
            rung = ladder.reload(self.path)
        except ValueError as exc:
            return self.say(report.declaration_error(self.path, str(exc)), saved, ok=False)
        self.files = [p for p, _ in rung.files]
        self.args.dtype = self.args.dtype or rung.dtypes[0]  # fixed at the first header that parses
        if self.args.dtype not in rung.dtypes:
            return self.say(f"{self.path}: {rung.name} takes {', '.join(rung.dtypes)}, not --dtype {self.args.dtype}",
                            saved, ok=False)
        configs = rung.configs_for(self.args.d, self.args.dtype)
        if not configs:
            sizes = ", ".join(map(str, rung.head_sizes()))
            return self.say(f"{self.path}: {rung.name} declares head sizes {sizes}, not --d {self.args.d}", saved, ok=False)
        return self.check_gpu(rung, configs, saved) if self.gpu else self.check_cpu(rung, configs, saved)

    def say(self, text: str, saved: float, ok: bool) -> bool:
        if text:
            print(text)
        print(f"report {time.time() - saved:.2f} s after the save", flush=True)
        return ok

    def resources(self, rung, configs, arches) -> dict:
        """The resource rows for each architecture the rung compiles for (one NVRTC child process each, in
        parallel), and a line for each it does not; KernelCompileError from the first that fails."""
        able = [a for a in arches if rung.runs_on(a)]
        with ThreadPoolExecutor(max_workers=len(able) or 1) as pool:
            reports = list(pool.map(lambda a: kernels.compile_report(rung.path, a, configs), able))
        rows = {}
        for r in reports:
            rows |= report.resource_rows(r)
        skipped = [f"  {a}: not compiled, {rung.name} needs {rung.arch_needed()}" for a in arches if a not in able]
        return {"rows": rows, "skipped": skipped}

    def show_resources(self, found: dict):
        print("resources:")
        for line in report.format_resources(found["rows"]) + found["skipped"]:
            print(line)
        changes = report.diff_resources(self.last_resources, found["rows"])
        if self.last_resources is not None:
            print("since last save: " + ("; ".join(changes) if changes else "resources unchanged"))
        self.last_resources = found["rows"]

    def check_cpu(self, rung, configs, saved: float) -> bool:
        try:
            found = self.resources(rung, configs, CPU_ARCHES)
        except kernels.KernelCompileError as exc:
            return self.say(report.locate(str(exc), self.path), saved, ok=False)
        self.show_resources(found)
        return self._done(saved, None)

    def _done(self, saved: float, phases: dict | None) -> bool:
        """The report's last line: seconds from the save, and the GPU process's own (compile, check, time)."""
        detail = "" if not phases else " (GPU process: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()) + ")"
        print(f"report {time.time() - saved:.2f} s after the save{detail}", flush=True)
        return True

    # -- GPU ---------------------------------------------------------------------------------------

    def start_worker(self):
        self.worker = Worker(worker_command(self.path, self.args))

    def wait_ready(self) -> bool:
        """Until the GPU process has warmed up (its lines shown as they come); False if it died or hung."""
        while self.worker.ready is None:
            message = self.worker.next(self.args.timeout)
            if message is None or "exit" in message or "crash" in message:
                self.lost(message)
                return False
            self.show(message)
        return True

    def lost(self, message: dict | None):
        """The GPU process crashed, hung or exited: one line, and a fresh process warming up for the next save."""
        if message is None:
            print(f"hang: no word from the GPU process in {self.args.timeout:g} s; killed it")
        elif "crash" in message:
            print(f"crash: {message['crash']}")
        else:
            print(f"crash: the GPU process exited with status {message.get('exit')}")
        self.worker.stop()
        self.start_worker()
        print("the next save is checked in a fresh GPU process", flush=True)

    def show(self, message: dict):
        if "line" in message:
            print(message["line"], flush=True)
        elif "exit" in message or "crash" in message:
            self.lost(message)

    def check_gpu(self, rung, configs, saved: float) -> bool:
        if self.worker is None:
            self.start_worker()
        if not self.wait_ready():
            return self.say("the GPU process did not start", saved, ok=False)
        ready = self.worker.ready
        resources = ThreadPoolExecutor(max_workers=1)
        found = resources.submit(self.resources, rung, configs, [ready["arch"]])
        if not self.worker.request():
            self.lost({"exit": self.worker.process.poll()})
            return self.say("", saved, ok=False)
        while True:
            message = self.worker.next(self.args.timeout)
            if message is None or "exit" in message or "crash" in message:
                self.lost(message)
                resources.shutdown(wait=False)
                return self.say("", saved, ok=False)
            if "line" in message:
                print(message["line"], flush=True)
            elif "compile_error" in message:
                resources.shutdown(wait=False)
                return self.say(report.locate(message["compile_error"], self.path), saved, ok=False)
            elif "error" in message:
                resources.shutdown(wait=False)
                return self.say(report.declaration_error(self.path, message["error"]), saved, ok=False)
            elif "done" in message:
                break
        done = message["done"]
        lines, ok = report.format_checks(done["checks"])
        print(f"check against float64 (bound: lab.tolerance x a plain {self.args.dtype} implementation's error):")
        print("\n".join(lines))
        print(report.verdict(done["checks"]))
        name = rung.name.split("_", 1)[0]
        print(f"timing (median of CUDA events; NH={self.args.nh}, d={self.args.d}, {self.args.dtype}; "
              f"(Nx): {name}'s speed-up over it):")
        print("\n".join(report.format_timing(name, done["times"], ready["baseline"], self.last_times, ready["columns"])))
        self.last_times = {k: v for k, v in done["times"].items() if isinstance(v, float)}
        gpu_report = time.time() - saved
        print(f"checked and timed {gpu_report:.2f} s after the save", flush=True)
        try:
            self.show_resources(found.result())
        except kernels.KernelCompileError as exc:  # the device compiled it: only ptxas's report is missing
            print(report.locate(str(exc), self.path))
        resources.shutdown()
        return self._done(saved, done["seconds"]) and ok

    def close(self):
        if self.worker is not None:
            self.worker.stop()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = kernels.resolve(args.rung)
    except ValueError as exc:
        print(f"lab.py watch: error: {exc}", file=sys.stderr)
        return 2
    gpu = args.device != "cpu" and kernels.gpu_available()
    if args.device == "gpu" and not gpu:
        print("lab.py watch: error: --device gpu: no CUDA device (or CuPy) here; use --device cpu", file=sys.stderr)
        return 2
    where = "on the GPU" if gpu else f"without a GPU: compiled for {' and '.join(CPU_ARCHES)}"
    print(f"watching {path} ({where}); Ctrl-C ends the watch", flush=True)
    watch = Watch(path, args, gpu)
    try:
        return watch.run()
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    finally:
        watch.close()
