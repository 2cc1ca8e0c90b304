"""tools/llama_step_variants.py without a GPU: its variants and caches parsed, bad ones refused in one
line, attention_plan's and the streams' overrides (the geometry the tool asks the engine for) and their
limits, rms_gemv.cu's two ways of dealing the tasks out, each giving every task once, block by block
evenly, and its table (the GPU run is the
tool itself)."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import llama
import llama.fast as fast
from llama.fast.engine import gemv_options, l2_options
from lm.errors import LabError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import llama_step_variants as variants  # noqa: E402

ONE_B = llama.SIZES["llama-3.2-1b"]


def test_variants_parse_into_the_engine_s_overrides():
    assert variants.parse_variant("plan") == {"attention": {}, "gemv": {}, "l2": {}}
    assert variants.parse_variant("keys=256+warps=8") == {"attention": {"split_keys": 256, "warps": 8}, "gemv": {},
                                                          "l2": {}}
    assert variants.parse_variant("splits=32+gemv_bps=1+item_loads=4") == {
        "attention": {"splits": 32}, "gemv": {"blocks_per_sm": 1, "item_loads": 4}, "l2": {}}
    assert variants.parse_variant("o_proj_bps=1+down_proj_bps=1+gemv_bps=2") == {
        "attention": {}, "gemv": {"blocks_per_sm_of": {"o_proj": 1, "down_proj": 1}, "blocks_per_sm": 2}, "l2": {}}
    assert variants.parse_variant("qkv_loads=4+down_proj_loads=6") == {
        "attention": {}, "gemv": {"item_loads_of": {"qkv": 4, "down_proj": 6}}, "l2": {}}
    assert variants.parse_variant("attn_mb=16+cap_mb=32") == {
        "attention": {}, "gemv": {}, "l2": {"attention": 16 << 20, "cap": 32 << 20}}
    for bad in ("keys", "keys=0", "rows=3", "keys=2.5", "warps=8,keys=4", "spread=1", "gemv_bps=0", "cap_mb=0",
                "oproj_bps=1", "qkv_bps=0"):
        with pytest.raises(ValueError, match="is not one of"):
            variants.parse_variant(bad)
    for text in variants.DEFAULT_VARIANTS.split(","):  # every default is a geometry the engine takes
        v = variants.parse_variant(text)
        fast.attention_plan(ONE_B, 512, 132, 2, **v["attention"])
        assert gemv_options(v["gemv"])["item_loads"] in (None, *range(1, fast.plan.ITEM_LOADS + 1))


def test_the_streams_overrides_are_checked():
    assert gemv_options(None) == {"blocks_per_sm": 1 << 30, "blocks_per_sm_of": fast.plan.STREAM_BLOCKS_PER_SM,
                                  "item_loads": None, "item_loads_of": {}}
    assert gemv_options({"item_loads_of": {"qkv": 4}})["item_loads_of"] == {"qkv": 4}
    plan = dict(fast.plan.STREAM_BLOCKS_PER_SM)
    one = gemv_options({"blocks_per_sm_of": {"o_proj": 1}})
    assert one["blocks_per_sm_of"] == {**plan, "o_proj": 1} and fast.plan.STREAM_BLOCKS_PER_SM == plan  # a copy
    assert set(fast.plan.MATRIX_NAMES) == set(fast.matrices(ONE_B))
    for bad in ({"rows": 1}, {"spread": True}, {"blocks_per_sm": 0}, {"item_loads": 16},
                {"blocks_per_sm_of": {"oproj": 1}}, {"blocks_per_sm_of": {"qkv": 0}}, {"item_loads_of": {"qkv": 9}},
                {"item_loads_of": {"gate": 4}}):
        with pytest.raises(LabError, match="gemv"):
            gemv_options(bad)
    assert l2_options(None) == {"cap": fast.plan.PREFETCH_CAP, "attention": fast.plan.ATTENTION_PREFETCH}
    assert variants.parse_variant("attn_mb=0")["l2"] == {"attention": 0}
    assert l2_options({"attention": 1 << 24}) == {"cap": fast.plan.PREFETCH_CAP, "attention": 1 << 24}
    for bad in ({"ahead": 1}, {"cap": 0}, {"attention": -1}):
        with pytest.raises(LabError, match="l2"):
            l2_options(bad)


def deal(tasks: int, grid: int, warps: int) -> list[list[int]]:
    """rms_gemv.cu's stream_tasks: each block's tasks, its warps' in turn (first, then every stride): warp
    by warp where the grid has a warp for every task, block by block where the tasks outnumber them."""
    stride = grid * warps
    out = []
    for b in range(grid):
        mine = []
        for i in range(warps):
            first = b + grid * i if tasks > stride else b * warps + i
            mine += list(range(first, tasks, stride))
        out.append(mine)
    return out


@pytest.mark.parametrize("tasks", [1, 7, 1536, 2048, 2112, 2113, 2560, 8192, 14_336, 128_256])
def test_the_tasks_are_dealt_once_each_and_a_whole_wave_s_evenly(tasks):
    grid = fast.plan.gemv_grid(tasks, 2, 132)
    assert grid == min(264, -(-tasks // fast.plan.GEMV_WARPS))
    blocks = deal(tasks, grid, fast.plan.GEMV_WARPS)
    assert sorted(t for b in blocks for t in b) == list(range(tasks))
    if tasks > grid * fast.plan.GEMV_WARPS:  # a whole wave: as many a block, give or take one
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        for b, mine in enumerate(blocks):
            assert all(t % grid == b for t in mine)
    else:  # a warp a task, a block's warps on neighbours
        assert all(mine == list(range(b * 8, min(tasks, b * 8 + 8))) for b, mine in enumerate(blocks))


def test_llama_3b_s_qkv_dealt_warp_by_warp_would_load_56_blocks_twice():
    tasks = fast.matrices(llama.SIZES["llama-3.2-3b"])["qkv"].tasks  # 2,560 pairs of rows
    grid = fast.plan.gemv_grid(tasks, 2, 132)
    assert grid == 264
    warp_by_warp = [sum(1 for i in range(8) for _ in range(b * 8 + i, tasks, grid * 8)) for b in range(grid)]
    assert warp_by_warp.count(16) == 56 and warp_by_warp.count(8) == 208
    assert sorted({len(mine) for mine in deal(tasks, grid, 8)}) == [9, 10]
    one_b = fast.matrices(ONE_B)["qkv"].tasks  # 1,536: 192 blocks of 8, a warp a task
    assert fast.plan.gemv_grid(one_b, 2, 132) == 192


def test_item_loads_change_only_the_streams_expressions():
    three_b = llama.SIZES["llama-3.2-3b"]  # no entry of its own in STREAM_ITEM_LOADS
    plain = fast.kernel_expressions(three_b, "bfloat16")
    fewer = fast.kernel_expressions(three_b, "bfloat16", item_loads=4)
    assert plain["qkv"] == ("rms_gemv", "rms_gemv_rope<unsigned short, 3072, 128, 8, 4>")
    assert plain["down_proj"] == ("rms_gemv", "rms_gemv_residual<unsigned short, 8192, 8, 8>")
    assert fewer["down_proj"] == ("rms_gemv", "rms_gemv_residual<unsigned short, 8192, 8, 4>")
    assert {k: v for k, v in fewer.items() if k not in fast.matrices(three_b)} == \
        {k: v for k, v in plain.items() if k not in fast.matrices(three_b)}
    one = fast.kernel_expressions(three_b, "bfloat16", item_loads_of={"down_proj": 4})  # that stream alone
    assert one == {**plain, "down_proj": fewer["down_proj"]}
    both = fast.kernel_expressions(three_b, "bfloat16", item_loads=4, item_loads_of={"down_proj": 8})
    assert both == {**fewer, "down_proj": plain["down_proj"]}
    # the plan's per-size entry: Llama 3.2 1B in bfloat16 takes 4 for every stream whose items it changes,
    # in float32 the default
    assert fast.kernel_expressions(ONE_B, "bfloat16") == fast.kernel_expressions(ONE_B, "bfloat16", item_loads=4)
    assert fast.kernel_expressions(ONE_B, "float32") == fast.kernel_expressions(ONE_B, "float32",
                                                                                item_loads=fast.plan.ITEM_LOADS)


def test_caches_parse_and_leave_room_for_the_timed_steps():
    assert variants.parse_cache("512:40,128,260") == (512, [40, 128, 260])
    for bad in ("512", "512:", "x:3", "512:447", "512:-1"):
        with pytest.raises(ValueError, match="--cache"):
            variants.parse_cache(bad)


def test_the_overrides_keep_the_plan_consistent_and_refuse_what_the_kernel_cannot_take():
    plan = fast.attention_plan(ONE_B, 512, 132, 2)
    assert (plan.splits, plan.split_keys, plan.warps) == (8, 64, 8)  # MIN_SPLIT_KEYS; attention_warps: one step
    more = fast.attention_plan(ONE_B, 512, 132, 2, split_keys=256, warps=8)
    assert (more.splits, more.split_keys, more.warps, more.staged_rows) == (8, 256, 8, 256)
    assert more.smem == 2 * 256 * 64 * 2 + 4 * 8 * 4 * (64 + 2) * more.cluster  # K and V rows (and rank 0's partials)
    assert fast.attention_plan(ONE_B, 512, 132, 2, split_keys=8).split_keys == 64  # never under max_len / splits
    assert fast.attention_plan(ONE_B, 512, 132, 2, splits=4).split_keys == 128
    assert fast.attention_plan(ONE_B, 512, 132, 2, split_keys=256).warps == 16  # attention_warps: one pass
    with pytest.raises(ValueError, match="warps 6"):
        fast.attention_plan(ONE_B, 512, 132, 2, warps=6)
    with pytest.raises(ValueError, match="splits 0"):
        fast.attention_plan(ONE_B, 512, 132, 2, splits=0)
    with pytest.raises(ValueError, match="past a block's"):
        fast.attention_plan(ONE_B, 131072, 132, 2, splits=1, staged_rows=4096)
    # the cluster's combine: rank 0 holds every split's partial (GROUP rows of HS + 2 floats each)
    clustered, ticket = (fast.attention_plan(ONE_B, 512, 132, 2, cluster=c) for c in (True, False))
    assert clustered.cluster and not ticket.cluster and clustered.smem == ticket.smem + 4 * 8 * 4 * (64 + 2)
    assert plan.cluster == fast.plan.ATTENTION_CLUSTER
    with pytest.raises(ValueError, match="past the 16 blocks a cluster holds"):
        fast.attention_plan(ONE_B, 512, 132, 2, splits=17, cluster=True)
    assert variants.parse_variant("cluster=1+splits=8") == {"attention": {"cluster": True, "splits": 8}, "gemv": {},
                                                             "l2": {}}
    assert variants.parse_variant("cluster=0")["attention"] == {"cluster": False}


def test_the_table_gives_each_variant_its_geometry_and_times():
    plan = vars(fast.attention_plan(ONE_B, 512, 132, 2))
    rows = [{"size": "llama-3.2-1b", "max_len": 512, "variant": "plan", "position": 128,
             "plan": {**plan, "grids": {"qkv": 192}}, "us_per_token": [955.5, 955.6]},
            {"size": "llama-3.2-1b", "max_len": 512, "variant": "warps=6", "position": 128,
             "plan": "attention {'warps': 6}: warps 6", "us_per_token": None}]
    text = variants.table(rows)
    assert "   955.5    955.6" in text and f"    8    64     8 {str(plan['cluster']):>7s}      192" in text
    assert "warps 6" in text


@pytest.mark.parametrize("size", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("item_loads", [4, fast.plan.ITEM_LOADS])
def test_the_streams_compile_for_sm90_without_spills(size, item_loads):
    from kernels import fused

    exprs = fast.kernel_expressions(llama.SIZES[size], "bfloat16", item_loads=item_loads)
    for key in fast.matrices(llama.SIZES[size]):
        file, expr = exprs[key]
        r = fused.compile_report(file, expr, "sm_90")
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_attention_compiles_without_spills_at_every_size_and_block(dtype):
    """gqa_decode_attention.cu holds a lane's elements of up to COMBINE_SPLITS splits' o at once in its
    combine: every Llama size, block and dtype compiles for sm_90 without spills."""
    from kernels import fused

    for size in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"):
        for warps, cluster in itertools.product(fast.plan.ATTENTION_WARPS, (False, True)):
            file, expr = fast.plan.attention_kernel(llama.SIZES[size], dtype, warps, cluster)
            key = f"attention/{warps}{'/cluster' * cluster}"
            assert (file, expr) == fast.kernel_expressions(llama.SIZES[size], dtype)[key]
            r = fused.compile_report(file, expr, "sm_90")
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (expr, r)


@pytest.mark.parametrize("size", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cluster_combine_draws_no_ticket_and_crosses_no_fence_through_l2(size, dtype):
    """With cluster, a split's partial goes to rank 0's shared memory (mapa, st.shared::cluster) between
    the cluster barrier's halves, in order: arrive.relaxed at the start, wait before the first
    remote store, arrive.release after the stores, wait.acquire in rank 0 before it combines; no atomic
    ticket and no memory fence. The ticket's kernel has the ticket and no cluster instruction."""
    from kernels import fused

    def body(cluster):
        text = fused.ptx(*fast.plan.attention_kernel(llama.SIZES[size], dtype, 4, cluster))
        return text[text.index(".entry"):]

    ticket, cluster = body(False), body(True)
    assert "barrier.cluster" not in ticket and "mapa" not in ticket and len(re.findall(r"atom\.", ticket)) == 1
    barriers = re.findall(r"barrier\.cluster\.(\w+)(?:\.(\w+))?", cluster)
    assert barriers == [("arrive", "relaxed"), ("wait", "acquire"), ("arrive", "release"), ("wait", "acquire")], barriers
    assert "mapa.shared::cluster" in cluster and "st.shared::cluster.f32" in cluster
    assert not re.search(r"atom\.|membar|fence\.", cluster)
    first_store, stores = cluster.index("st.shared::cluster"), [m.start() for m in re.finditer("st.shared::cluster", cluster)]
    waits = [m.start() for m in re.finditer(r"barrier\.cluster\.wait", cluster)]
    release = cluster.index("barrier.cluster.arrive.release")
    assert waits[0] < first_store and max(stores) < release < waits[1]


def test_the_cluster_s_denominator_is_the_ticket_s_shuffle_tree():
    """gqa_decode_attention.cu's cluster combine adds rank 0's 16 terms e^(m_s - M) l_s in one fixed
    tree, written out; the ticket's combine adds them across 32 lanes by __shfl_xor_sync by 16, 8, 4,
    2, 1 (lanes past the splits in use hold 0). In float32, with NumPy: the same bits, for every count
    of splits in use and terms of very different sizes."""
    rng = np.random.default_rng(0)
    for used in range(1, 17):
        for _ in range(50):
            terms = np.zeros(32, np.float32)
            terms[:used] = (rng.random(used) * 10.0 ** rng.integers(-8, 8, used)).astype(np.float32)
            lanes = terms.copy()
            for o in (16, 8, 4, 2, 1):  # every lane adds its partner's value of the step before
                lanes = (lanes + lanes[np.arange(32) ^ o]).astype(np.float32)
            t = terms
            tree = (((t[0] + t[8]) + (t[4] + t[12])) + ((t[2] + t[10]) + (t[6] + t[14]))) + \
                   (((t[1] + t[9]) + (t[5] + t[13])) + ((t[3] + t[11]) + (t[7] + t[15])))
            assert tree.dtype == np.float32 and tree.tobytes() == lanes[0].tobytes(), (used, terms)
            assert (lanes == lanes[0]).all()  # every lane ends with the same sum


def test_pad_puts_empty_kernel_boundaries_after_each_attention_and_changes_nothing_else():
    """pad=N: N launches of spin.cu's handoff after each layer's attention, no arguments, one warp; the
    step's other launches as the engine's. The handoff lets the next kernel launch, then waits: one
    grid completion more in the chain and nothing else."""
    from kernels import fused
    from tests.test_llama_fast_cpu import TINY, fake_engine

    assert variants.parse_variant("pad=2") == {"attention": {}, "gemv": {}, "l2": {}, "pad": 2}
    assert "pad" not in variants.parse_variant("plan")
    e, _ = fake_engine(TINY, "bfloat16")
    e.fn["handoff"] = "handoff"
    plain = e._decode_launches(prefetch=False, pdl=False)
    e.__class__ = variants.padded_engine(2)
    padded = e._decode_launches(prefetch=False, pdl=False)
    assert [x for x in padded if x.fn != "handoff"] == plain
    for i in range(TINY.n_layer):
        k = next(j for j, x in enumerate(padded) if x.name == f"h.{i}.{fast.STEP_KINDS[1]}")
        assert [(x.name, x.fn, x.grid, x.block, x.args) for x in padded[k + 1:k + 3]] == [
            (f"h.{i}.{fast.STEP_KINDS[1]}.pad{j}", "handoff", (1,), (32,), ()) for j in range(2)]
        assert padded[k + 3].name == f"h.{i}.{fast.STEP_KINDS[2]}"
    body = fused.ptx("spin", "handoff")
    body = body[body.index(".entry"):]
    assert re.findall(r"griddepcontrol\.(\w+)", body) == ["launch_dependents", "wait"]
    assert not re.search(r"\b(ld|st|atom|red)\.global", body)
