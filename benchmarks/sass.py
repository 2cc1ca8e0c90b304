"""`bench.py sass`: where a rung's warps wait, instruction by instruction, from Nsight Compute's source view.

    python3 bench.py sass --kernels v26,v27 --cases 2x32x4096-d128 --dtype bfloat16
    python3 bench.py sass --from-csv v27-sass.csv            a source page saved earlier, no GPU

bench.py profile gives a rung's counters as totals: the tensor pipe busy so much, the top stall `wait`. This
says which instructions those are. Each rung runs once at each shape under ncu with the full set of sections
(its SourceCounters sample where every warp stands, issuing or stalled, and count every SASS instruction
executed), as bench.py profile runs it (benchmarks/profile_target.py: one launch between cudaProfilerStart
and Stop, clocks unlocked); then ncu prints the report's source page as CSV, one row per SASS instruction.
The tables: each opcode's share of the instructions executed and of the warps' samples, and the
instructions where the most samples fell, with their SASS. A sample counts a warp at an instruction it has
not yet issued: the instruction it waits to issue, so the wait shows at the consumer of a late value (an
FMNMX after a MUFU), a `WARPGROUP.DEPBAR` for the tensor cores, a `BRA` spinning on an mbarrier. The
producer's spins count too (one warp of the block's 12 or 16), idle by design while the ring is full.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import kernels

from . import device, frontier
from .device import progress
from .options import kernel_list, results_option
from .profile import NCU_TIMEOUT_S, case_list, find_ncu, ncu_version, skip_reason, target_args
from .results import result_path, write_result, wrote

SCHEMA = 1
TOP = 20  # instructions listed, by their share of the samples
SAMPLES, EXECUTED, SOURCE = "Warp Stall Sampling (All Samples)", "Instructions Executed", "Source"


def report_command(ncu: str, report: Path, target: list[str]) -> list[str]:
    """ncu on one launch (the target's cudaProfilerStart/Stop), clocks unlocked, every section (the source
    counters among them) into `report`."""
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--set", "full", "--import-source", "no",
            "-f", "-o", str(report.with_suffix("")), *target]


def source_command(ncu: str, report: Path) -> list[str]:
    """The report's source page, SASS only, as CSV: one row per instruction."""
    return [ncu, "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"]


def parse_source(text: str) -> list[dict]:
    """ncu's source page (CSV, after whatever else it printed) -> [{"address", "sass", "opcode", "samples",
    "executed"}] in program order. The opcode is the SASS mnemonic without its predicate and modifiers."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no source page in ncu's output (a header row starting with \"Address\")")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    missing = {SOURCE, SAMPLES, EXECUTED} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"ncu's source page lacks the columns {', '.join(sorted(missing))} (run with --set full)")
    rows = []
    for r in reader:
        words = (r[SOURCE] or "").split()
        if not words:
            continue
        mnemonic = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        rows.append({"address": r["Address"], "sass": " ".join(words), "opcode": mnemonic.split(".")[0],
                     "samples": number(r[SAMPLES]), "executed": number(r[EXECUTED])})
    if not rows:
        raise ValueError("ncu's source page has no instructions")
    return rows


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def number(text: str) -> int:
    text = (text or "").replace(",", "").strip()
    return int(float(text)) if text else 0


def summarize(rows: list[dict], top: int = TOP) -> dict:
    """Each opcode's share of the samples and of the instructions executed (largest sample share first), and
    the `top` instructions by samples (their index in program order, SASS, shares)."""
    samples, executed = sum(r["samples"] for r in rows), sum(r["executed"] for r in rows)
    if not samples or not executed:
        raise ValueError(f"no samples ({samples}) or no instructions executed ({executed}) in the source page")
    by_samples, by_executed = Counter(), Counter()
    for r in rows:
        by_samples[r["opcode"]] += r["samples"]
        by_executed[r["opcode"]] += r["executed"]
    opcodes = [{"opcode": op, "samples": n / samples, "executed": by_executed[op] / executed}
               for op, n in sorted(by_samples.items(), key=lambda item: (-item[1], -by_executed[item[0]], item[0]))]
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:top]
    hot = [{"index": i, "sass": rows[i]["sass"], "samples": rows[i]["samples"] / samples,
            "executed": rows[i]["executed"]} for i in sorted(order)]
    return {"samples": samples, "executed": executed, "instructions": len(rows), "opcodes": opcodes, "hot": hot}


def render(entry: dict, opcodes: int = 16) -> str:
    """One rung at one shape: the opcode table (the first `opcodes` by samples) and the hot instructions."""
    s = entry["summary"]
    lines = [f"**{entry['name']}** {entry.get('case') or ''}: {s['instructions']:,} SASS instructions, "
             f"{s['executed']:,} executed (warp-level), {s['samples']:,} samples", "",
             "| opcode | % of samples | % of instructions executed |", "|:---|---:|---:|"]
    lines += [f"| `{o['opcode']}` | {100 * o['samples']:.1f} | {100 * o['executed']:.1f} |" for o in s["opcodes"][:opcodes]]
    lines += ["", "| # | SASS | % of samples | executed |", "|---:|:---|---:|---:|"]
    lines += [f"| {h['index']} | `{h['sass']}` | {100 * h['samples']:.1f} | {h['executed']:,} |" for h in s["hot"]]
    return "\n".join(lines)


def run_ncu(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=NCU_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what}: ncu exited with status {done.returncode}: " + " | ".join(tail))
    return done.stdout


def sass_entry(ncu: str, path: Path, case, dtype: str, top: int) -> dict:
    """One rung at one frontier case under ncu: its source page, summarized (status "error" and the reason
    where ncu or the page fails)."""
    entry = {"name": path.stem, "case": frontier.case_id(case)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "rung.ncu-rep"
            target = target_args(str(path), frontier.case_id(case), dtype)
            run_ncu(report_command(ncu, report, target), f"{path.stem} {frontier.case_id(case)}")
            rows = parse_source(run_ncu(source_command(ncu, report), f"{path.stem}: the source page"))
        return entry | {"status": "ok", "summary": summarize(rows, top)}
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return entry | {"status": "error", "reason": str(exc)}


def cmd_sass(args) -> int:
    if args.from_csv is not None:
        entry = {"name": args.from_csv.stem, "case": None, "status": "ok",
                 "summary": summarize(parse_source(args.from_csv.read_text()), args.top)}
        print(render(entry))
        return 0
    ncu = find_ncu(args.ncu)
    device.require_gpu()
    setup = device.setup_info(args.argv)
    dev = setup["device"]
    rungs = args.kernels if args.kernels is not None else [kernels.resolve(kernels.names()[-1])]
    entries = []
    for case in args.cases or case_list("2x32x4096-d128"):
        for path in rungs:
            why = skip_reason(path, args.dtype, dev["arch"], case.d)
            if why:
                entries.append({"name": path.stem, "case": frontier.case_id(case), "status": "skipped", "reason": why})
                progress(f"{path.stem} {frontier.case_id(case)}: skipped: {why}")
                continue
            progress(f"{path.stem} {frontier.case_id(case)}: under ncu (every section) ...")
            entries.append(sass_entry(ncu, path, case, args.dtype, args.top))
            if entries[-1]["status"] == "ok":
                print("\n" + render(entries[-1]), flush=True)
            else:
                progress(f"{path.stem} {frontier.case_id(case)}: error: {entries[-1]['reason']}")
    result = {"schema": SCHEMA, "kind": "sass", "setup": setup, "dtype": args.dtype,
              "ncu": {"path": ncu, "version": ncu_version(ncu),
                      "command": " ".join(report_command("ncu", Path("<report>"), ["<target>"]))},
              "entries": entries}
    path = result_path("sass", setup, args.results)
    write_result(result, path)
    progress(wrote(path))
    return 1 if any(e["status"] == "error" for e in entries) else 0


def add_sass_parser(subparsers) -> argparse.ArgumentParser:
    """Declare `sass` and its flags on bench.py's subparsers; bench.py maps the command to cmd_sass."""
    p = subparsers.add_parser(
        "sass", help="where a rung's warps wait, instruction by instruction (Nsight Compute's source view)",
        description="Each rung at each frontier case, one launch under ncu with every section: each SASS "
                    "opcode's share of the instructions executed and of the warps' stall samples, and the "
                    f"instructions where most samples fell (the top {TOP}). --from-csv reads a source page "
                    "saved before (ncu -i REPORT --page source --csv --print-source sass), no GPU.")
    p.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs, comma-separated (v26,v27 or a .cu path); default: the newest rung")
    p.add_argument("--cases", type=case_list, default=None, metavar="LIST",
                   help="frontier cases, comma-separated ids such as 2x32x4096-d128,16x12x2048-d64 (default: "
                        "2x32x4096-d128)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="input dtype (default bfloat16)")
    p.add_argument("--top", type=positive, default=TOP, help=f"instructions listed by their samples (default {TOP})")
    p.add_argument("--ncu", default=None, metavar="PATH",
                   help="Nsight Compute's ncu (default: ncu on PATH, else /usr/local/cuda/bin/ncu)")
    p.add_argument("--from-csv", type=Path, default=None, metavar="FILE",
                   help="summarize a source page saved earlier instead of running anything")
    results_option(p)
    return p

