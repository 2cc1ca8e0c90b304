"""The Triton rungs on the GPU, by the CUDA rungs' tests and helpers: against the float64 reference
with the same tolerance rule (test_kernels_gpu.check_against_reference, test_decode_gpu.check_general:
the declared factor, per precision here, times the plain implementation's own error), outputs
poisoned with NaN, the same awkward lengths, strided and misaligned views, large scores, NaN and Inf
propagation, non-causal, cross lengths and grouped-query heads; then what only a Triton rung has:
every fp32 precision, every declared tile shape pinned, CuPy's current stream, zero-copy reuse.
Skipped where Triton or PyTorch is not installed (pip install -e '.[triton]')."""

import math

import pytest

import kernels
from kernels import triton as triton_rungs
from tests.test_decode_gpu import check_general
from tests.test_decode_gpu import random_qkv as random_qkv_gqa
from tests.test_kernels_gpu import LENGTHS, check_against_reference, check_nan_reaches, random_qkv
from tests.tiers import first_of_each_rung, spread, tiered

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kernels.triton_unavailable() is not None, reason=str(kernels.triton_unavailable()))]

RUNGS = kernels.triton_names()
# every Triton rung x every head size and dtype it declares
CASES = [(name, d, dtype) for name in RUNGS for d in triton_rungs.load(name).head_sizes()
         for dtype in triton_rungs.load(name).dtypes]
ONCE = tiered(CASES, quick=first_of_each_rung(CASES))  # the quick tier runs each rung's first case only


def precision_cases():
    """(rung, precision) for every float32 precision a rung declares beyond its default."""
    return [(name, p) for name in RUNGS for p in triton_rungs.load(name).precisions[1:]]


@pytest.mark.parametrize("T,name,d,dtype", spread(LENGTHS, CASES, quick=[1, 97, 257]))  # quick: every case, one awkward length each
@pytest.mark.parametrize("B,NH", tiered([(1, 1), (1, 12), (3, 1), (3, 12)], quick=[(3, 12)]))
def test_triton_matches_reference(name, d, dtype, T, B, NH):
    import cupy as cp

    check_against_reference(*random_qkv(cp, B, NH, T, d, dtype=dtype), name)


@pytest.mark.parametrize("name,d,dtype", ONCE)
@pytest.mark.parametrize("T", tiered([97, 512], quick=[97]))
def test_triton_strided_views_of_packed_qkv(name, d, dtype, T):
    import cupy as cp

    q, k, v = random_qkv(cp, 2, 3, T, d, packed=True, dtype=dtype)
    assert not q.flags.c_contiguous
    check_against_reference(q, k, v, name)


@pytest.mark.parametrize("name,d,dtype", ONCE)
def test_triton_misaligned_views(name, d, dtype):
    """Row strides and starts that are not multiples of 16 bytes: read as they are, no copies."""
    import cupy as cp

    base = (cp.random.standard_normal((2, 3, 45, d + 3), dtype=cp.float32)).astype(dtype)
    check_against_reference(*(base[..., i : i + d] for i in range(3)), name)


@pytest.mark.parametrize("name,d,dtype", ONCE)
@pytest.mark.parametrize("magnitude", tiered([8.0, 30.0], quick=[30.0]))
def test_triton_large_scores(name, d, dtype, magnitude):
    import cupy as cp

    check_against_reference(*random_qkv(cp, 1, 2, 300, d, magnitude=magnitude, dtype=dtype), name)


@pytest.mark.parametrize("name,d,dtype", ONCE)
def test_triton_custom_scale(name, d, dtype):
    import cupy as cp

    check_against_reference(*random_qkv(cp, 1, 2, 130, d, dtype=dtype), name, scale=0.5)


@pytest.mark.parametrize("name,d,dtype", ONCE)
@pytest.mark.parametrize("T", tiered([1, 97, 1000], quick=[1, 97]))
def test_triton_noncausal(name, d, dtype, T):
    import cupy as cp

    check_general(*random_qkv_gqa(cp, 2, 3, 3, T, T, d, dtype=dtype), name, causal=False)


@pytest.mark.parametrize("name,d,dtype", ONCE)
@pytest.mark.parametrize("T_q,T_k", tiered([(1, 1000), (17, 257), (97, 1024), (300, 97)], quick=[(1, 1000), (300, 97)]))
def test_triton_cross_lengths(name, d, dtype, T_q, T_k):
    """Causal with the mask aligned bottom-right (T_q > T_k: the first rows see nothing, zeros), and non-causal."""
    import cupy as cp

    q, k, v = random_qkv_gqa(cp, 2, 3, 3, T_q, T_k, d, dtype=dtype)
    check_general(q, k, v, name)
    check_general(q, k, v, name, causal=False)


@pytest.mark.parametrize("name,d,dtype", ONCE)
@pytest.mark.parametrize("NH,NH_kv", [(12, 3), (12, 1)])
def test_triton_grouped_query_heads(name, d, dtype, NH, NH_kv):
    import cupy as cp

    check_general(*random_qkv_gqa(cp, 2, NH, NH_kv, 257, 257, d, dtype=dtype), name)
    check_general(*random_qkv_gqa(cp, 2, NH, NH_kv, 1, 700, d, dtype=dtype), name)


# quick: plain "tf32"; "ieee" (float32 FMAs, no tensor cores) is far slower to compile and autotune
@pytest.mark.parametrize("name,precision", tiered(precision_cases(), quick=lambda case: case[1] == "tf32"))
@pytest.mark.parametrize("T_q,T_k,causal", tiered([(257, 257, True), (97, 1024, False), (300, 97, True)], quick=[(97, 1024, False)]))
def test_triton_every_float32_precision(name, precision, T_q, T_k, causal):
    """"ieee" (no tensor cores) and plain "tf32", each held to its declared factor."""
    import cupy as cp

    q, k, v = random_qkv_gqa(cp, 2, 4, 2, T_q, T_k, 64, dtype="float32")
    check_general(q, k, v, name, causal=causal, config=precision)


@pytest.mark.exhaustive  # every tile shape x head size x dtype, each a compile: the quick tier runs the autotuner's picks
@pytest.mark.parametrize("name", RUNGS)
def test_triton_every_declared_tile_shape(name):
    """Each of the autotuner's tile shapes pinned, for every dtype and head size, self and cross,
    causal and not: a shape the autotuner never picked here must still be right. A shape the
    device's shared memory cannot hold at some head size and dtype is skipped there."""
    import cupy as cp
    from triton.runtime.errors import OutOfResources

    rung, ran = triton_rungs.load(name), 0
    for tiles in triton_rungs.configs(name):
        for d in rung.head_sizes():
            for dtype in rung.dtypes:
                q, k, v = random_qkv_gqa(cp, 2, 4, 2, 201, 201, d, dtype=dtype)
                q2, k2, v2 = random_qkv_gqa(cp, 1, 2, 1, 300, 97, d, dtype=dtype)
                try:
                    check_general(q, k, v, name, config=tiles)
                except OutOfResources:
                    continue
                check_general(q, k, v, name, config=tiles, causal=False)
                check_general(q2, k2, v2, name, config=tiles)
                check_general(q2, k2, v2, name, config=tiles, causal=False)
                ran += 1
    assert ran, f"{name}: no tile shape fits this device"


@pytest.mark.parametrize("name", RUNGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_triton_nan_reaches_every_row_that_sees_it(name, dtype, where):
    check_nan_reaches(name, where, T_q=100, T_k=100, row=40, dtype=dtype)
    check_nan_reaches(name, where, T_q=300, T_k=97, row=250 if where == "q" else 40, dtype=dtype)


@pytest.mark.parametrize("name", RUNGS)
def test_triton_inf_in_v_is_not_masked(name):
    import cupy as cp

    q, k, v = random_qkv(cp, 1, 1, 70, 64)
    v[0, 0, 30, 5] = cp.inf
    out = kernels.attention(q, k, v, kernel=name)
    assert not bool(cp.isfinite(out[0, 0, 30:, 5]).any()), f"{name}: an Inf in V was masked"


@pytest.mark.parametrize("name", RUNGS)
def test_triton_runs_on_cupys_current_stream(name):
    """Prepared under a non-blocking CuPy stream; then, on that stream, tens of milliseconds of
    matrix products before the inputs are written, and the launch with no sync between. Right only
    if the launch waits for the writes in that stream's order: a launch on another stream (the
    legacy default does not wait for a non-blocking one) would read the zeros."""
    import cupy as cp

    q0, k0, v0 = random_qkv(cp, 4, 12, 1024, 64)
    expected = kernels.reference_attention(q0, k0, v0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = (cp.zeros_like(x) for x in (q0, k0, v0))
        run = kernels.prepare(q, k, v, kernel=name)
        run()  # compiled and autotuned before the race
        stream.synchronize()
        busy = cp.full((8192, 8192), 1e-4, dtype=cp.float32)
        for _ in range(3):
            busy = busy @ busy
        for x, x0 in ((q, q0), (k, k0), (v, v0)):
            x[...] = x0 + 0 * busy[0, 0]  # after the products, in the stream's order
        got = run()
    stream.synchronize()
    assert float(cp.abs(got - expected).max()) < 1e-4


@pytest.mark.parametrize("name", RUNGS)
def test_triton_prepared_run_reads_new_contents_and_reports_its_tiles(name):
    """prepare() holds views of the caller's arrays (no copies): new contents, same launch."""
    import cupy as cp

    q, k, v = random_qkv(cp, 2, 4, 300, 64)
    run = kernels.prepare(q, k, v, kernel=name)
    assert run.reads_inputs and "autotuned" in run.instance.describe()
    first = run().copy()
    q *= 2.0
    second = run()
    assert float(cp.abs(second - kernels.reference_attention(q, k, v)).max()) < 1e-4
    assert float(cp.abs(second - first).max()) > 1e-3
    assert "BLOCK_M=" in run.instance.describe() and run.instance.config == "tf32x3"


@pytest.mark.parametrize("name", RUNGS)
def test_triton_as_the_models_attention(name):
    """kernels.Attend with a Triton rung, as gpt2.forward calls it and as gpt2.fast prepares it."""
    import cupy as cp

    q, k, v = random_qkv(cp, 1, 12, 77, 64, packed=True)
    attend = kernels.Attend(name)
    ref = kernels.reference_attention(q, k, v)
    assert float(cp.abs(attend(q, k, v) - ref).max()) < 1e-4
    assert float(cp.abs(attend.prepare(q, k, v)() - ref).max()) < 1e-4


def test_triton_bad_config_is_a_clear_error():
    import cupy as cp

    q, k, v = random_qkv(cp, 1, 1, 8, 64)
    with pytest.raises(ValueError, match="precision 'fp16' is not one of"):
        kernels.attention(q, k, v, kernel="t01", config="fp16")
    with pytest.raises(ValueError, match="tile shape .* is not one of its CONFIGS"):
        kernels.attention(q, k, v, kernel="t01", config={"BLOCK_M": 48, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
    with pytest.raises(TypeError, match="float64"):
        kernels.attention(q.astype(cp.float64), k, v, kernel="t01")
    assert math.isfinite(float(kernels.attention(q, k, v, kernel="t01").sum()))
