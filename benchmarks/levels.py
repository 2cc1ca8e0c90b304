"""`bench.py levels`: seed 004's four levels of writing a kernel, on one problem in one run. The plain
PyTorch attention (easy, slow), the same function under torch.compile (easy, fast, not flexible), the
Triton rung (harder, faster, more flexible) and the fastest CUDA rung the device runs (hardest,
fastest when done right), beside SDPA's kernels (a library call), at the five GPT-2 shapes and two
d=128 shapes, float32 and bfloat16; each checked against float64 and timed as `bench.py kernels`
times (rungs.bench_shape), with the lines of code each level took, counted from the sources."""

from __future__ import annotations

import ast
import math
import re
import time
from pathlib import Path

import kernels
from kernels import triton as triton_rungs

from . import device, plots, timing
from .cases import FLOP_CONVENTION, GPT2_SHAPES, Shape
from .device import first_line, progress
from .peers import PEERS
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import announce_and_measure_ceilings, bench_shape
from .tables import fmt_tflops, setup_header, table

SHAPE_SETS = {"gpt2": tuple(Shape(B, T) for B, T in GPT2_SHAPES),  # NH=12, d=64
              "d128": (Shape(2, 4096, 32, 128), Shape(1, 16384, 16, 128))}
LEVELS = {  # --levels key: (seed 004's level, what runs it)
    "pytorch": ("PyTorch", "peer torch_naive"),
    "compile": ("torch.compile", "peer torch_compile"),
    "compile-max": ("torch.compile", "peer torch_compile_max"),
    "triton": ("Triton", "the newest Triton rung"),
    "cuda": ("CUDA", "the first CUDA_CANDIDATES rung that declares the dtype and head size and runs here"),
    "sdpa": ("SDPA", "SDPA_PEERS of the dtype"),
}
CUDA_CANDIDATES = {"float32": ("v20", "v14", "v13"), "bfloat16": ("v19", "v18", "v15"),
                   "float16": ("v19", "v18", "v15")}  # the ladder's fastest first (docs/results.md)
SDPA_PEERS = {"float32": ("sdpa_efficient",), "bfloat16": ("sdpa_flash", "sdpa_cudnn"),
              "float16": ("sdpa_flash", "sdpa_cudnn")}
PLAIN = Path(__file__).resolve().parent / "torch_attention.py"  # the PyTorch level's function


def triton_rung() -> str:
    return kernels.triton_names()[-1]


def cuda_rung(dtype: str, d: int, arch: str | None) -> str | None:
    """The CUDA level's rung: the first candidate that declares `dtype` and head size `d` and runs on
    `arch` (any, when None); None if none does."""
    for name in CUDA_CANDIDATES[dtype]:
        rung = kernels.load(name)
        if dtype in rung.dtypes and d in rung.head_sizes() and (arch is None or rung.runs_on(arch)):
            return kernels.resolve(name).stem
    return None


def plan(shapes, dtypes: list[str], levels: list[str], arch: str | None) -> list[tuple[str, Shape, list[dict]]]:
    """(dtype, shape, entries) for every dtype x shape, entries in level order: {"level", "name", "kind"};
    a CUDA entry with name None where no candidate rung takes the case."""
    out = []
    for dtype in dtypes:
        for shape in shapes:
            entries = []
            for key in levels:
                level = LEVELS[key][0]
                if key in ("pytorch", "compile", "compile-max"):
                    peer = {"pytorch": "torch_naive", "compile": "torch_compile", "compile-max": "torch_compile_max"}
                    entries.append({"level": level, "name": peer[key], "kind": "peer"})
                elif key == "triton":
                    entries.append({"level": level, "name": triton_rung(), "kind": "rung"})
                elif key == "cuda":
                    entries.append({"level": level, "name": cuda_rung(dtype, shape.d, arch), "kind": "rung"})
                else:
                    entries += [{"level": level, "name": p, "kind": "peer"} for p in SDPA_PEERS[dtype]]
            out.append((dtype, shape, entries))
    return out


# ---------------------------------------------------------------------------------------------
# Lines of code per level, counted from the sources: non-blank lines that are not comments or docstrings
# ---------------------------------------------------------------------------------------------


def code_lines(text: str, language: str) -> int:
    """Non-blank lines that are not only comment: Python ("#", docstrings) or C/CUDA ("//", "/* */").
    A line with code and a trailing comment counts."""
    if language == "python":
        skip = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
        return sum(1 for i, line in enumerate(text.splitlines(), 1)
                   if i not in skip and line.strip() and not line.strip().startswith("#"))
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    return sum(1 for line in text.splitlines() if line.split("//", 1)[0].strip())


def function_source(path: Path, name: str) -> str:
    """The source of the top-level function `name` in the file (no import: torch need not be here)."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "\n".join(text.splitlines()[node.lineno - 1:node.end_lineno])
    raise ValueError(f"{path} has no function {name}")


def lines_of_code(name: str) -> dict:
    """{"lines": n or None, "what": how they were counted} for a plan entry's name."""
    if name in ("torch_naive", "torch_compile", "torch_compile_max"):
        n = code_lines(function_source(PLAIN, "plain_attention"), "python")
        if name == "torch_naive":
            return {"lines": n, "what": f"plain_attention in {PLAIN.parent.name}/{PLAIN.name}"}
        return {"lines": n + 1, "what": "plain_attention + the torch.compile line"}
    if name.startswith("sdpa"):
        return {"lines": None, "what": "library: 1 call"}
    if triton_rungs.owns(name):
        path = triton_rungs.resolve(name)
        return {"lines": code_lines(path.read_text(), "python"), "what": f"kernels/triton/{path.name}: kernel, "
                                                                        "tile configs, launcher"}
    path = kernels.resolve(name)
    return {"lines": code_lines(path.read_text(), "cuda"), "what": f"kernels/{path.name}"}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def measure_case(dtype: str, shape: Shape, entries: list[dict], *, flush, method, ceilings, seed: int,
                 counter: list[int], total: int) -> list[dict]:
    """Rows for one dtype and shape: bench_shape's (checked, then timed), each with its level, lines of
    code and, for the rungs, the compile or autotune time it spent here. A failure of the whole case (out
    of memory making the inputs) becomes one error row per entry, and the run goes on."""
    named = [e for e in entries if e["name"] is not None]
    rung_paths = [triton_rungs.resolve(e["name"]) if triton_rungs.owns(e["name"]) else kernels.resolve(e["name"])
                  for e in named if e["kind"] == "rung"]
    peers = [e["name"] for e in named if e["kind"] == "peer"]
    cu_before, tr_before = kernels.runtime.compile_seconds, triton_rungs.compile_seconds
    try:
        rows = bench_shape(shape, dtype, rung_paths, peers, flush=flush, method=method,
                           ffma_tflops=ceilings["ffma_tflops"], seed=seed, counter=counter, total=total)
    except Exception as exc:
        progress(f"{shape_label(shape.as_dict())} {dtype}: failed: {first_line(exc)}")
        device.release_memory()
        rows = [{"shape": shape.as_dict(), "dtype": dtype, "name": e["name"], "kind": e["kind"],
                 "label": PEERS[e["name"]].label if e["kind"] == "peer" else e["name"], "status": "error",
                 "reason": first_line(exc)} for e in named]
    spent = {"": kernels.runtime.compile_seconds - cu_before, "triton": triton_rungs.compile_seconds - tr_before}
    level = {e["name"]: e["level"] for e in named}
    for r in rows:
        r["level"] = level[r["name"]]
        r |= {"loc": lines_of_code(r["name"])}
        if r["kind"] == "rung":
            r["compile_seconds"] = spent["triton" if r.get("family") == "triton" else ""]
    missing = [e for e in entries if e["name"] is None]
    for e in missing:
        counter[0] += 1
        why = (f"no CUDA rung among {', '.join(CUDA_CANDIDATES[dtype])} declares {dtype} and d={shape.d} and runs "
               "on this device")
        progress(f"[{counter[0]:>3}/{total}] {shape.label:>8} {'CUDA':<24} unsupported: {why}")
        rows.append({"shape": shape.as_dict(), "dtype": dtype, "name": "cuda", "label": "CUDA", "kind": "rung",
                     "level": e["level"], "status": "unsupported", "reason": why, "loc": {"lines": None, "what": "-"}})
    return rows


def cmd_levels(args) -> int:
    device.require_gpu()
    setup = device.setup_info(args.argv)
    method = timing.Method(budget_ms=args.budget_ms)
    ceilings = announce_and_measure_ceilings(setup, method)
    if kernels.triton_unavailable() and "triton" in args.levels:
        progress(f"Triton level: {kernels.triton_unavailable()}")
    flush = timing.L2Flush()
    shapes = [s for key in args.shapes for s in SHAPE_SETS[key]]
    cases = plan(shapes, args.dtypes, args.levels, setup["device"]["arch"])
    total, counter, rows = sum(len(e) for *_, e in cases), [0], []
    started = time.perf_counter()
    for i, (dtype, shape, entries) in enumerate(cases):
        names = ", ".join(f"{e['level']} {e['name'] or '(none)'}" for e in entries)
        progress(f"--- {dtype}, {shape_label(shape.as_dict())} (NH={shape.NH}, d={shape.d}): {names}")
        rows += measure_case(dtype, shape, entries, flush=flush, method=method, ceilings=ceilings,
                             seed=args.seed + i, counter=counter, total=total)
    result = {
        "schema": SCHEMA, "kind": "levels", "setup": setup, "flop_convention": FLOP_CONVENTION,
        "method": method.describe(flush.nbytes) | {
            "compilation": "before warm-up and never timed: NVRTC for the CUDA rung, Triton's compilation and "
                           "autotuning on the rung's first call at each length bucket, torch.compile on the "
                           "peer's first call at each shape and dtype (static shapes); each row's compile_seconds"},
        "ceilings": ceilings, "dtypes": args.dtypes, "shapes": [s.as_dict() for s in shapes],
        "levels": args.levels, "cuda_candidates": {d: CUDA_CANDIDATES[d] for d in args.dtypes},
        "sdpa_peers": {d: SDPA_PEERS[d] for d in args.dtypes}, "seed": args.seed,
        "wall_seconds": time.perf_counter() - started, "rows": rows,
    }
    path = result_path("levels", setup, args.results)
    result["plot"] = plots.plot_or_none(plot_levels, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_levels(result, result["plot"]))
    progress(f"levels: {result['wall_seconds']:.0f} s in all, of which {total_seconds(rows):.0f} s compiling and "
             "autotuning")
    progress(wrote(path, result["plot"]))
    return 0


# ---------------------------------------------------------------------------------------------
# The table and the plot
# ---------------------------------------------------------------------------------------------


def shape_label(shape: dict) -> str:
    """1x512 for the GPT-2 shapes (NH=12, d=64); 2x32x4096 d128 (B x NH x T) for the others."""
    if shape["NH"] == 12 and shape["d"] == 64:
        return f"{shape['B']}x{shape['T']}"
    return f"{shape['B']}x{shape['NH']}x{shape['T']} d{shape['d']}"


def _implementations(result: dict, dtype: str) -> list[dict]:
    """The first row of each implementation of `dtype`, in level order (the order the run made them)."""
    order = list(dict.fromkeys(level for level, _ in LEVELS.values()))
    first = {}
    for r in result["rows"]:
        if r["dtype"] == dtype:
            first.setdefault(r["name"], r)
    return sorted(first.values(), key=lambda r: order.index(r["level"]))


def _label(r: dict) -> str:
    return f"`{r['name']}`" if r["kind"] == "rung" and r["name"] != "cuda" else r["label"]


def _seconds(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f}"


def render_dtype(result: dict, dtype: str) -> list[str]:
    shapes = result["shapes"]
    by = {(r["name"], shape_label(r["shape"])): r for r in result["rows"] if r["dtype"] == dtype}
    body, notes = [], {}
    for impl in _implementations(result, dtype):
        cells = []
        for s in shapes:
            r = by.get((impl["name"], shape_label(s)))
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(fmt_tflops(r["tflops"]))
            else:
                cells.append(f"{r['status']}")
                notes.setdefault((_label(impl), r["status"], r.get("reason", "")), []).append(shape_label(s))
        mine = [r for (name, _), r in by.items() if name == impl["name"]]
        errors = [r["max_err"] for r in mine if r.get("max_err") is not None]
        config = next((r.get("config") for r in mine if r.get("config")), "")
        loc = impl["loc"]
        body.append([impl["level"], _label(impl), "-" if loc["lines"] is None else str(loc["lines"]), loc["what"],
                     *cells, _seconds([r["compile_seconds"] for r in mine if r.get("compile_seconds") is not None]),
                     f"{max(errors):.1e}" if errors else "-", config])
    cuda = ", ".join(f"`{n}`" for n in result["cuda_candidates"][dtype])
    lines = [f"**{dtype}**: TFLOP/s per shape (B x T: NH=12, d=64; B x NH x T: d=128), causal. CUDA: the first of "
             f"{cuda} that declares {dtype} and the head size and runs on this device. Compile s: compilation and "
             "autotuning at each shape (torch.compile, Triton) or NVRTC (CUDA), never timed; the range over the "
             "shapes. Max error: the worst over the shapes, against float64.", ""]
    header = ["level", "implementation", "lines of code", "counted", *[shape_label(s) for s in shapes], "compile s",
              "max error", "config"]
    lines += table(header, body, "llrl" + "r" * len(shapes) + "rrl")
    for (label, status, reason), where in notes.items():
        lines.append(f"\n{label} at {', '.join(where)}: {status}: {reason}")
    return lines


def render_levels(result: dict, image: str | None = None, dtypes: list[str] | None = None) -> str:
    c = result["ceilings"]
    m = result["method"]
    lines = setup_header(result) + [
        "",
        f"FLOP convention: {result['flop_convention']}. fp32 FFMA ceiling {c['ffma_tflops']:.1f} TFLOP/s, measured "
        f"in the same run. Times: median of {m['min_runs']}-{m['max_runs']} runs ({m['budget_ms']:g} ms each) after "
        f"warm-up, CUDA events, L2 flushed before each run. Every output was checked against a float64 reference "
        f"first ({m['tolerance']}); a rung over it is reported wrong, a peer's error is shown as it is. Lines of code: "
        "non-blank lines that are not comments or docstrings, counted by bench.py from the sources.",
    ]
    if image:
        lines += ["", f"![TFLOP/s per shape and level]({image})"]
    for dtype in dtypes or result["dtypes"]:
        lines += [""] + render_dtype(result, dtype)
    return "\n".join(lines)


def plot_levels(plt, result: dict):
    """Grouped bars, one panel per dtype: TFLOP/s per shape (log scale), one bar per implementation."""
    dtypes = result["dtypes"]
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(13, 4.8 * len(dtypes)), squeeze=False)
    labels = [shape_label(s) for s in result["shapes"]]
    for ax, dtype in zip((row[0] for row in axes), dtypes, strict=True):
        impls = _implementations(result, dtype)
        color = plots._colors(plt, [r["name"] for r in impls])
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, s in enumerate(result["shapes"]):
                r = next((r for r in result["rows"] if r["dtype"] == dtype and r["name"] == impl["name"]
                          and r["shape"] == s and r["status"] == "ok"), None)
                if r is not None:
                    xs.append(i - 0.4 + (j + 0.5) * width)
                    ys.append(r["tflops"])
            ax.bar(xs, ys, width=width, color=color[impl["name"]],
                   label=f"{impl['level']}: {impl['name'] if impl['kind'] == 'rung' else impl['label']}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_ylabel("TFLOP/s (causal: 4 B NH T^2 d / 2)")
        ax.set_title(f"{dtype}: {plots._device_title(result)}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def newest_per_dtype(paths: list[Path], load) -> list[tuple[Path, dict, list[str]]]:
    """(file, result, its dtypes shown) so that each dtype comes from the newest levels file that has it;
    paths newest first."""
    chosen: dict[Path, tuple[dict, list[str]]] = {}
    seen = set()
    for p in paths:
        result = load(p)
        mine = [d for d in result["dtypes"] if d not in seen]
        if mine:
            chosen[p] = (result, mine)
            seen |= set(mine)
    order = lambda item: min(("float32", "bfloat16", "float16").index(d) for d in item[1][1])  # noqa: E731
    return [(p, result, mine) for p, (result, mine) in sorted(chosen.items(), key=order)]


def total_seconds(rows: list[dict]) -> float:
    return math.fsum(r.get("compile_seconds") or 0.0 for r in rows)
