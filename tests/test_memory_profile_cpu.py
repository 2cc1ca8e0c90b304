"""tools/memory_profile.py's bookkeeping: the live allocations at their peak, summed by the place that made
them (the CuPy hook that feeds it runs on the device)."""

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import memory_profile  # noqa: E402


def test_the_peak_is_the_largest_live_total_and_its_places():
    where = iter(["weights", "weights", "prefill", "engine", "prefill"])
    peak = memory_profile.LivePeak(where=lambda: next(where))
    peak.malloc(1, 100)
    peak.malloc(2, 100)
    peak.malloc(3, 50)  # a prefill transient
    peak.free(3)
    peak.malloc(4, 30)  # the engine, after the transient went back
    assert peak.peak == 250 and peak.total == 230
    assert peak.by_place() == {"weights": 200, "prefill": 50}
    peak.malloc(5, 40)  # a new peak: 270, the engine in it and the transient not
    assert peak.peak == 270 and peak.by_place() == {"weights": 200, "prefill": 40, "engine": 30}
    peak.free(99)  # a block taken before the hook: nothing to take back
    assert peak.total == 270


def test_a_place_is_the_lab_s_innermost_frames():
    root = str(Path(memory_profile.__file__).resolve().parent.parent)
    stack = [traceback.FrameSummary(f"{root}/lab.py", 10, "run"),
             traceback.FrameSummary(f"{root}/gpt2/fast/engine.py", 70, "__init__"),
             traceback.FrameSummary(f"{root}/gpt2/fast/persistent.py", 78, "_lay_out"),
             traceback.FrameSummary("/venv/cupy/_creation/basic.py", 5, "empty")]
    assert memory_profile.place(stack, root) == ("gpt2/fast/persistent.py:78 _lay_out < gpt2/fast/engine.py:70 "
                                                 "__init__ < lab.py:10 run")
    assert memory_profile.place(stack[3:], root) == "(outside the lab)"
