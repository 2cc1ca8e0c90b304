"""`bench.py backward`: every backward rung (kernels/backward/) beside SDPA's backward in the same run, at
the GPT-2 shapes (causal, NH=12, d=64), at d=128 and without the mask. Each case runs a forward rung that
writes the log-sum-exp, then every backward rung and SDPA's backward once, checks each one's gradients
against float64 (FlashAttention's rule, as tests/test_backward_gpu.py), and times what is right: the
rung's kernels, or SDPA's backward alone through torch.autograd.grad on a retained graph. A rung with a
deterministic configuration (lab.deterministic) is run a second time with deterministic=True, a row of its
own right after the rung's, so that the cost of summing dQ in a fixed order is measured beside it."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import numpy as np

import kernels
from kernels import backward as backward_ladder
from kernels.backward import launcher

from . import device, timing
from .cases import EPS, GPT2_SHAPES, Case, Inputs, _round_to, shape_flops
from .device import first_line, progress
from .peers import PEERS, sdpa_launch, torch_stream
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import add_speedups
from .tables import clocked, fmt_ms, fmt_tflops, fmt_x, setup_header, sm_clock, table

CASE_SETS = {  # --cases key -> the cases, each q (B, NH, T, d) over k, v (B, NH_kv, T, d)
    "gpt2": tuple(Case("gpt2", B, 12, 12, T, T, 64) for B, T in GPT2_SHAPES),
    "d128": (Case("d128", 4, 16, 16, 2048, 2048, 128), Case("d128", 2, 16, 16, 4096, 4096, 128)),
    "noncausal": (Case("noncausal", 4, 12, 12, 2048, 2048, 64, causal=False),
                  Case("noncausal", 4, 16, 16, 2048, 2048, 128, causal=False)),
    # grouped-query heads as Llama 3's: 32 query heads over 8 key/value heads, d = 128
    "gqa": (Case("gqa", 2, 32, 8, 4096, 4096, 128), Case("gqa", 2, 32, 8, 4096, 4096, 128, causal=False)),
    # FlashAttention-3's backward shapes: d = 128, non-causal, 16k tokens a batch, 4k to 16k long
    "long": tuple(Case("long", 16384 // T, 16, 16, T, T, 128, causal=False) for T in (4096, 8192, 16384)),
}
DEFAULT_CASES = ("gpt2", "d128", "noncausal")  # gqa and long when asked: d = 128's largest, for the bf16 rungs
PEERS_OF = {"float32": ("sdpa_efficient",), "bfloat16": ("sdpa_flash", "sdpa_cudnn"),
            "float16": ("sdpa_flash", "sdpa_cudnn")}
TARGETS = {  # dtype -> [(peer, speed-up at least, the cases it applies to, in words)]
    "float32": [("sdpa_efficient", 1.5, lambda s: s["part"] == "gpt2" and s["T_q"] >= 1024,
                 "every GPT-2 shape with T >= 1024")],
    "bfloat16": [("sdpa_cudnn", 1.0, lambda s: s["T_q"] >= 2048, "every case with T >= 2048"),
                 ("sdpa_cudnn", 1.2, lambda s: s["d"] == 128 and not s["causal"] and s["T_q"] >= 4096,
                  "d=128 without the mask, T >= 4096 (where FlashAttention-3 leads cuDNN)")],
}
FLOP_CONVENTION = ("backward = 2.5 x the forward's FLOPs, the forward's counted as the kernels table does (4 d per "
                   "(query, key) pair the mask lets through: 4 * B * NH * T^2 * d / 2 causal, without the / 2 "
                   "non-causal): five T x T x d products to the forward's two; exp and the softmax arithmetic are "
                   "not counted")
TOLERANCE = ("each gradient's max |grad - grad64| <= the rung's lab.tolerance (3: FlashAttention's rule) x "
             "max(max |plain - grad64|, eps(dtype) x max |grad64|), plain the same forward and backward in plain "
             "array code in the dtype, grad64 in float64")


def backward_flops(case: Case) -> float:
    """FLOP_CONVENTION: 2.5 x the forward's count at this case."""
    return 2.5 * shape_flops(case)


def rungs_for(dtype: str, names: list[str] | None = None) -> list[str]:
    """The backward rungs to run: those named, else every one that declares the dtype (not one declared
    lab.unverified: not yet run on a GPU)."""
    if names is not None:
        return names
    return [n for n in backward_ladder.default_names() if dtype in backward_ladder.load(n).dtypes]


def entries(case: Case, dtype: str, rungs: list[str]) -> list[tuple[str, bool]]:
    """(rung, deterministic) in the order they run: each rung, then, where it declares for the case's d and
    dtype both a deterministic configuration and another, the same rung with deterministic=True."""
    out = []
    for name in rungs:
        out.append((name, False))
        rung = backward_ladder.load(name)
        found = rung.configs_for(case.d, dtype) if dtype in rung.dtypes else []
        if {rung.is_deterministic(c) for c in found} == {False, True}:
            out.append((name, True))
    return out


def forward_rung(case: Case, dtype: str, arch: str) -> str | None:
    """The newest forward rung that writes the log-sum-exp and takes the case, dtype and device."""
    for name in reversed(kernels.names()):
        rung = kernels.load(name)
        if (rung.lse and not rung.unverified and dtype in rung.dtypes and case.d in rung.head_sizes() and rung.runs_on(arch)
                and case.needs() <= set(rung.supports)):
            return name
    return None


def check_gradients(case: Case, inputs: Inputs, do32, outputs: dict[str, tuple]) -> dict:
    """Every implementation's (dq, dk, dv) against the float64 gradients of the same q, k, v, do, with the
    plain implementation's (kernels.reference_attention_backward in the dtype, after its own forward)
    beside them; over chunks of K/V heads (each with its query heads) so that the float64 score matrices
    fit in memory at any shape."""
    cupy = device.get_cupy()
    names = ("dq", "dk", "dv")
    worst = {n: dict.fromkeys(names, 0.0) for n in outputs}
    plain_err, ref_max = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    group = case.NH // case.NH_kv
    per_kv_head = 96 * group * case.T_q * case.T_k  # ~8 float64 and 8 float32 (T_q x T_k) temporaries a query head
    chunk = int(max(1, min(case.NH_kv, min(0.4 * device.free_memory(), 8 * 2**30) // per_kv_head)))
    low = inputs.qkv[0].dtype if inputs.qkv is not None else np.float32
    for start in range(0, case.NH_kv, chunk):
        kv = slice(start, min(case.NH_kv, start + chunk))
        qh = slice(kv.start * group, kv.stop * group)
        q, do, k, v = inputs.q32[:, qh], do32[:, qh], inputs.k32[:, kv], inputs.v32[:, kv]
        truth = kernels.reference_attention_backward(*(x.astype(cupy.float64) for x in (q, k, v)), None, None,
                                                     do.astype(cupy.float64), causal=case.causal)
        plain = kernels.reference_attention_backward(*(x.astype(low) for x in (q, k, v)), None, None, do.astype(low),
                                                     causal=case.causal)
        for g, t, p in zip(names, truth, plain):
            plain_err[g] = max(plain_err[g], float(cupy.abs(p.astype(cupy.float64) - t).max()))
            ref_max[g] = max(ref_max[g], float(cupy.abs(t).max()))
        del plain
        for name, grads in outputs.items():
            for g, t, x, heads in zip(names, truth, grads, (qh, kv, kv)):
                err = float(cupy.abs(as_cupy(x)[:, heads].astype(cupy.float64) - t).max())
                worst[name][g] = math.inf if math.isnan(err) else max(worst[name][g], err)
        del truth
        device.release_memory()
    floor = {g: max(plain_err[g], EPS[inputs.dtype] * ref_max[g]) for g in names}
    return {"plain_err": plain_err, "floor": floor, "max_err": worst}


def as_cupy(x):
    """A rung's CuPy array as it is; a torch tensor as a float32 CuPy array (DLPack)."""
    cupy = device.get_cupy()
    return x if isinstance(x, cupy.ndarray) else cupy.from_dlpack(x.detach().float().contiguous())


def sdpa_backward(peer_name: str, inputs: Inputs, do32, case: Case):
    """(grads, launch): SDPA's forward once under the peer's backend on leaf tensors, and a launch that runs
    its backward alone, torch.autograd.grad on the retained graph; Unavailable where it cannot run."""
    torch = device.get_torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    peer = PEERS[peer_name]
    q, k, v = (x.detach().clone().requires_grad_(True) for x in inputs.torch_qkv())
    do = torch.from_dlpack(do32).to(q.dtype)
    with sdpa_kernel([getattr(SDPBackend, peer.backend)]):
        out = sdpa_launch(torch, peer, q, k, v, case)()

    def launch():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return launch(), launch


def bench_case(case: Case, dtype: str, rungs: list[str], peers: list[str], *, flush, method, seed: int,
               arch: str, counter: list[int], total: int, interleave: bool = False) -> list[dict]:
    """Rows for one case: every backward rung, then every peer; each checked, then timed if right (with
    `interleave` the rungs together, timing.time_together; the peers one by one)."""
    cupy = device.get_cupy()
    label = f"{case.label} (NH={case.NH}, d={case.d}, {'causal' if case.causal else 'non-causal'})"
    progress(f"{label}, {dtype}: a forward rung, then {len(rungs)} backward rungs and {len(peers)} peers once, "
             "checked against float64 ...")
    inputs = Inputs(case, dtype, seed)
    do32 = _round_to(cupy.random.default_rng(seed + 1).standard_normal((case.B, case.NH, case.T_q, case.d),
                                                                        dtype=cupy.float32), dtype)
    flops = backward_flops(case)
    rows, launches, outputs = [], {}, {}

    def row(name, kind, **more):
        r = {"shape": case.as_dict(), "dtype": dtype, "name": name, "kind": kind, "status": None, "flops": flops,
             "label": PEERS[name].label if kind == "peer" else name} | more
        rows.append(r)
        return r

    def rung_row(rung, deterministic, **more):  # a deterministic run: a variant of the rung's row
        variant = {"variant_of": rung, "deterministic": True} if deterministic else {}
        return row(f"{rung} deterministic" if deterministic else rung, "rung", **variant, **more)

    forward, why = forward_rung(case, dtype, arch), inputs.rung_inputs_problem
    if forward is None:
        why = why or f"no forward rung writes the log-sum-exp for {dtype}, d={case.d} here"
    elif why is None:
        q, k, v = inputs.qkv
        try:
            o, lse = kernels.attention(q, k, v, kernel=forward, causal=case.causal, return_lse=True)
        except Exception as exc:
            why = f"the forward rung {forward} failed: {first_line(exc)}"
    if why is not None:
        for rung, deterministic in entries(case, dtype, rungs):
            rung_row(rung, deterministic, status="unsupported", reason=why)
    else:
        do = do32.astype(q.dtype)
        for rung, deterministic in entries(case, dtype, rungs):
            r = rung_row(rung, deterministic, forward=forward)
            try:
                run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=rung, causal=case.causal,
                                                deterministic=deterministic)
                for g in run():
                    g.fill(np.nan)  # poison: an element the rung does not write fails the check
                outputs[r["name"]] = run()
                cupy.cuda.Device().synchronize()
                r["config"] = run.instance.describe()
                launches[r["name"]] = (run, cupy.cuda.get_current_stream())
            except (TypeError, ValueError) as exc:  # the rung does not take this case
                r["status"], r["reason"] = "unsupported", first_line(exc)
            except Exception as exc:
                r["status"], r["reason"] = "error", first_line(exc)
    for name in peers:
        r = row(name, "peer")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                outputs[name], launch = sdpa_backward(name, inputs, do32, case)
                launches[name] = (launch, torch_stream(cupy, device.get_torch()))
            except device.Unavailable as exc:
                r["status"], r["reason"] = "unavailable", str(exc)
            except Exception as exc:  # a backend that refuses this dtype or shape, out of memory
                r["status"], r["reason"] = "unavailable", first_line(exc)
                device.release_memory()

    if outputs:
        check = check_gradients(case, inputs, do32, outputs)
        for r in rows:
            if r["name"] in outputs:
                inst = launches[r["name"]][0].instance if r["kind"] == "rung" else None
                factor = inst.rung.tolerance_factor(inst.config) if inst is not None else None
                r |= {"max_err": check["max_err"][r["name"]], "plain_err": check["plain_err"]}
                if factor is not None:
                    r["bound"] = {g: factor * f for g, f in check["floor"].items()}
                    over = [g for g, e in r["max_err"].items() if not e <= r["bound"][g]]
                    if over:
                        r["status"] = "wrong"
                        r["reason"] = "; ".join(f"{g} max error {r['max_err'][g]:.2e} > bound {r['bound'][g]:.2e}"
                                                for g in over)
    outputs.clear()
    device.release_memory()

    together = [r for r in rows if r["status"] is None and r["kind"] == "rung"] if interleave else []
    for r, t in zip(together, timing.time_together([launches[r["name"]] for r in together], flush=flush,
                                                   method=method, label=case.label, what="rungs") or []):
        r["timing"] = t
    for r in rows:
        counter[0] += 1
        where = f"[{counter[0]:>3}/{total}] {case.label:>16} {r['label']:<18}"
        if r["status"] is None:
            launch, stream = launches[r["name"]]
            try:
                if "timing" not in r:  # not timed together above
                    cupy.cuda.Device().synchronize()
                    r["timing"] = timing.time_gpu(launch, stream=stream, flush=flush, method=method)
                r["status"] = "ok"
                r["tflops"] = flops / (r["timing"]["median_ms"] * 1e-3) / 1e12
            except Exception as exc:
                r["status"], r["reason"] = "error" if r["kind"] == "rung" else "unavailable", first_line(exc)
        if r["status"] == "ok":
            progress(f"{where} {r['timing']['median_ms']:10.4f} ms {r['tflops']:8.2f} TFLOP/s  "
                     f"err {max(r['max_err'].values()):.1e}")
        else:
            progress(f"{where} {r['status']}: {r.get('reason', '')}")
        device.release_memory()
    add_speedups(rows)
    return rows


def cmd_backward(args) -> int:
    device.require_gpu()
    setup = device.setup_info(args.argv)
    method = timing.Method(budget_ms=args.budget_ms)
    dev = setup["device"]
    progress(f"{dev['name']} ({dev['arch']}, {dev['sm_count']} SMs), driver {dev['driver']}, CUDA "
             f"{dev['cuda_runtime']}, CuPy {setup['cupy']}, torch {setup['torch']}")
    rungs = rungs_for(args.dtype, args.kernels)
    peers = list(PEERS_OF[args.dtype] if args.peers is None else args.peers)
    cases = [c for key in args.cases for c in CASE_SETS[key]]
    flush = timing.L2Flush()
    compile_before = kernels.runtime.compile_seconds
    rows, counter, started = [], [0], time.perf_counter()
    total = sum(len(entries(case, args.dtype, rungs)) + len(peers) for case in cases)
    for i, case in enumerate(cases):
        rows += bench_case(case, args.dtype, rungs, peers, flush=flush, method=method, seed=args.seed + i,
                           arch=dev["arch"], counter=counter, total=total, interleave=args.interleave)
    result = {
        "schema": SCHEMA, "kind": "backward", "setup": setup, "flop_convention": FLOP_CONVENTION,
        "method": method.describe(flush.nbytes) | ({"interleave": timing.INTERLEAVE} if args.interleave else {}) | {
            "tolerance": TOLERANCE,
            "timed": "a backward rung: all its kernels (preprocessing, dK and dV, dQ's conversion); SDPA: "
                     "torch.autograd.grad(out, (q, k, v), do, retain_graph=True) on one forward, its backward "
                     "kernels alone"},
        "dtype": args.dtype, "cases": [c.as_dict() for c in cases], "kernels": rungs, "peers": peers,
        "seed": args.seed, "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started, "rows": rows,
    }
    path = write_result(result, result_path("backward", setup, args.results))
    print("\n" + render_backward(result))
    progress(wrote(path))
    return 0


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------


def case_title(shape: dict, dtype: str) -> str:
    mask = "causal" if shape["causal"] else "non-causal"
    gflop = backward_flops(Case(**shape)) / 1e9
    heads = f"NH={shape['NH']}" + (f", NH_kv={shape['NH_kv']}" if shape["NH_kv"] != shape["NH"] else "")
    return (f"**B={shape['B']}, T={shape['T_q']}** ({heads}, d={shape['d']}, {mask}, {dtype}, "
            f"{gflop:.1f} GFLOP)")


def targets(result: dict) -> list[str]:
    """One line per target of the result's dtype whose cases the run has: the ladder's best at each case
    (the fastest rung that ran it: a rung may take only some head sizes), its speed-up over the peer at
    the worst of those cases, met or missed."""
    return [line for target in TARGETS.get(result["dtype"], []) for line in target_line(result, *target)]


def target_line(result: dict, peer: str, at_least: float, applies, where: str) -> list[str]:
    cases = [s for s in result["cases"] if applies(s)]
    if not cases:
        return []
    label = PEERS[peer].label
    best = []  # per case: (speed-up, rung, case)
    for s in cases:
        ran = [(r["speedup"][peer], r["name"]) for r in result["rows"]
               if r["shape"] == s and r["name"] in result["kernels"] and r["speedup"].get(peer) is not None]
        if not ran:
            return [f"Target: at least {at_least:g}x {label}'s backward at {where}: no rung ran "
                    f"{s['B']}x{s['NH']}x{s['T_q']}, d={s['d']}."]
        best.append((*max(ran), s))
    x, name, s = min(best, key=lambda b: b[0])
    verdict = "met" if x >= at_least else "missed"
    return [f"Target: at least {at_least:g}x {label}'s backward at {where}: the fastest rung at each case, at worst "
            f"{fmt_x(x)} (`{name}` at {s['B']}x{s['NH']}x{s['T_q']}, d={s['d']}): {verdict}."]


def render_backward(result: dict) -> str:
    m = result["method"]
    peers = result["peers"]
    lines = setup_header(result) + [
        "",
        f"FLOP convention: {result['flop_convention']}.",
        "",
        f"Times: median of {m['min_runs']}-{m['max_runs']} runs (as many as fit in {m['budget_ms']:g} ms) after "
        f"{m['warmup_runs']} warm-up runs, CUDA events, L2 flushed before each run; spread p20-p80. Timed: {m['timed']}. "
        "Speed-ups are the other's median over this one's (above 1x: this one is faster). The rungs' o and lse come "
        "from the forward rung named in the note; a rung's deterministic run (deterministic=True: dQ summed in a fixed "
        "order), where it has one, is the row after it, and its \"vs previous\" is against that rung's row: the cost of "
        "the fixed order. Every output was checked against float64 first: "
        f"{m['tolerance']}; a rung over it is reported wrong and not timed, a peer's error is shown as it is.",
    ]
    lines += [line for target in targets(result) for line in ("", target)]
    left_out = sorted({r["name"] for r in result["rows"] if r["status"] == "unsupported"})
    if left_out:
        lines += ["", "Not run: " + "; ".join(
            f"`{n}` ({next(r['reason'] for r in result['rows'] if r['name'] == n and r['status'] == 'unsupported')})"
            for n in left_out) + "."]
    clock = clocked(result["rows"])  # an SM MHz column where the run read the clock (benchmarks.clocks)
    header = ["kernel", "ms", "p20-p80", "TFLOP/s", *(["SM MHz"] if clock else []), "vs previous",
              *[f"vs {PEERS[p].label}" for p in peers], "max error dq / dk / dv", "note"]
    for shape in result["cases"]:
        body = []
        for r in (r for r in result["rows"] if r["shape"] == shape and r["status"] != "unsupported"):
            name = (r["label"] if r["kind"] != "rung" else f"`{r['variant_of']}` deterministic" if r.get("variant_of")
                    else f"`{r['name']}`")
            errors = " / ".join(f"{r['max_err'][g]:.1e}" for g in ("dq", "dk", "dv")) if r.get("max_err") else "-"
            if r["status"] == "ok":
                t = r["timing"]
                note = "; ".join(x for x in (r.get("config"), f"forward {r['forward']}" if r.get("forward") else None) if x)
                body.append([name, fmt_ms(t["median_ms"]), f"{fmt_ms(t['p20_ms'])}-{fmt_ms(t['p80_ms'])}",
                             fmt_tflops(r["tflops"]), *([sm_clock(r)] if clock else []), fmt_x(r["speedup"].get("previous")),
                             *[fmt_x(r["speedup"].get(p)) for p in peers], errors, note])
            else:
                body.append([name, f"**{r['status']}**", "-", "-", *(["-"] if clock else []), "-", *["-" for _ in peers],
                             errors, r.get("reason", "")])
        lines += ["", case_title(shape, result["dtype"]), ""] + table(
            header, body, "lrrr" + ("r" if clock else "") + "r" + "r" * len(peers) + "rl")
    return "\n".join(lines)


def newest_per_dtype(paths: list[Path], load) -> list[tuple[Path, dict]]:
    """The newest backward result of each dtype (paths newest first), float32 first."""
    newest: dict[str, tuple[Path, dict]] = {}
    for p in paths:
        result = load(p)
        newest.setdefault(result["dtype"], (p, result))
    return [newest[t] for t in sorted(newest, key=lambda t: (t != "float32", t))]
