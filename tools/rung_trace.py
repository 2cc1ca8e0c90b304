"""Where a rung's consumer warpgroups spend a step of their loop, cycle by cycle: the SM clock read at each
point of a step by block 0's consumers (the STEP_TRACE build of kernels/v34_lazy_rescale.cu and the forward
rungs after it, and of the backward rung kernels/backward/b08_pingpong.cu's dK/dV phase).

    python3 tools/rung_trace.py [--kernel v34] [--case 4x16x4096-d128-noncausal] [--timeline 6]
    python3 tools/rung_trace.py --kernel b08 [--case 2x16x4096-d128]
    python3 tools/rung_trace.py --kernel b08 --results results    also a result file the docs can cite

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

A backward rung (b08: `--case` one of bench.py backward's cases, as B x NH x T-d, -gqa8 where 8 key/value
heads serve the query heads, -noncausal without the mask; its inputs from the forward rung bench.py
backward uses) has six points a step of its dK/dV loop, so these phases:

    turn 1     loop top to S^T and dP^T issued: the wait for Q_i and dO_i, the turn, the issue
    S dP wait  to S^T and dP^T landed
    dS         to dS^T written: P^T's exponentials, dS^T = P^T o (dP^T - D_i), the stores
    turn 2     to dV_j, dK_j (and the step before's dQ_i share) issued: the wait for both halves of the
               step before's dS^T, the dQ share's buffer, the turn, the issue
    dKV wait   to those landed (at d = 128, DQ_FIRST: the dQ_i share out to dQ_accum in between)
    rest       to the next step's loop top: dQ_i's share out to dQ_accum (the bulk reduction; at d = 128
               done in the wait before)
    step       loop top to loop top

Where the rung also declares `tile_trace` (b13), its key tiles' ends and starts are read too and
printed for block 0's first boundaries, in cycles after consumer 0 reached its tile's last dQ_i turn:

    last dQ    consumer c done with the tile's steps, before the last dQ_i share's turn
    dQ turn    the turn taken
    dQ landed  the share's products landed (K_j and V_j released after this)
    dQ stored  the share out to dQ_accum
    dK dV out  dK_j and dV_j stored to memory
    next tile  the next tile's number read
    K V in     the next tile's K_j and V_j landed
    drawn, K V copy   the producer's: the next tile drawn; its K_j and V_j copy issued (after their release)

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
POINTS = ("top", "issued", "S", "softmax", "PV")
BACKWARD_PHASES = ("turn 1", "S dP wait", "dS", "turn 2", "dKV wait", "rest", "step")
BACKWARD_POINTS = ("top", "turn 1", "S dP", "dS", "turn 2", "dKV")
TILE_POINTS = ("last dQ", "dQ turn", "dQ landed", "dQ stored", "dK dV out", "next tile", "K V in")
PRODUCER_POINTS = ("drawn", "K V copy")


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
    """Per consumer c with traced steps: (steps, points + 1) cycles of the phases (PHASES, or
    BACKWARD_PHASES), from trace (consumers, uses, points) of clock64 values (0: not traced). A step counts
    where its points and the next use's loop top are all there and in order (a forward tile's last step is
    followed by the next tile's first, which has no loop top: those steps drop out)."""
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


def table(by_consumer: dict[int, np.ndarray], names=PHASES) -> str:
    """One line per consumer and phase: median, 10th and 90th percentile, cycles, and the phase's share
    of the median step."""
    lines = [f"{'consumer':>8s} {'phase':>9s} {'median':>8s} {'p10':>8s} {'p90':>8s} {'of step':>8s}"]
    for c, rows in by_consumer.items():
        step = float(np.median(rows[:, -1]))
        for i, name in enumerate(names):
            col = rows[:, i]
            share = f"{100 * np.median(col) / step:7.1f}%" if name != "step" else f"{len(rows):5d} st"
            lines.append(f"{c:8d} {name:>9s} {np.median(col):8.0f} {np.percentile(col, 10):8.0f} "
                         f"{np.percentile(col, 90):8.0f} {share:>8s}")
    return "\n".join(lines)


def summary(by_consumer: dict[int, np.ndarray], names=PHASES) -> dict:
    """table()'s figures as numbers: per consumer, each phase's median, 10th and 90th percentile in cycles,
    and the steps they come from."""
    return {str(c): {"steps": len(rows), **{name: {"median": float(np.median(rows[:, i])),
                                                   "p10": float(np.percentile(rows[:, i], 10)),
                                                   "p90": float(np.percentile(rows[:, i], 90))}
                                            for i, name in enumerate(names)}}
            for c, rows in by_consumer.items()}


def timeline(trace: np.ndarray, first: int, count: int, points=POINTS) -> str:
    """Ring uses first .. first + count - 1 of trace (consumers, uses, points), one line per use and
    consumer: the points in cycles after consumer 0's loop top at use `first` ('-': not traced)."""
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


def backward_case_id(case) -> str:
    """A bench.py backward case as --case names it: 2x16x4096-d128, 2x32x4096-d128-gqa8, ...-noncausal."""
    return (f"{case.B}x{case.NH}x{case.T_q}-d{case.d}" + (f"-gqa{case.NH_kv}" if case.NH_kv != case.NH else "")
            + ("" if case.causal else "-noncausal"))


def backward_cases() -> dict:
    from benchmarks.backward import CASE_SETS

    return {backward_case_id(c): c for cases in CASE_SETS.values() for c in cases}


def traced_backward(rung, source: str, shape, case, seed: int):
    """(trace, the configuration) of one traced run of a backward rung's STEP_TRACE copy at `case`, on the
    inputs bench.py backward gives it (bfloat16; o and lse from its forward rung; dO random)."""
    import cupy as cp

    import kernels
    from benchmarks import backward as bench_backward
    from benchmarks.cases import Inputs
    from kernels.backward import launcher

    inputs = Inputs(case, "bfloat16", seed)
    if inputs.qkv is None:
        raise ValueError(inputs.rung_inputs_problem)
    q, k, v = inputs.qkv
    forward = bench_backward.forward_rung(case, "bfloat16", kernels.device_limits().arch)
    if forward is None:
        raise ValueError(f"no forward rung writes the log-sum-exp for bfloat16, d={case.d} here")
    o, lse = kernels.attention(q, k, v, kernel=forward, causal=case.causal, return_lse=True)
    do = cp.random.default_rng(seed + 1).standard_normal(q.shape, dtype=cp.float32).astype(q.dtype)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{rung.path.stem}_trace.cu"
        path.write_text(source)
        run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=str(path), causal=case.causal)
        return traced(run, run.instance.module, shape, tile_shape(source)), run.instance.describe()


def traced(run, module, shape, tiles_shape=None) -> tuple[np.ndarray, np.ndarray | None]:
    """step_trace (and tile_trace where the rung declares it: tiles_shape) after `run` once more, its first
    run a warm-up (the caches' first misses)."""
    import cupy as cp

    run()
    cp.cuda.Device().synchronize()
    arrays = [(module.get_global(name), np.zeros(s, dtype=np.int64))
              for name, s in (("step_trace", shape), ("tile_trace", tiles_shape)) if s is not None]
    for device_array, host in arrays:
        device_array.copy_from_host(host.ctypes.data, host.nbytes)  # zero: untraced points read 0
    run()
    cp.cuda.Device().synchronize()
    for device_array, host in arrays:
        device_array.copy_to_host(host.ctypes.data, host.nbytes)
    return arrays[0][1], arrays[1][1] if len(arrays) > 1 else None


def tile_shape(source: str) -> tuple[int, int, int] | None:
    """(3, tiles, 8) of the rung's tile_trace (consumers 0 and 1, then the producer), None where it has none."""
    dims = re.search(r"__device__ long long tile_trace\[3\]\[(\w+)\]\[8\]", source)
    if not dims:
        return None
    tiles = re.search(rf"constexpr int {dims.group(1)} = (\d+);", source) if not dims.group(1).isdigit() else None
    return 3, int(tiles.group(1)) if tiles else int(dims.group(1)), 8


def tile_table(tiles: np.ndarray, count: int = 6) -> str:
    """Block 0's first key tile boundaries: each consumer's points at a tile's end and the next one's start,
    and the producer's for the next tile, in cycles after consumer 0's `last dQ` of the tile."""
    width = 10

    def consumer_header(c: int) -> str:  # the first column named with its consumer, 3 wider
        return " ".join(f"{f'c{c} ' + p:>{width + 3}}" if i == 0 else f"{p:>{width}}" for i, p in enumerate(TILE_POINTS))

    header = ("tile  " + consumer_header(0) + "  " + consumer_header(1) + "  "
              + " ".join(f"{p:>{width}}" for p in PRODUCER_POINTS))
    lines = [header]
    for u in range(min(count, tiles.shape[1] - 1)):
        base = tiles[0, u, 0]
        if base == 0 or tiles[0, u + 1, 6] == 0:
            break
        cells = []
        for c in range(2):
            row = [tiles[c, u, p] for p in range(5)] + [tiles[c, u + 1, p] for p in (5, 6)]
            cells.append(" ".join(f"{v - base:>{width + (3 if i == 0 else 0)}d}" for i, v in enumerate(row)))
        producer = " ".join(f"{tiles[2, u + 1, p] - base:>{width}d}" for p in range(2))
        lines.append(f"{u:>2}-{u + 1:<2} " + "  ".join(cells) + "  " + producer)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", default="v34",
                        help="a rung with the STEP_TRACE diagnostic: a forward one (default v34) or b08")
    parser.add_argument("--case", default=None, help="a bench.py frontier case id (default 4x16x4096-d128-noncausal), "
                                                     "or for a backward rung a bench.py backward case (default "
                                                     "2x16x4096-d128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", type=int, default=0, metavar="K",
                        help="also print K ring uses one after another from the middle of the first tile")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="also write the phases and the raw clock reads into DIR/rungtrace-<device>-<UTC time>.json")
    args = parser.parse_args(argv)
    if args.timeline < 0:
        parser.error("--timeline: a count of ring uses, 0 or more")

    from benchmarks import frontier
    from kernels import backward, ladder

    is_backward = backward.owns(args.kernel)
    if is_backward:
        cases, names, points = backward_cases(), BACKWARD_PHASES, BACKWARD_POINTS
        case_name = args.case or "2x16x4096-d128"
    else:
        cases, names, points = {frontier.case_id(c): c for c in frontier.CASES}, PHASES, POINTS
        case_name = args.case or "4x16x4096-d128-noncausal"
    if case_name not in cases:
        parser.error(f"--case: one of {', '.join(cases)}")
    case = cases[case_name]
    try:
        rung = (backward if is_backward else ladder).load(args.kernel)
        source = with_trace(rung.path.read_text())
        shape = trace_shape(source)
    except ValueError as exc:
        parser.error(str(exc))
    if shape[2] != len(points):
        parser.error(f"{rung.name}'s step_trace has {shape[2]} points a step; this tool reads {len(points)}")

    from benchmarks import device

    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")

    if is_backward:
        try:
            (host, tiles), config = traced_backward(rung, source, shape, case, args.seed)
        except ValueError as exc:
            parser.error(str(exc))
    else:
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
            (host, tiles), config = traced(run, run.instance.module, shape), run.instance.describe()
    by_consumer = phases(host)
    print(f"{rung.name} {case_name} (config {config}): block 0's steps, SM clock cycles")
    print(table(by_consumer, names))
    if args.timeline:
        tile = int(np.argmax(host[0, 1:, 0] == 0)) + 1 if (host[0, 1:, 0] == 0).any() else host.shape[1]
        first = max(1, min(tile // 2, host.shape[1] - args.timeline))
        print(f"\nring uses {first}-{first + args.timeline - 1}, cycles after consumer 0's loop top at use {first}:")
        print(timeline(host, first, args.timeline, points))
    if tiles is not None:
        print("\nkey tile boundaries, block 0, cycles after consumer 0's last dQ turn began (c0, c1: the tile's end, "
              "then the next one's start; the producer's next tile)")
        print(tile_table(tiles))
    if args.results:
        from benchmarks.results import write_tool_result

        payload = {"rung": rung.name, "case": case_name, "config": config, "points": list(points),
                   "phases": summary(by_consumer, names), "trace": host.tolist()}
        if tiles is not None:
            payload |= {"tile_points": list(TILE_POINTS), "producer_points": list(PRODUCER_POINTS),
                        "tiles": tiles.tolist()}
        print(f"wrote {write_tool_result('rungtrace', 'tools/rung_trace.py', sys.argv[1:] if argv is None else argv, payload, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
