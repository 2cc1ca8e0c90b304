"""Every backward rung against float64 on the GPU, by FlashAttention's rule: each gradient's largest
error against the float64 gradients at most the rung's lab.tolerance (3 by default) times that of the
plain implementation in the same dtype (kernels.reference_attention_backward in float32, or its
16-bit recipe). That error is floored at the dtype's epsilon times the gradient's largest magnitude,
and at float32's epsilon times its largest single term (term_scale), so that a lucky plain result
does not demand bit-exactness: at T = 1, dS = P (dP - D) is exactly 0 in float64 (O is V), and any
implementation's dq and dk are the rounding of dP and D, each to the nearest float32 at best (every
recipe computes them in float32, 16-bit inputs included).

The rung and the plain implementation get the same o and lse, the plain forward's in the same dtype
(reference_attention(..., return_lse=True)), and float64 evaluates the same formulas on them: what is
measured is the backward's own arithmetic. test_backward_after_a_forward_rung runs a forward rung
that writes the log-sum-exp first and measures both passes together against the float64 forward
and backward. Every output is poisoned with NaN before the measured run."""

import math
import secrets

import pytest

import kernels
from kernels import backward
from kernels.backward import launcher
from tests.tiers import first_of_each_rung, spread, tiered

pytestmark = pytest.mark.gpu

RUNGS = backward.names()
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# every rung x head size 64 and 128 x every dtype it declares
CASES = [(name, d, dtype) for name in RUNGS for d in (64, 128) if d in backward.load(name).head_sizes()
         for dtype in backward.load(name).dtypes]
SHAPES = [  # B, NH, NH_kv, T_q, T_k, causal
    (2, 3, 3, 1, 1, True),
    (2, 3, 3, 17, 17, True),
    (1, 2, 2, 97, 97, True),
    (1, 2, 2, 97, 97, False),
    (1, 2, 2, 1000, 1000, True),
    (1, 2, 2, 1025, 1025, False),
    (1, 1, 1, 2048, 2048, True),
    (1, 1, 1, 8192, 8192, True),  # bench.py backward's longest: a sum over every query row grows with T
    (1, 2, 2, 113, 203, True),
    (1, 2, 2, 203, 113, True),  # causal, bottom-right: rows 0-89 see no key
    (1, 2, 2, 113, 203, False),
    (1, 4, 1, 257, 257, True),  # grouped-query heads, 4 a group
    (2, 6, 2, 300, 300, False),
]
QUICK_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[9], SHAPES[11]]  # T = 1, non-causal 97, causal cross, grouped heads


def shape_id(shape):
    B, NH, NH_kv, T_q, T_k, causal = shape
    heads = f"{NH}h" if NH == NH_kv else f"{NH}h{NH_kv}kv"
    return f"{B}x{heads}x{T_q}" + (f"x{T_k}" if T_k != T_q else "") + ("" if causal else "-noncausal")


def random_inputs(cp, B, NH, NH_kv, T_q, T_k, d, dtype, seed=None):
    """Fresh standard-normal q, k, v, do; without a seed, a new one each run, printed (pytest shows a failing
    test's output), so that a failure seen once can be run again on the same inputs."""
    if seed is None:
        seed = secrets.randbits(32)
        print(f"random_inputs: seed={seed} ({B}x{NH}/{NH_kv}x{T_q}x{T_k}, d={d}, {dtype})")
    rng = cp.random.default_rng(seed)
    q, do = ((rng.standard_normal((B, NH, T_q, d), dtype=cp.float32)).astype(dtype) for _ in range(2))
    k, v = ((rng.standard_normal((B, NH_kv, T_k, d), dtype=cp.float32)).astype(dtype) for _ in range(2))
    return q, k, v, do


def term_scale(q, k, v, o, lse, do, causal=True, scale=None):
    """The largest single term each of dq, dk, dv sums, in float64, with dS's two parts apart:
    scale P_ij (|dP_ij| + |D_i|) |k_j|, scale P_ij (|dP_ij| + |D_i|) |q_i| and P_ij |do_i| at their
    largest. Rounding dP_ij and D_i once each moves dq, dk by eps times that much."""
    import cupy as cp

    q, k, v, o, lse, do = (x.astype(cp.float64) for x in (q, k, v, o, lse, do))
    group = q.shape[1] // k.shape[1]
    k, v = (cp.repeat(x, group, axis=1) for x in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        T_q, T_k = S.shape[-2:]
        S = cp.where(cp.arange(T_k)[None, :] <= cp.arange(T_q)[:, None] + (T_k - T_q), S, -cp.inf)
    P = cp.exp(S - lse[..., None])
    dS = P * (cp.abs(do @ v.swapaxes(-1, -2)) + cp.abs((do * o).sum(axis=-1, keepdims=True)))
    largest = [cp.abs(x).max(axis=-1) for x in (k, q, do)]  # (B, NH, T) each
    return [scale * float((dS * largest[0][..., None, :]).max()), scale * float((dS * largest[1][..., :, None]).max()),
            float((P * largest[2][..., :, None]).max())]


def gradient_errors(got, truth, plain, dtype, scales):
    """[(name, max error, plain's max error floored, mean error)] of dq, dk, dv against float64."""
    import cupy as cp

    out = []
    for name, g, t, p, s in zip(("dq", "dk", "dv"), got, truth, plain, scales):
        diff = cp.abs(g.astype(cp.float64) - t)
        floor = max(EPS[dtype] * float(cp.abs(t).max()), EPS["float32"] * s)
        out.append((name, float(diff.max()), max(float(cp.abs(p.astype(cp.float64) - t).max()), floor),
                    float(diff.mean())))
    return out


def check_gradients(name, q, k, v, do, *, causal=True, scale=None, config=None, deterministic=False):
    """The rung's gradients, poisoned first, against float64, from the exact forward's o and lse rounded to
    the inputs' dtype and float32: the rung and the plain implementation get the same o and lse, neither
    of them the rounding of its own scores (a plain forward's lse agrees with the plain backward's scores
    to the last bit, and would hold a rung to the plain one's summation order)."""
    import cupy as cp

    o64, lse64 = kernels.reference_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal, scale=scale,
                                             return_lse=True)
    o, lse = o64.astype(cp.float32).astype(q.dtype), lse64.astype(cp.float32)
    run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=name, causal=causal, scale=scale, config=config,
                                    deterministic=deterministic)
    for g in run():
        g.fill(cp.nan)  # poison: unwritten elements fail
    got = run()
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape] and all(g.dtype == q.dtype for g in got)
    truth = kernels.reference_attention_backward(*(x.astype(cp.float64) for x in (q, k, v, o, lse, do)),
                                                 causal=causal, scale=scale)
    plain = kernels.reference_attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale)
    inst = run.instance
    factor = inst.rung.tolerance_factor(inst.config)
    for grad, g in zip(("dq", "dk", "dv"), got):
        bad = int((~cp.isfinite(g)).sum())
        assert not bad, f"{name} {inst.describe()} {q.shape}: {bad} elements of {grad} NaN or inf (unwritten?)"
    scales = term_scale(q, k, v, o, lse, do, causal, scale)
    for grad, err, plain_err, mean in gradient_errors(got, truth, plain, q.dtype.name, scales):
        assert err <= factor * plain_err, (f"{name} {inst.describe()} q {q.shape} k {k.shape} causal={causal}: {grad} max "
                                           f"error {err:.3e} (mean {mean:.3e}) > {factor} x {plain_err:.3e} (plain)")
    return got


# quick: every case at one of the quick shapes in turn
@pytest.mark.parametrize("shape,name,d,dtype", spread(SHAPES, CASES, quick=QUICK_SHAPES, unpack=False),
                         ids=lambda value: shape_id(value) if isinstance(value, tuple) else None)
def test_backward_rung_matches_float64(name, d, dtype, shape):
    import cupy as cp

    B, NH, NH_kv, T_q, T_k, causal = shape
    check_gradients(name, *random_inputs(cp, B, NH, NH_kv, T_q, T_k, d, dtype), causal=causal)


@pytest.mark.exhaustive  # every configuration: the quick tier runs the ones the launcher picks
@pytest.mark.parametrize("name", RUNGS)
def test_backward_rung_every_declared_config(name):
    import cupy as cp

    rung = backward.load(name)
    limits = kernels.device_limits()
    for config in rung.configs:
        if max(rung.phase_smem(p, config) for p in rung.phases) > limits.max_shared_per_block:
            continue
        for dtype in [rung.dtype_of(config)] if rung.dtype_of(config) else rung.dtypes:
            inputs = random_inputs(cp, 1, 4, 2, 201, 201, config[0], dtype)
            check_gradients(name, *inputs, config=config, deterministic=rung.is_deterministic(config))


@pytest.mark.parametrize("name", RUNGS)
def test_backward_rung_strided_inputs_and_custom_scale(name):
    """Views of one packed projection (the launcher copies them) and a scale that is not 1/sqrt(d)."""
    import cupy as cp

    rung = backward.load(name)
    dtype, d = rung.dtypes[0], min(rung.head_sizes())
    packed = cp.random.standard_normal((2, 130, 4, 3, d), dtype=cp.float32).astype(dtype)
    q, k, v, do = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(4))
    assert not q.flags.c_contiguous
    check_gradients(name, q, k, v, do, scale=0.3)


@pytest.mark.parametrize("NH,NH_kv", [(7, 7), (14, 7)])
def test_b05_non_causal_heads_in_chunks(NH, NH_kv):
    """b05's non-causal grid takes the heads in chunks whose Q, dO and dQ_accum fit 16 MB of L2: at 4096 rows
    and d = 128, 7 heads make chunks of 4 and 3, and 14 query heads over 7 K/V heads chunks of 2, 2, 2 and 1
    (the last chunk short): every key tile of every head must still be visited once."""
    import cupy as cp

    check_gradients("b05", *random_inputs(cp, 1, NH, NH_kv, 4096, 4096, 128, "bfloat16", seed=5), causal=False)


@pytest.mark.parametrize("name", ["b06", "b07", "b08"])
def test_long_causal_grid_in_chunks_of_heads(name):
    """b06's causal grid of 16 waves of blocks or more takes the heads in chunks (16 MB of Q, dO and dQ_accum,
    two waves of blocks at least): 600 heads of 512 rows are 2,400 blocks, past 16 x the SM identifiers of
    an H100 or H200, in chunks of 66-72 heads, the last one short. b07 and b08 walk the same tiles, about 18
    a block."""
    import cupy as cp

    check_gradients(name, *random_inputs(cp, 2, 300, 300, 512, 512, 64, "bfloat16", seed=6), causal=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name,d", [("b07", 64), ("b08", 64), ("b08", 128)])
def test_persistent_blocks_walk_several_tiles(name, d, causal, deterministic):
    """A persistent grid with more tiles than SMs: 8 key tiles x 32 K/V heads (grouped query heads, 4 a
    K/V head) are 256 tiles, two or so a block, the ring and K_j/V_j's barriers carried from tile to tile
    (b08: its dS^T buffers' barriers and turns too, and each tile's last dQ_i share in its own turn)."""
    import cupy as cp

    check_gradients(name, *random_inputs(cp, 4, 32, 8, 1024, 1024, d, "bfloat16", seed=7), causal=causal,
                    deterministic=deterministic)


# every rung x head size x dtype with a deterministic configuration
DETERMINISTIC = [(name, d, dtype) for name, d, dtype in CASES
                 if any(backward.load(name).is_deterministic(c) for c in backward.load(name).configs_for(d, dtype))]


@pytest.mark.parametrize("name,d,dtype", tiered(DETERMINISTIC, quick=first_of_each_rung(DETERMINISTIC)))
def test_deterministic_backward_gives_identical_bits(name, d, dtype):
    """deterministic=True: 50 runs give the same bits in dq, dk and dv (dQ summed in a fixed order),
    at a length where many key tiles add into each query tile, with grouped-query heads; and within the
    rule."""
    import cupy as cp

    q, k, v, do = random_inputs(cp, 2, 4, 2, 1000, 1000, d, dtype)
    o, lse = kernels.reference_attention(q, k, v, return_lse=True)
    run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=name, deterministic=True)
    assert run.instance.rung.is_deterministic(run.instance.config)
    first = [g.copy() for g in run()]
    for i in range(49):
        for name_g, a, b in zip(("dq", "dk", "dv"), first, run()):
            same = bool((a.view(cp.uint8) == b.view(cp.uint8)).all())
            assert same, f"{name} run {i + 2}: {name_g} differs from the first run's bits"
    check_gradients(name, q, k, v, do, deterministic=True)


def forward_rung(dtype: str, d: int) -> str | None:
    """The newest forward rung that writes the log-sum-exp and takes dtype, d and every feature here (one run
    on a GPU: not lab.unverified, as bench.py backward's)."""
    arch = kernels.device_limits().arch
    for n in reversed(kernels.names()):
        rung = kernels.load(n)
        if (rung.lse and not rung.unverified and dtype in rung.dtypes and d in rung.head_sizes() and rung.runs_on(arch)
                and {"noncausal", "cross", "gqa"} <= set(rung.supports)):
            return n
    return None


@pytest.mark.parametrize("name,d,dtype", tiered(CASES, quick=first_of_each_rung(CASES)))
@pytest.mark.parametrize("causal", [True, False])
def test_backward_after_a_forward_rung(name, d, dtype, causal):
    """The forward rung's o and lse into the backward rung, against the float64 forward and backward:
    within the tolerance of the plain implementation doing both passes in the same dtype."""
    import cupy as cp

    forward = forward_rung(dtype, d)
    if forward is None:
        pytest.skip(f"no forward rung writes the log-sum-exp for {dtype}, d={d} here")
    q, k, v, do = random_inputs(cp, 2, 4, 2, 700, 700, d, dtype)
    o, lse = kernels.attention(q, k, v, kernel=forward, causal=causal, return_lse=True)
    run = launcher.prepare_backward(q, k, v, o, lse, do, kernel=name, causal=causal)
    got = run()
    q64, k64, v64, do64 = (x.astype(cp.float64) for x in (q, k, v, do))
    truth = kernels.reference_attention_backward(q64, k64, v64, None, None, do64, causal=causal)
    # The plain backward twice: after its own forward, and after the forward rung's o and lse, whose
    # rounding the backward rung inherits through D = rowsum(dO o O) and P; the bound is the larger.
    plain = kernels.reference_attention_backward(q, k, v, None, None, do, causal=causal)
    plain_after = kernels.reference_attention_backward(q, k, v, o, lse, do, causal=causal)
    factor = run.instance.rung.tolerance_factor(run.instance.config)
    o64, lse64 = kernels.reference_attention(q64, k64, v64, causal=causal, return_lse=True)
    scales = term_scale(q64, k64, v64, o64, lse64, do64, causal)
    bounds = zip(gradient_errors(got, truth, plain, dtype, scales), gradient_errors(got, truth, plain_after, dtype, scales))
    for (grad, err, plain_err, mean), (_, _, plain_after_err, _) in bounds:
        plain_err = max(plain_err, plain_after_err)
        assert err <= factor * plain_err, (f"{forward} then {name} ({dtype}, d={d}, causal={causal}): {grad} max error "
                                           f"{err:.3e} (mean {mean:.3e}) > {factor} x {plain_err:.3e} (plain)")


def test_backward_validation_on_the_gpu():
    import cupy as cp

    q, k, v, do = random_inputs(cp, 1, 2, 2, 8, 8, 64, "float32")
    o, lse = kernels.reference_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must be float32"):
        kernels.attention_backward(q, k, v, o, lse.astype(cp.float64), do, kernel="b01")
    with pytest.raises(TypeError, match="do must be a CuPy array"):
        kernels.attention_backward(q, k, v, o, lse, [1.0], kernel="b01")
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, kernel="b01")
    assert dq.flags.c_contiguous and dk.shape == k.shape and not math.isnan(float(dv.sum()))
