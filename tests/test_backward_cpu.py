"""The backward pass without a GPU: the reference gradients against central differences in float64,
grouped-query sums and causal masks; the backward ladder's discovery and declarations, lab.tma's and the
descriptors a rung gets; every backward rung's phases compiled with NVRTC for sm_80 and sm_90 without
spills; input validation."""

import numpy as np
import pytest

import kernels
from kernels import backward, driver
from kernels.backward import launcher

ARCHES = ["sm_80", "sm_90"]
RUNGS = backward.names()


# -- the reference gradients ----------------------------------------------------------------------


def loss(q, k, v, do, causal, scale):
    """sum(O * dO): its gradient with respect to q, k, v is (dq, dk, dv) given dO = do."""
    return float((kernels.reference_attention(q, k, v, causal=causal, scale=scale) * do).sum())


def random_problem(rng, B, NH, NH_kv, T_q, T_k, d):
    q, do = rng.standard_normal((2, B, NH, T_q, d))
    k, v = rng.standard_normal((2, B, NH_kv, T_k, d))
    return q, k, v, do


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("NH,NH_kv,T_q,T_k", [(2, 2, 1, 1), (2, 2, 9, 9), (3, 3, 5, 12), (2, 2, 12, 5), (4, 2, 7, 7),
                                              (6, 2, 10, 6)])
def test_reference_gradients_are_the_directional_derivative(causal, NH, NH_kv, T_q, T_k):
    """For random directions e: (L(x + h e) - L(x - h e)) / 2h = <grad L, e> for L = sum(O o dO), in
    float64, h = 1e-5 (the central difference's error, h^2 times the third derivative, is far below the
    tolerance); each input alone and all at once. Rows that see no key (causal, T_q > T_k) are in it."""
    rng = np.random.default_rng(T_q * 100 + T_k + NH)
    q, k, v, do = random_problem(rng, 2, NH, NH_kv, T_q, T_k, 8)
    scale = 0.4
    grads = kernels.reference_attention_backward(q, k, v, None, None, do, causal=causal, scale=scale)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == np.float64 for g in grads)
    h = 1e-5
    for which in (0, 1, 2, None):
        e = [rng.standard_normal(x.shape) if which in (None, i) else np.zeros(x.shape) for i, x in enumerate((q, k, v))]
        plus = loss(*(x + h * dx for x, dx in zip((q, k, v), e)), do, causal, scale)
        minus = loss(*(x - h * dx for x, dx in zip((q, k, v), e)), do, causal, scale)
        analytic = sum(float((g * dx).sum()) for g, dx in zip(grads, e))
        assert abs((plus - minus) / (2 * h) - analytic) <= 1e-7 * max(1.0, abs(analytic)), (which, analytic)


def test_reference_grouped_query_gradients_sum_the_group():
    """dk and dv of a K/V head are the sums of the gradients its query heads would give it alone."""
    rng = np.random.default_rng(1)
    q, k, v, do = random_problem(rng, 2, 6, 2, 11, 11, 8)
    dq, dk, dv = kernels.reference_attention_backward(q, k, v, None, None, do)
    dq_r, dk_r, dv_r = kernels.reference_attention_backward(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1),
                                                            None, None, do)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 11, 8).sum(axis=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 11, 8).sum(axis=2), rtol=1e-12, atol=1e-12)


def test_reference_causal_gradients_respect_the_mask():
    """Causal, bottom-right: a key that no query sees gets dk = dv = 0; a query that sees no key gets
    dq = 0 and gives nothing to dk and dv; later keys never reach earlier rows' dq."""
    rng = np.random.default_rng(2)
    q, k, v, do = random_problem(rng, 1, 2, 2, 9, 5, 8)  # rows 0-3 see no key
    dq, dk, dv = kernels.reference_attention_backward(q, k, v, None, None, do)
    assert (dq[:, :, :4] == 0).all() and (dq[:, :, 4:] != 0).all()
    do2 = do.copy()
    do2[:, :, :4] = rng.standard_normal(do2[:, :, :4].shape)  # rows that see nothing: no effect
    for a, b in zip((dk, dv), kernels.reference_attention_backward(q, k, v, None, None, do2)[1:]):
        np.testing.assert_array_equal(a, b)
    q, k, v, do = random_problem(rng, 1, 1, 1, 8, 8, 8)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 5:], v2[:, :, 5:] = rng.standard_normal((2, 1, 1, 3, 8))
    dq_a = kernels.reference_attention_backward(q, k, v, None, None, do)[0]
    dq_b = kernels.reference_attention_backward(q, k2, v2, None, None, do)[0]
    np.testing.assert_array_equal(dq_a[:, :, :5], dq_b[:, :, :5])  # rows 0-4 do not see keys 5-7


def test_reference_takes_the_forward_outputs_it_is_given():
    rng = np.random.default_rng(3)
    q, k, v, do = random_problem(rng, 1, 2, 2, 6, 6, 8)
    o, lse = kernels.reference_attention(q, k, v, return_lse=True)
    given = kernels.reference_attention_backward(q, k, v, o, lse, do)
    for a, b in zip(given, kernels.reference_attention_backward(q, k, v, None, None, do)):
        np.testing.assert_array_equal(a, b)
    shifted = kernels.reference_attention_backward(q, k, v, o, lse + np.log(2.0), do)  # P halved
    np.testing.assert_allclose(shifted[2], given[2] / 2, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_in_the_inputs_dtype(dtype):
    """float32: float32 arithmetic; 16-bit: the low-precision recipe, gradients in the dtype, close to
    float64 (a few of the dtype's epsilons of the largest gradient) and not equal to it."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rng = np.random.default_rng(4)
    q, k, v, do = (x.astype(np.float32).astype(dtype) for x in random_problem(rng, 1, 2, 2, 33, 33, 16))
    o, lse = kernels.reference_attention(q, k, v, return_lse=True)
    got = kernels.reference_attention_backward(q, k, v, o, lse, do)
    exact = kernels.reference_attention_backward(*(x.astype(np.float64) for x in (q, k, v, o)), lse.astype(np.float64),
                                                 do.astype(np.float64))
    eps = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    for g, e in zip(got, exact):
        assert g.dtype == np.dtype(dtype)
        err = np.abs(g.astype(np.float64) - e).max()
        assert 0 < err < 8 * eps * np.abs(e).max()


def test_reference_backward_rejects_bad_input():
    x = np.ones((1, 2, 4, 8))
    with pytest.raises(ValueError, match="4-d"):
        kernels.reference_attention_backward(x, x, x, None, None, x[0])
    with pytest.raises(ValueError, match="shapes disagree"):
        kernels.reference_attention_backward(x, x, x, x, np.zeros((1, 2, 5)), x)


# -- discovery and declarations ------------------------------------------------------------------


def test_backward_rungs_are_discovered_in_ladder_order():
    assert RUNGS[0] == "b01_naive"
    numbers = [int(n[1:3]) for n in RUNGS]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert kernels.backward_names() == RUNGS


@pytest.mark.parametrize("name", RUNGS)
def test_every_spelling_resolves_to_the_same_backward_rung(name):
    path = backward.resolve(name)
    number = int(name[1:3])
    assert backward.resolve(f"b{number}") == backward.resolve(f"b{number:02d}") == backward.resolve(str(path)) == path
    assert backward.owns(f"b{number}") and not backward.owns(f"v{number}")


def test_unknown_backward_kernel_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown backward kernel 'b99'.*b01_naive"):
        backward.resolve("b99")


MINIMAL = """\
/*
 * lab.template   d_head, B_r, B_c, deterministic
 * lab.configs    (64, 32, 64, 0), (64, 32, 64, 1), (32, 16, 16, 1)
 * lab.threads    128
 * lab.smem       4 * B_c * d_head
 * lab.phase      backward_preprocess: query tiles, smem 0
 * lab.phase      backward_dk_dv: key tiles, threads 2 * B_c, 4
 * lab.phase      backward_dq: query tiles, threads min(B_r, 32), smem 0
 * lab.dq_accum   true
 * lab.deterministic deterministic
 */
template <int d_head, int B_r, int B_c, int deterministic>
__global__ void backward_preprocess() {}
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_backward_declarations_are_parsed(tmp_path):
    rung = backward.load(write(tmp_path, "mine.cu", MINIMAL))
    pre, main, dq = rung.phases
    assert (pre.entry, pre.tiles, pre.threads, pre.smem) == ("backward_preprocess", "query", None, "0")
    assert (main.entry, main.tiles, main.threads, main.smem) == ("backward_dk_dv", "key", ("2 * B_c", "4"), None)
    config = (64, 32, 64, 1)
    assert rung.phase_block(main, config) == (128, 4, 1) and rung.phase_smem(main, config) == 4 * 64 * 64
    assert rung.phase_block(pre, config) == (128, 1, 1) and rung.phase_smem(pre, config) == 0
    assert rung.phase_block(dq, config) == (32, 1, 1)
    assert rung.entry_expression(main, config) == "backward_dk_dv<64, 32, 64, 1>"
    assert rung.grid(pre, config, 2, 12, 4, 100, 300) == (4, 12, 2)  # ceil(100 / 32) query tiles, NH heads
    assert rung.grid(main, config, 2, 12, 4, 100, 300) == (5, 4, 2)  # ceil(300 / 64) key tiles, NH_kv heads
    assert [rung.is_deterministic(c) for c in rung.configs] == [False, True, True]
    assert rung.dq_accum and rung.tolerance_factor(config) == 3  # FlashAttention's rule by default


def test_a_persistent_phase_walks_the_tiles_on_a_grid_of_the_sms(tmp_path):
    """`key tiles persistent`: one block an SM, at most a block a tile; every phase then takes NH_kv and B."""
    rung = backward.load(write(tmp_path, "mine.cu", MINIMAL.replace("key tiles, threads", "key tiles persistent, threads")))
    pre, main, _ = rung.phases
    assert main.persistent and not pre.persistent and rung.has_persistent_phase
    config = (64, 32, 64, 1)
    assert rung.grid(main, config, 2, 12, 4, 100, 300, sm_count=132) == (40, 1, 1)  # 5 key tiles x 4 x 2 < 132
    assert rung.grid(main, config, 8, 12, 4, 100, 3000, sm_count=132) == (132, 1, 1)
    assert rung.grid(pre, config, 2, 12, 4, 100, 300, sm_count=132) == (4, 12, 2)  # not persistent: as before
    with pytest.raises(ValueError, match="needs the SM count"):
        rung.grid(main, config, 2, 12, 4, 100, 300)
    assert not backward.load(write(tmp_path, "plain.cu", MINIMAL)).has_persistent_phase


def test_an_unverified_rung_is_tested_but_not_a_default(tmp_path):
    """lab.unverified: a rung landed before a GPU ran it. The tests take every rung; the runs that pick
    rungs by default (bench.py backward, train.py, bench.py train) skip it."""
    rung = backward.load(write(tmp_path, "mine.cu", MINIMAL.replace(" */", " * lab.unverified  not yet run on a GPU\n */", 1)))
    assert rung.unverified == "not yet run on a GPU" and backward.load(write(tmp_path, "plain.cu", MINIMAL)).unverified is None
    unverified = [n for n in RUNGS if backward.load(n).unverified]
    assert backward.default_names() == [n for n in RUNGS if n not in unverified]


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("key tiles, threads", "value tiles, threads"), "must read like"),
    (lambda s: s.replace(" * lab.phase      backward_dq: query tiles, threads min(B_r, 32), smem 0\n", "")
     .replace("backward_dk_dv: key", "backward_preprocess: key"), "appears twice"),
    (lambda s: "\n".join(line for line in s.splitlines() if "lab.phase" not in line), "no lab.phase"),
    (lambda s: s.replace("lab.deterministic deterministic", "lab.deterministic 2"), "not 0 or 1"),
    (lambda s: s.replace("d_head, B_r, B_c, deterministic", "d_head, B_q, B_c, deterministic"), "need template parameter"),
    (lambda s: s.replace("lab.dq_accum", "lab.workspace"), "unknown declaration lab.workspace"),
    (lambda s: s.replace("smem 0\n", "smem B_x\n", 1), "cannot evaluate"),
])
def test_bad_backward_declarations_are_clear_errors(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        backward.load(write(tmp_path, "bad.cu", edit(MINIMAL)))


def test_configurations_are_chosen_by_determinism(tmp_path):
    """deterministic=True: only the deterministic configurations; otherwise the others first."""
    rung = backward.load(write(tmp_path, "mine.cu", MINIMAL))
    assert launcher.candidates(rung, 64, "float32", False) == [(64, 32, 64, 0), (64, 32, 64, 1)]
    assert launcher.candidates(rung, 64, "float32", True) == [(64, 32, 64, 1)]
    assert launcher.candidates(rung, 32, "float32", False) == [(32, 16, 16, 1)]
    with pytest.raises(ValueError, match="is not deterministic"):
        launcher.candidates(rung, 64, "float32", True, config=(64, 32, 64, 0))
    with pytest.raises(ValueError, match="has d_head=32 but the inputs have d=64"):
        launcher.candidates(rung, 64, "float32", False, config=(32, 16, 16, 1))
    with pytest.raises(ValueError, match="supports head sizes 32, 64; got d=128"):
        launcher.candidates(rung, 128, "float32", False)
    no_turns = write(tmp_path, "atomic.cu", MINIMAL.replace("(64, 32, 64, 1), (32, 16, 16, 1)", "(32, 16, 16, 0)"))
    with pytest.raises(ValueError, match=r"no deterministic configuration for d=64 \(lab.deterministic\); b01_naive"):
        launcher.candidates(backward.load(no_turns), 64, "float32", True)


# -- TMA descriptors (lab.tma) --------------------------------------------------------------------

TMA_LINE = " * lab.tma        Q: (B_r, 64), dO: (B_r, 64), dQ_accum: (B_r, 32)\n"


def test_backward_tma_declaration_is_parsed(tmp_path):
    rung = backward.load(write(tmp_path, "tma.cu", MINIMAL.replace(" * lab.dq_accum", TMA_LINE + " * lab.dq_accum")))
    assert rung.tma == (("Q", ("B_r", "64")), ("dO", ("B_r", "64")), ("dQ_accum", ("B_r", "32")))
    assert rung.tma_boxes((64, 32, 64, 0)) == {"Q": (32, 64), "dO": (32, 64), "dQ_accum": (32, 32)}
    assert backward.load(write(tmp_path, "plain.cu", MINIMAL)).tma == ()


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("dO: (B_r, 64)", "dX: (B_r, 64)"), r"lab.tma must read like .*tensors Q, K, V, O, dO, dQ_accum"),
    (lambda s: s.replace(" * lab.dq_accum   true\n", ""), "describes dQ_accum, which exists only with lab.dq_accum"),
    (lambda s: s.replace("dQ_accum: (B_r, 32)", "dQ_accum: (B_r, 512)"), r"dQ_accum box is \(32, 512\)"),
])
def test_bad_backward_tma_declarations_are_clear_errors(tmp_path, edit, message):
    text = edit(MINIMAL.replace(" * lab.dq_accum", TMA_LINE + " * lab.dq_accum"))
    with pytest.raises(ValueError, match=message):
        backward.load(write(tmp_path, "bad.cu", text))


class OnDevice:
    """A NumPy array as the descriptor builder sees a CuPy one: shape, strides, dtype, a device pointer."""

    def __init__(self, array, ptr):
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        self.data = type("data", (), {"ptr": ptr})


TMA_RUNGS = [n for n in RUNGS if backward.load(n).tma]


@pytest.mark.parametrize("name", TMA_RUNGS)
def test_the_backward_launcher_builds_the_declared_descriptors(name):
    """One descriptor per declared tensor, in order, of the arrays the launcher passes (contiguous, 16-bit
    inputs, float32 dQ_accum), each box a whole 128-byte row of the 128-byte swizzle, as the rung's
    shared-memory layouts assume."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rung = backward.load(name)
    B, NH, NH_kv, T_q, T_k = 2, 6, 2, 97, 203
    for config in rung.configs:
        d, dtype = config[0], np.dtype(rung.dtype_of(config) or rung.dtypes[0])
        shapes = {"Q": (B, NH, T_q, d), "O": (B, NH, T_q, d), "dO": (B, NH, T_q, d), "K": (B, NH_kv, T_k, d),
                  "V": (B, NH_kv, T_k, d)}
        tensors = {t: OnDevice(np.empty(shape, dtype), ptr=0x100000 * (i + 1)) for i, (t, shape) in enumerate(shapes.items())}
        tensors["dQ_accum"] = OnDevice(np.empty((B, NH, T_q, d), np.float32), ptr=0x900000)
        maps = launcher.tensor_map_arguments(rung, config, tensors)
        assert len(maps) == len(rung.tma)
        for (t, _), m in zip(rung.tma, maps):
            x = tensors[t]
            assert m.address == x.data.ptr and m.dims == x.shape[::-1], (t, m)
            assert m.dtype == driver.TENSOR_MAP_DTYPES[x.dtype.name] and m.swizzle == driver.CU_TENSOR_MAP_SWIZZLE_128B
            assert m.box[0] * x.dtype.itemsize == 128, f"{name} {config}: {t}'s box rows are {m.box[0]} elements"
            # a tile's rows, or (b06's dQ_accum) one warpgroup's 64 of them
            assert m.box[1] in (rung.params(config)["B_r"], rung.params(config)["B_c"], 64) and m.box[2:] == (1, 1)


# -- compilation without a GPU -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", RUNGS)
def test_every_backward_phase_compiles_without_spills(name, arch):
    rung = backward.load(name)
    if not rung.runs_on(arch):
        pytest.skip(f"{name} declares lab.min_arch sm_{rung.min_arch}")
    reports = launcher.compile_report(name, arch)
    assert len(reports) == len(rung.configs) * len(rung.phases)
    for r in reports:
        assert r.registers > 0, f"{r.kernel} {r.config}: no register count in the ptxas report"
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{r.kernel} {r.config} on {arch}: spills {r}"
        assert r.stack_bytes <= rung.stack, f"{r.kernel} {r.config} on {arch}: {r.stack_bytes} B stack"
        assert r.registers * r.threads <= 65536, f"{r.kernel} {r.config}: a block needs more registers than an SM has"
        assert r.dynamic_smem + r.static_smem <= 227 * 1024, f"{r.kernel} {r.config}: more shared memory than an H100 has"
        assert not r.performance_warnings, f"{r.kernel} {r.config} on {arch}: ptxas says {r.performance_warnings}"
        assert r.threads <= 1024


# rungs whose tiling holds only at d = 64, and why (the newest rung that takes d = 128 runs it there)
D64_ONLY = {"b06_wide_query_tiles": "S^T and dP^T at n128 beside dK_j and dV_j pass the 240 registers at d = 128",
            "b14_wide_stores_d64": "b13's stores on b08's tiles of 128 queries; d = 128 is b13's"}
D128_ONLY = {"b10_tiles_of_80": "80 queries a tile is d = 128's trade; d = 64 keeps b08's tiles of 128",
             "b13_wide_stores": "b10's, dK_j and dV_j written 16 bytes a lane"}


@pytest.mark.parametrize("name", RUNGS)
def test_every_backward_rung_takes_the_lab_features(name):
    """The rungs take what the forward rungs that write the log-sum-exp take: non-causal, cross lengths,
    grouped-query heads, head sizes 64 and 128."""
    rung = backward.load(name)
    assert set(rung.supports) == {"noncausal", "cross", "gqa"}
    assert {64, 128} - set(rung.head_sizes()) == ({128} if name in D64_ONLY else {64} if name in D128_ONLY else set())


# -- input validation (the checks that need no GPU) ----------------------------------------------


def problem(shape=(2, 3, 5, 64), kv_heads=3, T_k=None, dtype=np.float32):
    rng = np.random.default_rng()
    B, NH, T_q, d = shape
    q, o, do = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    k, v = (rng.standard_normal((B, kv_heads, T_k or T_q, d)).astype(dtype) for _ in range(2))
    return q, k, v, o, np.zeros((B, NH, T_q), np.float32), do


def check(*arrays, kernel="b01", causal=True, scale=None):
    launcher.check_layout(*arrays, backward.load(kernel), causal, scale)


def test_valid_backward_layouts_pass():
    check(*problem())
    check(*problem((2, 6, 5, 128), kv_heads=2, T_k=9), causal=False)


@pytest.mark.parametrize("edit,error,message", [
    (lambda a: (a[0].astype(np.float64),) + a[1:], TypeError, "dtype float64"),
    (lambda a: a[:3] + (a[3][:, :, :4],) + a[4:], ValueError, r"o must have q's shape \(2, 3, 5, 64\)"),
    (lambda a: a[:5] + (a[5].astype(np.float16),), ValueError, "do must have q's shape .* and dtype float32"),
    (lambda a: a[:4] + (a[4].astype(np.float64),) + a[5:], ValueError, r"lse must be float32 of shape \(B, NH, T_q\)"),
    (lambda a: a[:4] + (a[4][:, :, :3],) + a[5:], ValueError, "return_lse=True"),
    (lambda a: (a[0][..., :48],) + a[1:], ValueError, "shapes disagree"),
    (lambda a: problem((2, 3, 5, 80)), ValueError, "supports head sizes .*got d=80"),
])
def test_bad_backward_inputs_are_clear_errors(edit, error, message):
    with pytest.raises(error, match=message):
        check(*edit(problem()))


def test_unsupported_features_name_the_backward_rungs_that_have_them(tmp_path):
    plain = write(tmp_path, "causal_only.cu", MINIMAL)
    with pytest.raises(ValueError, match=r"does not support causal=False; b01_naive"):
        check(*problem(), kernel=str(plain), causal=False)


def test_numpy_arrays_are_refused_by_backward_rungs():
    with pytest.raises(TypeError, match="NumPy array.*reference_attention_backward"):
        kernels.attention_backward(*problem(), kernel="b01")


def test_unknown_kernel_in_attention_backward():
    with pytest.raises(ValueError, match="known backward kernels are b01_naive"):
        kernels.attention_backward(*problem(), kernel="b00")
