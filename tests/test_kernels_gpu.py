"""Every rung against the float64 reference on the GPU.

Tolerance: a rung's largest error against float64 may be at most its declared factor
(`lab.tolerance`, default 8) times the largest error of the plain float32 implementation
(kernels.reference_attention in float32) on the same inputs, with that error floored at float32 epsilon times the output's largest magnitude so
that a lucky exact plain result does not demand bit-exactness. It may also reach what holding the
scores in float32 alone can cause (score_floor): on large inputs (magnitude 10, scores in the
hundreds) every float32 order of the same sums lands there, and the plain implementation's error is
then a lucky draw, not a bound.

An FP8 rung (lab.fp8) computes on e4m3 copies of its inputs: its error is FP8's, so the tests that hold
a rung to a bound against float64 (EXACT) leave it out, and tests/test_fp8_gpu.py holds it to its float64
emulation and to RMSE bounds; the tests of NaN, Inf and resources take every rung.
"""

import math

import numpy as np
import pytest

import kernels
from tests.tiers import first_of_each_rung, spread, tiered

pytestmark = pytest.mark.gpu

LENGTHS = [1, 17, 64, 97, 257, 512, 1000, 1024]
RUNGS = kernels.names()
EXACT = [name for name in RUNGS if not kernels.load(name).fp8]  # held to a bound against float64


# every rung x every head size and dtype it declares
CASES = [(name, d, dtype) for name in EXACT for d in kernels.load(name).head_sizes() for dtype in kernels.load(name).dtypes]
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def random_qkv(cp, B, NH, T, d, *, magnitude=1.0, packed=False, seed=None, dtype="float32"):
    rng = cp.random.default_rng(seed)
    if packed:  # views of one (B, T, 3, NH, d) projection, as the model makes them
        qkv = (rng.standard_normal((B, T, 3, NH, d), dtype=cp.float32) * magnitude).astype(dtype)
        return tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    return tuple((rng.standard_normal((B, NH, T, d), dtype=cp.float32) * magnitude).astype(dtype) for _ in range(3))


def head_size(name):
    """The head size the one-shape tests use: 64 where the rung takes it, else its first (v40: 128 alone)."""
    sizes = kernels.load(name).head_sizes()
    return 64 if 64 in sizes else sizes[0]


def score_floor(cp, q, k, v, scale=None):
    """The output error that rounding the scores to float32 alone can cause: softmax moves by at most
    2 max|ds| (in each probability's share), ds = eps * |s|, and the output by that times max|v|."""
    q64, k64 = q.astype(cp.float64), cp.repeat(k.astype(cp.float64), q.shape[1] // k.shape[1], axis=1)  # grouped heads
    s = cp.matmul(q64, k64.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    T_q, T_k = s.shape[-2:]
    visible = cp.arange(T_k)[None, :] <= cp.arange(T_q)[:, None] + (T_k - T_q)  # causal, aligned at the end
    return 2 * EPS["float32"] * float(cp.abs(cp.where(visible, s, 0.0)).max()) * float(cp.abs(v.astype(cp.float64)).max())


def check_against_reference(q, k, v, name, scale=None, config=None):
    import cupy as cp

    B, NH, T, d = q.shape
    out = cp.full((B, NH, T, d), cp.nan, dtype=q.dtype)  # poison: unwritten elements fail
    run = kernels.prepare(q, k, v, kernel=name, scale=scale, out=out, config=config)
    got, inst = run(), run.instance  # the configuration the launcher chose for this shape
    assert got is out
    ref64 = kernels.reference_attention(*(x.astype(cp.float64) for x in (q, k, v)), scale=scale)
    plain_same_dtype = kernels.reference_attention(q, k, v, scale=scale)
    err = float(cp.abs(got.astype(cp.float64) - ref64).max())
    plain = float(cp.abs(plain_same_dtype.astype(cp.float64) - ref64).max())
    floor = EPS[q.dtype.name] * float(cp.abs(ref64).max())
    bound = max(inst.rung.tolerance_factor(inst.config) * max(plain, floor), score_floor(cp, q, k, v, scale))
    assert not math.isnan(err), f"{name}: NaN in output ({int(cp.isnan(got).sum())} elements unwritten or NaN)"
    mean = float(cp.abs(got.astype(cp.float64) - ref64).mean())
    assert err <= bound, f"{name} {q.shape}: max error {err:.3e} (mean {mean:.3e}) > {bound:.3e} (plain fp32 {plain:.3e})"


@pytest.mark.parametrize("T,name,d,dtype", spread(LENGTHS, CASES, quick=[1, 97, 257]))  # quick: every case, one awkward length each
@pytest.mark.parametrize("B,NH", tiered([(1, 1), (1, 12), (3, 1), (3, 12)], quick=[(3, 12)]))
def test_rung_matches_reference(name, d, dtype, T, B, NH):
    import cupy as cp

    check_against_reference(*random_qkv(cp, B, NH, T, d, dtype=dtype), name)


@pytest.mark.parametrize("name,d,dtype", tiered(CASES, quick=first_of_each_rung(CASES)))
@pytest.mark.parametrize("T", tiered([97, 512], quick=[97]))
def test_rung_strided_views_of_packed_qkv(name, d, dtype, T):
    import cupy as cp

    q, k, v = random_qkv(cp, 2, 3, T, d, packed=True, dtype=dtype)
    assert not q.flags.c_contiguous
    check_against_reference(q, k, v, name)


@pytest.mark.parametrize("name,d,dtype", tiered(CASES, quick=first_of_each_rung(CASES)))
def test_rung_misaligned_views(name, d, dtype):
    """Row strides and a start that are not multiples of 16 bytes: strided rungs get copies."""
    import cupy as cp

    B, NH, T = 2, 3, 45
    base = (cp.random.standard_normal((B, NH, T, d + 3), dtype=cp.float32)).astype(dtype)
    q, k, v = (base[..., i : i + d] for i in range(3))  # offsets of 0, 1 and 2 elements
    check_against_reference(q, k, v, name)


@pytest.mark.parametrize("name,d,dtype", tiered(CASES, quick=first_of_each_rung(CASES)))
@pytest.mark.parametrize("magnitude", tiered([8.0, 30.0], quick=[30.0]))
def test_rung_large_scores(name, d, dtype, magnitude):
    """Scores in the hundreds: the online softmax must rescale, not overflow."""
    import cupy as cp

    check_against_reference(*random_qkv(cp, 1, 2, 300, d, magnitude=magnitude, dtype=dtype), name)


@pytest.mark.parametrize("name,d,dtype", tiered(CASES, quick=first_of_each_rung(CASES)))
@pytest.mark.parametrize("climb", [3.0, 20.0])
def test_rung_scores_climbing_along_the_keys(name, d, dtype, climb):
    """Every query's scores rise by `climb` (natural units) every 128 keys, so a row's maximum moves at
    nearly every key step, by less than v34's threshold (2^8, 5.5 natural units) at 3 and past it at 20:
    the online softmax's rescale and a reference that lags the running maximum are both exercised."""
    import cupy as cp

    B, NH, T = 1, 2, 1000
    q, k, v = (x.astype(cp.float32) for x in random_qkv(cp, B, NH, T, d, seed=5))
    q[..., 0] = math.sqrt(d)  # the scaled score picks up k[..., 0]
    k[..., 0] = climb * cp.arange(T, dtype=cp.float32) / 128
    check_against_reference(q.astype(dtype), k.astype(dtype), v.astype(dtype), name)


@pytest.mark.parametrize("name", EXACT)
def test_rung_custom_scale(name):
    import cupy as cp

    dtype = kernels.load(name).dtypes[0]
    check_against_reference(*random_qkv(cp, 1, 2, 130, head_size(name), dtype=dtype), name, scale=0.5)


@pytest.mark.exhaustive  # every configuration: the quick tier runs the ones the launcher picks
@pytest.mark.parametrize("name", EXACT)
def test_rung_every_declared_config(name):
    import cupy as cp

    rung = kernels.load(name)
    limits = kernels.device_limits()
    for config in rung.configs:
        if rung.shared_bytes(config) > limits.max_shared_per_block:
            continue
        for dtype in [rung.dtype_of(config)] if rung.dtype_of(config) else rung.dtypes:
            check_against_reference(*random_qkv(cp, 2, 2, 201, config[0], dtype=dtype), name, config=config)


@pytest.mark.exhaustive  # compiles every configuration; tests/test_kernels_cpu.py reads the same report via NVRTC
@pytest.mark.parametrize("name", RUNGS)
def test_resource_report_on_device(name):
    for r in kernels.resources(name):
        assert r.registers > 0
        assert r.blocks_per_sm is not None
        assert r.spill_stores == 0 and r.spill_loads == 0


def test_large_shared_memory_opt_in():
    """v01 at B_r = B_c = 64, d = 64 needs 64 KiB of dynamic shared memory: more than the default."""
    import cupy as cp

    inst = kernels.instance("v01", 64, (64, 64, 64))
    assert inst.smem > 48 * 1024
    check_against_reference(*random_qkv(cp, 1, 1, 200, 64), "v01")


def test_numpy_input_to_gpu_rung_is_rejected():
    x = np.ones((1, 1, 4, 64), np.float32)
    with pytest.raises(TypeError, match="NumPy"):
        kernels.attention(x, x, x, kernel="v01")


def test_wrong_dtype_and_shapes_on_gpu():
    import cupy as cp

    x = cp.ones((1, 1, 4, 64), cp.float64)
    with pytest.raises(TypeError, match="float64"):
        kernels.attention(x, x, x, kernel="v01")
    y = cp.ones((1, 1, 4, 64), cp.float32)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernels.attention(y, y, cp.ones((1, 1, 5, 64), cp.float32), kernel="v01")
    with pytest.raises(ValueError, match="head sizes"):
        z = cp.ones((1, 1, 4, 80), cp.float32)
        kernels.attention(z, z, z, kernel="v01")
    with pytest.raises(ValueError, match="unit stride"):
        w = cp.ones((1, 1, 4, 128), cp.float32)[..., ::2]
        kernels.attention(w, w, w, kernel="v01")
    with pytest.raises(ValueError, match="empty"):
        e = cp.ones((1, 1, 0, 64), cp.float32)
        kernels.attention(e, e, e, kernel="v01")
    with pytest.raises(ValueError, match="causal"):
        kernels.attention(y, y, y, kernel="v01", causal=False)


def test_impossible_config_names_kernel_and_config():
    import cupy as cp

    x = cp.ones((1, 1, 4, 64), cp.float32)
    with pytest.raises(ValueError, match=r"v01_naive.*B_r=64, B_c=128|threads"):
        kernels.attention(x, x, x, kernel="v01", config=(64, 64, 128))


def test_user_kernel_compile_error_names_file_and_line(tmp_path):
    import cupy as cp

    source = kernels.resolve("v02").read_text()
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if "const int row_start" in line)
    lines.insert(at + 1, "    const int broken = undefined_name;")
    path = tmp_path / "broken.cu"
    path.write_text("\n".join(lines) + "\n")
    x = cp.ones((1, 1, 8, 64), cp.float32)
    with pytest.raises(kernels.KernelCompileError) as info:
        kernels.attention(x, x, x, kernel=str(path))
    assert f"{path}({at + 2})" in str(info.value) and "undefined_name" in str(info.value)


def test_user_kernel_by_path_runs(tmp_path):
    """A copy of a rung outside kernels/ runs by path, and an edit to it is picked up at once."""
    import cupy as cp

    path = tmp_path / "mine.cu"
    source = kernels.resolve("v02").read_text()
    path.write_text(source)
    check_against_reference(*random_qkv(cp, 1, 2, 77, 64), str(path))
    # the same file, edited to scale every output by 2: the next call must run the new code
    path.write_text(source.replace("*o = *o * expf(m_old - m_new) * (l_old / l_new) + pv;",
                                   "*o = *o * expf(m_old - m_new) * (l_old / l_new) + 2.0f * pv;"))
    q, k, v = random_qkv(cp, 1, 2, 77, 64)
    got = kernels.attention(q, k, v, kernel=str(path))
    ref = kernels.reference_attention(q, k, v)
    assert float(cp.abs(got - 2 * ref).max()) < 1e-4


@pytest.mark.parametrize("name", RUNGS)
def test_inf_in_v_is_not_masked(name):
    """An Inf in V reaches every row that attends to its key as a non-finite output."""
    import cupy as cp

    dtype = kernels.load(name).dtypes[0]
    q, k, v = random_qkv(cp, 1, 1, 70, head_size(name), dtype=dtype)
    v[0, 0, 30, 5] = cp.inf
    out = kernels.attention(q, k, v, kernel=name).astype(cp.float32)
    assert not bool(cp.isfinite(out[0, 0, 30:, 5]).any()), f"{name}: an Inf in V was masked"


def test_config_needing_more_shared_memory_than_the_device_has():
    import cupy as cp

    x = cp.ones((1, 1, 8, 128), cp.float32)
    with pytest.raises(ValueError, match=r"v01_naive config d_head=128, B_r=256, B_c=64: needs \d+ bytes of shared memory"):
        kernels.attention(x, x, x, kernel="v01", config=(128, 256, 64))


def check_nan_reaches(name, where, *, T_q, T_k, row, config=None, dtype=None):
    """A NaN at q[0, 1, row, 3] (where = "q") or at k/v[0, 1, row, 3], causal, the mask aligned
    bottom-right: every output row of head 1 that sees it must be NaN; a NaN query row must stay in
    its row; head 0 must stay clean. Rows that cannot see a NaN key may turn NaN too in a tiled rung
    (0 x NaN is NaN when a tile's masked products are summed; docs/ladder.md says so)."""
    import cupy as cp

    if dtype is None:  # a .cu rung's first dtype, or its config's
        rung = kernels.load(name)
        dtype = (rung.dtype_of(config) if config else None) or rung.dtypes[0]
    d = config[0] if isinstance(config, tuple) else head_size(name) if name in RUNGS else 64  # triton rungs: 64
    q = (cp.random.standard_normal((1, 2, T_q, d), dtype=cp.float32)).astype(dtype)
    k, v = ((cp.random.standard_normal((1, 2, T_k, d), dtype=cp.float32)).astype(dtype) for _ in range(2))
    {"q": q, "k": k, "v": v}[where][0, 1, row, 3] = cp.nan
    out = kernels.attention(q, k, v, kernel=name, config=config).astype(cp.float32)
    nan_rows = cp.isnan(out[0, 1]).any(axis=-1)
    what = f"{name} config {config} T_q={T_q} T_k={T_k}: NaN in {where} row {row}"
    if where == "q":  # query row i sees keys j <= i + T_k - T_q: this one sees at least key 0
        assert row + T_k - T_q >= 0
        assert bool(nan_rows[row]), f"{what} did not reach its own output row"
        assert int(nan_rows.sum()) == 1, f"{what} leaked into rows {cp.flatnonzero(nan_rows).tolist()}"
    else:  # every row i with i + T_k - T_q >= row sees key `row`
        must = cp.zeros(T_q, dtype=bool)
        must[max(row + T_q - T_k, 0):] = True
        assert bool(nan_rows[must].all()), f"{what} did not reach rows {cp.flatnonzero(must & ~nan_rows).tolist()}"
    assert not bool(cp.isnan(out[0, 0]).any()), f"{what} leaked into another head"


# quick: each rung with its NaN in one of q, k, v in turn (the next test takes all three at a declared configuration)
@pytest.mark.parametrize("where,name", spread(["q", "k", "v"], [(name,) for name in RUNGS], quick=["q", "k", "v"]))
def test_nan_reaches_every_row_that_sees_it(name, where):
    """A NaN is never masked silently: with a NaN in query row 40, or in key/value row 40, every
    output row that attends to it is NaN (T = 100, the configuration the launcher picks)."""
    check_nan_reaches(name, where, T_q=100, T_k=100, row=40)


# every declared configuration of every rung, plus the cross-length case for rungs declaring "cross";
# quick: each rung's first configuration, at the cross lengths where the rung declares them
NAN_CONFIG_CASES = [pytest.param(name, config, shape, id=f"{name}-{'x'.join(map(str, config))}-{shape}",
                                 marks=() if i == 0 and shape == shapes[-1] else pytest.mark.exhaustive)
                    for name in RUNGS for i, config in enumerate(kernels.load(name).configs)
                    for shapes in [["self"] + (["cross"] * ("cross" in kernels.load(name).supports))]
                    for shape in shapes]


@pytest.mark.parametrize("name,config,shape", NAN_CONFIG_CASES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_every_row_that_sees_it_every_config(name, config, shape, where):
    """test_nan_reaches_every_row_that_sees_it for every declared configuration, and, for a rung
    declaring "cross", with T_q = 300 queries over T_k = 97 keys (causal, bottom-right: row i sees
    keys j <= i - 203): NaN in query row 250, which sees keys 0..47 (with B_c = 64 its tile 0
    reaches past its last key: the visible scores all NaN, the masked ones -inf, the row maximum
    -inf), or in key/value row 40, which rows 243..299 see. A rung that scales Q on the GPU meets a
    NaN in Q as the GPU's canonical NaN 0x7fffffff: v14 with split = 0 used to round that to TF32
    as -0 and lose it."""
    rung = kernels.load(name)
    if rung.shared_bytes(config) > kernels.device_limits().max_shared_per_block:
        pytest.skip(f"{name} config {config} needs more shared memory than this device has")
    if shape == "self":
        check_nan_reaches(name, where, T_q=100, T_k=100, row=40, config=config)
    else:
        check_nan_reaches(name, where, T_q=300, T_k=97, row=250 if where == "q" else 40, config=config)


# the rungs that make their parent persistent (v27's parent, v26, is persistent already, and v27 changes the arithmetic)
PERSISTENT = [name for name in RUNGS[1:] if kernels.load(name).persistent and not kernels.load(RUNGS[RUNGS.index(name) - 1]).persistent]


PERSISTENT_SHAPES = [
    (1, 10, 10, 8192, 8192, 128, True, "bfloat16"),  # K and V past L2_ALL: tiles in chunks of 4 heads, the last of 2
    (3, 12, 4, 1024, 1024, 64, True, "float16"),     # more tiles than SMs, grouped K/V heads
    (2, 12, 12, 1000, 1500, 64, False, "bfloat16"),  # non-causal, cross
    (2, 8, 8, 1500, 700, 128, True, "bfloat16"),     # causal cross: the first 800 rows' tiles see no key
]


@pytest.mark.parametrize("wait", [False, True], ids=["synchronized", "waits_by_event"])  # runtime.WAIT_BY_EVENT
@pytest.mark.parametrize("name", PERSISTENT)  # quick: grouped heads, and the causal cross
@pytest.mark.parametrize("B,NH,NH_kv,T_q,T_k,d,causal,dtype", tiered(PERSISTENT_SHAPES, quick=PERSISTENT_SHAPES[1::2]))
def test_persistent_rung_matches_its_one_block_per_tile_parent(name, B, NH, NH_kv, T_q, T_k, d, causal, dtype,
                                                                wait, monkeypatch):
    """A persistent rung does its parent's arithmetic per tile (the rung before it, launched a block
    per tile), so its output is the parent's bit for bit, launch after launch and replayed from a
    CUDA graph: a launch that left its tile counter off zero would leave the next one's poisoned
    output partly unwritten. Prepared on the legacy stream and launched on another, its workspace's
    zeros waited for by the host at prepare, or by an event (captured: by the host at the capture)."""
    import cupy as cp

    from kernels import runtime

    monkeypatch.setattr(runtime, "WAIT_BY_EVENT", wait)

    parent = RUNGS[RUNGS.index(name) - 1]
    if dtype not in kernels.load(name).dtypes:  # the shape is the point (an FP8 rung takes bfloat16 alone)
        dtype = kernels.load(name).dtypes[0]
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((B, NH, T_q, d), dtype=cp.float32).astype(dtype)
    k, v = (rng.standard_normal((B, NH_kv, T_k, d), dtype=cp.float32).astype(dtype) for _ in range(2))
    want = kernels.attention(q, k, v, kernel=parent, causal=causal)
    out = cp.empty_like(q)
    run = kernels.prepare(q, k, v, kernel=name, causal=causal, out=out)
    cp.cuda.Device().synchronize()  # inputs and parent written before the non-blocking stream reads them
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    for launch in [run, run, graph.launch, graph.launch, run]:
        with stream:  # the poison in the launch's stream order (the legacy default stream does not wait for it)
            out.fill(cp.nan)
            launch()
        stream.synchronize()
        bad = int(cp.count_nonzero(out.view(cp.uint16) != want.view(cp.uint16)))
        assert bad == 0, f"{name} {q.shape} k {k.shape} causal={causal}: {bad} elements differ from {parent}'s"


# v37 computes v34's values in v34's order on both of its paths: the shapes and scores that take each
DEFERRED_MAX_CASES = [
    (2, 12, 12, 1000, 1000, 64, True, 0.0, 1.0),    # random scores: every step on the exponentials-first path
    (2, 8, 8, 1500, 1500, 128, False, 0.0, 1.0),
    (1, 6, 6, 1000, 1000, 128, True, 3.0, 1.0),     # a row's maximum climbing by less than 2^8 at every step
    (1, 6, 6, 1000, 1000, 64, False, 20.0, 1.0),    # and by more: S_ij taken again, v34's softmax
    (1, 4, 4, 1000, 1000, 128, True, 20.0, 1.0),
    (2, 8, 8, 1500, 700, 128, True, 0.0, 1.0),      # causal cross: rows that have seen no key (m_i = -inf)
    (1, 4, 4, 1000, 1000, 64, True, 0.0, 30.0),     # scores in the hundreds
    (1, 4, 4, 1000, 1000, 128, False, 0.0, 30.0),
]


def deferred_max_inputs(cp, B, NH, NH_kv, T_q, T_k, d, climb, magnitude):
    rng = cp.random.default_rng(7)
    q = rng.standard_normal((B, NH, T_q, d), dtype=cp.float32) * magnitude
    k, v = (rng.standard_normal((B, NH_kv, T_k, d), dtype=cp.float32) * magnitude for _ in range(2))
    if climb:
        q[..., 0] = math.sqrt(d)
        k[..., 0] = climb * cp.arange(T_k, dtype=cp.float32) / 128
    return tuple(x.astype("bfloat16") for x in (q, k, v))


@pytest.mark.parametrize("name", ["v37", "v38", "v39"])
@pytest.mark.parametrize("B,NH,NH_kv,T_q,T_k,d,causal,climb,magnitude", DEFERRED_MAX_CASES)
def test_exponentials_first_is_v34_bit_for_bit(name, B, NH, NH_kv, T_q, T_k, d, causal, climb, magnitude):
    """v37 takes a step's exponentials before the row maximum and looks for the maximum only where a
    partial sum passed 2^8 (then from S_ij again, with v34's softmax): the same values in the same
    order as v34 on either path, so the outputs agree in every bit, with climbing scores that take the
    second path at most steps and rows whose reference is still -inf. v38 does the same at d = 128 with
    key tiles of 128 too (a third stage of K_j, O_i stored from registers: the same rounding). v39 takes
    S_ij again per warp on mma.sync (another order of the float32 sums) where the block has two
    consumers: there, where scores climb or run into the hundreds, it is held to the float64 reference
    instead, at most twice v34's error."""
    import cupy as cp

    q, k, v = deferred_max_inputs(cp, B, NH, NH_kv, T_q, T_k, d, climb, magnitude)
    want = kernels.attention(q, k, v, kernel="v34", causal=causal)
    got = kernels.attention(q, k, v, kernel=name, causal=causal)
    assert not bool(cp.isnan(want.astype(cp.float32)).any())
    if name == "v39" and (climb or magnitude != 1.0):
        ref = kernels.reference_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)
        err_v34 = float(cp.abs(want.astype(cp.float64) - ref).max())
        err = float(cp.abs(got.astype(cp.float64) - ref).max())
        floor = EPS["bfloat16"] * float(cp.abs(ref).max())
        assert err <= 2 * max(err_v34, floor), f"v39's error {err:.3g} against v34's {err_v34:.3g}"
        return
    bad = int(cp.count_nonzero(got.view(cp.uint16) != want.view(cp.uint16)))
    assert bad == 0, f"{bad} of {got.size} elements differ from v34's"


@pytest.mark.parametrize("name", PERSISTENT)
def test_waits_by_event_a_launch_on_another_stream_waits_for_the_workspace_s_zeros(name, monkeypatch):
    """runtime.WAIT_BY_EVENT: prepared on a stream still busy with products, so that the workspace's zeros
    land late, in a block of the pool that held NaN; launched at once on another stream. Right only if
    that launch waited for the zeros: a tile counter read from the NaN's bits ends every block at once
    and leaves the poisoned output unwritten."""
    import cupy as cp

    from kernels import runtime

    monkeypatch.setattr(runtime, "WAIT_BY_EVENT", True)
    rng = cp.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 8, 1000, 64), dtype=cp.float32).astype("bfloat16") for _ in range(3))
    want = kernels.attention(q, k, v, kernel=name)  # prepared and launched on one stream: no wait
    out = cp.empty_like(q)
    cp.cuda.Device().synchronize()
    busy_stream, launch_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with busy_stream:  # CuPy's pool reuses a block freed on a stream for that stream's allocations
        busy = cp.full((4096, 4096), 2.0**-12, dtype=cp.float32)
        for _ in range(20):
            busy = busy @ busy  # tens of milliseconds before the zeros, in this stream's order (2^-12 again)
        junk = cp.full(1 << 24, cp.nan, dtype=cp.float32)
        del junk  # 64 MiB of NaN (or a freed product's bits) for the zeros' block: never zeros by chance
        run = kernels.prepare(q, k, v, kernel=name, out=out)
    with launch_stream:
        out.fill(cp.nan)
        run()
    launch_stream.synchronize()
    bad = int(cp.count_nonzero(out.view(cp.uint16) != want.view(cp.uint16)))
    assert bad == 0, f"{name}: {bad} elements differ from the same-stream launch's"


# every rung declaring lab.lse x head size x dtype, each over lengths that leave rows seeing no key
LSE_CASES = [(name, d, dtype) for name in RUNGS if kernels.load(name).lse
             for d in kernels.load(name).head_sizes() for dtype in kernels.load(name).dtypes]


@pytest.mark.parametrize("name,d,dtype", tiered(LSE_CASES, quick=first_of_each_rung(LSE_CASES)))
@pytest.mark.parametrize("T_q,T_k,causal", tiered([(1, 1, True), (97, 97, True), (257, 257, False), (300, 97, True),
                                                   (64, 1000, True)], quick=[(1, 1, True), (257, 257, False), (300, 97, True)]))
def test_rung_writes_the_log_sum_exp(name, d, dtype, T_q, T_k, causal):
    """return_lse: each row's log-sum-exp (natural log of its scaled scores' exp sum) against float64,
    within 8 x the plain implementation's error in the same dtype (floored at float32 epsilon x
    max(1, max |lse|)); +inf exactly for the rows that see no key; every element written (poisoned
    first); the output the same bits as without return_lse."""
    import cupy as cp

    rung = kernels.load(name)
    if (T_q != T_k and "cross" not in rung.supports) or (not causal and "noncausal" not in rung.supports):
        pytest.skip(f"{name} does not declare the case")
    rng = cp.random.default_rng()
    q = rng.standard_normal((2, 3, T_q, d), dtype=cp.float32).astype(dtype)
    k, v = (rng.standard_normal((2, 3, T_k, d), dtype=cp.float32).astype(dtype) for _ in range(2))
    run = kernels.prepare(q, k, v, kernel=name, causal=causal, return_lse=True)
    out, lse = run()
    lse.fill(cp.nan)  # poison: an unwritten row fails
    out, lse = run()
    assert lse.shape == (2, 3, T_q) and lse.dtype == cp.float32
    plain_out = kernels.attention(q, k, v, kernel=name, causal=causal)
    assert bool((out.view(cp.uint8) == plain_out.view(cp.uint8)).all()), f"{name}: return_lse changed the output"
    _, ref = kernels.reference_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal, return_lse=True)
    _, plain = kernels.reference_attention(q, k, v, causal=causal, return_lse=True)
    none_seen = cp.isposinf(ref)
    assert bool((cp.isposinf(lse) == none_seen).all()), f"{name}: +inf rows differ from the reference's"
    seen = ~none_seen
    if not bool(seen.any()):
        return
    err = float(cp.abs(lse.astype(cp.float64) - ref)[seen].max())
    plain_err = float(cp.abs(plain.astype(cp.float64) - ref)[seen].max())
    bound = 8 * max(plain_err, EPS["float32"] * max(1.0, float(cp.abs(ref[seen]).max())))
    assert err <= bound, f"{name} d={d} {dtype} T_q={T_q} T_k={T_k}: lse error {err:.3e} > {bound:.3e} (plain {plain_err:.3e})"


# float32 inputs into a bfloat16 rung (gpt2.fast's prefill in a bfloat16 run): (B, NH, NH_kv, T_q, T_k, d,
# packed), packed: views of one (B, T, 3, NH, d) projection, as the engine hands them
CAST_SHAPES = [(1, 12, 12, 97, 97, 64, True), (2, 8, 8, 97, 257, 64, False), (1, 32, 8, 257, 257, 64, False)]


@pytest.mark.parametrize("name", ["v15", "v22", "v24"])
@pytest.mark.parametrize("B,NH,NH_kv,T_q,T_k,d,packed", CAST_SHAPES)
def test_a_prepared_cast_is_the_call_bit_for_bit(name, B, NH, NH_kv, T_q, T_k, d, packed, monkeypatch):
    """kernels.runtime.PREPARE_CASTS: Attend.prepare of float32 inputs into a bfloat16 rung (prepared once
    on bfloat16 copies that each run casts into) gives Attend.__call__'s bits (astype copies, the rung
    prepared anew, the output cast back), run after run on new contents, and prepares nothing in a run."""
    import cupy as cp

    from kernels import runtime

    rung = kernels.load(name)
    if (T_q != T_k and "cross" not in rung.supports) or (NH_kv != NH and "gqa" not in rung.supports):
        pytest.skip(f"{name} does not declare the case")
    prepare, prepares = runtime.prepare, []

    def counted(*args, **kwargs):
        prepares.append(args)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(runtime, "prepare", counted)
    monkeypatch.setattr(runtime, "PREPARE_CASTS", True)
    rng = cp.random.default_rng(0)
    if packed:
        qkv = cp.empty((B, T_q, 3, NH, d), dtype=cp.float32)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        arrays = (qkv,)
    else:
        q = cp.empty((B, NH, T_q, d), dtype=cp.float32)
        k, v = (cp.empty((B, NH_kv, T_k, d), dtype=cp.float32) for _ in range(2))
        arrays = (q, k, v)
    attend = kernels.Attend(name, dtype="bfloat16")
    run = attend.prepare(q, k, v)
    assert len(prepares) == 1 and all(x.dtype.name == "bfloat16" and x.flags.c_contiguous for x in prepares[0])
    for _ in range(3):
        for x in arrays:  # the layer's new projection
            x[...] = rng.standard_normal(x.shape, dtype=cp.float32)
        before = len(prepares)
        got = run()
        assert len(prepares) == before, "a run of the prepared cast prepared the rung again"
        want = attend(q, k, v)
        assert got.dtype == cp.float32 and got.shape == want.shape
        bad = int(cp.count_nonzero(got.view(cp.uint32) != want.view(cp.uint32)))
        assert bad == 0, f"{name} q {q.shape} k {k.shape}: {bad} elements differ from Attend.__call__'s"
