"""tools/racecheck_ring.py, the skeleton of decode_step.cu's weight stream under racecheck: its kernel compiled
for sm_90, kept to decode_step's threads and issue delay, its expected sums (a slot read holding another
item's values fails them), its verdicts; on the GPU, every case's sums right without the tool."""

import re
import sys
from pathlib import Path

import pytest

from gpt2.fast.plan import STEP_THREADS
from kernels import nvrtc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import racecheck_ring as ring  # noqa: E402


def test_the_skeleton_compiles_for_sm_90():
    source = (ROOT / "tools" / "racecheck_ring.cu").read_text()
    (result,) = nvrtc.compile_isolated(source, "racecheck_ring.cu", ["-arch=sm_90", "-Xptxas=-v"], ["ring"])
    assert "registers" in result["log"]


def test_the_skeleton_keeps_decode_steps_threads_and_float32_issue_delay():
    cu = (ROOT / "tools" / "racecheck_ring.cu").read_text()
    assert ring.THREADS == STEP_THREADS == int(re.search(r"constexpr int THREADS = (\d+);", cu).group(1))
    step = (ROOT / "kernels" / "fused" / "decode_step.cu").read_text()
    float32_delay = int(re.search(r"#define ISSUE_DELAY_NS \(sizeof\(weight_t\) == 2 \? \d+ : (\d+)\)", step).group(1))
    assert ring.CASES["ring2"].issue_ns == float32_delay


def test_the_expected_sums_catch_a_slot_holding_another_item():
    src = ring.ring_source()
    want = ring.ring_expected(src)
    assert want.shape == (ring.BLOCKS, ring.THREADS)
    stale = src.copy()
    stale[7] = src[5]  # item 7 read from a slot still holding item 5 (2 slots)
    assert (ring.ring_expected(stale) != want).all()


def rows(drawn):
    return [{"case": name, "errors": 4 if name in drawn else 0} for name in ring.CASES]


def test_the_verdicts():
    assert ring.verdict(rows(set())) == "No skeleton case draws the report; decode_step is clean at 2 slots."
    assert ring.verdict(rows({"step-float32"})).startswith("The skeleton is clean and decode_step draws")
    one = {"ring2", "ring2-waits", "ring2-landed", "ring3-waits", "ring2-waits-recheck", "step-float32"}
    assert ring.verdict(rows(one)).startswith("Thread 0's arrival for the compute threads draws the report")
    timing = {"ring2", "ring2-waits", "ring2-all-waits", "ring3-waits", "step-float32"}
    said = ring.verdict(rows(timing))
    assert said.startswith("The report follows the timing") and said.endswith("A test_wait after the wait clears it.")
    said = ring.verdict(rows(timing | {"ring2-waits-recheck"}))
    assert said.endswith("A test_wait after the wait does not clear it.")
    assert ring.verdict(rows({"ring2", "ring2-all", "ring2-landed"})).startswith("The report follows no one property")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n, c in ring.CASES.items() if isinstance(c, ring.Ring)])
def test_every_skeleton_case_sums_right(name):
    import cupy as cp

    assert ring.run_ring(cp, ring.CASES[name])
