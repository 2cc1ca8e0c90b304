#!/usr/bin/env python3
"""Benchmarks of the attention ladder, beside its peers, and of GPT-2 generation; the README's tables.

    python3 bench.py kernels                    every rung x the five GPT-2 shapes, beside CuPy and torch SDPA
    python3 bench.py kernels --kernels v01,v02 --shape 8x1024 --shape 1x8192
    python3 bench.py sweep                      TFLOP/s against T = 128 .. 16384, with a PNG plot
    python3 bench.py e2e                        seconds to generate 512 tokens, per rung, without and with a KV cache
    python3 bench.py resources [--arch sm_90]   registers, shared memory, spills, resident blocks per SM
    python3 bench.py features                   decode, long-context decode, non-causal, cross lengths, GQA and
                                                head sizes on the rungs that declare them, beside torch SDPA
    python3 bench.py readme                     rewrite README.md's tables from the newest results/*.json

How it measures (every number it prints is also written to results/<subcommand>-<device>-<UTC time>.json,
with the device, driver, CUDA, CuPy and torch versions, the date and the command):

- Time: CUDA events (cupy.cuda.Event) recorded on the stream the work runs on; warm-up first;
  the median of many runs, with the p20-p80 spread and min/max; L2 flushed before every run by
  writing a buffer twice the device's L2 size; compilation happens before any timing.
  torch runs on its current stream, which is CuPy's (the legacy default stream): one clock for all.
- Correct before timed: each rung's output, poisoned with NaN beforehand, is compared with a float64
  reference on the same inputs; its largest error may be at most 8 x that of the plain float32
  implementation (kernels.reference_attention in float32), floored at the dtype's epsilon x max|ref|.
  A rung over that bound is reported wrong, with its error, and not timed.
- FLOPs: causal forward counts 4 * B * NH * T^2 * d / 2 (attention_flops); TFLOP/s are also given as
  a percentage of the fp32 FFMA ceiling this run measures (cuBLAS SGEMM 8192^3, TF32 off). `features`
  counts 4 * d per (query, key) pair the mask lets through (attention_flops_qk): all T_q x T_k without
  the mask, the same T^2 / 2 for causal self-attention, the exact bottom-right count otherwise.
- Decode (`features`): kernel time per call from CUPTI's kernel records through torch.profiler, the
  median over calls that rotate through 24 independent caches so that L2 does not hold K and V,
  and the time per call of the same calls replayed as one CUDA graph.
"""

from __future__ import annotations

import os

_CUPY_TF32_GIVEN = os.environ.get("CUPY_TF32")
os.environ["CUPY_TF32"] = "0"  # CuPy reads this at its first float32 matmul: plain fp32 FFMA, no TF32

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import kernels  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
README = ROOT / "README.md"
SCHEMA = 1
SECTIONS = ("kernels", "sweep", "e2e", "resources", "features")  # result kinds, and the README's marked sections

GPT2_SHAPES = ((1, 512), (8, 1024), (16, 2048), (6, 4096), (1, 8192))  # B x T; NH = 12, d = 64
DTYPES = ("float32", "bfloat16", "float16")
TOLERANCE_FACTOR = 8.0
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0**-7}

FLOP_CONVENTION = ("causal forward = 4 * B * NH * T^2 * d / 2 FLOPs: the two T x T x d matrix products, half "
                   "of them under the mask; exp and the softmax arithmetic are not counted")


def attention_flops(B: int, NH: int, T: int, d: int, causal: bool = True) -> int:
    """The FLOP count every TFLOP/s in this lab is computed from (FLOP_CONVENTION)."""
    full = 4 * B * NH * T * T * d  # S = Q K^T and O = P V: 2 * T * T * d each
    return full // 2 if causal else full


FEATURE_FLOP_CONVENTION = (
    "4 * d FLOPs per (query, key) pair of every query head (S = Q K^T and O = P V, 2 * d each; exp and the "
    "softmax arithmetic are not counted; grouped-query heads count every query head). Pairs: T_q * T_k without "
    "the mask; T^2 / 2 for causal self-attention (T_q = T_k, as in the kernels table); with T_q != T_k the exact "
    "number the bottom-right causal mask lets through, T_q * T_k - T_q * (T_q - 1) / 2 for T_q <= T_k")


def visible_pairs(T_q: int, T_k: int, causal: bool = True) -> int:
    """(query, key) pairs the mask lets through. Causal is aligned bottom-right, as in the rungs and
    kernels.reference.causal_mask: query i sees keys j <= i + T_k - T_q (so with T_q > T_k the first
    T_q - T_k queries see nothing)."""
    if not causal:
        return T_q * T_k
    if T_q <= T_k:  # query i sees i + T_k - T_q + 1 keys
        return T_q * T_k - T_q * (T_q - 1) // 2
    return T_k * (T_k + 1) // 2  # the last T_k queries see 1, 2, ..., T_k keys


def attention_flops_qk(B: int, NH: int, T_q: int, T_k: int, d: int, causal: bool = True) -> int:
    """FLOPs of q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d) (FEATURE_FLOP_CONVENTION): 4 * d per pair.
    Causal self-attention (T_q == T_k) keeps attention_flops' T^2 / 2, so these TFLOP/s compare with
    the kernels table; without the mask every T_q x T_k pair counts; causal with T_q != T_k counts the
    pairs the bottom-right mask lets through exactly (visible_pairs)."""
    if causal and T_q == T_k:
        return attention_flops(B, NH, T_q, d, causal=True)
    return 4 * B * NH * visible_pairs(T_q, T_k, causal) * d


class Unavailable(Exception):
    """A peer that cannot run here (a missing package, a backend refusing the dtype, memory): a row says so."""


class NotComparable(Unavailable):
    """A peer that could run, but not with the rungs' mask (cross lengths on a torch without a bottom-right
    causal mask for this backend): its row says n/a rather than comparing different masks."""


def fail(message: str) -> int:
    """One line on stderr; exit status 2 (the user's to fix: a missing GPU, a bad file)."""
    print(f"bench.py: {message}", file=sys.stderr, flush=True)
    return 2


def progress(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# Setup: what ran where. Every result file carries this; every README table is headed by it.
# ---------------------------------------------------------------------------------------------


def _cupy():
    import cupy

    return cupy


def gpu_problem() -> str | None:
    """None if CuPy sees a CUDA device; else why not, in a few words."""
    try:
        cupy = _cupy()
    except ImportError as exc:
        return f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, insufficient driver, ...
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None if count > 0 else "no CUDA device visible"


class CannotRun(Exception):
    """A subcommand that cannot run here (no GPU, no gpt2 package, no NVRTC): one line, exit 2."""


def require_gpu() -> None:
    problem = gpu_problem()
    if problem:
        raise CannotRun(f"needs a CUDA GPU, and none is usable here ({problem}); run it on the GPU machine")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _driver_release() -> str | None:
    """The kernel driver's release (580.65.06), which the CUDA version alone does not name."""
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit (+dirty with uncommitted changes to tracked files); LAB_COMMIT, where
    set, names it instead: a copy of the tree without its history (a GPU machine it was synced to)
    cannot tell."""
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_info() -> dict | None:
    if gpu_problem():
        return None
    cupy = _cupy()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {
        "name": name,
        "arch": f"sm_{dev.compute_capability}",
        "sm_count": int(dev.attributes["MultiProcessorCount"]),
        "l2_bytes": int(props["l2CacheSize"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver": _driver_release(),
        "driver_cuda": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
    }


def setup_info(argv: list[str]) -> dict:
    """Device, driver, CUDA, library versions, date and command: the header of every result."""
    cupy_version = _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy")
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python3", "bench.py", *argv]),
        "git": _git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cupy": cupy_version,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "cupy_tf32": f"0 (set by bench.py; was {_CUPY_TF32_GIVEN!r})",
        "device": device_info(),
    }


def device_slug(setup: dict, fallback: str = "nogpu") -> str:
    name = setup["device"]["name"] if setup.get("device") else fallback
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ---------------------------------------------------------------------------------------------
# Results: results/<subcommand>-<device>-<UTC timestamp>.json
# ---------------------------------------------------------------------------------------------

_RESULT_NAME = re.compile(r"^(?P<kind>[a-z0-9]+)-(?P<device>[a-z0-9-]+)-(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<n>\d+))?\.json$")


def _jsonable(x):
    """NumPy scalars to Python, NaN and infinity to None: result files are strict JSON."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def result_path(kind: str, setup: dict, folder: Path, fallback_slug: str = "nogpu") -> Path:
    """A new file name: the kind, the device, the setup's UTC date; -1, -2 ... on a clash."""
    stamp = setup["date"].replace("-", "").replace(":", "")  # 2026-11-21T21:30:00Z -> 20261121T213000Z
    base = f"{kind}-{device_slug(setup, fallback_slug)}-{stamp}"
    path, n = folder / f"{base}.json", 0
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}.json"
    return path


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_jsonable(result), indent=1, allow_nan=False)
    with open(path, "x") as f:  # never overwrite a result
        f.write(text + "\n")
    return path


def newest_results(folder: Path) -> dict[str, list[Path]]:
    """Result files of each kind, newest first (by the UTC stamp in the name)."""
    found: dict[str, list[tuple]] = {k: [] for k in SECTIONS}
    for p in folder.glob("*.json") if folder.is_dir() else []:
        m = _RESULT_NAME.match(p.name)
        if m and m["kind"] in found:
            found[m["kind"]].append((m["stamp"], int(m["n"] or 0), p))
    return {k: [p for *_, p in sorted(v, reverse=True)] for k, v in found.items()}


# ---------------------------------------------------------------------------------------------
# Timing: CUDA events, warm-up, L2 flush, median and spread
# ---------------------------------------------------------------------------------------------


class L2Flush:
    """Writes a buffer twice the size of L2 (read from the device) so no run finds the last one's data."""

    def __init__(self):
        cupy = _cupy()
        dev = cupy.cuda.Device()
        self.nbytes = 2 * int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"])
        self.buffer = cupy.empty(self.nbytes, dtype=cupy.uint8)

    def __call__(self):
        self.buffer.fill(0)  # a memset on CuPy's current stream


def no_flush():
    pass


@dataclass
class Method:
    budget_ms: float = 300.0  # timed runs: as many as fit in this, within [min_runs, max_runs]
    min_runs: int = 10
    max_runs: int = 200
    warmup: int = 3

    def describe(self, flush_bytes: int) -> dict:
        return {
            "timer": "cupy.cuda.Event pairs on the stream the work runs on (torch peers: torch's current "
                     "stream, which is CuPy's legacy default stream), read after the last run",
            "warmup_runs": self.warmup,
            "budget_ms": self.budget_ms,
            "min_runs": self.min_runs,
            "max_runs": self.max_runs,
            "statistic": "median; spread as p20-p80 and min-max",
            "l2_flush_bytes": flush_bytes,
            "l2_flush": "a buffer of twice the L2 size is written before every timed run, outside the events",
            "compilation": "before warm-up (kernels.prepare), never timed",
            "tolerance": f"max |out - ref64| <= {TOLERANCE_FACTOR:g} x max(max |plain32 - ref64|, eps(dtype) x max |ref64|)",
        }


def time_gpu(fn, *, stream, flush, method: Method) -> dict:
    """Median and spread, in ms, of `fn()` over many runs, timed with CUDA events on `stream`."""
    cupy = _cupy()
    Event = cupy.cuda.Event
    cupy.cuda.Device().synchronize()  # whatever another framework queued is done before the clock starts
    with stream:
        for _ in range(method.warmup):
            fn()
        start, end = Event(), Event()
        flush()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        estimate = cupy.cuda.get_elapsed_time(start, end)
        runs = int(min(method.max_runs, max(method.min_runs, method.budget_ms / max(estimate, 1e-3))))
        events = [(Event(), Event()) for _ in range(runs)]
        for s, e in events:
            flush()
            s.record(stream)
            fn()
            e.record(stream)
        events[-1][1].synchronize()
    times = np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in events])
    return {
        "median_ms": float(np.median(times)),
        "p20_ms": float(np.percentile(times, 20)),
        "p80_ms": float(np.percentile(times, 80)),
        "min_ms": float(times.min()),
        "max_ms": float(times.max()),
        "runs": runs,
    }


def per_call_us(records: list[tuple[float, float, str]], calls: int) -> dict | None:
    """Device time per call from the kernel records (start, duration in us, name) of `calls` identical
    calls made one after another: with k records per call, each run of k consecutive records (in start
    order) is one call, summed; the median and spread over the calls. Records that do not divide evenly
    among the calls give their total over the calls instead (the mean, and `statistic` says so)."""
    if not records or calls < 1:
        return None
    records = sorted(records)
    names = sorted({name[:160] for *_, name in records})
    if len(records) % calls:
        return {"us": sum(d for _, d, _ in records) / calls, "statistic": "mean (records do not divide among calls)",
                "calls": calls, "kernels_per_call": len(records) / calls, "kernels": names}
    k = len(records) // calls
    per_call = np.array([sum(d for _, d, _ in records[i:i + k]) for i in range(0, len(records), k)])
    return {"us": float(np.median(per_call)), "statistic": "median", "p20_us": float(np.percentile(per_call, 20)),
            "p80_us": float(np.percentile(per_call, 80)), "min_us": float(per_call.min()),
            "max_us": float(per_call.max()), "calls": calls, "kernels_per_call": k, "kernels": names}


def kernel_timing(runs, reps: int = 10, name: str | None = None) -> dict | None:
    """Device time per call, from CUPTI's kernel records (torch's profiler sees CuPy's launches too),
    over `reps` passes through `runs`: the kernels each call launched, summed (per_call_us); only
    those whose name contains `name` if given. None without torch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    cupy = _cupy()
    for run in runs:  # compiled and warm before the profile
        run()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for run in runs:
                run()
        cupy.cuda.Device().synchronize()
    records = [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
               if (name in e.name if name else str(getattr(e, "device_type", "")).endswith("CUDA"))]
    return per_call_us(records, reps * len(runs))


def kernel_us(runs, reps: int = 10, name: str | None = None) -> float | None:
    """kernel_timing's median microseconds per call, or None without torch."""
    timing = kernel_timing(runs, reps, name)
    return timing["us"] if timing else None


def graph_us(runs, reps: int = 10) -> float:
    """Microseconds per call: the calls captured once as a CUDA graph on a CuPy stream (no Python
    between launches), replayed, timed with events. For launches that go through CuPy (the rungs)."""
    cupy = _cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for run in runs:  # compiled and warm before the capture
            run()
        stream.begin_capture()
        for _ in range(reps):
            for run in runs:
                run()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch()
        end.record(stream)
        end.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(start, end) / (reps * len(runs))


def torch_graph_us(runs, reps: int = 10) -> float:
    """graph_us for calls that launch through torch (SDPA): captured with torch.cuda.graph, whose
    private memory pool serves the calls' allocations during the capture."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm, off the capture, as torch.cuda.graph asks
        for run in runs:
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for run in runs:
                run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    us = 1e3 * start.elapsed_time(end) / (reps * len(runs))
    del graph
    return us


# ---------------------------------------------------------------------------------------------
# Ceilings: what the device can do, measured here
# ---------------------------------------------------------------------------------------------


def fp32_matmul_mode() -> str:
    """CuPy's compute type for float32 matmul: must not be TF32 for an FFMA ceiling."""
    from cupy._core import _routines_linalg as linalg

    mode = linalg.get_compute_type(np.dtype(np.float32))
    if mode == linalg.COMPUTE_TYPE_TF32:  # CUPY_TF32 was read before bench.py could set it
        linalg.set_compute_type(np.dtype(np.float32), linalg.COMPUTE_TYPE_DEFAULT)
        mode = linalg.get_compute_type(np.dtype(np.float32))
    return linalg.compute_type_to_str(mode)


def measure_ceilings(method: Method, n: int = 8192, copy_bytes: int = 1 << 30) -> dict:
    """fp32 FFMA ceiling (cupy.matmul of n^3 float32, TF32 off) and device-to-device copy bandwidth."""
    cupy = _cupy()
    rng = cupy.random.default_rng(1234)
    mode = fp32_matmul_mode()
    stream = cupy.cuda.get_current_stream()
    quick = Method(budget_ms=min(method.budget_ms, 300.0), min_runs=5, max_runs=50, warmup=2)

    def time_gemm():
        a, b = (rng.standard_normal((n, n), dtype=cupy.float32) for _ in range(2))
        c = cupy.empty((n, n), dtype=cupy.float32)
        return time_gpu(lambda: cupy.matmul(a, b, out=c), stream=stream, flush=no_flush, method=quick)

    gemm = time_gemm()
    release_memory()
    return {
        "ffma_tflops": 2 * n**3 / (gemm["median_ms"] * 1e-3) / 1e12,
        "ffma_what": f"cupy.matmul float32 {n}^3 (cuBLAS, compute type {mode}, CUPY_TF32=0)",
        "ffma_timing": gemm,
        **measure_copy(method, copy_bytes),
    }


def measure_copy(method: Method, copy_bytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth, bytes read + written over the median time: the ceiling a
    bandwidth-bound kernel (decode) is held against."""
    cupy = _cupy()
    stream = cupy.cuda.get_current_stream()
    quick = Method(budget_ms=min(method.budget_ms, 300.0), min_runs=5, max_runs=50, warmup=2)

    def time_copy():
        src = cupy.random.default_rng(1234).random(copy_bytes // 4, dtype=cupy.float32)
        dst = cupy.empty_like(src)
        return time_gpu(lambda: dst.data.copy_from_device_async(src.data, src.nbytes, stream), stream=stream,
                        flush=no_flush, method=quick)

    copy = time_copy()
    release_memory()  # the two buffers are gone with time_copy's frame
    return {
        "copy_tbps": 2 * copy_bytes / (copy["median_ms"] * 1e-3) / 1e12,
        "copy_what": f"device-to-device copy of {copy_bytes >> 20} MiB; bytes read + written",
        "copy_timing": copy,
    }


# ---------------------------------------------------------------------------------------------
# Inputs, peers and the correctness gate
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    NH: int = 12
    d: int = 64

    @property
    def label(self) -> str:
        return f"{self.B}x{self.T}"

    def as_dict(self) -> dict:
        return {"B": self.B, "T": self.T, "NH": self.NH, "d": self.d}

    # causal self-attention, one K/V head per query head: the general fields Case spells out
    T_q = property(lambda self: self.T)
    T_k = property(lambda self: self.T)
    NH_kv = property(lambda self: self.NH)
    causal = True


@dataclass(frozen=True)
class Case:
    """A shape of the features benchmark: q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d), causal (the
    mask aligned bottom-right) or not. `part` names the table it belongs to."""

    part: str
    B: int
    NH: int
    NH_kv: int
    T_q: int
    T_k: int
    d: int
    causal: bool = True

    @property
    def label(self) -> str:
        lengths = f"{self.T_q}" if self.T_q == self.T_k else f"{self.T_q}/{self.T_k}"
        return f"{self.part} {self.B}x{lengths}"

    def needs(self) -> set[str]:
        """The lab.supports features a rung must declare to run this case."""
        return {f for f, needed in (("noncausal", not self.causal), ("cross", self.T_q != self.T_k),
                                    ("gqa", self.NH_kv != self.NH)) if needed}

    def describe(self) -> str:
        heads = f"NH={self.NH}" + (f", NH_kv={self.NH_kv}" if self.NH_kv != self.NH else "")
        lengths = f"T={self.T_q}" if self.T_q == self.T_k else f"T_q={self.T_q}, T_k={self.T_k}"
        mask = ("causal" + (", bottom-right" if self.T_q != self.T_k else "")) if self.causal else "non-causal"
        return f"B={self.B}, {heads}, {lengths}, d={self.d}, {mask}"

    def as_dict(self) -> dict:
        return {"part": self.part, "B": self.B, "NH": self.NH, "NH_kv": self.NH_kv, "T_q": self.T_q,
                "T_k": self.T_k, "d": self.d, "causal": self.causal}


def shape_flops(shape) -> int:
    """attention_flops_qk of a Shape or a Case (for a Shape: attention_flops)."""
    return attention_flops_qk(shape.B, shape.NH, shape.T_q, shape.T_k, shape.d, shape.causal)


def _round_to(x32, dtype: str):
    """float32 values rounded to `dtype` and held in float32 (exact: both halves are subsets of float32)."""
    cupy = _cupy()
    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(cupy.float16).astype(cupy.float32)
    bits = x32.view(cupy.uint32)  # bfloat16: round to nearest even on the top 16 bits
    bits = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) & cupy.uint32(0xFFFF0000)
    return bits.view(cupy.float32)


class Inputs:
    """One shape's random Q, K, V: the float32 values every implementation sees (rounded to the
    benchmark dtype), the arrays a rung gets, and torch views of the same memory (DLPack)."""

    def __init__(self, shape: Shape | Case, dtype: str, seed: int):
        cupy = _cupy()
        self.shape, self.dtype = shape, dtype
        rng = cupy.random.default_rng(seed)
        q_dims = (shape.B, shape.NH, shape.T_q, shape.d)
        kv_dims = (shape.B, shape.NH_kv, shape.T_k, shape.d)
        self.q32, self.k32, self.v32 = (_round_to(rng.standard_normal(dims, dtype=cupy.float32), dtype)
                                        for dims in (q_dims, kv_dims, kv_dims))
        self.rung_inputs_problem = None
        if dtype == "float32":
            self.qkv = (self.q32, self.k32, self.v32)
        else:
            try:
                target = np.float16 if dtype == "float16" else _ml_dtypes_bfloat16()
                self.qkv = tuple(x.astype(target) for x in (self.q32, self.k32, self.v32))
            except Exception as exc:
                self.qkv, self.rung_inputs_problem = None, f"CuPy cannot hold {dtype} here ({exc})"
        self._torch = None

    def torch_qkv(self):
        if self._torch is None:
            torch = _torch()
            tensors = [torch.from_dlpack(x) for x in (self.q32, self.k32, self.v32)]  # zero-copy
            if self.dtype != "float32":
                tensors = [t.to(getattr(torch, self.dtype)) for t in tensors]  # exact: values already rounded
            self._torch = tuple(tensors)
        return self._torch


def _ml_dtypes_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


_torch_module = None


def _torch():
    """torch, imported once; Unavailable if it cannot be."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except Exception as exc:
            raise Unavailable(f"torch is not importable ({type(exc).__name__}: {exc})") from None
        if not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False  # the math backend's matmuls in plain fp32
        _torch_module = torch
    return _torch_module


def _torch_loaded():
    return _torch_module


def free_memory() -> int:
    """Bytes the next allocation could get: the device's free memory plus CuPy's cached blocks,
    after torch hands its cached blocks back."""
    cupy = _cupy()
    if _torch_loaded() is not None:
        _torch_module.cuda.empty_cache()
    pool = cupy.get_default_memory_pool()
    return cupy.cuda.runtime.memGetInfo()[0] + pool.free_bytes()


def release_memory():
    _cupy().get_default_memory_pool().free_all_blocks()
    if _torch_loaded() is not None:
        _torch_module.cuda.empty_cache()


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    backend: str | None  # torch.nn.attention.SDPBackend member; None for the CuPy reference
    materialises: bool  # builds the T x T score matrix: memory grows with T^2

    def memory_needed(self, shape: Shape | Case) -> int:
        """A generous estimate for the materialising peers: three (B, NH, T_q, T_k) float32 temporaries."""
        return 3 * 4 * shape.B * shape.NH * shape.T_q * shape.T_k + (1 << 28) if self.materialises else 0


PEERS = {p.name: p for p in (
    Peer("reference", "CuPy reference", None, True),
    Peer("sdpa_math", "SDPA math", "MATH", True),
    Peer("sdpa_efficient", "SDPA efficient", "EFFICIENT_ATTENTION", False),
    Peer("sdpa_flash", "SDPA flash", "FLASH_ATTENTION", False),
    Peer("sdpa_cudnn", "SDPA cuDNN", "CUDNN_ATTENTION", False),
)}
DEFAULT_PEERS = {"float32": ("reference", "sdpa_math", "sdpa_efficient"),
                 "bfloat16": ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn"),
                 "float16": ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn")}
COMPARE_TO = {"float32": ("sdpa_efficient", "reference"),  # the README's "vs" columns, besides the previous rung
              "bfloat16": ("sdpa_flash", "sdpa_cudnn"),
              "float16": ("sdpa_flash", "sdpa_cudnn")}
FEATURE_PEER = {"float32": "sdpa_efficient", "bfloat16": "sdpa_flash", "float16": "sdpa_flash"}  # `features`


def sdpa_mask(shape: Shape | Case) -> str:
    """How SDPA expresses the rungs' mask for this shape: "none" (non-causal, or one query row under the
    bottom-right mask, which hides nothing from it), "is_causal" (T_q == T_k, where is_causal's top-left
    alignment is the same mask) or "lower_right" (T_q != T_k: torch.nn.attention.bias.causal_lower_right)."""
    if not shape.causal:
        return "none"
    if shape.T_q == shape.T_k:
        return "is_causal"
    return "none" if shape.T_q == 1 else "lower_right"


def lower_right_backend(q, k, v) -> str:
    """The SDPBackend member torch runs causal_lower_right with on these tensors under the backends now
    enabled: flash if it can, else memory-efficient, else the math path on a materialised mask
    (torch/nn/attention/bias.py, CausalBias._dispatch)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    try:
        params = SDPAParams(q, k, v, None, 0.0, False, False)  # torch >= 2.5: enable_gqa last
    except TypeError:
        params = SDPAParams(q, k, v, None, 0.0, False)
    if can_use_flash_attention(params):
        return "FLASH_ATTENTION"
    return "EFFICIENT_ATTENTION" if can_use_efficient_attention(params) else "MATH"


def sdpa_launch(torch, peer: Peer, q, k, v, shape: Shape | Case):
    """A function running torch SDPA on q, k, v as the rungs compute `shape` (its mask, cross lengths,
    grouped-query heads), under the backend the caller enabled; its `note` says how. Grouped-query heads
    go through enable_gqa=True where this torch and backend take it (one trial call), else through K and
    V repeated to NH heads for the peer only. NotComparable where the mask cannot be expressed."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs, notes = {}, []
    mask = sdpa_mask(shape)
    if mask == "is_causal":
        kwargs["is_causal"] = True
    elif mask == "lower_right":
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError:
            raise NotComparable("n/a: this torch has no torch.nn.attention.bias.causal_lower_right, and "
                                "is_causal=True aligns the mask top-left, not bottom-right") from None
        runs = lower_right_backend(q, k, v)
        if runs != peer.backend:
            raise NotComparable(f"n/a: torch runs the bottom-right causal mask of these inputs with {runs}, not "
                                f"{peer.backend}")
        kwargs["attn_mask"] = causal_lower_right(shape.T_q, shape.T_k)
        notes.append("attn_mask=causal_lower_right(T_q, T_k)")
    elif shape.causal:
        notes.append("one query row: the bottom-right mask hides no key, so is_causal=False")
    if shape.NH_kv != shape.NH:
        try:
            sdpa(q, k, v, enable_gqa=True, **kwargs)
            torch.cuda.synchronize()
            kwargs["enable_gqa"] = True
            notes.append("enable_gqa=True")
        except (TypeError, RuntimeError) as exc:  # an older torch, or a backend without grouped heads
            group = shape.NH // shape.NH_kv
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            notes.append(f"K and V repeated to {shape.NH} heads for the peer only (enable_gqa=True: "
                         f"{_first_line(exc)})")

    def launch():
        return sdpa(q, k, v, **kwargs)

    launch.note = "; ".join(notes)
    return launch


@contextlib.contextmanager
def peer_sessions(peer: Peer, inputs_list: list[Inputs]):
    """Yield (launches, stream) for a peer on each of these inputs (all of one shape), its backend
    enabled while the block runs; raise Unavailable if it cannot run them."""
    cupy = _cupy()
    shape = inputs_list[0].shape
    if peer.materialises:
        need, have = peer.memory_needed(shape), free_memory()
        if need > have:
            raise Unavailable(f"does not fit: needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB free")
    if peer.backend is None:
        def reference(inputs):
            q, k, v = inputs.q32, inputs.k32, inputs.v32
            return lambda: kernels.reference_attention(q, k, v, causal=shape.causal)

        yield [reference(x) for x in inputs_list], cupy.cuda.get_current_stream()
        return
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ptr = torch.cuda.current_stream().cuda_stream
    stream = cupy.cuda.get_current_stream()
    if ptr != stream.ptr:  # time torch where it runs
        stream = cupy.cuda.ExternalStream(ptr)
    with sdpa_kernel([getattr(SDPBackend, peer.backend)]):
        yield [sdpa_launch(torch, peer, *x.torch_qkv(), shape) for x in inputs_list], stream


@contextlib.contextmanager
def peer_session(peer: Peer, inputs: Inputs):
    """Yield (launch, stream) for a peer on these inputs; raise Unavailable if it cannot run."""
    with peer_sessions(peer, [inputs]) as (launches, stream):
        yield launches[0], stream


def as_cupy_float(out):
    """A peer's or rung's output as a CuPy array (torch tensors through DLPack)."""
    cupy = _cupy()
    if isinstance(out, cupy.ndarray):
        return out
    return cupy.from_dlpack(out.float().contiguous())


def check_outputs(inputs: Inputs, outputs: dict[str, object]) -> dict:
    """Every output's error against a float64 reference on the same inputs, with the plain float32
    implementation's own error beside it. Computed over chunks of K/V heads (each with the query heads
    it serves) so that the float64 score matrices fit in memory at any shape; every slice is checked."""
    cupy = _cupy()
    s = inputs.shape
    B, NH, NH_kv, T_q, T_k, d = s.B, s.NH, s.NH_kv, s.T_q, s.T_k, s.d
    group, kv_heads = NH // NH_kv, B * NH_kv
    as_q = lambda x: x.reshape(kv_heads, group, T_q, d)  # noqa: E731  (B, NH, T_q, d) -> (B*NH_kv, group, T_q, d)
    as_kv = lambda x: x.reshape(kv_heads, 1, T_k, d)  # noqa: E731  (B, NH_kv, T_k, d) -> (B*NH_kv, 1, T_k, d)
    q, k, v = as_q(inputs.q32), as_kv(inputs.k32), as_kv(inputs.v32)
    outs = {name: as_q(as_cupy_float(o)) for name, o in outputs.items()}
    budget = min(0.4 * free_memory(), 8 * 2**30)
    per_kv_head = 32 * group * T_q * T_k + 32 * T_k * d  # ~3 float64 T_q x T_k temporaries per query head, K and V
    chunk = int(max(1, min(kv_heads, budget // per_kv_head)))
    plain = ref_max = 0.0
    stats = {name: {"max": 0.0, "sum": 0.0, "nonfinite": 0} for name in outs}
    for start in range(0, kv_heads, chunk):
        part = slice(start, min(kv_heads, start + chunk))
        ref = kernels.reference_attention(*(x[part].astype(cupy.float64) for x in (q, k, v)), causal=s.causal)
        plain32 = kernels.reference_attention(q[part], k[part], v[part], causal=s.causal)
        plain = max(plain, float(cupy.abs(plain32 - ref).max()))
        del plain32
        ref_max = max(ref_max, float(cupy.abs(ref).max()))
        for name, out in outs.items():
            o = out[part].astype(cupy.float64)
            bad = int((~cupy.isfinite(o)).sum())
            diff = cupy.abs(o - ref)
            st = stats[name]
            st["nonfinite"] += bad
            st["max"] = math.inf if bad else max(st["max"], float(diff.max()))
            st["sum"] += float(diff.sum()) if not bad else 0.0
        del ref
    release_memory()
    floor = EPS[inputs.dtype] * ref_max
    bound = TOLERANCE_FACTOR * max(plain, floor)
    n = B * NH * T_q * d
    return {
        "plain32_err": plain,
        "ref_max": ref_max,
        "bound": bound,
        "outputs": {name: {"max_err": st["max"], "mean_err": (st["sum"] / n) if not st["nonfinite"] else math.inf,
                           "nonfinite": st["nonfinite"], "ok": st["max"] <= bound} for name, st in stats.items()},
    }


# ---------------------------------------------------------------------------------------------
# One shape: check every rung and peer on the same inputs, then time those that are right
# ---------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def describe_launch(launch, shape: Shape | Case) -> str:
    """The configuration a prepared rung runs, with its number of key splits for a split-KV rung."""
    inst = launch.instance
    text = inst.describe()
    rung = getattr(inst, "rung", None)
    if rung is not None and rung.split_kv:
        text += f", splits={inst.splits(shape.B, shape.NH, shape.T_q, shape.T_k)}"
    return text


def apply_check(rows: list[dict], check: dict | None, outputs: dict) -> None:
    """The gate: each output's error against float64 goes into its row; a rung over the bound is wrong."""
    for r in rows:
        if r["name"] in outputs:
            e = check["outputs"][r["name"]]
            r |= {"max_err": e["max_err"], "mean_err": e["mean_err"], "nonfinite": e["nonfinite"],
                  "bound": check["bound"], "plain32_err": check["plain32_err"]}
            if not e["ok"] and r["kind"] == "rung":
                r["status"] = "wrong"
                r["reason"] = (f"max error {e['max_err']:.2e} > bound {check['bound']:.2e}"
                               + (f"; {e['nonfinite']} elements NaN/inf (unwritten?)" if e["nonfinite"] else ""))


def run_peer_once(r: dict, peer: Peer, inputs: Inputs, outputs: dict) -> bool:
    """The peer once on `inputs`, its output kept for the check; False (the row says why) if it cannot run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with peer_session(peer, inputs) as (launch, stream):
                out = launch()
                stream.synchronize()
                if getattr(launch, "note", ""):
                    r["note"] = launch.note
            outputs[r["name"]] = out
            return True
        except Unavailable as exc:
            r["status"], r["reason"] = "n/a" if isinstance(exc, NotComparable) else "unavailable", str(exc)
        except Exception as exc:  # a backend that refuses this dtype or shape, out of memory, ...
            why = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
            r["status"], r["reason"] = "unavailable", _first_line(exc) + (f" ({why})" if why else "")
            release_memory()
    return False


def bench_shape(shape: Shape | Case, dtype: str, rungs: list[Path], peers: list[str], *, flush, method: Method,
                ffma_tflops: float, seed: int, counter: list[int], total: int) -> list[dict]:
    """Rows for one shape: every rung (ladder order), then every peer."""
    cupy = _cupy()
    progress(f"{shape.label}: NH={shape.NH}, d={shape.d}, {dtype}: running {len(rungs)} rungs (compiled on first "
             f"use) and {len(peers)} peers once, then checking them against float64 ...")
    inputs = Inputs(shape, dtype, seed)
    flops = shape_flops(shape)
    rows, launches, outputs = [], {}, {}

    def row(name, label, kind):
        r = {"shape": shape.as_dict(), "dtype": dtype, "name": name, "label": label, "kind": kind,
             "status": None, "flops": flops}
        rows.append(r)
        return r

    def report(r):
        counter[0] += 1
        where = f"[{counter[0]:>3}/{total}] {shape.label:>8} {r['label']:<24}"
        if r["status"] == "ok":
            t = r["timing"]
            progress(f"{where} {t['median_ms']:10.4f} ms [{t['p20_ms']:.4f}-{t['p80_ms']:.4f}] "
                     f"{r['tflops']:8.2f} TFLOP/s  err {r['max_err']:.1e} <= {r['bound']:.1e}")
        else:
            progress(f"{where} {r['status']}: {r.get('reason', '')}")

    # 1. Run each rung once on NaN-poisoned output, keeping its output for the check.
    for path in rungs:
        r = row(path.stem, path.stem, "rung")
        try:
            if inputs.qkv is None:
                raise TypeError(inputs.rung_inputs_problem)
            q, k, v = inputs.qkv
            launch = kernels.prepare(q, k, v, kernel=path, causal=shape.causal)  # validates, compiles: never timed
            r["config"] = describe_launch(launch, shape)
            out = launch()
            out.fill(np.nan)  # poison: an element the rung does not write fails the check
            out = launch()
            cupy.cuda.Device().synchronize()
            launches[r["name"]], outputs[r["name"]] = (launch, cupy.cuda.get_current_stream()), out
        except (TypeError, ValueError) as exc:  # this rung does not take these inputs
            r["status"], r["reason"] = "unsupported", _first_line(exc)
        except Exception as exc:
            r["status"], r["reason"] = "error", _first_line(exc)

    # 2. Each peer once on the same inputs.
    for name in peers:
        peer = PEERS[name]
        if run_peer_once(row(name, peer.label, "peer"), peer, inputs, outputs):
            launches[name] = (peer, None)

    # 3. The gate: every output against float64, in one pass over the reference.
    apply_check(rows, check_outputs(inputs, outputs) if outputs else None, outputs)
    outputs.clear()
    release_memory()

    # 4. Time what is right (peers are timed whatever their error, which is recorded beside them).
    for r in rows:
        if r["status"] is not None:
            report(r)
            continue
        try:
            if r["kind"] == "rung":
                launch, stream = launches[r["name"]]
                r["timing"] = time_gpu(launch, stream=stream, flush=flush, method=method)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with peer_session(launches[r["name"]][0], inputs) as (launch, stream):
                        cupy.cuda.Device().synchronize()  # CuPy's writes of the inputs are done before torch runs
                        r["timing"] = time_gpu(launch, stream=stream, flush=flush, method=method)
            r["status"] = "ok"
            r["tflops"] = flops / (r["timing"]["median_ms"] * 1e-3) / 1e12
            r["pct_ffma"] = 100.0 * r["tflops"] / ffma_tflops if ffma_tflops else None
        except Exception as exc:
            r["status"], r["reason"] = "unavailable" if r["kind"] == "peer" else "error", _first_line(exc)
        release_memory()
        report(r)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Speed-ups (the other's median over this one's): against the previous timed rung, and each peer."""
    timed = {r["name"]: r["timing"]["median_ms"] for r in rows if r["status"] == "ok"}
    peers = [r["name"] for r in rows if r["kind"] == "peer" and r["name"] in timed]
    previous = None
    for r in rows:
        r["speedup"] = {}
        if r["status"] != "ok":
            continue
        ms = r["timing"]["median_ms"]
        if r["kind"] == "rung":
            if previous is not None:
                r["speedup"]["previous"] = timed[previous] / ms
            previous = r["name"]
        for other in peers:
            if other != r["name"]:
                r["speedup"][other] = timed[other] / ms


def announce_and_measure_ceilings(setup: dict, method) -> dict:
    """Print the device line, then measure the FFMA and copy ceilings of this run."""
    dev = setup["device"]
    progress(f"{dev['name']} ({dev['arch']}, {dev['sm_count']} SMs), driver {dev['driver']}, CUDA {dev['cuda_runtime']}, "
             f"CuPy {setup['cupy']}, torch {setup['torch']}")
    progress("measuring the ceilings (fp32 SGEMM 8192^3 without TF32; device copy) ...")
    ceilings = measure_ceilings(method)
    progress(f"fp32 FFMA ceiling {ceilings['ffma_tflops']:.1f} TFLOP/s; copy {ceilings['copy_tbps']:.2f} TB/s")
    return ceilings


def run_shapes(kind: str, args, shapes: list[Shape]) -> dict:
    """The shared body of `kernels` and `sweep`: setup, ceilings, every shape, one result."""
    setup = setup_info(args.argv)
    method = Method(budget_ms=args.budget_ms)
    peers = list(DEFAULT_PEERS[args.dtype] if args.peers is None else args.peers)
    ceilings = announce_and_measure_ceilings(setup, method)
    flush = L2Flush()
    compile_before = kernels.runtime.compile_seconds
    rows, counter = [], [0]
    total = len(shapes) * (len(args.kernels) + len(peers))
    started = time.perf_counter()
    for i, shape in enumerate(shapes):
        rows += bench_shape(shape, args.dtype, args.kernels, peers, flush=flush, method=method,
                            ffma_tflops=ceilings["ffma_tflops"], seed=args.seed + i, counter=counter, total=total)
    return {
        "schema": SCHEMA,
        "kind": kind,
        "setup": setup,
        "flop_convention": FLOP_CONVENTION,
        "method": method.describe(flush.nbytes),
        "ceilings": ceilings,
        "dtype": args.dtype,
        "shapes": [s.as_dict() for s in shapes],
        "kernels": [p.stem for p in args.kernels],
        "peers": peers,
        "compare_to": list(COMPARE_TO[args.dtype]),
        "seed": args.seed,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# Features: decode, long-context decode, non-causal, cross lengths, grouped-query heads, head sizes
# ---------------------------------------------------------------------------------------------

FEATURE_PARTS = ("decode", "long", "noncausal", "cross", "gqa", "heads")
FEATURE_CASES = {  # part -> the cases measured, each in every dtype of the part
    "decode": [Case("decode", 1, 12, 12, 1, T_k, 64) for T_k in (1, 128, 512, 1024)],  # GPT-2 small, one token
    "long": [Case("long", 16, 32, 32, 1, 4096, 128)],
    "noncausal": [Case("noncausal", 4, 12, 12, 2048, 2048, 64, causal=False)],
    "cross": [Case("cross", 4, 12, 12, 256, 4096, 64)],
    "gqa": [Case("gqa", 4, 32, 8, 2048, 2048, 128)],
    "heads": [Case("heads", 8, 12, 12, 1024, 1024, d) for d in (32, 64, 96, 128)],
}
LONG_DTYPES = ("bfloat16", "float32", "float16")  # long context: bfloat16, and the others a rung declares
DECODE_TARGET_US = 5.0  # GPT-2 decode: kernel time per call at most this
LONG_TARGET_PCT = 75.0  # long-context decode: K+V bandwidth at least this % of the copy ceiling


def default_feature_rungs() -> list[Path]:
    """The rungs past causal self-attention: those declaring lab.supports or lab.split_kv."""
    return [kernels.resolve(n) for n in kernels.names() if kernels.load(n).supports or kernels.load(n).split_kv]


def declares(rung, case: Case, dtype: str) -> bool:
    """Whether a rung's declarations cover a case: the dtype, the head size and every feature it needs."""
    return dtype in rung.dtypes and case.d in rung.head_sizes() and case.needs() <= set(rung.supports)


def case_rungs(case: Case, dtype: str, candidates: list[Path], named: bool) -> list[Path]:
    """The rungs a case runs. Named on the command line: every one (those that do not take the case
    are reported unsupported). Otherwise those declaring it: for decode the split-KV rungs and, as
    context, the newest other rung; for long context the split-KV rungs; elsewhere all."""
    if named:
        return list(candidates)
    loaded = [(p, kernels.load(p)) for p in candidates]
    taking = [(p, r) for p, r in loaded if declares(r, case, dtype)]
    if case.part == "decode":
        newest_other = [p for p, r in taking if not r.split_kv][-1:]
        return [p for p, r in taking if r.split_kv or p in newest_other]
    if case.part == "long":
        return [p for p, r in taking if r.split_kv]
    return [p for p, _ in taking]


def feature_plan(parts: list[str], dtypes: list[str], candidates: list[Path], named: bool) -> list[dict]:
    """Every (case, dtype) to measure, in table order, with its rungs and its peer: `dtypes` for decode
    and the general features; for long context bfloat16 and any other dtype a chosen split-KV rung
    declares (every one, with named rungs)."""
    plan = []
    for part in FEATURE_PARTS:
        if part not in parts:
            continue
        if part == "long":
            loaded = [kernels.load(p) for p in candidates]
            part_dtypes = [t for t in LONG_DTYPES if t == "bfloat16" or any(
                t in r.dtypes and (named or r.split_kv) for r in loaded)]
        else:
            part_dtypes = list(dtypes)
        for case in FEATURE_CASES[part]:
            for dtype in part_dtypes:
                plan.append({"id": f"{part}-{case.B}x{case.T_q}x{case.T_k}-d{case.d}-{dtype}", "case": case,
                             "dtype": dtype,
                             "rungs": case_rungs(case, dtype, candidates, named), "peer": FEATURE_PEER[dtype]})
    return plan


def kv_bytes(case: Case, dtype: str) -> int:
    """Bytes of K and V: what a decode step must read."""
    return 2 * case.B * case.NH_kv * case.T_k * case.d * (4 if dtype == "float32" else 2)


def bench_decode(case: Case, dtype: str, rungs: list[Path], peer_name: str, *, caches: int, reps: int, seed: int,
                 counter: list[int], total: int) -> list[dict]:
    """Rows for one decode shape: every rung, then the peer, checked against float64 on the first cache,
    then timed over `caches` independent caches in turn (so that L2 does not hold K and V, as in a
    model where other layers ran since): kernel time per call from CUPTI, and per call in a CUDA graph."""
    cupy = _cupy()
    peer = PEERS[peer_name]
    progress(f"decode T_k={case.T_k} ({case.describe()}), {dtype}: {len(rungs)} rungs and {peer.label} over "
             f"{caches} caches, checked against float64 first ...")
    inputs = [Inputs(case, dtype, seed + i) for i in range(caches)]
    rows, runs, outputs = [], {}, {}

    def row(name, label, kind):
        r = {"shape": case.as_dict(), "dtype": dtype, "name": name, "label": label, "kind": kind, "status": None,
             "kv_bytes": kv_bytes(case, dtype)}
        rows.append(r)
        return r

    for path in rungs:
        r = row(path.stem, path.stem, "rung")
        try:
            if inputs[0].qkv is None:
                raise TypeError(inputs[0].rung_inputs_problem)
            launches = [kernels.prepare(*x.qkv, kernel=path, causal=case.causal) for x in inputs]
            r["config"] = describe_launch(launches[0], case)
            out = launches[0]()
            out.fill(np.nan)  # poison: an element the rung does not write fails the check
            out = launches[0]()
            cupy.cuda.Device().synchronize()
            runs[r["name"]], outputs[r["name"]] = launches, out
        except (TypeError, ValueError) as exc:
            r["status"], r["reason"] = "unsupported", _first_line(exc)
        except Exception as exc:
            r["status"], r["reason"] = "error", _first_line(exc)
    run_peer_once(row(peer_name, peer.label, "peer"), peer, inputs[0], outputs)
    apply_check(rows, check_outputs(inputs[0], outputs) if outputs else None, outputs)
    outputs.clear()
    release_memory()

    def timed(calls, graph) -> dict:
        t = {}
        try:
            t["kernel_timing"] = kernel_timing(calls, reps)
        except Exception as exc:  # the profiler failing leaves the graph's time
            t["kernel_timing"], t["kernel_reason"] = None, f"CUPTI: {_first_line(exc)}"
        t["kernel_us"] = t["kernel_timing"]["us"] if t["kernel_timing"] else None
        try:
            t["graph_us"] = graph(calls, reps)
        except Exception as exc:  # a capture the backend refuses
            t["graph_us"], t["graph_reason"] = None, _first_line(exc)
        return t

    for r in rows:
        if r["status"] is None:
            try:
                if r["kind"] == "rung":
                    r |= timed(runs[r["name"]], graph_us)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        with peer_sessions(peer, inputs) as (launches, _):
                            cupy.cuda.Device().synchronize()
                            r |= timed(launches, torch_graph_us)
                r["status"] = "ok"
            except Exception as exc:
                r["status"], r["reason"] = "unavailable" if r["kind"] == "peer" else "error", _first_line(exc)
        counter[0] += 1
        where = f"[{counter[0]:>3}/{total}] decode {dtype:<8} T_k {case.T_k:>5} {r['label']:<22}"
        if r["status"] == "ok":
            us = lambda x: "n/a" if x is None else f"{x:7.2f} us"  # noqa: E731
            progress(f"{where} kernel {us(r['kernel_us'])} (CUPTI), {us(r['graph_us'])} per call in a graph")
        else:
            progress(f"{where} {r['status']}: {r.get('reason', '')}")
    runs.clear()
    release_memory()
    peer_us = next((r["kernel_us"] for r in rows if r["kind"] == "peer" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and r["kernel_us"]:
            r["kv_tbps"] = r["kv_bytes"] / (r["kernel_us"] * 1e-6) / 1e12
            r["vs_peer"] = peer_us / r["kernel_us"] if peer_us and r["kind"] == "rung" else None
            if r["kind"] == "rung":
                r["target_met"] = r["kernel_us"] <= DECODE_TARGET_US
    return rows


def add_feature_ratios(rows: list[dict], peer_name: str, copy_tbps: float | None) -> None:
    """Each timed rung against the case's peer (the peer's median over the rung's); with a copy
    ceiling (long context), K+V bytes / time, its % of the ceiling and whether the target is met."""
    peer = next((r for r in rows if r["name"] == peer_name and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        ms = r["timing"]["median_ms"]
        r["vs_peer"] = peer["timing"]["median_ms"] / ms if peer is not None and r["kind"] == "rung" else None
        if copy_tbps is not None:
            r["kv_bytes"] = kv_bytes(Case(**r["shape"]), r["dtype"])
            r["kv_tbps"] = r["kv_bytes"] / (ms * 1e-3) / 1e12
            r["pct_copy"] = 100.0 * r["kv_tbps"] / copy_tbps if copy_tbps else None
            if r["kind"] == "rung" and r["pct_copy"] is not None:
                r["target_met"] = r["pct_copy"] >= LONG_TARGET_PCT


# ---------------------------------------------------------------------------------------------
# GPT-2 end to end: the seam to gpt2/ (imported lazily), our generation, HF transformers as a peer
# ---------------------------------------------------------------------------------------------

PROMPT = "Hello, I'm a language model,"


def gpt2_seam():
    """The GPT-2 of gpt2/: random_weights, load_tokenizer, generate(..., attend, kv_cache, on_token), save."""
    try:
        import gpt2
        from gpt2 import generate, load_tokenizer, random_weights, save  # noqa: F401  (the names e2e uses)
    except ImportError as exc:
        raise CannotRun(f"needs the GPT-2 package gpt2/ with random_weights, load_tokenizer, generate and save "
                        f"({type(exc).__name__}: {exc})") from None
    if "TIKTOKEN_CACHE_DIR" not in os.environ and (ROOT / ".cache" / "tiktoken").is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(ROOT / ".cache" / "tiktoken")  # the BPE files, carried (no network)
    return gpt2


def attend_with(gpt2, path: Path | None):
    """The attention function gpt2.forward calls: the CuPy reference, or a rung (as lab.py runs them)."""
    if path is None:
        return gpt2.reference_attend
    return kernels.Attend(path)


def time_generation(gpt2, ckpt, prompt: list[int], n_new: int, attend, kv_cache: bool, warmup: int) -> dict:
    """Wall-clock seconds for n_new greedy tokens, a timestamp per token (on_token runs after the
    token is on the host, so each stamp follows that step's GPU work), and the CuPy pool's size."""
    cupy = _cupy()
    pool = cupy.get_default_memory_pool()
    gpt2.generate(ckpt.params, ckpt.config, prompt, warmup, attend=attend, kv_cache=kv_cache)  # compile, warm up
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    stamps = []
    compile_before = kernels.runtime.compile_seconds
    start = time.perf_counter()
    out = gpt2.generate(ckpt.params, ckpt.config, prompt, n_new, attend=attend, kv_cache=kv_cache,
                        on_token=lambda token: stamps.append(time.perf_counter()))
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "elapsed": [t - start for t in stamps], "tokens": list(out.tokens),
            "compile_seconds_in_run": kernels.runtime.compile_seconds - compile_before,  # 0: warm-up compiled all
            "peak_bytes": pool.total_bytes(),
            "peak_what": "CuPy memory pool after the run (its high-water mark: blocks are cached, not freed), weights included"}


def time_hf_generation(folder: Path, prompt: list[int], n_new: int, kv_cache: bool, warmup: int,
                       attn_implementation: str) -> dict:
    """HF transformers' GPT2LMHeadModel on the same weights (saved by gpt2.save), fp32, greedy."""
    torch = _torch()
    try:
        import transformers
    except Exception as exc:
        raise Unavailable(f"transformers is not importable ({type(exc).__name__}: {exc})") from None
    try:
        from transformers.generation.streamers import BaseStreamer
    except ImportError:  # generate() only calls put() and end()
        BaseStreamer = object

    class TokenClock(BaseStreamer):
        """generate() puts the prompt first, then each new token as it is chosen (already on the host)."""

        def __init__(self):
            self.stamps, self.first = [], True

        def put(self, value):
            if not (self.first and value.numel() == len(prompt) > 1):  # the prompt, not a token
                self.stamps.append(time.perf_counter())
            self.first = False

        def end(self):
            pass

    model = transformers.GPT2LMHeadModel.from_pretrained(str(folder), attn_implementation=attn_implementation)
    model = model.to("cuda", dtype=torch.float32).eval()
    ids = torch.tensor([prompt], device="cuda")
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, use_cache=kv_cache,
                   pad_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=warmup, min_new_tokens=warmup, **options)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        clock = TokenClock()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, streamer=clock, **options)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_reserved()
    tokens = out[0, len(prompt):].tolist()
    del model, out
    release_memory()
    return {"seconds": seconds, "elapsed": [t - start for t in clock.stamps], "tokens": tokens, "peak_bytes": peak,
            "peak_what": "torch.cuda.max_memory_reserved() during the run, weights included",
            "attn_implementation": attn_implementation, "transformers": transformers.__version__}


DECODE_TARGETS = {"float32": 4000.0, "bfloat16": 7000.0}  # decode tokens/s with the KV cache, GPT-2 small
DECODE_STEPS = {"persistent": "one persistent kernel per window (kernels/fused/decode_step.cu)",
                "graphs": "CUDA graphs of the per-operation kernels (5 per layer + 2)"}


def time_decode(gpt2, ckpt, prompt: list[int], n_new: int, dtype: str, step: str, warmup: int) -> dict:
    """The fast engine's KV-cache generation in dtype with one decode step (DECODE_STEPS): time to the
    first token (the prefill, through the CuPy reference attention) and decode tokens/s from the
    first token's arrival on the host to the last's."""
    import gpt2.fast as fast

    cupy = _cupy()
    params = ckpt.params if dtype == "float32" else fast.as_bfloat16(ckpt.params)
    engine = fast.Engine(params, ckpt.config, dtype=dtype, persistent=step == "persistent")
    try:
        engine.generate(prompt, warmup, attend=gpt2.reference_attend, kv_cache=True)  # compile, warm up
        cupy.cuda.Device().synchronize()
        stamps = []
        start = time.perf_counter()
        out = engine.generate(prompt, n_new, attend=gpt2.reference_attend, kv_cache=True,
                              on_token=lambda token: stamps.append(time.perf_counter()))
        cupy.cuda.Device().synchronize()
        seconds = time.perf_counter() - start
        note = f"programmatic dependent launch {engine.pdl_note}" if step == "graphs" else None
    finally:
        del engine
        fast.clear_cache()
        release_memory()
    return {"seconds": seconds, "elapsed": [t - start for t in stamps], "tokens": list(out.tokens), "note": note}


def decode_figures(row: dict, weight_bytes_per_token: int, ceiling: float) -> None:
    """From a row's per-token stamps: time to first token, decode tokens/s, the weight bytes streamed
    per second and their % of the copy ceiling (bytes/s), and, for gpt2.fast, whether the target is met."""
    t = row["elapsed"]
    row["ttft_ms"] = 1e3 * t[0]
    rate = row["decode_tokens_per_s"] = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None
    if rate is None:
        return
    row["weight_bytes_per_token"] = weight_bytes_per_token
    row["weight_tbps"] = weight_bytes_per_token * rate / 1e12
    row["pct_copy"] = 100 * weight_bytes_per_token * rate / ceiling
    if row["step"] in DECODE_STEPS:
        row["target_met"] = rate >= DECODE_TARGETS[row["dtype"]]


def report_generation(count: int, total: int, row: dict) -> None:
    where = f"[{count:>3}/{total}] {row['mode']:>8} {row['label']:<26}"
    if row["status"] == "ok":
        n = len(row["tokens"])
        progress(f"{where} {row['seconds']:8.2f} s  {n / row['seconds']:7.1f} tokens/s  "
                 f"peak {row['peak_bytes'] / 2**20:8.0f} MiB")
    else:
        progress(f"{where} {row['status']}: {row['reason']}")


def add_generation_comparisons(rows: list[dict]) -> None:
    """Per mode: speed-up against the CuPy reference, and how many leading tokens match its."""
    for mode in {r["mode"] for r in rows}:
        ref = next((r for r in rows if r["mode"] == mode and r["name"] == "reference" and r["status"] == "ok"), None)
        for r in rows:
            if r["mode"] != mode or r["status"] != "ok":
                continue
            r["tokens_per_s"] = len(r["tokens"]) / r["seconds"]
            r["ms_per_token"] = 1e3 * r["seconds"] / len(r["tokens"])
            if ref is not None:
                r["speedup_vs_reference"] = ref["seconds"] / r["seconds"]
                same = 0
                for a, b in zip(r["tokens"], ref["tokens"], strict=False):
                    if a != b:
                        break
                    same += 1
                r["same_tokens_as_reference"] = same


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib is optional: the `plot` extra)
# ---------------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_or_none(plot, result: dict, path: Path) -> str | None:
    """Draw the plot beside the result file; its name, or None (saying why) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        progress("matplotlib is not installed (pip install -e '.[plot]'): no plot written; the JSON has the data")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plot(plt, result)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _device_title(result: dict) -> str:
    dev = result["setup"].get("device") or {}
    return f"{dev.get('name', 'no GPU')}, {result['setup']['date'][:10]}"


def _colors(plt, names: list[str]) -> dict[str, tuple]:
    """One distinct colour per name (tab20, then tab20b), stable across both plots."""
    palette = [plt.get_cmap("tab20")(i) for i in range(20)] + [plt.get_cmap("tab20b")(i) for i in range(20)]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def plot_sweep(plt, result: dict):
    fig, ax = plt.subplots(figsize=(11, 5.5))
    names = result["kernels"] + result["peers"]
    color = _colors(plt, names)
    for name in names:
        points = [(r["shape"]["T"], r["tflops"]) for r in result["rows"] if r["name"] == name and r["status"] == "ok"]
        if points:
            label = next(r["label"] for r in result["rows"] if r["name"] == name)
            ax.plot(*zip(*points, strict=True), marker="o", label=label, color=color[name],
                    linestyle="-" if name in result["kernels"] else "--")
    ffma = result["ceilings"]["ffma_tflops"]
    ax.axhline(ffma, color="gray", linestyle=":", label=f"fp32 FFMA ceiling ({ffma:.0f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"sequence length T (B = {result['tokens']} // T, NH = {result['shapes'][0]['NH']}, "
                  f"d = {result['shapes'][0]['d']})")
    ax.set_ylabel("TFLOP/s (causal: 4 B NH T^2 d / 2)")
    ax.set_title(f"causal attention forward, {result['dtype']}: {_device_title(result)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_e2e(plt, result: dict):
    """Elapsed time against tokens generated, one panel per mode, one colour per attention."""
    modes = [m for m in ("no-cache", "kv-cache") if any(r["mode"] == m and r["status"] == "ok" for r in result["rows"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes) + 3, 5.5), squeeze=False)
    labels = list(dict.fromkeys(r["label"] for r in result["rows"]))
    color = _colors(plt, labels)
    for ax, mode in zip(axes[0], modes, strict=True):
        for r in result["rows"]:
            if r["status"] == "ok" and r["mode"] == mode:
                ax.plot(range(1, len(r["elapsed"]) + 1), r["elapsed"], label=r["label"], color=color[r["label"]],
                        linestyle="--" if r["kind"] != "rung" else "-")
        ax.set_xlabel("tokens generated")
        ax.set_ylabel("elapsed seconds")
        ax.set_title("no KV cache (the seed's mode)" if mode == "no-cache" else "KV cache")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"GPT-2 small, greedy, float32, prompt {result['prompt']!r}: {_device_title(result)}")
    return fig


# ---------------------------------------------------------------------------------------------
# Tables (terminal and README alike)
# ---------------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    """Four significant digits, zeros kept (0.01723, 1.200, 12.34, 123.4)."""
    digits = max(0, 3 - math.floor(math.log10(x))) if x > 0 else 4
    return f"{x:.{digits}f}"


def _tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _x(x: float | None) -> str:
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


def render_rows_table(result: dict, rows: list[dict]) -> list[str]:
    compare = result["compare_to"]
    header = ["kernel", "ms", "p20-p80", "TFLOP/s", "% FFMA", "vs previous",
              *[f"vs {PEERS[c].label}" for c in compare], "max error", "note"]
    body = []
    for r in rows:
        if r["status"] == "ok":
            t = r["timing"]
            body.append([_label(r), _ms(t["median_ms"]), f"{_ms(t['p20_ms'])}-{_ms(t['p80_ms'])}", _tflops(r["tflops"]),
                         f"{r['pct_ffma']:.1f}%" if r.get("pct_ffma") is not None else "-",
                         _x(r["speedup"].get("previous")), *[_x(r["speedup"].get(c)) for c in compare],
                         f"{r['max_err']:.1e}" if r.get("max_err") is not None else "-", r.get("config", "")])
        else:
            err = f"{r['max_err']:.1e}" if r.get("max_err") is not None else "-"
            body.append([_label(r), f"**{r['status']}**", "-", "-", "-", "-", *["-" for _ in compare], err,
                         r.get("reason", "")])
    return table(header, body, "lrrrrrr" + "r" * len(compare) + "l")


def render_kernels(result: dict) -> str:
    c, m = result["ceilings"], result["method"]
    lines = setup_header(result) + [
        "",
        f"FLOP convention: {result['flop_convention']}. Ceilings measured in the same run: fp32 FFMA "
        f"{c['ffma_tflops']:.1f} TFLOP/s ({c['ffma_what']}); device copy {c['copy_tbps']:.2f} TB/s ({c['copy_what']}).",
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
        f"NH={result['shapes'][0]['NH']}, d={result['shapes'][0]['d']}, {result['dtype']}; fp32 FFMA ceiling "
        f"{c['ffma_tflops']:.1f} TFLOP/s measured in the same run. Median of many runs, CUDA events, L2 flushed.",
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
            cells.append("-" if r is None else _tflops(r["tflops"]) if r["status"] == "ok" else r["status"])
        body.append([str(shape["T"]), str(shape["B"]), *cells])
    return "\n".join(lines + [""] + table(["T", "B", *[labels.get(n, n) for n in names]], body,
                                          "rr" + "r" * len(names)))


def render_e2e(entries: list[tuple[Path, dict, set]], base: Path) -> str:
    """One block per result file, each with the modes it contributes."""
    out = []
    for path, result, modes in entries:
        lines = setup_header(result) + [
            "",
            f"{result['new_tokens']} new tokens after the {result['prompt_tokens']}-token prompt {result['prompt']!r}; "
            f"GPT-2 small with {result['model']}, float32, greedy. No cache: {result['method']['no-cache']}. "
            f"KV cache: {result['method']['kv-cache']}. HF peer: {result['method']['hf']}. Peak memory: what each "
            "framework's allocator held at most, weights included.",
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
                             f"{r['ms_per_token']:.2f}", _bytes(r["peak_bytes"]), _x(r.get("speedup_vs_reference")),
                             str(r.get("same_tokens_as_reference", "-"))])
            else:
                body.append([_label(r), r["mode"], f"**{r['status']}**", "-", "-", "-", "-", r.get("reason", "")])
        lines += [""] + table(["attention", "mode", "seconds", "tokens/s", "ms/token", "peak memory",
                               "vs reference", "leading tokens equal to the reference's"], body, "llrrrrrr")
        if result.get("decode") and "kv-cache" in modes:
            lines += ["", render_decode(result["decode"])]
        out.append("\n".join(lines))
    return "\n\n".join(out)


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
                        spread = (f"{_ms(kt['p20_us'])}-{_ms(kt['p80_us'])}" if "p20_us" in kt else kt.get(
                            "statistic", "-"))
                        body.append(first + [
                            _ms(r["kernel_us"]) if r.get("kernel_us") else "n/a", spread,
                            _ms(r["graph_us"]) if r.get("graph_us") else "n/a", _met(r),
                            f"{r['kv_tbps']:.2f}" if r.get("kv_tbps") else "-", _x(r.get("vs_peer")), _err(r),
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
                    body.append(first + [_ms(1e3 * tm["median_ms"]),
                                         f"{_ms(1e3 * tm['p20_ms'])}-{_ms(1e3 * tm['p80_ms'])}",
                                         _bytes(r["kv_bytes"]), f"{r['kv_tbps']:.2f}",
                                         f"{r['pct_copy']:.0f}%" if r.get("pct_copy") is not None else "-", _met(r),
                                         _x(r.get("vs_peer")), _err(r), _note(r)])
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
                    body.append(first + [_ms(tm["median_ms"]), f"{_ms(tm['p20_ms'])}-{_ms(tm['p80_ms'])}",
                                         _tflops(r["tflops"]), _x(r.get("vs_peer")), _err(r), _note(r)])
                else:
                    body.append(first + _status_cells(r, 4) + [_err(r), _note(r)])
        lines += table(["kernel", "dtype", "ms", "p20-p80", "TFLOP/s", vs, "max error", "note"], body, "llrrrrrl")
        lines += [f"\n{n}" for n in _peer_notes([r for e in group for r in e["rows"]])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def cmd_kernels(args) -> int:
    require_gpu()
    shapes = [Shape(B, T, args.nh, args.d) for B, T in (args.shape or GPT2_SHAPES)]
    result = run_shapes("kernels", args, shapes)
    path = write_result(result, result_path("kernels", result["setup"], args.results))
    print("\n" + render_kernels(result))
    progress(f"wrote {path}")
    return 0


def cmd_sweep(args) -> int:
    require_gpu()
    lengths = [2**i for i in range(int(math.log2(args.t_min)), int(math.log2(args.t_max)) + 1)]
    shapes = [Shape(max(1, args.tokens // T), T, args.nh, args.d) for T in lengths]
    result = run_shapes("sweep", args, shapes)
    result["tokens"] = args.tokens
    path = result_path("sweep", result["setup"], args.results)
    result["plot"] = plot_or_none(plot_sweep, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_sweep(result, result["plot"]))
    progress(f"wrote {path}" + (f" and {result['plot']}" if result["plot"] else ""))
    return 0


def measure_decode(gpt2, ckpt, prompt: list[int], args, rows: list[dict]) -> dict:
    """The KV-cache decode table: the fast engine in float32 and bfloat16 with each decode step, and
    HF transformers' float32 kv-cache row measured above, each with its time to first token, decode
    tokens/s, the weight bytes streamed per second against the copy ceiling measured now, and the
    lab's decode target."""
    import gpt2.fast as fast

    ceiling = fast.copy_ceiling()
    progress(f"decode: copy ceiling {ceiling / 1e12:.2f} TB/s (bytes read + written)")
    out = []
    for dtype in DECODE_TARGETS:
        for step in DECODE_STEPS:
            row = {"dtype": dtype, "step": step, "label": f"gpt2.fast, {step}"}
            try:
                row |= time_decode(gpt2, ckpt, prompt, args.tokens, dtype, step, args.warmup)
                row["status"] = "ok"
            except Exception as exc:
                row |= {"status": "error", "reason": _first_line(exc)}
            out.append(row)
        hf = next((r for r in rows if r["name"] == "hf" and r["mode"] == "kv-cache"), None)
        if dtype == "float32" and hf is not None:  # the kv-cache row measured above
            out.append(dict(hf) | {"dtype": dtype, "step": "HF generate"})
    for r in out:
        if r["status"] != "ok":
            progress(f"decode {r['dtype']:<8} {r['label']:<30} {r['status']}: {r.get('reason', '')}")
            continue
        decode_figures(r, fast.weight_bytes_per_token(ckpt.config, r["dtype"]), ceiling)
        progress(f"decode {r['dtype']:<8} {r['label']:<30} first token {r['ttft_ms']:7.1f} ms, "
                 f"decode {r['decode_tokens_per_s'] or 0:8.1f} tokens/s")
    for r in out:
        r.pop("elapsed", None)
    return {"copy_tbps": ceiling / 1e12, "targets": DECODE_TARGETS, "steps": DECODE_STEPS, "rows": out,
            "method": "time.perf_counter stamps as each token reaches the host (gpt2.fast copies tokens back in "
                      f"windows, of {fast.STEPS_PER_LAUNCH} tokens with the persistent step and "
                      f"{fast.STEPS_PER_GRAPH} with graphs, while the GPU runs the next window): time to first "
                      "token = the prompt's "
                      "prefill and first argmax; decode tokens/s = (tokens - 1) / (last stamp - first stamp). "
                      "Weight bytes per token: gpt2.fast.weight_bytes_per_token (every matrix once, wte whole)."}


def cmd_e2e(args) -> int:
    require_gpu()
    gpt2 = gpt2_seam()
    cupy = _cupy()
    setup = setup_info(args.argv)
    modes = [False, True] if args.mode == "both" else [args.mode == "kv-cache"]
    ckpt = gpt2.random_weights("gpt2", seed=args.seed, xp=cupy)
    try:
        prompt = gpt2.load_tokenizer(None).encode(args.prompt, allowed_special="all")
    except Exception as exc:  # gpt2.LabError: no tiktoken files and no network
        raise CannotRun(str(exc)) from None
    impls = [("reference", "CuPy reference", None)] + [(p.stem, p.stem, p) for p in args.kernels]
    total = len(modes) * (len(impls) + (0 if args.no_hf else 1))
    progress(f"{setup['device']['name']}: GPT-2 small, {ckpt.name}, {len(prompt)} prompt tokens, "
             f"{args.tokens} new tokens, greedy, float32")
    rows, count = [], 0
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:  # the weights as HF reads them
        hf_folder = None
        for kv in modes:
            mode = "kv-cache" if kv else "no-cache"
            for name, label, path in impls:
                count += 1
                row = {"name": name, "label": label, "kind": "rung" if path else "peer", "mode": mode, "kv_cache": kv}
                try:
                    row |= time_generation(gpt2, ckpt, prompt, args.tokens, attend_with(gpt2, path), kv, args.warmup)
                    row["status"] = "ok"
                except Exception as exc:
                    row |= {"status": "error", "reason": _first_line(exc)}
                release_memory()
                rows.append(row)
                report_generation(count, total, row)
            if not args.no_hf:
                count += 1
                row = {"name": "hf", "label": f"HF transformers ({args.hf_attn})", "kind": "peer", "mode": mode,
                       "kv_cache": kv}
                try:
                    hf_folder = hf_folder or gpt2.save(ckpt, Path(scratch) / "gpt2")
                    row |= time_hf_generation(hf_folder, prompt, args.tokens, kv, args.warmup, args.hf_attn)
                    row["status"] = "ok"
                except Exception as exc:  # Unavailable, or transformers refusing something
                    row |= {"status": "unavailable", "reason": _first_line(exc)}
                rows.append(row)
                report_generation(count, total, row)
    add_generation_comparisons(rows)
    decode = measure_decode(gpt2, ckpt, prompt, args, rows) if True in modes and not args.no_decode else None
    result = {
        "schema": SCHEMA, "kind": "e2e", "setup": setup,
        "model": ckpt.name, "prompt": args.prompt, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
        "sampling": "greedy", "dtype": "float32", "modes": ["kv-cache" if kv else "no-cache" for kv in modes],
        "method": {
            "clock": "time.perf_counter around gpt2.generate (device synchronized before and after), after a "
                     f"{args.warmup}-token warm-up generation that compiles every rung and CuPy kernel",
            "no-cache": "every step runs the whole sequence so far through the model (gpt2's fast path: fused "
                        "kernels, the products on kernels/fused/gemm.cu's 3xTF32 wgmma on sm_90, else cuBLAS "
                        "SGEMM; past the last layer's attention only the last position): the attention under "
                        "test runs on every token, at every length",
            "kv-cache": "the prompt is prefilled through the attention under test; each later step is one query "
                        "over a static cache, gpt2.fast's decode step (the persistent kernel where the device runs "
                        "it, else CUDA graphs of its fused kernels), the same for every rung",
            "hf": "transformers GPT2LMHeadModel.from_pretrained on the same weights (gpt2.save), fp32, "
                  "generate(do_sample=False, min_new_tokens=max_new_tokens), use_cache per mode",
        },
        "rows": rows,
        "decode": decode,
    }
    path = result_path("e2e", setup, args.results)
    result["plot"] = plot_or_none(plot_e2e, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_e2e([(path, result, set(result["modes"]))], ROOT))
    progress(f"wrote {path}" + (f" and {result['plot']}" if result["plot"] else ""))
    return 0


def cmd_resources(args) -> int:
    on_device = args.arch is None and gpu_problem() is None
    arch = None if on_device else (args.arch or "sm_90")
    try:
        nvrtc_version = "{}.{}".format(*kernels.nvrtc.version())
    except RuntimeError as exc:  # libnvrtc not found
        raise CannotRun(str(exc).splitlines()[0]) from None
    setup = setup_info(args.argv)
    if not on_device:
        setup["device"] = None  # compiled for a named architecture: no device was involved
    rows = []
    for path in args.kernels:
        try:
            reports = kernels.resources(path, arch=arch)
        except kernels.KernelCompileError as exc:
            rows.append({"kernel": path.stem, "error": str(exc).splitlines()[0]})
            progress(f"{path.stem}: does not compile: {str(exc).splitlines()[0]}")
            continue
        for r in reports:
            rows.append(r.as_dict())
            progress(f"{r.kernel:<24} {str(r.config):<40} {r.registers:>4} registers, smem {r.static_smem} + "
                     f"{r.dynamic_smem}, stack {r.stack_bytes}, spills {r.spill_stores}/{r.spill_loads}, "
                     f"blocks/SM {r.blocks_per_sm if r.blocks_per_sm is not None else '-'}")
    result = {"schema": SCHEMA, "kind": "resources", "setup": setup, "nvrtc": nvrtc_version,
              "arch": setup["device"]["arch"] if on_device else arch, "on_device": on_device,
              "kernels": [p.stem for p in args.kernels], "rows": rows}
    slug_fallback = f"{arch}-nvrtc" if arch else "nogpu"
    path = write_result(result, result_path("resources", setup, args.results, slug_fallback))
    print("\n" + render_resources(result))
    progress(f"wrote {path}")
    return 0


def cmd_features(args) -> int:
    require_gpu()
    setup = setup_info(args.argv)
    method = Method(budget_ms=args.budget_ms)
    named = args.kernels is not None
    candidates = args.kernels if named else default_feature_rungs()
    plan = feature_plan(args.parts, args.dtypes, candidates, named)
    ceilings = announce_and_measure_ceilings(setup, method)
    flush = L2Flush()
    compile_before = kernels.runtime.compile_seconds
    started = time.perf_counter()
    rows, counter = [], [0]
    total = sum(len(entry["rungs"]) + 1 for entry in plan)
    for i, entry in enumerate(plan):
        case, dtype, peer = entry["case"], entry["dtype"], entry["peer"]
        seed = args.seed + 1000 * i
        if case.part == "decode":
            got = bench_decode(case, dtype, entry["rungs"], peer, caches=args.caches, reps=args.reps, seed=seed,
                               counter=counter, total=total)
        else:
            got = bench_shape(case, dtype, entry["rungs"], [peer], flush=flush, method=method,
                              ffma_tflops=ceilings["ffma_tflops"], seed=seed, counter=counter, total=total)
            add_feature_ratios(got, peer, ceilings["copy_tbps"] if case.part == "long" else None)
        for r in got:
            r["case"] = entry["id"]
        rows += got
        release_memory()
    result = {
        "schema": SCHEMA,
        "kind": "features",
        "setup": setup,
        "flop_convention": FEATURE_FLOP_CONVENTION,
        "method": method.describe(flush.nbytes) | {
            "decode": f"kernel time per call: CUPTI kernel records through torch.profiler (every kernel a call "
                      f"launches, summed), the median over {args.reps} passes through {args.caches} independent "
                      f"caches in turn, so that L2 does not hold K and V; graph: the same {args.reps} x "
                      f"{args.caches} calls captured as one CUDA graph (CuPy's stream capture for the rungs, "
                      "torch.cuda.graph for SDPA), one replay timed with events, divided by the calls",
            "caches": args.caches,
            "reps": args.reps,
            "speedup": "vs peer: the peer's time over the rung's (above 1x: the rung is faster)",
        },
        "ceilings": ceilings,
        "targets": {"decode_kernel_us": DECODE_TARGET_US, "long_pct_copy": LONG_TARGET_PCT},
        "parts": [p for p in FEATURE_PARTS if p in args.parts],
        "dtypes": list(args.dtypes),
        "kernels": [p.stem for p in candidates],
        "kernels_named": named,
        "peers": dict(FEATURE_PEER),
        "cases": [{"id": e["id"], "part": e["case"].part, "shape": e["case"].as_dict(), "dtype": e["dtype"],
                   "peer": e["peer"], "kernels": [p.stem for p in e["rungs"]],
                   "flops": shape_flops(e["case"])} for e in plan],
        "seed": args.seed,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
    }
    path = write_result(result, result_path("features", setup, args.results))
    print("\n" + render_features(result))
    progress(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------
# README: the tables between <!-- bench:<section>:start --> and <!-- bench:<section>:end -->
# ---------------------------------------------------------------------------------------------

_MARKER = re.compile(r"<!--\s*bench:([A-Za-z0-9_-]+):(start|end)\s*-->")


def find_sections(text: str) -> dict[str, tuple[int, int]]:
    """{section: (end of its start marker, start of its end marker)}; ValueError on a malformed pair."""
    starts, ends = {}, {}
    for m in _MARKER.finditer(text):
        name, edge = m.groups()
        if name not in SECTIONS:
            raise ValueError(f"unknown section {name!r} in {m.group(0)} (known: {', '.join(SECTIONS)})")
        marks = starts if edge == "start" else ends
        if name in marks:
            raise ValueError(f"{m.group(0)} appears twice")
        marks[name] = m
    spans = {}
    for name in sorted(set(starts) | set(ends), key=lambda n: (starts.get(n) or ends[n]).start()):
        if name not in starts or name not in ends:
            missing = "start" if name not in starts else "end"
            raise ValueError(f"<!-- bench:{name}:{missing} --> is missing")
        if ends[name].start() < starts[name].end():
            raise ValueError(f"<!-- bench:{name}:end --> comes before its start marker")
        spans[name] = (starts[name].end(), ends[name].start())
    ordered = sorted(spans.items(), key=lambda kv: kv[1])
    for (a, (_, a_end)), (b, (b_start, _)) in zip(ordered, ordered[1:], strict=False):
        if b_start < a_end:
            raise ValueError(f"section {b} starts inside section {a}")
    return spans


def replace_sections(text: str, spans: dict[str, tuple[int, int]], blocks: dict[str, str]) -> str:
    for name, (a, b) in sorted(spans.items(), key=lambda kv: kv[1], reverse=True):
        if name in blocks:
            text = text[:a] + "\n" + blocks[name].strip("\n") + "\n" + text[b:]
    return text


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def readme_blocks(found: dict[str, list[Path]], base: Path) -> dict[str, str]:
    """The generated text of each section that has results, from the newest file of its kind
    (for e2e, the newest file of each mode)."""
    blocks = {}

    def source(*paths: Path) -> str:
        names = ", ".join(f"`{os.path.relpath(p, base)}`" for p in paths)
        return f"<!-- generated by `python3 bench.py readme` from {names}; rerun bench.py rather than editing -->"

    if found["kernels"]:
        newest_per_dtype: dict[str, tuple[Path, dict]] = {}  # float32 first, then the low-precision tables
        for p in found["kernels"]:
            result = _load(p)
            newest_per_dtype.setdefault(result["dtype"], (p, result))
        order = sorted(newest_per_dtype, key=lambda t: (t != "float32", t))
        blocks["kernels"] = source(*[newest_per_dtype[t][0] for t in order]) + "\n" + "\n\n".join(
            render_kernels(newest_per_dtype[t][1]) for t in order)
    if found["sweep"]:
        p = found["sweep"][0]
        result = _load(p)
        image = os.path.relpath(p.parent / result["plot"], base) if result.get("plot") else None
        blocks["sweep"] = source(p) + "\n" + render_sweep(result, image)
    if found["e2e"]:
        entries, wanted = [], ["no-cache", "kv-cache"]
        for p in found["e2e"]:
            result = _load(p)
            modes = {m for m in result["modes"] if m in wanted}
            if modes:
                entries.append((p, result, modes))
                wanted = [m for m in wanted if m not in modes]
            if not wanted:
                break
        blocks["e2e"] = source(*[p for p, *_ in entries]) + "\n" + render_e2e(entries, base)
    if found["resources"]:
        p = found["resources"][0]
        blocks["resources"] = source(p) + "\n" + render_resources(_load(p))
    if found["features"]:
        p = found["features"][0]
        blocks["features"] = source(p) + "\n" + render_features(_load(p))
    return blocks


def cmd_readme(args) -> int:
    readme, results = args.readme, args.results
    if not readme.is_file():
        raise CannotRun(f"{readme} does not exist")
    text = readme.read_text()
    try:
        spans = find_sections(text)
    except ValueError as exc:
        raise CannotRun(f"{readme}: {exc}; nothing rewritten") from None
    if not spans:
        raise CannotRun(f"{readme} has no bench markers (a line <!-- bench:kernels:start --> and a line "
                        "<!-- bench:kernels:end -->, likewise for sweep, e2e, resources, features); nothing rewritten")
    found = newest_results(results)
    if getattr(args, "replot", False):
        for kind, plot in (("sweep", plot_sweep), ("e2e", plot_e2e)):
            for p in found[kind][:1]:
                plot_or_none(plot, _load(p), p.with_suffix(".png"))  # the JSON already names this PNG
    blocks = readme_blocks(found, readme.parent)
    for name in SECTIONS:
        if name in blocks and name not in spans:
            print(f"bench.py readme: {readme.name} has no bench:{name} markers; the {name} table is not shown",
                  file=sys.stderr)
        elif name in spans and name not in blocks:
            progress(f"no {name} results in {results}: that section is left as it is")
    new = replace_sections(text, spans, {k: v for k, v in blocks.items() if k in spans})
    if new != text:
        readme.write_text(new)
    written = [k for k in blocks if k in spans]
    progress(f"{readme}: {'rewrote' if new != text else 'already current:'} {', '.join(written) or 'nothing'}")
    return 0


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int]:
    """'8x1024' -> (8, 1024): batch x sequence length."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"shape must be BxT with positive integers, e.g. 8x1024; got {text!r}")
    return int(m[1]), int(m[2])


def kernel_list(text: str) -> list[Path]:
    """'v01,v2,v03_x' or 'all' -> rung files (kernels.resolve: v8, v08, v08_name, or a .cu path)."""
    if text.strip() == "all":
        return [kernels.resolve(n) for n in kernels.names()]
    try:
        return [kernels.resolve(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def peer_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(unknown)}: choose from {', '.join(PEERS)} "
                                         "(or none)")
    return names


def _choices(text: str, allowed, what: str, extra: str = "") -> list[str]:
    """'a,b' -> the names given, each once, in order; an argparse error names the unknown ones."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown) or repr(text)}: choose from "
                                         f"{', '.join(allowed)}{extra}")
    return list(dict.fromkeys(names))


def part_list(text: str) -> list[str]:
    """'decode,gqa' -> the features parts, in the order given; 'all' for every part."""
    return list(FEATURE_PARTS) if text.strip() == "all" else _choices(text, FEATURE_PARTS, "part", " (or all)")


def dtype_list(text: str) -> list[str]:
    return _choices(text, DTYPES, "dtype")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {text!r}")
    return value


def arch_name(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}[a-z]?", text):
        raise argparse.ArgumentTypeError(f"architecture must look like sm_90 (or sm_80, sm_90a), got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{kernels,sweep,e2e,resources,features,readme}")

    def results_option(p):
        p.add_argument("--results", type=Path, default=RESULTS,
                       help="folder for result files (default: results/ beside bench.py; results/scratch/ is git-ignored)")

    def shape_options(p, budget_ms):
        p.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                       help="rungs, comma-separated (v05,v12 or a .cu path); default: every rung")
        p.add_argument("--peers", type=peer_list, default=None, metavar="LIST",
                       help=f"peers from {', '.join(PEERS)} or none; default float32: "
                            f"{','.join(DEFAULT_PEERS['float32'])}; bfloat16/float16: {','.join(DEFAULT_PEERS['bfloat16'])}")
        p.add_argument("--nh", type=positive_int, default=12, help="heads (default 12)")
        p.add_argument("--d", type=positive_int, default=64, help="head size (default 64)")
        p.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="input dtype; rungs that do not take it are reported unsupported (default float32)")
        p.add_argument("--budget-ms", type=float, default=budget_ms,
                       help=f"GPU time to spend on the timed runs of each entry (default {budget_ms:g}; 10-200 runs)")
        p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
        results_option(p)

    k = sub.add_parser("kernels", help="every rung x shapes beside the peers: ms, TFLOP/s, %% of FFMA, speed-ups",
                       description="Every rung x shapes (default the five GPT-2 shapes, NH=12, d=64), each checked "
                                   "against a float64 reference, then timed beside the CuPy reference and torch SDPA.")
    k.add_argument("--shape", type=parse_shape, action="append", metavar="BxT",
                   help="batch x sequence length, repeatable (default: 1x512 8x1024 16x2048 6x4096 1x8192)")
    shape_options(k, 300.0)

    s = sub.add_parser("sweep", help="TFLOP/s against sequence length, with a PNG plot",
                       description="TFLOP/s against T (powers of two from --t-min to --t-max) with B = --tokens // T, "
                                   "for chosen rungs and peers; a PNG plot (matplotlib) beside the JSON.")
    s.add_argument("--t-min", type=power_of_two, default=128, help="shortest T, a power of two (default 128)")
    s.add_argument("--t-max", type=power_of_two, default=16384, help="longest T, a power of two (default 16384)")
    s.add_argument("--tokens", type=positive_int, default=16384, help="B x T per point: B = tokens // T (default 16384)")
    shape_options(s, 150.0)

    e = sub.add_parser("e2e", help="seconds for GPT-2 small to generate 512 tokens, per rung, beside HF transformers",
                       description="Seconds to generate --tokens tokens greedily from the prompt with GPT-2 small "
                                   "(random weights, float32), with the CuPy reference and each rung as the attention, "
                                   "without and with a KV cache; HF transformers generate() on the same weights.")
    e.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs, comma-separated; default: every rung (the CuPy reference always runs)")
    e.add_argument("--tokens", type=positive_int, default=512, help="new tokens (default 512)")
    e.add_argument("--prompt", default=PROMPT, help=f"default {PROMPT!r}")
    mode = e.add_mutually_exclusive_group()
    mode.add_argument("--kv-cache", dest="mode", action="store_const", const="kv-cache",
                      help="only the KV-cache mode (default: both modes)")
    mode.add_argument("--no-cache", dest="mode", action="store_const", const="no-cache",
                      help="only the no-cache mode, the seed's setup (default: both modes)")
    e.set_defaults(mode="both")
    e.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    e.add_argument("--no-decode", action="store_true",
                   help="leave out the decode table (gpt2.fast in float32 and bfloat16 with each decode step)")
    e.add_argument("--hf-attn", choices=("sdpa", "eager"), default="sdpa",
                   help="the HF model's attn_implementation (default sdpa)")
    e.add_argument("--warmup", type=positive_int, default=64,
                   help="tokens of the warm-up generation (default 64: two of the persistent step's windows)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    results_option(e)

    r = sub.add_parser("resources", help="registers, shared memory, spills, blocks per SM of every rung and config",
                       description="Every rung and configuration: registers, shared memory, stack, spills (ptxas "
                                   "through NVRTC), and resident blocks per SM on a device. Without a GPU, or with "
                                   "--arch, compiles for that architecture (default sm_90) with no device.")
    r.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST", help="default: every rung")
    r.add_argument("--arch", type=arch_name, default=None, help="compile for this architecture (sm_90) with NVRTC")
    results_option(r)

    f = sub.add_parser("features", help="decode, long-context decode, non-causal, cross lengths, GQA and head "
                                        "sizes on the rungs that declare them, beside torch SDPA",
                       description="The attention features past causal self-attention, each case checked against "
                                   "a float64 reference, then timed beside torch SDPA (float32 against SDPA "
                                   "efficient, bfloat16/float16 against SDPA flash): GPT-2 decode (B=1, NH=12, d=64, "
                                   "one query over T_k = 1, 128, 512, 1024 keys; CUPTI kernel time per call with "
                                   "independent caches in rotation, and per call in a CUDA graph; target <= 5 us), "
                                   "long-context decode (B=16, NH=32, d=128, T_k=4096; TB/s of K+V against the copy "
                                   "ceiling; target >= 75%), non-causal (B=4, NH=12, T=2048, d=64), cross lengths "
                                   "(T_q=256 over T_k=4096, causal bottom-right), grouped-query heads (B=4, NH=32, "
                                   "NH_kv=8, T=2048, d=128) and head sizes 32/64/96/128 (B=8, NH=12, T=1024). "
                                   "The defaults are sized for about 3 minutes of GPU time, compilation aside; "
                                   "--parts, --dtypes and --budget-ms trim it.")
    f.add_argument("--parts", type=part_list, default=list(FEATURE_PARTS), metavar="LIST",
                   help=f"parts to run, comma-separated, from {', '.join(FEATURE_PARTS)} (default: all)")
    f.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs to try in every case (those that do not take a case are reported unsupported); "
                        "default: the rungs declaring lab.supports or lab.split_kv, each in the cases it declares "
                        "(decode: the split-KV rungs and the newest other rung; long context: the split-KV rungs)")
    f.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"], metavar="LIST",
                   help="dtypes of decode and of the general features (default float32,bfloat16); long context "
                        "runs bfloat16 and whichever of float32, float16 its rungs declare")
    f.add_argument("--budget-ms", type=float, default=100.0,
                   help="GPU time for the timed runs of each event-timed entry (default 100; 10-200 runs)")
    f.add_argument("--caches", type=positive_int, default=24,
                   help="decode: independent caches the calls rotate through, so that L2 does not hold K/V "
                        "(default 24)")
    f.add_argument("--reps", type=positive_int, default=10,
                   help="decode: passes through the caches, profiled and captured as one graph (default 10)")
    f.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    results_option(f)

    m = sub.add_parser("readme", help="rewrite README.md's tables between markers from the newest results",
                       description="Rewrite what lies between <!-- bench:<section>:start --> and "
                                   "<!-- bench:<section>:end --> (sections kernels, sweep, e2e, resources, features) "
                                   "from the "
                                   "newest result file of each kind; nothing outside the markers changes. "
                                   "Exits 2 if the README has no markers.")
    m.add_argument("--readme", type=Path, default=README, help="default: README.md beside bench.py")
    m.add_argument("--results", type=Path, default=RESULTS, help="default: results/ beside bench.py")
    m.add_argument("--replot", action="store_true",
                   help="also redraw the newest sweep and e2e plots from their JSON (after a change to the plotting)")
    return parser


COMMANDS = {"kernels": cmd_kernels, "sweep": cmd_sweep, "e2e": cmd_e2e, "resources": cmd_resources,
            "features": cmd_features, "readme": cmd_readme}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "kernels", False) is None and args.command != "features":  # features picks per case
        # decode rungs (split-KV) are made for a few query rows over a long cache, not whole sequences:
        # they are timed only when named (and by tests/test_decode_gpu.py's timing on decode shapes)
        whole = args.command == "resources"
        dtype = getattr(args, "dtype", "float32")  # e2e runs float32
        args.kernels = [kernels.resolve(n) for n in kernels.names()
                        if whole or (not kernels.load(n).split_kv and dtype in kernels.load(n).dtypes)]
    if args.command == "sweep" and args.t_min > args.t_max:
        parser.error(f"--t-min {args.t_min} is larger than --t-max {args.t_max}")
    try:
        return COMMANDS[args.command](args)
    except CannotRun as exc:
        return fail(f"{args.command}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
