"""Where a decode step's time goes, size by size: per kind of launch (the layers' launches of one kind
summed), its milliseconds each timed alone (lab.profile_step: CUDA events around each kernel, queued
behind a spin kernel) and inside the graph (the graph replay's ms per token less the replay's without
that kind's launches), the bytes it must read (FastEngine.step_bytes: its matrices; the attention's
cached keys and values up to the position) and the rate those imply against the copy ceiling measured
in the same run. Beside them the step as it runs: a graph replay's milliseconds per token and, where
the persistent step runs, its own and its stages' (global-timer trace; a stage's bytes are those of
the launches it fuses). What the note on the decode floor reads to say where the missing percent goes.

    python3 tools/decode_breakdown.py                                 every size of bench.py e2e --sizes all
    python3 tools/decode_breakdown.py --sizes gpt2,llama-3.2-1b --dtypes bfloat16,float32 --out $OUT

Each size from random weights as `bench.py e2e --sizes` loads them (benchmarks/scale.py), its engine
warmed up by a short generation, profiled at --position. Writes decode_breakdown.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lm.measure import by_kind  # noqa: E402

# GPT-2's persistent step fuses launches of the per-operation step into its stages (gpt2.fast.plan.STEP_STAGES)
STAGE_LAUNCHES = {"ln_1+attn.c_attn": ("ln_1+attn.c_attn",), "attn+attn.c_proj": ("attn", "attn.c_proj+residual"),
                  "residual+ln_2+mlp.c_fc+gelu": ("ln_2+mlp.c_fc+gelu",),
                  "mlp.c_proj+residual": ("mlp.c_proj+residual",), "ln_f+lm_head+argmax": ("ln_f+lm_head+argmax",)}


def rate(nbytes: int, ms: float, copy_bps: float) -> dict:
    """nbytes read in ms: GB/s and % of the copy ceiling (None where nothing is counted or timed)."""
    if not nbytes or ms <= 0:
        return {"bytes": nbytes, "gb_per_s": None, "pct_copy": None}
    bps = nbytes / (ms / 1e3)
    return {"bytes": nbytes, "gb_per_s": bps / 1e9, "pct_copy": 100 * bps / copy_bps}


def breakdown(profile: dict, step_bytes: list[tuple[str, int]], copy_bps: float) -> dict:
    """lab.profile_step's result and FastEngine.step_bytes' at the same position, by kind: each kind's
    launches, ms, bytes and rate; the step's bytes against its time per token as it runs (the persistent
    step's where it runs, else the graph replay's); the persistent stages with their launches' bytes."""
    nbytes = {kind: total for kind, _, total in by_kind(step_bytes)}
    graph_ms = profile["graph_ms_per_token"]
    without = profile.get("graph_ms_per_token_without") or {}
    kinds = [{"kind": k["kind"], "launches": k["launches"], "ms": k["ms"], **rate(nbytes.get(k["kind"], 0), k["ms"],
                                                                                 copy_bps),
              "in_graph_ms": graph_ms - without[k["kind"]] if k["kind"] in without else None}
             for k in profile["by_kind"]]
    step = sum(nbytes.values())
    per_token = profile["persistent_ms_per_token"] or profile["graph_ms_per_token"]
    out = {"position": profile["position"], "step_bytes": step, "kernel_ms_sum": profile["kernel_ms_sum"],
           "ms_per_token": per_token, "runs_as": "persistent step" if profile["persistent_ms_per_token"] else "graphs",
           "graph_ms_per_token": graph_ms, "step": rate(step, per_token, copy_bps), "kernels_alone": rate(step, profile["kernel_ms_sum"], copy_bps),
           "kinds": kinds, "stages": None}
    if profile["persistent_stages"]:
        out["stages"] = [{**s, **rate(sum(nbytes.get(k, 0) for k in STAGE_LAUNCHES.get(s["kind"], ())), s["ms"],
                                      copy_bps)} for s in profile["persistent_stages"]]
    return out


def measure(size: str, dtype: str, position: int, copy_bps: float, seed: int) -> dict:
    import cupy

    import kernels
    import lab
    from benchmarks import scale

    fam = scale.of_size(size)
    ckpt = fam.random_weights(size, seed=seed, xp=cupy, dtype=dtype)
    config, params = ckpt.config, ckpt.params
    fam.decode_layout(params, config)
    why = fam.fast_reason(params, config, kv_cache=True, sampler=None)
    if why is not None:
        return {"size": size, "dtype": dtype, "status": f"no fast engine: {why}"}
    kernel = lab.fit_kernel(lab.REFERENCE, None, config, dtype, "gpu", kernels.device_limits().arch)
    attend = lab.make_attend(kernel, dtype)
    positions = position + 80  # room for the profile's steps past the position
    fam.generate(params, config, list(fam.prompt_ids), 16, attend=attend, kv_cache=True, sampler=None,
                 max_len=positions)  # compiles, captures the graphs, warms up
    engine = fam.engine(params, config, positions)
    profile = lab.profile_step(engine, position)
    return {"size": size, "dtype": dtype, "status": "ok", "attention": kernel,
            **breakdown(profile, engine.step_bytes(profile["position"]), copy_bps)}


def table(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['size']} {row['dtype']}: {row['status']}"

    def pct(r):
        return "-" if r["pct_copy"] is None else f"{r['pct_copy']:.0f}%"

    lines = [f"{row['size']} {row['dtype']} at position {row['position']}: {row['step_bytes'] / 1e6:,.1f} MB a step, "
             f"{row['ms_per_token']:.3f} ms a token as it runs ({row['runs_as']}: {pct(row['step'])} of copy), "
             f"{row['kernel_ms_sum']:.3f} ms its kernels alone ({pct(row['kernels_alone'])})",
             f"  {'kind':36s} {'launches':>8s} {'ms':>8s} {'MB':>9s} {'% copy':>7s} {'in graph':>9s}"]
    lines += [f"  {k['kind']:36s} {k['launches']:8d} {k['ms']:8.3f} {k['bytes'] / 1e6:9.1f} {pct(k):>7s}"
              + ("" if k.get("in_graph_ms") is None else f" {k['in_graph_ms']:9.3f}")
              for k in row["kinds"]]
    for s in row["stages"] or []:
        lines.append(f"  stage {s['kind']:30s} {s['stages']:8d} {s['ms']:8.3f} {s['bytes'] / 1e6:9.1f} {pct(s):>7s}"
                     f"  (work {s['work_ms']:.3f}, wait {s['wait_ms']:.3f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="all", help="comma-separated sizes of bench.py e2e --sizes, or all")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float32")
    parser.add_argument("--position", type=int, default=128, help="the cache position profiled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for decode_breakdown.json")
    args = parser.parse_args(argv)

    from benchmarks import device, scale
    from lm.measure import copy_ceiling

    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    sizes = list(scale.SIZES) if args.sizes == "all" else args.sizes.split(",")
    unknown = [s for s in sizes if s not in scale.SIZES]
    if unknown:
        parser.error(f"unknown size(s) {', '.join(unknown)}: choose from {', '.join(scale.SIZES)}")
    copy_bps = copy_ceiling()
    info = device.device_info()
    print(f"{info['name']}, driver {info['driver']}; copy ceiling {copy_bps / 1e12:.2f} TB/s", flush=True)
    rows = []
    for size in sizes:
        for dtype in args.dtypes.split(","):
            if dtype == "float32" and scale.family(size) == "llama":
                continue  # Llama's rows run in bfloat16 (as bench.py e2e --sizes)
            rows.append(measure(size, dtype, args.position, copy_bps, args.seed))
            print(table(rows[-1]), flush=True)
            scale.release()
    if args.out:
        path = Path(args.out) / "decode_breakdown.json"
        path.write_text(json.dumps({"device": info, "copy_bps": copy_bps, "command": ["python3", "tools/decode_breakdown.py",
                                    *(sys.argv[1:] if argv is None else argv)], "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
