"""The README's short tables, from the same result files as docs/results.md: per precision class, the
best rung against its peers at the five GPT-2 shapes, the frontier's verdict, with the sweep plots; and
the end-to-end summary.
Every table names the result file behind its numbers as a link relative to the page it is written to."""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

from .cases import GPT2_SHAPES, attention_flops
from .frontier import verdicts
from .peers import PEERS
from .results import E2E_MODELS, e2e_model
from .tables import fmt_ms, fmt_tflops, fmt_x, table


def link(path: Path, base: Path) -> str:
    """A Markdown link to a result file, relative to the folder of the page that shows it."""
    return f"[{path.name}]({Path(os.path.relpath(path, base)).as_posix()})"


def gpt2_shape(B: int, T: int) -> dict:
    return {"B": B, "T": T, "NH": 12, "d": 64}


def gpt2_shapes_in(result: dict) -> list[tuple[int, int]]:
    """The GPT-2 shapes (B, T) a kernels result measured, in GPT2_SHAPES order."""
    return [(B, T) for B, T in GPT2_SHAPES if gpt2_shape(B, T) in result["shapes"]]


def has_gpt2_shapes(result: dict) -> bool:
    return len(gpt2_shapes_in(result)) == len(GPT2_SHAPES)


def best_rung(result: dict) -> tuple[str, float] | None:
    """The fastest rung correct at every GPT-2 shape the result measured (all five, in a default run), by
    the geometric mean of its median times there, with that mean in ms; None if no rung was timed at all."""
    wanted = [gpt2_shape(B, T) for B, T in gpt2_shapes_in(result)]
    times: dict[str, list[float]] = {}
    for r in result["rows"]:
        if r["kind"] == "rung" and r["shape"] in wanted:
            times.setdefault(r["name"], []).append(r["timing"]["median_ms"] if r["status"] == "ok" else math.nan)
    means = [(math.exp(sum(map(math.log, ms)) / len(ms)), name) for name, ms in times.items()
             if wanted and len(ms) == len(wanted) and not any(math.isnan(t) for t in ms)]
    if not means:
        return None
    mean, name = min(means)
    return name, mean


def short_setup(result: dict) -> str:
    """The device and the date, one line: the full header is in docs/results.md."""
    s, dev = result["setup"], result["setup"].get("device")
    where = f"{dev['name']} ({dev['arch']}), CUDA {dev['cuda_runtime']}" if dev else "no device"
    return f"{where}, CuPy {s['cupy'] or '-'}, torch {s['torch'] or '-'}; {s['date'][:10]}, commit {s['git'] or '?'}"


def device_date(result: dict) -> str:
    """The device and the date alone, where the plot's title or docs/results.md gives the rest."""
    return f"{(result['setup'].get('device') or {}).get('name', 'no device')}, {result['setup']['date'][:10]}"


def render_class(path: Path, result: dict, base: Path) -> str | None:
    """One precision class: its best rung's ms and TFLOP/s at each GPT-2 shape the result measured, each
    peer's ms and the peer's time over the rung's; None if no rung is correct at every one of them."""
    best = best_rung(result)
    if best is None:
        return None
    name, mean = best
    peers = result["peers"]
    rows = {(r["name"], r["shape"]["B"], r["shape"]["T"]): r for r in result["rows"] if r["shape"]["NH"] == 12
            and r["shape"]["d"] == 64}
    shapes = gpt2_shapes_in(result)
    body = []
    for B, T in shapes:
        rung = rows[(name, B, T)]
        ms = rung["timing"]["median_ms"]
        cells = [f"{B}x{T}", fmt_ms(ms), fmt_tflops(attention_flops(B, 12, T, 64) / (ms * 1e-3) / 1e12)]
        for p in peers:
            peer = rows.get((p, B, T))
            if peer is not None and peer["status"] == "ok":
                cells += [fmt_ms(peer["timing"]["median_ms"]), fmt_x(peer["timing"]["median_ms"] / ms)]
            else:
                cells += [peer["status"] if peer is not None else "-", "-"]
        body.append(cells)
    labels = [PEERS[p].label for p in peers]
    header = ["B x T", f"`{name}` ms", "TFLOP/s", *[h for label in labels for h in (f"{label} ms", f"vs {label}")]]
    where = "all five GPT-2 shapes" if len(shapes) == len(GPT2_SHAPES) else (
        f"the {len(shapes)} GPT-2 shapes this run measured, without " +
        ", ".join(f"{B}x{T}" for B, T in GPT2_SHAPES if (B, T) not in shapes))
    caption = (f"**{result['dtype']}**: `{name}`, the fastest rung correct at {where} (geometric mean "
               f"{fmt_ms(mean)} ms), against its peers; \"vs\" is the peer's time over the rung's (above 1x: the rung is "
               f"faster). NH=12, d=64, causal. {short_setup(result)}. Results file: {link(path, base)}.")
    return "\n".join([caption, ""] + table(header, body, "lrr" + "rr" * len(peers)))


def render_frontier_line(path: Path, result: dict, base: Path) -> str:
    """The frontier in one paragraph: at how many shapes the best rung reached its speed-up over cuDNN,
    the TFLOP/s targets, and the rung fastest at the most shapes."""
    t, cases = result["targets"], verdicts(result)
    judged = [v["vs_cudnn_met"] for _, _, v in cases if v["vs_cudnn_met"] is not None]
    ratios = [v["vs_cudnn"] for _, _, v in cases if v["vs_cudnn"] is not None]
    spread = f" ({fmt_x(min(ratios))}-{fmt_x(max(ratios))})" if ratios else ""
    parts = [f"the best rung >= {t['vs_cudnn']:g}x SDPA cuDNN at {sum(judged)} of {len(judged)} shapes{spread}"]
    for case, _, v in cases:
        if v["tflops_target"] is not None:
            got = "no rung correct" if v["best_tflops"] is None else f"{fmt_tflops(v['best_tflops'])} TFLOP/s"
            parts.append(f"{got} at {case['id']} (target {v['tflops_target']:g}: {'met' if v['tflops_met'] else 'missed'})")
    fastest = Counter(v["best"] for _, _, v in cases if v["best"]).most_common(1)
    parts += [f"fastest: `{name}` at {n} of {len(cases)}" for name, n in fastest]  # the first of a tie
    return f"**bfloat16 frontier**: {'; '.join(parts)}. {device_date(result)}. Results file: {link(path, base)}."


def render_summary(kernel_results: list[tuple[Path, dict]], sweeps: list[tuple[Path, dict]], base: Path,
                   frontier: tuple[Path, dict] | None = None) -> str:
    """The README's summary: one table per precision class (float32 first), the frontier's verdict, then
    the sweep plots (their JSON is linked beside their tables in docs/results.md)."""
    parts = [text for path, result in kernel_results if (text := render_class(path, result, base))]
    if frontier is not None:
        parts.append(render_frontier_line(*frontier, base))
    for path, result in sweeps:
        image = Path(os.path.relpath(path.parent / result["plot"], base)).as_posix()
        parts.append(f"![TFLOP/s against sequence length, {result['dtype']}]({image})\n\n"
                     f"TFLOP/s against sequence length, {result['dtype']}, d={result['shapes'][0]['d']}: "
                     f"{device_date(result)}.")
    return "\n\n".join(parts)


def render_e2e_summary(no_cache: tuple[Path, dict] | None, decode: tuple[Path, dict] | None, base: Path) -> str:
    """GPT-2 small end to end: without a cache, the best rung's seconds against HF transformers; with the
    KV cache, the fast engine's decode tokens/s per dtype (its faster decode step) against HF's, with the
    target the result carries."""
    body = []
    if no_cache is not None:
        path, result = no_cache
        ok = [r for r in result["rows"] if r["mode"] == "no-cache" and r["status"] == "ok"]
        rungs = sorted((r for r in ok if r["kind"] == "rung"), key=lambda r: r["seconds"])
        hf = next((r for r in ok if r["name"] == "hf"), None)
        if rungs:
            best = rungs[0]
            body.append([f"no cache, float32: seconds for {result['new_tokens']} tokens, `{best['name']}`",
                         f"{best['seconds']:.2f}", f"{hf['seconds']:.2f}" if hf else "-",
                         fmt_x(hf["seconds"] / best["seconds"]) if hf else "-", "-", link(path, base)])
    if decode is not None:
        path, result = decode
        d = result["decode"]
        ok = [r for r in d["rows"] if r["status"] == "ok" and r.get("decode_tokens_per_s")]
        for dtype in dict.fromkeys(r["dtype"] for r in d["rows"]):
            fast = sorted((r for r in ok if r["dtype"] == dtype and r["step"] in d["steps"]),
                          key=lambda r: -r["decode_tokens_per_s"])
            if not fast:
                continue
            best, rate = fast[0], fast[0]["decode_tokens_per_s"]
            hf = next((r for r in ok if r["dtype"] == dtype and r["step"] not in d["steps"]), None)
            target = d.get("targets", {}).get(dtype)
            met = "" if best.get("target_met") is None else (": met" if best["target_met"] else ": missed")
            body.append([f"KV cache, {dtype}: decode tokens/s, {best['label']}", f"{rate:,.0f}",
                         f"{hf['decode_tokens_per_s']:,.0f}" if hf else "-",
                         fmt_x(rate / hf["decode_tokens_per_s"]) if hf else "-",
                         f">= {target:,.0f}{met}" if target else "-", link(path, base)])
    if not body:
        return ""
    results = [r for r in (no_cache, decode) if r is not None]
    caption = ("GPT-2 small, greedy, from the prompt " + repr(results[0][1]["prompt"]) + "; HF transformers "
               "generate() on the same weights in float32. Speed-up: HF's time over ours. "
               + "; ".join(dict.fromkeys(short_setup(r) for _, r in results)) + ".")
    return "\n".join([caption, ""] + table(["GPT-2 small", "this lab", "HF transformers", "speed-up", "target",
                                            "results file"], body, "lrrrll"))


def render_models_summary(entries: list[tuple[Path, dict, set]], base: Path) -> str:
    """The models past GPT-2 end to end (e2e --model): per model and mode, the fastest rung's seconds
    against HF transformers', from the newest result of that mode."""
    parts = []
    for model in dict.fromkeys(e2e_model(result) for _, result, _ in entries):
        body, shown = [], []
        for path, result, modes in (e for e in entries if e2e_model(e[1]) == model):
            for mode in (m for m in ("no-cache", "kv-cache") if m in modes):
                ok = [r for r in result["rows"] if r["mode"] == mode and r["status"] == "ok"]
                rungs = sorted((r for r in ok if r["kind"] == "rung"), key=lambda r: r["seconds"])
                hf = next((r for r in ok if r["name"] == "hf"), None)
                if not rungs:
                    continue
                best = rungs[0]
                body.append([f"{'no cache' if mode == 'no-cache' else 'KV cache'}, {result['dtype']}: seconds for "
                             f"{result['new_tokens']} tokens, `{best['name']}`", f"{best['seconds']:.2f}",
                             f"{hf['seconds']:.2f}" if hf else "-", fmt_x(hf["seconds"] / best["seconds"]) if hf else "-",
                             link(path, base)])
                shown.append(result)
        if not body:
            continue
        caption = (f"{E2E_MODELS[model]}, random weights in {shown[0]['dtype']}, greedy, from a "
                   f"{shown[0]['prompt_tokens']}-token prompt of token ids; HF transformers generate() on the same "
                   "weights (with the KV cache: its static cache). Speed-up: HF's time over ours. "
                   + "; ".join(dict.fromkeys(short_setup(r) for r in shown)) + ".")
        parts.append("\n".join([caption, ""] + table([E2E_MODELS[model], "this lab", "HF transformers", "speed-up",
                                                      "results file"], body, "lrrrl")))
    return "\n\n".join(parts)
