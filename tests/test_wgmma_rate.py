"""tools/wgmma_rate.py without a GPU: each default variant's generated kernel compiles for sm_90a (NVRTC)
without a ptxas performance warning, and its SASS (nvdisasm) issues the variant's product and nothing
else: HGMMA.64xNx16 with bfloat16 operands, A from registers for rs, B read transposed for t, batches of
four with one batch left in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1); with --traffic, the storing
warpgroup's 16-byte stores besides."""

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
# one and two warpgroups; two beside the storing one where --traffic takes the variant (N up to 128)
CASES = [(name, w, False) for name in VARIANTS for w in (1, 2)] + \
        [(name, 2, True) for name in VARIANTS if wgmma_rate.Variant.parse(name).n <= 128]


def build(v, warpgroups: int, traffic: bool, pause_ns: int = 0) -> tuple[list[str], str]:
    """(SASS instructions, ptxas log) of a variant's kernel."""
    cubin, log, _ = nvrtc.compile_cubin(wgmma_rate.source(v, warpgroups, traffic, pause_ns), f"{v.name}.cu",
                                        [*wgmma_rate.OPTIONS, "-Xptxas=-v"], [])
    return [line.split("*/", 1)[1] for line in wgmma_waits.disassemble(cubin).splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)], log


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="nvdisasm is a test dependency (pip install -e '.[test]')")
@pytest.mark.parametrize("name, warpgroups, traffic", CASES)
def test_each_variant_issues_its_product_alone(name, warpgroups, traffic):
    v = wgmma_rate.Variant.parse(name)
    sass, log = build(v, warpgroups, traffic)
    assert not performance_warnings(log)
    products = [line for line in sass if "HGMMA" in line]
    assert products and len(products) % wgmma_rate.K_STEPS == 0
    shapes = {re.search(r"HGMMA\.(\S+)", line).group(1) for line in products}
    assert shapes == {f"64x{v.n}x16.F32.BF16"}
    assert all(("tnspB" in line) == v.trans_b for line in products)
    assert all((", R" in line.split("gdesc")[0]) == (v.source == "rs") for line in products)  # A in registers
    assert any("WARPGROUP.DEPBAR.LE gsb0, 0x1" in line for line in sass)
    if traffic:  # the storing warpgroup's eight 16-byte stores a round, besides the fill's
        stores = lambda listing: sum("STS.128" in line for line in listing)  # noqa: E731
        assert stores(sass) >= stores(build(v, warpgroups, False)[0]) + 8


def test_the_storing_warpgroup_pauses_where_asked():
    v = wgmma_rate.Variant.parse("ss64")
    paused, log = build(v, 2, True, pause_ns=900)
    assert not performance_warnings(log)
    assert any("NANOSLEEP" in line for line in paused)
    assert not any("NANOSLEEP" in line for line in build(v, 2, True)[0])


@pytest.mark.parametrize("text, message", [("xx64", "ss or rs"), ("ss65", "multiple of 8"), ("rs264", "from 8 to 256"),
                                           ("ss80t", "whole 64-column atoms")])
def test_bad_variants_are_refused_with_a_reason(text, message):
    with pytest.raises(ValueError, match=message):
        wgmma_rate.Variant.parse(text)


def test_a_batch_s_flops():
    assert wgmma_rate.flops_per_batch(wgmma_rate.Variant.parse("ss64")) == 2 * 64 * 64 * 64


def test_the_rows_go_into_a_result_file(tmp_path):
    rows = [{"variant": "ss64", "warpgroups": 2, "flops_per_clock": 3985.0, "of_peak": 0.973, "tflops": 927.6,
             "mhz": 1763.0, "finite": True, "traffic_bytes_per_clock": 1.7}]
    path = wgmma_rate.save(rows, {"variants": "ss64", "traffic": True, "results": tmp_path}, ["--traffic"], tmp_path)
    import json

    result = json.loads(path.read_text())
    assert path.name.startswith("wgmmarate-") and path.suffix == ".json"
    assert result["rows"] == rows and result["options"]["traffic"] is True
    assert result["setup"]["command"] == "python3 tools/wgmma_rate.py --traffic"
    assert result["peak_flops_per_clock"] == wgmma_rate.PEAK
    assert wgmma_rate.save(rows, {}, [], tmp_path) != path  # never overwritten
