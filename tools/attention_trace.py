"""Where gqa_decode_attention's time goes inside Llama's decode step: the kernel's diagnostic build
(TRACE) in the engine's own graph, each block's global-timer marks read back after a replay, as phases.

    python3 tools/attention_trace.py --sizes llama-3.2-1b,llama-3.2-3b --cache 512:40,260 --out $OUT

For each size, cache and position, the step at that position replayed --repeats times (a graph of
STEPS_PER_GRAPH steps ending there, as generate() runs them), microseconds:
  - each phase of a block (PHASES, between its marks: see the kernel's header), the mean over the
    repeats, the layers and the splits in use; the combine over the blocks that combined;
  - `critical`: from the layer's projection complete (its blocks' earliest wait's end) to its last head's
    y stored (the combining block's end, or the only split's), the mean over the repeats and layers: the
    attention's share of the step's critical path;
  - `splits apart`: how much later a head's last split stored its partial than its first.
Means, not medians: the global timer moves in steps that may be coarser than a phase (`resolution`), and
a mean over many marks is not biased by them. The traced build's time a token is printed beside: the marks
cost a few stores a block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_step_variants  # noqa: E402  (beside this file)

from llama.fast.plan import ATTENTION_TRACE_MARKS  # noqa: E402  (no CuPy needed)

PHASES = ("waiting for the projection", "q and the staged rows", "warp 0's pass", "other warps' passes",
          "warps combined", "partial and ticket", "combine")


def phases(t: np.ndarray) -> dict:
    """t: (repeats, layers, key/value heads, splits, ATTENTION_TRACE_MARKS) global-timer marks, ns; a block
    past the splits in use has only mark 0, a block that does not combine no mark 7. Returns us: each of
    PHASES (marks k to k + 1, the combine 6 to 7), `critical` and `splits apart` (the module's docstring)."""
    t = t.astype(np.int64)
    used = t[..., 1] > 0  # the blocks that waited for the projection: the splits in use
    out = {}
    for k, name in enumerate(PHASES[:-1]):
        out[name] = float((t[..., k + 1] - t[..., k])[used].mean()) / 1e3
    combined = t[..., 7] > 0
    out[PHASES[-1]] = float((t[..., 7] - t[..., 6])[combined].mean()) / 1e3 if combined.any() else 0.0
    # a head's y: the combining block's mark 7, or the only split's mark 6 (y stored itself)
    y_at = np.where(combined.any(axis=-1), t[..., 7].max(axis=-1), t[..., 0, 6])  # (repeats, layers, heads)
    ready = np.where(used, t[..., 1], np.iinfo(np.int64).max).min(axis=(-2, -1))  # (repeats, layers)
    out["critical"] = float((y_at.max(axis=-1) - ready).mean()) / 1e3
    stored = np.where(used, t[..., 6], 0)
    first = np.where(used, t[..., 6], np.iinfo(np.int64).max).min(axis=-1)
    out["splits apart"] = float((stored.max(axis=-1) - first).mean()) / 1e3
    out["splits in use"] = float(used.sum(axis=-1).mean())
    return out


def resolution(t: np.ndarray) -> int:
    """The global timer's step as the marks show it: the smallest nonzero difference between two, ns."""
    marks = np.unique(t[t > 0])
    steps = np.diff(marks)
    return int(steps[steps > 0].min()) if steps.size else 0


def parse_cache(text: str) -> tuple[int, list[int]]:
    """`512:40,260` -> (512, [40, 260]): a cache length and the positions traced in it, each the last of a
    graph of 8 steps (llama_step_variants.parse_cache's form)."""
    return llama_step_variants.parse_cache(text, first=7, room=1, why="a graph of 8 steps ends there")


def trace(size: str, caches: list[tuple[int, list[int]]], repeats: int, seed: int) -> list[dict]:
    import cupy

    import llama.fast as fast
    from benchmarks import scale

    fam = scale.of_size(size)
    ckpt = fam.random_weights(size, seed=seed, xp=cupy, dtype="bfloat16")
    config, params = ckpt.config, ckpt.params
    fam.decode_layout(params, config)
    rows = []
    for max_len, positions in caches:
        engine = fast.Engine(params, config, max_len=max_len, trace=True)
        n = engine.steps_per_graph
        for position in positions:
            marks, ms = [], []
            for _ in range(repeats + 1):  # the first warms up
                ms.append(engine.replay_ms(position - n + 1, n, repeats=1))
                marks.append(cupy.asnumpy(engine.attn_trace))
            t = np.stack(marks[1:])
            rows.append({"size": size, "max_len": max_len, "position": position, "plan": vars(engine.attn),
                         "us_per_token_traced": 1e3 * float(np.median(ms[1:])), "resolution_ns": resolution(t),
                         "us": phases(t)})
        del engine
    del ckpt, params
    scale.release()
    return rows


def table(rows: list[dict]) -> str:
    names = (*PHASES, "critical", "splits apart")
    lines = [f"{'size':14s} {'cache':>6s} {'pos':>5s} {'splits':>6s} " + " ".join(f"{n[:12]:>12s}" for n in names)
             + f" {'us a token':>10s}"]
    for r in rows:
        lines.append(f"{r['size']:14s} {r['max_len']:6d} {r['position']:5d} {r['us']['splits in use']:6.1f} "
                     + " ".join(f"{r['us'][n]:12.2f}" for n in names) + f" {r['us_per_token_traced']:10.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="llama-3.2-1b,llama-3.2-3b", help="comma-separated Llama sizes")
    parser.add_argument("--cache", action="append", help="LENGTH:POSITIONS (repeatable; default 512:40,260 and "
                        "2048:1000)")
    parser.add_argument("--repeats", type=int, default=20, help="replays traced a position (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for attention_trace.json")
    args = parser.parse_args(argv)

    from benchmarks import device, scale

    try:
        caches = [parse_cache(c) for c in (args.cache or ["512:40,260", "2048:1000"])]
    except ValueError as exc:
        parser.error(str(exc))
    sizes = args.sizes.split(",")
    if bad := [s for s in sizes if s not in scale.SIZES or scale.family(s) != "llama"]:
        parser.error(f"not a Llama size: {', '.join(bad)}")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    info = device.device_info()
    print(f"{info['name']}, driver {info['driver']}; marks a block: {ATTENTION_TRACE_MARKS}", flush=True)
    rows = []
    for size in sizes:
        rows += trace(size, caches, args.repeats, args.seed)
        print(table([r for r in rows if r["size"] == size]), flush=True)
    if args.out:
        path = Path(args.out) / "attention_trace.json"
        path.write_text(json.dumps({"device": info, "command": ["python3", "tools/attention_trace.py",
                                    *(sys.argv[1:] if argv is None else argv)], "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
