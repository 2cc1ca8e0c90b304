"""What `lab.py watch` prints for a save: compile errors at the watched file's own lines, a declaration
that does not parse in one line, resources per architecture and configuration with what changed since
the last save, the correctness checks with a verdict, and the timing table. Plain functions of plain
data (dicts the GPU process sends back as JSON), so that all of it is tested without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

# NVRTC names the program CuPy compiles after a temporary file (/tmp/tmpab12/kern.cu) or, unnamed,
# "default_program"; ladder.assemble's #line directives name the rung's own file everywhere else.
_PROGRAM = re.compile(r'(?:/[^\s"]*/)?kern\.cu\b|\bdefault_program\b')
_POSITION = re.compile(r"^(\S[^\n]*?)\((\d+)\): (?=(?:catastrophic )?error|warning|remark)", re.M)
_LAB_KEY = re.compile(r"\blab\.(\w+)")
FIELDS = (("registers", "registers"), ("static_smem", "static smem"), ("dynamic_smem", "dynamic smem"),
          ("stack_bytes", "stack"), ("spill_stores", "spill stores"), ("spill_loads", "spill loads"))


def locate(log: str, path: str | Path) -> str:
    """A compile log with NVRTC's `file(12): error` as `file:12: error` (editors and terminals jump to
    that form) and the temporary program's name replaced by the watched file's path."""
    return _POSITION.sub(r"\1:\2: ", _PROGRAM.sub(str(path), log.strip()))


def declaration_error(path: str | Path, message: str) -> str:
    """One line for a header that does not parse: `path:line: what`, at the line of the lab.<key> the
    message names where the file has one (the ladder's messages name the file, not always the line)."""
    path = Path(path)
    text = " ".join(message.split())
    if re.match(rf"{re.escape(str(path))}:\d+:", text):  # the ladder named the line itself
        return text
    text = text.removeprefix(f"{path}:").strip()
    key = _LAB_KEY.search(text)
    quoted = re.findall(r"'([^']+)'", text)  # an expression that does not evaluate: found among the values
    if key:
        line = declaration_line(path, key.group(1))
    else:
        line = declaration_line(path, r"\w+", quoted[-1]) if quoted else None
    return f"{path}:{line}: {text}" if line else f"{path}: {text}"


def declaration_line(path: Path, key: str, value: str = "") -> int | None:
    """The line number of a file's first `lab.<key>` declaration (key a regular expression) whose value
    holds `value`, or None."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    pattern = re.compile(rf"^\s*(?:\*|//)\s*lab\.{key}\s.*{re.escape(value)}")
    return next((n for n, line in enumerate(lines, 1) if pattern.match(line)), None)


def config_label(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def resource_rows(reports) -> dict[str, dict]:
    """kernels.Resources (or their as_dict()) -> {"sm_90 d_head=64, B_r=32, B_c=32": fields}, the
    form diff_resources compares and the watcher keeps from one save to the next."""
    rows = {}
    for r in reports:
        r = r if isinstance(r, dict) else r.as_dict()
        rows[f"{r['arch']} {config_label(r['config'])}"] = {
            **{k: r[k] for k, _ in FIELDS}, "performance_warnings": list(r["performance_warnings"])}
    return rows


def format_resources(rows: dict[str, dict]) -> list[str]:
    width = max((len(k) for k in rows), default=0)
    out = []
    for key, r in rows.items():
        out.append(f"  {key:<{width}}  {r['registers']:>3} registers  smem {r['static_smem']} + {r['dynamic_smem']}"
                   f"  stack {r['stack_bytes']}  spills {r['spill_stores']}/{r['spill_loads']}")
        out += [f"  {'':<{width}}  ptxas: {w}" for w in r["performance_warnings"]]
    return out


def diff_resources(old: dict[str, dict] | None, new: dict[str, dict]) -> list[str]:
    """What changed between two resource_rows: a configuration compiled or dropped, a field's value
    (`registers 96 -> 104 (+8)`), a ptxas warning that came or went. Empty when nothing did."""
    if old is None:
        return []
    out = [f"{key}: new" for key in new if key not in old]
    out += [f"{key}: no longer compiled" for key in old if key not in new]
    for key in (k for k in new if k in old):
        a, b = old[key], new[key]
        changes = [f"{label} {a[f]} -> {b[f]} ({b[f] - a[f]:+d})" for f, label in FIELDS if a[f] != b[f]]
        changes += [f"ptxas warning gone: {w}" for w in a["performance_warnings"] if w not in b["performance_warnings"]]
        changes += [f"ptxas warning new: {w}" for w in b["performance_warnings"] if w not in a["performance_warnings"]]
        if changes:
            out.append(f"{key}: " + "; ".join(changes))
    return out


def change(old_ms: float | None, new_ms: float | None) -> str:
    """`-0.120 ms (-7.5%)` from the last save's time to this one's; `-` when either is missing."""
    if old_ms is None or new_ms is None:
        return "-"
    return f"{new_ms - old_ms:+.3f} ms ({100 * (new_ms - old_ms) / old_ms:+.1f}%)"


def format_checks(checks: list[dict]) -> tuple[list[str], bool]:
    """One line per awkward case (its max error against float64 beside the bound: the rung's lab.tolerance
    times a plain implementation's error in the same dtype), and whether every case passed."""
    out = []
    case_width = max((len(c["case"]) for c in checks), default=0)
    config_width = max((len(c["config"]) for c in checks), default=0)
    for c in checks:
        err = "NaN/inf" if c["nonfinite"] else f"{c['max_err']:.2e}"
        unwritten = f", {c['nonfinite']} elements NaN/inf (unwritten?)" if c["nonfinite"] else ""
        out.append(f"  {c['case']:<{case_width}}  config ({c['config']}){'':<{config_width - len(c['config'])}}  "
                   f"max err {err} vs bound {c['bound']:.2e} ({c['factor']:g} x plain {c['plain']:.2e})"
                   f"{unwritten}: {'ok' if c['ok'] else 'WRONG'}")
    return out, all(c["ok"] for c in checks)


def verdict(checks: list[dict]) -> str:
    if not checks:
        return "verdict: not checked"
    failed = [c["case"] for c in checks if not c["ok"]]
    if not failed:
        return f"verdict: CORRECT ({len(checks)} cases within the bound)"
    return f"verdict: WRONG ({', '.join(failed)})"


def format_timing(name: str, times: dict[str, float | str], baseline: dict[str, dict], last: dict[str, float] | None,
                  columns: list[str]) -> list[str]:
    """The timing table: one row per shape, the watched rung's median ms, each column's (the rung before
    it, SDPA) with the watched rung's speed-up over it, and the change since the last save."""
    head = [f"{name} ms", *(f"{c} ms" for c in columns), "since last save"]
    rows = []
    for shape, ms in times.items():
        row = [shape, f"{ms:.3f}" if isinstance(ms, float) else ms]
        for c in columns:
            other = baseline.get(shape, {}).get(c)
            if isinstance(other, float) and isinstance(ms, float):
                row.append(f"{other:.3f} ({other / ms:.2f}x)")
            else:
                row.append(other if isinstance(other, str) else "-")
        row.append(change((last or {}).get(shape), ms if isinstance(ms, float) else None))
        rows.append(row)
    widths = [max(len(r[i]) for r in [["shape", *head], *rows]) for i in range(len(head) + 1)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(["shape", *head], widths))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return lines


# tools/watch_demo.py's summary line of one rung, as its output file in results/ holds it
_DEMO = re.compile(r"^(?P<device>[^:\n]+): (?P<rung>\S+) (?P<dtype>\S+) (?P<shape>\d+x\d+): median save-to-report "
                   r"(?P<timed>[\d.]+) s checked and timed, (?P<total>[\d.]+) s with resources$", re.M)
AIM_SECONDS = 3.0  # the save-to-report time watch mode aims at, compile included


def render_demo(text: str, source: str) -> str:
    """docs/watch.md's speed table from tools/watch_demo.py's output (`source`: the results file it was
    written to): each rung's median seconds from the save to its checked and timed report, and to the whole
    report (the resources too), against AIM_SECONDS."""
    rows = [m.groupdict() for m in _DEMO.finditer(text)]
    if not rows:
        raise ValueError(f"{source}: no `median save-to-report` line of tools/watch_demo.py")
    lines = [f"{rows[0]['device']}, [{Path(source).name}]({source}): medians in seconds, the saves' shape "
             f"{rows[0]['shape']}.", "",
             "| rung | dtype | checked and timed | whole report (resources too) | within 3 s |",
             "|:---|:---|---:|---:|:---|"]
    lines += [f"| `{r['rung']}` | {r['dtype']} | {r['timed']} | {r['total']} | "
              f"{'yes' if float(r['total']) <= AIM_SECONDS else '**no**'} |" for r in rows]
    return "\n".join(lines)
