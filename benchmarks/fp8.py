"""`bench.py fp8`: the FP8 rung (lab.fp8) against the best bfloat16 rungs and SDPA flash and cuDNN in the
same run, and its accuracy on FlashAttention-3's outlier distribution beside one scale per tensor.

Speed: at d=128, causal, T = 4096, 8192 and 16384 (the FP8 target's shapes) and at the frontier's d=64
shapes. The bfloat16 rungs (v22 and v24, warp-specialized: the FP8 rung is built on them; and the newest, the
ladder's best at d=128) and the peers
are checked against float64 and timed as `bench.py frontier` does (rungs.bench_shape). The FP8 rung takes
the same bfloat16 inputs through kernels.prepare, which quantizes them once (its configuration's tiles,
block scales, the Hadamard rotation), so the timed launches are the kernel alone on e4m3 inputs, as
FlashAttention-3 times its FP8 kernel; before timing, its output must lie within FP8_GATE of the float64
reference's RMS (FP8's own error is about 5% of it on these N(0,1) inputs). TFLOP/s with the frontier's
FLOP convention. Target: at least 1.5x the best bfloat16 rung at d=128, T >= 4096, causal.

Accuracy: Q, K, V from N(0,1) + N(0,100) x Bernoulli(0.001) in float32 (kernels.fp8.outlier_inputs), the
RMSE of each output against float64 attention of those inputs: the FP8 rung on block scales with the
Hadamard rotation, the same arithmetic emulated in float64 (kernels.fp8.emulated_attention, on the
same quantized inputs), and the same kernel on one scale per tensor without the rotation, the
per-tensor FP8 baseline. Target: RMSE <= 1.0e-2 (FlashAttention-3: 9.1e-3, its baseline 2.4e-2).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

import kernels
from kernels import fp8

from . import ceilings as precision
from . import device, timing
from . import fp8_envelope as envelope
from .cases import Case, Inputs, describe_launch, shape_flops
from .device import first_line, progress
from .frontier import FLOPS, case_title, mark
from .options import kernel_list, results_option
from .peers import PEERS
from .plots import plot_or_none
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import announce_and_measure_ceilings, bench_shape
from .tables import clocked, fmt_ms, fmt_tflops, fmt_x, setup_header, sm_clock, table

DTYPE = "bfloat16"
CASES = (  # q (B, NH, T, d) over k, v: FlashAttention-3's 16k tokens of 2048 channels at d=128, the frontier's d=64
    Case("causal", 4, 16, 16, 4096, 4096, 128),
    Case("causal", 2, 16, 16, 8192, 8192, 128),
    Case("causal", 1, 16, 16, 16384, 16384, 128),
    Case("causal", 8, 12, 12, 1024, 1024, 64),
    Case("causal", 16, 12, 12, 2048, 2048, 64),
    Case("causal", 6, 12, 12, 4096, 4096, 64),
    Case("causal", 1, 12, 12, 8192, 8192, 64),
    Case("noncausal", 4, 16, 16, 2048, 2048, 64, causal=False),
)
BF16_RUNGS = ("v22", "v24")  # warp-specialized bfloat16: the FP8 rung's base, and its persistent sibling
PEER_NAMES = ("sdpa_flash", "sdpa_cudnn")
VS_BF16 = 1.5  # the FP8 rung's speed-up over the best bfloat16 rung (its time over the FP8 rung's) ...
VS_BF16_D, VS_BF16_FROM_T = 128, 4096  # ... at this head size, causal, T at least this
FP8_GATE = 0.15  # the FP8 rung's RMSE against float64, as a fraction of the reference's RMS, before it is timed
ACCURACY_SHAPES = ((1, 8, 1024, 64), (1, 8, 4096, 64), (1, 8, 1024, 128), (1, 8, 4096, 128))  # B, NH, T, d; causal
RMSE_TARGET = 1.0e-2


def case_id(case: Case) -> str:
    return f"{case.B}x{case.NH}x{case.T_q}-d{case.d}" + ("" if case.causal else "-noncausal")


def fp8_rungs() -> list[Path]:
    return [kernels.resolve(n) for n in kernels.names() if kernels.load(n).fp8]


def bf16_rungs() -> list[Path]:
    """BF16_RUNGS and the newest bfloat16 rung at d=128 (what a run naming none gets): the target's "best
    bfloat16 rung" is the best of the ladder, not of the FP8 rung's bases alone."""
    names = [*BF16_RUNGS, kernels.default_rung("bfloat16", VS_BF16_D)]
    return list(dict.fromkeys(kernels.resolve(n) for n in names if n is not None))


def target_applies(shape: dict) -> bool:
    return shape["d"] == VS_BF16_D and shape["T_q"] >= VS_BF16_FROM_T and shape["causal"]


def rmse(a, ref) -> float:
    cupy = device.get_cupy()
    return math.sqrt(float(((a.astype(cupy.float64) - ref) ** 2).mean()))


def error_against_float64(inputs: Inputs, out) -> tuple[float, float]:
    """(RMSE of `out` against float64 attention of the same inputs, the reference's RMS), over chunks of
    K/V heads so that the float64 scores fit in memory at any shape."""
    cupy = device.get_cupy()
    s = inputs.shape
    group, kv_heads = s.NH // s.NH_kv, s.B * s.NH_kv
    q = inputs.q32.reshape(kv_heads, group, s.T_q, s.d)  # (B, NH, T_q, d) -> (B*NH_kv, group, T_q, d)
    k, v = (x.reshape(kv_heads, 1, s.T_k, s.d) for x in (inputs.k32, inputs.v32))  # (B, NH_kv, T_k, d) -> (B*NH_kv, 1, T_k, d)
    o = out.reshape(kv_heads, group, s.T_q, s.d)
    budget = min(0.4 * device.free_memory(), 8 * 2**30)
    chunk = int(max(1, min(kv_heads, budget // (32 * group * s.T_q * s.T_k + 32 * s.T_k * s.d))))
    squares = ref_squares = 0.0
    for start in range(0, kv_heads, chunk):
        part = slice(start, min(kv_heads, start + chunk))
        ref = kernels.reference_attention(*(x[part].astype(cupy.float64) for x in (q, k, v)), causal=s.causal)
        squares += float(((o[part].astype(cupy.float64) - ref) ** 2).sum())
        ref_squares += float((ref**2).sum())
        del ref
    n = s.B * s.NH * s.T_q * s.d
    return math.sqrt(squares / n), math.sqrt(ref_squares / n)


def fp8_row(case: Case, path: Path, *, flush, method: timing.Method, seed: int) -> dict:
    """The FP8 rung at one case: quantized once, checked against float64 (FP8_GATE), then timed."""
    r, run = checked_fp8_row(case, path, seed=seed)
    if run is not None:
        timed(r, lambda: alone(run, flush=flush, method=method))
    return r


def alone(run, *, flush, method: timing.Method) -> dict:
    return timing.time_gpu(run, stream=device.get_cupy().cuda.get_current_stream(), flush=flush, method=method)


def timed(r: dict, measure) -> None:
    """r's timing from measure(), its status and TFLOP/s; or the error measure raised."""
    try:
        r["timing"] = measure()
        r["status"] = "ok"
        r["tflops"] = r["flops"] / (r["timing"]["median_ms"] * 1e-3) / 1e12
    except Exception as exc:
        r["status"], r["reason"] = "error", first_line(exc)
    device.release_memory()


def checked_fp8_row(case: Case, path: Path, *, seed: int) -> tuple[dict, object]:
    """(row, run): the FP8 rung prepared at one case (quantized once) and checked against float64
    (FP8_GATE); run is None where it does not take the case, fails or is wrong (the row says why)."""
    cupy = device.get_cupy()
    r = {"shape": case.as_dict(), "dtype": DTYPE, "name": path.stem, "label": path.stem, "kind": "rung",
         "fp8": True, "status": None, "flops": shape_flops(case), "math": None, "pct_ceiling": None}
    try:
        inputs = Inputs(case, DTYPE, seed)  # bench_shape's inputs for this case, drawn again
        if inputs.qkv is None:
            raise TypeError(inputs.rung_inputs_problem)
        run = kernels.prepare(*inputs.qkv, kernel=path, causal=case.causal)  # quantizes: never timed
        out = run()
        out.fill(np.nan)  # poison: an element the rung does not write fails the check
        out = run()
        cupy.cuda.Device().synchronize()
        r["config"] = describe_launch(run, case)
        r["rmse"], r["ref_rms"] = error_against_float64(inputs, out)
        del inputs, out
        device.release_memory()
        if not r["rmse"] <= FP8_GATE * r["ref_rms"]:
            r["status"] = "wrong"
            r["reason"] = f"RMSE {r['rmse']:.2e} > {FP8_GATE:g} x the reference's RMS {r['ref_rms']:.2e}"
            return r, None
        return r, run
    except (TypeError, ValueError) as exc:  # this rung does not take the case
        r["status"], r["reason"] = "unsupported", first_line(exc)
    except Exception as exc:
        r["status"], r["reason"] = "error", first_line(exc)
    device.release_memory()
    return r, None


def fp8_rows(case: Case, paths: list[Path], *, flush, method: timing.Method, seed: int, interleave: bool) -> list[dict]:
    """Every FP8 rung at one case, in order: each checked, then timed alone (fp8_row), or with
    `interleave` those that passed timed together (timing.time_interleaved; one by one if that fails)."""
    if not interleave:
        return [fp8_row(case, p, flush=flush, method=method, seed=seed) for p in paths]
    checked = [checked_fp8_row(case, p, seed=seed) for p in paths]
    ready = [(r, run) for r, run in checked if run is not None]
    stream = device.get_cupy().cuda.get_current_stream()
    together = timing.time_together([(run, stream) for _, run in ready], flush=flush, method=method,
                                    label=case.label, what="FP8 rungs")
    for i, (r, run) in enumerate(ready):
        timed(r, (lambda t=together[i]: t) if together else (lambda run=run: alone(run, flush=flush, method=method)))
    return [r for r, _ in checked]


def accuracy_rows(paths: list[Path], seed: int) -> list[dict]:
    """Each FP8 rung's RMSE on the outlier distribution at ACCURACY_SHAPES (causal): block scales with the
    rotation, the same emulated in float64, and one scale per tensor without the rotation."""
    cupy = device.get_cupy()
    rows = []
    for B, NH, T, d in ACCURACY_SHAPES:
        q, k, v = fp8.outlier_inputs(cupy, (B, NH, T, d), seed=seed)
        ref = kernels.reference_attention(*(x.astype(cupy.float64) for x in (q, k, v)))
        for path in paths:
            r = {"shape": {"B": B, "NH": NH, "T": T, "d": d}, "name": path.stem, "status": "ok"}
            try:
                rung = kernels.load(path)
                if d not in rung.head_sizes():
                    raise ValueError(f"kernel {rung.name} supports head sizes {rung.head_sizes()}; got d={d}")
                block = kernels.quantize_for(path, q, k, v)
                tensor = kernels.quantize_for(path, q, k, v, hadamard=False, per_tensor=True)
                r |= {"quantized": block.describe(), "baseline": tensor.describe(),
                      "rmse": rmse(kernels.attention_fp8(block, kernel=path), ref),
                      "rmse_emulated": rmse(fp8.emulated_attention(block), ref),
                      "rmse_per_tensor": rmse(kernels.attention_fp8(tensor, kernel=path), ref)}
                r["met"] = r["rmse"] <= RMSE_TARGET
            except (TypeError, ValueError) as exc:
                r["status"], r["reason"] = "unsupported", first_line(exc)
            except Exception as exc:
                r["status"], r["reason"] = "error", first_line(exc)
            rows.append(r)
            device.release_memory()
        del q, k, v, ref
        device.release_memory()
    return rows


def verdict(case: dict, rows: list[dict]) -> dict:
    """One case's outcome: the fastest correct bfloat16 rung, the FP8 rung's speed-up over it, and the
    target as True (met), False (missed) or None (does not apply, or nothing to compare)."""
    timed = [r for r in rows if r["status"] == "ok" and r["kind"] == "rung"]
    ms = lambda r: r["timing"]["median_ms"]  # noqa: E731
    best = min((r for r in timed if not r.get("fp8")), key=ms, default=None)
    ours = min((r for r in timed if r.get("fp8")), key=ms, default=None)
    vs = ms(best) / ms(ours) if best and ours else None
    applies = target_applies(case["shape"])
    met = None if not applies or best is None else (vs is not None and vs >= VS_BF16)
    return {"fp8": ours["name"] if ours else None, "fp8_tflops": ours["tflops"] if ours else None,
            "best_bf16": best["name"] if best else None, "best_bf16_tflops": best["tflops"] if best else None,
            "vs_best_bf16": vs, "met": met}


def render_fp8(result: dict) -> str:
    """The speed table (TFLOP/s per implementation, the FP8 rung against the best bfloat16 rung, the
    target), the FP8 rung per case (time, spread, error), then the accuracy table."""
    m, t = result["method"], result["targets"]
    names = result["fp8_kernels"] + result["bf16_kernels"] + result["peers"]
    labels = {n: f"`{n}`" for n in result["fp8_kernels"] + result["bf16_kernels"]} | {n: PEERS[n].label for n in result["peers"]}
    lines = setup_header(result) + [
        "",
        f"TFLOP/s of each implementation on the same bfloat16 inputs; FLOPs: {result['flop_convention']}. Times: "
        f"median of {m['min_runs']}-{m['max_runs']} runs (as many as fit in {m['budget_ms']:g} ms) after "
        f"{m['warmup_runs']} warm-up runs, CUDA events, L2 flushed before each run. The bfloat16 rungs and the peers "
        f"were checked against float64 first ({m['tolerance']}); the FP8 rung runs on its inputs quantized once "
        "before timing (e4m3, one scale per tile, Hadamard rotation of Q and K), and its RMSE against float64 had to "
        f"be at most {t['gate']:g} x the reference's RMS. A rung that failed its check is reported wrong and not timed.",
        "",
        f"Target: the FP8 rung at least {t['vs_bf16']:g}x the best bfloat16 rung (that one's time over the FP8 "
        f"rung's) at d={t['d']}, T >= {t['from_T']}, causal. \"-\": the target does not apply to the shape; n/a: not "
        "judged, no bfloat16 rung was timed.",
        "",
    ]
    header = ["shape", *[labels[n] for n in names], "best bfloat16 rung", "FP8 vs best bfloat16",
              f">= {t['vs_bf16']:g}x best bfloat16"]
    body, met, judged = [], 0, 0
    for case in result["cases"]:
        rows = [r for r in result["rows"] if r["case"] == case["id"]]
        by_name, v = {r["name"]: r for r in rows}, case["verdict"]
        cells = [case_title(case["shape"])]
        for n in names:
            r = by_name.get(n)
            cells.append("-" if r is None else fmt_tflops(r["tflops"]) if r["status"] == "ok" else r["status"])
        applies = target_applies(case["shape"])
        cells += [f"`{v['best_bf16']}`" if v["best_bf16"] else "none", fmt_x(v["vs_best_bf16"]), mark(v["met"], applies)]
        body.append(cells)
        met += v["met"] is True
        judged += v["met"] is not None
    lines += table(header, body, "l" + "r" * len(names) + "lrl")
    lines += ["", f"Targets met: {met} of {judged}."]
    lines += ["", "The FP8 rung per shape: its time, and its error on these N(0,1) inputs (RMSE against float64, "
                  "and the reference's RMS).", ""]
    detail = []
    fp8_rows = [r for r in result["rows"] if r.get("fp8")]
    clock = clocked(fp8_rows)  # an SM MHz column where the run read the clock (benchmarks.clocks)
    for r in fp8_rows:
        title = case_title(r["shape"])
        if r["status"] == "ok":
            tm = r["timing"]
            detail.append([title, f"`{r['name']}`", fmt_ms(tm["median_ms"]), f"{fmt_ms(tm['p20_ms'])}-{fmt_ms(tm['p80_ms'])}",
                           fmt_tflops(r["tflops"]), *([sm_clock(r)] if clock else []), f"{r['rmse']:.1e}",
                           f"{r['ref_rms']:.1e}", r.get("config", "")])
        else:
            error = f"{r['rmse']:.1e}" if r.get("rmse") is not None else "-"
            detail.append([title, f"`{r['name']}`", f"**{r['status']}**", "-", "-", *(["-"] if clock else []), error, "-",
                           r.get("reason", "")])
    lines += table(["shape", "kernel", "ms", "p20-p80", "TFLOP/s", *(["SM MHz"] if clock else []), "RMSE", "reference RMS",
                    "note"], detail, "llrrr" + ("r" if clock else "") + "rrl")
    a = result["accuracy"]
    lines += ["", f"**Accuracy** on N(0,1) + N(0,100) x Bernoulli(0.001) (float32 inputs, seed {a['seed']}, causal): "
                  f"RMSE against float64 attention. Target: at most {a['target']:.1e} with block scales and the "
                  "Hadamard rotation. \"emulated\": the same arithmetic in float64 on the same e4m3 inputs "
                  "(kernels.fp8.emulated_attention); \"per tensor\": the same kernel on one scale per tensor and no "
                  "rotation.", ""]
    acc = []
    for r in a["rows"]:
        s = r["shape"]
        title = f"{s['B']}x{s['NH']}x{s['T']}, d{s['d']}"
        if r["status"] == "ok":
            acc.append([title, f"`{r['name']}`", f"{r['rmse']:.2e}", f"{r['rmse_emulated']:.2e}",
                        f"{r['rmse_per_tensor']:.2e}", fmt_x(r["rmse_per_tensor"] / r["rmse"] if r["rmse"] else None),
                        "met" if r["met"] else "**missed**"])
        else:
            acc.append([title, f"`{r['name']}`", f"**{r['status']}**", "-", "-", "-", r.get("reason", "")])
    lines += table(["shape", "kernel", "RMSE (block scales, Hadamard)", "emulated", "per tensor", "per tensor / block",
                    f"<= {a['target']:.1e}"], acc, "llrrrrl")
    return "\n".join(lines)


def cmd_envelope(args, setup: dict) -> int:
    started = time.perf_counter()
    rows = envelope.envelope_rows(args.seed)
    result = {"schema": SCHEMA, "kind": "envelope", "setup": setup, "seed": args.seed,
              "envelope": {"shape": dict(zip(("B", "NH", "T", "d"), envelope.SHAPE)), "causal": True,
                           "stds": list(envelope.STDS), "variants": list(envelope.VARIANTS),
                           "bf16_kernel": envelope.BF16_BASELINE, "rows": rows},
              "wall_seconds": time.perf_counter() - started}
    path = write_result(result, result_path("envelope", setup, args.results))  # a kind of its own: docs' envelope section
    png = plot_or_none(envelope.plot_envelope, result, path.with_suffix(".png"))
    print("\n" + "\n".join(envelope.render_envelope(rows)))
    progress(wrote(path, png))
    return 0


def cmd_fp8(args) -> int:
    device.require_gpu()
    setup = device.setup_info(args.argv)
    if args.envelope:
        return cmd_envelope(args, setup)
    method = timing.Method(budget_ms=args.budget_ms)
    ours = args.kernels if args.kernels is not None else fp8_rungs()
    if not ours:
        raise device.CannotRun("no rung declares lab.fp8")
    others = [p.stem for p in ours if not kernels.load(p).fp8]
    if others:
        raise device.CannotRun(f"{', '.join(others)} do not declare lab.fp8; `bench.py frontier` measures bfloat16 rungs")
    bf16 = bf16_rungs()
    peers = list(PEER_NAMES)
    ceilings = announce_and_measure_ceilings(setup, method)
    progress(f"FLOPs: {FLOPS}")
    flush = timing.L2Flush()
    compile_before, started = kernels.runtime.compile_seconds, time.perf_counter()
    rows, counter = [], [0]
    total = len(CASES) * (len(bf16) + len(peers))
    for i, case in enumerate(CASES):
        got = bench_shape(case, DTYPE, bf16, peers, flush=flush, method=method, ffma_tflops=ceilings["ffma_tflops"],
                          seed=args.seed + i, counter=counter, total=total, interleave=args.interleave)
        precision.annotate(got, ceilings, bf16)
        for r in fp8_rows(case, ours, flush=flush, method=method, seed=args.seed + i, interleave=args.interleave):
            progress(f"{case.label:>14} {r['name']:<24} " + (f"{r['timing']['median_ms']:10.4f} ms {r['tflops']:8.2f} TFLOP/s  "
                                                              f"RMSE {r['rmse']:.1e} (reference RMS {r['ref_rms']:.1e})"
                                                              if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"))
            got.insert(0, r)
        for r in got:
            r["case"] = case_id(case)
        rows += got
        device.release_memory()
    progress("accuracy on N(0,1) + N(0,100) x Bernoulli(0.001) ...")
    accuracy = accuracy_rows(ours, args.seed)
    cases = [{"id": case_id(c), "shape": c.as_dict(), "flops": shape_flops(c)} for c in CASES]
    for case in cases:
        case["verdict"] = verdict(case, [r for r in rows if r["case"] == case["id"]])
    result = {
        "schema": SCHEMA, "kind": "fp8", "setup": setup, "flop_convention": FLOPS,
        "method": method.describe(flush.nbytes) | ({"interleave": timing.INTERLEAVE} if args.interleave else {}),
        "ceilings": ceilings, "dtype": DTYPE,
        "fp8_kernels": [p.stem for p in ours], "bf16_kernels": [p.stem for p in bf16], "peers": peers,
        "targets": {"vs_bf16": VS_BF16, "d": VS_BF16_D, "from_T": VS_BF16_FROM_T, "gate": FP8_GATE},
        "cases": cases, "seed": args.seed, "rows": rows,
        "accuracy": {"target": RMSE_TARGET, "seed": args.seed, "causal": True, "rows": accuracy},
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
    }
    path = write_result(result, result_path("fp8", setup, args.results))
    print("\n" + render_fp8(result))
    progress(wrote(path))
    return 0


def add_fp8_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fp8", help="the FP8 rung beside the best bfloat16 rungs and SDPA flash / cuDNN, and its RMSE on outliers",
        description=f"The FP8 rung (lab.fp8) at d=128, causal, T = 4096 to 16384, and at the frontier's d=64 shapes, "
                    f"beside {', '.join(p.stem.split('_')[0] for p in bf16_rungs())} and SDPA flash and cuDNN in the same run (TFLOP/s; target: "
                    f">= {VS_BF16:g}x the best bfloat16 rung at d={VS_BF16_D}, T >= {VS_BF16_FROM_T}, causal); then "
                    "its RMSE against float64 on N(0,1) + N(0,100) x Bernoulli(0.001) beside its float64 emulation "
                    f"and the same kernel with one scale per tensor (target: <= {RMSE_TARGET:.1e}).")
    p.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="FP8 rungs, comma-separated (default: every rung declaring lab.fp8)")
    p.add_argument("--budget-ms", type=float, default=300.0,
                   help="GPU time to spend on the timed runs of each entry (default 300; 10-200 runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--envelope", action="store_true",
                   help="instead: the error against the scores' std (1 to 50), v25 with and without the rotation, "
                        "per-tensor FP8, their float64 emulations and bfloat16 v24 (a table and a plot)")
    p.add_argument("--interleave", action="store_true",
                   help="time a case's FP8 rungs together, and its bfloat16 rungs together, a run of each per round, "
                        "the order rotated (as bench.py frontier --interleave); bench.py compare pairs them")
    results_option(p)
    return p
