"""Llama's fast path without a GPU: every kernel instantiation the engine uses compiles with NVRTC for
sm_90 with no spills and no stack, the streams read 16-byte vectors with their first items in flight
before griddep_wait(), the host-side plan (matrices, items, grids, attention splits, cache length) is
right, the layout made at load holds every weight once in the run's dtype and changes no value, the
engine's weights are views of it, and RoPE's pairing and tables reproduce the eager model's rotation.
NumPy stands in for CuPy."""

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import llama
import llama.fast as fast
from kernels import fused
from llama.config import from_json
from llama.fast.engine import l2_options
from lm.arrays import held_bytes
from lm.generate import Sampler, reference_attend

BF16 = np.dtype(ml_dtypes.bfloat16)
TINY = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)  # head size 16
UNTIED = llama.LlamaConfig(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False)
PEERS = {  # tests/test_llama_gpu.py's, which the fast path runs there
    "gqa": llama.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=256),
    "untied-128": llama.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=128, vocab_size=2048, max_position_embeddings=256,
                                    tie_word_embeddings=False),
}
FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = {**llama.SIZES, **PEERS, "tiny": TINY, "untied": UNTIED,  # and the golden fixtures lab.py runs
          **{name: from_json(FIXTURES / name / "config.json") for name in ("llama-gqa", "llama-untied")}}
CASES = sorted({(file, expr) for config in MODELS.values() for dtype in fast.DTYPES
                for file, expr in fast.kernel_expressions(config, dtype).values()})


# -- the kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("file,expr", CASES, ids=[e for _, e in CASES])
def test_every_engine_kernel_compiles_for_sm90_without_spills(file, expr):
    r = fused.compile_report(file, expr, "sm_90")
    assert r.registers > 0
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    assert r.registers <= 168, r  # at least one block of 8 warps (or 12 of the attention's 4) per SM


def test_llama_3_2_1b_step_kernels():
    exprs = fast.kernel_expressions(llama.SIZES["llama-3.2-1b"], "bfloat16")
    assert exprs == {
        "qkv": ("rms_gemv", "rms_gemv_rope<unsigned short, 2048, 64, 8, 2>"),  # plan.STREAM_ITEM_LOADS: 4
        "o_proj": ("rms_gemv", "rms_gemv_residual<unsigned short, 2048, 8, 4>"),
        "gate_up": ("rms_gemv", "rms_gemv_silu<unsigned short, 2048, 8, 2>"),
        "down_proj": ("rms_gemv", "rms_gemv_residual<unsigned short, 8192, 8, 4>"),
        "lm_head": ("rms_gemv", "rms_gemv_argmax<unsigned short, 2048, 8, 4>"),
        **{f"attention/{w}{'/cluster' * c}": ("gqa_decode_attention",
                                               f"gqa_decode_attention<unsigned short, 64, 4, {w}, {str(c).lower()}, false>")
           for w in (4, 8, 16) for c in (False, True)},
        "embed": ("embed", "embed<unsigned short>"),
        "spin": ("spin", "spin"),
        "handoff": ("spin", "handoff"),
    }
    assert fast.kernel_expressions(llama.SIZES["llama-3.1-8b"], "float32")["down_proj"] == (
        "rms_gemv", "rms_gemv_residual<float, 14336, 8, 8>")


@pytest.mark.parametrize("key", ["qkv", "o_proj", "gate_up", "down_proj", "lm_head"])
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_streams_read_16_byte_vectors_two_items_ahead(key, dtype):
    """Every weight load of a stream is one 16-byte vector; its first two items (2 x rows x UNROLL loads)
    are issued before griddep_wait() and the input's staging, two more refill the buffers in the loop;
    the input is read through L2 after the wait; each stream hands the next matrix to L2."""
    config = llama.SIZES["llama-3.2-1b"]
    file, expr = fast.kernel_expressions(config, dtype)[key]
    body = fused.ptx(file, expr)
    body = body[body.index(".entry"):]
    loads = [m.start() for m in re.finditer(re.escape("ld.global.nc.v4.u32"), body)]
    wait = body.index("griddepcontrol.wait")
    m = fast.matrices(config)[key]
    item = m.rows * int(expr.rstrip(">").split(",")[-1])  # rows x UNROLL
    assert sum(at < wait for at in loads) == 2 * item, expr
    assert len(loads) == 4 * item, f"{expr}: {len(loads)} 16-byte weight loads, expected 2 + 2 items of {item}"
    assert wait < body.index("ld.global.cg.v4.f32"), f"{expr}: the input read before the wait"
    assert "st.global" not in body[:wait], f"{expr}: a store before the wait"
    assert "cp.async.bulk.prefetch.L2.global" in body, expr


# what each stream's epilogue and RMSNorm read before griddep_wait() besides the weights (rms_gemv.cu's
# ahead): RMSNorm's weight as float4s (nc: a weight), the residual's x (cg: two launches back), RoPE's
# position (cg) and its angle's cos and sin (nc: tables)
AHEAD = {"qkv": {"ld.global.nc.v4.f32", "ld.global.cg.s32", "ld.global.nc.f32"}, "o_proj": {"ld.global.cg.f32"},
         "gate_up": {"ld.global.nc.v4.f32"}, "down_proj": {"ld.global.cg.f32"}, "lm_head": {"ld.global.nc.v4.f32"}}


@pytest.mark.parametrize("key", sorted(AHEAD))
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_streams_read_their_epilogues_inputs_before_the_wait(key, dtype):
    """Besides the weights' 16-byte vectors, a stream reads before griddep_wait() exactly what AHEAD
    says: no epilogue and no RMSNorm pays a round trip through L2 after the last item's sums."""
    file, expr = fast.kernel_expressions(llama.SIZES["llama-3.2-1b"], dtype)[key]
    body = fused.ptx(file, expr)
    body = body[body.index(".entry"):]
    before = set(re.findall(r"\bld\.global[\w.]*", body[:body.index("griddepcontrol.wait")]))
    assert before - {"ld.global.nc.v4.u32"} == AHEAD[key], expr


def test_attention_stages_cached_rows_before_its_wait():
    file, expr = fast.kernel_expressions(llama.SIZES["llama-3.2-1b"], "bfloat16")["attention/4"]
    body = fused.ptx(file, expr)
    body = body[body.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert body.index("cp.async.cg.shared.global") < wait < body.index("cp.async.wait_all")


# -- the plan ---------------------------------------------------------------------------------------


def test_matrices_of_a_step():
    c = llama.SIZES["llama-3.2-3b"]  # 24 query heads over 8 key/value heads of 128
    m = fast.matrices(c)
    assert list(m) == ["qkv", "o_proj", "gate_up", "down_proj", "lm_head"]
    assert (m["qkv"].N, m["qkv"].K, m["qkv"].tasks) == ((24 + 16) * 128, 3072, (24 + 16) * 64)
    assert (m["o_proj"].N, m["o_proj"].K, m["o_proj"].tasks) == (3072, 3072, 3072)
    assert (m["gate_up"].N, m["gate_up"].K, m["gate_up"].tasks) == (2 * 8192, 3072, 8192)
    assert (m["down_proj"].N, m["down_proj"].K, m["down_proj"].tasks) == (3072, 8192, 3072)
    assert (m["lm_head"].N, m["lm_head"].K, m["lm_head"].tasks) == (128256, 3072, 128256)


@pytest.mark.parametrize("K", [16, 32, 64, 512, 1000, 1024, 2048, 3072, 4096, 8192, 14336])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_items_are_equal_and_about_item_loads(K, itemsize, rows):
    if K % (16 // itemsize):
        pytest.skip("not whole 16-byte rows")
    unroll = fast.gemv_unroll(K, itemsize, rows)
    per_lane = -(-(K // (16 // itemsize)) // 32)
    groups = -(-per_lane // unroll)
    assert 1 <= unroll and rows * unroll <= fast.plan.ITEM_LOADS
    assert groups * unroll - per_lane < groups, "items of equal size: no item more than one vector short"
    if per_lane * rows > fast.plan.ITEM_LOADS // 2:
        assert groups >= 2, (per_lane, unroll)
    if per_lane >= 2 * fast.plan.ITEM_LOADS // rows:
        assert rows * unroll > fast.plan.ITEM_LOADS // 2, "long rows: items of about ITEM_LOADS loads"


def test_gemv_grid_is_one_wave_no_larger_than_the_tasks():
    assert fast.gemv_grid(128256, 3, 132) == 396
    assert fast.gemv_grid(2048, 4, 132) == 256  # 8 warps a block, a task a warp
    assert fast.gemv_grid(5, 4, 132) == 1
    assert fast.gemv_grid(10_000, 0, 132) == 132  # occupancy unknown: a block per SM


@pytest.mark.parametrize("size", list(llama.SIZES))
@pytest.mark.parametrize("max_len", [2, 17, 768, 1024, 8192, 131072])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_attention_plan_fills_the_sms_and_fits_shared_memory(size, max_len, itemsize):
    c = llama.SIZES[size]
    group, sms = c.num_attention_heads // c.num_key_value_heads, 132
    p = fast.attention_plan(c, max_len, sms, itemsize)
    cap = p.split_keys
    assert cap == -(-max_len // p.splits) and p.warps == fast.plan.attention_warps(cap, c.head_size)
    assert p.splits >= 1 and cap <= fast.plan.MAX_SPLIT_KEYS
    if max_len >= fast.plan.MIN_SPLIT_KEYS * sms // c.num_key_value_heads:
        assert p.splits * c.num_key_value_heads >= sms - c.num_key_value_heads + 1  # a block per SM, about
    assert 1 <= p.staged_rows <= cap and 2 * p.staged_rows * c.head_size * itemsize <= fast.plan.STAGE_BYTES
    merge = 4 * p.splits * group * (c.head_size + 2) if p.cluster else 0  # rank 0's partials
    assert p.smem == 2 * p.staged_rows * c.head_size * itemsize + merge
    assert not p.cluster or p.splits <= fast.plan.CLUSTER_SPLITS
    assert p.smem + 17 * 1024 < 227 * 1024  # with the static outputs: within an H100's block


def kernel_splits(S: int, split_keys: int, T_k: int) -> list[tuple[int, int]]:
    """gqa_decode_attention.cu's split arithmetic, as its blocks do it: the key range of each split in use."""
    used = min(S, -(-T_k // split_keys))
    chunk = -(-T_k // used)
    assert chunk <= split_keys, (S, split_keys, T_k)  # the split's scores fit their room
    return [(min(s * chunk, T_k), min(min(s * chunk, T_k) + chunk, T_k)) for s in range(used)]


@pytest.mark.parametrize("size", list(llama.SIZES))
@pytest.mark.parametrize("max_len", [2, 17, 256, 1033, 2048, 131072])
def test_attention_uses_as_few_splits_as_hold_the_keys_and_covers_every_key(size, max_len):
    p = fast.attention_plan(llama.SIZES[size], max_len, 132, 2)
    for T_k in {1, 2, 17, 63, 64, 65, 127, 128, 129, 1000, max_len // 2, max_len - 1, max_len} - {0}:
        if T_k > max_len:
            continue
        ranges = kernel_splits(p.splits, p.split_keys, T_k)
        assert ranges[0][0] == 0 and ranges[-1][1] == T_k and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert len(ranges) == -(-T_k // p.split_keys) or len(ranges) == p.splits
    assert len(kernel_splits(p.splits, p.split_keys, p.split_keys)) == 1  # one split, no combine
    assert len(kernel_splits(p.splits, p.split_keys, max_len)) == p.splits


def test_attention_warps_take_a_split_in_one_step_of_their_pass():
    # 512 / head_size keys a warp: 8 at head size 64, 4 at 128
    assert [fast.plan.attention_warps(k, 64) for k in (1, 32, 33, 64, 65, 128, 4096)] == [4, 4, 8, 8, 16, 16, 16]
    assert [fast.plan.attention_warps(k, 128) for k in (1, 16, 17, 32, 33, 4096)] == [4, 4, 8, 8, 16, 16]
    c = llama.SIZES["llama-3.2-1b"]  # 8 key/value heads: 8 splits of 64 keys at 512, 16 of 128 at 2,048
    assert fast.attention_plan(c, 512, 132, 2).warps == 8 and fast.attention_plan(c, 2048, 132, 2).warps == 16


def test_the_cache_holds_the_run_not_the_model():
    c = llama.SIZES["llama-3.2-1b"]
    assert fast.cache_positions(523, c) == 768 and fast.cache_positions(512, c) == 512
    assert fast.cache_positions(2, c) == fast.CACHE_QUANTUM
    assert fast.cache_positions(10**6, c) == c.max_position_embeddings
    assert fast.cache_positions(50, TINY) == 64  # no more than the model has
    with pytest.raises(ValueError, match="at least 2 positions"):
        fast.cache_positions(1, c)


class FakeArray:  # what unsupported_reason looks at: not a NumPy array, a dtype
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype) if dtype != "bfloat16" else BF16


@pytest.mark.parametrize("case,kwargs,config,dtype,reason", [
    ("greedy kv-cache bf16", {"kv_cache": True}, "llama-3.2-1b", "bfloat16", None),
    ("greedy kv-cache fp32", {"kv_cache": True}, "llama-3.1-8b", "float32", None),
    ("no cache", {"kv_cache": False}, "llama-3.2-1b", "bfloat16", "no KV cache"),
    ("sampling", {"kv_cache": True, "sampler": Sampler(1.0)}, "llama-3.2-1b", "bfloat16", "sampling"),
    ("greedy sampler", {"kv_cache": True, "sampler": Sampler(0.0)}, "llama-3.2-3b", "bfloat16", None),
    ("logits", {"kv_cache": True, "record_logits": True}, "llama-3.2-1b", "bfloat16", "recording logits"),
    ("float16", {"kv_cache": True}, "llama-3.2-1b", "float16", "dtype float16"),
    ("head size 16", {"kv_cache": True}, TINY, "float32", None),
    ("head size 40", {"kv_cache": True}, llama.LlamaConfig(hidden_size=160, num_attention_heads=4,
                                                           num_key_value_heads=2), "float32", "head size 40"),
    ("group of 16", {"kv_cache": True}, llama.LlamaConfig(hidden_size=1024, num_attention_heads=16,
                                                          num_key_value_heads=1), "float32", "16 query heads per"),
    ("width", {"kv_cache": True}, llama.LlamaConfig(hidden_size=2048, intermediate_size=8190), "float32",
     "multiples of 8"),
])
def test_when_the_fast_path_runs(case, kwargs, config, dtype, reason):
    config = llama.SIZES[config] if isinstance(config, str) else config
    got = fast.unsupported_reason({"model.layers.0.self_attn.q_proj.weight": FakeArray(dtype)}, config, **kwargs)
    assert (got is None) if reason is None else (reason in got), got


def test_numpy_weights_take_the_eager_path():
    params = llama.random_weights(TINY, seed=0).params
    assert "NumPy" in fast.unsupported_reason(params, TINY, kv_cache=True)
    out = llama.generate(params, TINY, [1, 2, 3], 4, attend=reference_attend, kv_cache=True)  # fast=True, eager here
    assert len(out.tokens) == 4


# -- the weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_layout_stacks_in_place_and_changes_no_value(config, dtype):
    """q/k/v and gate/up become row blocks of one matrix each: the same values, shapes and dtypes, every
    byte held once (the originals dropped), the eager model's logits unchanged; once is enough."""
    params = llama.random_weights(config, seed=1, dtype=dtype).params
    before = {k: a.copy() for k, a in params.items()}
    total = held_bytes(params.values())
    ids = np.arange(9)[None] * 7
    want = llama.forward(params, config, ids, reference_attend)
    assert fast.decode_layout(params, config) is params
    assert params.keys() == before.keys() and held_bytes(params.values()) == total
    for name, a in params.items():
        assert a.dtype == before[name].dtype and a.shape == before[name].shape, name
        np.testing.assert_array_equal(a.view(np.uint8), before[name].view(np.uint8), err_msg=name)
    for i in range(config.n_layer):
        for names in fast.STACKS.values():
            parts = [params[f"model.layers.{i}.{n}.weight"] for n in names]
            whole = fast.stacked(parts)
            assert whole is not None and whole.shape == (sum(p.shape[0] for p in parts), config.hidden_size)
            np.testing.assert_array_equal(whole, np.concatenate(parts))
    np.testing.assert_array_equal(llama.forward(params, config, ids, reference_attend), want)
    laid = dict(params)
    fast.decode_layout(params, config)
    assert all(params[k] is laid[k] for k in params)


def test_stacked_refuses_what_is_not_one_matrix_in_order():
    stack = np.arange(40, dtype=np.float32).reshape(10, 4)
    assert fast.stacked([stack[0:3], stack[3:5], stack[5:10]]) is not None
    assert fast.stacked([stack[3:5], stack[0:3]]) is None  # out of order
    assert fast.stacked([stack[0:3], stack[4:6]]) is None  # a gap
    assert fast.stacked([stack[:, :2], stack[:, 2:]]) is None  # columns, not rows
    assert fast.stacked([np.zeros((3, 4), np.float32), np.zeros((2, 4), np.float32)]) is None  # two arrays
    np.testing.assert_array_equal(fast.stacked([stack[2:4], stack[4:7]]), stack[2:7])


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_weights_are_views_of_weights_laid_out_in_the_run_s_dtype(config, dtype):
    """With params in the run's dtype and decode_layout's layout, the engine's matrices are views of them:
    no byte of a matrix held twice, each (out, in) row-major in the kernels' element type; a tied head
    is the embedding table itself. Only the RMSNorm weights of a bfloat16 run are widened to float32."""
    params = fast.decode_layout(llama.random_weights(config, seed=2, dtype=dtype).params, config)
    w = fast.decode_weights(np, params, config, dtype)
    kernel_type = np.uint16 if dtype == "bfloat16" else np.float32
    mats = {k: a for k, a in w.arrays().items() if a.ndim == 2}
    assert len(mats) == 2 + 4 * config.n_layer
    assert all(a.dtype == kernel_type and a.flags.c_contiguous for a in mats.values())
    assert held_bytes(mats.values(), besides=params.values()) == 0
    assert held_bytes(mats.values()) == sum(a.nbytes for a in params.values() if a.ndim == 2)
    assert (w.head is w.embed) == config.tie_word_embeddings
    norms = [a for a in w.arrays().values() if a.ndim == 1]
    assert len(norms) == 2 * config.n_layer + 1 and all(a.dtype == np.float32 for a in norms)
    widened = 0 if dtype == "float32" else sum(a.nbytes for a in norms)
    assert held_bytes(w.arrays().values(), besides=params.values()) == widened
    C, HS, NH = config.hidden_size, config.head_size, config.num_attention_heads
    np.testing.assert_array_equal(w.layers[1]["qkv"][NH * HS:NH * HS + 2],
                                  params["model.layers.1.self_attn.k_proj.weight"][:2].view(kernel_type))
    np.testing.assert_array_equal(w.layers[0]["gate_up"][config.intermediate_size:],
                                  params["model.layers.0.mlp.up_proj.weight"].view(kernel_type))
    assert w.layers[0]["down_proj"].shape == (C, config.intermediate_size)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_copies_each_matrix_once_when_params_are_not_laid_out(dtype):
    """float32 params as loaded (q, k, v apart): the engine stacks a copy of each layer's projections, and
    in a bfloat16 run holds every other matrix once in bfloat16 too; never two copies of one."""
    params = llama.random_weights(UNTIED, seed=3).params
    w = fast.decode_weights(np, params, UNTIED, dtype)
    item = 2 if dtype == "bfloat16" else 4
    stacks = sum(params[f"model.layers.{i}.{n}.weight"].size for i in range(UNTIED.n_layer)
                 for names in fast.STACKS.values() for n in names)
    others = sum(a.size for a in params.values() if a.ndim == 2) - stacks
    copied = item * (stacks + (others if dtype == "bfloat16" else 0))
    assert held_bytes(w.arrays().values(), besides=params.values()) == copied  # the float32 norms: views
    assert held_bytes(w.norms.values(), besides=params.values()) == 0


def test_a_norm_off_a_16_byte_boundary_is_copied():
    """rms_gemv.cu reads a norm's weight as float4s: a float32 view that starts 4 bytes into its buffer is
    copied (onto a boundary, with its values), one that starts on a boundary is used as it is."""
    from llama.fast.weights import on_16_bytes
    from lm.arrays import address

    buf = np.arange(9, dtype=np.float32)
    on, off = buf[4:8], buf[1:5]
    assert address(on) % 16 == 0 and address(off) % 16 == 4  # NumPy aligns its buffers to 16 bytes at least
    assert on_16_bytes(on) is on
    moved = on_16_bytes(off)
    assert address(moved) % 16 == 0 and (moved == off).all()


def test_weight_bytes_per_token_is_the_loader_s():
    c = llama.SIZES["llama-3.2-1b"]
    assert fast.weight_bytes_per_token(c, "bfloat16") == 2 * 1_235_814_400  # tied: the table once
    assert fast.weight_bytes_per_token(llama.SIZES["llama-3.1-8b"], "bfloat16") < 2 * 8_030_261_248


# -- RoPE ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY, PEERS["untied-128"], llama.SIZES["llama-3.2-1b"]], ids=["16", "128", "1b"])
def test_rope_pairs_and_tables_give_the_eager_rotation(config):
    """rms_gemv_rope's task t reads rows i and i + HS / 2 of head t / (HS / 2) of the stacked [q; k; v] and
    rotates them with the engine's tables (rope_tables' first half, (max_len, HS / 2)): done in NumPy on
    a random stacked matrix and input, q and k equal llama/model.py's rope() of the same products at
    every position tried, bit for bit, and v passes unrotated."""
    rng = np.random.default_rng(5)
    C, HS, NH, NKV = config.hidden_size, config.head_size, config.num_attention_heads, config.num_key_value_heads
    W = rng.standard_normal(((NH + 2 * NKV) * HS, C)).astype(np.float32) * np.float32(0.05)
    h = rng.standard_normal(C).astype(np.float32)
    out = W @ h  # the products, (NH + 2 NKV) HS
    max_len = 40
    cos, sin = llama.model.rope_tables(config, 0, max_len, np)
    tables = np.ascontiguousarray(cos[:, :HS // 2]), np.ascontiguousarray(sin[:, :HS // 2])
    half = HS // 2
    for pos in (0, 1, 17, max_len - 1):
        got = np.empty_like(out)
        for t in range((NH + 2 * NKV) * half):  # the kernel's tasks, as rms_gemv.cu's RopePairs and RopeStore
            head, i = divmod(t, half)
            ra, rb = head * HS + i, head * HS + i + half
            a, b = out[ra], out[rb]
            if head < NH + NKV:
                c, s = tables[0][pos, i], tables[1][pos, i]
                a, b = np.float32(a * c) + np.float32(-b * s), np.float32(b * c) + np.float32(a * s)
            got[ra], got[rb] = a, b
        c1, s1 = llama.model.rope_tables(config, pos, 1, np)  # (1, HS)
        q = out[:NH * HS].reshape(1, NH, 1, HS)
        k = out[NH * HS:(NH + NKV) * HS].reshape(1, NKV, 1, HS)
        np.testing.assert_array_equal(got[:NH * HS], llama.model.rope(q, c1, s1).reshape(-1))
        np.testing.assert_array_equal(got[NH * HS:(NH + NKV) * HS], llama.model.rope(k, c1, s1).reshape(-1))
        np.testing.assert_array_equal(got[(NH + NKV) * HS:], out[(NH + NKV) * HS:])
        np.testing.assert_array_equal(tables[0][pos], c1[0, :half])
        np.testing.assert_array_equal(c1[0, :half], c1[0, half:])  # both halves share the angle


# -- the launches against the kernels' signatures ------------------------------------------------------

C_TYPES = {"float": np.float32, "int": np.int32, "unsigned int": np.uint32, "char": None}  # None: any array


def signature(file: str, kernel: str) -> list[tuple[str, bool, str]]:
    """(base type, is a pointer, name) of each parameter of `kernel` in kernels/fused/<file>.cu."""
    text = fused.path_of(file).read_text()
    (params,) = re.findall(rf"\n{kernel}\(([^)]*)\)", text)
    out = []
    for p in params.split(","):
        words = p.replace("*", " * ").replace("__restrict__", "").replace("const", "").split()
        pointer = "*" in words
        words = [w for w in words if w != "*"]
        out.append((" ".join(words[:-1]), pointer, words[-1]))
    return out


def fake_engine(config, dtype):
    """An Engine with NumPy buffers and kernel names for functions: what _decode_launches reads."""
    from types import SimpleNamespace

    params = fast.decode_layout(llama.random_weights(config, seed=0, dtype=dtype).params, config)
    e = fast.Engine.__new__(fast.Engine)
    wt = np.uint16 if dtype == "bfloat16" else np.float32
    C, NH, NKV, HS = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_size
    e.config, e.dtype, e.max_len, e.eps = config, dtype, 64, np.float32(config.rms_norm_eps)
    e.weights = fast.decode_weights(np, params, config, dtype)
    e.state, e.history = np.zeros(2, np.int32), np.zeros(64, np.int32)
    cache = np.zeros((config.n_layer, 1, NKV, 64, HS), wt)
    e.kv = [(cache[i, 0], cache[i, 0].copy()) for i in range(config.n_layer)]
    e.rope_cos = e.rope_sin = np.zeros((64, HS // 2), np.float32)
    e.x, e.q, e.y = np.zeros(C, np.float32), np.zeros(NH * HS, np.float32), np.zeros(NH * HS, np.float32)
    e.g = np.zeros(config.intermediate_size, np.float32)
    e.attn = fast.attention_plan(config, 64, 132, 2 if dtype == "bfloat16" else 4)
    e.attn_partial = np.zeros((NH, e.attn.splits, HS + 2), np.float32)
    e.attn_counters = np.zeros(NKV, np.uint32)
    e.attn_trace = None
    e.block_max, e.block_arg, e.lm_counter = np.zeros(7, np.float32), np.zeros(7, np.int32), np.zeros(1, np.uint32)
    e.logits = np.zeros(config.vocab_size, np.float32)
    e.gemv = {key: (m.kernel, 7, 4 * m.K) for key, m in fast.matrices(config).items()}
    e.fn = {"embed": "embed", "attention": "gqa_decode_attention"}
    e.stream = SimpleNamespace(ptr=0)
    e.l2_options = l2_options(None)
    return e, wt


def test_prefetch_hints_name_the_next_matrix_and_the_attention_the_layer_s_gate_up():
    """With prefetch on, each stream asks L2 for the next matrix read, up to l2's cap; the attention launch
    (which reads no matrix) asks for the first `attention` bytes of its layer's gate/up, where l2 says so."""
    from types import SimpleNamespace

    class Matrix:  # a device array as the hints see it: an address and a size
        def __init__(self, ptr, nbytes):
            self.data, self.nbytes = SimpleNamespace(ptr=ptr), nbytes

    e, _ = fake_engine(TINY, "bfloat16")
    w = e.weights
    for i, layer in enumerate(w.layers):
        for j, key in enumerate(("qkv", "o_proj", "gate_up", "down_proj")):
            layer[key] = Matrix((1 + 4 * i + j) << 24, 5000 + 1000 * j)
    w.head = Matrix(1 << 40, 3000)
    for cap, ahead in ((4096, 0), (1 << 20, 2048), (1 << 20, 1 << 30)):
        e.l2_options = l2_options({"cap": cap, "attention": ahead})
        launches = e._decode_launches(prefetch=True, pdl=False)
        for i in range(TINY.n_layer):
            qkv, attention, o_proj, gate_up, down = launches[1 + 5 * i:6 + 5 * i]
            nxt = w.layers[i + 1]["qkv"] if i + 1 < TINY.n_layer else w.head
            for launch, m in ((qkv, w.layers[i]["o_proj"]), (o_proj, w.layers[i]["gate_up"]),
                              (gate_up, w.layers[i]["down_proj"]), (down, nxt)):
                assert launch.args[-2:] == (m.data.ptr, min(m.nbytes, cap) // 256 * 256), launch.name
            want = (w.layers[i]["gate_up"].data.ptr, min(7000, ahead) // 256 * 256) if ahead else (0, 0)
            assert attention.args[-3:-1] == want and attention.args[-1] == 0  # then trace: none
    e.l2_options = l2_options({"attention": 1 << 20})
    assert all(launch.args[-2:] == (0, 0) for launch in e._decode_launches(prefetch=False, pdl=False)[1:-1])


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_every_launch_passes_what_its_kernel_declares(config, dtype):
    """Each launch of a decode step, against its kernel's parameters in the .cu file: as many arguments,
    each pointer an array of the declared element type (weight_t and kv_t: the run's element type) or
    null, each scalar of the declared width; and the layer's own matrix, norm and cache views."""
    e, wt = fake_engine(config, dtype)
    launches = e._decode_launches(prefetch=False, pdl=False)
    assert len(launches) == 5 * config.n_layer + 2
    assert [launch.name for launch in launches[1:6]] == [f"h.0.{kind}" for kind in fast.STEP_KINDS]
    files = {"embed": "embed", "gqa_decode_attention": "gqa_decode_attention"}
    for launch in launches:
        params = signature(files.get(launch.fn, "rms_gemv"), launch.fn)
        assert len(params) == len(launch.args), f"{launch.name}: {len(launch.args)} arguments for {len(params)}"
        for (ctype, pointer, name), arg in zip(params, launch.args, strict=True):
            what = f"{launch.name} ({launch.fn}) {name}"
            if pointer:
                if isinstance(arg, np.uint64):
                    assert arg == 0, f"{what}: a pointer must be an array or null"
                    continue
                assert isinstance(arg, np.ndarray), what
                want = wt if ctype in ("weight_t", "kv_t") else C_TYPES[ctype]
                assert want is None or arg.dtype == want, f"{what}: {arg.dtype}, declared {ctype}"
            else:
                want = {"int": np.int32, "float": np.float32, "unsigned long long": np.uint64}[ctype]
                assert type(arg) is want, f"{what}: {type(arg).__name__}, declared {ctype}"
    w, norms = e.weights, e.weights.norms
    for i in range(config.n_layer):
        qkv, attention, o_proj, gate_up, down = launches[1 + 5 * i:6 + 5 * i]
        assert qkv.args[0] is w.layers[i]["qkv"] and qkv.args[2] is norms[f"model.layers.{i}.input_layernorm.weight"]
        assert qkv.args[10] is e.kv[i][0] and qkv.args[11] is e.kv[i][1] and attention.args[1:3] == e.kv[i]
        assert o_proj.args[0] is w.layers[i]["o_proj"] and down.args[0] is w.layers[i]["down_proj"]
        assert gate_up.args[2] is norms[f"model.layers.{i}.post_attention_layernorm.weight"]
        assert attention.grid == (e.attn.splits, config.num_key_value_heads)
    assert launches[-1].args[0] is w.head and launches[-1].args[2] is norms["model.norm.weight"]
    assert launches[0].args[0] is w.embed
