"""`bench.py features`: the attention features past causal self-attention, on the rungs that declare
them (lab.supports, lab.split_kv), each case checked against float64 and timed beside torch SDPA:
GPT-2 decode (CUPTI kernel time per call, and per call in a CUDA graph), long-context decode (K+V
bandwidth against the copy ceiling), non-causal, cross lengths, grouped-query heads, head sizes."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np

import kernels

from . import device, timing
from .cases import (
    FEATURE_FLOP_CONVENTION,
    Case,
    Inputs,
    apply_check,
    check_outputs,
    describe_launch,
    shape_flops,
)
from .device import first_line, progress
from .peers import FEATURE_PEER, PEERS, peer_sessions, run_peer_once
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import announce_and_measure_ceilings, bench_shape
from .tables import render_features

FEATURE_PARTS = ("decode", "long", "noncausal", "cross", "gqa", "heads")
FEATURE_CASES = {  # part -> the cases measured, each in every dtype of the part
    "decode": [Case("decode", 1, 12, 12, 1, T_k, 64) for T_k in (1, 128, 512, 1024)],  # GPT-2 small, one token
    "long": [Case("long", 16, 32, 32, 1, 4096, 128)],
    "noncausal": [Case("noncausal", 4, 12, 12, 2048, 2048, 64, causal=False)],
    "cross": [Case("cross", 4, 12, 12, 256, 4096, 64)],
    "gqa": [Case("gqa", 4, 32, 8, 2048, 2048, 128)],
    "heads": [Case("heads", 8, 12, 12, 1024, 1024, d) for d in (32, 64, 96, 128)],
}
LONG_DTYPES = ("bfloat16", "float32", "float16")  # long context: bfloat16, and the others a rung declares
DECODE_TARGET_US = 5.0  # GPT-2 decode: kernel time per call at most this
LONG_TARGET_PCT = 75.0  # long-context decode: K+V bandwidth at least this % of the copy ceiling


def default_feature_rungs() -> list[Path]:
    """The rungs past causal self-attention: those declaring lab.supports or lab.split_kv (not the FP8
    rungs, held to FP8's accuracy by `bench.py fp8` rather than to their dtype's)."""
    return [kernels.resolve(n) for n in kernels.names()
            if (kernels.load(n).supports or kernels.load(n).split_kv) and not kernels.load(n).fp8]


def declares(rung, case: Case, dtype: str) -> bool:
    """Whether a rung's declarations cover a case: the dtype, the head size and every feature it needs."""
    return dtype in rung.dtypes and case.d in rung.head_sizes() and case.needs() <= set(rung.supports)


def case_rungs(case: Case, dtype: str, candidates: list[Path], named: bool) -> list[Path]:
    """The rungs a case runs. Named on the command line: every one (those that do not take the case
    are reported unsupported). Otherwise those declaring it: for decode the split-KV rungs and, as
    context, the newest other rung; for long context the split-KV rungs; elsewhere all."""
    if named:
        return list(candidates)
    loaded = [(p, kernels.load(p)) for p in candidates]
    taking = [(p, r) for p, r in loaded if declares(r, case, dtype)]
    if case.part == "decode":
        newest_other = [p for p, r in taking if not r.split_kv][-1:]
        return [p for p, r in taking if r.split_kv or p in newest_other]
    if case.part == "long":
        return [p for p, r in taking if r.split_kv]
    return [p for p, _ in taking]


def feature_plan(parts: list[str], dtypes: list[str], candidates: list[Path], named: bool) -> list[dict]:
    """Every (case, dtype) to measure, in table order, with its rungs and its peer: `dtypes` for decode
    and the general features; for long context bfloat16 and any other dtype a chosen split-KV rung
    declares (every one, with named rungs)."""
    plan = []
    for part in FEATURE_PARTS:
        if part not in parts:
            continue
        if part == "long":
            loaded = [kernels.load(p) for p in candidates]
            part_dtypes = [t for t in LONG_DTYPES if t == "bfloat16" or any(
                t in r.dtypes and (named or r.split_kv) for r in loaded)]
        else:
            part_dtypes = list(dtypes)
        for case in FEATURE_CASES[part]:
            for dtype in part_dtypes:
                plan.append({"id": f"{part}-{case.B}x{case.T_q}x{case.T_k}-d{case.d}-{dtype}", "case": case,
                             "dtype": dtype,
                             "rungs": case_rungs(case, dtype, candidates, named), "peer": FEATURE_PEER[dtype]})
    return plan


def kv_bytes(case: Case, dtype: str) -> int:
    """Bytes of K and V: what a decode step must read."""
    return 2 * case.B * case.NH_kv * case.T_k * case.d * (4 if dtype == "float32" else 2)


def bench_decode(case: Case, dtype: str, rungs: list[Path], peer_name: str, *, caches: int, reps: int, seed: int,
                 counter: list[int], total: int) -> list[dict]:
    """Rows for one decode shape: every rung, then the peer, checked against float64 on the first cache,
    then timed over `caches` independent caches in turn (so that L2 does not hold K and V, as in a
    model where other layers ran since): kernel time per call from CUPTI, and per call in a CUDA graph."""
    cupy = device.get_cupy()
    peer = PEERS[peer_name]
    progress(f"decode T_k={case.T_k} ({case.describe()}), {dtype}: {len(rungs)} rungs and {peer.label} over "
             f"{caches} caches, checked against float64 first ...")
    inputs = [Inputs(case, dtype, seed + i) for i in range(caches)]
    rows, runs, outputs = [], {}, {}

    def row(name, label, kind):
        r = {"shape": case.as_dict(), "dtype": dtype, "name": name, "label": label, "kind": kind, "status": None,
             "kv_bytes": kv_bytes(case, dtype)}
        rows.append(r)
        return r

    for path in rungs:
        r = row(path.stem, path.stem, "rung")
        try:
            if inputs[0].qkv is None:
                raise TypeError(inputs[0].rung_inputs_problem)
            launches = [kernels.prepare(*x.qkv, kernel=path, causal=case.causal) for x in inputs]
            r["config"] = describe_launch(launches[0], case)
            out = launches[0]()
            out.fill(np.nan)  # poison: an element the rung does not write fails the check
            out = launches[0]()
            cupy.cuda.Device().synchronize()
            runs[r["name"]], outputs[r["name"]] = launches, out
        except (TypeError, ValueError) as exc:
            r["status"], r["reason"] = "unsupported", first_line(exc)
        except Exception as exc:
            r["status"], r["reason"] = "error", first_line(exc)
    run_peer_once(row(peer_name, peer.label, "peer"), peer, inputs[0], outputs)
    apply_check(rows, check_outputs(inputs[0], outputs) if outputs else None, outputs)
    outputs.clear()
    device.release_memory()

    def timed(calls, graph) -> dict:
        t = {}
        try:
            t["kernel_timing"] = timing.kernel_timing(calls, reps)
        except Exception as exc:  # the profiler failing leaves the graph's time
            t["kernel_timing"], t["kernel_reason"] = None, f"CUPTI: {first_line(exc)}"
        t["kernel_us"] = t["kernel_timing"]["us"] if t["kernel_timing"] else None
        try:
            t["graph_us"] = graph(calls, reps)
        except Exception as exc:  # a capture the backend refuses
            t["graph_us"], t["graph_reason"] = None, first_line(exc)
        return t

    for r in rows:
        if r["status"] is None:
            try:
                if r["kind"] == "rung":
                    r |= timed(runs[r["name"]], timing.graph_us)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        with peer_sessions(peer, inputs) as (launches, _):
                            cupy.cuda.Device().synchronize()
                            r |= timed(launches, timing.torch_graph_us)
                r["status"] = "ok"
            except Exception as exc:
                r["status"], r["reason"] = "unavailable" if r["kind"] == "peer" else "error", first_line(exc)
        counter[0] += 1
        where = f"[{counter[0]:>3}/{total}] decode {dtype:<8} T_k {case.T_k:>5} {r['label']:<22}"
        if r["status"] == "ok":
            us = lambda x: "n/a" if x is None else f"{x:7.2f} us"  # noqa: E731
            progress(f"{where} kernel {us(r['kernel_us'])} (CUPTI), {us(r['graph_us'])} per call in a graph")
        else:
            progress(f"{where} {r['status']}: {r.get('reason', '')}")
    runs.clear()
    device.release_memory()
    peer_us = next((r["kernel_us"] for r in rows if r["kind"] == "peer" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and r["kernel_us"]:
            r["kv_tbps"] = r["kv_bytes"] / (r["kernel_us"] * 1e-6) / 1e12
            r["vs_peer"] = peer_us / r["kernel_us"] if peer_us and r["kind"] == "rung" else None
            if r["kind"] == "rung":
                r["target_met"] = r["kernel_us"] <= DECODE_TARGET_US
    return rows


def add_feature_ratios(rows: list[dict], peer_name: str, copy_tbps: float | None) -> None:
    """Each timed rung against the case's peer (the peer's median over the rung's); with a copy
    ceiling (long context), K+V bytes / time, its % of the ceiling and whether the target is met."""
    peer = next((r for r in rows if r["name"] == peer_name and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        ms = r["timing"]["median_ms"]
        r["vs_peer"] = peer["timing"]["median_ms"] / ms if peer is not None and r["kind"] == "rung" else None
        if copy_tbps is not None:
            r["kv_bytes"] = kv_bytes(Case(**r["shape"]), r["dtype"])
            r["kv_tbps"] = r["kv_bytes"] / (ms * 1e-3) / 1e12
            r["pct_copy"] = 100.0 * r["kv_tbps"] / copy_tbps if copy_tbps else None
            if r["kind"] == "rung" and r["pct_copy"] is not None:
                r["target_met"] = r["pct_copy"] >= LONG_TARGET_PCT


def cmd_features(args) -> int:
    device.require_gpu()
    setup = device.setup_info(args.argv)
    method = timing.Method(budget_ms=args.budget_ms)
    named = args.kernels is not None
    candidates = args.kernels if named else default_feature_rungs()
    plan = feature_plan(args.parts, args.dtypes, candidates, named)
    ceilings = announce_and_measure_ceilings(setup, method)
    flush = timing.L2Flush()
    compile_before = kernels.runtime.compile_seconds
    started = time.perf_counter()
    rows, counter = [], [0]
    total = sum(len(entry["rungs"]) + 1 for entry in plan)
    for i, entry in enumerate(plan):
        case, dtype, peer = entry["case"], entry["dtype"], entry["peer"]
        seed = args.seed + 1000 * i
        if case.part == "decode":
            got = bench_decode(case, dtype, entry["rungs"], peer, caches=args.caches, reps=args.reps, seed=seed,
                               counter=counter, total=total)
        else:
            got = bench_shape(case, dtype, entry["rungs"], [peer], flush=flush, method=method,
                              ffma_tflops=ceilings["ffma_tflops"], seed=seed, counter=counter, total=total)
            add_feature_ratios(got, peer, ceilings["copy_tbps"] if case.part == "long" else None)
        for r in got:
            r["case"] = entry["id"]
        rows += got
        device.release_memory()
    result = {
        "schema": SCHEMA,
        "kind": "features",
        "setup": setup,
        "flop_convention": FEATURE_FLOP_CONVENTION,
        "method": method.describe(flush.nbytes) | {
            "decode": f"kernel time per call: CUPTI kernel records through torch.profiler (every kernel a call "
                      f"launches, summed), the median over {args.reps} passes through {args.caches} independent "
                      f"caches in turn, so that L2 does not hold K and V; graph: the same {args.reps} x "
                      f"{args.caches} calls captured as one CUDA graph (CuPy's stream capture for the rungs, "
                      "torch.cuda.graph for SDPA), one replay timed with events, divided by the calls",
            "caches": args.caches,
            "reps": args.reps,
            "speedup": "vs peer: the peer's time over the rung's (above 1x: the rung is faster)",
        },
        "ceilings": ceilings,
        "targets": {"decode_kernel_us": DECODE_TARGET_US, "long_pct_copy": LONG_TARGET_PCT},
        "parts": [p for p in FEATURE_PARTS if p in args.parts],
        "dtypes": list(args.dtypes),
        "kernels": [p.stem for p in candidates],
        "kernels_named": named,
        "peers": dict(FEATURE_PEER),
        "cases": [{"id": e["id"], "part": e["case"].part, "shape": e["case"].as_dict(), "dtype": e["dtype"],
                   "peer": e["peer"], "kernels": [p.stem for p in e["rungs"]],
                   "flops": shape_flops(e["case"])} for e in plan],
        "seed": args.seed,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }
    path = write_result(result, result_path("features", setup, args.results))
    print("\n" + render_features(result))
    progress(wrote(path))
    return 0
