"""b08's descriptors by adds without a GPU (docs/backward.md#b08-descriptors): the arithmetic they rest on
(a descriptor advanced by an add is the descriptor of the advanced address, for every shared-memory
address), and, compiled with NVRTC and read with nvdisasm beside a build that makes each descriptor from
its address, what the adds change: nothing in deterministic mode; elsewhere fewer instructions in the loop
around the same products, with no spill and no ptxas performance warning."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import backward, nvrtc
from kernels.reports import COMMON_OPTIONS, PTXAS, performance_warnings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import wgmma_waits  # noqa: E402

B08 = backward.load("b08")
SMEM = 227 * 1024  # an H100's or H200's shared memory a block, the most any address here reaches


def descriptor(address, lbo, sbo):
    """b08's descriptor(), on NumPy uint64 arrays."""
    address = np.asarray(address, dtype=np.uint64)
    return ((address & np.uint64(0x3FFFF)) >> np.uint64(4)) | np.uint64(lbo >> 4) << np.uint64(16) | \
        np.uint64(sbo >> 4) << np.uint64(32) | np.uint64(1) << np.uint64(62)


@pytest.mark.parametrize("lbo, sbo", [(16, 1024), (128 * 128, 1024), (64 * 128, 1024)])
def test_an_advanced_descriptor_is_the_descriptor_of_the_advanced_address(lbo, sbo):
    offsets = np.arange(0, 64 * 1024, 16, dtype=np.uint64)  # every 16-byte step the kernel's batches take, and more
    for base in range(0, SMEM, 1024):  # tiles start on 1024-byte boundaries
        inside = offsets[base + offsets < SMEM]
        assert np.array_equal(descriptor(base, lbo, sbo) + (inside >> np.uint64(4)), descriptor(base + inside, lbo, sbo))
    # past 256 KB the address field would carry into the leading offset's: the premise is the bound
    assert descriptor(0x3FFF0, lbo, sbo) + np.uint64(1) != descriptor(0x40000, lbo, sbo)


ADDS = "constexpr bool ADDS = !deterministic;"


def build(config, adds: bool) -> tuple[str, str]:
    """(nvdisasm listing, ptxas log) of b08's dK/dV phase at `config`, as it is (adds) or with every
    descriptor made from its address."""
    assert ADDS in B08.source
    source = B08.source if adds else B08.source.replace(ADDS, "constexpr bool ADDS = false;", 1)
    expression = B08.entry_expression(next(p for p in B08.phases if p.entry == "backward_dk_dv"), config)
    cubin, log, _ = nvrtc.compile_cubin(source, str(B08.path), ["-arch=sm_90a", "-Xptxas=-v", *COMMON_OPTIONS,
                                                                  *B08.options], [expression])
    return wgmma_waits.disassemble(cubin), log


def body(sass: str) -> list[str]:
    return [line.split("*/", 1)[1] for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def check_clean(log: str):
    spills = {k: int(m.group(1)) if (m := PTXAS[k].search(log)) else 0 for k in ("spill_stores", "spill_loads")}
    assert spills == {"spill_stores": 0, "spill_loads": 0}, spills
    assert not performance_warnings(log)


def loop_instructions(sass: str) -> int:
    step = wgmma_waits.steady_step(wgmma_waits.events(sass))
    loop = wgmma_waits.step_loop(sass, step.arrive)
    return int(re.search(r"(\d+) instructions", loop.summary()).group(1))


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="nvdisasm is a test dependency (pip install -e '.[test]')")
@pytest.mark.parametrize("config", [c for c in B08.configs if c[2] == 128 and c[3] == 0],
                         ids=lambda c: "d{}-{}".format(c[0], "deterministic" if c[4] else "atomic"))
def test_b08_s_adds_take_integer_work_out_of_the_loop_and_nothing_else(config):
    off, _ = build(config, adds=False)
    on, log = build(config, adds=True)
    if config[4]:  # deterministic: no adds (at d = 128 the hoisted descriptors spill)
        assert body(on) == body(off)
        return
    assert body(on) != body(off)
    assert loop_instructions(on) < 0.95 * loop_instructions(off)
    assert sum(line.count("HGMMA") for line in body(on)) == sum(line.count("HGMMA") for line in body(off))
    check_clean(log)
