"""Timing on the GPU: CUDA events with warm-up, L2 flush, median and spread; CUPTI kernel time and CUDA
graphs for calls too short for events; and the ceilings a run measures (fp32 FFMA; TF32, bf16 and fp16
tensor GEMM; device copy)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import device
from .cases import TOLERANCE_FACTOR
from .clocks import wait_reading_clock


class L2Flush:
    """Writes a buffer twice the size of L2 (read from the device) so no run finds the last one's data."""

    def __init__(self):
        cupy = device.get_cupy()
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
            "sm_clock": "NVML's SM clock read every 0.5 ms while the host waits for an entry's timed runs to "
                        "finish (median, min, max MHz; entries timed together share one), where NVML loads",
            "tolerance": f"max |out - ref64| <= {TOLERANCE_FACTOR:g} x max(max |plain32 - ref64|, eps(dtype) x max |ref64|)",
        }


def warm_estimate(fn, stream, flush, method: Method) -> float:
    """`fn()` run method.warmup times, then once more timed (ms): the estimate that sizes the timed runs."""
    cupy = device.get_cupy()
    with stream:
        for _ in range(method.warmup):
            fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        flush()
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end)


def runs_for(estimate_ms: float, method: Method) -> int:
    return int(min(method.max_runs, max(method.min_runs, method.budget_ms / max(estimate_ms, 1e-3))))


def time_gpu(fn, *, stream, flush, method: Method) -> dict:
    """Median and spread, in ms, of `fn()` over many runs, timed with CUDA events on `stream`."""
    cupy = device.get_cupy()
    Event = cupy.cuda.Event
    cupy.cuda.Device().synchronize()  # whatever another framework queued is done before the clock starts
    runs = runs_for(warm_estimate(fn, stream, flush, method), method)
    with stream:
        events = [(Event(), Event()) for _ in range(runs)]
        for s, e in events:
            flush()
            s.record(stream)
            fn()
            e.record(stream)
        clock = wait_reading_clock(events[-1][1])
    return summary(np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in events])) | with_clock(clock)


def with_clock(clock: dict | None) -> dict:
    """{"sm_clock": the SM clock's median, min and max MHz while the timed runs ran} where it was read."""
    return {"sm_clock": clock} if clock else {}


def summary(times: np.ndarray) -> dict:
    """Median and spread, in ms, of one entry's timed runs."""
    return {
        "median_ms": float(np.median(times)),
        "p20_ms": float(np.percentile(times, 20)),
        "p80_ms": float(np.percentile(times, 80)),
        "min_ms": float(times.min()),
        "max_ms": float(times.max()),
        "runs": int(times.size),
    }


INTERLEAVE = ("the rungs of a shape timed together: each round runs every rung once (L2 flushed before each), "
              "the order rotated by one rung a round, the same number of rounds for all; each rung's timing keeps "
              "its runs in round order (round_ms); the peers are timed one after another")


def time_interleaved(entries: list[tuple], *, flush, method: Method) -> list[dict]:
    """time_gpu for several entries (fn, stream) at once, in rounds: each round runs every entry once, the
    order rotated by one entry a round, so that a clock the GPU holds for some milliseconds is shared by
    the entries of a round instead of falling on whichever was timed then. Every entry runs as many rounds
    (from the slowest entry's first run and the budget per entry); each result is time_gpu's plus the
    times of its runs in round order ("round_ms"), which bench.py compare pairs round by round. Where an
    entry's stream differs from the one before it in the round, it waits for that entry's end event, so
    the entries never overlap."""
    if not entries:
        return []
    cupy = device.get_cupy()
    Event = cupy.cuda.Event
    cupy.cuda.Device().synchronize()
    runs = runs_for(max(warm_estimate(fn, stream, flush, method) for fn, stream in entries), method)
    n = len(entries)
    events = [[None] * runs for _ in range(n)]
    previous = None  # (stream, end event) of the entry run last
    for r in range(runs):
        for i in [(r + j) % n for j in range(n)]:
            fn, stream = entries[i]
            with stream:
                if previous is not None and previous[0] is not stream:
                    stream.wait_event(previous[1])
                s, e = Event(), Event()
                flush()
                s.record(stream)
                fn()
                e.record(stream)
            events[i][r] = (s, e)
            previous = (stream, e)
    clock = wait_reading_clock(previous[1])
    cupy.cuda.Device().synchronize()
    out = []
    for i in range(n):  # the rounds share one clock: every entry's is the same
        times = np.array([cupy.cuda.get_elapsed_time(s, e) for s, e in events[i]])
        out.append(summary(times) | {"interleaved": n, "round_ms": [float(f"{t:.6g}") for t in times]} | with_clock(clock))
    return out


def time_together(entries: list[tuple], *, flush, method: Method, label: str, what: str) -> list[dict] | None:
    """time_interleaved for two entries or more; None for fewer, or (after a progress line: `label`: ...,
    timing the `what` one by one) when it fails, so that the caller times them one by one instead."""
    if len(entries) < 2:
        return None
    try:
        return time_interleaved(entries, flush=flush, method=method)
    except Exception as exc:
        device.progress(f"{label}: interleaved timing failed ({device.first_line(exc)}); timing the {what} one by one")
        return None


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
    cupy = device.get_cupy()
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
    cupy = device.get_cupy()
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
    torch = device.get_torch()
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
    """fp32 FFMA ceiling (cupy.matmul of n^3 float32, TF32 off), the tensor GEMM ceilings of TF32, bf16 and
    fp16 (measure_tensor_ceilings) and device-to-device copy bandwidth."""
    cupy = device.get_cupy()
    rng = cupy.random.default_rng(1234)
    mode = fp32_matmul_mode()
    stream = cupy.cuda.get_current_stream()
    quick = Method(budget_ms=min(method.budget_ms, 300.0), min_runs=5, max_runs=50, warmup=2)

    def time_gemm():
        a, b = (rng.standard_normal((n, n), dtype=cupy.float32) for _ in range(2))
        c = cupy.empty((n, n), dtype=cupy.float32)
        return time_gpu(lambda: cupy.matmul(a, b, out=c), stream=stream, flush=no_flush, method=quick)

    gemm = time_gemm()
    device.release_memory()
    return {
        "ffma_tflops": 2 * n**3 / (gemm["median_ms"] * 1e-3) / 1e12,
        "ffma_what": f"cupy.matmul float32 {n}^3 (cuBLAS, compute type {mode}, CUPY_TF32=0)",
        "ffma_timing": gemm,
        **measure_tensor_ceilings(method, n),
        **measure_copy(method, copy_bytes),
    }


TENSOR_GEMMS = (("tf32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))  # ceilings' keys, torch dtypes


@contextlib.contextmanager
def cublas_math(torch, tf32: bool):
    """torch's cuBLAS settings for a ceiling, restored after: TF32 allowed or not for float32, and the
    16-bit GEMMs' reductions kept in float32 (no reduced-precision split-K)."""
    matmul = torch.backends.cuda.matmul
    names = [n for n in ("allow_tf32", "allow_fp16_reduced_precision_reduction",
                         "allow_bf16_reduced_precision_reduction") if hasattr(matmul, n)]
    saved = {n: getattr(matmul, n) for n in names}
    try:
        for n in names:
            setattr(matmul, n, tf32 if n == "allow_tf32" else False)
        yield
    finally:
        for n, value in saved.items():
            setattr(matmul, n, value)


def time_torch_gemm(torch, dtype: str, n: int, stream, method: Method) -> dict:
    """time_gpu of torch.matmul on two random n x n matrices of `dtype` (freed on return)."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    a, b = (torch.randn((n, n), device="cuda", generator=gen).to(getattr(torch, dtype)) for _ in range(2))
    c = torch.empty((n, n), device="cuda", dtype=getattr(torch, dtype))
    return time_gpu(lambda: torch.matmul(a, b, out=c), stream=stream, flush=no_flush, method=method)


def time_torch_fp8_gemm(torch, n: int, stream, method: Method) -> dict:
    """time_gpu of torch._scaled_mm on two random n x n e4m3 matrices (per-tensor scales of 1, bfloat16 out;
    the second operand column-major, as the FP8 GEMM takes it), freed on return."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    a, b = (torch.randn((n, n), device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    b = b.t()  # column-major
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return time_gpu(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    stream=stream, flush=no_flush, method=method)


def measure_tensor_ceilings(method: Method, n: int = 8192) -> dict:
    """The tensor-core GEMM ceilings, torch.matmul of n^3 (cuBLAS, float32 accumulate): float32 with TF32
    allowed (tf32_tflops), bfloat16 (bf16_tflops), float16 (fp16_tflops); and torch._scaled_mm of e4m3
    (fp8_tflops), what an FP8 rung is held against. Each None, its `_what` saying why, where torch or the
    GEMM is unavailable (FP8: before sm_89)."""
    quick = Method(budget_ms=min(method.budget_ms, 300.0), min_runs=5, max_runs=50, warmup=2)
    try:
        torch = device.get_torch()
    except device.Unavailable as exc:
        return {f"{key}_{field}": value for key in [k for k, _ in TENSOR_GEMMS] + ["fp8"]
                for field, value in (("tflops", None), ("what", f"unavailable: {exc}"))}
    cupy = device.get_cupy()
    ptr = torch.cuda.current_stream().cuda_stream
    stream = cupy.cuda.get_current_stream()
    if ptr != stream.ptr:  # time torch where it runs
        stream = cupy.cuda.ExternalStream(ptr)
    out = {}
    for key, dtype in TENSOR_GEMMS:
        what = (f"torch.matmul {dtype} {n}^3 (cuBLAS" + (", allow_tf32=True" if key == "tf32" else "")
                + ", float32 accumulate, reduced-precision reductions off)")
        try:
            with cublas_math(torch, tf32=key == "tf32"):
                gemm = time_torch_gemm(torch, dtype, n, stream, quick)
            out |= {f"{key}_tflops": 2 * n**3 / (gemm["median_ms"] * 1e-3) / 1e12, f"{key}_what": what,
                    f"{key}_timing": gemm}
        except Exception as exc:  # out of memory, a dtype cuBLAS refuses here
            out |= {f"{key}_tflops": None, f"{key}_what": f"unavailable: {what}: {device.first_line(exc)}"}
        device.release_memory()
    what = f"torch._scaled_mm float8_e4m3fn {n}^3 (cuBLASLt, per-tensor scales, bfloat16 out)"
    try:
        gemm = time_torch_fp8_gemm(torch, n, stream, quick)
        out |= {"fp8_tflops": 2 * n**3 / (gemm["median_ms"] * 1e-3) / 1e12, "fp8_what": what, "fp8_timing": gemm}
    except Exception as exc:  # no float8 in this torch, a device before sm_89, out of memory
        out |= {"fp8_tflops": None, "fp8_what": f"unavailable: {what}: {device.first_line(exc)}"}
    device.release_memory()
    return out


def measure_copy(method: Method, copy_bytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth, bytes read + written over the median time: the ceiling a
    bandwidth-bound kernel (decode) is held against."""
    cupy = device.get_cupy()
    stream = cupy.cuda.get_current_stream()
    quick = Method(budget_ms=min(method.budget_ms, 300.0), min_runs=5, max_runs=50, warmup=2)

    def time_copy():
        src = cupy.random.default_rng(1234).random(copy_bytes // 4, dtype=cupy.float32)
        dst = cupy.empty_like(src)
        return time_gpu(lambda: dst.data.copy_from_device_async(src.data, src.nbytes, stream), stream=stream,
                        flush=no_flush, method=quick)

    copy = time_copy()
    device.release_memory()  # the two buffers are gone with time_copy's frame
    return {
        "copy_tbps": 2 * copy_bytes / (copy["median_ms"] * 1e-3) / 1e12,
        "copy_what": f"device-to-device copy of {copy_bytes >> 20} MiB; bytes read + written",
        "copy_timing": copy,
    }
