"""The warp-specialized rungs resize their warpgroups' registers with setmaxnreg: the producer gives
registers back, the consumers ask for more. Those come out of the block's own allocation at launch, the
registers ptxas gave a thread times the block's threads, not out of the SM's 65,536: a consumer that asks
for more than is left waits in `USETMAXREG.TRY_ALLOC` forever, and the block hangs (a copy of v39 with
four consumers asking for 120 registers did, on an H200: docs/ladder.md#v39-d64, and so did a copy of
b08 at 32 and 240: docs/backward.md#b08-lse-early). The kernels' static_asserts hold the request to the
block's registers at 65536 / threads a thread, rounded down to 8s, from their constants; this holds it to
what each configuration compiles to (ptxas's register count and the SASS's USETMAXREG immediates; NVRTC
and nvdisasm, no GPU)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import kernels
from kernels import backward, nvrtc
from kernels.reports import COMMON_OPTIONS, PTXAS
from kernels.runtime import _as_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import wgmma_waits  # noqa: E402

WARPGROUP = 128
ALLOC = re.compile(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)")
DEALLOC = re.compile(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)")


def budget(threads: int, registers: int, sass: str) -> tuple[int, int]:
    """(registers the warpgroups hold after resizing, the block's allocation at launch). Warpgroup 0 is
    the producer, which gives back (the DEALLOC's count); every other asks for the ALLOC's count."""
    (ask,) = {int(x, 16) for x in ALLOC.findall(sass)}
    (keep,) = {int(x, 16) for x in DEALLOC.findall(sass)}
    warpgroups = threads // WARPGROUP
    return keep * WARPGROUP + ask * WARPGROUP * (warpgroups - 1), registers * threads


def test_the_budget_of_a_build_that_hung():
    """The four-consumer copy's numbers: 96 registers for 640 threads at launch, 24 kept, 120 asked."""
    sass = "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x78 ;\nUSETMAXREG.DEALLOC.CTAPOOL 0x18 ;"
    held, launched = budget(640, 96, sass)
    assert (held, launched) == (64512, 61440) and held > launched  # over: it hung
    held, launched = budget(640, 96, sass.replace("0x78", "0x70"))  # 112 ran
    assert held <= launched


def compiled_with_report(rung, expression: str) -> tuple[int, str]:
    cubin, log, _ = nvrtc.compile_cubin(rung.source, str(rung.path),
                                        ["-arch=sm_90a", "-Xptxas=-v", *COMMON_OPTIONS, *rung.options], [expression])
    return int(PTXAS["registers"].search(log).group(1)), wgmma_waits.disassemble(cubin)


def resized():
    """(rung, entry expression, block) of every configuration of every rung that calls setmaxnreg, in its
    first dtype (the other compiles to the same registers and requests): the forward kernel, or the
    backward rung's warp-specialized phase (backward_dk_dv; its preprocess and dQ phases resize nothing)."""
    def first_dtype(rung):
        return [c for c in rung.configs if rung.params(c).get("dtype_id", 0) == 0]

    out = []
    for name in kernels.names():
        rung = kernels.load(name)
        if "setmaxnreg" in rung.source:
            out += [(rung, rung.name_expression(c), rung.block(c)) for c in first_dtype(rung)]
    for name in backward.names():
        rung = backward.load(name)
        if "setmaxnreg" in rung.source:
            for c in first_dtype(rung):
                cfg = _as_config(rung, c)
                out += [(rung, rung.entry_expression(p, cfg), rung.phase_block(p, cfg)) for p in rung.phases
                        if p.entry == "backward_dk_dv"]
    return out


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="nvdisasm is a test dependency (pip install -e '.[test]')")
@pytest.mark.parametrize("rung, expression, block", resized(), ids=lambda x: getattr(x, "name", None) or str(x))
def test_setmaxnreg_asks_within_the_blocks_own_registers(rung, expression, block):
    registers, sass = compiled_with_report(rung, expression)
    assert ALLOC.search(sass) and DEALLOC.search(sass), f"{expression}: no setmaxnreg in its SASS"
    threads = block[0] * block[1] * block[2]
    held, launched = budget(threads, registers, sass)
    assert held <= launched, (f"{expression}: the warpgroups ask for {held} registers, the block has {launched} "
                              f"({registers} a thread x {threads} threads): the consumers would wait forever")
