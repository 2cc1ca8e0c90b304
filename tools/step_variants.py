"""A/B of compile-time variants of the persistent decode step (kernels/fused/decode_step.cu) on a GPU.

    python3 tools/step_variants.py [--position 264[,900]] [--dtype float32] [--size gpt2-xl] [--ring 3] -- "" "-DPOLL_SLEEP_NS=0"

Each argument after `--` is one variant: NVRTC options separated by commas ("" is the engine's build: the
file with the size's switches, gpt2/fast/plan.py's STEP_SWITCHES; a variant's defines replace those of the
same macro), and `reduce=0` or `reduce=1` among them for the kernel's REDUCE_HEADS (else the plan's choice). For each
dtype: the model (GPT-2 small unless --size) with random weights, the step planned for --ring slots where given
(step_plan's ring), a KV cache filled by a generation; every variant runs 64
steps from the same state and cache, and must leave the same tokens and the same bits of x as the
first (a variant that changes arithmetic says so); then microseconds per token from each `position`
(Engine.replay_ms, the variants interleaved over 4 rounds, each a median of 5 runs) and each stage
kind's total, work and wait (Engine.profile_persistent at 519).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help='NVRTC options of a variant, comma-separated ("" for none)')
    parser.add_argument("--position", default="264", help="positions the timed steps start from, comma-separated")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--size", default="gpt2", help="a GPT-2 size: gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    parser.add_argument("--ring", type=int, default=None, help="the weight stream's slots (step_plan's ring)")
    parser.add_argument("--splits", type=int, default=None,
                        help="the key splits a head step_plan starts from (its splits; default STEP_SPLITS)")
    args = parser.parse_args(argv)

    import cupy as cp

    import gpt2
    import gpt2.fast as fast
    from gpt2.fast.plan import with_options
    from kernels import fused

    variants = [tuple(o for o in v.split(",") if o) for v in args.variants]
    try:
        positions = [int(p) for p in args.position.split(",")]
    except ValueError:
        parser.error(f"--position: whole numbers separated by commas, not {args.position!r}")
    if not positions or min(positions) < 1 or max(positions) > 900:
        parser.error("--position: between 1 and 900 (the steps run 64 tokens from each, in a cache of 1,024)")
    if args.size not in gpt2.SIZES:
        parser.error(f"--size must be one of {', '.join(gpt2.SIZES)}")
    ckpt = gpt2.random_weights(args.size, seed=0, xp=cp)
    for dtype in fast.DTYPES if args.dtype == "both" else (args.dtype,):
        params = ckpt.params if dtype == "float32" else fast.as_bfloat16(ckpt.params)
        engine = fast.Engine(params, ckpt.config, dtype=dtype, persistent=True, step_ring=args.ring,
                             step_splits=args.splits)
        print(f"{args.size} {dtype}: {engine.plan}, switches {' '.join(engine.step.options) or '(none)'}")
        engine.generate([1, 2, 3], 300, attend=gpt2.reference_attend, kv_cache=True)  # the cache up to 303
        fns = []
        for options in variants:
            reduce = [o.split("=")[1] == "1" for o in options if o.startswith("reduce=")]
            name, expr = fast.kernel_expressions(ckpt.config, dtype, reduce_heads=reduce[-1] if reduce else None)[
                "decode_step"]
            fn = fused.function(name, expr, options=with_options(
                engine.step.options, tuple(o for o in options if not o.startswith("reduce="))))
            fn.max_dynamic_shared_size_bytes = engine.plan.smem
            fns.append(fn)
        k0, v0 = engine.k_cache.copy(), engine.v_cache.copy()
        first = None
        for options, fn in zip(variants, fns):
            engine.fn["decode_step"] = fn
            engine.k_cache[...], engine.v_cache[...] = k0, v0
            engine.state.set(np.asarray([int(engine.history[200].get()), 200], np.int32))
            with engine.stream:
                engine.persistent_steps(64)
            engine.stream.synchronize()
            got = cp.asnumpy(engine.history[201:265]), cp.asnumpy(engine.x)
            first = first or got
            same = bool((got[0] == first[0]).all() and (got[1] == first[1]).all())
            print(f"{dtype} {' '.join(options) or '(as is)'}: tokens and x {'the same as' if same else 'DIFFER from'} "
                  "the first variant's")
        times = {(i, p): [] for i in range(len(fns)) for p in positions}
        for _ in range(4):
            for p in positions:
                for i, fn in enumerate(fns):
                    engine.fn["decode_step"] = fn
                    times[i, p].append(1e3 * engine.replay_ms(p, 64, repeats=5))
        for i, options in enumerate(variants):
            engine.fn["decode_step"] = fns[i]
            stages = engine.profile_persistent(519)
            kinds = fast.by_kind([(n, t) for n, t, _, _ in stages])
            work = {k: ms for k, _, ms in fast.by_kind([(n, w) for n, _, w, _ in stages])}
            wait = {k: ms for k, _, ms in fast.by_kind([(n, b) for n, _, _, b in stages])}
            for p in positions:
                print(f"{dtype} {' '.join(options) or '(as is)':<40} us/token at {p}: "
                      + " ".join(f"{t:.1f}" for t in times[i, p]))
            print("    " + "; ".join(f"{k} {1e3 * ms:.0f}/{1e3 * work[k]:.0f}/{1e3 * wait[k]:.0f}"
                                     for k, _, ms in kinds) + "  (us per token: total/work/wait)")
        del engine
        fast.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
