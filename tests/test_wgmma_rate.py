"""tools/wgmma_rate.py without a GPU: each default variant's generated kernel compiles for sm_90a (NVRTC)
without a ptxas performance warning, and its SASS (nvdisasm) issues the variant's product and nothing
else: HGMMA.64xNx16 with bfloat16 operands, A from registers for rs, B read transposed for t, batches of
four with one batch left in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kernels import nvrtc
from kernels.reports import performance_warnings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import wgmma_rate  # noqa: E402
import wgmma_waits  # noqa: E402

VARIANTS = wgmma_rate.DEFAULT.split(",")


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="nvdisasm is a test dependency (pip install -e '.[test]')")
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_issues_its_product_alone(name, warpgroups):
    v = wgmma_rate.Variant.parse(name)
    cubin, log, _ = nvrtc.compile_cubin(wgmma_rate.source(v, warpgroups), f"{name}.cu",
                                        [*wgmma_rate.OPTIONS, "-Xptxas=-v"], [])
    assert not performance_warnings(log)
    sass = [line.split("*/", 1)[1] for line in wgmma_waits.disassemble(cubin).splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    products = [line for line in sass if "HGMMA" in line]
    assert products and len(products) % wgmma_rate.K_STEPS == 0
    shapes = {re.search(r"HGMMA\.(\S+)", line).group(1) for line in products}
    assert shapes == {f"64x{v.n}x16.F32.BF16"}
    assert all(("tnspB" in line) == v.trans_b for line in products)
    assert all((", R" in line.split("gdesc")[0]) == (v.source == "rs") for line in products)  # A in registers
    assert any("WARPGROUP.DEPBAR.LE gsb0, 0x1" in line for line in sass)


@pytest.mark.parametrize("text, message", [("xx64", "ss or rs"), ("ss65", "multiple of 8"), ("rs264", "from 8 to 256"),
                                           ("ss80t", "whole 64-column atoms")])
def test_bad_variants_are_refused_with_a_reason(text, message):
    with pytest.raises(ValueError, match=message):
        wgmma_rate.Variant.parse(text)


def test_a_batch_s_flops():
    assert wgmma_rate.flops_per_batch(wgmma_rate.Variant.parse("ss64")) == 2 * 64 * 64 * 64
