"""The Triton family without a GPU: names and resolution, declarations, the messages when Triton is
missing, validation through the runtime's checks, and the kernel itself under Triton's interpreter
(TRITON_INTERPRET=1, torch CPU tensors) against the float64 reference with the GPU tests' tolerance
rule. The interpreter tests skip where Triton or PyTorch is not installed (they are an optional
extra, not part of the test extra); test_triton_gpu.py runs the compiled kernel on the device."""

import importlib.util
import math
import re

import numpy as np
import pytest

import kernels
from kernels import runtime
from kernels import triton as triton_rungs

# -- names, resolution, declarations -------------------------------------------------------------


def test_triton_rungs_are_listed_apart_from_the_cu_ladder():
    names = kernels.triton_names()
    assert names and names[0] == "t01_fa2"
    for n in names:
        assert re.fullmatch(r"t\d{2}_[a-z0-9_]+", n), f"{n}: Triton rung files are tNN_<change>.py"
    assert not set(names) & set(kernels.names())  # NVRTC compile tests and resource reports never see them


@pytest.mark.parametrize("name", kernels.triton_names())
def test_every_spelling_resolves_to_the_same_triton_rung(name):
    number = int(name[1:3])
    path = triton_rungs.resolve(name)
    assert path.parent.name == "triton" and path.suffix == ".py"
    for spelling in (f"t{number}", f"t{number:02d}", name, str(path)):
        assert triton_rungs.owns(spelling)
        assert triton_rungs.resolve(spelling) == path
    assert not triton_rungs.owns("v01") and not triton_rungs.owns(kernels.resolve("v01"))


def test_unknown_triton_kernel_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown Triton kernel 't99'.*t01_fa2"):
        triton_rungs.resolve("t99")
    with pytest.raises(ValueError, match="unknown Triton kernel"):
        triton_rungs.resolve("t01_wrong_change")
    with pytest.raises(ValueError, match="does not exist"):
        triton_rungs.resolve("/no/such/file.py")


def test_t01_declarations():
    rung = triton_rungs.load("t1")
    assert rung.name == "t01_fa2" and rung.dtypes == ("float32", "bfloat16", "float16")
    assert rung.head_sizes() == [32, 64, 128] and set(rung.supports) == {"noncausal", "cross", "gqa"}
    assert rung.precisions[0] == "tf32x3"  # float32-level accuracy by default
    assert rung.tolerance_factor("tf32x3") == 8 and rung.tolerance_factor("tf32") > 8192


def test_precision_choice():
    rung = triton_rungs.load("t01")
    assert rung.precision("float32") == "tf32x3"
    assert rung.precision("float32", "ieee") == "ieee" and rung.precision("float32", {"precision": "tf32"}) == "tf32"
    assert rung.precision("bfloat16") == "bfloat16" and rung.precision("float16", "float16") == "float16"
    with pytest.raises(ValueError, match="precision 'fp64' is not one of tf32x3, ieee, tf32"):
        rung.precision("float32", "fp64")
    with pytest.raises(ValueError, match="bfloat16 inputs multiply in bfloat16.*'ieee' is for float32"):
        rung.precision("bfloat16", "ieee")


DECLARED = '''"""A user's own Triton rung.

lab.dtypes      float32
lab.head_sizes  64
lab.precisions  ieee
lab.tolerance   ieee 8
"""
'''


def test_a_user_file_by_path_and_bad_declarations(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(DECLARED)
    rung = triton_rungs.load(str(path))
    assert rung.name == "mine" and rung.head_sizes() == [64] and rung.supports == ()
    path.write_text(DECLARED.replace("lab.tolerance   ieee 8\n", ""))
    with pytest.raises(ValueError, match="missing declaration.*lab.tolerance"):
        triton_rungs.load(str(path))
    path.write_text(DECLARED.replace("ieee 8", "tf32 8"))
    with pytest.raises(ValueError, match="lab.tolerance has no factor for ieee"):
        triton_rungs.load(str(path))
    path.write_text(DECLARED.replace("lab.dtypes", "lab.dtype"))
    with pytest.raises(ValueError, match="unknown declaration lab.dtype "):
        triton_rungs.load(str(path))


# -- without Triton: listed, unavailable in one line, and asking for one says how to install ------


def without(monkeypatch, missing):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))


@pytest.mark.parametrize("missing", [("triton",), ("torch",), ("triton", "torch")])
def test_without_triton_the_rungs_are_unavailable_with_one_line(monkeypatch, missing):
    without(monkeypatch, missing)
    why = kernels.triton_unavailable()
    assert why is not None and "\n" not in why
    assert " and ".join(missing) in why and "pip install -e '.[triton]'" in why
    assert "t01_fa2" in kernels.triton_names()  # still listed
    x = np.ones((1, 1, 4, 64), np.float32)
    for ask in (lambda: kernels.attention(x, x, x, kernel="t01"), lambda: kernels.Attend("t1")(x, x, x)):
        with pytest.raises(RuntimeError, match=r"kernel t01_fa2: .*pip install -e '\.\[triton\]'"):
            ask()


# -- validation: the runtime's checks, with the Triton rung's declarations ------------------------


def qkv(shape=(2, 3, 5, 64), kv_shape=None, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape).astype(dtype)
    return (q, *(rng.standard_normal(kv_shape or shape).astype(dtype) for _ in range(2)))


def check(q, k, v, causal=True, scale=None):
    runtime.check_layout(q, k, v, triton_rungs.load("t01"), causal, scale)


def test_triton_rung_takes_what_it_declares():
    import ml_dtypes

    check(*qkv())
    check(*qkv(), causal=False)
    check(*qkv((2, 12, 5, 128), (2, 3, 700, 128)))  # grouped heads, cross lengths
    check(*qkv((1, 2, 9, 32), dtype=ml_dtypes.bfloat16))
    packed = np.zeros((2, 5, 3, 3, 64), np.float32)
    check(*(packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3)))


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: qkv(dtype=np.float64), TypeError, "dtype float64; kernel t01_fa2 supports float32, bfloat16, float16"),
        (lambda: qkv((2, 3, 5, 80)), ValueError, r"kernel t01_fa2 supports head sizes 32, 64, 128; got d=80"),
        (lambda: qkv((2, 3, 5, 64), (2, 2, 5, 64)), ValueError, "multiple of the key/value heads"),
        (lambda: qkv()[:2] + (qkv((2, 3, 6, 64))[0],), ValueError, "shapes disagree"),
        (lambda: tuple(x[..., ::2] for x in qkv((2, 3, 5, 128))), ValueError, "unit stride"),
        (lambda: qkv((2, 3, 0, 64)), ValueError, "empty input"),
    ],
)
def test_triton_rung_bad_layouts_are_the_runtimes_errors(make, error, message):
    with pytest.raises(error, match=message):
        check(*make())


# -- the kernel under Triton's interpreter ---------------------------------------------------------

EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
TILES = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)  # small tiles: many of them at short lengths


@pytest.fixture(scope="module")
def interpreted():
    """t01's module imported afresh with TRITON_INTERPRET=1 (read when @triton.jit runs), under its
    own name, so the package's compiled module is untouched; the environment is restored after."""
    if kernels.triton_unavailable():
        pytest.skip(kernels.triton_unavailable())
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        spec = importlib.util.spec_from_file_location("t01_fa2_interpreted", triton_rungs.resolve("t01"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        probe(module)
    finally:
        mp.undo()
    return module


def probe(module):
    """Skip, with the reason, where this Triton's interpreter cannot run here (Triton 3.6's takes
    int() of a 1-element array, which NumPy 2.4 refuses)."""
    import torch

    x = torch.zeros((1, 1, 1, 32))
    try:
        module.forward(x, x, x, x.clone(), scale=1.0, causal=True, precision="ieee", config=module.CONFIGS[-1])
    except Exception as exc:  # the interpreter's own failure, not the kernel's arithmetic
        if "0-dimensional" in str(exc):
            pytest.skip(f"Triton's interpreter does not run with NumPy {np.__version__}: {exc}")
        raise


def run_interpreted(module, q, k, v, *, causal=True, scale=None, precision="ieee", tiles=TILES):
    """The kernel on NumPy inputs (any strides), checked as test_kernels_gpu.check_against_reference:
    max error against float64 at most the declared factor times the plain implementation's own."""
    import torch

    dtype = q.dtype.name
    to_torch = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]

    def tensor(x):  # the same view (shape, strides, offset) of its NumPy base, converted
        root = x
        while root.base is not None:
            root = root.base
        flat = torch.from_numpy(np.ascontiguousarray(root).astype(np.float32).reshape(-1)).to(to_torch)
        offset = (x.ctypes.data - root.ctypes.data) // x.itemsize
        return torch.as_strided(flat, x.shape, [s // x.itemsize for s in x.strides], offset)

    tq, tk, tv = (tensor(x) for x in (q, k, v))
    out = torch.full(q.shape, float("nan"), dtype=to_torch)  # poison: unwritten elements fail
    d = q.shape[-1]
    scale_used = 1.0 / math.sqrt(d) if scale is None else scale
    module.forward(tq, tk, tv, out, scale=scale_used, causal=causal, precision=precision, config=tiles)
    got = out.to(torch.float64).numpy()
    ref64 = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal, scale=scale)
    plain = kernels.reference_attention(q, k, v, causal=causal, scale=scale).astype(np.float64)
    err = float(np.abs(got - ref64).max())
    floor = EPS[dtype] * float(np.abs(ref64).max())
    factor = triton_rungs.load("t01").tolerance_factor(precision if dtype == "float32" else dtype)
    bound = factor * max(float(np.abs(plain - ref64).max()), floor)
    assert not math.isnan(err), f"NaN in output ({int(np.isnan(got).sum())} elements unwritten or NaN)"
    assert err <= bound, f"q {q.shape} k {k.shape} causal={causal}: max error {err:.3e} > {bound:.3e}"


def draw(B, NH, NH_kv, T_q, T_k, d, dtype="float32", seed=0, magnitude=1.0):
    import ml_dtypes  # noqa: F401  (bfloat16 for NumPy)

    rng = np.random.default_rng(seed)
    shapes = ((B, NH, T_q, d), (B, NH_kv, T_k, d), (B, NH_kv, T_k, d))
    return tuple((rng.standard_normal(s) * magnitude).astype(np.float32).astype(dtype) for s in shapes)


@pytest.mark.parametrize("T", [1, 17, 97])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_interpreted_self_attention(interpreted, T, causal):
    run_interpreted(interpreted, *draw(2, 2, 2, T, T, 32, seed=T), causal=causal)


@pytest.mark.parametrize("T_q,T_k", [(1, 70), (17, 57), (70, 23), (40, 40)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_interpreted_cross_lengths_and_grouped_heads(interpreted, T_q, T_k, causal):
    """Bottom-right causal mask; with T_q > T_k the first T_q - T_k rows see nothing and are zeros."""
    run_interpreted(interpreted, *draw(1, 4, 2, T_q, T_k, 32, seed=T_q + T_k), causal=causal)
    run_interpreted(interpreted, *draw(1, 3, 1, T_q, T_k, 16, seed=T_q * T_k), causal=causal)


def test_interpreted_strided_views_and_scale(interpreted):
    rng = np.random.default_rng(1)
    packed = rng.standard_normal((2, 45, 3, 3, 32)).astype(np.float32)  # (B, T, q/k/v, NH, d), as the model makes
    q, k, v = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    assert not q.flags.c_contiguous
    run_interpreted(interpreted, q, k, v)
    run_interpreted(interpreted, q, k, v, scale=0.5, causal=False)


def test_interpreted_large_scores_rescale(interpreted):
    run_interpreted(interpreted, *draw(1, 2, 2, 90, 90, 32, seed=3, magnitude=8.0))


def interpreter_dot_is_exact(dtype):
    """Whether the interpreter's tl.dot multiplies `dtype` as numbers (Triton 3.6's multiplies
    bfloat16's raw bits)."""
    import torch
    import triton
    import triton.language as tl

    def product(X, Y):
        r = tl.arange(0, 16)
        x = tl.load(X + r[:, None] * 16 + r[None, :])
        tl.store(Y + r[:, None] * 16 + r[None, :], tl.dot(x, x))

    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        kernel = triton.jit(product)
    finally:
        mp.undo()
    x = torch.eye(16).to(getattr(torch, dtype)) * 2
    y = torch.empty(16, 16)
    kernel[(1,)](x, y)
    return bool((y == 4 * torch.eye(16)).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_interpreted_16_bit(interpreted, dtype):
    if not interpreter_dot_is_exact(dtype):
        pytest.skip(f"this Triton's interpreter multiplies {dtype}'s raw bits in tl.dot: {dtype} runs on the device only")
    run_interpreted(interpreted, *draw(1, 2, 1, 50, 77, 32, dtype=dtype), precision="tf32")
    run_interpreted(interpreted, *draw(1, 2, 2, 33, 33, 32, dtype=dtype), precision="tf32", causal=False)


def test_interpreted_every_declared_tile_shape(interpreted):
    for tiles in interpreted.CONFIGS:
        run_interpreted(interpreted, *draw(1, 2, 1, 150, 131, 32, seed=7), tiles=tiles)
