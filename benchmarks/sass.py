"""`bench.py sass`: where a rung's warps wait, instruction by instruction, from Nsight Compute's source view.

    python3 bench.py sass --kernels v26,v27 --cases 2x32x4096-d128 --dtype bfloat16
    python3 bench.py sass --decode gpt2,gpt2-xl --dtype float32  GPT-2's decode step (the persistent one on sm_90)
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
from .profile import (
    NCU_TIMEOUT_S,
    backward_list,
    case_list,
    find_ncu,
    ncu_version,
    short_kernel_name,
    skip_reason,
    target_args,
)
from .results import result_path, write_result, wrote

SCHEMA = 1
TOP = 20  # instructions listed, by their share of the samples
SAMPLES, EXECUTED, SOURCE = "Warp Stall Sampling (All Samples)", "Instructions Executed", "Source"
EXCESSIVE = "L1 Wavefronts Shared Excessive"  # shared-memory wavefronts past the ideal: bank conflicts


def report_command(ncu: str, report: Path, target: list[str]) -> list[str]:
    """ncu on one launch (the target's cudaProfilerStart/Stop), clocks unlocked, every section (the source
    counters among them) into `report`."""
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--set", "full", "--import-source", "no",
            "-f", "-o", str(report.with_suffix("")), *target]


def source_command(ncu: str, report: Path) -> list[str]:
    """The report's source page, SASS only, as CSV: one row per instruction."""
    return [ncu, "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"]


def parse_source(text: str) -> list[dict]:
    """ncu's source page (CSV, after whatever else it printed) -> one {"kernel", "rows"} per kernel on it,
    each kernel's table headed by its "Kernel Name" row (kernel None where the page has no such row).
    A row: {"address", "sass", "opcode", "samples", "executed", "excessive", "stall"} in program order;
    the opcode is the SASS mnemonic without its predicate and modifiers, `excessive` the instruction's
    shared-memory wavefronts beyond the ideal (bank conflicts; 0 where ncu gave no such column), `stall`
    the reason most of its samples give (None where it has none)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Address"')]
    if not starts:
        raise ValueError("no source page in ncu's output (a header row starting with \"Address\")")
    pages = []
    for start, limit in zip(starts, starts[1:] + [len(lines)], strict=True):
        end = next((i for i in range(start + 1, limit) if lines[i].startswith('"Kernel Name"')), limit)
        named = lines[start - 1] if start > 0 and lines[start - 1].startswith('"Kernel Name"') else None
        name = short_kernel_name(next(csv.reader([named]))[1]) if named else None
        pages.append({"kernel": name, "rows": parse_table(lines[start:end])})
    return pages


def parse_table(lines: list[str]) -> list[dict]:
    """One kernel's table of the source page: its header row and its instructions."""
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    fields = reader.fieldnames or ()
    missing = {SOURCE, SAMPLES, EXECUTED} - set(fields)
    if missing:
        raise ValueError(f"ncu's source page lacks the columns {', '.join(sorted(missing))} (run with --set full)")
    stalls = [f for f in fields if f.startswith("stall_") and "(" not in f]  # all samples, not the not-issued
    rows = []
    for r in reader:
        words = (r[SOURCE] or "").split()
        if not words:
            continue
        mnemonic = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        counts = {f.removeprefix("stall_"): number(r[f]) for f in stalls}
        stall = max(counts, key=lambda k: (counts[k], k)) if counts and max(counts.values()) > 0 else None
        rows.append({"address": r["Address"], "sass": " ".join(words), "opcode": mnemonic.split(".")[0],
                     "samples": number(r[SAMPLES]), "executed": number(r[EXECUTED]),
                     "excessive": number(r.get(EXCESSIVE)), "stall": stall})
    if not rows:
        raise ValueError("ncu's source page has no instructions")
    return rows


def size_list(text: str) -> list[str]:
    """'gpt2,gpt2-xl' -> GPT-2 sizes (gpt2.SIZES)."""
    import gpt2

    sizes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in gpt2.SIZES]
    if not sizes or unknown:
        raise argparse.ArgumentTypeError(f"GPT-2 sizes, comma-separated, of {', '.join(gpt2.SIZES)}; got {text!r}")
    return sizes


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def number(text: str) -> int:
    text = (text or "").replace(",", "").strip()
    return int(float(text)) if text else 0


def summarize(rows: list[dict], top: int = TOP) -> dict:
    """Each opcode's share of the samples, of the instructions executed and of the excessive shared
    wavefronts (largest sample share first); the `top` instructions by samples (their index in program
    order, SASS, shares, top stall); and the `top` by excessive wavefronts, where any are."""
    samples, executed = sum(r["samples"] for r in rows), sum(r["executed"] for r in rows)
    excessive = sum(r["excessive"] for r in rows)
    if not samples or not executed:
        raise ValueError(f"no samples ({samples}) or no instructions executed ({executed}) in the source page")
    by_samples, by_executed, by_excessive = Counter(), Counter(), Counter()
    for r in rows:
        by_samples[r["opcode"]] += r["samples"]
        by_executed[r["opcode"]] += r["executed"]
        by_excessive[r["opcode"]] += r["excessive"]
    opcodes = [{"opcode": op, "samples": n / samples, "executed": by_executed[op] / executed,
                "excessive": by_excessive[op] / excessive if excessive else 0.0}
               for op, n in sorted(by_samples.items(), key=lambda item: (-item[1], -by_executed[item[0]], item[0]))]
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:top]
    hot = [{"index": i, "sass": rows[i]["sass"], "samples": rows[i]["samples"] / samples,
            "executed": rows[i]["executed"], "stall": rows[i]["stall"]} for i in sorted(order)]
    order = sorted((i for i in range(len(rows)) if rows[i]["excessive"]), key=lambda i: -rows[i]["excessive"])[:top]
    conflicts = [{"index": i, "sass": rows[i]["sass"], "excessive": rows[i]["excessive"],
                  "share": rows[i]["excessive"] / excessive, "executed": rows[i]["executed"]} for i in sorted(order)]
    return {"samples": samples, "executed": executed, "instructions": len(rows), "excessive": excessive,
            "opcodes": opcodes, "hot": hot, "conflicts": conflicts}


def render(entry: dict, opcodes: int = 16) -> str:
    """One kernel of a rung at one shape: the opcode table (the first `opcodes` by samples), the hot
    instructions and, where the kernel has bank conflicts, the instructions that make them."""
    s = entry["summary"]
    kernel = f" `{entry['kernel']}`" if entry.get("kernel") else ""
    lines = [f"**{entry['name']}**{kernel} {entry.get('case') or ''}: {s['instructions']:,} SASS instructions, "
             f"{s['executed']:,} executed (warp-level), {s['samples']:,} samples, "
             f"{s['excessive']:,} excessive shared wavefronts", "",
             "| opcode | % of samples | % of instructions executed | % of excessive shared wavefronts |",
             "|:---|---:|---:|---:|"]
    lines += [f"| `{o['opcode']}` | {100 * o['samples']:.1f} | {100 * o['executed']:.1f} | {100 * o['excessive']:.1f} |"
              for o in s["opcodes"][:opcodes]]
    lines += ["", "| # | SASS | % of samples | top stall | executed |", "|---:|:---|---:|:---|---:|"]
    lines += [f"| {h['index']} | `{h['sass']}` | {100 * h['samples']:.1f} | {h['stall'] or '-'} | {h['executed']:,} |"
              for h in s["hot"]]
    if s["conflicts"]:
        lines += ["", "| # | SASS | excessive shared wavefronts | % of the kernel's | executed |", "|---:|:---|---:|---:|---:|"]
        lines += [f"| {c['index']} | `{c['sass']}` | {c['excessive']:,} | {100 * c['share']:.1f} | {c['executed']:,} |"
                  for c in s["conflicts"]]
    return "\n".join(lines)


def run_ncu(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=NCU_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what}: ncu exited with status {done.returncode}: " + " | ".join(tail))
    return done.stdout


def entries_of(pages: list[dict], entry: dict, top: int) -> list[dict]:
    """A page's kernels as entries (a rung's name and case, the kernel's name where the page names it), each
    summarized; a kernel with no samples (too short for the sampler) is reported skipped."""
    out = []
    for k in pages:
        e = entry | {"kernel": k["kernel"]}
        try:
            out.append(e | {"status": "ok", "summary": summarize(k["rows"], top)})
        except ValueError as exc:
            out.append(e | {"status": "skipped", "reason": str(exc)})
    return out


def sass_entries(ncu: str, path: Path, case, dtype: str, top: int, backward: bool = False) -> list[dict]:
    """One rung (a backward rung: every kernel of one pass) at one frontier case under ncu: its source page,
    an entry per kernel (one entry with status "error" and the reason where ncu or the page fails)."""
    entry = {"name": path.stem, "case": frontier.case_id(case)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "rung.ncu-rep"
            target = target_args(str(path), frontier.case_id(case), dtype, backward)
            run_ncu(report_command(ncu, report, target), f"{path.stem} {frontier.case_id(case)}")
            pages = parse_source(run_ncu(source_command(ncu, report), f"{path.stem}: the source page"))
        return entries_of(pages, entry, top)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return [entry | {"status": "error", "reason": str(exc)}]


def decode_entries(ncu: str, size: str, dtype: str, top: int) -> list[dict]:
    """One decode step of GPT-2 `size` on gpt2.fast's engine (profile_target --decode) under ncu: an entry
    per kernel it launches (the persistent step's one where it runs), as sass_entries."""
    entry = {"name": f"decode step {size}", "case": dtype}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "decode.ncu-rep"
            run_ncu(report_command(ncu, report, target_args(None, None, dtype, size=size)), f"decode step {size}")
            pages = parse_source(run_ncu(source_command(ncu, report), f"decode step {size}: the source page"))
        return entries_of(pages, entry, top)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return [entry | {"status": "error", "reason": str(exc)}]


def cmd_sass(args) -> int:
    if sum(x is not None for x in (args.backward, args.kernels, args.decode)) > 1:
        raise device.CannotRun("--kernels, --backward and --decode: name one kind of target")
    if args.from_csv is not None:
        for e in entries_of(parse_source(args.from_csv.read_text()), {"name": args.from_csv.stem, "case": None},
                            args.top):
            print(render(e) if e["status"] == "ok" else f"`{e['kernel']}`: {e['reason']}", end="\n\n")
        return 0
    ncu = find_ncu(args.ncu)
    device.require_gpu()
    setup = device.setup_info(args.argv)
    dev = setup["device"]
    entries = []
    for size in args.decode or ():
        progress(f"decode step {size} {args.dtype}: under ncu (every section) ...")
        for e in decode_entries(ncu, size, args.dtype, args.top):
            entries.append(e)
            if e["status"] == "ok":
                print("\n" + render(e), flush=True)
            else:
                progress(f"decode step {size} {e.get('kernel') or ''}: {e['status']}: {e['reason']}")
    backward = args.backward is not None
    rungs = [] if args.decode else args.backward if backward else args.kernels if args.kernels is not None else [
        kernels.resolve(kernels.names()[-1])]
    for case in [] if args.decode else args.cases or case_list("2x32x4096-d128"):
        for path in rungs:
            why = skip_reason(path, args.dtype, dev["arch"], case.d, backward)
            if why:
                entries.append({"name": path.stem, "case": frontier.case_id(case), "status": "skipped", "reason": why})
                progress(f"{path.stem} {frontier.case_id(case)}: skipped: {why}")
                continue
            progress(f"{path.stem} {frontier.case_id(case)}: under ncu (every section) ...")
            for e in sass_entries(ncu, path, case, args.dtype, args.top, backward):
                entries.append(e)
                if e["status"] == "ok":
                    print("\n" + render(e), flush=True)
                else:
                    progress(f"{path.stem} {frontier.case_id(case)} {e.get('kernel') or ''}: {e['status']}: {e['reason']}")
    result = {"schema": SCHEMA, "kind": "sass", "setup": setup, "dtype": args.dtype,
              "direction": "decode" if args.decode else "backward" if backward else "forward",
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
                    "opcode's share of the instructions executed, of the warps' stall samples and of the excessive "
                    f"shared-memory wavefronts (bank conflicts), the instructions where most samples fell (the top "
                    f"{TOP}, each with its top stall) and those that make the bank conflicts. --from-csv reads a source page "
                    "saved before (ncu -i REPORT --page source --csv --print-source sass), no GPU.")
    p.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs, comma-separated (v26,v27 or a .cu path); default: the newest rung")
    p.add_argument("--backward", type=backward_list, default=None, metavar="LIST",
                   help="backward rungs instead (b05,b06 or all): every kernel of one backward pass, after the "
                        "newest forward rung that writes the log-sum-exp (as bench.py profile --backward)")
    p.add_argument("--decode", type=size_list, default=None, metavar="SIZES",
                   help="GPT-2's decode step instead (gpt2,gpt2-xl: sizes of random weights on gpt2.fast's engine, "
                        "one step after a warm-up generation, as bench.py profile's decode row)")
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

