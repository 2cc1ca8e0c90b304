"""Where a forward rung's consumer warpgroups spend a step of their loop, cycle by cycle: the SM clock read
at five points of each step by block 0's consumers (kernels/v34_lazy_rescale.cu's STEP_TRACE build).

    python3 tools/rung_trace.py [--kernel v34] [--case 4x16x4096-d128-noncausal] [--timeline 6]

The rung must declare the diagnostic (`#ifndef STEP_TRACE` and `step_trace`); the tool compiles a copy of
it with `-DSTEP_TRACE=1` added to its lab.options (the rung's own build is untouched: with the switch off
nothing is compiled in), runs the case once to warm up and once traced on random bfloat16 inputs, and
prints, per consumer, the median and the 10th-90th percentile of each phase over the traced steps:

    issue      loop top to the step's products issued: the waits for K_j and V_j-1 to land, the rescale
               of O_i where a row's reference moved, the turn (d = 64), the products' issue
    S wait     to S_ij landed (wgmma.wait_group 1)
    softmax    to the softmax done (and, at d = 128, its row sums stored: the pin)
    PV wait    to P V landed (wgmma.wait_group 0)
    rest       to the next step's loop top: the releases and P rounded to 16 bits
    step       loop top to loop top

`--timeline K` prints K ring uses one after another as well, from the middle of the block's first tile:
when each consumer reached each point, in cycles after consumer 0's loop top at the first of them (the
consumers of a block read one SM's clock), so that whose softmax overlaps whose products shows.

Cycles are the SM clock's (clock64): at the H200's 1.98 GHz boost about 2 per ns. Steps of the block's
first tiles only (the trace holds TRACE_STEPS ring uses), and not a tile's first step (it has no P V
before it), so the figures describe the steady loop of the heavy tiles a block draws first.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("issue", "S wait", "softmax", "PV wait", "rest", "step")


def with_trace(source: str) -> str:
    """The rung's file with -DSTEP_TRACE=1 added to its lab.options; ValueError where it declares neither
    the switch nor the options line."""
    if "#ifndef STEP_TRACE" not in source or "step_trace[" not in source:
        raise ValueError("the kernel has no STEP_TRACE diagnostic (#ifndef STEP_TRACE and step_trace)")
    out, n = re.subn(r"^( \* lab\.options[ \t]+)(.*)$", r"\1\2 -DSTEP_TRACE=1", source, count=1, flags=re.M)
    if n != 1:
        raise ValueError("the kernel declares no lab.options line to add -DSTEP_TRACE=1 to")
    return out


def trace_shape(source: str) -> tuple[int, int, int]:
    """(consumers, ring uses, points) of the rung's step_trace, from its declaration
    (`__device__ long long step_trace[3][TRACE_STEPS][TRACE_POINTS]`) and its constants' values."""
    dims = re.search(r"__device__ long long step_trace\[(\w+)\]\[(\w+)\]\[(\w+)\]", source)
    if dims is None:
        raise ValueError("the kernel declares no step_trace[consumers][uses][points]")

    def value(word: str) -> int:
        if word.isdigit():
            return int(word)
        m = re.search(rf"\b{word} = (\d+)", source)
        if m is None:
            raise ValueError(f"step_trace's {word} has no value in the file")
        return int(m.group(1))

    return tuple(value(w) for w in dims.groups())


def phases(trace: np.ndarray) -> dict[int, np.ndarray]:
    """Per consumer c with traced steps: (steps, 6) cycles of PHASES, from trace (consumers, uses, 5) of
    clock64 values (0: not traced). A step counts where its five points and the next use's loop top are
    all there and in order (a tile's last step is followed by the next tile's first, which has no loop
    top: those steps drop out)."""
    out = {}
    for c in range(trace.shape[0]):
        t = trace[c].astype(np.int64)
        rows = []
        for u in range(t.shape[0] - 1):
            points, after = t[u], t[u + 1, 0]
            if (points == 0).any() or after == 0:
                continue
            marks = np.append(points, after)
            if (np.diff(marks) < 0).any():
                continue
            rows.append(np.append(np.diff(marks), after - points[0]))
        if rows:
            out[c] = np.asarray(rows)
    return out


def table(by_consumer: dict[int, np.ndarray]) -> str:
    """One line per consumer and phase: median, 10th and 90th percentile, cycles, and the phase's share
    of the median step."""
    lines = [f"{'consumer':>8s} {'phase':>8s} {'median':>8s} {'p10':>8s} {'p90':>8s} {'of step':>8s}"]
    for c, rows in by_consumer.items():
        step = float(np.median(rows[:, -1]))
        for i, name in enumerate(PHASES):
            col = rows[:, i]
            share = f"{100 * np.median(col) / step:7.1f}%" if name != "step" else f"{len(rows):5d} st"
            lines.append(f"{c:8d} {name:>8s} {np.median(col):8.0f} {np.percentile(col, 10):8.0f} "
                         f"{np.percentile(col, 90):8.0f} {share:>8s}")
    return "\n".join(lines)


def timeline(trace: np.ndarray, first: int, count: int) -> str:
    """Ring uses first .. first + count - 1 of trace (consumers, uses, 5), one line per use and consumer:
    the five points in cycles after consumer 0's loop top at use `first` ('-': not traced)."""
    points = ("top", "issued", "S", "softmax", "PV")
    base = int(trace[0, first, 0])
    if base == 0:
        raise ValueError(f"ring use {first} has no loop top traced for consumer 0")
    lines = [f"{'use':>5s} {'consumer':>8s} " + " ".join(f"{p:>8s}" for p in points)]
    for u in range(first, min(first + count, trace.shape[1])):
        for c in range(trace.shape[0]):
            if not trace[c, u].any():
                continue
            cells = [f"{int(x) - base:8d}" if x else f"{'-':>8s}" for x in trace[c, u]]
            lines.append(f"{u:5d} {c:8d} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", default="v34", help="a forward rung with the STEP_TRACE diagnostic (default v34)")
    parser.add_argument("--case", default="4x16x4096-d128-noncausal", help="a bench.py frontier case id")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", type=int, default=0, metavar="K",
                        help="also print K ring uses one after another from the middle of the first tile")
    args = parser.parse_args(argv)
    if args.timeline < 0:
        parser.error("--timeline: a count of ring uses, 0 or more")

    from benchmarks import frontier
    from kernels import ladder

    cases = {frontier.case_id(c): c for c in frontier.CASES}
    if args.case not in cases:
        parser.error(f"--case: one of {', '.join(cases)}")
    case = cases[args.case]
    try:
        rung = ladder.load(args.kernel)
        source = with_trace(rung.path.read_text())
        shape = trace_shape(source)
    except ValueError as exc:
        parser.error(str(exc))

    from benchmarks import device

    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    import cupy as cp

    import kernels
    from benchmarks.cases import Inputs

    inputs = Inputs(case, "bfloat16", args.seed)
    if inputs.qkv is None:
        parser.error(inputs.rung_inputs_problem)
    q, k, v = inputs.qkv
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{rung.path.stem}_trace.cu"
        path.write_text(source)
        run = kernels.prepare(q, k, v, kernel=str(path), causal=case.causal)
        run()  # warm: the first launch's clocks include the caches' first misses
        cp.cuda.Device().synchronize()
        trace = run.instance.module.get_global("step_trace")
        host = np.zeros(shape, dtype=np.int64)
        trace.copy_from_host(host.ctypes.data, host.nbytes)  # zero: untraced points read 0
        run()
        cp.cuda.Device().synchronize()
        trace.copy_to_host(host.ctypes.data, host.nbytes)
    by_consumer = phases(host)
    print(f"{rung.name} {args.case} (config {run.instance.describe()}): block 0's steps, SM clock cycles")
    print(table(by_consumer))
    if args.timeline:
        tile = int(np.argmax(host[0, 1:, 0] == 0)) + 1 if (host[0, 1:, 0] == 0).any() else host.shape[1]
        first = max(1, min(tile // 2, host.shape[1] - args.timeline))
        print(f"\nring uses {first}-{first + args.timeline - 1}, cycles after consumer 0's loop top at use {first}:")
        print(timeline(host, first, args.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
