"""The persistent decode step under compute-sanitizer, with source lines in its reports.

    compute-sanitizer --tool racecheck --kernel-name kns=decode_step python3 tools/sanitize_step.py [--dtype float32]

GPT-2 small with random weights: a 3-token prompt, then `--steps` persistent steps of
kernels/fused/decode_step.cu compiled with -lineinfo (so that a report names decode_step.cu's lines).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import cupy as cp

    import gpt2
    import gpt2.fast as fast
    from kernels import fused

    ckpt = gpt2.random_weights("gpt2", seed=0, xp=cp)
    for dtype in fast.DTYPES if args.dtype == "both" else (args.dtype,):
        params = ckpt.params if dtype == "float32" else fast.as_bfloat16(ckpt.params)
        engine = fast.Engine(params, ckpt.config, dtype=dtype, persistent=True)
        if not engine.persistent:
            print(f"the persistent step is {engine.persistent_note}")
            return 1
        name, expr = fast.kernel_expressions(ckpt.config, dtype)["decode_step"]
        fn = fused.function(name, expr, options=("-lineinfo",))
        fn.max_dynamic_shared_size_bytes = engine.plan.smem
        engine.fn["decode_step"] = fn
        engine.start([1, 2, 3], gpt2.reference_attend, kv_cache=True)
        with engine.stream:
            engine.persistent_steps(args.steps)
        engine.stream.synchronize()
        print(f"{dtype}: tokens {cp.asnumpy(engine.history[3:4 + args.steps]).tolist()}")
        del engine
        fast.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
