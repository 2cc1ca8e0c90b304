"""`bench.py frontier`: the Hopper frontier in bfloat16. The shapes where SDPA cuDNN leads the ladder
(the GPT-2 shapes, d=128, grouped-query heads, non-causal), each case checked against float64 and then
timed as `bench.py kernels` times (rungs.bench_shape: CUDA events, L2 flushed, median), the chosen
rungs beside SDPA flash (FlashAttention-2) and SDPA cuDNN in the same run; per shape the best rung's
speed-up over cuDNN, held to the frontier's targets."""

from __future__ import annotations

import time
from pathlib import Path

import kernels

from . import ceilings as precision
from . import device, timing
from .cases import Case, shape_flops
from .device import progress
from .features import declares
from .peers import PEERS
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import announce_and_measure_ceilings, bench_shape
from .tables import fmt_tflops, fmt_x, render_rows_table, setup_header, table

DTYPE = "bfloat16"
CASES = (  # q (B, NH, T, d) over k, v (B, NH_kv, T, d); the part names the mask and heads
    Case("causal", 8, 12, 12, 1024, 1024, 64),
    Case("causal", 16, 12, 12, 2048, 2048, 64),
    Case("causal", 6, 12, 12, 4096, 4096, 64),
    Case("causal", 1, 12, 12, 8192, 8192, 64),
    Case("causal", 2, 32, 32, 4096, 4096, 128),
    Case("gqa", 2, 32, 8, 4096, 4096, 128),
    Case("causal", 1, 16, 16, 16384, 16384, 128),
    Case("noncausal", 4, 16, 16, 2048, 2048, 64, causal=False),
    Case("noncausal", 4, 16, 16, 4096, 4096, 128, causal=False),
)
PEER_NAMES = ("sdpa_flash", "sdpa_cudnn")  # FlashAttention-2 and cuDNN, through torch SDPA
CUDNN = "sdpa_cudnn"
VS_CUDNN = 1.1  # the best rung's speed-up over SDPA cuDNN (cuDNN's time over the rung's) ...
VS_CUDNN_FROM_T = 1024  # ... at every shape with T at least this
TFLOPS_TARGETS = {"1x16x16384-d128": 620.0, "4x16x4096-d128-noncausal": 650.0}  # case id -> the best rung's TFLOP/s at least this
FLOPS = ("causal: 4 * B * NH * T^2 * d / 2 (the mask halves the T x T pairs); non-causal: 4 * B * NH * T^2 * d; "
         "grouped-query heads count every query head; exp and the softmax arithmetic are not counted")


def case_id(case: Case) -> str:
    """'8x12x1024-d64', '2x32x4096-d128-gqa8', '4x16x2048-d64-noncausal': what --shapes takes."""
    return (f"{case.B}x{case.NH}x{case.T_q}-d{case.d}" + (f"-gqa{case.NH_kv}" if case.NH_kv != case.NH else "")
            + ("" if case.causal else "-noncausal"))


def case_title(shape: dict) -> str:
    """'2x32x4096, d128, causal, GQA 8 KV heads': a table's first cell, from a row's shape."""
    mask = "causal" if shape["causal"] else "non-causal"
    gqa = f", GQA {shape['NH_kv']} KV heads" if shape["NH_kv"] != shape["NH"] else ""
    return f"{shape['B']}x{shape['NH']}x{shape['T_q']}, d{shape['d']}, {mask}{gqa}"


def case_ids() -> list[str]:
    return [case_id(c) for c in CASES]


def default_rungs() -> list[Path]:
    """The frontier's rungs: those that load through TMA (lab.tma, v21 on) and, as their baseline, the
    newest bfloat16 rung before them (v19, the fastest of the ladder before TMA); not an FP8 rung
    (lab.fp8), which `bench.py fp8` measures beside them."""
    whole = [(n, kernels.load(n)) for n in kernels.names()]
    bf16 = [(i, n, r) for i, (n, r) in enumerate(whole) if DTYPE in r.dtypes and not r.split_kv and not r.fp8]
    tma = [(i, n) for i, n, r in bf16 if r.tma]
    first = tma[0][0] if tma else len(whole)
    baseline = [n for i, n, r in bf16 if not r.tma and i < first][-1:]
    return [kernels.resolve(n) for n in baseline + [n for _, n in tma]]


def frontier_plan(ids: list[str], candidates: list[Path], named: bool) -> list[dict]:
    """Every chosen case, in table order, with its rungs: named on the command line, every one (those
    that do not take a case are reported unsupported); otherwise those that declare the case."""
    plan = []
    for case in CASES:
        if case_id(case) not in ids:
            continue
        rungs = list(candidates) if named else [p for p in candidates if declares(kernels.load(p), case, DTYPE)]
        plan.append({"id": case_id(case), "case": case, "rungs": rungs})
    return plan


def verdict(case: dict, rows: list[dict], targets: dict) -> dict:
    """One case's outcome from its rows: the fastest correct rung, its TFLOP/s and speed-up over cuDNN,
    and each target as True (met), False (missed) or None (does not apply, or cuDNN was not timed)."""
    ok = [r for r in rows if r["status"] == "ok"]
    timed = [r for r in ok if r["kind"] == "rung"]
    best = min(timed, key=lambda r: r["timing"]["median_ms"], default=None)
    cudnn = next((r for r in ok if r["name"] == CUDNN), None)
    vs = cudnn["timing"]["median_ms"] / best["timing"]["median_ms"] if best and cudnn else None
    applies = case["shape"]["T_q"] >= targets["vs_cudnn_from_T"]
    vs_met = None if not applies or cudnn is None else (vs is not None and vs >= targets["vs_cudnn"])
    floor = targets["tflops"].get(case["id"])
    tflops_met = None if floor is None else (best is not None and best["tflops"] >= floor)
    return {"best": best["name"] if best else None, "best_tflops": best["tflops"] if best else None,
            "vs_cudnn": vs, "vs_cudnn_met": vs_met, "tflops_target": floor, "tflops_met": tflops_met}


def verdicts(result: dict) -> list[tuple[dict, list[dict], dict]]:
    """(case, its rows, its verdict) for every case of a frontier result, in table order."""
    out = []
    for case in result["cases"]:
        rows = [r for r in result["rows"] if r["case"] == case["id"]]
        out.append((case, rows, verdict(case, rows, result["targets"])))
    return out


def mark(met: bool | None, applies: bool = True) -> str:
    if not applies:
        return "-"
    return "n/a" if met is None else ("met" if met else "**missed**")


def render_frontier(result: dict) -> str:
    """The summary table (TFLOP/s per implementation, the best rung's speed-up over cuDNN, the targets
    met or missed), then each case in full as `kernels` prints it."""
    c, m, t = result["ceilings"], result["method"], result["targets"]
    names = result["kernels"] + result["peers"]
    labels = {n: f"`{n}`" for n in result["kernels"]} | {n: PEERS[n].label for n in result["peers"]}
    floors = sorted(set(t["tflops"].values()))
    lines = setup_header(result) + [
        "",
        f"TFLOP/s of each implementation, bfloat16; FLOPs: {result['flop_convention']}. Ceilings measured in the same run: "
        f"{precision.measured(c)}. Times: median of {m['min_runs']}-{m['max_runs']} runs (as many as fit in "
        f"{m['budget_ms']:g} ms) after {m['warmup_runs']} warm-up runs, CUDA events, L2 flushed before each run. "
        f"Every entry was checked against a float64 reference first: {m['tolerance']}; a rung over the bound is "
        "reported wrong and not timed.",
        "",
        f"Targets: the best rung at least {t['vs_cudnn']:g}x SDPA cuDNN (cuDNN's time over the rung's) at every "
        f"shape with T >= {t['vs_cudnn_from_T']}"
        + "".join(f"; at least {v:g} TFLOP/s at {k}" for k, v in t["tflops"].items())
        + ". \"-\": the target does not apply to the shape; n/a: not judged, SDPA cuDNN did not run.",
        "",
    ]
    header = ["shape", *[labels[n] for n in names], "best rung", "vs SDPA cuDNN", f">= {t['vs_cudnn']:g}x cuDNN",
              *[f">= {v:g} TFLOP/s" for v in floors]]
    body, met, judged = [], 0, 0
    for case, rows, v in verdicts(result):
        by_name = {r["name"]: r for r in rows}
        cells = [case_title(case["shape"])]
        for n in names:
            r = by_name.get(n)
            cells.append("-" if r is None else fmt_tflops(r["tflops"]) if r["status"] == "ok" else r["status"])
        cells += [f"`{v['best']}`" if v["best"] else "none", fmt_x(v["vs_cudnn"]),
                  mark(v["vs_cudnn_met"], case["shape"]["T_q"] >= t["vs_cudnn_from_T"])]
        cells += [mark(v["tflops_met"], v["tflops_target"] == floor) for floor in floors]
        body.append(cells)
        for outcome in (v["vs_cudnn_met"], v["tflops_met"]):
            met += outcome is True
            judged += outcome is not None
    lines += table(header, body, "l" + "r" * len(names) + "lrl" + "l" * len(floors))
    lines += ["", f"Targets met: {met} of {judged}."]
    notes = list(dict.fromkeys(f"{r['label']} at {case_title(case['shape'])}: {r['note']}."
                               for case, rows, _ in verdicts(result) for r in rows
                               if r["kind"] == "peer" and r.get("note")))
    lines += [f"\n{n}" for n in notes]
    for case, rows, _ in verdicts(result):
        shown = [r for r in rows if r["status"] != "unsupported"]
        left_out = [f"`{r['name']}`" for r in rows if r["status"] == "unsupported"]
        lines += ["", f"**{case_title(case['shape'])}** ({case['flops'] / 1e9:.1f} GFLOP)"
                      + (f"; left out: {', '.join(left_out)}, which do not take it" if left_out else ""), ""]
        lines += render_rows_table(result, shown)
    return "\n".join(lines)


def cmd_frontier(args) -> int:
    device.require_gpu()
    setup = device.setup_info(args.argv)
    method = timing.Method(budget_ms=args.budget_ms)
    named = args.kernels is not None
    candidates = args.kernels if named else default_rungs()
    plan = frontier_plan(args.shapes or case_ids(), candidates, named)
    peers = list(PEER_NAMES)
    ceilings = announce_and_measure_ceilings(setup, method)
    progress(f"FLOPs: {FLOPS}")
    flush = timing.L2Flush()
    compile_before = kernels.runtime.compile_seconds
    started = time.perf_counter()
    rows, counter = [], [0]
    total = sum(len(entry["rungs"]) + len(peers) for entry in plan)
    for i, entry in enumerate(plan):
        got = bench_shape(entry["case"], DTYPE, entry["rungs"], peers, flush=flush, method=method,
                          ffma_tflops=ceilings["ffma_tflops"], seed=args.seed + i, counter=counter, total=total,
                          interleave=args.interleave)
        for r in got:
            r["case"] = entry["id"]
        rows += got
        device.release_memory()
    precision.annotate(rows, ceilings, candidates)
    targets = {"vs_cudnn": VS_CUDNN, "vs_cudnn_from_T": VS_CUDNN_FROM_T, "tflops": dict(TFLOPS_TARGETS)}
    cases = [{"id": e["id"], "shape": e["case"].as_dict(), "kernels": [p.stem for p in e["rungs"]],
              "flops": shape_flops(e["case"])} for e in plan]
    for case in cases:
        case["verdict"] = verdict(case, [r for r in rows if r["case"] == case["id"]], targets)
    result = {
        "schema": SCHEMA,
        "kind": "frontier",
        "setup": setup,
        "flop_convention": FLOPS,
        "method": method.describe(flush.nbytes) | ({"interleave": timing.INTERLEAVE} if args.interleave else {}),
        "ceilings": ceilings,
        "dtype": DTYPE,
        "kernels": [p.stem for p in candidates],
        "kernels_named": named,
        "peers": peers,
        "compare_to": peers,
        "targets": targets,
        "cases": cases,
        "seed": args.seed,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }
    path = write_result(result, result_path("frontier", setup, args.results))
    print("\n" + render_frontier(result))
    progress(wrote(path))
    return 0
