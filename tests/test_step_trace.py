"""tools/step_trace.py's arithmetic on the CPU, on a trace built by hand (the GPU run is the tool itself):
each block's start, end and next start of a stage, their spreads, and a head's key splits against the
one that holds the position."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import step_trace  # noqa: E402


def trace(stages: int, blocks: int) -> np.ndarray:
    """Two steps: block b ends stage k at 1000 (step * stages + k) + 10 b ns and has the next stage's
    inputs 100 + b ns later (the end of one stage and the start of the next, decode_step.cu's marks)."""
    t = np.zeros((2, stages, blocks, 2), dtype=np.int64)
    for step in range(2):
        for k in range(stages):
            for b in range(blocks):
                end = 1000 * (step * stages + k) + 10 * b
                t[step, k, b] = (end, end + 100 + b)
    return t


def test_block_times_take_the_second_step_and_the_previous_marks_as_starts():
    t = trace(stages=3, blocks=4)
    start, end, ready = step_trace.block_times(t, 3)
    assert start.shape == end.shape == ready.shape == (3, 4)
    assert end[0].tolist() == [3000, 3010, 3020, 3030]  # step 1, stage 0
    assert ready[0].tolist() == [3100, 3111, 3122, 3133]
    assert start[0].tolist() == [2100, 2111, 2122, 2133]  # step 0's last stage, inputs in hand
    assert start[1].tolist() == ready[0].tolist()


def test_stage_spread_in_microseconds():
    t = trace(stages=3, blocks=4)
    row = step_trace.stage_spread(*step_trace.block_times(t, 3))[1]
    # work: end (4000 + 10 b) less start (3100 + 11 b) = 900 - b ns
    np.testing.assert_allclose(row[:3], [0.897, 0.8985, 0.9])
    np.testing.assert_allclose(row[3:5], [0.015, 0.03])  # ends 0, 10, 20, 30 ns behind the first
    np.testing.assert_allclose(row[5:], [0.1, 0.1015, 0.103])  # waits 100 + b


def test_split_skew_finds_the_last_split_and_the_one_holding_the_position():
    heads, splits = 2, 3
    start = np.array([[0, 500, 200, 0, 0, 0, 7]], dtype=np.int64)  # a seventh block with no head
    end = np.array([[3000, 3000, 3400, 1000, 1900, 1000, 9]], dtype=np.int64)
    # position 5: chunk ceil(6 / 3) = 2, so split 2 holds it
    got = step_trace.split_skew(start, end, heads, splits, pos=5)
    assert got.shape == (1, 2, 3)
    np.testing.assert_allclose(got[0, 0], [0.5, 0.4, 1.0])  # head 0: split 2 ends last
    np.testing.assert_allclose(got[0, 1], [0.0, 0.9, 0.0])  # head 1: split 1 does


def test_attention_phases_split_stage_b_at_its_inner_marks():
    """A TRACE_MARKS 6 trace (two layers and the lm_head): block b ends a stage at 1000 k + 10 b ns; its
    partial stored 600 ns before, the head's partials in hand 450 before, y_h combined 400 before, the
    projection done 100 before (then the second pass); the previous stage's inputs in hand 100 ns after
    that stage's end. Where mark 5 is 0 (no second pass), the projection runs to the stage's end."""
    stages, blocks = 9, 6
    t = np.zeros((2, stages, blocks, 6), dtype=np.int64)
    for step in range(2):
        for k in range(stages):
            for b in range(blocks):
                end = 1000 * (step * stages + k) + 10 * b
                t[step, k, b] = (end, end + 100, end - 600, end - 450, end - 400, end - 100)
    start, _, _ = step_trace.block_times(t, stages)
    got = step_trace.attention_phases(t, start, stages, 4, working=4)
    assert got.shape == (2, 4, 5)  # layers, working blocks, phases
    np.testing.assert_allclose(got[0, 0], [0.3, 0.15, 0.05, 0.3, 0.1])
    t[..., 5] = 0
    got = step_trace.attention_phases(t, start, stages, 4, working=4)
    np.testing.assert_allclose(got[1, 3], [0.3, 0.15, 0.05, 0.4, 0.0])


def test_the_detail_build_compiles_without_spills():
    """decode_step.cu with TRACE_MARKS 6, as tools/step_trace.py --detail builds it (beside the size's
    switches), at GPT-2 small and xl."""
    import gpt2
    import gpt2.fast as fast
    from gpt2.fast.plan import with_options
    from kernels import fused

    for size in ("gpt2", "gpt2-xl"):
        file, expr = fast.kernel_expressions(gpt2.SIZES[size], "bfloat16")["decode_step"]
        options = with_options(fast.step_options(gpt2.SIZES[size], "bfloat16"), ("-DTRACE_MARKS=6",))
        r = fused.compile_report(file, expr, "sm_90", options)
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0 and r.registers <= 168, (size, r)


def test_resolution_is_the_smallest_step_between_marks():
    t = np.array([[0, 1024, 2048], [1056, 3072, 0]], dtype=np.int64)
    assert step_trace.resolution(t) == 32


def test_the_result_file_names_each_column_stage_spread_makes():
    t = np.arange(1, 7, dtype=float).reshape(2, 3) * 1e3
    assert step_trace.stage_spread(t, t + 1e3, t + 2e3).shape[1] == len(step_trace.SPREAD_COLUMNS)
