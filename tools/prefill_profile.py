"""The prefill on the fast engines, host time beside wall time, with the switches of its launches off and
on: off; casts (kernels.runtime.PREPARE_CASTS, the default); casts+event (and WAIT_BY_EVENT);
casts+graphs (and lm.prefill_graph.PREFILL_GRAPHS: the pass replayed from a CUDA graph a bucket).

    python3 tools/prefill_profile.py                                   gpt2-xl and llama-3.2-1b, bfloat16, 1000 tokens
    python3 tools/prefill_profile.py --sizes gpt2 --tokens 97 --out $OUT
    python3 tools/prefill_profile.py --sizes gpt2-xl --cprofile 20     and the host's busiest functions per setting

Each size from random weights as `bench.py e2e --sizes` loads them (benchmarks/scale.py: in the run's dtype,
in the fast engine's layout; the newest rung that takes the model, or --kernel; lab.make_attend), one engine
for every prompt: --tokens ids (benchmarks.scale.prefill_ids), then the first of them alone. Per setting
and prompt: the engine's prefill (engine.start: the whole-sequence pass and the first token's
argmax, queued on the engine's stream) timed on the host's clock twice, once when the call returns without
synchronizing (host: what Python takes to queue the launches) and once after the stream's synchronization
(wall); then the time to the first token as benchmarks/scale.py takes it (generate(prompt, 1), synchronized
before and after). Medians of --repeats rounds after --warmup, the settings interleaved in each round.

Reading it: a pass whose host time is about its wall time is host-bound (the GPU waits for the launches),
as is one whose 1-token prompt takes as long as the long one. PREPARE_CASTS on should leave the values as
they are (tests/test_fused_gpu.py checks the bits) and take the per-layer casts and prepares out of the host
time of a pass whose q, k, v are not in the rung's dtype (gpt2.fast's float32 work buffers in a bfloat16 run);
WAIT_BY_EVENT takes out the host's wait for a persistent or split-KV rung's zeroed workspace at each prepare
(Llama's eager prefill prepares its rung every layer), so that the host queues while the device runs.
PREFILL_GRAPHS should leave a host time of a few launches and a wall time of the GPU's work; its
one-time costs at each prompt's bucket (the bucket's first prompt, run eagerly, and its second,
captured) are measured before the rounds and kept in its rows.
Writes prefill_profile.json to --out (default $OUT) when given.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the switches of the prefill's launches, by the module that holds each
SWITCHES = {"PREPARE_CASTS": "kernels.runtime", "WAIT_BY_EVENT": "kernels.runtime",
            "PREFILL_GRAPHS": "lm.prefill_graph"}
SETTINGS = {"off": (), "casts": ("PREPARE_CASTS",), "casts+event": ("PREPARE_CASTS", "WAIT_BY_EVENT"),
            "casts+graphs": ("PREPARE_CASTS", "PREFILL_GRAPHS")}  # the switches each setting turns on


def turn(setting: str) -> None:
    """The switches as `setting` has them."""
    for switch, module in SWITCHES.items():
        setattr(importlib.import_module(module), switch, switch in SETTINGS[setting])


def bucket_costs(engine, prefill, ids) -> dict:
    """A graphed prefill's one-time costs at ids' bucket (PREFILL_GRAPHS on), its graphs dropped first:
    the bucket's first prompt (eager, over the bucket's rows) and its second (captured, then launched),
    wall milliseconds each."""
    graphs = engine.prefill_graphs()
    graphs.clear()
    return {"bucket_first_ms": 1e3 * prefill(ids)[1], "bucket_capture_ms": 1e3 * prefill(ids)[1]}


def measure(size: str, dtype: str, args) -> list[dict]:
    """One row per (prompt length, setting): median host, wall and first-token milliseconds."""
    import cupy

    from benchmarks import scale

    fam, ckpt, kernel, attend = scale.lab_model(size, dtype, args.seed, args.kernel)
    config, params = ckpt.config, ckpt.params
    long_prompt = scale.prefill_ids(size, config, args.tokens)
    prompts = {len(long_prompt): long_prompt, 1: long_prompt[:1]}
    positions = len(long_prompt) + 1
    why = fam.fast_reason(params, config, kv_cache=True, sampler=None)
    if why is not None:
        raise SystemExit(f"{size} {dtype}: the fast engine does not run it ({why})")

    def first_token(ids) -> float:
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        fam.generate(params, config, ids, 1, attend=attend, kv_cache=True, sampler=None, max_len=positions)
        cupy.cuda.Device().synchronize()
        return time.perf_counter() - start

    for on in SETTINGS:  # compiles every kernel, validates the rung at both lengths, warms cuBLAS
        turn(on)
        for ids in prompts.values():
            first_token(ids)
    engine = fam.engine(params, config, positions)

    def prefill(ids) -> tuple[float, float]:
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        engine.start(ids, attend, kv_cache=True)
        host = time.perf_counter() - start
        engine.stream.synchronize()
        return host, time.perf_counter() - start

    once = {}
    for T, ids in prompts.items():
        turn("casts+graphs")
        once[T] = bucket_costs(engine, prefill, ids)
    samples = {(T, on): [] for T in prompts for on in SETTINGS}
    for round_ in range(args.warmup + args.repeats):
        for on in SETTINGS:
            turn(on)
            for T, ids in prompts.items():
                times = (*prefill(ids), first_token(ids))
                if round_ >= args.warmup:
                    samples[(T, on)].append(times)
    if args.cprofile:
        for on in SETTINGS:
            turn(on)
            print(f"{size} {dtype} {len(long_prompt)} tokens, switches {on}: the host's busiest functions")
            print(host_profile(lambda: engine.start(long_prompt, attend, kv_cache=True), engine, args.cprofile))
    rows = []
    for (T, on), runs in samples.items():
        host, wall, ttft = (1e3 * statistics.median(r[i] for r in runs) for i in range(3))
        rows.append({"size": size, "dtype": dtype, "attention": kernel, "prompt_tokens": T, "switches": on,
                     "host_ms": host, "wall_ms": wall, "first_token_ms": ttft, "host_over_wall": host / wall,
                     "repeats": len(runs), **(once[T] if on == "casts+graphs" else {})})
    return rows


def host_profile(call, engine, top: int) -> str:
    """cProfile's table of one call (by own time, the `top` first), the stream synchronized after it."""
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    engine.stream.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="gpt2-xl,llama-3.2-1b", help="comma-separated sizes (bench.py e2e's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kernel", default=None, help="the prefill's rung (default: the newest that takes the model)")
    parser.add_argument("--tokens", type=int, default=1000, help="the long prompt's length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="rounds before the timed ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print cProfile's N busiest functions of one long prefill per setting")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for prefill_profile.json")
    args = parser.parse_args(argv)

    from benchmarks import device, scale

    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    given = {switch: getattr(importlib.import_module(module), switch) for switch, module in SWITCHES.items()}
    rows = []
    try:
        for size in args.sizes.split(","):
            rows += measure(size, args.dtype, args)
            scale.release()
    finally:
        for switch, value in given.items():
            setattr(importlib.import_module(SWITCHES[switch]), switch, value)
    info = device.device_info()
    print(f"{info['name']}, driver {info['driver']}, CUDA {info['cuda_runtime']}; medians of {args.repeats} (ms)")
    print(f"{'size':14s} {'dtype':9s} {'attention':22s} {'prompt':>6s} {'switches':>13s} {'host':>8s} "
          f"{'wall':>8s} {'host/wall':>9s} {'first token':>11s}")
    for r in rows:
        print(f"{r['size']:14s} {r['dtype']:9s} {r['attention']:22s} {r['prompt_tokens']:6d} {r['switches']:>13s} "
              f"{r['host_ms']:8.2f} {r['wall_ms']:8.2f} {r['host_over_wall']:9.2f} {r['first_token_ms']:11.2f}"
              + (f"  (the bucket's first prompt {r['bucket_first_ms']:.2f}, its capture {r['bucket_capture_ms']:.2f})"
                 if "bucket_first_ms" in r else ""))
    if args.out:
        path = Path(args.out) / "prefill_profile.json"
        path.write_text(json.dumps({"device": info, "command": ["python3", "tools/prefill_profile.py", *(sys.argv[1:] if argv is None else argv)],
                                    "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
