"""The Markdown tables, in the terminal and in docs/results.md alike: each headed by the setup that
produced it (device, driver, CUDA, versions, date, commit, command)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from . import ceilings
from .cases import Case, attention_flops, attention_flops_qk
from .peers import PEERS
from .results import E2E_MODELS, e2e_model


def fmt_ms(x: float) -> str:
    """Four significant digits, zeros kept (0.01723, 1.200, 12.34, 123.4)."""
    digits = max(0, 3 - math.floor(math.log10(x))) if x > 0 else 4
    return f"{x:.{digits}f}"


def fmt_tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(header: list[str], rows: list[list], align: str) -> list[str]:
    """A Markdown table; `align` is one letter per column, l or r."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def setup_header(result: dict) -> list[str]:
    """Device, driver, CUDA, versions, date, commit and command: above every table."""
    s = result["setup"]
    dev = s.get("device")
    if dev:
        where = (f"**{dev['name']}** ({dev['arch']}, {dev['sm_count']} SMs, {dev['memory_bytes'] / 2**30:.0f} GiB), "
                 f"driver {dev['driver'] or '?'} (CUDA {dev['driver_cuda']}), CUDA runtime {dev['cuda_runtime']}")
    else:
        where = f"compiled for {result.get('arch', '?')} with NVRTC {result.get('nvrtc', '?')}, no device"
    libs = f"CuPy {s['cupy'] or '-'}, torch {s['torch'] or 'not installed'}"
    if result["kind"] == "e2e":
        libs += f", transformers {s['transformers'] or 'not installed'}"
    date = s["date"].replace("T", " ").replace("Z", " UTC")
    return [f"{where}; {libs}; {date}, commit {s['git'] or '?'}.", "", f"Command: `{s['command']}`"]


def _label(r: dict) -> str:
    return f"`{r['name']}`" if r["kind"] == "rung" else r["label"]


def clocked(rows: list[dict]) -> bool:
    """Whether any of the rows read the SM clock (files before benchmarks.clocks have none): the tables
    show an SM MHz column only then."""
    return any((r.get("timing") or {}).get("sm_clock") for r in rows)


def sm_clock(row: dict) -> str:
    """The SM clock's median over a row's timed runs (benchmarks.clocks), or "-" where it was not read."""
    clock = (row.get("timing") or {}).get("sm_clock")
    return f"{clock['median_mhz']:,.0f}" if clock else "-"


def render_rows_table(result: dict, rows: list[dict]) -> list[str]:
    """One shape's rows; with a column of the SM clock (MHz, median over the timed runs) where the run read
    it (files before benchmarks.clocks have none)."""
    compare = result["compare_to"]
    clock = clocked(rows)
    header = ["kernel", "ms", "p20-p80", "TFLOP/s", "% of ceiling", *(["SM MHz"] if clock else []), "vs previous",
              *[f"vs {PEERS[c].label}" for c in compare], "max error", "note"]
    body = []
    for r in rows:
        if r["status"] == "ok":
            t = r["timing"]
            pct = ceilings.pct_of_ceiling(r, result["ceilings"])
            body.append([_label(r), fmt_ms(t["median_ms"]), f"{fmt_ms(t['p20_ms'])}-{fmt_ms(t['p80_ms'])}", fmt_tflops(r["tflops"]),
                         "-" if pct is None else f"{pct:.1f}%", *([sm_clock(r)] if clock else []),
                         fmt_x(r["speedup"].get("previous")), *[fmt_x(r["speedup"].get(c)) for c in compare],
                         f"{r['max_err']:.1e}" if r.get("max_err") is not None else "-", r.get("config", "")])
        else:
            err = f"{r['max_err']:.1e}" if r.get("max_err") is not None else "-"
            body.append([_label(r), f"**{r['status']}**", "-", "-", "-", *(["-"] if clock else []), "-",
                         *["-" for _ in compare], err, r.get("reason", "")])
    return table(header, body, "lrrrr" + ("r" if clock else "") + "rr" + "r" * len(compare) + "l")


def render_kernels(result: dict) -> str:
    c, m = result["ceilings"], result["method"]
    lines = setup_header(result) + [
        "",
        f"FLOP convention: {result['flop_convention']}. Ceilings measured in the same run: {ceilings.measured(c)}; "
        f"device copy {c['copy_tbps']:.2f} TB/s ({c['copy_what']}).",
        "",
        ceilings.describe([r for r in result["rows"] if r["status"] != "unsupported"], c),
        "",
        f"Times: median of {m['min_runs']}-{m['max_runs']} runs (as many as fit in {m['budget_ms']:g} ms) after "
        f"{m['warmup_runs']} warm-up runs, CUDA events, L2 flushed before each run; spread p20-p80. Speed-ups are the other's median over this "
        "one's (above 1x: this one is faster). Every rung was checked against a float64 reference first: "
        f"{m['tolerance']}.",
    ]
    left_out = sorted({r["name"] for r in result["rows"] if r["status"] == "unsupported"})
    if left_out:
        lines += ["", f"Left out: {', '.join(f'`{n}`' for n in left_out)}, which do not take {result['dtype']}."]
    for shape in result["shapes"]:
        rows = [r for r in result["rows"] if r["shape"] == shape and r["status"] != "unsupported"]
        flops = attention_flops(shape["B"], shape["NH"], shape["T"], shape["d"])
        lines += ["", f"**B={shape['B']}, T={shape['T']}** (NH={shape['NH']}, d={shape['d']}, {result['dtype']}, "
                      f"{flops / 1e9:.1f} GFLOP)", ""]
        lines += render_rows_table(result, rows)
    return "\n".join(lines)


def render_sweep(result: dict, image: str | None = None) -> str:
    c = result["ceilings"]
    lines = setup_header(result) + [
        "",
        f"TFLOP/s ({result['flop_convention']}) against T, with B = {result['tokens']} // T (at least 1), "
        f"NH={result['shapes'][0]['NH']}, d={result['shapes'][0]['d']}, {result['dtype']}. Ceilings measured in the "
        f"same run: {ceilings.measured(c)}. Median of many runs, CUDA events, L2 flushed.",
    ]
    if image:
        lines += ["", f"![TFLOP/s against sequence length]({image})"]
    unsupported = {r["name"] for r in result["rows"] if r["status"] == "unsupported"}
    names = [n for n in result["kernels"] if n not in unsupported] + result["peers"]  # rungs that take the dtype
    labels = {r["name"]: _label(r) for r in result["rows"]}
    body = []
    for shape in result["shapes"]:
        by_name = {r["name"]: r for r in result["rows"] if r["shape"] == shape}
        cells = []
        for n in names:
            r = by_name.get(n)
            cells.append("-" if r is None else fmt_tflops(r["tflops"]) if r["status"] == "ok" else r["status"])
        body.append([str(shape["T"]), str(shape["B"]), *cells])
    return "\n".join(lines + [""] + table(["T", "B", *[labels.get(n, n) for n in names]], body,
                                          "rr" + "r" * len(names)))


def render_e2e(entries: list[tuple[Path, dict, set]], base: Path) -> str:
    """One block per result file, each with the modes it contributes."""
    out = []
    for path, result, modes in entries:
        lines = setup_header(result) + [
            "",
            f"{result['new_tokens']} new tokens after the {result['prompt_tokens']}-token prompt {_prompt(result)}; "
            f"{E2E_MODELS[e2e_model(result)]} with {result['model']}, {result['dtype']}, greedy. No cache: "
            f"{result['method']['no-cache']}. KV cache: {result['method']['kv-cache']}. HF peer: "
            f"{result['method']['hf']}. Peak memory: what each framework's allocator held at most, weights included.",
        ]
        if result.get("plot"):
            image = os.path.relpath(path.parent / result["plot"], base)
            lines += ["", f"![elapsed time against tokens generated]({image})"]
        body = []
        for r in result["rows"]:
            if r["mode"] not in modes:
                continue
            if r["status"] == "ok":
                body.append([_label(r), r["mode"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
                             f"{r['ms_per_token']:.2f}", _bytes(r["peak_bytes"]), fmt_x(r.get("speedup_vs_reference")),
                             str(r.get("same_tokens_as_reference", "-"))])
            else:
                body.append([_label(r), r["mode"], f"**{r['status']}**", "-", "-", "-", "-", r.get("reason", "")])
        lines += [""] + table(["attention", "mode", "seconds", "tokens/s", "ms/token", "peak memory",
                               "vs reference", "leading tokens equal to the reference's"], body, "llrrrrrr")
        if result.get("decode") and "kv-cache" in modes:
            lines += ["", render_decode(result["decode"])]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _prompt(result: dict) -> str:
    """The prompt as text (GPT-2), or as token ids with why (random Llama weights have no tokenizer)."""
    if isinstance(result["prompt"], str):
        return repr(result["prompt"])
    return f"of token ids {','.join(map(str, result['prompt']))} ({result['method']['prompt']})"


def render_decode(d: dict) -> str:
    """The KV-cache decode table of an e2e result."""
    steps = "; ".join(f"{k}: {v}" for k, v in d["steps"].items())
    lines = [f"**Decode with the KV cache**, same run: {d['method']} Decode steps: {steps}. Copy ceiling "
             f"measured in the run: {d['copy_tbps']:.2f} TB/s. Targets: "
             + ", ".join(f"{dtype} {rate:,.0f} tokens/s" for dtype, rate in d["targets"].items()) + "."]
    body = []
    for r in d["rows"]:
        if r["status"] != "ok":
            body.append([r["dtype"], r["label"], f"**{r['status']}**", "-", "-", "-", "-", r.get("reason", "")])
            continue
        rate = r.get("decode_tokens_per_s")
        body.append([r["dtype"], r["label"], f"{r['ttft_ms']:.1f}", f"{rate:,.0f}" if rate else "-",
                     f"{1e6 / rate:.0f}" if rate else "-",
                     f"{r['weight_tbps']:.2f} ({r['pct_copy']:.0f}%)" if rate else "-", _met(r), r.get("note") or ""])
    return "\n".join(lines + [""] + table(["dtype", "generation", "first token ms", "decode tokens/s", "us/token",
                                           "weights TB/s (% of copy)", "target", "note"], body, "llrrrrll"))


def render_resources(result: dict) -> str:
    lines = setup_header(result) + ["", "Registers, stack and spills from ptxas (NVRTC -Xptxas=-v) for "
                                        f"{result['arch']}; blocks per SM from the CUDA occupancy calculator "
                                        "where a device was present.", ""]
    body = []
    for r in result["rows"]:
        config = ", ".join(f"{k}={v}" for k, v in r.get("config", {}).items())
        if "error" in r:
            body.append([f"`{r['kernel']}`", config, "**error**", "-", "-", "-", "-", "-", r["error"]])
            continue
        blocks = "-" if r.get("blocks_per_sm") is None else str(r["blocks_per_sm"])
        body.append([f"`{r['kernel']}`", config, str(r["threads"]), str(r["registers"]),
                     f"{r['static_smem']} + {r['dynamic_smem']}", str(r["stack_bytes"]),
                     f"{r['spill_stores']} / {r['spill_loads']}", blocks, "; ".join(r.get("performance_warnings", ()))])
    lines += table(["kernel", "config", "threads", "registers", "smem bytes (static + dynamic)", "stack bytes",
                    "spill bytes (stores / loads)", "blocks / SM", "note"], body, "llrrrrrrl")
    return "\n".join(lines)


def _status_cells(r: dict, n: int) -> list[str]:
    """A row that was not timed: its status in the first of `n` cells, dashes after."""
    return [f"**{r['status']}**"] + ["-"] * (n - 1)


def _err(r: dict) -> str:
    return f"{r['max_err']:.1e}" if r.get("max_err") is not None else "-"


def _note(r: dict) -> str:
    if r["status"] != "ok":
        return r.get("reason", "")
    return "; ".join(x for x in (r.get("config"), r.get("note"), r.get("kernel_reason"), r.get("graph_reason")) if x)


def _met(r: dict) -> str:
    return "-" if r.get("target_met") is None else ("met" if r["target_met"] else "missed")


def _peer_notes(rows: list[dict]) -> list[str]:
    return [f"{r['label']} ({r['dtype']}): {r['note']}." for r in rows if r["kind"] == "peer" and r.get("note")]


def render_features(result: dict) -> str:
    """The features tables: decode, long-context decode, then one table per general-feature case."""
    c, m, t = result["ceilings"], result["method"], result["targets"]
    peers = result["peers"]
    by_case = {}
    for r in result["rows"]:
        by_case.setdefault(r["case"], []).append(r)
    cases = [dict(e, rows=by_case.get(e["id"], [])) for e in result["cases"]]
    vs = "vs SDPA"
    lines = setup_header(result) + [
        "",
        "Every entry was checked against a float64 reference on the same inputs before it was timed: "
        f"{m['tolerance']}; a rung over the bound is reported wrong and not timed. Peers, on the same inputs: "
        + ", ".join(f"{d} against {PEERS[p].label}" for d, p in peers.items())
        + f" (torch.nn.attention.sdpa_kernel). \"{vs}\" is the peer's time over the rung's (above 1x: the rung is "
        "faster). " + ("Rungs: those named on the command line, in every case (those that do not take a case are "
                       "reported unsupported)." if result.get("kernels_named") else
                       "Rungs: each rung that declares the case's features, head size and dtype (lab.supports, "
                       "lab.dtypes); for decode the split-KV rungs and, for context, the newest other rung."),
    ]
    decode = [e for e in cases if e["part"] == "decode"]
    if decode:
        d0 = decode[0]["shape"]
        lines += ["", f"**GPT-2 decode** (B={d0['B']}, NH={d0['NH']}, d={d0['d']}, one query over T_k keys; the "
                      f"bottom-right causal mask hides nothing from it). {m['decode'][:1].upper()}{m['decode'][1:]}. "
                      f"Target: kernel time <= {t['decode_kernel_us']:g} us per call."]
        header = ["T_k", "kernel", "kernel us", "p20-p80", "us per call in a graph",
                  f"target <= {t['decode_kernel_us']:g} us", "K+V TB/s", vs, "max error", "note"]
        for dtype in dict.fromkeys(e["dtype"] for e in decode):
            body = []
            for e in (e for e in decode if e["dtype"] == dtype):
                for r in e["rows"]:
                    first = [str(e["shape"]["T_k"]), _label(r)]
                    kt = r.get("kernel_timing") or {}
                    if r["status"] == "ok":
                        spread = (f"{fmt_ms(kt['p20_us'])}-{fmt_ms(kt['p80_us'])}" if "p20_us" in kt else kt.get(
                            "statistic", "-"))
                        body.append(first + [
                            fmt_ms(r["kernel_us"]) if r.get("kernel_us") else "n/a", spread,
                            fmt_ms(r["graph_us"]) if r.get("graph_us") else "n/a", _met(r),
                            f"{r['kv_tbps']:.2f}" if r.get("kv_tbps") else "-", fmt_x(r.get("vs_peer")), _err(r),
                            _note(r)])
                    else:
                        body.append(first + _status_cells(r, 6) + [_err(r), _note(r)])
            lines += ["", f"{dtype}, against {PEERS[peers[dtype]].label}:", ""]
            lines += table(header, body, "rlrrrlrrrl")
    long = [e for e in cases if e["part"] == "long"]
    if long:
        s0 = long[0]["shape"]
        lines += ["", f"**Long-context decode** (B={s0['B']}, NH={s0['NH']}, d={s0['d']}, one query over "
                      f"{s0['T_k']} keys). Times: median of CUDA-event runs, L2 flushed before each. Bandwidth: bytes "
                      f"of K and V over the time, against the device copy measured in the same run "
                      f"({c['copy_tbps']:.2f} TB/s, {c['copy_what']}). Target: at least {t['long_pct_copy']:g}% "
                      "of the copy ceiling."]
        body = []
        for e in long:
            for r in e["rows"]:
                first = [e["dtype"], _label(r)]
                if r["status"] == "ok":
                    tm = r["timing"]
                    body.append(first + [fmt_ms(1e3 * tm["median_ms"]),
                                         f"{fmt_ms(1e3 * tm['p20_ms'])}-{fmt_ms(1e3 * tm['p80_ms'])}",
                                         _bytes(r["kv_bytes"]), f"{r['kv_tbps']:.2f}",
                                         f"{r['pct_copy']:.0f}%" if r.get("pct_copy") is not None else "-", _met(r),
                                         fmt_x(r.get("vs_peer")), _err(r), _note(r)])
                else:
                    body.append(first + _status_cells(r, 7) + [_err(r), _note(r)])
        lines += [""] + table(["dtype", "kernel", "us", "p20-p80", "K+V", "TB/s", "% of copy",
                               f"target >= {t['long_pct_copy']:g}%", vs, "max error", "note"], body, "llrrrrrlrrl")
        lines += [f"\n{n}" for n in _peer_notes([r for e in long for r in e["rows"]])]
    general = [e for e in cases if e["part"] not in ("decode", "long")]
    if general:
        lines += ["", f"**Features** (FLOP convention: {result['flop_convention']}). Times: median of CUDA-event "
                      "runs, L2 flushed before each."]
    titles = {"noncausal": "Non-causal", "cross": "Cross lengths", "gqa": "Grouped-query heads", "heads": "Head size"}
    for key in dict.fromkeys((e["part"], json.dumps(e["shape"], sort_keys=True)) for e in general):
        group = [e for e in general if (e["part"], json.dumps(e["shape"], sort_keys=True)) == key]
        shape = group[0]["shape"]
        case = Case(**shape)
        flops = attention_flops_qk(shape["B"], shape["NH"], shape["T_q"], shape["T_k"], shape["d"], shape["causal"])
        title = titles.get(shape["part"], shape["part"]) + (f" {shape['d']}" if shape["part"] == "heads" else "")
        lines += ["", f"**{title}**: {case.describe()} ({flops / 1e9:.1f} GFLOP)", ""]
        body = []
        for e in group:
            for r in e["rows"]:
                first = [_label(r), e["dtype"]]
                if r["status"] == "ok":
                    tm = r["timing"]
                    body.append(first + [fmt_ms(tm["median_ms"]), f"{fmt_ms(tm['p20_ms'])}-{fmt_ms(tm['p80_ms'])}",
                                         fmt_tflops(r["tflops"]), fmt_x(r.get("vs_peer")), _err(r), _note(r)])
                else:
                    body.append(first + _status_cells(r, 4) + [_err(r), _note(r)])
        lines += table(["kernel", "dtype", "ms", "p20-p80", "TFLOP/s", vs, "max error", "note"], body, "llrrrrrl")
        lines += [f"\n{n}" for n in _peer_notes([r for e in group for r in e["rows"]])]
    return "\n".join(lines)
