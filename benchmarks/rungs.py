"""`bench.py kernels`: every rung x shapes (default the five GPT-2 shapes), each checked against float64
on the same inputs as its peers, then timed beside them. bench_shape and run_shapes are also what
`sweep` and `features` run."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np

import kernels
from kernels import triton as triton_rungs

from . import ceilings as precision
from . import device, timing
from .cases import (
    GPT2_SHAPES,
    Case,
    Inputs,
    Shape,
    apply_check,
    check_outputs,
    describe_launch,
    flop_convention,
    shape_flops,
)
from .device import first_line, progress
from .peers import COMPARE_TO, DEFAULT_PEERS, PEERS, peer_session, run_peer_once
from .results import SCHEMA, result_path, write_result, wrote
from .tables import render_kernels


def bench_shape(shape: Shape | Case, dtype: str, rungs: list[Path], peers: list[str], *, flush, method: timing.Method,
                ffma_tflops: float, seed: int, counter: list[int], total: int, interleave: bool = False) -> list[dict]:
    """Rows for one shape: every rung (ladder order), then every peer. With `interleave`, the rungs that
    passed the check are timed together, round by round (timing.time_interleaved); the peers one after
    another as always (an SDPA peer's backend is chosen inside its own session, so sessions cannot nest)."""
    cupy = device.get_cupy()
    progress(f"{shape.label}: NH={shape.NH}, d={shape.d}, {dtype}: running {len(rungs)} rungs (compiled on first "
             f"use) and {len(peers)} peers once, then checking them against float64 ...")
    inputs = Inputs(shape, dtype, seed)
    flops = shape_flops(shape)
    rows, launches, outputs = [], {}, {}

    def row(name, label, kind):
        r = {"shape": shape.as_dict(), "dtype": dtype, "name": name, "label": label, "kind": kind,
             "status": None, "flops": flops}
        rows.append(r)
        return r

    def report(r):
        counter[0] += 1
        where = f"[{counter[0]:>3}/{total}] {shape.label:>8} {r['label']:<24}"
        if r["status"] == "ok":
            t = r["timing"]
            progress(f"{where} {t['median_ms']:10.4f} ms [{t['p20_ms']:.4f}-{t['p80_ms']:.4f}] "
                     f"{r['tflops']:8.2f} TFLOP/s  err {r['max_err']:.1e} <= {r['bound']:.1e}")
        else:
            progress(f"{where} {r['status']}: {r.get('reason', '')}")

    # 1. Run each rung once on NaN-poisoned output, keeping its output for the check. A Triton rung
    #    autotunes on its first call at a new length bucket: that call is here too, never timed.
    for path in rungs:
        r = row(path.stem, path.stem, "rung")
        if triton_rungs.owns(path):
            r["family"] = "triton"
            if kernels.triton_unavailable():
                r["status"], r["reason"] = "unavailable", kernels.triton_unavailable()
                continue
        try:
            if inputs.qkv is None:
                raise TypeError(inputs.rung_inputs_problem)
            q, k, v = inputs.qkv
            launch = kernels.prepare(q, k, v, kernel=path, causal=shape.causal)  # validates, compiles: never timed
            out = launch()
            out.fill(np.nan)  # poison: an element the rung does not write fails the check
            out = launch()
            cupy.cuda.Device().synchronize()
            r["config"] = describe_launch(launch, shape)  # after a run: a Triton rung's tiles are the autotuner's
            launches[r["name"]], outputs[r["name"]] = (launch, cupy.cuda.get_current_stream()), out
        except (TypeError, ValueError) as exc:  # this rung does not take these inputs
            r["status"], r["reason"] = "unsupported", first_line(exc)
        except Exception as exc:
            r["status"], r["reason"] = "error", first_line(exc)

    # 2. Each peer once on the same inputs.
    for name in peers:
        peer = PEERS[name]
        if run_peer_once(row(name, peer.label, "peer"), peer, inputs, outputs):
            launches[name] = (peer, None)

    # 3. The gate: every output against float64, in one pass over the reference.
    apply_check(rows, check_outputs(inputs, outputs) if outputs else None, outputs)
    outputs.clear()
    device.release_memory()

    # 4. Time what is right (peers are timed whatever their error, which is recorded beside them).
    def timed(r, t):
        r["timing"], r["status"] = t, "ok"
        r["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
        r["pct_ffma"] = 100.0 * r["tflops"] / ffma_tflops if ffma_tflops else None

    together = [r for r in rows if r["status"] is None and r["kind"] == "rung"] if interleave else []
    for r, t in zip(together, timing.time_together([launches[r["name"]] for r in together], flush=flush,
                                                   method=method, label=shape.label, what="rungs") or []):
        timed(r, t)
    for r in rows:
        if r["status"] is not None:
            report(r)
            continue
        try:
            if r["kind"] == "rung":
                launch, stream = launches[r["name"]]
                r["timing"] = timing.time_gpu(launch, stream=stream, flush=flush, method=method)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with peer_session(launches[r["name"]][0], inputs) as (launch, stream):
                        cupy.cuda.Device().synchronize()  # CuPy's writes of the inputs are done before torch runs
                        r["timing"] = timing.time_gpu(launch, stream=stream, flush=flush, method=method)
            timed(r, r["timing"])
        except Exception as exc:
            r["status"], r["reason"] = "unavailable" if r["kind"] == "peer" else "error", first_line(exc)
        device.release_memory()
        report(r)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Speed-ups (the other's median over this one's): against the previous timed rung, and each peer. A row
    with "variant_of" (a rung's other configuration, its deterministic one) is measured against that rung's
    row instead, and is no rung's previous."""
    timed = {r["name"]: r["timing"]["median_ms"] for r in rows if r["status"] == "ok"}
    peers = [r["name"] for r in rows if r["kind"] == "peer" and r["name"] in timed]
    previous = None
    for r in rows:
        r["speedup"] = {}
        if r["status"] != "ok":
            continue
        ms = r["timing"]["median_ms"]
        if r.get("variant_of") is not None:
            if r["variant_of"] in timed:
                r["speedup"]["previous"] = timed[r["variant_of"]] / ms
        elif r["kind"] == "rung" and r.get("family") != "triton":  # the ladder's neighbours only
            if previous is not None:
                r["speedup"]["previous"] = timed[previous] / ms
            previous = r["name"]
        for other in peers:
            if other != r["name"]:
                r["speedup"][other] = timed[other] / ms


def announce_and_measure_ceilings(setup: dict, method) -> dict:
    """Print the device line, then measure the FFMA and copy ceilings of this run."""
    dev = setup["device"]
    progress(f"{dev['name']} ({dev['arch']}, {dev['sm_count']} SMs), driver {dev['driver']}, CUDA {dev['cuda_runtime']}, "
             f"CuPy {setup['cupy']}, torch {setup['torch']}")
    progress("measuring the ceilings (fp32 SGEMM 8192^3 without TF32; TF32, bf16, fp16 GEMM 8192^3; device copy) ...")
    ceilings = timing.measure_ceilings(method)
    progress(f"{precision.measured(ceilings)}; copy {ceilings['copy_tbps']:.2f} TB/s")
    return ceilings


def run_shapes(kind: str, args, shapes: list[Shape]) -> dict:
    """The shared body of `kernels` and `sweep`: setup, ceilings, every shape, one result."""
    setup = device.setup_info(args.argv)
    method = timing.Method(budget_ms=args.budget_ms)
    peers = list(DEFAULT_PEERS[args.dtype] if args.peers is None else args.peers)
    ceilings = announce_and_measure_ceilings(setup, method)
    flush = timing.L2Flush()
    compile_before, triton_before = kernels.runtime.compile_seconds, triton_rungs.compile_seconds
    rows, counter = [], [0]
    total = len(shapes) * (len(args.kernels) + len(peers))
    started = time.perf_counter()
    for i, shape in enumerate(shapes):
        rows += bench_shape(shape, args.dtype, args.kernels, peers, flush=flush, method=method,
                            ffma_tflops=ceilings["ffma_tflops"], seed=args.seed + i, counter=counter, total=total)
    precision.annotate(rows, ceilings, args.kernels)
    return {
        "schema": SCHEMA,
        "kind": kind,
        "setup": setup,
        "flop_convention": flop_convention(shapes),
        "method": method.describe(flush.nbytes),
        "ceilings": ceilings,
        "dtype": args.dtype,
        "shapes": [s.as_dict() for s in shapes],
        "kernels": [p.stem for p in args.kernels],
        "peers": peers,
        "compare_to": list(COMPARE_TO[args.dtype]),
        "seed": args.seed,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "triton_compile_seconds": triton_rungs.compile_seconds - triton_before,  # compilation and autotuning
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }


def cmd_kernels(args) -> int:
    device.require_gpu()
    shapes = [Shape(B, T, args.nh, args.d) for B, T in (args.shape or GPT2_SHAPES)]
    result = run_shapes("kernels", args, shapes)
    path = write_result(result, result_path("kernels", result["setup"], args.results))
    print("\n" + render_kernels(result))
    progress(wrote(path))
    return 0
