"""tools/attention_trace.py without a GPU: the phases it reads from a trace of known marks, and the
kernel's diagnostic build: the marks it takes, and none without it; tools/attention_ncu.sh's errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llama
import llama.fast as fast
from kernels import fused

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import attention_trace  # noqa: E402


def block(start, steps):
    """Marks 0.. of a block: start, then each mark `steps[k]` ns after the one before (8 marks, 0 past them)."""
    out = np.zeros(fast.plan.ATTENTION_TRACE_MARKS, np.uint64)
    out[0] = start
    for k, step in enumerate(steps):
        out[k + 1] = int(out[k]) + step
    return out


def test_phases_are_the_marks_differences_over_the_splits_in_use():
    t = np.zeros((1, 1, 2, 3, 8), np.uint64)  # one repeat, one layer, two heads, three splits
    # head 0: splits 0 and 1 in use, split 1 combines; split 2 returned at once (mark 0 only)
    t[0, 0, 0, 0] = block(1000, [3000, 400, 600, 200, 800, 500])
    t[0, 0, 0, 1] = block(1100, [2900, 600, 800, 200, 600, 700, 900])
    t[0, 0, 0, 2] = block(1200, [])
    # head 1: the same, split 0 combines
    t[0, 0, 1, 0] = block(1000, [3200, 400, 600, 200, 800, 500, 1000])
    t[0, 0, 1, 1] = block(1000, [3000, 400, 600, 200, 800, 500])
    t[0, 0, 1, 2] = block(1300, [])
    got = attention_trace.phases(t)
    assert got["waiting for the projection"] == pytest.approx((3000 + 2900 + 3200 + 3000) / 4 / 1e3)
    assert got["q and the staged rows"] == pytest.approx((400 + 600 + 400 + 400) / 4 / 1e3)
    assert got["warps combined"] == pytest.approx((800 + 600 + 800 + 800) / 4 / 1e3)
    assert got["partial and ticket"] == pytest.approx((500 + 700 + 500 + 500) / 4 / 1e3)
    assert got["combine"] == pytest.approx((900 + 1000) / 2 / 1e3)
    assert got["splits in use"] == 2
    # the layer's projection complete at 4000 (the earliest mark 1); its last y at head 0's 1100 + 2900 +
    # 600 + 800 + 200 + 600 + 700 + 900 = 7800 (head 1's at 7700)
    assert got["critical"] == pytest.approx((7800 - 4000) / 1e3)
    # head 0: partials at 1000 + 3000 + 400 + 600 + 200 + 800 + 500 = 6500 and 1100 + 2900 + 600 + 800 + 200
    # + 600 + 700 = 6900; head 1: 6700 and 6500
    assert got["splits apart"] == pytest.approx((400 + 200) / 2 / 1e3)
    one = t[:, :, :, :1].copy()  # one split a head: y stored at mark 6, no combine
    one[..., 7] = 0
    got = attention_trace.phases(one)
    assert got["combine"] == 0.0 and got["splits apart"] == 0.0
    assert got["critical"] == pytest.approx((6700 - 4000) / 1e3)


def test_caches_parse_and_leave_room_for_a_graph_ending_there():
    assert attention_trace.parse_cache("512:40,260") == (512, [40, 260])
    for bad in ("512", "512:3", "512:511", "x:40"):
        with pytest.raises(ValueError, match="--cache"):
            attention_trace.parse_cache(bad)


@pytest.mark.parametrize("size", ["llama-3.2-1b", "llama-3.1-8b"])
def test_the_trace_build_marks_each_phase_and_the_plain_build_none(size):
    """With TRACE the kernel reads the global timer at its 8 marks (6 and 7 on each of their paths: the
    only split, the ticket, the fast and the long combine); without it, not once, and it has one more
    parameter than it reads (trace, null from the engine)."""
    config = llama.SIZES[size]

    def body(trace):
        text = fused.ptx(*fast.plan.attention_kernel(config, "bfloat16", 4, False, trace))
        return text[text.index(".entry"):]

    plain, traced = body(False), body(True)
    assert "globaltimer" not in plain
    assert len(re.findall(r"%globaltimer", traced)) == 10
    r = fused.compile_report(*fast.plan.attention_kernel(config, "bfloat16", 4, False, True), "sm_90")
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    cu = fused.path_of("gqa_decode_attention").read_text()
    assert f"#define TRACE_MARKS {fast.plan.ATTENTION_TRACE_MARKS} " in cu


def test_the_ncu_script_refuses_a_bad_size_and_a_machine_without_ncu(tmp_path):
    """tools/attention_ncu.sh: a size that is not Llama's, or no ncu on the PATH, is a clear error (2);
    its embedded driver is valid Python."""
    script = Path(__file__).resolve().parent.parent / "tools" / "attention_ncu.sh"
    env = {**os.environ, "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    bad = subprocess.run(["bash", str(script), "gpt2"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "not a Llama size" in bad.stderr
    if not any((Path(d) / "ncu").exists() for d in env["PATH"].split(":")):
        none = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
        assert none.returncode == 2 and "no ncu here" in none.stderr
    text = script.read_text()
    driver = text[text.index('DRIVER="') + len('DRIVER="'):text.index('"\nMETRICS=')]
    compile(driver.replace("$SIZE", "llama-3.2-1b"), "attention_ncu driver", "exec")
