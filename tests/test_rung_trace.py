"""tools/rung_trace.py without a GPU: the traced copy of a rung (its options, what it refuses), the trace's
declared shape, the phases read from clocks built by hand, and, with nvdisasm, where the diagnostic's clock
reads sit in v34's SASS: none in the rung's own build, five in the traced one's loop, around the products'
waits and the softmax."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import ladder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import rung_trace  # noqa: E402
import wgmma_waits  # noqa: E402

V34 = ladder.load("v34")


def test_the_traced_copy_adds_the_switch_to_the_rung_s_options():
    source = rung_trace.with_trace(V34.path.read_text())
    assert re.search(r"^ \* lab\.options[ \t]+-arch=sm_90a -DSTEP_TRACE=1$", source, flags=re.M)
    assert source.replace(" -DSTEP_TRACE=1", "", 1) == V34.path.read_text()
    with pytest.raises(ValueError, match="no STEP_TRACE diagnostic"):
        rung_trace.with_trace(ladder.load("v31").path.read_text())
    with pytest.raises(ValueError, match="no lab.options line"):
        rung_trace.with_trace(V34.path.read_text().replace(" * lab.options", " * lab.flags"))


def test_the_trace_s_shape_comes_from_its_declaration():
    assert rung_trace.trace_shape(V34.path.read_text()) == (3, 512, 5)
    with pytest.raises(ValueError, match="no value"):
        rung_trace.trace_shape("__device__ long long step_trace[3][STEPS][5];")
    with pytest.raises(ValueError, match="declares no step_trace"):
        rung_trace.trace_shape("long long step_trace[3];")


def test_phases_from_the_clocks_of_each_step_and_the_next_loop_top():
    t = np.zeros((3, 6, 5), dtype=np.int64)
    t[0, 1] = [100, 150, 400, 1100, 1120]  # a step: issue 50, S wait 250, softmax 700, PV wait 20
    t[0, 2] = [1200, 1260, 1500, 2210, 2230]  # rest 80 (1120 -> 1200), step 1100
    t[0, 3] = [2300, 2340, 2600, 3300, 3310]
    t[0, 4] = [0, 0, 0, 0, 0]  # not traced: use 3 has no next loop top and drops out
    t[1, 1] = [500, 400, 600, 700, 800]  # out of order (a clock that wrapped or a torn write): dropped
    t[1, 2] = [900, 950, 1000, 1100, 1200]
    got = rung_trace.phases(t)
    assert set(got) == {0}  # consumer 1's one step in order has no next loop top; consumer 2 traced nothing
    np.testing.assert_array_equal(got[0], [[50, 250, 700, 20, 80, 1100], [60, 240, 710, 20, 70, 1100]])
    lines = rung_trace.table(got).splitlines()
    assert lines[0].split() == ["consumer", "phase", "median", "p10", "p90", "of", "step"]
    assert lines[3].split()[:3] == ["0", "softmax", "705"] and lines[3].split()[-1] == "64.1%"
    assert lines[6].split()[:3] == ["0", "step", "1100"] and lines[6].split()[-2:] == ["2", "st"]


def test_the_timeline_puts_both_consumers_on_consumer_0_s_clock():
    t = np.zeros((3, 6, 5), dtype=np.int64)
    t[0, 2] = [1000, 1050, 1300, 2000, 2020]
    t[1, 2] = [1500, 1900, 2000, 2600, 2700]
    t[0, 3] = [2100, 2150, 2400, 3100, 3120]
    t[1, 3] = [0, 0, 0, 0, 0]  # consumer 1 not traced at use 3: no line
    lines = rung_trace.timeline(t, 2, 2).splitlines()
    assert lines[0].split() == ["use", "consumer", "top", "issued", "S", "softmax", "PV"]
    assert [line.split() for line in lines[1:]] == [
        ["2", "0", "0", "50", "300", "1000", "1020"],
        ["2", "1", "500", "900", "1000", "1600", "1700"],
        ["3", "0", "1100", "1150", "1400", "2100", "2120"],
    ]
    with pytest.raises(ValueError, match="no loop top"):
        rung_trace.timeline(t, 1, 2)


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
@pytest.mark.parametrize("config,products", [("128,128,128,0", 16), ("64,192,128,0", 12)])
def test_the_clock_reads_frame_the_phases_in_sass_and_the_rung_s_own_build_has_none(config, products, tmp_path):
    """The traced copy compiles (sm_90a) with its five clock reads in the steady step's order: the products
    issued between the first two, the wait for S between the second and third, the 66 exponentials between
    the third and fourth, the wait for P V between the last two. The rung's own build reads no clock."""
    _, cubin = wgmma_waits.compiled("v34", config, "sm_90")
    assert "SR_CLOCKLO" not in wgmma_waits.disassemble(cubin)
    path = tmp_path / "v34_lazy_rescale_trace.cu"
    path.write_text(rung_trace.with_trace(V34.path.read_text()))
    _, cubin = wgmma_waits.compiled(str(path), config, "sm_90")
    lines = [line for line in wgmma_waits.disassemble(cubin).splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    clocks = [i for i, line in enumerate(lines) if "SR_CLOCKLO" in line]
    assert len(clocks) == 5, clocks
    between = [lines[a:b] for a, b in zip(clocks, clocks[1:])]

    def count(part, what):
        return sum(what in line for line in part)

    assert count(between[0], "HGMMA") == products and count(between[0], "MUFU.EX2") == 0
    assert count(between[1], "WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
    assert count(between[2], "MUFU.EX2") == 66 and count(between[2], "HGMMA") == 0
    assert count(between[3], "WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1


# -- the backward rung's dK/dV loop (b08) ------------------------------------------------------------

def test_b08_declares_six_points_a_step_for_its_two_consumers():
    from kernels import backward

    source = backward.load("b08").path.read_text()
    assert rung_trace.trace_shape(source) == (2, 512, len(rung_trace.BACKWARD_POINTS))
    assert " -DSTEP_TRACE=1" in rung_trace.with_trace(source)
    assert len(rung_trace.BACKWARD_PHASES) == len(rung_trace.BACKWARD_POINTS) + 1  # and the whole step


def test_backward_cases_are_named_as_bench_py_backward_runs_them():
    cases = rung_trace.backward_cases()
    assert {"2x16x4096-d128", "4x16x2048-d128-noncausal", "2x32x4096-d128-gqa8", "2x32x4096-d128-gqa8-noncausal",
            "1x16x16384-d128-noncausal", "16x12x2048-d64"} <= set(cases)
    c = cases["2x32x4096-d128-gqa8"]
    assert (c.B, c.NH, c.NH_kv, c.T_q, c.d, c.causal) == (2, 32, 8, 4096, 128, True)


def test_backward_phases_table_and_timeline():
    t = np.zeros((2, 4, 6), dtype=np.int64)
    t[0, 1] = [100, 300, 800, 1200, 1500, 2300]  # turn 1 200, wait 500, dS 400, turn 2 300, dKV wait 800
    t[0, 2] = [2400, 2600, 3100, 3500, 3800, 4600]  # rest 100, step 2300
    t[1, 1] = [400, 700, 1100, 1500, 2000, 2600]
    got = rung_trace.phases(t)
    np.testing.assert_array_equal(got[0], [[200, 500, 400, 300, 800, 100, 2300]])
    lines = rung_trace.table(got, rung_trace.BACKWARD_PHASES).splitlines()
    assert [line.split()[1:3] for line in lines[1:8]] == [["turn", "1"], ["S", "dP"], ["dS", "400"], ["turn", "2"],
                                                         ["dKV", "wait"], ["rest", "100"], ["step", "2300"]]
    lines = rung_trace.timeline(t, 1, 1, rung_trace.BACKWARD_POINTS).splitlines()
    assert lines[0].split() == ["use", "consumer", "top", "turn", "1", "S", "dP", "dS", "turn", "2", "dKV"]
    assert lines[2].split() == ["1", "1", "300", "600", "1000", "1400", "1900", "2500"]
    figures = rung_trace.summary(got, rung_trace.BACKWARD_PHASES)  # --results: the table's figures as numbers
    assert figures["0"]["steps"] == 1 and figures["0"]["dS"] == {"median": 400.0, "p10": 400.0, "p90": 400.0}
    assert figures["0"]["step"]["median"] == 2300.0 and set(figures) == {"0"}  # consumer 1 has no next loop top


def test_b13_declares_its_tile_boundaries_and_the_table_reads_them():
    from kernels import backward

    assert rung_trace.tile_shape(backward.load("b13").path.read_text()) == (3, 24, 8)
    assert rung_trace.tile_shape(backward.load("b10").path.read_text()) is None
    t = np.zeros((3, 4, 8), dtype=np.int64)
    t[0, 0, :5] = [1000, 1500, 2000, 2600, 4400]  # consumer 0's end of tile 0
    t[1, 0, :5] = [1600, 2500, 3000, 4600, 6200]
    t[0, 1, 5:7] = [4700, 5900]  # its start of tile 1
    t[1, 1, 5:7] = [6400, 7000]
    t[2, 1, :2] = [-3000, 3500]  # the producer: tile 1 drawn, its K_j and V_j copied
    lines = rung_trace.tile_table(t).splitlines()
    assert len(lines) == 2  # tile 1's end has no tile 2 start: one boundary
    assert lines[0].split()[:3] == ["tile", "c0", "last"] and lines[0].split()[-4:] == ["drawn", "K", "V", "copy"]
    assert [int(v) for v in lines[1].split()[1:]] == [0, 500, 1000, 1600, 3400, 3700, 4900,
                                                      600, 1500, 2000, 3600, 5200, 5400, 6000, -4000, 2500]
    assert lines[1].split()[0] == "0-1"


def test_a_tool_s_result_file_carries_its_command_and_payload(tmp_path):
    import json

    from benchmarks.results import write_tool_result

    path = write_tool_result("rungtrace", "tools/rung_trace.py", ["--kernel", "b08"], {"rung": "b08_pingpong"}, tmp_path)
    result = json.loads(path.read_text())
    assert path.name.startswith("rungtrace-") and result["kind"] == "rungtrace" and result["rung"] == "b08_pingpong"
    assert result["setup"]["command"] == "python3 tools/rung_trace.py --kernel b08" and "date" in result["setup"]


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
@pytest.mark.parametrize("config", ["128,64,128,0,0", "64,128,128,0,0"])
def test_b08_clock_reads_frame_its_turns_in_sass_and_its_own_build_has_none(config, tmp_path):
    """The traced copy's dK/dV phase reads the clock six times a step (twice over: the tile's first step and
    the loop are compiled apart) in order: the first turn's products between the first two reads, no
    product and no exponential while S^T and dP^T land, the exponentials between the third and fourth, the
    second turn's products between the fourth and fifth. b08's own build reads no clock."""
    from kernels import backward, nvrtc
    from kernels.reports import COMMON_OPTIONS
    from kernels.runtime import _as_config

    def sass_of(rung):
        phase = next(p for p in rung.phases if p.entry == "backward_dk_dv")
        expression = rung.entry_expression(phase, _as_config(rung, config))
        cubin, _, _ = nvrtc.compile_cubin(rung.source, str(rung.path), ["-arch=sm_90a", *COMMON_OPTIONS, *rung.options],
                                          [expression])
        return [line for line in wgmma_waits.disassemble(cubin).splitlines() if re.search(r"/\*[0-9a-f]{4,5}\*/", line)]

    assert not any("SR_CLOCKLO" in line for line in sass_of(backward.load("b08")))
    path = tmp_path / "b08_pingpong_trace.cu"
    path.write_text(rung_trace.with_trace(backward.load("b08").path.read_text()))
    lines = sass_of(backward.load(str(path)))
    clocks = [i for i, line in enumerate(lines) if "SR_CLOCKLO" in line]
    assert len(clocks) == 12, clocks
    for first in (0, 6):  # the tile's first step, then the loop's
        part = [lines[a:b] for a, b in zip(clocks[first:first + 6], clocks[first + 1:first + 6])]

        def count(i, what, part=part):
            return sum(what in line for line in part[i])

        assert count(0, "HGMMA") > 0 and count(0, "MUFU.EX2") == 0
        assert count(1, "HGMMA") == 0 and count(1, "MUFU.EX2") == 0
        assert count(2, "MUFU.EX2") > 0 and count(2, "HGMMA") == 0
        assert count(3, "HGMMA") > 0 and count(3, "MUFU.EX2") == 0
