"""`bench.py profile`'s table, roofline plot and docs sections (docs/profile.md's; docs/ladder.md's short row per rung)
from its result dict (benchmarks/profile.py).

The roofline: x = arithmetic intensity, the FLOPs of the launch (bench's attention_flops convention) over
the DRAM bytes ncu counted (read + written); y = achieved TFLOP/s, those FLOPs over ncu's duration; the
roof is the ceilings measured in the same run: each compute ceiling flat, the copy bandwidth slanted
(TFLOP/s = TB/s x FLOP/byte), log-log. An FP8 rung's point is drawn in the color of the e4m3 roof it is
held against (benchmarks/ceilings.py), apart from the points under the other roofs.
"""

from __future__ import annotations

import math
import re
import statistics

import kernels

from . import ceilings as precision
from .tables import setup_header, table

FP8_COLOR = "C3"  # the e4m3 roof and the FP8 rungs' points
ROOF_COLORS = ("C1", "C2", "C4", "C5", "C6")  # the other roofs: neither the points' C0 nor FP8's

COLUMNS = ["rung", "kernel (grid x block)", "us", "TFLOP/s", "occupancy % achieved / theoretical (limit)", "SM %",
           "memory %", "DRAM read / write MB", "DRAM TB/s (% peak)", "L2 hit %", "shared ld / st TB/s",
           "bank conflicts ld / st", "global ld / st TB/s", "tensor pipe % (kind)", "issue slots %",
           "top warp stalls (share of stall cycles)"]
ALIGN = "llrrlrrrrrrrrlrl"


def roofline_point(flops: int | None, read_bytes: int | None, write_bytes: int | None,
                   duration_s: float | None) -> dict:
    """FLOPs per DRAM byte and achieved TFLOP/s; None where an input is missing (or no DRAM byte moved)."""
    dram = None if read_bytes is None or write_bytes is None else read_bytes + write_bytes
    return {"dram_bytes": dram,
            "intensity": flops / dram if flops and dram else None,
            "tflops": flops / duration_s / 1e12 if flops and duration_s else None}


def median_clock(rows: list[dict]) -> float | None:
    """The SM clock (Hz) ncu saw, the median over every profiled kernel."""
    clocks = [k["sm_clock_hz"] for r in rows if r.get("status") == "ok" for k in r["kernels"] if k.get("sm_clock_hz")]
    return statistics.median(clocks) if clocks else None


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sig(x: float | None) -> str:
    """Four significant figures, zeros kept (364.3, 48.86, 203.0, 1203)."""
    if x is None:
        return "-"
    return f"{x:.{max(0, 3 - math.floor(math.log10(x))) if x > 0 else 1}f}"


def _pair(a, b, fmt) -> str:
    return "-" if a is None and b is None else f"{fmt(a)} / {fmt(b)}"


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def _tbps(x) -> str:
    return "-" if x is None else f"{x / 1e12:.2f}"


def _count(n) -> str:
    return "-" if n is None else f"{n:,}"


def _us(seconds) -> str:
    return "-" if seconds is None else _sig(seconds * 1e6)


def occupancy_cell(k: dict) -> str:
    cell = _pair(k.get("occupancy_achieved_pct"), k.get("occupancy_theoretical_pct"), _num)
    return f"{cell} ({' = '.join(k['occupancy_limiter'])})" if k.get("occupancy_limiter") else cell


def dram_cell(k: dict) -> str:
    if k.get("dram_bytes_per_s") is None:
        return "-" if k.get("dram_pct") is None else f"- ({k['dram_pct']:.1f}%)"
    return f"{_tbps(k['dram_bytes_per_s'])} ({_num(k.get('dram_pct'))}%)"


def tensor_cell(k: dict) -> str:
    if k.get("tensor_pct") is None:
        return "-"
    kind = k.get("tensor_kind")
    return f"{k['tensor_pct']:.1f}" + (f" ({kind})" if kind else "")


def stalls_cell(k: dict) -> str:
    return ", ".join(f"{reason} {share:.0%}" for reason, share in k.get("stalls_top") or ()) or "-"


def shape_text(shape: dict) -> str:
    """'8x1024' (B x T at GPT-2's heads), or a frontier case's id ('2x32x4096-d128-gqa8')."""
    return shape.get("case") or f"{shape['B']}x{shape['T']}"


def shapes_header(result: dict) -> str:
    """'B x T 8x1024, 4x2048, NH=12, d=64', or 'frontier shapes 16x12x2048-d64, ...'."""
    shapes = ", ".join(shape_text(s) for s in result["shapes"])
    if any("case" in s for s in result["shapes"]):
        return f"frontier shapes (B x NH x T-d) {shapes}"
    nh, d = (result["shapes"][0]["NH"], result["shapes"][0]["d"]) if result["shapes"] else ("?", "?")
    return f"B x T {shapes}, NH={nh}, d={d}"


def _label(r: dict, shapes: int) -> str:
    label = f"`{r['name']}`" if r["kind"] == "rung" else r["name"]
    return f"{label} {shape_text(r['shape'])}" if shapes > 1 and r.get("shape") else label


def kernel_cells(k: dict) -> list[str]:
    """The columns after the rung's label and TFLOP/s that one kernel fills."""
    return [occupancy_cell(k), _num(k.get("sm_pct")), _num(k.get("memory_pct")),
            _pair(k.get("dram_read_bytes"), k.get("dram_write_bytes"), _mb), dram_cell(k), _num(k.get("l2_hit_pct")),
            _pair(k.get("shared_ld_bytes_per_s"), k.get("shared_st_bytes_per_s"), _tbps),
            _pair(k.get("bank_conflicts_ld"), k.get("bank_conflicts_st"), _count),
            _pair(k.get("global_ld_bytes_per_s"), k.get("global_st_bytes_per_s"), _tbps),
            tensor_cell(k), _num(k.get("issue_pct")), stalls_cell(k)]


def table_rows(result: dict) -> list[list[str]]:
    """One row per kernel; a rung of several kernels adds a row of its total."""
    shapes, body = len(result["shapes"]), []
    for r in result["rows"]:
        label = _label(r, shapes)
        if r["status"] != "ok":
            body.append([label, f"**{r['status']}**: {r.get('reason', '')}"] + ["-"] * (len(COLUMNS) - 2))
            continue
        several = len(r["kernels"]) > 1
        for k in r["kernels"]:
            body.append([label, f"`{k['kernel']}` {k['grid']}x{k['block']}", _us(k["duration_s"]),
                         "-" if several else _num(r.get("tflops"), 2), *kernel_cells(k)])
        if several:
            total = [f"all {len(r['kernels'])} kernels", _us(r["duration_s"]), _num(r.get("tflops"), 2), "-", "-", "-",
                     _pair(r.get("dram_read_bytes"), r.get("dram_write_bytes"), _mb)]
            body.append([label, *total] + ["-"] * (len(COLUMNS) - 1 - len(total)))
    return body


def render_profile(result: dict) -> str:
    """The profile table, headed by the setup, the clock ncu saw and the run's ceilings."""
    clock = result.get("sm_clock_hz")
    ncu = result.get("ncu") or {}
    shapes = shapes_header(result)
    roofs = "; ".join(f"{name} {v:.1f} TFLOP/s" for name, v in (result.get("roofs") or {}).items())
    copy = (result.get("ceilings") or {}).get("copy_tbps")
    lines = setup_header(result) + [
        "",
        f"{result['dtype']}, {shapes}: "
        f"{'one backward pass per rung (every phase its kernel)' if result.get('direction') == 'backward' else 'one launch per rung'}"
        f" after warm-up under Nsight Compute "
        f"{ncu.get('version') or '?'}, clocks not locked (--clock-control {ncu.get('clock_control', 'none')}): "
        f"**SM clock {clock / 1e9:.2f} GHz** (gpc__cycles_elapsed.avg.per_second, median over the kernels)."
        if clock else f"{result['dtype']}, {shapes}: no kernel was profiled.",
        "",
        f"Ceilings of this run: {roofs or 'none'}; copy {_num(copy, 2)} TB/s. TFLOP/s count {result['flop_convention']}. "
        "Throughputs are % of the peak sustained over the elapsed cycles, occupancy of the active cycles; the "
        "limit is the smallest of ncu's blocks-per-SM limits; stall shares leave out the issuing warp's own cycle.",
        "",
    ]
    return "\n".join(lines + table(COLUMNS, table_rows(result), ALIGN))


def progress_line(r: dict) -> str:
    """One line per profiled rung, as it finishes."""
    where = shape_text(r["shape"]) if r.get("shape") else ""
    if r["status"] != "ok":
        return f"{r['name']} {where}: {r['status']}: {r.get('reason', '')}"
    k = r["kernels"][0]
    more = f" ({len(r['kernels'])} kernels)" if len(r["kernels"]) > 1 else ""
    return (f"{r['name']} {where}: {_us(r['duration_s'])} us{more}, {_num(r.get('tflops'), 2)} TFLOP/s, "
            f"occupancy {occupancy_cell(k)}, SM {_num(k.get('sm_pct'))}%, stalls {stalls_cell(k)}")


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------


def point_math(r: dict, dtype: str) -> str | None:
    """What a profiled row computes with: as the run recorded it, else (an older result) from its rung."""
    if r.get("math") or r.get("kind") != "rung":
        return r.get("math")
    try:
        return precision.rung_math(kernels.load(r["name"]), dtype, {})
    except (ValueError, OSError):  # a rung no longer found
        return None


def roofline_points(result: dict) -> list[tuple[str, float, float, str | None]]:
    """(label, FLOP per DRAM byte, TFLOP/s, what it computes with) of every profiled rung with both."""
    shapes = len(result["shapes"])
    return [(r["name"] + (f" {shape_text(r['shape'])}" if shapes > 1 else ""), r["intensity"], r["tflops"],
             point_math(r, result["dtype"]))
            for r in result["rows"] if r["status"] == "ok" and r.get("intensity") and r.get("tflops")]


def spread(targets: list[float], gap: float) -> list[float]:
    """Positions as near their targets as may be (least squares), in the targets' order, each at least gap
    from the next: labels stacked apart where their points crowd. Pool adjacent violators: a run of labels
    that would overlap moves as one block, centred on its targets."""
    order = sorted(range(len(targets)), key=targets.__getitem__)
    blocks: list[list[float]] = []  # [the block's first position, its labels, the sum of target - k * gap]
    for i in order:
        blocks.append([targets[i], 1, targets[i]])
        while len(blocks) > 1 and blocks[-2][0] + blocks[-2][1] * gap > blocks[-1][0]:
            _, n1, sum1 = blocks.pop()
            _, n0, sum0 = blocks[-1]
            total = sum0 + sum1 - n0 * n1 * gap  # the upper block's labels now sit n0 gaps higher
            blocks[-1] = [total / (n0 + n1), n0 + n1, total]
    positions = [start + k * gap for start, count, _ in blocks for k in range(int(count))]
    out = [0.0] * len(targets)
    for rank, i in enumerate(order):
        out[i] = positions[rank]
    return out


def columns(spans: list[tuple[float, float]]) -> list[list[int]]:
    """The indices of (left, right) spans grouped where they overlap, directly or through others."""
    groups: list[list[int]] = []
    reach = float("-inf")
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        if spans[i][0] > reach:
            groups.append([])
        groups[-1].append(i)
        reach = max(reach, spans[i][1]) if groups[-1] != [i] else spans[i][1]
    return groups


def clear_of(ys: list[float], height: float, obstacles: list[tuple[float, float]]) -> list[float]:
    """Positions at or above ys (taken in their order), each label of this height clear of the previous
    one and of every (bottom, top) obstacle: a label that would cross one moves up past it."""
    out, floor = [0.0] * len(ys), float("-inf")
    for i in sorted(range(len(ys)), key=ys.__getitem__):
        y = max(ys[i], floor)
        while hit := [top for bottom, top in obstacles if y < top and y + height > bottom]:
            y = max(hit)
        out[i], floor = y, y + height
    return out


def place_labels(ax, texts, anchors, align: str = "left", fixed=()) -> None:
    """Move texts (placed at their anchors, in data coordinates) apart vertically where their boxes would
    overlap, each column of overlapping boxes spread (spread()) in display space, then moved up past the
    `fixed` texts in their column, which stay where they are; a thin line from a moved label back to its
    point."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    still = [t.get_window_extent(renderer) for t in fixed]
    for group in columns([(b.x0 - 2, b.x1 + 2) for b in boxes]):
        heights = max(boxes[i].height for i in group) + 1
        left, right = min(boxes[i].x0 for i in group) - 2, max(boxes[i].x1 for i in group) + 2
        obstacles = [(b.y0 - 1, b.y1 + 1) for b in still if b.x0 < right and b.x1 > left]
        ys = clear_of(spread([boxes[i].y0 for i in group], heights), heights, obstacles)
        for i, y in zip(group, ys):
            dy = y - boxes[i].y0
            if abs(dy) < 0.5:
                continue
            x0, y0 = texts[i].get_position()
            x_px, y_px = ax.transData.transform((x0, y0))
            texts[i].set_position(ax.transData.inverted().transform((x_px, y_px + dy)))
            if anchors[i] is not None:
                ax.plot(*zip(anchors[i], ax.transData.inverted().transform((x_px + (4 if align == "left" else -4),
                                                                            y_px + dy))),
                        color="gray", linewidth=0.5)


def plot_roofline(plt, points: list[tuple[str, float, float, str | None]], roofs: dict[str, float],
                  copy_tbps: float | None, title: str):
    """Log-log: the points, each compute roof (TFLOP/s) flat from where the copy bandwidth's slant meets it,
    an FP8 rung's point (math "fp8") and the e4m3 roof in one color of their own; labels that would print
    over each other stacked apart (place_labels)."""
    from matplotlib.ticker import FuncFormatter  # matplotlib is there: plt came from it

    fig, ax = plt.subplots(figsize=(9, 6))
    ridges = [p / copy_tbps for p in roofs.values()] if copy_tbps else []
    xs = [x for _, x, _, _ in points] + ridges
    lo, hi = (min(xs) / 4, max(xs) * 4) if xs else (0.1, 1000.0)
    if copy_tbps:
        top = max(ridges) if ridges else hi
        ax.plot([lo, top], [copy_tbps * lo, copy_tbps * top], color="gray", linestyle="-")
        ax.text(lo * 1.6, copy_tbps * lo * 1.1, f"copy {copy_tbps:.2f} TB/s", color="gray", fontsize="small",
                ha="left", va="top")
    roof_labels = []
    fp8_roof = precision.MATHS["fp8"][1]
    for i, ((name, tflops), ridge) in enumerate(zip(roofs.items(), ridges or [lo] * len(roofs))):
        color = FP8_COLOR if name == fp8_roof else ROOF_COLORS[i % len(ROOF_COLORS)]
        ax.plot([ridge, hi], [tflops, tflops], linestyle="--", color=color)
        roof_labels.append(ax.text(hi / 1.1, tflops * 1.05, f"{name} {tflops:.0f} TFLOP/s", ha="right",
                                   va="bottom", fontsize="small", color=color if name == fp8_roof else None))
    for _, x, y, held in points:
        ax.plot([x], [y], marker="D" if held == "fp8" else "o", color=FP8_COLOR if held == "fp8" else "C0")
    if any(held == "fp8" for *_, held in points):
        from matplotlib.lines import Line2D

        ax.legend(handles=[Line2D([], [], marker="o", color="C0", linestyle="", label="rungs"),
                           Line2D([], [], marker="D", color=FP8_COLOR, linestyle="",
                                  label=f"FP8 rungs: against the {fp8_roof} roof")],
                  loc="lower right", fontsize="small")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(*ax.get_ylim())  # the limits fixed before the labels are placed in display space
    nudge = 10 ** 0.012  # a few points right of and above its point, on these log axes
    point_labels = [ax.text(x * nudge, y * nudge, label, fontsize="x-small", ha="left", va="bottom")
                    for label, x, y, _ in points]
    place_labels(ax, roof_labels, [None] * len(roof_labels), align="right")
    place_labels(ax, point_labels, [(x, y) for _, x, y, _ in points], fixed=roof_labels)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("arithmetic intensity: FLOPs / DRAM bytes read + written (ncu)")
    ax.set_ylabel("achieved TFLOP/s (FLOPs / ncu's duration)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_result(plt, result: dict):
    """The roofline of one profile result (bench's plot_or_none calls this)."""
    dev = result["setup"].get("device") or {}
    title = (f"roofline, causal attention {result.get('direction', 'forward')}, {result['dtype']}: "
             f"{dev.get('name', 'no GPU')}, {result['setup']['date'][:10]}")
    return plot_roofline(plt, roofline_points(result), result.get("roofs") or {},
                         (result.get("ceilings") or {}).get("copy_tbps"), title)


def render_profile_doc(result: dict, source: str, image: str | None) -> str:
    """docs/profile.md's generated section: the table (its header names the SM clock) and the roofline;
    `source` and `image` are the result file and its PNG, relative to the docs page."""
    parts = [f"<!-- generated by `python3 bench.py profile` from `{source}`; rerun bench.py rather than editing -->",
             render_profile(result)]
    if image:
        parts.append(f"![roofline of the {result['dtype']} rungs: FLOPs per DRAM byte against TFLOP/s, under the "
                     f"ceilings of the same run]({image})")
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# docs/ladder.md's counters: one short row per rung
# ---------------------------------------------------------------------------------------------

COUNTER_COLUMNS = ["rung", "us", "vs previous", "occupancy % achieved / theoretical (limit)", "bank conflicts ld / st",
                   "shared ld / st TB/s", "tensor pipe % (kind)", "issue slots %", "DRAM read MB", "top warp stall"]
COUNTER_ALIGN = "lrrlrrrrrl"


def splits_keys(name: str) -> bool:
    """Whether a rung splits the keys across blocks (lab.split_kv); False for a name the ladder no longer has."""
    try:
        return kernels.load(name).split_kv
    except ValueError:
        return False


def _rung_link(name: str, ladder: str = "") -> str:
    """The rung's name, linked to its story on the ladder page (#v02; `ladder` the page's path from another)."""
    m = re.match(r"v\d+", name)
    return f"[`{name}`]({ladder}#{m.group(0)})" if m else f"`{name}`"


def counter_rows(result: dict, line=splits_keys, ladder: str = "") -> list[list[str]]:
    """One row per profiled rung, in ladder order. "vs previous" is the speed-up over the rung before that ran
    at the same shape and on the same line (`line(name)`: the split-KV rungs are a line of their own); the
    time is the rung's (every kernel's), the other counters its longest kernel's."""
    shapes, before, body = len(result["shapes"]), {}, []
    for r in result["rows"]:
        if r["kind"] != "rung" or r["status"] != "ok":
            continue
        key = (tuple(sorted((r.get("shape") or {}).items())), line(r["name"]))
        previous = before.get(key)
        before[key] = r
        speedup = (f"{previous['duration_s'] / r['duration_s']:.2f}x ({previous['name'].split('_')[0]})"
                   if previous and previous.get("duration_s") and r.get("duration_s") else "-")
        k = max(r["kernels"], key=lambda k: k.get("duration_s") or 0)
        label = _rung_link(r["name"], ladder) + (f" {shape_text(r['shape'])}" if shapes > 1 else "")
        if len(r["kernels"]) > 1:
            label += f" ({len(r['kernels'])} kernels)"
        top = (k.get("stalls_top") or [None])[0]
        body.append([label, _us(r.get("duration_s")), speedup, occupancy_cell(k),
                     _pair(k.get("bank_conflicts_ld"), k.get("bank_conflicts_st"), _count),
                     _pair(k.get("shared_ld_bytes_per_s"), k.get("shared_st_bytes_per_s"), _tbps),
                     tensor_cell(k), _num(k.get("issue_pct")), _mb(r.get("dram_read_bytes")),
                     f"{top[0]} {top[1]:.0%}" if top else "-"])
    return body


def left_out(result: dict) -> str:
    """The rungs a counters table leaves out, grouped by why: '`v15_bf16_mma`, `v18_wgmma`: skipped, does not ...'."""
    why: dict[str, list[str]] = {}
    for r in result["rows"]:
        if r["kind"] == "rung" and r["status"] != "ok":
            why.setdefault(f"{r['status']}, {r.get('reason') or 'no reason given'}", []).append(f"`{r['name']}`")
    if not why:
        return ""
    return f"Not in this table: {'; '.join(', '.join(names) + ': ' + reason for reason, names in why.items())}."


def render_counters(result: dict, line=splits_keys, ladder: str = "") -> str:
    """One dtype's counters for docs/ladder.md: a line of setup, the table, the rungs left out."""
    dev = (result["setup"].get("device") or {}).get("name", "no GPU")
    clock = result.get("sm_clock_hz")
    lines = [f"**{result['dtype']}**, {shapes_header(result)}: {dev}, {result['setup']['date'][:10]}, "
             f"SM clock {_num(clock and clock / 1e9, 2)} GHz, one launch per rung under Nsight Compute.", ""]
    lines += table(COUNTER_COLUMNS, counter_rows(result, line, ladder), COUNTER_ALIGN)
    rest = left_out(result)
    return "\n".join(lines + (["", rest] if rest else []))
