"""What `bench.py profile` runs under ncu: one launch between cudaProfilerStart and cudaProfilerStop.

    python -m benchmarks.profile_target --kernel v13 --shape 8x1024 --dtype float32
    python -m benchmarks.profile_target --kernel v24 --case 2x32x4096-d128-gqa8 --dtype bfloat16
    python -m benchmarks.profile_target --decode --dtype bfloat16 [--size gpt2-xl]
    python -m benchmarks.profile_target --backward b05 --case 16x12x2048-d64 --dtype bfloat16

A rung: random q, k, v (B, 12, T, 64), or a shape of `bench.py frontier` (--case: its heads, head size,
grouped K/V heads and mask), prepared and compiled (kernels.prepare), three warm-up launches,
then one launch profiled. --backward: a backward rung on the same inputs and a random dO, after the
newest forward rung that writes the log-sum-exp (as `bench.py backward` runs it), every phase of one
backward pass profiled (--deterministic: its deterministic configuration). --decode: GPT-2 (small, or
--size) with random weights on gpt2.fast's engine, a warm-up generation of WARMUP tokens, then one decode
step profiled. ncu (--profile-from-start off) sees only
the profiled launch. Nothing goes to stdout, where ncu writes its CSV; errors are one line on stderr,
exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

NH, D_HEAD = 12, 64
WARMUP = 64  # decode: tokens generated before the profiled step (two of the persistent step's windows)
PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]  # "Hello, I'm a language model," in GPT-2's BPE


class TargetError(Exception):
    """Bad arguments or a rung that cannot run: one line on stderr."""


def shape_arg(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"shape must be BxT with positive integers, e.g. 8x1024; got {text!r}")
    return int(m[1]), int(m[2])


def array_dtype(name: str):
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def frontier_case(case_id: str):
    """A shape of `bench.py frontier` by its id ('2x32x4096-d128-gqa8')."""
    from benchmarks.frontier import CASES
    from benchmarks.frontier import case_id as id_of

    cases = {id_of(c): c for c in CASES}
    if case_id not in cases:
        raise TargetError(f"no frontier case {case_id!r}; the cases: {', '.join(cases)}")
    return cases[case_id]


def rung_launch(kernel: str, B: int, T: int, dtype: str, case=None):
    """The rung prepared on random inputs (B, NH, T, D_HEAD), or a frontier case's, warm: the function
    that launches it once."""
    import cupy

    import kernels

    try:
        path = kernels.resolve(kernel)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    rng = cupy.random.default_rng(0)
    q_shape, kv_shape, causal = (B, NH, T, D_HEAD), (B, NH, T, D_HEAD), True
    if case is not None:
        q_shape, kv_shape = (case.B, case.NH, case.T_q, case.d), (case.B, case.NH_kv, case.T_k, case.d)
        causal = case.causal
    q, k, v = (rng.standard_normal(shape, dtype=cupy.float32).astype(array_dtype(dtype))
               for shape in (q_shape, kv_shape, kv_shape))
    try:
        run = kernels.prepare(q, k, v, kernel=path, causal=causal)
    except (ValueError, kernels.KernelCompileError) as exc:
        raise TargetError(f"{path.stem}: {str(exc).splitlines()[0]}") from None
    for _ in range(3):
        run()
    return run


def backward_launch(kernel: str, B: int, T: int, dtype: str, case=None, deterministic: bool = False):
    """The backward rung prepared (kernels.backward.launcher.prepare_backward) on random inputs, or a
    frontier case's, their forward's output and log-sum-exp from the newest rung that writes it, warm: the
    function that launches every phase once."""
    import cupy

    import kernels
    from benchmarks.backward import forward_rung
    from benchmarks.cases import Case
    from kernels import backward
    from kernels.backward import launcher

    try:
        path = backward.resolve(kernel)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    case = case or Case("profile", B, NH, NH, T, T, D_HEAD)
    forward = forward_rung(case, dtype, kernels.device_limits().arch)
    if forward is None:
        raise TargetError(f"no forward rung writes the log-sum-exp for {dtype}, d={case.d} on this device")
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape, dtype=cupy.float32).astype(array_dtype(dtype)) for shape in
                   ((case.B, case.NH, case.T_q, case.d), *[(case.B, case.NH_kv, case.T_k, case.d)] * 2,
                    (case.B, case.NH, case.T_q, case.d)))
    try:
        o, lse = kernels.attention(q, k, v, kernel=forward, causal=case.causal, return_lse=True)
        run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=path, causal=case.causal,
                                        deterministic=deterministic)
    except (TypeError, ValueError, kernels.KernelCompileError) as exc:
        raise TargetError(f"{path.stem}: {str(exc).splitlines()[0]}") from None
    for _ in range(3):
        run()
    return run


def decode_launch(dtype: str, size: str = "gpt2"):
    """gpt2.fast's engine on a GPT-2 size (random weights) after a warm-up generation: one decode step."""
    import cupy

    import gpt2
    from gpt2 import fast

    if size not in gpt2.SIZES:
        raise TargetError(f"no GPT-2 size {size!r}; the sizes: {', '.join(gpt2.SIZES)}")
    ckpt = gpt2.random_weights(size, xp=cupy)
    try:
        engine = fast.engine_for(ckpt.params, ckpt.config, dtype=dtype)
    except gpt2.LabError as exc:
        raise TargetError(str(exc).splitlines()[0]) from None
    engine.generate(PROMPT, WARMUP, attend=gpt2.reference_attend, kv_cache=True)
    return lambda: engine.decode(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_target", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--kernel", help="the rung (v13, v13_fa2_partitioning or a .cu path)")
    what.add_argument("--decode", action="store_true", help="one decode step of gpt2.fast's engine")
    what.add_argument("--backward", metavar="KERNEL", help="a backward rung (b05, b05_wgmma or a .cu path)")
    parser.add_argument("--deterministic", action="store_true", help="with --backward: its deterministic mode")
    parser.add_argument("--size", default="gpt2", help="with --decode: the GPT-2 size (default gpt2)")
    parser.add_argument("--shape", type=shape_arg, default=(8, 1024), metavar="BxT", help="default 8x1024")
    parser.add_argument("--case", default=None, metavar="ID",
                        help="a shape of bench.py frontier in place of --shape, e.g. 2x32x4096-d128-gqa8")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args(argv)
    try:
        import cupy
        from cupy.cuda import profiler

        case = frontier_case(args.case) if args.case else None
        if args.deterministic and not args.backward:
            raise TargetError("--deterministic goes with --backward")
        if args.size != "gpt2" and not args.decode:
            raise TargetError("--size goes with --decode")
        launch = (decode_launch(args.dtype, args.size) if args.decode
                  else backward_launch(args.backward, *args.shape, args.dtype, case, args.deterministic)
                  if args.backward else rung_launch(args.kernel, *args.shape, args.dtype, case))
        cupy.cuda.Device().synchronize()
        profiler.start()
        launch()
        cupy.cuda.Device().synchronize()
        profiler.stop()
    except TargetError as exc:
        print(f"profile_target: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"profile_target: {exc}; the target needs CuPy and the lab's packages (run from the checkout)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
