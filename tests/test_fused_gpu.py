"""The fused kernels against the CuPy code they replace, and the fast engine against the eager model.

Kernels: fresh random inputs every run, awkward sizes (97 rows, 4097 outputs, widths of 32 and 1600),
outputs poisoned with NaN (cache positions past the one a step may read too), float32 and bfloat16
weights. A kernel's largest error against float64 may be at most FACTOR times that of the plain
float32 CuPy code on the same (rounded) inputs, floored at float32 epsilon times the largest
reference value; copies and additions done in the same order must be bit-exact.

Engine (GPT-2 small, random weights): graph replay and eager launches of the same kernels give the
same tokens bit for bit; float32 greedy tokens equal the eager model's (gpt2/model.py) for 64 tokens,
in both modes. bfloat16 (matrices and KV cache in bfloat16) is judged by teacher forcing over the
eager float32 run's sequence, as tests/test_gpt2_dtype.py judges the eager bfloat16 model: the
argmax agrees at every position whose float32 top-two margin is at least MARGIN and at 90% of all.
"""

import json
import math

import numpy as np
import pytest

import gpt2
import gpt2.fast as fast
import kernels
from gpt2 import generate, reference_attend
from gpt2.load import random_weights
from gpt2.model import cast_params
from kernels import fused
from tests.tiers import tiered

pytestmark = pytest.mark.gpu

EPS32 = 2.0**-23
FACTOR = 8
MARGIN = 0.02  # bfloat16 moves GPT-2 small's logits by about 0.01 (tests/test_gpt2_dtype.py)
PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]  # "Hello, I'm a language model,"
NULL = np.uint64(0)


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def check_close(cp, got, ref64, plain32, what, factor=FACTOR):
    """got within factor x max(plain float32 error, eps32 x max|ref|) of the float64 reference."""
    got64 = got.astype(cp.float64)
    nan = int(cp.isnan(got64).sum())
    assert nan == 0, f"{what}: {nan} of {got.size} outputs NaN (unwritten, or a poisoned input read)"
    err = cp.abs(got64 - ref64)
    plain = float(cp.abs(plain32.astype(cp.float64) - ref64).max())
    bound = factor * max(plain, EPS32 * float(cp.abs(ref64).max()))
    worst = float(err.max())
    assert worst <= bound, (f"{what}: max error {worst:.3e} at flat index {int(err.argmax())} (mean "
                            f"{float(err.mean()):.3e}) > bound {bound:.3e} (plain float32: {plain:.3e})")
    return bound


def weights(cp, rng, shape, dtype, scale=0.05):
    """(array the kernel reads, its values in float32): float32, or bfloat16 bits and their values."""
    w32 = rng.standard_normal(shape, dtype=cp.float32) * np.float32(scale)
    if dtype == "bfloat16":
        return fast.bf16_bits(cp, w32), fast.round_to_bf16(cp, w32)
    return w32, w32


def ln64(cp, x, w, b, eps):
    x = x.astype(cp.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / cp.sqrt(var + eps) * w.astype(cp.float64) + b.astype(cp.float64)


def ln32(x, w, b, eps):
    return gpt2.model.layer_norm(x, {"n.weight": w, "n.bias": b}, "n", eps)


def gelu64(cp, x):
    return 0.5 * x * (1.0 + cp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


# -- gemv ------------------------------------------------------------------------------------------

GEMV_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (256, 1000), (1600, 97), (32, 5), (1024, 4097)]
GEMV_VARIANTS = [(True, fast.EPI_BIAS), (False, fast.EPI_RESIDUAL), (True, fast.EPI_GELU), (False, fast.EPI_BIAS)]


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("ln,epi", GEMV_VARIANTS, ids=["ln+bias", "bias+residual", "ln+bias+gelu", "bias"])
@pytest.mark.parametrize("K,N", tiered(GEMV_SHAPES, quick=[(1600, 97), (1024, 4097)]), ids=[f"K{k}-N{n}" for k, n in GEMV_SHAPES])
def test_gemv_matches_layernorm_linear_and_epilogue(cp, K, N, ln, epi, dtype):
    rng = cp.random.default_rng()
    W, W32 = weights(cp, rng, (N, K), dtype)  # (out, in): the engine's transposed copy
    x = rng.standard_normal(K, dtype=cp.float32) * np.float32(2.0) + np.float32(0.5)
    bias = rng.standard_normal(N, dtype=cp.float32) * np.float32(0.1)
    ln_w = np.float32(1.0) + rng.standard_normal(K, dtype=cp.float32) * np.float32(0.1)
    ln_b = rng.standard_normal(K, dtype=cp.float32) * np.float32(0.1)
    eps = np.float32(1e-5)
    residual = epi == fast.EPI_RESIDUAL
    out0 = rng.standard_normal(N, dtype=cp.float32) if residual else cp.full(N, cp.nan, dtype=cp.float32)
    out = out0.copy()

    item = 2 if dtype == "bfloat16" else 4
    warps, rows = fast.gemv_shape(N, K, item)
    wt = "unsigned short" if dtype == "bfloat16" else "float"
    fn = fused.function("gemv", f"gemv<{wt}, {K}, {warps}, {rows}, {'true' if ln else 'false'}, {epi}>")
    fn((-(-N // (warps * rows)),), (warps * 32,),
       (W, bias, x, ln_w if ln else NULL, ln_b if ln else NULL, eps, out, np.int32(N), NULL, np.uint64(0)))

    xin64 = ln64(cp, x, ln_w, ln_b, float(eps)) if ln else x.astype(cp.float64)
    ref = W32.astype(cp.float64) @ xin64 + bias
    xin32 = ln32(x, ln_w, ln_b, float(eps)) if ln else x
    plain = W32 @ xin32 + bias
    if epi == fast.EPI_GELU:
        ref, plain = gelu64(cp, ref), gpt2.model.gelu(plain)
    if residual:
        ref, plain = out0 + ref, out0 + plain
    check_close(cp, out, ref, plain, f"gemv {dtype} K={K} N={N} ln={ln} epi={epi} warps={warps} rows={rows}")


def test_gemv_prefetch_hint_changes_nothing(cp):
    """The L2 prefetch of another buffer is a hint: the result is bit-identical with and without it."""
    rng = cp.random.default_rng()
    K, N = 768, 2304
    W = rng.standard_normal((N, K), dtype=cp.float32)
    other = rng.standard_normal(3 << 20, dtype=cp.float32)
    x, bias = rng.standard_normal(K, dtype=cp.float32), rng.standard_normal(N, dtype=cp.float32)
    warps, rows = fast.gemv_shape(N, K, 4)
    fn = fused.function("gemv", f"gemv<float, {K}, {warps}, {rows}, false, 0>")
    outs = []
    for pf, nbytes in ((NULL, 0), (np.uint64(other.data.ptr), other.nbytes)):
        out = cp.full(N, cp.nan, dtype=cp.float32)
        fn((-(-N // (warps * rows)),), (warps * 32,), (W, bias, x, NULL, NULL, np.float32(1e-5), out, np.int32(N),
                                                       pf, np.uint64(nbytes)))
        outs.append(out)
    assert bool((outs[0] == outs[1]).all())


# -- lm_head + argmax ------------------------------------------------------------------------------


def lm_head(V, C, dtype):
    """The engine's lm_head_argmax for (V, C) in dtype: (kernel, threads, the engine's grid)."""
    warps, rows = fast.lm_head_shape(gpt2.GPT2Config(n_layer=1, n_head=1, n_embd=C, vocab_size=V), dtype)
    wt = "unsigned short" if dtype == "bfloat16" else "float"
    fn = fused.function("lm_head_argmax", f"lm_head_argmax<{wt}, {C}, {warps}, {rows}>")
    return fn, warps * 32, fast.lm_head_blocks(fn, warps, rows, V, kernels.device_limits().sm_count)


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["decode", "eager-last-row"])
@pytest.mark.parametrize("V,C", tiered([(50257, 768), (4097, 1600), (1000, 32), (97, 256)], quick=[(50257, 768), (97, 256)]))
def test_lm_head_argmax_picks_the_largest_logit_and_advances_the_state(cp, V, C, with_residual, dtype):
    """Against float64, on the engine's grid and on others (one block, a few, more warps than row
    groups): every grid gives the same logits bit for bit and the same token."""
    rng = cp.random.default_rng()
    wte, wte32 = weights(cp, rng, (V, C), dtype, scale=0.1)
    x = rng.standard_normal(C, dtype=cp.float32)
    y = rng.standard_normal(C, dtype=cp.float32) if with_residual else None
    y_bias = rng.standard_normal(C, dtype=cp.float32) * np.float32(0.1) if with_residual else None
    ln_w = np.float32(1.0) + rng.standard_normal(C, dtype=cp.float32) * np.float32(0.1)
    ln_b = rng.standard_normal(C, dtype=cp.float32) * np.float32(0.1)
    eps = np.float32(1e-5)
    fn, threads, engine_blocks = lm_head(V, C, dtype)
    grids = [engine_blocks, 1, 7, -(-V // (threads // 32)) + 3, engine_blocks]  # one wave, 1, 7, more warps than rows, one wave
    pos = 37
    state = cp.asarray([5, pos], dtype=cp.int32)
    history = cp.full(pos + len(grids) + 1, -1, dtype=cp.int32)
    counter = cp.zeros(1, dtype=cp.uint32)
    block_max, block_arg = cp.full(max(grids), cp.nan, dtype=cp.float32), cp.full(max(grids), -1, dtype=cp.int32)

    xin = x + (y + y_bias) if with_residual else x
    ref = wte32.astype(cp.float64) @ ln64(cp, xin, ln_w, ln_b, float(eps))
    plain = wte32 @ ln32(xin, ln_w, ln_b, float(eps))
    first = None
    for step, blocks in enumerate(grids):
        logits = cp.full(V, cp.nan, dtype=cp.float32)
        fn((blocks,), (threads,),
           (wte, x, y if with_residual else NULL, y_bias if with_residual else NULL, ln_w, ln_b, eps, np.int32(V),
            logits, block_max, block_arg, counter, state, history, NULL, np.uint64(0)))
        what = f"lm_head {dtype} V={V} C={C} grid {blocks} run {step}"
        bound = check_close(cp, logits, ref, plain, f"{what}: logits")
        token = int(state[0])
        top = cp.sort(ref)[-2:]
        assert float(ref[token]) >= float(top[1]) - 2 * bound, f"{what}: token {token} is not the largest logit"
        if float(top[1] - top[0]) > 2 * bound:  # a clear maximum: exactly the argmax
            assert token == int(ref.argmax()), what
        assert token == int(logits.argmax()), f"{what}: not the first largest of its own logits"
        if first is None:
            first = (logits, token)
        assert bool((logits == first[0]).all()) and token == first[1], f"{what}: differs from grid {grids[0]}"
        assert int(state[1]) == pos + 1 + step and int(history[pos + 1 + step]) == token, what
        assert int(counter[0]) == 0, f"{what}: the last block must put the ticket counter back to 0"
    assert cp.asnumpy(history[:pos + 1]).tolist() == [-1] * (pos + 1), "history written outside pos + 1"


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("grid", ["engine", 1, 2, 7])
def test_lm_head_argmax_ties_go_to_the_first_index(cp, dtype, grid):
    """Equal largest logits in one row group, in one warp's later groups, in other warps and blocks."""
    V, C = 5000, 64
    wte = cp.zeros((V, C), dtype=cp.float32)
    wte[[4321, 18, 17, 2999, 81, 4999, 17 + 64 * 8], :] = 1.0  # 1.0 is exact in bfloat16 too
    wte = fast.bf16_bits(cp, wte) if dtype == "bfloat16" else wte
    fn, threads, engine_blocks = lm_head(V, C, dtype)
    blocks = engine_blocks if grid == "engine" else grid
    state = cp.asarray([0, 3], dtype=cp.int32)
    logits = cp.full(V, cp.nan, dtype=cp.float32)
    fn((blocks,), (threads,),
       (wte, cp.arange(C, dtype=cp.float32), NULL, NULL, cp.ones(C, dtype=cp.float32), cp.ones(C, dtype=cp.float32),
        np.float32(1e-5), np.int32(V), logits, cp.zeros(blocks, dtype=cp.float32), cp.zeros(blocks, dtype=cp.int32),
        cp.zeros(1, dtype=cp.uint32), state, cp.zeros(8, dtype=cp.int32), NULL, np.uint64(0)))
    assert int(logits.argmax()) == 17 and float(logits[17]) > float(logits[16])
    assert int(state[0]) == 17


# -- decode attention ------------------------------------------------------------------------------


def nan_bits(cp, shape, dtype):
    if dtype == "bfloat16":
        return cp.full(shape, 0x7FC0, dtype=cp.uint16)
    return cp.full(shape, cp.nan, dtype=cp.float32)


@pytest.mark.parametrize("kv", fast.DTYPES)
@pytest.mark.parametrize("pos", tiered([0, 1, 15, 16, 97, 519, 1023], quick=[0, 97, 1023]))
@pytest.mark.parametrize("NH,HS", tiered([(12, 64), (3, 32), (2, 16), (4, 128)], quick=[(12, 64), (2, 16)]))
@pytest.mark.parametrize("splits", tiered(["engine", 1, 5], quick=["engine", 5]))
@pytest.mark.parametrize("staged", [1 << 30, 3], ids=["staged", "3-staged"])
def test_decode_attention_matches_softmax_attention_over_the_cache(cp, NH, HS, pos, kv, splits, staged):
    rng = cp.random.default_rng()
    max_len, C = 1024, NH * HS
    S = max(1, min(kernels.device_limits().sm_count // NH, -(-max_len // 16))) if splits == "engine" else splits
    k_cache, v_cache = nan_bits(cp, (NH, max_len, HS), kv), nan_bits(cp, (NH, max_len, HS), kv)  # past pos: NaN
    past_k, past_k32 = weights(cp, rng, (NH, pos, HS), kv, scale=1.0)
    past_v, past_v32 = weights(cp, rng, (NH, pos, HS), kv, scale=1.0)
    k_cache[:, :pos], v_cache[:, :pos] = past_k, past_v
    qkv = rng.standard_normal(3 * C, dtype=cp.float32)
    state = cp.asarray([0, pos], dtype=cp.int32)
    partial = cp.full((NH, S, HS + 2), cp.nan, dtype=cp.float32)
    counters = cp.zeros(NH, dtype=cp.uint32)
    warps = max(4, HS // 32)
    kt = "unsigned short" if kv == "bfloat16" else "float"
    fn = fused.function("decode_attention", f"decode_attention<{kt}, {HS}, {warps}>")
    rows, smem = fast.attention_staging(max_len, S, HS, k_cache.itemsize)
    rows = min(rows, staged)  # also fewer rows staged than the chunk: the rest read from the cache
    fn.max_dynamic_shared_size_bytes = smem

    def run():
        y = cp.full(C, cp.nan, dtype=cp.float32)
        fn((S, NH), (warps * 32,), (qkv, k_cache, v_cache, state, np.int32(NH), np.int32(max_len), np.int32(rows),
                                    np.float32(1.0 / math.sqrt(HS)), partial, counters, y, NULL, np.uint64(0)),
           shared_mem=smem)
        return y

    y = run()
    q = qkv[:C].reshape(NH, 1, HS)
    new_k, new_v = qkv[C:2 * C].reshape(NH, 1, HS), qkv[2 * C:].reshape(NH, 1, HS)
    if kv == "bfloat16":  # the new key and value as the cache will hold them
        new_k, new_v = fast.round_to_bf16(cp, new_k), fast.round_to_bf16(cp, new_v)
    K = cp.concatenate([past_k32, new_k], axis=1)  # (NH, pos + 1, HS)
    V = cp.concatenate([past_v32, new_v], axis=1)

    def attention(q, K, V):
        s = (q @ K.transpose(0, 2, 1)) / math.sqrt(HS)
        p = cp.exp(s - s.max(axis=-1, keepdims=True))
        return ((p / p.sum(axis=-1, keepdims=True)) @ V).reshape(C)

    ref = attention(*(a.astype(cp.float64) for a in (q, K, V)))
    check_close(cp, y, ref, attention(q, K, V), f"decode attention kv={kv} NH={NH} HS={HS} pos={pos} S={S}")
    stored_k, stored_v = k_cache[:, pos], v_cache[:, pos]
    if kv == "bfloat16":
        assert bool((stored_k == fast.bf16_bits(cp, qkv[C:2 * C].reshape(NH, HS))).all())
        assert bool((stored_v == fast.bf16_bits(cp, qkv[2 * C:].reshape(NH, HS))).all())
    else:
        assert bool((stored_k == qkv[C:2 * C].reshape(NH, HS)).all()) and bool((stored_v == qkv[2 * C:].reshape(NH, HS)).all())
    assert int(counters.sum()) == 0, "the last block of each head must put its counter back to 0"
    assert bool((run() == y).all()), "a second run (counters reused, pos now cached) must give the same bits"


# -- the eager path's kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", fast.DTYPES)
@pytest.mark.parametrize("T,C,from_state", [(1, 768, True), (5, 768, False), (64, 32, False), (3, 1600, True)])
def test_embed_adds_token_and_position_rows(cp, T, C, from_state, dtype):
    rng = cp.random.default_rng()
    V, P = 1000, 1024
    wte, wte32 = weights(cp, rng, (V, C), dtype)
    wpe, wpe32 = weights(cp, rng, (P, C), dtype)
    ids = cp.asarray(rng.integers(0, V, T), dtype=cp.int32)
    p0 = 17 if from_state else 0
    pos0 = cp.asarray([p0], dtype=cp.int32) if from_state else NULL
    x = cp.full((T, C), cp.nan, dtype=cp.float32)
    wt = "unsigned short" if dtype == "bfloat16" else "float"
    fused.function("embed", f"embed<{wt}>")((T,), (256,), (wte, wpe, ids, pos0, np.int32(C), x, NULL, np.uint64(0)))
    expected = wte32[ids] + wpe32[p0:p0 + T]  # gpt2/model.py's sum, in float32
    assert bool((x == expected).all()), f"embed {dtype}: {int((x != expected).sum())} elements differ"


GEMM_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (1024, 4096), (1600, 6400)]  # (K, N)
GEMM_EPILOGUES = {"none": fast.GEMM_NONE, "bias": fast.GEMM_BIAS, "bias+gelu": fast.GEMM_BIAS_GELU}


@pytest.fixture(scope="module")
def gemm_setup(cp):
    """gemm.cu's three instantiations, the split-K buffers; skips where TF32 wgmma does not run."""
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("gemm.cu needs sm_90a (TF32 wgmma)")
    fns = {}
    for key, (file, expr) in fast.gemm_expressions().items():
        fns[int(key.split("_")[1])] = fn = fused.function(file, expr, options=fast.GEMM_OPTIONS)
        fn.max_dynamic_shared_size_bytes = fast.GEMM_SMEM
    sms = kernels.device_limits().sm_count
    return fns, cp.zeros(2 * sms * 64 * 64, dtype=cp.float32), cp.zeros(sms, dtype=cp.uint32), sms


def gemm_case(cp, M, K, N, epi):
    rng = cp.random.default_rng()
    a = rng.standard_normal((M, K), dtype=cp.float32)
    w = rng.standard_normal((K, N), dtype=cp.float32) * np.float32(0.02)
    b = rng.standard_normal(N, dtype=cp.float32) * np.float32(0.1)
    ref64 = a.astype(cp.float64) @ w.astype(cp.float64)
    plain32 = a @ w  # cuBLAS SGEMM (CuPy's float32 matmul, no TF32)
    if epi != fast.GEMM_NONE:
        ref64, plain32 = ref64 + b, plain32 + b
    if epi == fast.GEMM_BIAS_GELU:
        ref64, plain32 = gelu64(cp, ref64), gpt2.model.gelu(plain32)
    return a, w, b, ref64, plain32


@pytest.mark.parametrize("epi", GEMM_EPILOGUES.values(), ids=GEMM_EPILOGUES.keys())
@pytest.mark.parametrize("M", tiered([1, 17, 97, 257, 1000, 1024], quick=[1, 97, 257]))
@pytest.mark.parametrize("K,N", tiered(GEMM_SHAPES, quick=[(768, 2304), (1600, 6400)]), ids=[f"K{k}-N{n}" for k, n in GEMM_SHAPES])
def test_gemm_matches_the_float64_product_and_epilogue(cp, gemm_setup, K, N, M, epi):
    """3xTF32 on wgmma at float32's accuracy (the bound of a plain float32 product, cuBLAS's), every
    output written (rows past M are not: the output is exactly (M, N)), the same bits launch after
    launch, and the split-K tickets back at zero."""
    fns, partials, tickets, sms = gemm_setup
    a, w, b, ref64, plain32 = gemm_case(cp, M, K, N, epi)
    out = cp.full((M + 1, N), cp.nan, dtype=cp.float32)  # one poisoned row past M must stay poisoned
    parts = fast.gemm_weight(cp, w)
    fast.gemm(fns[epi], a, parts, b, out[:M], partials, tickets, sms)
    check_close(cp, out[:M], ref64, plain32, f"gemm {M}x{K} @ {K}x{N}, splits {fast.gemm_splits(M, N, K, sms)}")
    assert bool(cp.isnan(out[M]).all()), "gemm wrote past row M"
    assert int(tickets.sum()) == 0, "the split-K tickets must be left at zero"
    again = cp.full((M, N), cp.nan, dtype=cp.float32)
    fast.gemm(fns[epi], a, parts, b, again, partials, tickets, sms)
    assert bool((again == out[:M]).all()), "two launches on the same inputs must give the same bits"


@pytest.mark.parametrize("splits", [1, 2, 5, 11, 22])
def test_gemm_split_k_sums_every_split(cp, gemm_setup, splits):
    fns, partials, tickets, sms = gemm_setup
    M, K, N = 17, 3072, 768  # 12 output tiles
    a, w, b, ref64, plain32 = gemm_case(cp, M, K, N, fast.GEMM_BIAS)
    out = cp.full((M, N), cp.nan, dtype=cp.float32)
    parts = fast.gemm_weight(cp, w)
    fast.gemm(fns[fast.GEMM_BIAS], a, parts, b, out, partials, tickets, sms, splits=splits)
    check_close(cp, out, ref64, plain32, f"gemm with {splits} splits of K")
    assert int(tickets.sum()) == 0
    with pytest.raises(ValueError, match="partial sums"):  # 12 tiles x 48 splits: more than 2 x SMs of them
        fast.gemm(fns[fast.GEMM_BIAS], a, parts, b, out, partials, tickets, 132, splits=48)


def test_attend_prepare_reads_new_contents_of_the_same_arrays(cp):
    """kernels.Attend.prepare: run() sees what the arrays hold when it runs, for a strided rung (its
    views as they are) and for one that needs contiguous copies (made anew by every run)."""
    rng = cp.random.default_rng()
    qkv = rng.standard_normal((1, 97, 3, 4, 64), dtype=cp.float32)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    for name in ("v02", "v13"):
        attend = kernels.Attend(name)
        run = attend.prepare(q, k, v)
        first = run().copy()
        qkv[...] = rng.standard_normal(qkv.shape, dtype=cp.float32)
        second = run()
        assert bool((second == attend(q, k, v)).all()), f"{name}: run() must read the new q, k, v"
        assert not bool((second == first).all())


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(cp):
    return random_weights("gpt2", seed=0, xp=cp)


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def margins(cp, logits):
    top2 = cp.sort(cp.stack(logits).astype(cp.float64), axis=-1)[:, -2:]
    return cp.asnumpy(top2[:, 1] - top2[:, 0])


@pytest.mark.parametrize("attention", ["reference", "v13"])
def test_graph_replay_equals_eager_launches_and_the_eager_model(cp, small, attention):
    attend = reference_attend if attention == "reference" else (
        lambda q, k, v: kernels.attention(q, k, v, kernel="v13", causal=True))
    engine = fast.engine_for(small.params, small.config, persistent=False)
    graphed = engine.generate(PROMPT, 64, attend=attend, kv_cache=True, graph=True)
    launched = engine.generate(PROMPT, 64, attend=attend, kv_cache=True, graph=False)
    assert graphed.tokens == launched.tokens, "the same kernels, replayed or launched, must give the same tokens"
    assert cp.asnumpy(engine.history[len(PROMPT):len(PROMPT) + 64]).tolist() == graphed.tokens
    assert cp.asnumpy(engine.state).tolist() == [graphed.tokens[-1], len(PROMPT) + 63]
    eager = generate(small.params, small.config, PROMPT, 64, attend=attend, kv_cache=True, fast=False,
                     record_logits=True)
    first = first_difference(graphed.tokens, eager.tokens)
    assert first is None, (f"fast and eager tokens part at new token {first}; the eager top-two margin there is "
                           f"{margins(cp, eager.logits)[first]:.2e} (a near tie if below ~1e-4)")


@pytest.mark.parametrize("products", ["3xtf32", "cublas"])
@pytest.mark.parametrize("attention", ["reference", "v13"])
def test_no_cache_fast_path_equals_the_eager_model(cp, small, attention, products):
    if products == "3xtf32" and int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("gemm.cu needs sm_90a")
    attend = reference_attend if attention == "reference" else kernels.Attend("v13")
    engine = fast.engine_for(small.params, small.config, products=products, persistent=False)
    fast_run = engine.generate(PROMPT, 48, attend=attend, kv_cache=False)
    eager = generate(small.params, small.config, PROMPT, 48, attend=attend, kv_cache=False, fast=False,
                     record_logits=True)
    first = first_difference(fast_run.tokens, eager.tokens)
    assert first is None, f"no-cache: tokens part at {first}; eager margin there {margins(cp, eager.logits)[first]:.2e}"


def teacher_forced(cp, engine, prompt, forced):
    """The engine's logits for the prompt's next token, then for each next token after forcing the
    previous one to `forced` (one graph replay per step). Each row is copied on the engine's stream:
    it does not wait for the legacy default stream (non_blocking), so a copy made there could run
    after the next step has overwritten the logits."""
    rows = []
    engine.start(prompt, reference_attend, kv_cache=True)
    with engine.stream:
        rows.append(engine.logits.copy())
        for token in forced[:-1]:
            engine.state[0:1].set(np.asarray([token], dtype=np.int32), stream=engine.stream)
            engine.decode(1)
            rows.append(engine.logits.copy())
    engine.stream.synchronize()
    return rows


@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_teacher_forced_logits_follow_the_eager_model(cp, small, dtype):
    """Per step, the engine's logits against the eager float32 model's over the same sequence: float32
    within 1e-4 relative (summation order only), bfloat16 within 2e-2 and the argmax criterion."""
    n = 48
    eager = generate(small.params, small.config, PROMPT, n, attend=reference_attend, kv_cache=True, fast=False,
                     record_logits=True)
    engine = fast.Engine(small.params, small.config, dtype=dtype, keep_logits=True)
    got = teacher_forced(cp, engine, PROMPT, eager.tokens)
    rel = [float(cp.linalg.norm(g - e) / cp.linalg.norm(e)) for g, e in zip(got, eager.logits, strict=True)]
    agree = np.array([int(g.argmax()) == t for g, t in zip(got, eager.tokens, strict=True)])
    clear = margins(cp, eager.logits) >= (1e-4 if dtype == "float32" else MARGIN)
    limit = 1e-4 if dtype == "float32" else 2e-2
    assert max(rel) <= limit, f"{dtype}: relative logit error per step {np.round(rel, 6).tolist()} (limit {limit})"
    assert agree[clear].all(), f"{dtype}: argmax differs at clear steps {np.flatnonzero(clear & ~agree).tolist()}"
    assert agree.mean() >= 0.9, f"{dtype}: argmax agrees at {agree.mean():.0%} of steps"


def test_bfloat16_weights_from_cast_params_take_the_fast_path(cp, small):
    """lab.py --dtype bfloat16 loads every parameter in bfloat16; generate() then runs the bfloat16
    engine on views of them (decode_layout's layout), whose first token comes from a prefill whose
    products take bfloat16 operands, as the eager bfloat16 model's do: the same first token wherever
    that model's top two logits are MARGIN apart (the rest of the two passes differ in what they
    round to bfloat16: the products' outputs, q, k and v)."""
    params = fast.decode_layout(cast_params(small.params, "bfloat16"))
    assert fast.unsupported_reason(params, small.config, kv_cache=True) is None
    out = generate(params, small.config, PROMPT, 24, attend=reference_attend, kv_cache=True)
    engine = fast.engine_for(params, small.config)
    assert engine.dtype == "bfloat16" and engine.k_cache.dtype == cp.uint16 and len(out.tokens) == 24
    eager = generate(params, small.config, PROMPT, 1, attend=reference_attend, kv_cache=True, fast=False,
                     record_logits=True)
    if margins(cp, eager.logits)[0] >= MARGIN:
        assert out.tokens[0] == eager.tokens[0]


@pytest.mark.parametrize("name", ["v15", "v24"])
def test_prepared_casts_leave_the_bfloat16_prefill_and_tokens_as_they_were(cp, small, monkeypatch, name):
    """kernels.runtime.PREPARE_CASTS (the bfloat16 engine's float32 q, k, v cast into copies made once a
    pass, the rung prepared once): the 97-token prefill's logits, 64 greedy tokens after it, and the
    eager model's tokens (which calls the rung per layer, not prepared) the same bits as with it off."""
    from kernels import runtime

    engine = fast.Engine(small.params, small.config, dtype="bfloat16", keep_logits=True, persistent=False)
    attend = kernels.Attend(name, dtype="bfloat16")
    prompt = np.random.default_rng(97).integers(0, small.config.vocab_size, 97).tolist()
    runs = []
    for on in (False, True):
        monkeypatch.setattr(runtime, "PREPARE_CASTS", on)
        engine.start(prompt, attend, kv_cache=True)
        with engine.stream:  # the engine's stream does not wait for the legacy default one
            logits = engine.logits.copy()
        engine.stream.synchronize()
        tokens = engine.generate(prompt, 64, attend=attend, kv_cache=True).tokens
        eager = generate(small.params, small.config, PROMPT, 8, attend=attend, kv_cache=True, fast=False).tokens
        runs.append((logits, tokens, eager))
    (logits, tokens, eager), (cast_logits, cast_tokens, cast_eager) = runs
    assert bool(cp.isfinite(logits).all()), "the prefill wrote no logits"
    bad = int(cp.count_nonzero(cast_logits.view(cp.uint32) != logits.view(cp.uint32)))
    assert bad == 0, f"{name}: {bad} prefill logits differ with PREPARE_CASTS on"
    assert cast_tokens == tokens, f"{name}: tokens part at step {first_difference(cast_tokens, tokens)}"
    assert cast_eager == eager


def check_prefill_graphs(cp, monkeypatch, engine, attend, vocab_size: int, dtype: str) -> None:
    """lm.prefill_graph.PREFILL_GRAPHS on an engine (GPT-2's or Llama's): a bucket's first prompt runs
    eagerly over its 128 rows, its second is captured, every later one replays; the padded passes' logits
    the same bits whichever ran them, within float32's rounding of the unpadded prefill's (whose last
    layer runs on one row: other products), the same first token, and the decode after a replayed
    prefill (over cache positions the padding filled) the same greedy tokens as after the unpadded one:
    all 32 in float32, the first 8 in bfloat16 (whose logits move by more than a near-tie's margin
    between other products)."""
    from lm import prefill_graph

    rng = np.random.default_rng(117)
    prompts = [rng.integers(0, vocab_size, T).tolist() for T in (100, 117)]

    def prefill(prompt):
        engine.start(prompt, attend)
        with engine.stream:  # the engine's stream does not wait for the legacy default one
            logits = engine.logits.copy()
        engine.stream.synchronize()
        return logits

    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", False)
    plain = [prefill(p) for p in prompts]
    plain_tokens = [engine.generate(p, 32, attend=attend).tokens for p in prompts]
    monkeypatch.setattr(prefill_graph, "PREFILL_GRAPHS", True)
    monkeypatch.setattr(prefill_graph, "PREFILL_BUCKET", 128)  # more padding rows than the default's 8
    graphs = engine.prefill_graphs().graphs
    eager = prefill(prompts[0])  # the bucket's first prompt: eager, over 128 rows
    assert not graphs
    captured = prefill(prompts[0])  # its second: captured, then launched
    assert list(graphs) == [(128, attend)] and graphs[(128, attend)] is not None, "not captured"
    replayed = prefill(prompts[0])
    other = prefill(prompts[1])  # another length of the bucket: the same graph
    assert len(graphs) == 1
    for got, what in ((captured, "captured"), (replayed, "replayed")):
        bad = int(cp.count_nonzero(got.view(cp.uint32) != eager.view(cp.uint32)))
        assert bad == 0, f"{bad} logits of the {what} pass differ from the eager padded pass's"
    for got, want, T in ((replayed, plain[0], 100), (other, plain[1], 117)):
        assert bool(cp.isfinite(got).all())
        assert int(got.argmax()) == int(want.argmax()), f"T = {T}: another first token"
        tol = (1e-4 if dtype == "float32" else 2e-2) * float(cp.abs(want).max())
        assert float(cp.abs(got - want).max()) <= tol, f"T = {T}: padded logits off the unpadded prefill's"
    n = 32 if dtype == "float32" else 8
    for prompt, want in zip(prompts, plain_tokens, strict=True):
        tokens = engine.generate(prompt, 32, attend=attend).tokens  # its prefill replayed
        assert tokens[:n] == want[:n], f"tokens part at step {first_difference(tokens, want)}"


@pytest.mark.parametrize("dtype, name, persistent", [("float32", "v20", True), ("bfloat16", "v24", True),
                                                     ("bfloat16", "v24", False)])
def test_prefill_graphs_replay_the_eager_pass_and_keep_the_tokens(cp, small, monkeypatch, dtype, name, persistent):
    """check_prefill_graphs on GPT-2's whole-sequence pass, after it the persistent step or the graphs."""
    engine = fast.Engine(small.params, small.config, dtype=dtype, keep_logits=True, persistent=persistent)
    check_prefill_graphs(cp, monkeypatch, engine, kernels.Attend(name, dtype=dtype), small.config.vocab_size, dtype)


def test_windows_end_of_text_and_streaming(cp, small):
    engine = fast.engine_for(small.params, small.config)
    full = engine.generate(PROMPT, 64, attend=reference_attend, kv_cache=True).tokens
    assert engine.window == (fast.STEPS_PER_LAUNCH if engine.persistent else fast.STEPS_PER_GRAPH)
    w = engine.window
    for n in (1, w - 1, w, w + 1, w + 13):  # window edges
        assert engine.generate(PROMPT, n, attend=reference_attend, kv_cache=True).tokens == full[:n], n
    k = next(i for i in range(5, 64) if full[i] not in full[:i])
    seen = []
    out = engine.generate(PROMPT, 64, attend=reference_attend, kv_cache=True, eos_ids=(full[k],), on_token=seen.append)
    assert out.tokens == full[:k + 1] and out.stopped_at_eos and seen == out.tokens
    nocache = engine.generate(PROMPT, 11, attend=reference_attend, kv_cache=False).tokens
    j = next(i for i in range(2, 11) if nocache[i] not in nocache[:i])
    stopped = engine.generate(PROMPT, 11, attend=reference_attend, kv_cache=False, eos_ids=(nocache[j],))
    assert stopped.tokens == nocache[:j + 1] and stopped.stopped_at_eos


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_programmatic_dependent_launch_gives_the_plain_launches_tokens(cp, small, dtype):
    """On Hopper the graphs use PDL by default. Its tokens must equal plain launches' over hundreds of
    steps: with L1 loads of activations (before fresh()) they parted after a few dozen."""
    engine = fast.engine_for(small.params, small.config, dtype, persistent=False)
    major = int(cp.cuda.Device().compute_capability) // 10
    assert engine.pdl == (major >= 9), engine.pdl_note
    if not engine.pdl:
        pytest.skip(f"programmatic dependent launch: {engine.pdl_note}")
    plain = fast.Engine(small.params, small.config, dtype=dtype, pdl=False, persistent=False)
    assert plain.pdl_note == "off (asked)"
    want = plain.generate(PROMPT, 400, attend=reference_attend, kv_cache=True).tokens
    for _ in range(2):
        got = engine.generate(PROMPT, 400, attend=reference_attend, kv_cache=True).tokens
        assert got == want, f"PDL tokens part from plain launches at step {first_difference(got, want)}"


def test_engines_are_cached_per_weights_and_dtype(small):
    a = fast.engine_for(small.params, small.config)
    assert fast.engine_for(small.params, small.config) is a
    assert fast.engine_for(dict(small.params), small.config) is a  # the same arrays
    assert fast.engine_for(small.params, small.config, "bfloat16") is not a


def test_profile_step_times_every_kernel(cp, small, capsys):
    engine = fast.engine_for(small.params, small.config)
    before = engine.generate(PROMPT, 8, attend=reference_attend, kv_cache=True).tokens
    rows = engine.profile_step(519)
    names = [name for name, _ in rows]
    assert len(rows) == 5 * 12 + 2 and names[0] == "embed" and names[-1] == "ln_f+lm_head+argmax"
    assert all(ms > 0 for _, ms in rows), rows
    kinds = fast.by_kind(rows)
    assert [n for _, n, _ in kinds] == [1, 12, 12, 12, 12, 12, 1]
    with_prefetch, without = engine.replay_ms(400, 64), engine.replay_ms(400, 64, prefetch=False)
    plain = engine.replay_ms(400, 64, pdl=False)
    assert with_prefetch > 0 and without > 0 and plain > 0
    with capsys.disabled():  # for the notes: where a step's time goes on this device
        total = sum(ms for _, ms in rows)
        print(f"\none fp32 decode step at position 519: kernels sum to {1e3 * total:.1f} us; graph replay at 400: "
              f"{1e3 * with_prefetch:.1f} us per token (PDL {engine.pdl_note}, prefetch), {1e3 * without:.1f} us "
              f"without prefetch, {1e3 * plain:.1f} us with plain launches")
        for kind, n, ms in kinds:
            print(f"  {kind:<28}{n:>3} x {1e3 * ms / n:7.1f} us = {1e3 * ms:8.1f} us")
    assert engine.generate(PROMPT, 8, attend=reference_attend, kv_cache=True).tokens == before  # state restored


def test_copy_ceiling_is_measured():
    assert 1e11 < fast.copy_ceiling(1 << 28, 3) < 1e14  # between 100 GB/s and 100 TB/s


# -- the persistent decode step (kernels/fused/decode_step.cu) -------------------------------------


def persistent_engine(cp, small, dtype, **options):
    engine = fast.Engine(small.params, small.config, dtype=dtype, keep_logits=True, **options)
    major = int(cp.cuda.Device().compute_capability) // 10
    assert engine.persistent == (major >= 9), engine.persistent_note  # the default wherever it runs
    if not engine.persistent:
        pytest.skip(f"the persistent step: {engine.persistent_note}")
    return engine


def follows_step_by_step(cp, engine, graphs, dtype: str, steps: int, what: str) -> None:
    """The persistent engine teacher-forced to the per-operation engine's tokens for `steps` steps after
    PROMPT: the logits within summation-order rounding (float32 1e-5 relative, bfloat16 5e-4), the same
    argmax wherever the top two are 1e-3 apart, the same position."""
    for e in (engine, graphs):
        e.start(PROMPT, reference_attend, kv_cache=True)
    limit = 1e-5 if dtype == "float32" else 5e-4
    for step in range(steps):
        if step:
            for e in (engine, graphs):
                e.decode(1)
        for e in (engine, graphs):
            e.stream.synchronize()
        rel = float(cp.linalg.norm(engine.logits - graphs.logits) / cp.linalg.norm(graphs.logits))
        assert rel <= limit, f"{what} step {step}: relative logit difference {rel:.2e} (limit {limit:g})"
        want = int(graphs.state[0].get())
        if margins(cp, [graphs.logits])[0] >= 1e-3:
            assert int(engine.state[0].get()) == want, f"{what} step {step}: argmax differs at a clear margin"
        assert int(engine.state[1].get()) == int(graphs.state[1].get()) == len(PROMPT) + step
        with engine.stream:  # both go on from the per-operation step's token
            engine.state[0:1].set(np.asarray([want], dtype=np.int32), stream=engine.stream)


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("max_len", [None, 97])
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_persistent_step_follows_the_per_operation_step(cp, small, dtype, max_len, reduce):
    """Teacher-forced to the per-operation step's tokens, step by step up to the engine's last position
    (97: splits of 13 or 17 keys, the last one short): the logits within summation-order rounding (float32
    1e-5 relative, bfloat16 5e-4), the same argmax wherever the top two are apart, the same state. With the
    heads' terms of attn.c_proj summed in every block (GPT-2 small's default) and by each block for its
    columns of x (reduce: gpt2-xl's)."""
    engine = persistent_engine(cp, small, dtype, max_len=max_len, step_reduce=reduce)
    assert engine.step.reduce_heads == reduce
    graphs = fast.Engine(small.params, small.config, dtype=dtype, keep_logits=True, persistent=False,
                         max_len=max_len)
    n = 48 if max_len is None else max_len - len(PROMPT)
    follows_step_by_step(cp, engine, graphs, dtype, n, dtype)


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_persistent_step_windows_are_single_steps(cp, small, dtype, reduce):
    """One launch runs a window of steps, carrying token and position on the device: the tokens of
    windows of STEPS_PER_LAUNCH equal those of one step per launch, and a rerun gives the same tokens
    (deterministic: fixed summation orders, no atomics in the arithmetic)."""
    windows = persistent_engine(cp, small, dtype, step_reduce=reduce)
    single = persistent_engine(cp, small, dtype, steps_per_launch=1, step_reduce=reduce)
    want = windows.generate(PROMPT, 200, attend=reference_attend, kv_cache=True).tokens
    assert single.generate(PROMPT, 200, attend=reference_attend, kv_cache=True).tokens == want
    assert windows.generate(PROMPT, 200, attend=reference_attend, kv_cache=True).tokens == want
    assert cp.asnumpy(windows.history[len(PROMPT):len(PROMPT) + 200]).tolist() == want


def test_profile_persistent_names_every_stage(cp, small, capsys):
    engine = persistent_engine(cp, small, "float32")
    rows = engine.profile_persistent(519)
    assert len(rows) == 4 * 12 + 1 and rows[0][0] == "h.0.ln_1+attn.c_attn" and rows[-1][0] == "ln_f+lm_head+argmax"
    assert [name for name, *_ in rows[:4]] == [f"h.0.{kind}" for kind in fast.STEP_STAGES]
    assert all(total > 0 and work > 0 and wait >= 0 for _, total, work, wait in rows), rows
    per_token = engine.replay_ms(519, 64)
    # loose: other processes sharing the GPU (pytest -n) stretch single runs
    assert 0.25 * per_token < sum(r[1] for r in rows) < 4 * per_token, (sum(r[1] for r in rows), per_token)
    with capsys.disabled():  # for the notes
        print(f"\npersistent fp32 step at 519: stages sum to {1e3 * sum(r[1] for r in rows):.1f} us, "
              f"{1e3 * per_token:.1f} us per token in windows")
        for kind, n, ms in fast.by_kind([(name, total) for name, total, _, _ in rows]):
            print(f"  {kind:<28}{n:>3} x {1e3 * ms / n:7.2f} us")


def test_lab_profile_step_reports_both_decode_steps(cp, tmp_path, capsys):
    import lab

    out = tmp_path / "run.json"
    assert lab.main(["--random-weights", "--kv-cache", "--tokens", "16", "--profile-step", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    p = s["profile_step"]
    assert len(p["kernels"]) == 5 * 12 + 2 and p["graph_ms_per_token"] > 0
    assert s["persistent"] == p["persistent"]
    if p["persistent"] == "on":
        kinds = [row["kind"] for row in p["persistent_stages"]]
        assert kinds == [*fast.STEP_STAGES, "ln_f+lm_head+argmax"]
        assert [row["stages"] for row in p["persistent_stages"]] == [12] * len(fast.STEP_STAGES) + [1]
        assert p["persistent_ms_per_token"] > 0 and "persistent kernel" in capsys.readouterr().out
