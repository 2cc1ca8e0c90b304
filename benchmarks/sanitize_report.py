"""docs/ladder.md's sanitizer table, from tools/sanitize.py --json files in results/ (sanitize-GROUP-*.json,
one a group of the full run, tools/device_sanitize.sh GROUP): the newest file of each group, a row a group
with its error count under each tool (the targets that have any named), its wall time under each tool, and
the run's notes (where a target ran otherwise under one tool, and why); the newest --quick run last, its
own row."""

from __future__ import annotations

import json
import re
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
GROUPS = ("forward", "backward", "triton", "fused", "step", "llama", "train")  # tools/sanitize.py's, in its order


def group_of(result: dict) -> str:
    """The group a file ran: its `group` field, or (older files) the command's --group or --only."""
    if result.get("group"):
        return result["group"]
    found = re.search(r"--(?:group|only|kernels)[ =](\S+)", result.get("command", ""))
    return found.group(1) if found else "everything"


def label_of(result: dict) -> str:
    """A row's name: the group, `(--quick)` after a quick run's (`--parallel` too where the tools ran at once)."""
    flags = ["--quick"] * bool(result.get("quick")) + ["--parallel"] * bool(result.get("parallel"))
    return group_of(result) + (f" ({' '.join(flags)})" if result.get("quick") else "")


def newest_per_group(paths: list[Path]) -> list[tuple[Path, dict]]:
    """The newest full-run file of each group, GROUPS' order, then any other group by name; then the newest
    --quick run of each group (`everything`: tools/device_sanitize.sh quick)."""
    chosen: dict[tuple[bool, str], tuple[Path, dict]] = {}
    for path in sorted(paths, key=lambda p: p.stem.rsplit("-", 1)[-1]):
        result = json.loads(path.read_text())
        chosen[bool(result.get("quick")), group_of(result)] = (path, result)
    order = {g: k for k, g in enumerate(GROUPS)}
    return [chosen[key] for key in sorted(chosen, key=lambda key: (key[0], order.get(key[1], len(order)), key[1]))]


def cell(result: dict, tool: str) -> str:
    """0, or the errors under `tool` summed with the targets that have them (`+` where a count is a floor:
    the tool stopped printing); skipped cells named apart. A kernels/fused file this group did not launch
    (`0 not launched`) is another group's to count."""
    if tool not in result.get("tools", TOOLS):
        return "not run"
    counts, floor, other = {}, False, []
    for target, by_tool in result["cells"].items():
        value = by_tool.get(tool)
        if isinstance(value, str) and (found := re.fullmatch(r"(\d+)(\+?)( not launched)?", value)):
            # "N not launched" with N > 0: a child stopped before it named the files it launched (older files)
            value, floor = int(found.group(1)), floor or bool(found.group(2))
        if isinstance(value, int):
            if value:
                counts[target] = value
        elif value is not None and not value.endswith("not launched"):
            other.append(f"{target}: {value}")
    text = f"{sum(counts.values())}{'+' * floor}"
    if counts:
        text = f"**{text}** (" + ", ".join(f"{t} {n}" for t, n in counts.items()) + ")"
    return "; ".join([text] + other)


def render_sanitize(entries: list[tuple[Path, dict]], rel) -> str:
    """The table: a row a group (its file linked through rel(path)), then the notes."""
    lines = ["| group | targets | " + " | ".join(TOOLS) + " | seconds (" + ", ".join(TOOLS) + ") | file |",
             "|:---|---:|" + "---:|" * len(TOOLS) + "---:|:---|"]
    notes = []
    for path, result in entries:
        seconds = result.get("tool_seconds", {})
        wall = " / ".join(f"{seconds[t]:.0f}" if t in seconds else "-" for t in TOOLS)
        library = result.get("initcheck_library", "excluded")  # tools/sanitize.py --initcheck-library
        label = label_of(result) + (f" (initcheck: cuBLAS {library})" if library != "excluded" else "")
        lines.append(f"| {label} | {len(result['targets'])} | "
                     + " | ".join(cell(result, t) for t in TOOLS)
                     + f" | {wall} | [{path.name}]({rel(path)}) |")
        for target, by_tool in sorted(result.get("notes", {}).items()):
            notes += [f"- {target} under {tool}: {note}" for tool, note in by_tool.items()]
        notes += [f"- {group_of(result)}: {problem}" for problem in result.get("problems", [])]
    devices = sorted({r["setup"].get("device", "?") for _, r in entries})
    commits = sorted({r["setup"].get("git", "?") for _, r in entries})
    head = (f"Every group of the full run (`tools/device_sanitize.sh GROUP`), its newest file, and the newest quick "
            f"run (`tools/device_sanitize.sh quick`, one shape a target), last: {', '.join(devices)}; "
            f"commit {', '.join(commits)}. A cell counts the tool's errors over the group's targets; a run with "
            f"`--parallel` ran its tools at once, each one's seconds the longest of its children's.")
    notes = list(dict.fromkeys(notes))  # a note the full run's group and the quick run both carry: once
    return "\n".join([head, ""] + lines + ([""] + notes if notes else []))
