"""tools/llama_attention_variants.py without a GPU: its variants and caches parsed, bad ones refused in
one line, attention_plan's overrides (the geometry the tool asks the engine for) and their limits, and
its table (the GPU run is the tool itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llama
import llama.fast as fast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import llama_attention_variants as variants  # noqa: E402

ONE_B = llama.SIZES["llama-3.2-1b"]


def test_variants_parse_into_attention_plan_overrides():
    assert variants.parse_variant("plan") == {}
    assert variants.parse_variant("keys=256+warps=8") == {"split_keys": 256, "warps": 8}
    assert variants.parse_variant("splits=32") == {"splits": 32}
    for bad in ("keys", "keys=0", "rows=3", "keys=2.5", "warps=8,keys=4"):
        with pytest.raises(ValueError, match="is not one of"):
            variants.parse_variant(bad)
    for text in variants.DEFAULT_VARIANTS.split(","):
        fast.attention_plan(ONE_B, 512, 132, 2, **variants.parse_variant(text))  # every default is a geometry


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
    rows = [{"size": "llama-3.2-1b", "max_len": 512, "variant": "plan", "position": 128, "plan": plan,
             "us_per_token": [955.5, 955.6]},
            {"size": "llama-3.2-1b", "max_len": 512, "variant": "warps=6", "position": 128,
             "plan": "attention {'warps': 6}: warps 6", "us_per_token": None}]
    text = variants.table(rows)
    assert "   955.5    955.6" in text and "   16    32     4" in text and "warps 6" in text
