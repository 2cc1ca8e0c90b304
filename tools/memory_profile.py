"""Where a decode-at-scale row's peak GPU memory goes: the row of `bench.py e2e --sizes` (benchmarks/scale.py's
measure: random weights laid out, a warm-up, a decode, the long prompt's prefill) run once under a CuPy memory
hook that keeps every live allocation of the default pool with the lab's lines that made it. At the moment
the live bytes peak, the allocations are summed by where they were made; the pool's high-water mark (what
the row reports as its peak) is printed beside them, the difference being blocks the pool kept but no array
held.

    python3 tools/memory_profile.py gpt2-xl bfloat16            the top 15 places at the peak
    python3 tools/memory_profile.py llama-3.2-3b --top 30 --out DIR

A place is the innermost frame of the lab's own files (not CuPy's) and the two that called it.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 2**20


def place(stack: list[traceback.FrameSummary], root: str = str(ROOT), depth: int = 3) -> str:
    """The lab's frames of an allocation's stack, innermost first: 'file:line function < caller < ...'."""
    own = [f for f in reversed(stack) if f.filename.startswith(root) and not f.filename.endswith("memory_profile.py")]
    return " < ".join(f"{Path(f.filename).relative_to(root)}:{f.lineno} {f.name}" for f in own[:depth]) or "(outside the lab)"


class LivePeak:
    """The pool's live allocations (pointer -> bytes, place) and, at their largest total, the bytes by place.
    malloc and free are what CuPy's MemoryHook calls after the pool hands out or takes back a block."""

    def __init__(self, where=lambda: place(traceback.extract_stack())):
        self.where = where
        self.live: dict[int, tuple[int, str]] = {}
        self.total = self.peak = 0
        self.at_peak: dict[int, tuple[int, str]] = {}  # the live allocations when the total peaked

    def malloc(self, mem_ptr: int, mem_size: int) -> None:
        self.live[mem_ptr] = (mem_size, self.where())
        self.total += mem_size
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.live)

    def free(self, mem_ptr: int) -> None:
        size, _ = self.live.pop(mem_ptr, (0, ""))
        self.total -= size

    def by_place(self) -> dict[str, int]:
        """Bytes by place at the peak, largest first."""
        sums: dict[str, int] = defaultdict(int)
        for size, where in self.at_peak.values():
            sums[where] += size
        return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def hook(peak: LivePeak):
    """A cupy.cuda.MemoryHook feeding `peak`."""
    import cupy

    class Hook(cupy.cuda.MemoryHook):
        name = "LivePeak"

        def malloc_postprocess(self, **kw):
            peak.malloc(kw["mem_ptr"], kw["mem_size"])

        def free_postprocess(self, **kw):
            peak.free(kw["mem_ptr"])

    return Hook()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", help="a model size of bench.py e2e --sizes (gpt2 ... gpt2-xl, llama-3.2-1b, ...)")
    parser.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens after the warm-up (default 64)")
    parser.add_argument("--prefill-tokens", type=int, default=1000, help="the long prompt (default 1000)")
    parser.add_argument("--top", type=int, default=15, help="places printed (default 15)")
    parser.add_argument("--out", help="write the places and figures as JSON into this folder")
    args = parser.parse_args(argv)
    from benchmarks import scale
    from lm.errors import LabError

    try:
        scale.of_size(args.size)
    except LabError as exc:
        parser.error(str(exc))
    peak = LivePeak()
    settings = SimpleNamespace(seed=0, warmup=8, tokens=args.tokens, prefill_tokens=args.prefill_tokens)
    with hook(peak):
        row = scale.measure(args.size, args.dtype, settings, copy_bps=1.0, bf16_tflops=None)
    places = peak.by_place()
    print(f"{args.size} {args.dtype}: live peak {peak.peak / MIB:,.0f} MiB; the pool's high-water mark "
          f"{row['peak_bytes'] / MIB:,.0f} MiB; weights {row['weight_bytes'] / MIB:,.0f} MiB, KV cache "
          f"{row['kv_cache_bytes'] / MIB:,.0f} MiB, bound {row['memory_bound_bytes'] / MIB:,.0f} MiB")
    for where, size in list(places.items())[:args.top]:
        print(f"{size / MIB:10,.1f} MiB  {where}")
    if args.out:
        out = Path(args.out) / f"memory-profile-{args.size}-{args.dtype}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"size": args.size, "dtype": args.dtype, "live_peak_bytes": peak.peak,
                                   "row": row, "places": places}, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
