"""tools/llama_step_variants.py without a GPU: its variants and caches parsed, bad ones refused in one
line, attention_plan's and the streams' overrides (the geometry the tool asks the engine for) and their
limits, rms_gemv.cu's SPREAD dealing every task out once and evenly, and its table (the GPU run is the
tool itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llama
import llama.fast as fast
from llama.fast.engine import gemv_options
from lm.errors import LabError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import llama_step_variants as variants  # noqa: E402

ONE_B = llama.SIZES["llama-3.2-1b"]


def test_variants_parse_into_the_engine_s_overrides():
    assert variants.parse_variant("plan") == {"attention": {}, "gemv": {}}
    assert variants.parse_variant("keys=256+warps=8") == {"attention": {"split_keys": 256, "warps": 8}, "gemv": {}}
    assert variants.parse_variant("splits=32+spread=1+gemv_bps=1+item_loads=4") == {
        "attention": {"splits": 32}, "gemv": {"spread": True, "blocks_per_sm": 1, "item_loads": 4}}
    assert variants.parse_variant("spread=0") == {"attention": {}, "gemv": {"spread": False}}
    for bad in ("keys", "keys=0", "rows=3", "keys=2.5", "warps=8,keys=4", "spread=2"):
        with pytest.raises(ValueError, match="is not one of"):
            variants.parse_variant(bad)
    for text in variants.DEFAULT_VARIANTS.split(","):  # every default is a geometry the engine takes
        v = variants.parse_variant(text)
        fast.attention_plan(ONE_B, 512, 132, 2, **v["attention"])
        assert gemv_options(v["gemv"])["item_loads"] >= 1


def test_the_streams_overrides_are_checked():
    assert gemv_options(None) == {"spread": False, "blocks_per_sm": 1 << 30, "item_loads": fast.plan.ITEM_LOADS}
    for bad in ({"rows": 1}, {"spread": 1}, {"blocks_per_sm": 0}, {"item_loads": 16}):
        with pytest.raises(LabError, match="gemv"):
            gemv_options(bad)


def spread_tasks(tasks: int, grid: int, warps: int) -> list[list[int]]:
    """rms_gemv.cu's stream_tasks with SPREAD: each block's tasks, its warps' in turn (first, stride)."""
    out = []
    for b in range(grid):
        mine = []
        for i in range(warps):
            mine += list(range(b + grid * i, tasks, grid * warps))
        out.append(mine)
    return out


@pytest.mark.parametrize("tasks", [1, 7, 1536, 2048, 2560, 8192, 128_256])
def test_spread_deals_every_task_once_and_every_block_as_many_give_or_take_one(tasks):
    grid = fast.plan.gemv_grid(tasks, 2, 132, spread=True)
    assert grid == min(264, tasks)
    blocks = spread_tasks(tasks, grid, fast.plan.GEMV_WARPS)
    assert sorted(t for b in blocks for t in b) == list(range(tasks))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    for b in blocks:  # a warp's tasks ascend (the argmax keeps the first of equal values)
        assert all(t % grid == blocks.index(b) for t in b)


def test_without_spread_llama_1b_s_qkv_loads_some_sms_twice_as_much():
    tasks = fast.matrices(ONE_B)["qkv"].tasks  # 1,536 pairs of rows
    grid = fast.plan.gemv_grid(tasks, 2, 132)
    assert grid == 192  # 60 SMs hold two blocks of 8 tasks each, 72 hold one
    assert fast.plan.gemv_grid(tasks, 2, 132, spread=True) == 264  # two blocks an SM, 5 or 6 tasks each


def test_spread_and_item_loads_change_only_the_streams_expressions():
    plain = fast.kernel_expressions(ONE_B, "bfloat16")
    spread = fast.kernel_expressions(ONE_B, "bfloat16", spread=True, item_loads=4)
    assert spread["qkv"] == ("rms_gemv", "rms_gemv_rope<unsigned short, 2048, 64, 8, 2, true>")
    assert spread["down_proj"] == ("rms_gemv", "rms_gemv_residual<unsigned short, 8192, 8, 4, true>")
    assert {k: v for k, v in spread.items() if k not in fast.matrices(ONE_B)} == \
        {k: v for k, v in plain.items() if k not in fast.matrices(ONE_B)}


def test_caches_parse_and_leave_room_for_the_timed_steps():
    assert variants.parse_cache("512:40,128,260") == (512, [40, 128, 260])
    for bad in ("512", "512:", "x:3", "512:447", "512:-1"):
        with pytest.raises(ValueError, match="--cache"):
            variants.parse_cache(bad)


def test_the_overrides_keep_the_plan_consistent_and_refuse_what_the_kernel_cannot_take():
    plan = fast.attention_plan(ONE_B, 512, 132, 2)
    assert (plan.splits, plan.split_keys, plan.warps) == (16, 32, 4)
    more = fast.attention_plan(ONE_B, 512, 132, 2, split_keys=256, warps=8)
    assert (more.splits, more.split_keys, more.warps, more.staged_rows) == (16, 256, 8, 256)
    assert more.smem == 4 * 4 * 256 + 2 * 256 * 64 * 2
    assert fast.attention_plan(ONE_B, 512, 132, 2, split_keys=8).split_keys == 32  # never under max_len / splits
    assert fast.attention_plan(ONE_B, 512, 132, 2, splits=4).split_keys == 128
    assert fast.attention_plan(ONE_B, 512, 132, 2, split_keys=256).warps == 16  # attention_warps: one pass
    with pytest.raises(ValueError, match="warps 6"):
        fast.attention_plan(ONE_B, 512, 132, 2, warps=6)
    with pytest.raises(ValueError, match="splits 0"):
        fast.attention_plan(ONE_B, 512, 132, 2, splits=0)
    with pytest.raises(ValueError, match="past a block's"):
        fast.attention_plan(ONE_B, 131072, 132, 2, splits=1)


def test_the_table_gives_each_variant_its_geometry_and_times():
    plan = vars(fast.attention_plan(ONE_B, 512, 132, 2))
    rows = [{"size": "llama-3.2-1b", "max_len": 512, "variant": "plan", "position": 128,
             "plan": {**plan, "grids": {"qkv": 192}}, "us_per_token": [955.5, 955.6]},
            {"size": "llama-3.2-1b", "max_len": 512, "variant": "warps=6", "position": 128,
             "plan": "attention {'warps': 6}: warps 6", "us_per_token": None}]
    text = variants.table(rows)
    assert "   955.5    955.6" in text and "   16    32     4      192" in text and "warps 6" in text


@pytest.mark.parametrize("size", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("item_loads", [4, fast.plan.ITEM_LOADS])
def test_the_spread_streams_compile_for_sm90_without_spills(size, item_loads):
    from kernels import fused

    exprs = fast.kernel_expressions(llama.SIZES[size], "bfloat16", spread=True, item_loads=item_loads)
    for key in fast.matrices(llama.SIZES[size]):
        file, expr = exprs[key]
        r = fused.compile_report(file, expr, "sm_90")
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
