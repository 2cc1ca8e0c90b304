"""tools/prefill_timeline.py's reading of a trace, on a made-up one: busy time as the union of the kernels'
intervals, gaps by the pair around them, the host's slow calls."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import prefill_timeline as timeline  # noqa: E402


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_the_intervals():
    assert timeline.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert timeline.busy_us([(3, 4)]) == 1 and timeline.busy_us([]) == 0


def test_a_trace_s_kernels_gaps_and_host_calls():
    events = [kernel("ln", 100, 10), kernel("gemm", 117, 20), kernel("ln", 140, 10), kernel("gemm", 157, 20),
              kernel("side", 160, 5),  # on another stream, inside gemm's interval: no gap, no double count
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90, "dur": 800},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 95, "dur": 4},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999}]
    s = timeline.summarize(events, wall_ms=0.2, top=5, slow_us=50)
    assert s["kernels"] == 5 and s["busy_ms"] == pytest.approx(0.060) and s["span_ms"] == pytest.approx(0.077)
    assert s["gaps_ms"] == pytest.approx(0.017) and s["outside_span_ms"] == pytest.approx(0.2 - 0.077)
    assert [(k["name"], k["launches"]) for k in s["by_kernel"]] == [("gemm", 2), ("ln", 2), ("side", 1)]
    assert s["by_kernel"][0]["share_of_busy"] == pytest.approx(40 / 60)
    assert [(g["before"], g["after"], g["count"]) for g in s["gaps"]] == [("ln", "gemm", 2), ("gemm", "ln", 1)]
    assert sum(g["total_ms"] for g in s["gaps"]) == pytest.approx(s["gaps_ms"])  # every gap told, once
    assert s["slow_host_calls"] == [{"name": "cudaGraphLaunch", "us": 800}]
    text = timeline.render("title", s)
    assert "ln -> gemm" in text and "host call cudaGraphLaunch: 800 us" in text


def test_a_trace_without_kernels_says_what_is_missing():
    with pytest.raises(ValueError, match="no kernel"):
        timeline.summarize([{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}], wall_ms=1.0)
