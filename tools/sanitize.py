"""compute-sanitizer over everything the lab launches: every rung (forward, backward, Triton), every kernel
of kernels/fused through the GPT-2 engine's own launch code, and the persistent decode step, under
memcheck, racecheck, initcheck and synccheck; a table of errors per kernel and tool at the end.

    python3 tools/sanitize.py                                   everything, every tool
    python3 tools/sanitize.py --quick --tools synccheck         one shape a rung, one tool
    python3 tools/sanitize.py --only v17,fused,step             some targets: names, globs (v1*), groups
    python3 tools/sanitize.py --list                            the targets, by group

What each target launches and checks: tools/sanitize_targets.py. Each tool runs the targets in one child
process under `compute-sanitizer --tool TOOL`; when a child dies (a tool may stop a launch it finds wrong,
and the CUDA context goes with it) a new one goes on from the next target. A report counts against the
target that was running, or, when it names a kernel of kernels/fused, against that kernel's file. Exit
status 0 only when no tool reports an error, every result is right, and (with every engine target chosen)
every file of kernels/fused was launched. A target that runs otherwise under one tool says so in a note,
printed under the table and kept in the json (v17 under synccheck: where that tool is sound).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sanitize_targets as targets  # noqa: E402  (beside this file)

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
FUSED_DIR = ROOT / "kernels" / "fused"
PREFIX = "========="  # every line compute-sanitizer prints
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, \d+ warnings?\)")
NOT_REPORTS = ("COMPUTE-SANITIZER", "Target application returned an error", "Error: process didn't terminate")
STATES = ("wrong", "failed", "crashed", "timed out", "not run")  # a target's status, shortened for the table
GLOBAL = re.compile(r"__global__\s+void\s+(?:__\w+__\s*(?:\([^()]*\))?\s*)*(\w+)\s*\(")
# Kernels of NVIDIA's libraries (cuBLAS's nvjet and cublasLt kernels, under the lab's bfloat16 products):
# their reports are shown on a row of their own and do not fail the run (they are not the lab's code).
LIBRARY = re.compile(r"^(nvjet|cublas|cublasLt|cutlass|cudnn|sm\d+_xmma)")


# -- reading the tool's output ---------------------------------------------------------------------


@dataclass
class Report:
    """One report of the tool: the target running when it came ("" before the first), the function it
    names ("" for none, as for an API call's error), its first line, and whether it is an error (not a
    warning)."""

    target: str
    kernel: str
    text: str
    error: bool = True


@dataclass
class Child:
    """What one child process under the tool left: its reports; each target's status in the order begun
    (ok, wrong: ..., skipped: ..., failed: ..., or running when it never ended); the kernels/fused files
    each engine target launched; the tool's own count of errors (None when it printed none); and what a
    target ran otherwise under this tool than under the others, and why (its note)."""

    reports: list[Report] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    covers: dict[str, list[str]] = field(default_factory=dict)
    summary: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # each target's wall time under the tool
    capped: str = ""  # the target during which the tool's --print-limit was reached (its count is a floor)
    notes: dict[str, str] = field(default_factory=dict)


def split_mark(line: str) -> tuple[str, str, str]:
    """`@@ sanitize end NAME STATUS ...` -> ("end", "NAME", "STATUS ...")."""
    word, name, rest = (line[len(targets.MARK):].split(maxsplit=2) + ["", ""])[:3]
    return word, name, rest


def function_at(where: str) -> str:
    """The function of a report's location, without its parameters: from `NAME(args)+0x1a0 in f.cu:57`,
    `0x1a0 in NAME(args)`, `f.cu:57 in NAME(args)` or `NAME+0x1a0`; template arguments kept."""
    m = re.match(r"(?:0x[0-9a-fA-F]+|\S+:\d+) in (.+)$", where)
    name = (m.group(1) if m else where).strip().removeprefix("void ")
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if depth == 0 and (ch in "( " or name.startswith("+0x", i)):
            return name[:i]
    return name


def kernel_of(text: str) -> str:
    """The function a report's line names after `at` ("" when it names none)."""
    m = re.search(r"(?:^|\s)at (.+)$", text)
    return function_at(m.group(1)) if m else ""


def base(kernel: str) -> str:
    m = re.match(r"[A-Za-z_]\w*", kernel)
    return m.group(0) if m else ""


def is_report(line: str) -> bool:
    """Whether a line of the tool's output opens a report (not a detail, the summary or the tool's own)."""
    if not line.startswith(PREFIX):
        return False
    body = line[len(PREFIX):]
    text = body.strip()
    return bool(text) and len(body) - len(body.lstrip()) <= 1 and not SUMMARY.search(text) \
        and not RACE_SUMMARY.search(text) and not text.startswith(NOT_REPORTS)


def parse(lines) -> Child:
    """The reports, statuses, launched files and error count in one child's output (stdout and stderr)."""
    child, target, report = Child(), "", None
    for line in lines:
        if line.startswith(targets.MARK):
            word, name, rest = split_mark(line)
            if word == "begin":
                target, child.status[name] = name, "running"
            elif word == "end":
                target, child.status[name] = "", rest or "ok"
            elif word == "covers":
                child.covers[name] = rest.split()
            elif word == "note":
                child.notes[name] = rest
            report = None
            continue
        if not line.startswith(PREFIX) or not line[len(PREFIX):].strip():
            continue
        body = line[len(PREFIX):]
        text = body.strip()
        if len(body) - len(body.lstrip()) > 1:  # a detail of the report above
            if report is not None and text.startswith("at ") and not report.kernel:
                report.kernel = kernel_of(text)
            elif report is not None and text.startswith("Device Frame:"):  # the last is the kernel itself
                report.kernel = function_at(text.removeprefix("Device Frame:").strip())
            continue
        report = None
        counted = SUMMARY.search(text) or RACE_SUMMARY.search(text)
        if counted:
            child.summary = max(child.summary or 0, int(counted.group(1)))
        elif not text.startswith(NOT_REPORTS):
            report = Report(target, kernel_of(text), text, error=not text.startswith("Warning"))
            child.reports.append(report)
    return child


def fused_kernels(folder: Path = FUSED_DIR) -> dict[str, str]:
    """{kernel function: file stem} for every __global__ function of kernels/fused/*.cu."""
    return {m.group(1): path.stem for path in sorted(folder.glob("*.cu")) for m in GLOBAL.finditer(path.read_text())}


# -- the table -------------------------------------------------------------------------------------


def row_of(r: Report, fused: dict[str, str]) -> str:
    """The row a report counts on: a kernels/fused file, a library kernel, a CuPy kernel (named apart from
    the rung whose target launched it, yet the lab's to answer for), the child's setup, or the target."""
    kernel = base(r.kernel)
    if kernel in fused:
        return f"fused/{fused[kernel]}"
    if LIBRARY.match(kernel):
        return f"library/{kernel}"
    if r.target == targets.SETUP:
        return f"library/{targets.SETUP}"
    if kernel.startswith("cupy_"):
        return f"{r.target or '(no target)'} in {kernel}"
    return r.target or "(no target)"


def summarize(tools, runs: dict[str, list[Child]], chosen: list[str], fused: dict[str, str]):
    """(rows, problems): rows maps a kernel (a target, or fused/FILE) to {tool: cell}, a cell being its
    error count with what went wrong beside it; problems says what makes the exit status 1."""
    engine = [name for name in chosen if name in targets.ENGINE]
    rows = {name: {} for name in chosen}
    rows.update({f"fused/{file}": {} for file in sorted(set(fused.values()))} if engine else {})
    problems = []
    for tool in tools:
        errors, warnings, status, covers, capped = Counter(), Counter(), {}, {}, set()
        for child in runs[tool]:
            status.update(child.status)
            for name, files in child.covers.items():
                covers.setdefault(name, set()).update(files)
            for r in child.reports:
                row = row_of(r, fused)
                (errors if r.error else warnings)[row] += 1
            printed = sum(r.error for r in child.reports)
            if child.capped:
                capped.add(child.capped)
            elif (child.summary or 0) > printed:
                problems.append(f"{tool}: the tool counted {child.summary} errors and printed {printed} "
                                "(--print-limit)")
        for row in [*rows, *sorted((set(errors) | set(warnings)) - set(rows))]:
            cell = str(errors[row]) + ("+" if row in capped else "") + (f" +{warnings[row]}w" if warnings[row] else "")
            if row in chosen:
                state = status.get(row, "not run")
                if state.startswith("skipped"):
                    cell = "skipped"
                elif state != "ok":
                    cell += " " + next((w for w in STATES if state.startswith(w)), state)
                    problems.append(f"{tool} {row}: {state}")
            elif (row.startswith("fused/") and not errors[row]  # a file with a report was launched
                  and not any(row[6:] in covers.get(name, ()) for name in engine)):
                cell += " not launched"
                if set(targets.ENGINE) <= set(chosen):
                    problems.append(f"{tool} {row}: no engine target launched it")
            if errors[row] and not row.startswith("library/"):
                problems.append(f"{tool} {row}: {errors[row]} error{'s' * (errors[row] != 1)}")
            rows.setdefault(row, {})[tool] = cell
    return rows, problems


def table(tools, rows: dict[str, dict[str, str]]) -> str:
    width = max(len("kernel"), *map(len, rows))
    cols = {tool: max(len(tool), *(len(cells.get(tool, "-")) for cells in rows.values())) for tool in tools}
    lines = ["kernel".ljust(width) + "".join(f"  {tool:<{cols[tool]}}" for tool in tools)]
    lines += [name.ljust(width) + "".join(f"  {cells.get(tool, '-'):<{cols[tool]}}" for tool in tools)
              for name, cells in rows.items()]
    return "\n".join(lines)


# -- running ---------------------------------------------------------------------------------------


def select(spec: str | None, groups: dict[str, list[str]], resolve) -> list[str]:
    """The targets `spec` names, in run order: comma-separated groups, target names, globs over them
    (v1*) or rungs' short names (v17, b2: `resolve`); every target without a spec. ValueError for one
    that names nothing."""
    every = [name for names in groups.values() for name in names]
    if not spec:
        return every
    chosen = set()
    for token in filter(None, (t.strip() for t in spec.split(","))):
        if token in groups:
            chosen.update(groups[token])
        elif token in every:
            chosen.add(token)
        elif any(c in token for c in "*?["):
            hits = fnmatch.filter(every, token)
            if not hits:
                raise ValueError(f"{token!r} matches no target (--list shows them)")
            chosen.update(hits)
        else:
            chosen.add(resolve(token))
    return [name for name in every if name in chosen]


# cuBLAS's kernels (the bfloat16 products of the prefill) under initcheck: checked, it floods on their split-K
# workspace (about 18,000 reports a run) and would hide the lab's own past --print-limit; so by default
# (zeroed) their split-K reduction is left out and every product's output zeroed first, the mode every
# group's committed initcheck row is clean in (docs/ladder.md#sanitizer).
# Only there: racecheck with them left out failed inside the tool (an internal error, then an illegal
# address) where racecheck over them ran through. Left out (excluded), their kernels' stores go unseen
# too, and a kernel that then reads a product is reported (a training step's thousands of such reads ran
# initcheck past 500 s); tools/initcheck_library.py runs its cases under each
# way of treating them (LIBRARY_MODES) to tell which holds.
LIBRARY_KERNELS = ("nvjet", "cublas")  # substrings of their names
LIBRARY_MODES = {  # --initcheck-library: (the tool's extra arguments, the child's extra environment)
    "excluded": ([arg for name in LIBRARY_KERNELS for arg in ("--kernel-name-exclude", f"kns={name}")], {}),
    "checked": ([], {}),
    # cuBLAS's default workspace pool cut to 8 buffers of 16 KiB (its reproducibility setting): too small
    # for a split-K workspace, so its kernels can be checked with the rest
    "small-workspace": ([], {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}),
    # checked, and every product's output zeroed first (lm.products.ZERO_OUTPUTS): the tool does not see
    # stores through the async proxy (tools/initcheck_library.py's bulk-store case), which cuBLAS's Hopper
    # kernels make for some products, and then reports the kernel that reads one. cuBLAS's split-K
    # reduction is left out: it reads the workspace the product's kernel stored that way (cuBLAS's own
    # memory, no lab kernel's) and its reports would fill --print-limit, the lab's count a floor after them
    "zeroed": (["--kernel-name-exclude", "kns=splitKreduce"], {"LAB_ZERO_PRODUCTS": "1"}),
}


def command(sanitizer: str, tool: str, names: list[str], quick: bool, print_limit: int,
            library: str = "zeroed") -> list[str]:
    extra = LIBRARY_MODES[library][0] if tool == "initcheck" else []
    return [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", str(print_limit), *extra,
            sys.executable, str(Path(targets.__file__).resolve()), f"--tool={tool}", *(["--quick"] if quick else []),
            *names]


def child_env(tool: str, library: str = "zeroed") -> dict[str, str]:
    """The child's environment: this process's, with the library mode's additions under initcheck."""
    return {**os.environ, **(LIBRARY_MODES[library][1] if tool == "initcheck" else {})}


@dataclass
class Streamed:
    """A child's output and how it ended: its exit code, whether it was stopped at the timeout, each
    target's wall time, and the target during which --print-limit was reached ("" if never)."""

    lines: list[str]
    code: int
    timed_out: bool
    seconds: dict[str, float]
    capped: str


# The running children's process groups. A child runs in a session of its own, so that a timeout stops the
# tool and the process under it together; so nothing stops it when sanitize.py itself is stopped (timeout's
# SIGTERM, Ctrl-C) but this: left alone it would run on unwatched (its timeout is this process's to keep)
# beside whatever the machine does next, a benchmark included.
CHILDREN: set[int] = set()
SPAWNING = threading.RLock()  # a child is started and registered at once, never between a stop's kills


def stop_children(signum, frame=None):
    """The handler of SIGTERM, SIGINT and SIGHUP (stop_children_with_me): every running child's process
    group killed, then this process gone at once (its threads would otherwise start the next children)."""
    with SPAWNING:
        for pid in list(CHILDREN):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"sanitize.py: stopped by signal {signum}; {len(CHILDREN)} running children killed",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)


def stop_children_with_me():
    """SIGTERM, SIGINT and SIGHUP stop the running children too (main calls this before the first)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop_children)


def stream(cmd: list[str], timeout: float, tool: str, print_limit: int, env: dict | None = None) -> Streamed:
    """Run cmd, echoing its output as it comes. Once the tool has printed print_limit reports it prints no
    more, and a later target's errors would be counted but not told apart: the child is stopped at the end
    of the target during which the limit was reached, and the caller goes on from the next one."""
    with SPAWNING:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                start_new_session=True, env=env)
        CHILDREN.add(proc.pid)
    try:
        return _follow(proc, timeout, tool, print_limit)
    finally:
        CHILDREN.discard(proc.pid)


def _follow(proc: subprocess.Popen, timeout: float, tool: str, print_limit: int) -> Streamed:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline, seen, started, seconds = time.monotonic() + timeout, [], {}, {}
    running, reports, capped = "", 0, ""
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # the tool and the child under it (a session of their own)
            return Streamed(seen, proc.wait(), True, seconds, capped)
        if line == "":
            continue
        if line is None:
            return Streamed(seen, proc.wait(), False, seconds, capped)
        seen.append(line)
        if not line.startswith(targets.MARK):
            reports += is_report(line)
            if reports >= print_limit and not capped and running not in ("", targets.SETUP):
                capped = running
            print(f"    [{tool}] {line}", flush=True)
            continue
        word, name, rest = split_mark(line)
        if word == "begin":
            running, started[name] = name, time.monotonic()
            print(f"[{tool}] {name}", flush=True)
        elif word == "end":
            running, seconds[name] = "", time.monotonic() - started.get(name, time.monotonic())
            print(f"[{tool}] {name}: {rest} ({seconds[name]:.1f} s)", flush=True)
            if capped and capped == name:
                os.killpg(proc.pid, signal.SIGKILL)
                return Streamed(seen, proc.wait(), False, seconds, capped)


def run_tool(sanitizer: str, tool: str, names: list[str], args) -> list[Child]:
    """Every target under one tool: a child process, and a new one after the target where one died or
    where the tool's --print-limit was reached."""
    children, left = [], list(names)
    while left:
        out = stream(command(sanitizer, tool, left, args.quick, args.print_limit, args.initcheck_library),
                     args.timeout, tool, args.print_limit, child_env(tool, args.initcheck_library))
        child = parse(out.lines)
        child.seconds, child.capped = out.seconds, out.capped
        children.append(child)
        for name, state in child.status.items():
            if state == "running":
                child.status[name] = (f"timed out after {args.timeout:g} s" if out.timed_out
                                      else f"crashed (exit {out.code})")
        begun = [name for name in child.status if name in left]  # not the child's setup
        if not begun:
            child.status.update({name: f"failed: the child exited ({out.code}) before its first target"
                                 for name in left})
            break
        left = left[left.index(begun[-1]) + 1:]
    return children


# Under --parallel, racecheck's targets are split among this many children at once: one racecheck child
# over everything takes five times as long as any other tool (the engine targets' thousands of launches,
# each one's shared memory tracked), and the run would wait on it alone.
PARALLEL_SHARDS = {"racecheck": 4}


def past_seconds(quick: bool, folder: Path = ROOT / "results") -> dict[str, dict[str, float]]:
    """{target: {tool: seconds}} from the committed runs of the same kind (--quick or not), the newest
    one's where several hold a target: what --parallel balances a tool's shards by."""
    runs = []
    for path in folder.glob("sanitize-*.json"):
        run = json.loads(path.read_text())
        if run.get("quick") == quick:
            runs.append((run.get("setup", {}).get("date", ""), run.get("seconds", {})))
    out: dict[str, dict[str, float]] = {}
    for _, seconds in sorted(runs, key=lambda r: r[0]):
        for name, by_tool in seconds.items():
            out.setdefault(name, {}).update(by_tool)
    return out


def shards(names: list[str], n: int, cost: dict[str, float]) -> list[list[str]]:
    """names in at most n groups of about equal cost, each group in names' order: the costliest first, each
    to the group with the least so far (a target of unknown cost counts the known ones' mean, else 1)."""
    known = [cost[name] for name in names if name in cost]
    mean = sum(known) / len(known) if known else 1.0
    groups: list[list[str]] = [[] for _ in range(max(1, min(n, len(names))))]
    totals = [0.0] * len(groups)
    for name in sorted(names, key=lambda name: -cost.get(name, mean)):
        least = totals.index(min(totals))
        groups[least].append(name)
        totals[least] += cost.get(name, mean)
    return [[name for name in names if name in group] for group in groups if group]


def run_tools(sanitizer: str, names: list[str], args) -> tuple[dict, dict]:
    """Every tool of args.tools over the targets: one after another, or with --parallel all at once, each
    tool its own children on the GPU beside the others' (racecheck's targets split among PARALLEL_SHARDS
    children by their committed seconds; the run takes about its slowest child's time, each tool's seconds
    longer than alone). Each tool's children, and its wall seconds."""

    def one(tool: str, mine: list[str]) -> tuple[list[Child], float]:
        began = time.monotonic()
        children = run_tool(sanitizer, tool, mine, args)
        seconds = round(time.monotonic() - began, 1)
        print(f"[{tool}] {len(mine)} targets in {seconds:.0f} s", flush=True)
        return children, seconds

    if not args.parallel:
        done = {tool: one(tool, names) for tool in args.tools}
        return {tool: d[0] for tool, d in done.items()}, {tool: d[1] for tool, d in done.items()}
    cost = past_seconds(args.quick)
    jobs = [(tool, part) for tool in args.tools
            for part in shards(names, PARALLEL_SHARDS.get(tool, 1),
                               {name: by_tool[tool] for name, by_tool in cost.items() if tool in by_tool})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = list(pool.map(lambda job: one(*job), jobs))
    runs = {tool: [child for (t, _), (children, _) in zip(jobs, done) if t == tool for child in children]
            for tool in args.tools}
    return runs, {tool: max(s for (t, _), (_, s) in zip(jobs, done) if t == tool) for tool in args.tools}


# -- the json --------------------------------------------------------------------------------------


def cells(tools, rows: dict[str, dict[str, str]], runs: dict[str, list[Child]]) -> dict:
    """The table for a file: a clean cell as its count (int), a skipped one as `skipped: why`, any other
    as the table's text (a count and what went wrong, `+` where --print-limit made it a floor)."""
    status = {tool: {name: state for child in runs[tool] for name, state in child.status.items()} for tool in tools}
    out = {}
    for row, by_tool in rows.items():
        out[row] = {}
        for tool, cell in by_tool.items():
            state = status[tool].get(row, "")
            out[row][tool] = (state if state.startswith("skipped") else int(cell) if cell.isdigit() else cell)
    return out


def per_target(tools, runs: dict[str, list[Child]], field: str) -> dict:
    """{target: {tool: value}} from each child's `field`: "seconds" (wall seconds under the tool, rounded to
    0.1 s) or "notes" (what a target ran otherwise under a tool than under the others, and why)."""
    out: dict[str, dict] = {}
    for tool in tools:
        for child in runs[tool]:
            for name, value in getattr(child, field).items():
                out.setdefault(name, {})[tool] = round(value, 1) if field == "seconds" else value
    return out


def first_reports(tools, runs: dict[str, list[Child]], fused: dict[str, str], keep: int = 3) -> dict:
    """{row: {tool: [its first `keep` reports: the line and the kernel named]}}, for the rows that have any."""
    out: dict[str, dict[str, list[str]]] = {}
    for tool in tools:
        for child in runs[tool]:
            for r in child.reports:
                kept = out.setdefault(row_of(r, fused), {}).setdefault(tool, [])
                if len(kept) < keep:
                    kept.append(f"{r.text} (in {r.kernel or 'no kernel named'})")
    return out


def find_sanitizer() -> str | None:
    """compute-sanitizer's path (PATH, else the toolkit's usual place), or None with a line on stderr."""
    path = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if Path(path).exists():
        return path
    print("compute-sanitizer not found (it ships with the CUDA toolkit)", file=sys.stderr)
    return None


def cases_under_tool(names, under, line) -> list[dict] | None:
    """A reproducer's run: each case in turn through under(sanitizer, name) (its row, a dict), line(name,
    row) printed as it comes; the rows, or None (a line on stderr) where compute-sanitizer is missing."""
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return None
    rows = []
    for name in names:
        rows.append(under(sanitizer, name))
        print(line(name, rows[-1]), flush=True)
    return rows


def told(rows: list[dict] | None, cases: dict, verdict) -> int:
    """A reproducer's ending: 2 where compute-sanitizer is missing (rows None); else each case's `what`
    and the verdict on the rows, and 0."""
    if rows is None:
        return 2
    print()
    for name, case in cases.items():
        print(f"  {name:22s} {case.what}")
    print(f"\n{verdict(rows)}")
    return 0


def case_under_tool(sanitizer: str, tool: str, script: str, name: str, timeout: float, mark: str,
                    library: str = "checked"):
    """A reproducer's case (`script --case name`) in a child process under the tool, cuBLAS's kernels
    treated under initcheck as --initcheck-library `library` treats them: (the tool's Child, the fields
    after `mark` of the case's last line that starts with it, or where it printed none why: "timed out"
    or "crashed"). tools/synccheck_cluster.py, initcheck_library.py and racecheck_ring.py."""
    extra = LIBRARY_MODES[library][0] if tool == "initcheck" else []
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "5", *extra, sys.executable,
           script, "--case", name]
    why = "crashed"
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=child_env(tool, library))
        lines = proc.stdout.splitlines()
    except subprocess.TimeoutExpired as exc:
        lines, why = (exc.stdout or b"").decode(errors="replace").splitlines(), "timed out"
    mine = [line[len(mark):].split() for line in lines if line.startswith(mark)]
    return parse(lines), (mine[-1] if mine else why)


def setup(sanitizer: str) -> dict:
    """The device and the tool's version, for the file's reader (nvidia-smi's and compute-sanitizer's words)."""
    def first(cmd):
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60)
            return next((line.strip() for line in done.stdout.splitlines() if line.strip()), "")
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = os.environ.get("LAB_COMMIT") or first(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"])
    return {"device": first(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
            "git": commit or "unknown",
            "compute_sanitizer": first([sanitizer, "--version"]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def tool_list(text: str) -> list[str]:
    tools = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        raise argparse.ArgumentTypeError(f"unknown tool {', '.join(unknown) or '(none)'}: choose from {', '.join(TOOLS)}")
    return tools


def positive(kind):
    def parse_positive(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse_positive


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", "--kernels", dest="only",
                        help="comma-separated targets: names (v17, b02, t01, fused-float32), globs (v1*), groups "
                             "(forward, backward, triton, fused, step); default: all")
    parser.add_argument("--group", help="comma-separated groups (forward, backward, triton, fused, step, llama): "
                                             "the full run split into device calls of a few minutes each")
    parser.add_argument("--tools", type=tool_list, default=list(TOOLS), help=f"comma-separated: {', '.join(TOOLS)}")
    parser.add_argument("--quick", action="store_true", help="one shape a rung (the awkward one; a split-KV rung "
                                                             "also its decode step)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the tools at once, each its own children, racecheck's targets split among "
                             f"{PARALLEL_SHARDS['racecheck']} (tools/device_sanitize.sh quick does): the run "
                             "takes about its slowest child's time")
    parser.add_argument("--list", action="store_true", help="print the chosen targets by group, and exit")
    parser.add_argument("--timeout", type=positive(float), default=540.0,
                        help="seconds one child process may run before it is stopped (default 540)")
    parser.add_argument("--print-limit", type=positive(int), default=100, help="reports the tool prints per child")
    parser.add_argument("--initcheck-library", choices=list(LIBRARY_MODES), default="zeroed",
                        help="cuBLAS's kernels under initcheck: checked with every product's output zeroed "
                             "first (zeroed, the default: stores through the async proxy go unseen), left out "
                             "(excluded: their stores go unseen, so reads of a product are reported), "
                             "checked, or checked with cuBLAS's workspace cut below a split-K's "
                             "(small-workspace); tools/initcheck_library.py compares them")
    parser.add_argument("--json", help="write the cells, each target's seconds per tool, the first reports of "
                                       "each row, the targets' notes and the problems to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    groups = targets.groups()
    try:
        unknown = [g for g in (args.group or "").split(",") if g.strip() and g.strip() not in groups]
        if unknown:
            raise ValueError(f"unknown group {', '.join(unknown)}: choose from {', '.join(groups)}")
        chosen = select(",".join(filter(None, (args.only, args.group))), groups, targets.resolve)
    except ValueError as exc:
        print(f"sanitize.py: {exc}", file=sys.stderr)
        return 2
    if not chosen:
        print("sanitize.py: no target chosen", file=sys.stderr)
        return 2
    if args.list:
        for group, names in groups.items():
            if mine := [n for n in names if n in chosen]:
                print(f"{group:9s} {' '.join(mine)}")
        return 0
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return 2
    stop_children_with_me()
    start = time.monotonic()
    runs, tool_seconds = run_tools(sanitizer, chosen, args)
    rows, problems = summarize(args.tools, runs, chosen, fused_kernels())
    print(f"\n{table(args.tools, rows)}\n")
    told = per_target(args.tools, runs, "notes")
    for name, by_tool in told.items():
        for tool, text in by_tool.items():
            print(f"note: {name} under {tool}: {text}")
    print("\n".join(problems) if problems else "clean: no errors, every result right")
    print(f"({time.monotonic() - start:.0f} s)")
    if args.json:
        result = {"command": "python3 tools/sanitize.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "setup": setup(sanitizer), "group": args.group or args.only or "everything",
                  "quick": args.quick, "parallel": args.parallel, "tools": args.tools, "initcheck_library": args.initcheck_library,
                  "targets": chosen,
                  "cells": cells(args.tools, rows, runs), "seconds": per_target(args.tools, runs, "seconds"),
                  "tool_seconds": tool_seconds, "reports": first_reports(args.tools, runs, fused_kernels()),
                  "notes": told, "problems": problems}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
