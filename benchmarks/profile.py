"""`bench.py profile`: Nsight Compute's hardware counters for every rung, one launch each.

    python3 bench.py profile                              every rung at 8x1024 float32, and the decode step
    python3 bench.py profile --kernels v13,v18 --dtype bfloat16 --no-decode
    python3 bench.py profile --ncu /usr/local/cuda/bin/ncu --save
    python3 bench.py profile --kernels v21,v22,v23,v24 --dtype bfloat16 --cases 16x12x2048-d64,2x32x4096-d128 --no-decode
    python3 bench.py profile --backward b04,b05 --dtype bfloat16 --cases 16x12x2048-d64,2x32x4096-d128

Each rung runs in a child process under ncu (benchmarks/profile_target.py): prepared and compiled, warmed
up, then one launch between cudaProfilerStart and cudaProfilerStop, which ncu (--profile-from-start off)
replays once per counter pass. Clocks are left as they are (--clock-control none; ncu would lock them to
base), and the SM clock ncu saw is in the table's header. A rung that launches several kernels (a split
and a combine) gets one row per kernel and a row with its total. The decode step's kernels are one step of
gpt2.fast's engine after a warm-up generation. --backward profiles backward rungs instead: one backward pass
each (every phase a kernel of its own row, beside the rung's total), after the newest forward rung that writes
the log-sum-exp, its TFLOP/s at bench.py backward's convention (2.5 x the forward's FLOPs).

Parsing reads ncu's raw page as CSV (--csv --page raw): a header row of metric names, a row of units
("ns", "%", "byte", "byte/s", "hz", scaled ones such as "Kbyte" or "usecond" too), then one row per
kernel, numbers with thousands separators. Every value is converted to base units (seconds, bytes,
bytes/s, Hz) before it is kept.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kernels
from kernels import backward as backward_ladder

from . import backward as backward_bench
from . import ceilings as precision
from . import device, frontier, plots, profile_render, timing
from .cases import DTYPES, FLOP_CONVENTION, attention_flops, shape_flops
from .device import ROOT, CannotRun, progress
from .options import kernel_list, parse_shape, results_option
from .results import SCHEMA, result_path, write_result, wrote

NH, D_HEAD = 12, 64  # GPT-2's heads and head size
DEFAULT_SHAPE = (8, 1024)
NCU_FALLBACK = Path("/usr/local/cuda/bin/ncu")
NCU_TIMEOUT_S = 600  # one rung: ncu replays the launch once per counter pass (about 40)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis", "WarpStateStats",
            "ComputeWorkloadAnalysis", "SchedulerStats", "MemoryWorkloadAnalysis_Tables")
EXTRA_METRICS = (  # besides the sections' own; every name is in `ncu --query-metrics --chip gh100`
    "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "sm__sass_data_bytes_mem_shared_op_ld.sum.per_second", "sm__sass_data_bytes_mem_shared_op_st.sum.per_second",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_issued.avg.pct_of_peak_sustained_active",
)
PERMISSION_FIX = ("ncu may not read the GPU's performance counters here (ERR_NVGPUCTRPERM): run bench.py profile "
                  "as root, or let every user profile (the nvidia module option "
                  "NVreg_RestrictProfilingToAdminUsers=0, then reload the driver or reboot)")

# field -> the ncu metric names it is read from, the first one present; None where none is
METRICS = {
    "duration_s": ("gpu__time_duration.sum",),
    "occupancy_achieved_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "occupancy_theoretical_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "memory_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",),
    "dram_read_bytes": ("dram__bytes_read.sum",),
    "dram_write_bytes": ("dram__bytes_write.sum",),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                 "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_bytes_per_s": ("dram__bytes.sum.per_second",),
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct",),
    "shared_ld_bytes_per_s": ("sm__sass_data_bytes_mem_shared_op_ld.sum.per_second",),
    "shared_st_bytes_per_s": ("sm__sass_data_bytes_mem_shared_op_st.sum.per_second",),
    "bank_conflicts_ld": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",),
    "bank_conflicts_st": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",),
    "global_ld_bytes_per_s": ("l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum.per_second",),
    "global_st_bytes_per_s": ("l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum.per_second",),
    "tensor_pct": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",),
    # tensor instructions executed, % of each kind's peak: mma.sync (HMMA) or wgmma (GMMA)
    "hmma_pct": ("sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",),
    "gmma_pct": ("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",),
    "issue_pct": ("sm__inst_issued.avg.pct_of_peak_sustained_active",),
    "sm_clock_hz": ("gpc__cycles_elapsed.avg.per_second",),
    "registers": ("launch__registers_per_thread",),
}
LIMITERS = {"registers": "launch__occupancy_limit_registers", "shared memory": "launch__occupancy_limit_shared_mem",
            "warps": "launch__occupancy_limit_warps", "blocks": "launch__occupancy_limit_blocks"}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(?P<reason>\w+?)_per_issue_active\.ratio$")


# ---------------------------------------------------------------------------------------------
# Units and ncu's CSV
# ---------------------------------------------------------------------------------------------

_TIME = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
         "s": 1.0, "second": 1.0}
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_SCALED = re.compile(r"^(?P<prefix>[KMGTP]i?)?(?P<base>[A-Za-z]+)$")
_BASES = {"byte", "hz", "cycle", "inst", "sector", "request", "warp", "block", "thread", "register", "wavefront",
          "sm", "cluster", "pass"}


def unit_scale(unit: str) -> float:
    """The factor to base units (seconds, bytes, Hz, per second) of one of ncu's units: "ns" 1e-9,
    "Kbyte" 1e3, "Mbyte/s" 1e6, "byte/usecond" 1e6, "cycle/nsecond" 1e9, "Ghz" 1e9; 1 for unitless,
    "%" and counts ("block", "inst", "register/thread")."""
    unit = unit.strip()
    if not unit or unit == "%":
        return 1.0
    numerator, _, denominator = unit.partition("/")
    scale = 1.0
    if denominator in _TIME:  # a rate: per second
        scale /= _TIME[denominator]
    if numerator in _TIME:
        return scale * _TIME[numerator]
    if numerator == "%":  # %/byte, %/register
        return scale
    m = _SCALED.match(numerator)
    if not m or m["base"].lower() not in _BASES:
        raise ValueError(f"unknown unit {unit!r} in ncu's output")
    return scale * _PREFIX[m["prefix"] or ""]


def parse_value(text: str, unit: str = "") -> float | None:
    """'364,320' in 'ns' -> 3.6432e-4 (seconds); None for an empty cell or n/a."""
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A", "-"):
        return None
    try:
        value = float(text)
    except ValueError:
        return None  # a text cell (a kernel name, a grid size): not a number
    return value * unit_scale(unit)


def parse_csv(text: str) -> list[dict[str, tuple[str, str]]]:
    """ncu's raw CSV page (within whatever else ncu and the target printed) -> one dict per kernel,
    metric name -> (value text, unit)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID","Process ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    header, units = rows[0], rows[1]
    return [dict(zip(header, zip(row, units, strict=True), strict=True))
            for row in rows[2:] if len(row) == len(header)]


def _number(raw: dict, names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in raw:
            value = parse_value(*raw[name])
            if value is not None:
                return value
    return None


def stall_shares(raw: dict) -> list[tuple[str, float]]:
    """Every warp-stall reason with its share of the stall cycles per issued instruction, largest
    first (ties by name). "selected" is the issuing warp's own cycle, not a stall: left out."""
    ratios = {m["reason"]: parse_value(*raw[name]) for name in raw if (m := _STALL.match(name))}
    ratios = {r: v for r, v in ratios.items() if v is not None and r != "selected"}
    total = sum(ratios.values())
    if total <= 0:
        return []
    return sorted(((r, v / total) for r, v in ratios.items()), key=lambda rv: (-rv[1], rv[0]))


def occupancy_limiters(raw: dict) -> tuple[list[str], dict[str, int]]:
    """What bounds the blocks per SM: the smallest of ncu's four limits (several where they tie)."""
    limits = {what: parse_value(*raw[name]) for what, name in LIMITERS.items() if name in raw}
    limits = {what: int(v) for what, v in limits.items() if v is not None}
    if not limits:
        return [], {}
    least = min(limits.values())
    return [what for what, v in limits.items() if v == least], limits


def short_kernel_name(name: str) -> str:
    """'void attention_forward<64, 128, 64>(const float *, ...)' -> 'attention_forward<64, 128, 64>'."""
    name = re.sub(r"^void\s+", "", name.strip())
    depth = 0
    for i, c in enumerate(name):
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            return name[:i]
    return name


TENSOR_ACTIVE_PCT = 1.0  # below this the tensor pipe ran no MMA work to speak of


def tensor_kind(fields: dict) -> str | None:
    """"HMMA" (mma.sync) or "GMMA" (wgmma): the larger by % of its peak, where the tensor pipe was busy.
    Not the mere presence: ptxas moves constants with HFMA2.MMA, which counts as HMMA on the tensor
    pipe, so an FFMA rung shows a fraction of a percent of HMMA (v13: 0.24%)."""
    if (fields["tensor_pct"] or 0) < TENSOR_ACTIVE_PCT:
        return None
    hmma, gmma = fields["hmma_pct"] or 0, fields["gmma_pct"] or 0
    return None if hmma == gmma == 0 else "GMMA" if gmma > hmma else "HMMA"


def kernel_fields(raw: dict) -> dict:
    """One kernel's row of ncu's CSV -> the table's fields, in base units; None where a metric is absent."""
    fields = {field: _number(raw, names) for field, names in METRICS.items()}
    for count in ("dram_read_bytes", "dram_write_bytes", "bank_conflicts_ld", "bank_conflicts_st", "registers"):
        if fields[count] is not None:
            fields[count] = int(round(fields[count]))
    limiters, limits = occupancy_limiters(raw)
    stalls = stall_shares(raw)
    return {
        "kernel": short_kernel_name(raw.get("Kernel Name", ("?", ""))[0]),
        "grid": raw.get("Grid Size", ("", ""))[0],
        "block": raw.get("Block Size", ("", ""))[0],
        **fields,
        "occupancy_limiter": limiters,
        "occupancy_limits": limits,
        "tensor_kind": tensor_kind(fields),
        "stalls_top": stalls[:3],
        "stalls": dict(stalls),
    }


def rung_totals(kernel_rows: list[dict]) -> dict:
    """A launch's kernels summed: duration and DRAM bytes (None where any kernel lacks them)."""
    def total(field):
        values = [k[field] for k in kernel_rows]
        return None if not values or any(v is None for v in values) else sum(values)

    return {"duration_s": total("duration_s"), "dram_read_bytes": total("dram_read_bytes"),
            "dram_write_bytes": total("dram_write_bytes")}


# ---------------------------------------------------------------------------------------------
# Running ncu
# ---------------------------------------------------------------------------------------------


def find_ncu(given: str | None) -> str:
    """ncu's path: --ncu, else ncu on PATH, else the CUDA toolkit's; CannotRun saying how to fix it."""
    if given is not None:
        path = shutil.which(given)
        if path is None:
            raise CannotRun(f"--ncu {given}: no such executable; give the path of Nsight Compute's ncu "
                            f"(on the GPU machine: {NCU_FALLBACK})")
        return path
    path = shutil.which("ncu") or (str(NCU_FALLBACK) if os.access(NCU_FALLBACK, os.X_OK) else None)
    if path is None:
        raise CannotRun(f"Nsight Compute (ncu) is not on PATH nor at {NCU_FALLBACK}: install it (it comes with the "
                        "CUDA toolkit) or name it with --ncu PATH")
    return path


def target_args(kernel: str | None, shape: tuple[int, int] | str | None, dtype: str, backward: bool = False,
                size: str | None = None) -> list[str]:
    """The child ncu profiles: one rung at one shape (B x T, or a frontier case's id), a backward rung's
    pass (backward), or (kernel None) one decode step (of GPT-2 small, or of `size`)."""
    base = [sys.executable, "-m", "benchmarks.profile_target", "--dtype", dtype]
    if kernel is None:
        return base + ["--decode"] + (["--size", size] if size else [])
    where = ["--case", shape] if isinstance(shape, str) else ["--shape", f"{shape[0]}x{shape[1]}"]
    return base + ["--backward" if backward else "--kernel", kernel, *where]


def backward_list(text: str) -> list[Path]:
    """'b04,b5' or 'all' -> backward rung files (kernels.backward.resolve)."""
    try:
        if text.strip() == "all":
            return [backward_ladder.resolve(n) for n in backward_ladder.names()]
        return [backward_ladder.resolve(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def case_list(text: str) -> list:
    """'16x12x2048-d64,2x32x4096-d128' or 'all' -> the frontier's cases (bench.py frontier's ids)."""
    cases = {frontier.case_id(c): c for c in frontier.CASES}
    ids = list(cases) if text.strip() == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [i for i in ids if i not in cases]
    if unknown or not ids:
        raise argparse.ArgumentTypeError(f"unknown frontier case {', '.join(unknown) or text!r}; the cases: "
                                         f"{', '.join(cases)}")
    return [cases[i] for i in ids]


def profiled_shapes(args) -> list[tuple[dict, tuple[int, int] | str, int]]:
    """(the rows' shape, what the target is told, FLOPs) for each shape: GPT-2's B x T, or frontier cases."""
    if args.cases:
        return [({"B": c.B, "NH": c.NH, "NH_kv": c.NH_kv, "T_q": c.T_q, "T_k": c.T_k, "d": c.d, "causal": c.causal,
                  "case": frontier.case_id(c)}, frontier.case_id(c), shape_flops(c)) for c in args.cases]
    return [({"B": B, "T": T, "NH": NH, "d": D_HEAD}, (B, T), attention_flops(B, NH, T, D_HEAD))
            for B, T in args.shape or [DEFAULT_SHAPE]]


def ncu_command(ncu: str, target: list[str]) -> list[str]:
    """ncu on one launch (the target's cudaProfilerStart/Stop), clocks unlocked, the raw page as CSV."""
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
            *sections, "--metrics", ",".join(EXTRA_METRICS), *target]


def ncu_version(ncu: str) -> str | None:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    versions = re.findall(r"Version\s+(\S+)", out)
    return versions[-1] if versions else (out.strip().splitlines() or [None])[-1]


def run_ncu(command: list[str], timeout: float = NCU_TIMEOUT_S) -> list[dict]:
    """Run ncu; the kernels' rows of its CSV. CannotRun where the counters are not permitted (nothing
    else would run either); RuntimeError with one line for a rung that failed under it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ncu did not finish in {timeout:g} s") from None
    except OSError as exc:
        raise CannotRun(f"cannot start {command[0]}: {exc}") from None
    output = done.stdout + "\n" + done.stderr
    if "ERR_NVGPUCTRPERM" in output:
        raise CannotRun(PERMISSION_FIX)
    rows = parse_csv(done.stdout)
    if rows:
        return rows
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("==")]
    errors = [line for line in output.splitlines() if line.startswith("==ERROR==")]
    if said:  # the target's own last words (its error line, a traceback's exception) say why
        raise RuntimeError(said[-1].strip())
    if errors:
        raise RuntimeError(errors[0].removeprefix("==ERROR==").strip())
    if "No kernels were profiled" in output:
        raise RuntimeError("ncu profiled no kernel (nothing launched between cudaProfilerStart and Stop)")
    raise RuntimeError(f"ncu exited with status {done.returncode} and no CSV")


def profile_row(ncu: str, name: str, kind: str, target: list[str], flops: int | None) -> dict:
    """One rung (or the decode step) under ncu: its kernels' fields, the totals, the roofline point."""
    row = {"name": name, "kind": kind, "flops": flops}
    try:
        row["kernels"] = [kernel_fields(r) for r in run_ncu(ncu_command(ncu, target))]
    except (RuntimeError, ValueError) as exc:  # ValueError: a unit this parser does not know
        return {**row, "status": "error", "reason": str(exc)}
    row.update(rung_totals(row["kernels"]))
    row.update(profile_render.roofline_point(flops, row["dram_read_bytes"], row["dram_write_bytes"],
                                             row["duration_s"]))
    return {**row, "status": "ok"}


def skip_reason(path: Path, dtype: str, arch: str, d: int | None = None, backward: bool = False) -> str | None:
    """Why a rung (a backward rung) is not profiled here, in one line; None if it is. d: the shape's head
    size, which a backward rung must declare."""
    rung = backward_ladder.load(path) if backward else kernels.load(path)
    if backward and d is not None and d not in rung.head_sizes():
        return f"has no configuration for d={d} (head sizes {', '.join(map(str, rung.head_sizes()))})"
    if dtype not in rung.dtypes:
        return f"does not take {dtype} (lab.dtypes {', '.join(rung.dtypes)})"
    if not rung.runs_on(arch):
        return f"needs {rung.arch_needed()}; this device is {arch}"
    return None


def decode_skip_reason(dtype: str) -> str | None:
    from gpt2 import fast

    return None if dtype in fast.DTYPES else f"gpt2.fast's decode step runs {' and '.join(fast.DTYPES)}"


def roofs_of(ceilings: dict) -> dict[str, float]:
    """The compute roofs among a run's ceilings (TFLOP/s), those it measured: fp32 FFMA, TF32, bf16, fp16
    and e4m3 tensor GEMM (benchmarks/ceilings.py names them)."""
    return {label: ceilings[key] for key, label in precision.MATHS.values() if ceilings.get(key)}


def cmd_profile(args) -> int:
    if args.cases and args.shape:
        raise CannotRun("--shape and --cases: name the shapes one way (B x T at GPT-2's heads, or frontier cases)")
    if args.backward is not None and args.kernels is not None:
        raise CannotRun("--kernels and --backward: name the forward rungs or the backward ones")
    ncu = find_ncu(args.ncu)
    device.require_gpu()
    setup = device.setup_info(args.argv)
    dev = setup["device"]
    shapes = profiled_shapes(args)
    backward = args.backward is not None
    rungs = (args.backward if backward else args.kernels if args.kernels is not None
             else [kernels.resolve(n) for n in kernels.names()])
    decode = args.decode and not backward
    version = ncu_version(ncu)
    progress(f"{dev['name']} ({dev['arch']}, {dev['sm_count']} SMs), driver {dev['driver']}, CUDA "
             f"{dev['cuda_runtime']}; ncu {version or '?'} at {ncu}")
    progress("measuring the ceilings (fp32 SGEMM 8192^3 without TF32; TF32, bf16, fp16, e4m3 GEMM 8192^3; device "
             "copy) ...")
    ceilings = timing.measure_ceilings(timing.Method())
    roofs = roofs_of(ceilings)
    progress(", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in roofs.items()) + f"; copy {ceilings['copy_tbps']:.2f} TB/s")

    rows = []
    for shape, told, flops in shapes:
        for path in rungs:
            name = path.stem
            why = skip_reason(path, args.dtype, dev["arch"], shape["d"], backward)
            if why:
                rows.append({"name": name, "kind": "rung", "shape": shape, "status": "skipped", "reason": why})
                progress(f"{name} {profile_render.shape_text(shape)}: skipped: {why}")
                continue
            target = target_args(str(path), told, args.dtype, backward)
            row = profile_row(ncu, name, "rung", target, flops * 5 // 2 if backward else flops)
            math = None if backward else precision.rung_math(kernels.load(path), args.dtype, {})
            rows.append({**row, "shape": shape, "math": math})
            progress(profile_render.progress_line(rows[-1]))
    if decode and (why := decode_skip_reason(args.dtype)):
        rows.append({"name": "decode step", "kind": "decode", "shape": None, "status": "skipped", "reason": why})
        progress(f"decode step: skipped: {why}")
    elif decode:
        row = profile_row(ncu, "decode step", "decode", target_args(None, None, args.dtype), None)
        rows.append({**row, "shape": None})
        progress(profile_render.progress_line(rows[-1]))

    result = {
        "schema": SCHEMA, "kind": "profile", "setup": setup,
        "flop_convention": backward_bench.FLOP_CONVENTION if backward else FLOP_CONVENTION,
        "direction": "backward" if backward else "forward", "ceilings": ceilings, "roofs": roofs, "dtype": args.dtype,
        "shapes": [shape for shape, _, _ in shapes],
        "kernels": [p.stem for p in rungs], "decode": decode,
        "ncu": {"path": ncu, "version": version, "clock_control": "none",
                "command": " ".join(ncu_command("ncu", ["<target>"]))},
        "sm_clock_hz": profile_render.median_clock(rows), "rows": rows,
    }
    path = result_path("profile", setup, args.results)
    result["plot"] = plots.plot_or_none(profile_render.plot_result, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + profile_render.render_profile(result))
    progress(wrote(path, result["plot"]))
    return 0


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Declare `profile` and its flags on bench.py's subparsers; bench.py maps the command to cmd_profile."""
    p = subparsers.add_parser(
        "profile", help="Nsight Compute's counters for every rung, one launch each, and a roofline plot",
        description="Each rung (default: every rung, at 8x1024, NH=12, d=64) and the decode step's kernels, one "
                    "launch after warm-up under ncu (clocks unlocked): duration, achieved and theoretical "
                    "occupancy and its limiter, SM and memory throughput, DRAM bytes and throughput, L2 hit rate, "
                    "shared and global load/store throughput, bank conflicts, tensor pipe, issue slots, the top "
                    "three warp stalls; a roofline plot against the ceilings measured in the same run.")
    p.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs, comma-separated (v05,v12 or a .cu path); default: every rung (those that do not "
                        "take the dtype or this device are reported skipped)")
    p.add_argument("--shape", type=parse_shape, action="append", metavar="BxT",
                   help="batch x sequence length, repeatable (default: 8x1024)")
    p.add_argument("--cases", type=case_list, default=None, metavar="LIST",
                   help="shapes of bench.py frontier in place of --shape (their heads, head size, K/V heads, "
                        "mask), comma-separated ids such as 16x12x2048-d64,2x32x4096-d128-gqa8, or all")
    p.add_argument("--backward", type=backward_list, default=None, metavar="LIST",
                   help="backward rungs instead of the forward ones (b04,b05, or all): one backward pass each, "
                        "every phase's kernel a row, after the newest forward rung that writes the log-sum-exp; "
                        "TFLOP/s at 2.5 x the forward's FLOPs (bench.py backward's convention); no decode step")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="input dtype (default float32)")
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="also the decode step's kernels (gpt2.fast's engine, GPT-2 small, one step; default on)")
    p.add_argument("--ncu", default=None, metavar="PATH",
                   help=f"Nsight Compute's ncu (default: ncu on PATH, else {NCU_FALLBACK})")
    results_option(p)
    return p
