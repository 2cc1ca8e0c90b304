"""The fused kernels and the fast engine's planning, without a GPU: every instantiation the engine
uses compiles with NVRTC for sm_90 with no spills and no stack, the weight loads are 16-byte vectors,
the loader's errors name the file, and the host-side arithmetic (bfloat16 rounding, bytes per token,
launch shapes, the choice between the fast and the eager path) is right."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt2
import gpt2.fast as fast
from gpt2 import GPT2Config, Sampler, train_kernels
from gpt2.load import expected_shapes
from kernels import KernelCompileError, fused
from lm import adamw
from lm.switch import ASKED, ON, Switch, decide

ROOT = Path(__file__).resolve().parent.parent
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64)  # tests/test_lab.py's
MODELS = {**{name: gpt2.SIZES[name] for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}, "tiny": TINY,
          "peer": GPT2Config(n_layer=4, n_head=4, n_embd=256, n_positions=256)}  # tests/test_gpt2_gpu.py's
CASES = sorted({(file, expr) for config in MODELS.values() for dtype in fast.DTYPES
                for file, expr in fast.kernel_expressions(config, dtype).values()})
TRAIN_CASES = sorted({expr for config in MODELS.values() for dtype in train_kernels.TYPES
                      for expr in train_kernels.kernel_expressions(config.n_embd, dtype)})


@pytest.mark.parametrize("file,expr", CASES, ids=[e for _, e in CASES])
def test_every_engine_kernel_compiles_for_sm90_without_spills(file, expr):
    r = fused.compile_report(file, expr, "sm_90")
    assert r.registers > 0
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    assert r.registers <= 255


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("expr", TRAIN_CASES)
def test_every_training_kernel_compiles_without_spills(expr, arch):
    r = fused.compile_report("train", expr, arch)
    assert 0 < r.registers <= 128, r  # layernorm_bwd's 512 threads fit an SM's 64K registers
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("expr", adamw.KERNELS)
def test_the_multi_tensor_adamw_compiles_without_spills(expr, arch):
    r = fused.compile_report("adamw", expr, arch, adamw.OPTIONS)
    assert 0 < r.registers <= 64, r  # 256 threads: eight blocks an SM
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r


@pytest.mark.parametrize("expr", adamw.KERNELS[1:])
def test_the_multi_tensor_adamw_step_rounds_every_operation(expr):
    """-fmad=false as the per-tensor ElementwiseKernel: no multiply-add contracted, so that both round alike
    (the eager update and the graph's, which reads its scalars from memory)."""
    text = fused.ptx("adamw", expr, "sm_90", adamw.OPTIONS)
    assert "fma." not in text and "mul.rn.ftz.f32" in text and "sqrt.rn.ftz.f32" in text


@pytest.mark.parametrize("key", sorted(fast.gemm_expressions()))
def test_gemm_compiles_for_sm90a_without_spills_or_a_serialized_wgmma(key):
    file, expr = fast.gemm_expressions()[key]
    r = fused.compile_report(file, expr, "sm_90", options=fast.GEMM_OPTIONS)
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    assert 0 < r.registers <= 168, r  # two blocks of 128 threads per SM with room to spare
    assert not r.performance_warnings, f"ptxas says {r.performance_warnings}"


def test_gemm_weight_splits_tiles_and_swizzles_every_element():
    """gemm_weight with NumPy for CuPy: element (k, n) of W lands as gemm.cu reads it, big + small
    is W exactly, big is W rounded to 10 mantissa bits (nearest, ties away from zero)."""
    rng = np.random.default_rng(0)
    K, N = 96, 128
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[0, 0], w[1, 0] = np.float32(1 + 2**-11), np.float32(-(1 + 3 * 2**-12))  # a tie (away from zero) and a round-up
    big, small = fast.gemm_weight(np, w)
    assert big.shape == small.shape == (N // 64, K // 32, 64, 32)
    k, n = np.meshgrid(np.arange(K), np.arange(N), indexing="ij")
    r, c = n % 64, k % 32
    at = (n // 64, k // 32, r, ((c // 4) ^ (r % 8)) * 4 + c % 4)
    assert (big[at] + small[at] == w).all()
    assert (big[at].view(np.uint32) & 0x1FFF == 0).all()
    assert (np.abs(small[at]) <= np.abs(w) * 2.0**-11).all()
    assert big[at][0, 0] == np.float32(1 + 2**-10) and big[at][1, 0] == np.float32(-(1 + 2**-10))
    with pytest.raises(ValueError, match="N % 64"):
        fast.gemm_weight(np, w[:, :100])


@pytest.mark.parametrize("K,N", [(768, 2304), (768, 768), (768, 3072), (3072, 768), (1600, 6400), (32, 64)])
def test_gemm_splits_fill_the_sms_and_fit_the_partials(K, N):
    sms = 132
    for M in range(1, 1025):
        splits = fast.gemm_splits(M, N, K, sms)
        blocks = (N // 64) * -(-M // 64)
        assert 1 <= splits <= max(1, K // 32 // 2), (M, splits)  # a split keeps two K tiles of 32
        if splits > 1:
            assert blocks < sms and splits * blocks < 2 * sms, (M, splits)  # the engine's partial sums hold them
            assert blocks <= sms, "a ticket per output tile: sm_count of them"
        elif K // 32 >= 4:
            assert blocks >= sms, (M, blocks)  # fewer output tiles than SMs: always split
    assert fast.gemm_splits(16, 768, 3072, sms) == 11 and fast.gemm_splits(519, 768, 3072, sms) == 2


def test_the_engines_and_the_training_pass_launch_every_fused_file():
    import llama
    import llama.fast

    llama_files = {file for config in llama.SIZES.values() for dtype in llama.fast.DTYPES
                   for file, _ in llama.fast.kernel_expressions(config, dtype).values()}
    used = {file for file, _ in CASES} | {file for file, _ in fast.gemm_expressions().values()} | llama_files | {"train", "adamw"}
    assert used == set(fused.names()), f"fused kernels nothing launches: {set(fused.names()) - used}"


@pytest.mark.parametrize("dtype,vector", [("float32", "ld.global.nc.v4.u32"), ("bfloat16", "ld.global.nc.v4.u32")])
def test_linear_layers_read_16_byte_vectors_and_prefetch(dtype, vector):
    """Every weight load of gemv and lm_head_argmax is one 16-byte vector; gemv issues all of them, and
    lm_head_argmax its first two row groups, before griddep_wait() and the first barrier (the LayerNorm
    of the input); lm_head_argmax issues two more groups in its loop (the two refilled buffers); and
    each kernel hands the next one's weights to L2."""
    for key in ("c_attn", "mlp_proj", "lm_head"):
        file, expr = fast.kernel_expressions(gpt2.SIZES["gpt2"], dtype)[key]
        text = fused.ptx(file, expr)
        body = text[text.index(".entry"):]
        loads = [m.start() for m in re.finditer(re.escape(vector), body)]
        first_barrier = min(body.index("bar.sync"), body.index("griddepcontrol.wait"))
        K = 3072 if key == "mlp_proj" else 768
        per_lane = -(-K // (16 // (2 if dtype == "bfloat16" else 4)) // 32)
        if key == "lm_head":
            group = fast.lm_head_shape(gpt2.SIZES["gpt2"], dtype)[1] * per_lane  # loads per row group
            early = sum(at < first_barrier for at in loads)
            assert early == 2 * group, f"{expr}: {early} 16-byte loads before the wait, expected two groups of {group}"
            assert len(loads) == 4 * group, f"{expr}: {len(loads)} 16-byte loads, expected 2 + 2 groups of {group}"
        else:
            assert len(loads) >= per_lane, f"{expr}: {len(loads)} 16-byte loads, expected {per_lane} per row"
            assert all(at < first_barrier for at in loads), f"{expr}: a weight load after the first barrier"
        assert "cp.async.bulk.prefetch.L2.global" in body, expr


def test_loader_names_the_file_and_line_of_a_compile_error(tmp_path):
    broken = tmp_path / "broken.cu"
    broken.write_text('#include "helper.cuh"\n__global__ void k(float* x)\n{\n    x[0] = undefined_name;\n}\n')
    (tmp_path / "helper.cuh").write_text("__device__ float twice(float v) { return 2 * v; }\n")
    with pytest.raises(KernelCompileError) as info:
        fused.compile_report(str(broken), "k")
    assert f"{broken}(4)" in str(info.value) and "undefined_name" in str(info.value)


def test_loader_rejects_unknown_kernels():
    with pytest.raises(ValueError, match=r"unknown fused kernel 'nope': known are .*gemv"):
        fused.path_of("nope")
    with pytest.raises(ValueError, match="does not exist"):
        fused.path_of("/no/such/kernel.cu")


def test_assembled_source_follows_edits_of_an_included_file(tmp_path):
    (tmp_path / "helper.cuh").write_text("__device__ float twice(float v) { return 2 * v; }\n")
    path = tmp_path / "user.cu"
    path.write_text('#include "helper.cuh"\n__global__ void k(float* x) { x[0] = twice(x[0]); }\n')
    before = fused.source(str(path))
    (tmp_path / "helper.cuh").write_text("__device__ float twice(float v) { return v + v + 0; }\n")
    assert fused.source(str(path)) != before and "v + v + 0" in fused.source(str(path))


# -- host-side arithmetic --------------------------------------------------------------------------


def test_bfloat16_rounding_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng()
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
                        np.array([0.0, -0.0, 1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, 1e-40],
                                 dtype=np.float32)]).astype(np.float32)  # ties to even, both ways
    bits = fast.bf16_bits(np, x)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(fast.round_to_bf16(np, x), x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-xl"])
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_weight_bytes_per_token_count_every_parameter_but_wpe(name, dtype):
    """A decode step reads every parameter once except wpe, of which it reads one row."""
    config = gpt2.SIZES[name]
    shapes = expected_shapes(config)
    item = 2 if dtype == "bfloat16" else 4
    matrices = sum(int(np.prod(s)) for k, s in shapes.items() if fast.is_matrix(k) and k != "wpe.weight")
    vectors = sum(int(np.prod(s)) for k, s in shapes.items() if not fast.is_matrix(k))
    expected = item * (matrices + config.n_embd) + 4 * vectors
    assert fast.weight_bytes_per_token(config, dtype) == expected
    if name == "gpt2" and dtype == "float32":
        assert expected == 494_616_576  # 0.49 GB: the fp32 bandwidth floor is about 0.12 ms per token


def test_kv_bytes_per_token():
    assert fast.kv_bytes_per_token(gpt2.SIZES["gpt2"], "float32", 511) == 2 * 12 * 768 * 512 * 4
    assert fast.kv_bytes_per_token(gpt2.SIZES["gpt2"], "bfloat16", 0) == 2 * 12 * 768 * 2


@pytest.mark.parametrize("N,K,item,expected", [
    (2304, 768, 4, (8, 1)), (768, 768, 4, (4, 1)), (768, 3072, 4, (4, 1)), (3072, 768, 4, (8, 1)),
    (2304, 768, 2, (8, 2)), (768, 3072, 2, (4, 1)), (96, 32, 4, (4, 2)),
])
def test_gemv_shape_keeps_loads_in_flight(N, K, item, expected):
    assert fast.gemv_shape(N, K, item) == expected


def test_decode_step_is_five_kernels_per_layer_plus_two():
    exprs = fast.kernel_expressions(gpt2.SIZES["gpt2"], "float32")
    assert exprs["c_attn"] == ("gemv", "gemv<float, 768, 8, 1, true, 0>")
    assert exprs["mlp_proj"] == ("gemv", "gemv<float, 3072, 4, 1, false, 2>")
    assert exprs["lm_head"] == ("lm_head_argmax", "lm_head_argmax<float, 768, 8, 1>")
    assert fast.kernel_expressions(gpt2.SIZES["gpt2"], "bfloat16")["lm_head"] == (
        "lm_head_argmax", "lm_head_argmax<unsigned short, 768, 8, 2>")
    assert fast.kernel_expressions(gpt2.SIZES["gpt2"], "bfloat16")["attention"] == (
        "decode_attention", "decode_attention<unsigned short, 64, 4>")


def test_by_kind_sums_the_layers():
    rows = [("embed", 1.0), ("h.0.attn", 2.0), ("h.1.attn", 3.0), ("h.10.attn", 4.0), ("ln_f+lm_head+argmax", 5.0)]
    assert fast.by_kind(rows) == [("embed", 1, 1.0), ("attn", 3, 9.0), ("ln_f+lm_head+argmax", 1, 5.0)]


class FakeArray:  # what unsupported_reason looks at: not a NumPy array, a dtype
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype) if dtype != "bfloat16" else type("D", (), {"name": "bfloat16"})()


@pytest.mark.parametrize("case,kwargs,config,dtype,reason", [
    ("greedy kv-cache fp32", {"kv_cache": True}, "gpt2", "float32", None),
    ("greedy no-cache fp32", {"kv_cache": False}, "gpt2", "float32", None),
    ("greedy kv-cache bf16", {"kv_cache": True}, "gpt2", "bfloat16", None),
    ("no-cache bf16", {"kv_cache": False}, "gpt2", "bfloat16", "no-cache mode in bfloat16"),
    ("sampling", {"kv_cache": True, "sampler": Sampler(1.0)}, "gpt2", "float32", "sampling"),
    ("greedy sampler", {"kv_cache": True, "sampler": Sampler(0.0)}, "gpt2", "float32", None),
    ("logits", {"kv_cache": True, "record_logits": True}, "gpt2", "float32", "recording logits"),
    ("float16", {"kv_cache": True}, "gpt2", "float16", "dtype float16"),
    ("head size 20", {"kv_cache": True}, GPT2Config(n_layer=1, n_head=2, n_embd=40), "float32", "head size 20"),
])
def test_when_the_fast_path_runs(case, kwargs, config, dtype, reason):
    config = gpt2.SIZES[config] if isinstance(config, str) else config
    got = fast.unsupported_reason({"wte.weight": FakeArray(dtype)}, config, **kwargs)
    assert (got is None) if reason is None else (reason in got), got


def test_numpy_weights_take_the_eager_path():
    params = {"wte.weight": np.zeros((3, 8), np.float32)}
    assert "NumPy" in fast.unsupported_reason(params, TINY, kv_cache=True)


# -- lab.py's new options -------------------------------------------------------------------------


def lab(*args):
    return subprocess.run([sys.executable, str(ROOT / "lab.py"), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["--profile-step"], "--profile-step times the fast decode step: it needs --kv-cache"),
    (["--profile-step", "--kv-cache", "--no-graph"], "it needs --kv-cache and no --no-graph"),
    (["--profile-step", "--kv-cache", "--device", "cpu"], "--profile-step needs the GPU"),
])
def test_lab_rejects_what_the_fast_path_cannot_do(args, message):
    r = lab("--random-weights", "--tokens", 2, *args, *([] if "--device" in args else ["--device", "cpu"]))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lab.py: error: ") and message in lines[0], r.stderr


def test_lab_on_the_cpu_reports_the_eager_engine_and_phases(tmp_path):
    import json

    out = tmp_path / "run.json"
    r = lab("--random-weights", "--size", "gpt2", "--tokens", 3, "--kv-cache", "--device", "cpu", "--json", out)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["engine"] == "eager" and s["decode_attention"] == "reference" and s["dtype"] == "float32"
    assert 0 < s["time_to_first_token_seconds"] < s["seconds"] and s["decode_tokens_per_second"] > 0
    assert s["profile_step"] is None and "weight_bytes_per_token" not in s  # bandwidth: GPU runs only
    assert "first token" in r.stdout and "decode" in r.stdout


H100_SMEM = 232_448  # MaxSharedMemoryPerBlockOptin on H100 and H200


@pytest.mark.parametrize("dtype,splits,slots", [("float32", 8, 2), ("bfloat16", 6, 3)])
def test_persistent_step_plan_for_gpt2_small_on_132_sms(dtype, splits, slots):
    """STEP_SPLITS key splits per head; a slot holds the largest item, here stage B's: a split's keys and
    values (ceil(1024 / splits) rows of each) and its rows of W_proj[h], rounded up to 128 bytes; as
    many slots as fit; as many rows of wte a chunk as fit a slot with their folds; as many rows kept in
    the shared memory left over (with LN_f's weight and their folds) as fit."""
    assert fast.STEP_SPLITS[dtype] == splits
    plan = fast.step_plan(gpt2.SIZES["gpt2"], dtype, 132, 1024, H100_SMEM)
    item = 2 if dtype == "bfloat16" else 4
    cap = -(-1024 // splits)
    assert plan.slot_bytes == -(-(2 * cap + -(-768 // splits)) * 64 * item // 128) * 128
    assert plan.slot_bytes >= 24 * 768 * item + 4 * 768 + 8 * (24 + 2)  # c_fc's 24 rows with LN_2's weight and folds
    assert (plan.blocks, plan.splits, plan.slots) == (132, splits, slots)
    assert plan.lm_rows == (plan.slot_bytes - 16) // (768 * item + 8)
    table = 12 * 8 * len(fast.LAYER_POINTERS)
    kept = plan.lm_keep * 768 * item + 4 * 768 + 8 * (plan.lm_keep + 2)
    assert plan.smem == 128 + slots * plan.slot_bytes + 4 * (3072 + 768) + table + kept
    assert plan.smem + fast.STEP_STATIC_SMEM <= H100_SMEM < plan.smem + fast.STEP_STATIC_SMEM + 768 * item + 8
    assert 0 < plan.lm_keep < -(-50257 // 132)  # every block still streams a chunk


def test_layernorm_fold_gives_the_layernorm_then_the_rows():
    """decode_step.cu's fold: r (W (ln_w x) - mean * fold[:, 0]) + fold[:, 1] is LN(x) W^T + b, for an x
    with an offset mean; and the fold is what the formula says, row by row."""
    rng = np.random.default_rng()
    N, K = 40, 96
    W, bias = rng.standard_normal((N, K)), rng.standard_normal(N)
    ln_w, ln_b = 1 + 0.1 * rng.standard_normal(K), 0.1 * rng.standard_normal(K)
    x = 3 + rng.standard_normal(K)
    fold = fast.layernorm_fold(np, W, bias, ln_w, ln_b)
    assert fold.shape == (N, 2) and fold.dtype == np.float32
    np.testing.assert_allclose(fold[:, 0], W @ ln_w, rtol=1e-6)
    np.testing.assert_allclose(fold[:, 1], bias + W @ ln_b, rtol=1e-5, atol=1e-6)
    mean, r = x.mean(), 1 / np.sqrt(x.var() + 1e-5)
    want = ((x - mean) * r * ln_w + ln_b) @ W.T + bias
    got = r * (W @ (ln_w * x) - mean * fold[:, 0].astype(np.float64)) + fold[:, 1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_persistent_step_plan_takes_more_splits_where_fewer_do_not_fit():
    """8 float32 splits need two 90,112-byte slots (beside them LN_f's weight for stage E, 4 * 768 + 16
    bytes); with less shared memory 9 splits (80,384) still fit, and so on up to one split a block; past
    that the shares are split into items (3 slots, else 2), down to one row of mlp.c_proj an item
    (12,324 bytes with its biases); past that, why not."""
    fixed = 128 + 4 * (3072 + 768) + 12 * 8 * len(fast.LAYER_POINTERS) + fast.STEP_STATIC_SMEM + 4 * 768 + 16
    whole = fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 1024, fixed + 2 * 90_112)
    assert (whole.splits, whole.stage_items) == (8, (1, 1, 1, 1))
    assert fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 1024, fixed + 2 * 90_112 - 1).splits == 9
    assert fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 97, H100_SMEM).splits == 8  # short: as many
    split = fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 1024, fixed + 2 * 77_056 - 1)  # 11 splits: c_fc's item
    assert (split.splits, split.slots) == (8, 3) and min(split.stage_items) > 1, split
    tight = fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 1024, fixed + 2 * 12_416)
    assert (tight.slots, tight.slot_bytes, tight.item_rows[3]) == (2, 12_416, 1), tight
    why = fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, 1024, fixed + 2 * 12_416 - 1)
    assert isinstance(why, str) and "needs two slots of 12416 bytes (one row of 3072 weights" in why


@pytest.mark.parametrize("config,sms,smem,reason", [
    ("gpt2-xl", 132, 80_000, "needs two slots of 25728 bytes (one row of 6400 weights"),  # mlp.c_proj's row
    ("tiny", 132, H100_SMEM, "head size 16"),
    ("gpt2", 8, H100_SMEM, "12 heads on 8 SMs"),
    ("gpt2", 132, 40_000, "needs two slots of"),
    ("gpt2-xl", 24, H100_SMEM, "25 heads on 24 SMs"),
])
def test_persistent_step_plan_says_why_not(config, sms, smem, reason):
    why = fast.step_plan(MODELS[config], "float32", sms, 1024, smem)
    assert isinstance(why, str) and reason in why


def test_layer_table_matches_decode_step_struct():
    """PersistentStep._lay_out writes LAYER_POINTERS in order; decode_step.cu reads struct Layer."""
    text = fused.path_of("decode_step").read_text()
    body = text[text.index("struct Layer {"):text.index("};", text.index("struct Layer {"))]
    fields = re.findall(r"\*\s*(\w+)", body)
    assert len(fields) == len(fast.LAYER_POINTERS) == 12
    expected = ["w_attn", "w_proj", "w_fc", "w_mlp", "fold_attn", "b_proj", "fold_fc", "b_mlp", "ln1_w", "ln2_w",
                "k_cache", "v_cache"]
    assert fields == expected
    assert [n.split(".")[-2] + "." + n.split(".")[-1] if "." in n else n for n in fast.LAYER_POINTERS][:4] == [
        "c_attn.weight", "c_proj.weight", "c_fc.weight", "c_proj.weight"]
    assert "decode_step" in fast.kernel_expressions(gpt2.SIZES["gpt2"], "float32")
    assert "decode_step" not in fast.kernel_expressions(TINY, "float32")  # head size 16: the graphs only


@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_decode_step_sums_the_heads_terms_per_block_where_every_block_would_wait_longest(dtype):
    """step_reduce_heads: proj_input's round trips through L2 one after another, C / 4 columns over the
    compute threads times groups of up to 10 heads (12 where NH <= 12): 1 at GPT-2 small, 2 at medium
    and large, 6 at xl, which alone takes reduce_heads. Both forms compile without spills at every size,
    with the size's switches (step_options) as the engine compiles them."""
    rounds = {name: fast.step_proj_rounds(gpt2.SIZES[name]) for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
    assert rounds == {"gpt2": 1, "gpt2-medium": 2, "gpt2-large": 2, "gpt2-xl": 6}
    assert [fast.step_reduce_heads(gpt2.SIZES[name]) for name in rounds] == [False, False, False, True]
    for name in rounds:
        for reduce in (False, True):
            file, expr = fast.kernel_expressions(gpt2.SIZES[name], dtype, reduce_heads=reduce)["decode_step"]
            assert expr.endswith(f"{'true' if reduce else 'false'}>")
            options = fast.step_options(gpt2.SIZES[name], dtype)
            r = fused.compile_report(file, expr, "sm_90", options)
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0 and r.registers <= 168, (name, r)


def test_decode_step_switches_by_size():
    """step_options: STEP_SWITCHES' defines for the GPT-2 size and dtype, none for GPT-2 small (the file's
    defaults) or a model of no measured size; with_options lets a variant's define replace the plan's."""
    from gpt2.fast.plan import STEP_SWITCHES, with_options

    assert fast.step_options(gpt2.SIZES["gpt2"], "bfloat16") == ()
    assert fast.step_options(gpt2.SIZES["gpt2-xl"], "float32") == (
        "-DDELAY_MID_STAGE=0", "-DDELAY_EMPTY=0", "-DISSUE_DELAY_NS=1200")
    assert fast.step_options(gpt2.SIZES["gpt2-large"], "bfloat16") == ("-DDELAY_MID_STAGE=0", "-DPROJ_GROUP=20")
    assert fast.step_options(dataclasses.replace(gpt2.SIZES["gpt2-xl"], n_layer=12), "float32") == ()
    sized = {(c.n_layer, c.n_embd) for name, c in gpt2.SIZES.items() if name != "gpt2"}
    assert {key[:2] for key in STEP_SWITCHES} == sized and len(STEP_SWITCHES) == 2 * len(sized)
    source = (Path(fused.__file__).parent / "fused" / "decode_step.cu").read_text()
    for switches in STEP_SWITCHES.values():  # every switch is one the kernel declares
        for macro in switches:
            assert f"#ifndef {macro}" in source, macro
    base = ("-DDELAY_MID_STAGE=0", "-DISSUE_DELAY_NS=400")
    assert with_options(base, ("-DISSUE_DELAY_NS=800", "-lineinfo")) == (
        "-DDELAY_MID_STAGE=0", "-DISSUE_DELAY_NS=800", "-lineinfo")
    assert with_options(base, ()) == base
    assert with_options((), ("-DTRACE_MARKS=6",)) == ("-DTRACE_MARKS=6",)


def test_engine_options_are_on_where_they_work():
    """pdl and persistent: False keeps the option off without checking, None takes what the check
    allows, True insists and names the reason when it cannot."""
    def never():
        raise AssertionError("checked although asked off")

    assert decide(False, never, "x") == Switch.off("asked", ASKED) and str(decide(False, never, "x")) == "off (asked)"
    assert decide(None, lambda: ON, "x") == ON and str(ON) == "on"
    off = Switch.off("needs compute capability 9.0")
    assert decide(None, lambda: off, "x") == off and str(off) == "off (needs compute capability 9.0)" and not off
    assert decide(True, lambda: ON, "x") == ON
    with pytest.raises(RuntimeError, match="the persistent decode step does not work here: no cooperative launch"):
        decide(True, lambda: Switch.off("no cooperative launch"), "the persistent decode step")
