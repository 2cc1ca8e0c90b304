"""Run every rung under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    python tools/sanitize.py                 # all rungs, forward and backward, all four tools
    python tools/sanitize.py --kernels v01,v12,b02 --tools memcheck

Each tool runs one child process that launches every rung at a small shape and an awkward one
(T not a multiple of any tile), checking each result against the reference: a forward rung's
output, a backward rung's dq, dk and dv (from the reference forward's o and lse; a rung with a
deterministic configuration runs in both modes). Prints one summary line per tool and exits
non-zero if any tool reported an error.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOOLS = ["memcheck", "racecheck", "initcheck", "synccheck"]
SHAPES = [(1, 2, 64, 64), (2, 3, 97, 64)]  # (B, NH, T, d)


def child(kernel_names: list[str]) -> int:
    import cupy as cp

    import kernels

    failures = 0
    for name in kernel_names:
        if kernels.backward.owns(name):
            failures += backward_child(cp, kernels, name)
            continue
        rung = kernels.load(name)
        dtype = rung.dtypes[0]  # float32, or the first dtype a low-precision rung takes
        for B, NH, T, d in SHAPES:
            q, k, v = (cp.random.standard_normal((B, NH, T, d), dtype=cp.float32).astype(dtype) for _ in range(3))
            run = kernels.prepare(q, k, v, kernel=name)
            out = run()
            if rung.fp8:  # FP8: against its float64 emulation on the same e4m3 inputs
                tiles = rung.params(run.instance.config)
                ref = kernels.fp8.emulated_attention(kernels.quantize_fp8(q, k, v, block_q=tiles["B_r"],
                                                                          block_k=tiles["B_c"]))
            else:
                ref = kernels.reference_attention(q, k, v)
            err = float(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)).max())
            ok = err < (1e-3 if dtype == "float32" else 5e-2)
            failures += not ok
            print(f"  {name:28s} {dtype:8s} B={B} NH={NH} T={T:4d} d={d}: max |out - ref| = {err:.2e}{'' if ok else '  WRONG'}",
                  flush=True)
    cp.cuda.Device().synchronize()
    return 1 if failures else 0


def backward_child(cp, kernels, name: str) -> int:
    """A backward rung at SHAPES, in each mode it declares; the number of wrong results."""
    rung = kernels.backward.load(name)
    dtype = rung.dtypes[0]
    modes = [False] + ([True] if any(rung.is_deterministic(c) for c in rung.configs) else [])
    failures = 0
    for deterministic in modes:
        for B, NH, T, d in SHAPES:
            q, k, v, do = (cp.random.standard_normal((B, NH, T, d), dtype=cp.float32).astype(dtype) for _ in range(4))
            o, lse = kernels.reference_attention(q, k, v, return_lse=True)
            got = kernels.attention_backward(q, k, v, o, lse, do, kernel=name, deterministic=deterministic)
            want = kernels.reference_attention_backward(q, k, v, o, lse, do)
            err = max(float(cp.abs(g.astype(cp.float32) - w.astype(cp.float32)).max()) for g, w in zip(got, want))
            ok = err < (1e-3 if dtype == "float32" else 1e-1)
            failures += not ok
            print(f"  {name:28s} {dtype:8s} B={B} NH={NH} T={T:4d} d={d}{' deterministic' if deterministic else ''}: "
                  f"max |grad - ref| = {err:.2e}{'' if ok else '  WRONG'}", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", help="comma-separated rungs, forward or backward (default: all)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated sanitizer tools")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import kernels

    def stem(n: str) -> str:
        return (kernels.backward.resolve(n) if kernels.backward.owns(n) else kernels.resolve(n)).stem

    names = [stem(n) for n in args.kernels.split(",")] if args.kernels else kernels.names() + kernels.backward_names()
    if args.child:
        return child(names)

    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(sanitizer).exists():
        print("compute-sanitizer not found (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    status = 0
    for tool in args.tools.split(","):
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
               sys.executable, __file__, "--child", "--kernels", ",".join(names)]
        if tool == "racecheck":
            cmd[3:3] = ["--racecheck-report", "all"]
        print(f"== {tool}: {' '.join(cmd[1:4])} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout, end="")
        summary = re.findall(r"=========\s+(?:ERROR SUMMARY|RACECHECK SUMMARY).*", proc.stdout + proc.stderr)
        print(f"   {tool}: exit {proc.returncode}; {'; '.join(summary) or proc.stderr.strip()[-400:]}", flush=True)
        status |= proc.returncode != 0
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
