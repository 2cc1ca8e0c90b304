"""The GPU side of `lab.py watch`: a process the watcher keeps warm across saves, and starts afresh
after a crash (a CUDA context does not survive an illegal access) or a hang.

    python -m benchmarks.watch_worker PATH --dtype bfloat16 --shapes 8x1024,1x8192 [--nh 12 --d 64]

It warms up once: CuPy and torch imported, a CUDA context, the inputs of every shape, the rung before
the watched one in the ladder compiled and timed, SDPA timed (flash and cuDNN for 16-bit inputs,
memory-efficient for float32), CuPy's reference kernels compiled. Then, for each line on stdin, it
reads the watched file afresh, compiles what the shapes need, checks each chosen configuration against
float64 at awkward shapes, and times the rung at the shapes. Its stdout carries only JSON lines for
the watcher (`{"line": ...}`, `{"ready": ...}`, `{"done": ...}`, `{"error": ...}`, `{"compile_error":
...}`, `{"crash": ...}`); whatever a library prints goes to stderr. After a CUDA error it says so in
one line and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import kernels
from kernels import ladder

from . import device, timing
from .cases import EPS, Case, Inputs, Shape
from .device import first_line
from .peers import PEERS, peer_session

WATCH_PEERS = {"float32": ("sdpa_efficient",), "bfloat16": ("sdpa_flash", "sdpa_cudnn"),
               "float16": ("sdpa_flash", "sdpa_cudnn")}
# Few runs: a watch reports within seconds; bench.py is where numbers for the docs come from.
METHOD = timing.Method(budget_ms=100.0, min_runs=5, max_runs=30, warmup=2)
CRASH_EXIT = 3


def parse_shape(text: str) -> tuple[int, int]:
    """`8x1024` -> (8, 1024): batch x sequence length."""
    try:
        B, T = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r} must read BxT, e.g. 8x1024") from None
    if B < 1 or T < 1:
        raise ValueError(f"shape {text!r}: B and T must be at least 1")
    return B, T


def awkward_cases(rung: ladder.Rung, d: int) -> list[Case]:
    """The shapes a rung is checked at on every save: an odd length, and, where the rung declares them
    (lab.supports), query and key lengths that differ, no mask, fewer K/V heads than query heads."""
    cases = [Case("causal", 2, 3, 3, 97, 97, d)]
    if "cross" in rung.supports:
        cases.append(Case("cross", 2, 3, 3, 37, 101, d))
    if "noncausal" in rung.supports:
        cases.append(Case("non-causal", 2, 3, 3, 97, 97, d, causal=False))
    if "gqa" in rung.supports:
        cases.append(Case("gqa", 2, 4, 2, 97, 97, d))
    return cases


def previous_rung(rung: ladder.Rung, dtype: str, d: int, arch: str) -> str | None:
    """The rung before `rung` in the ladder that takes dtype and head size d on arch: the newest ladder
    rung numbered below it (a file named vNN_...; any other name: below none, so the newest), FP8 only
    beside FP8."""
    numbered = re.match(r"v(\d+)_", rung.path.name)
    number = int(numbered.group(1)) if numbered else math.inf
    for name in reversed(ladder.names()):
        other = ladder.load(name)
        if (int(other.number[1:]) < number and other.path != rung.path and dtype in other.dtypes
                and d in other.head_sizes() and other.runs_on(arch) and other.fp8 == rung.fp8):
            return name
    return None


def max_error(out, ref64) -> tuple[float, int]:
    """max |out - ref64| (inf with any NaN or Inf in out) and the count of non-finite elements."""
    cupy = device.get_cupy()
    o = out.astype(cupy.float64)
    bad = int((~cupy.isfinite(o)).sum())
    return (math.inf if bad else float(cupy.abs(o - ref64).max())), bad


class Session:
    def __init__(self, path: Path, dtype: str, shapes: list[tuple[int, int]], NH: int, d: int, send):
        self.path, self.dtype, self.d, self.send = path, dtype, d, send
        self.shapes = [Shape(B, T, NH, d) for B, T in shapes]
        self.cupy = device.get_cupy()
        self.inputs = {s.label: Inputs(s, dtype, seed=0) for s in self.shapes}
        self.case_inputs: dict[Case, Inputs] = {}
        self.flush = timing.L2Flush()

    def say(self, text: str) -> None:
        self.send({"line": text})

    def warm_up(self) -> None:
        """Compile and time what does not change from save to save: the rung before this one, SDPA."""
        limits = kernels.device_limits()
        rung = ladder.reload(self.path)
        previous = previous_rung(rung, self.dtype, self.d, limits.arch)
        columns = ([previous] if previous else []) + [PEERS[p].label for p in WATCH_PEERS[self.dtype]]
        self.say(f"GPU process: {limits.name} ({limits.arch}); timing {', '.join(columns)} once ...")
        baseline = {s.label: {} for s in self.shapes}
        for shape in self.shapes:
            row = baseline[shape.label]
            if previous:
                try:
                    run = kernels.prepare(*self.inputs[shape.label].qkv, kernel=previous)
                    row[previous] = self.time(run)
                    if shape == self.shapes[0]:  # compiles CuPy's reference kernels now, not at the first save
                        self.check_config(previous, run.instance.config)
                except (TypeError, ValueError) as exc:
                    row[previous] = f"n/a: {first_line(exc)}"
            for name in WATCH_PEERS[self.dtype]:
                row[PEERS[name].label] = self.time_peer(PEERS[name], self.inputs[shape.label])
        self.send({"ready": {"device": limits.name, "arch": limits.arch, "previous": previous, "columns": columns,
                             "baseline": baseline}})

    def time(self, run) -> float:
        return timing.time_gpu(run, stream=self.cupy.cuda.get_current_stream(), flush=self.flush,
                               method=METHOD)["median_ms"]

    def time_peer(self, peer, inputs: Inputs) -> float | str:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with peer_session(peer, inputs) as (launch, stream):
                    self.cupy.cuda.Device().synchronize()  # CuPy's writes of the inputs are done before torch runs
                    return timing.time_gpu(launch, stream=stream, flush=self.flush, method=METHOD)["median_ms"]
        except device.Unavailable as exc:
            return f"n/a: {exc}"
        except Exception as exc:  # a backend that refuses this dtype or shape
            if not healthy():
                raise
            return f"n/a: {first_line(exc)}"

    def check(self) -> None:
        """One save: compile for every shape, check each chosen configuration, time."""
        start = time.perf_counter()
        try:
            rung = ladder.reload(self.path)
        except ValueError as exc:
            self.send({"error": str(exc)})
            return
        compile_before = kernels.runtime.compile_seconds
        runs, configs = {}, {}
        for shape in self.shapes:
            try:
                run = kernels.prepare(*self.inputs[shape.label].qkv, kernel=str(self.path))
            except kernels.KernelCompileError as exc:
                self.send({"compile_error": str(exc)})
                return
            except (TypeError, ValueError) as exc:  # a head size, dtype or length the rung does not take
                configs[shape.label] = f"n/a: {first_line(exc)}"
                continue
            runs[shape.label], configs[shape.label] = run, run.instance.describe()
        compiled = time.perf_counter()
        checks = []
        for config in dict.fromkeys(run.instance.config for run in runs.values()):
            checks += self.check_config(str(self.path), config, rung)
        checked = time.perf_counter()
        times = {label: self.time(run) for label, run in runs.items()}
        times |= {label: text for label, text in configs.items() if label not in runs}
        self.send({"done": {"configs": configs, "checks": checks, "times": times, "seconds": {
            "compile": kernels.runtime.compile_seconds - compile_before, "prepare": compiled - start,
            "check": checked - compiled, "time": time.perf_counter() - checked}}})

    def check_config(self, kernel: str, config: tuple[int, ...], rung: ladder.Rung | None = None) -> list[dict]:
        """The configuration against float64 at the awkward cases, on NaN-poisoned outputs; the bound as
        tests/test_kernels_gpu.py sets it for unit-magnitude inputs: lab.tolerance x max(the plain
        implementation's error in the same dtype, eps(dtype) x max |ref64|)."""
        cupy = self.cupy
        rung = rung or ladder.load(kernel)
        factor = rung.tolerance_factor(config)
        results = []
        for case in awkward_cases(rung, self.d):
            if case not in self.case_inputs:
                self.case_inputs[case] = Inputs(case, self.dtype, seed=1)
            q, k, v = self.case_inputs[case].qkv
            out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)  # poison: an unwritten element fails
            kernels.prepare(q, k, v, kernel=kernel, causal=case.causal, config=config, out=out)()
            ref64 = kernels.reference_attention(*(x.astype(cupy.float64) for x in (q, k, v)), causal=case.causal)
            plain, _ = max_error(kernels.reference_attention(q, k, v, causal=case.causal), ref64)
            err, bad = max_error(out, ref64)
            bound = factor * max(plain, EPS[self.dtype] * float(cupy.abs(ref64).max()))
            results.append({"case": case.label + (f" NH={case.NH}/{case.NH_kv}" if case.NH_kv != case.NH else ""),
                            "config": ", ".join(map(str, config)), "max_err": err, "nonfinite": bad,
                            "plain": plain, "factor": factor, "bound": bound, "ok": err <= bound})
        return results


def healthy() -> bool:
    """Whether this process's CUDA context still works: an illegal access leaves every later call failing."""
    try:
        device.get_cupy().cuda.runtime.deviceSynchronize()
        return True
    except Exception:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--dtype", required=True)
    p.add_argument("--shapes", required=True, help="BxT,BxT,...")
    p.add_argument("--nh", type=int, default=12)
    p.add_argument("--d", type=int, default=64)
    args = p.parse_args(argv)
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints to stderr: stdout is the watcher's

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        session = Session(args.path, args.dtype, [parse_shape(s) for s in args.shapes.split(",")], args.nh, args.d,
                          send)
        session.warm_up()
        for _ in sys.stdin:
            try:
                session.check()
            except Exception as exc:
                if healthy():  # a Python error of its own: say it, stay warm
                    send({"error": first_line(exc)})
                    continue
                raise
    except (KeyboardInterrupt, BrokenPipeError):
        return 0
    except Exception as exc:  # the CUDA context is gone (an illegal address, a launch failure)
        send({"crash": first_line(exc)})
        return CRASH_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
