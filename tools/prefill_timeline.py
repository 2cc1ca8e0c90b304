"""Where a prefill's first token goes, kernel by kernel: one `generate(prompt, 1)` (the time to first token
as benchmarks/scale.py takes it, the graphed pass by default) under torch.profiler, whose CUPTI sees every
kernel of the process (CuPy's, cuBLAS's, the rungs'); from its trace:

  - the wall time of the call, and the GPU's: busy (the union of the kernels' intervals), the span from
    the first kernel's start to the last one's end, and the gaps inside the span (span - busy);
  - per kernel (by name): launches, total and mean time, the share of busy;
  - the gaps by the pair of kernels around them (a gap that recurs before one kernel names its cause:
    a launch the GPU waits for, a memset node, a wait);
  - the host's CUDA runtime and driver calls longer than --slow-us (a graph's launch, a synchronization).

    python3 tools/prefill_timeline.py                                  gpt2-xl, bfloat16, 1000 tokens
    python3 tools/prefill_timeline.py --sizes llama-3.1-8b --top 15 --out $OUT

Each size from random weights as `bench.py e2e --sizes` loads them (benchmarks/scale.py), its rung as
there; --warmup generations first (the bucket's eager pass and its capture among them). Writes
prefill_timeline-SIZE-DTYPE.json to --out when given. Needs PyTorch (its profiler) beside CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals (kernels of several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(events: list[dict], wall_ms: float, top: int = 12, slow_us: float = 50.0) -> dict:
    """The timeline's figures from a Chrome trace's events (torch.profiler's export: "X" events with ts and
    dur in microseconds, kernels under cat "kernel", the host's runtime and driver calls under
    "cuda_runtime" and "cuda_driver")."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    if not kernels:
        raise ValueError("the trace holds no kernel: was the GPU activity recorded (ProfilerActivity.CUDA)?")
    busy = busy_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    span = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"]
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k["name"]].append(k["dur"])
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    reach = kernels[0]["ts"] + kernels[0]["dur"]
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - max(reach, before["ts"] + before["dur"])
        if gap > 0:
            gaps[(before["name"], after["name"])].append(gap)
        reach = max(reach, after["ts"] + after["dur"])
    host = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"
                   and e.get("dur", 0) > slow_us), key=lambda e: -e["dur"])
    return {
        "wall_ms": wall_ms, "kernels": len(kernels), "busy_ms": busy / 1e3, "span_ms": span / 1e3,
        "gaps_ms": (span - busy) / 1e3, "outside_span_ms": wall_ms - span / 1e3,
        "by_kernel": [{"name": name, "launches": len(d), "total_ms": sum(d) / 1e3, "mean_us": sum(d) / len(d),
                       "share_of_busy": sum(d) / busy}
                      for name, d in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]],
        "gaps": [{"before": a, "after": b, "count": len(d), "total_ms": sum(d) / 1e3, "mean_us": sum(d) / len(d)}
                 for (a, b), d in sorted(gaps.items(), key=lambda item: -sum(item[1]))[:top]],
        "slow_host_calls": [{"name": e["name"], "us": e["dur"]} for e in host[:top]],
    }


def render(title: str, s: dict, width: int = 70) -> str:
    def short(name: str) -> str:
        return name if len(name) <= width else name[:width - 3] + "..."

    lines = [title,
             f"wall {s['wall_ms']:.3f} ms: GPU busy {s['busy_ms']:.3f} ms over a span of {s['span_ms']:.3f} ms "
             f"({s['kernels']} kernels; gaps inside it {s['gaps_ms']:.3f} ms), outside the span {s['outside_span_ms']:.3f} ms",
             f"{'kernel':{width}s} {'launches':>8s} {'total ms':>9s} {'mean us':>8s} {'of busy':>7s}"]
    lines += [f"{short(k['name']):{width}s} {k['launches']:8d} {k['total_ms']:9.3f} {k['mean_us']:8.2f} "
              f"{k['share_of_busy']:7.1%}" for k in s["by_kernel"]]
    lines.append(f"{'gap: before -> after':{width}s} {'count':>8s} {'total ms':>9s} {'mean us':>8s}")
    for g in s["gaps"]:
        pair = f"{short(g['before'])[:width // 2 - 2]} -> {short(g['after'])[:width // 2 - 2]}"
        lines.append(f"{pair:{width}s} {g['count']:8d} {g['total_ms']:9.3f} {g['mean_us']:8.2f}")
    lines += [f"host call {h['name']}: {h['us']:.0f} us" for h in s["slow_host_calls"]]
    return "\n".join(lines)


def profile_first_token(size: str, dtype: str, args) -> dict:
    """One size's summary (module docstring)."""
    import cupy
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import scale

    fam, ckpt, kernel, attend = scale.lab_model(size, dtype, args.seed, args.kernel)
    config, params = ckpt.config, ckpt.params
    ids = scale.prefill_ids(size, config, args.tokens)

    def first_token() -> float:
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        fam.generate(params, config, ids, 1, attend=attend, kv_cache=True, sampler=None, max_len=len(ids) + 1)
        cupy.cuda.Device().synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        first_token()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = first_token()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    summary = summarize(events, 1e3 * wall, args.top, args.slow_us)
    return {"size": size, "dtype": dtype, "attention": kernel, "prompt_tokens": len(ids), **summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="gpt2-xl", help="comma-separated sizes (bench.py e2e's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kernel", default=None, help="the prefill's rung (default: the newest that takes the model)")
    parser.add_argument("--tokens", type=int, default=1000, help="the prompt's length")
    parser.add_argument("--warmup", type=int, default=4, help="generations before the profiled one")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    parser.add_argument("--slow-us", type=float, default=50.0, help="host calls longer than this are listed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for prefill_timeline-SIZE-DTYPE.json")
    args = parser.parse_args(argv)

    from benchmarks import device, scale

    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    info = device.device_info()
    for size in args.sizes.split(","):
        result = profile_first_token(size, args.dtype, args)
        print(render(f"{size} {args.dtype}, {result['prompt_tokens']} tokens, {result['attention']}; "
                     f"{info['name']}, driver {info['driver']}", result))
        if args.out:
            path = Path(args.out) / f"prefill_timeline-{size}-{args.dtype}.json"
            command = ["python3", "tools/prefill_timeline.py", *(sys.argv[1:] if argv is None else argv)]
            path.write_text(json.dumps({"device": info, "command": command, **result}, indent=1) + "\n")
            print(f"wrote {path}")
        scale.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
