"""Where the persistent decode step (kernels/fused/decode_step.cu) loses time, block by block: its
global-timer trace, which `lab.py --profile-step` and tools/decode_breakdown.py reduce to one work and one
wait figure a stage, read here as distributions over the blocks.

    python3 tools/step_trace.py --size gpt2-xl --dtype float32 --position 264
    python3 tools/step_trace.py --size gpt2-xl --detail --results results    also a result file to cite

For each kind of stage (STEP_STAGES, then the lm_head), microseconds per stage averaged over the layers,
each a median over --repeats runs of the second of two steps: a block's work (from its inputs in hand to
its end of the stage: least, median, most over the blocks), how far its end lies behind the earliest
block's (median, most), and its wait from its end to the next stage's inputs in hand (least, median,
most). For the attention stage, per head of the layers: how far apart its key splits get their inputs
(q, k and v from the projection: the latest split against the earliest) and end the stage (the
combine makes every split wait for the last), and which split ends last, the one that holds the
position or another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def block_times(t: np.ndarray, stages: int):
    """(start, end, ready) of the second step, each (stages, blocks) ns, from a trace t (2, stages, blocks,
    marks): a block's start of a stage (its inputs in hand: the previous stage's mark 1), its end of it
    (mark 0), and its start of the next (mark 1)."""
    start = t[..., 1].reshape(2 * stages, -1)[stages - 1:2 * stages - 1]
    return start, t[1, :, :, 0], t[1, :, :, 1]


PHASES = ("own keys to partial stored", "wait for the head's partials", "combine", "projection",
          "projection again")


def attention_phases(t: np.ndarray, start: np.ndarray, stages: int, layer_stages: int, working: int) -> np.ndarray:
    """Stage B's inside from a TRACE_MARKS 6 trace, per layer and working block (the first `working`), us
    (PHASES): its own keys (inputs in hand to its partial stored, mark 2), the head's partials (to mark 3:
    the combine's wait), the combine (to mark 4), the projection (to mark 5, or to the stage's end where
    stage B is several items and the diagnostic's second pass does not run: mark 5 is 0) and the second
    pass (mark 5 to the end; 0 where it does not run)."""
    b = slice(1, stages - 1, layer_stages)
    own, partials, combined, projected, end = (t[1, b, :working, i] for i in (2, 3, 4, 5, 0))
    projected = np.where(projected > 0, projected, end)
    return np.stack([own - start[b, :working], partials - own, combined - partials, projected - combined,
                     end - projected], axis=2) / 1e3


def resolution(t: np.ndarray) -> int:
    """The global timer's step as the trace shows it: the smallest nonzero difference between two of its
    marks, ns (marks a phase shorter than it apart read 0 or one step)."""
    marks = np.unique(t[t > 0])
    steps = np.diff(marks)
    return int(steps[steps > 0].min()) if steps.size else 0


def stage_spread(start: np.ndarray, end: np.ndarray, ready: np.ndarray) -> np.ndarray:
    """Per stage (rows), us: work least / median / most, end behind the earliest median / most, wait
    least / median / most."""
    work, lag, wait = end - start, end - end.min(axis=1, keepdims=True), ready - end
    cols = [work.min(1), np.median(work, 1), work.max(1), np.median(lag, 1), lag.max(1), wait.min(1),
            np.median(wait, 1), wait.max(1)]
    return np.stack(cols, axis=1) / 1e3


SPREAD_COLUMNS = ("work_least", "work_median", "work_most", "end_lag_median", "end_lag_most", "wait_least",
                  "wait_median", "wait_most")  # stage_spread's columns


def split_skew(start: np.ndarray, end: np.ndarray, heads: int, splits: int, pos: int) -> np.ndarray:
    """The attention stages' rows of start and end: per (stage, head), us between its splits' earliest
    and latest start, the same for their ends, and whether the split that holds `pos` ends last."""
    chunk = -(-(pos + 1) // splits)  # decode_step.cu's stage B: split s takes keys [s * chunk, ...)
    holder = min(splits - 1, pos // chunk)
    s = start[:, :heads * splits].reshape(-1, heads, splits)
    e = end[:, :heads * splits].reshape(-1, heads, splits)
    return np.stack([(s.max(2) - s.min(2)) / 1e3, (e.max(2) - e.min(2)) / 1e3,
                     (e.argmax(2) == holder).astype(float)], axis=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="gpt2", help="a GPT-2 size: gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--position", type=int, default=264)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--detail", action="store_true",
                        help="a build with TRACE_MARKS 6: stage B's own keys, combine wait, combine and projection "
                             "apart, and the projection run twice (the second pass's code already fetched)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="also write the figures printed into DIR/steptrace-<device>-<UTC time>.json")
    args = parser.parse_args(argv)

    import cupy as cp

    import gpt2
    import gpt2.fast as fast

    if args.size not in gpt2.SIZES:
        parser.error(f"--size must be one of {', '.join(gpt2.SIZES)}")
    ckpt = gpt2.random_weights(args.size, seed=0, xp=cp)
    params = ckpt.params if args.dtype == "float32" else fast.as_bfloat16(ckpt.params)
    engine = fast.Engine(params, ckpt.config, dtype=args.dtype, persistent=True)
    print(f"{args.size} {args.dtype} at position {args.position}: {engine.plan}, REDUCE_HEADS {engine.step.reduce_heads}, "
          f"options {' '.join(engine.step.options) or '(none)'}")
    engine.generate([1, 2, 3], 16, attend=gpt2.reference_attend, kv_cache=True)  # compiled and warm
    step = engine.step
    marks = 6 if args.detail else 2
    if args.detail:
        from gpt2.fast.plan import with_options
        from kernels import fused

        name, expr = fast.kernel_expressions(ckpt.config, args.dtype, reduce_heads=step.reduce_heads)["decode_step"]
        fn = fused.function(name, expr, options=with_options(step.options, ("-DTRACE_MARKS=6",)))
        fn.max_dynamic_shared_size_bytes = engine.plan.smem
        engine.fn["decode_step"] = fn
    names = step.stage_names()
    stages, kinds = len(names), (*fast.STEP_STAGES, "ln_f+lm_head+argmax")
    spreads, skews, phases = [], [], []
    working = ckpt.config.n_head * engine.plan.splits
    traces = step.traces(args.position, args.repeats, marks)
    print(f"global timer step in these traces: {min(resolution(t) for t in traces)} ns")
    for t in traces:
        start, end, ready = block_times(t, stages)
        spreads.append(stage_spread(start, end, ready))
        b = slice(1, stages - 1, len(fast.STEP_STAGES))  # the attention stage of every layer
        skews.append(split_skew(start[b], end[b], ckpt.config.n_head, engine.plan.splits, args.position + 1))
        if args.detail:
            phases.append(attention_phases(t, start, stages, len(fast.STEP_STAGES), working))
    spread, skew = np.median(spreads, axis=0), np.median(skews, axis=0)
    print(f"{'us a stage, mean over layers':<30} {'work least/median/most':>24} {'end lag median/most':>20} "
          f"{'wait least/median/most':>24}")
    figures = {"size": args.size, "dtype": args.dtype, "position": args.position, "repeats": args.repeats,
               "plan": str(engine.plan), "reduce_heads": bool(step.reduce_heads), "options": list(step.options),
               "stages": {}, "units": "us"}
    for kind in kinds:
        rows = spread[[k for k, name in enumerate(names) if name.endswith(kind)]].mean(axis=0)
        figures["stages"][kind] = dict(zip(SPREAD_COLUMNS, (float(x) for x in rows), strict=True))
        print(f"{kind:<30} {rows[0]:8.2f} {rows[1]:7.2f} {rows[2]:7.2f} {rows[3]:10.2f} {rows[4]:8.2f} "
              f"{rows[5]:8.2f} {rows[6]:7.2f} {rows[7]:7.2f}")
    inputs, ends, last = skew.reshape(-1, 3).T
    figures["splits"] = {"splits": engine.plan.splits, "inputs_apart_median": float(np.median(inputs)),
                         "inputs_apart_p90": float(np.percentile(inputs, 90)), "ends_apart_median": float(np.median(ends)),
                         "ends_apart_p90": float(np.percentile(ends, 90)), "holder_last_share": float(last.mean())}
    print(f"attention, a head's {engine.plan.splits} key splits: inputs in hand {np.median(inputs):.2f} us apart "
          f"(median; 90th percentile {np.percentile(inputs, 90):.2f}), ends {np.median(ends):.2f} apart "
          f"({np.percentile(ends, 90):.2f}); the split holding the position ends last in {100 * last.mean():.0f}% "
          "of heads")
    if args.detail:
        p = np.median(phases, axis=0)  # (layers, working blocks, 3)
        figures["attention_inside"] = {what: {"median": float(np.median(p[..., i], axis=1).mean()),
                                              "most": float(p[..., i].max(axis=1).mean())}
                                       for i, what in enumerate(PHASES)}
        print("attention stage inside, us (median / most over the working blocks, mean over layers): "
              + "; ".join(f"{what} {np.median(p[..., i], axis=1).mean():.2f} / {p[..., i].max(axis=1).mean():.2f}"
                          for i, what in enumerate(PHASES)))
    if args.results:
        from benchmarks.results import write_tool_result

        path = write_tool_result("steptrace", "tools/step_trace.py", sys.argv[1:] if argv is None else argv, figures,
                                 args.results)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
