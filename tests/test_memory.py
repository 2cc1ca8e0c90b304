"""What a run holds, counted on the CPU with NumPy standing in for CuPy: the weights loaded in the
run's dtype (never float32 first), GPT-2's Conv1D weights laid out once so that the fast engine's
weights are views of them (no array held twice, each in the run's dtype), products in the weights'
dtype without a float32 copy, and lab.py's memory figures against the bound."""

import ml_dtypes
import numpy as np
import pytest

import gpt2
import gpt2.fast as fast
import llama
from gpt2 import GPT2Config, forward, reference_attend
from lm.arrays import byte_span, cast_params, held_bytes, to_device
from lm.kv_cache import KVCache, kv_cache_bytes
from lm.products import matmul
from lm.summary import MEMORY_HEADROOM, memory_figures, memory_rows

TINY = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=64)
TINY_LLAMA = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
BF16 = np.dtype(ml_dtypes.bfloat16)


def matrices(params):
    return {k: a for k, a in params.items() if a.ndim == 2}


# -- counting bytes ---------------------------------------------------------------------------------


def test_held_bytes_counts_each_byte_once():
    a = np.zeros((8, 16), np.float32)
    b = np.zeros(100, np.uint16)
    assert held_bytes([a]) == a.nbytes
    assert held_bytes([a, a[2:5], a.T, a[:, 3]]) == a.nbytes  # views add nothing
    assert held_bytes([a, b]) == a.nbytes + b.nbytes
    assert held_bytes([a[1:3], a[2:4]]) == 3 * 16 * 4  # overlapping rows once
    assert held_bytes([a, b], besides=[a]) == b.nbytes
    assert held_bytes([a, b], besides=[a[:4], a[2:6]]) == a.nbytes - 6 * 16 * 4 + b.nbytes
    assert held_bytes([]) == 0


def test_byte_span_covers_any_strides():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    lo, hi = byte_span(a)
    assert hi - lo == a.nbytes
    assert byte_span(a[::-1]) == (lo, hi)  # negative strides: the same bytes
    assert byte_span(a[1:3, 2]) == (lo + (6 + 2) * 4, lo + (12 + 2) * 4 + 4)
    assert byte_span(a[:0])[0] == byte_span(a[:0])[1]


def test_kv_cache_bytes_are_those_the_eager_cache_allocates():
    for config, dtype in ((TINY, np.float32), (TINY_LLAMA, BF16)):
        cache = KVCache(config, 1, 37, np, dtype)
        assert kv_cache_bytes(config, 37, dtype) == cache.k.nbytes + cache.v.nbytes


# -- loading in the run's dtype ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_weights_are_drawn_into_the_run_s_dtype(family, dtype):
    """The values cast_params gives the float32 draw, every tensor in dtype from the start."""
    module, config = (gpt2, TINY) if family == "gpt2" else (llama, TINY_LLAMA)
    direct = module.random_weights(config, seed=4, dtype=dtype).params
    cast = cast_params(module.random_weights(config, seed=4).params, dtype)
    assert direct.keys() == cast.keys()
    for name, a in direct.items():
        assert a.dtype.name == dtype and a.shape == cast[name].shape, name
        np.testing.assert_array_equal(a.view(np.uint8), cast[name].view(np.uint8), err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoints_load_into_the_run_s_dtype(tmp_path, dtype):
    ckpt = gpt2.random_weights(TINY, seed=5)
    folder = gpt2.save(ckpt, tmp_path / "gpt2")
    loaded = gpt2.load(folder, dtype=dtype).params
    want = cast_params(ckpt.params, dtype)
    assert all(loaded[k].dtype.name == dtype and np.array_equal(loaded[k].view(np.uint8), want[k].view(np.uint8))
               for k in want)
    lckpt = llama.random_weights(TINY_LLAMA, seed=5, dtype=dtype)
    lfolder = llama.save(lckpt, tmp_path / "llama", shards=2)
    lloaded = llama.load(lfolder, dtype=dtype).params
    assert all(lloaded[k].dtype.name == dtype and np.array_equal(lloaded[k].view(np.uint8),
                                                                   lckpt.params[k].view(np.uint8)) for k in lloaded)


def test_to_device_casts_on_the_host():
    a = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    b = to_device(np, a, "bfloat16")
    assert b.dtype == BF16 and b.flags.c_contiguous
    np.testing.assert_array_equal(b, a.astype(BF16))
    assert to_device(np, a) is a
    with pytest.raises(ValueError, match="float64: the model runs float32, float16 or bfloat16"):
        to_device(np, a, "float64")


# -- products -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matmul_takes_the_weights_dtype_and_reads_a_transpose_where_it_lies(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    w = rng.standard_normal((7, 48)).astype(dtype)  # (out, in), as Llama stores it
    want = x.astype(dtype).astype(np.float64) @ w.astype(np.float64).T  # the operands rounded, an exact sum
    y = matmul(x, w.T)
    assert y.dtype.name == dtype and y.shape == (5, 7)
    eps = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    assert np.abs(y.astype(np.float64) - want).max() <= 2 * eps * np.abs(want).max()
    logits = matmul(x, w.T, np.float32)
    assert logits.dtype == np.float32
    assert np.abs(logits - want).max() <= 64 * 2.0**-23 * np.abs(x).sum(axis=1).max() * np.abs(w.astype(np.float32)).max()



def test_matmul_writes_into_out_or_adds_into_it():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    out = np.full((5, 3), np.nan, dtype=np.float32)
    assert matmul(x, w, out=out) is out
    np.testing.assert_array_equal(out, x @ w)
    start = rng.standard_normal((5, 3)).astype(np.float32)
    out[...] = start
    matmul(x, w, out=out, accumulate=True)
    np.testing.assert_allclose(out, start + x @ w, rtol=1e-6)
    with pytest.raises(ValueError, match="accumulate needs out"):
        matmul(x, w, accumulate=True)

# -- the fast engine's weights --------------------------------------------------------------------------


def test_decode_layout_changes_the_layout_alone():
    """Each Conv1D weight (in, out) column-major: the same values, shape and dtype, its transpose the
    row-major (out, in) the decode kernels read; the eager model's logits do not change."""
    params = dict(gpt2.random_weights(TINY, seed=1).params)
    before = {k: a.copy() for k, a in params.items()}
    ids = np.arange(10)[None] * 7
    want = forward(params, TINY, ids, reference_attend)
    assert fast.decode_layout(params) is params
    for name, a in params.items():
        np.testing.assert_array_equal(a, before[name], err_msg=name)
        linear = name.endswith(tuple(f"{n}.weight" for n in fast.LINEAR))
        assert a.T.flags.c_contiguous == linear or a.ndim == 1, name
    np.testing.assert_allclose(forward(params, TINY, ids, reference_attend), want, rtol=1e-5, atol=1e-6)
    laid = {k: params[k] for k in params}
    fast.decode_layout(params)  # once is enough: nothing moves again
    assert all(params[k] is laid[k] for k in params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_weights_are_views_of_weights_laid_out_in_the_run_s_dtype(dtype):
    """With params in the run's dtype and decode_layout's layout, the engine's matrices are views of
    them: no byte of a matrix held twice; each in the kernels' element type, each row contiguous. Only
    the vectors (biases, LayerNorm) of a bfloat16 run are widened to float32."""
    params = fast.decode_layout(gpt2.random_weights(TINY, seed=2, dtype=dtype).params)
    w = fast.decode_weights(np, params, TINY, dtype)
    arrays = w.arrays()
    kernel_type = np.uint16 if dtype == "bfloat16" else np.float32
    mats = {k: a for k, a in arrays.items() if a.ndim == 2}
    assert len(mats) == 2 + 4 * TINY.n_layer
    assert all(a.dtype == kernel_type and a.flags.c_contiguous for a in mats.values())
    assert held_bytes(mats.values(), besides=params.values()) == 0  # every matrix a view of params
    assert held_bytes(mats.values()) == sum(a.nbytes for a in matrices(params).values())
    vectors = [a for a in arrays.values() if a.ndim == 1]
    assert all(a.dtype == np.float32 for a in vectors)
    widened = 0 if dtype == "float32" else sum(a.nbytes for a in vectors)
    assert held_bytes(arrays.values(), besides=params.values()) == widened
    assert held_bytes(arrays.values()) == sum(a.nbytes for a in arrays.values())  # no two arrays overlap
    layer = w.layers[1]["mlp.c_fc"]  # (out, in) = the Conv1D weight's transpose, bit for bit
    np.testing.assert_array_equal(layer, params["h.1.mlp.c_fc.weight"].T.view(kernel_type))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_copies_each_weight_once_when_params_are_not_laid_out(dtype):
    """float32 params as loaded (row-major Conv1D weights): the engine makes one copy of each linear
    weight (and, for bfloat16, of wte and wpe too), never more, in the kernels' element type."""
    params = gpt2.random_weights(TINY, seed=2).params
    w = fast.decode_weights(np, params, TINY, dtype)
    item = 2 if dtype == "bfloat16" else 4
    linear = sum(a.size for k, a in matrices(params).items() if k.startswith("h."))
    tables = sum(params[k].size for k in ("wte.weight", "wpe.weight"))
    copied = item * (linear + (tables if dtype == "bfloat16" else 0))  # float32 vectors: views
    assert held_bytes(w.arrays().values(), besides=params.values()) == copied
    np.testing.assert_array_equal(w.layers[0]["attn.c_attn"], fast.bf16_bits(np, params["h.0.attn.c_attn.weight"].T)
                                  if dtype == "bfloat16" else params["h.0.attn.c_attn.weight"].T)


def test_layernorm_fold_is_the_same_widened_a_few_rows_at_a_time(monkeypatch):
    rng = np.random.default_rng(3)
    W = rng.standard_normal((37, 24)).astype(np.float32)
    bias, ln_w, ln_b = (rng.standard_normal(n).astype(np.float32) for n in (37, 24, 24))
    whole = fast.layernorm_fold(np, W, bias, ln_w, ln_b)
    monkeypatch.setattr(fast.weights, "FOLD_BYTES", 8 * 24 * 5)  # five rows at a time
    np.testing.assert_array_equal(fast.layernorm_fold(np, W, bias, ln_w, ln_b), whole)
    bits = fast.bf16_bits(np, W)
    np.testing.assert_array_equal(fast.layernorm_fold(np, bits, bias, ln_w, ln_b),
                                  fast.layernorm_fold(np, fast.round_to_bf16(np, W), bias, ln_w, ln_b))


# -- lab.py's figures ---------------------------------------------------------------------------------


def test_memory_figures_hold_the_peak_to_the_bound():
    mib = 2**20
    f = memory_figures(peak=500 * mib, used=900 * mib, weight_bytes=249 * mib, kv_bytes=36 * mib, engine_bytes=50 * mib)
    assert f["memory_bound_bytes"] == int(1.15 * 285 * mib + MEMORY_HEADROOM) and f["within_memory_bound"]
    assert dict(memory_rows({"peak_gpu_memory_bytes": 500 * mib, **f}))["peak GPU memory"].split(": ")[1].startswith(
        "within")
    f = memory_figures(peak=600 * mib, used=900 * mib, weight_bytes=249 * mib, kv_bytes=36 * mib, engine_bytes=50 * mib)
    assert not f["within_memory_bound"]
    s = {"peak_gpu_memory_bytes": 600 * mib, **f}
    rows = dict(memory_rows(s))
    assert rows["peak GPU memory"].startswith("600.0 MiB = 2.11 x (weights 249.0 + KV cache 36.0 MiB); bound 1.15 x "
                                              "that + 256 MiB = 583.8 MiB: OVER")
    assert rows["device memory"].startswith("900.0 MiB in use at the end (cudaMemGetInfo")
    assert rows["fast engine"].startswith("50.0 MiB beside the weights")
    assert memory_rows({"peak_gpu_memory_bytes": None}) == [("peak GPU memory", "n/a (cpu)")]


# -- cuBLAS's operands, with NumPy standing in for the device ---------------------------------------


class FakeCublas:
    """cuBLAS's column-major GEMM on host memory at the addresses Blas passes: the layout arithmetic
    (transposes, leading dimensions, data types) is what is under test."""

    CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_POINTER_MODE_HOST, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 0, 1, 0, 68, -1
    TYPES = {0: np.dtype(np.float32), 2: np.dtype(np.float16), 14: BF16}

    def __init__(self):
        self.calls = []

    def setPointerMode(self, handle, mode):
        pass

    def setStream(self, handle, stream):
        pass

    def sgemm(self, handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self.calls.append(("sgemm", ta, lda, tb, ldb))
        self.gemm(ta, tb, m, n, k, A, 0, lda, B, 0, ldb, beta, C, 0, ldc)

    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo):
        assert compute == self.CUBLAS_COMPUTE_32F and Atype == Btype
        self.calls.append(("gemmEx", ta, lda, Atype, Ctype, tb, ldb))
        self.gemm(ta, tb, m, n, k, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc)

    def gemm(self, ta, tb, m, n, k, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc):
        import ctypes

        def view(ptr, rows, cols, ld, dtype):  # column-major, leading dimension ld
            dtype = self.TYPES[dtype]
            assert ld >= rows
            buf = (ctypes.c_char * (((cols - 1) * ld + rows) * dtype.itemsize)).from_address(ptr)
            return np.ndarray((rows, cols), np.uint16 if dtype == BF16 else dtype, buffer=buf,
                              strides=(dtype.itemsize, ld * dtype.itemsize)).view(dtype)

        a = view(A, m, k, lda, Atype) if ta == self.CUBLAS_OP_N else view(A, k, m, lda, Atype).T
        b = view(B, k, n, ldb, Btype) if tb == self.CUBLAS_OP_N else view(B, n, k, ldb, Btype).T
        c = view(C, m, n, ldc, Ctype)
        product = a.astype(np.float64) @ b.astype(np.float64)
        if ctypes.c_float.from_address(beta).value:  # C = A B + beta C; beta 0 ignores C, as cuBLAS does
            product += ctypes.c_float.from_address(beta).value * c.astype(np.float64)
        c[...] = product.astype(c.dtype)


@pytest.mark.parametrize("out_dtype", [None, np.float32])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("stored", ["(K, N)", "(N, K) read transposed"])
@pytest.mark.parametrize("a_stored", ["(M, K)", "(K, M) read transposed"])
def test_blas_passes_cublas_each_operand_as_it_lies(dtype, stored, a_stored, out_dtype):
    from types import SimpleNamespace

    from lm.products import Blas

    cp = SimpleNamespace(cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 0),
                                              get_current_stream=lambda: SimpleNamespace(ptr=0, is_capturing=lambda: False)))
    blas = Blas(cp, cublas=FakeCublas())
    rng = np.random.default_rng(7)
    a = rng.standard_normal((5, 24)).astype(dtype)
    if a_stored != "(M, K)":  # an activation's transpose, as a weight's gradient x^T dy reads it
        a = np.ascontiguousarray(a.T).T
    w = rng.standard_normal((24, 9) if stored == "(K, N)" else (9, 24)).astype(dtype)
    b = w if stored == "(K, N)" else w.T  # (K, N) either way
    out = np.full((5, 9), np.nan, dtype=out_dtype or dtype)
    blas.gemm(a, b, out)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(out.dtype)
    np.testing.assert_array_equal(out, want)
    (call,) = blas.cublas.calls
    assert call[:3] == ("sgemm" if dtype == "float32" and out.dtype == np.float32 else "gemmEx",
                        0 if stored == "(K, N)" else 1, 9 if stored == "(K, N)" else 24)
    assert call[-2:] == ((0, 24) if a_stored == "(M, K)" else (1, 5))
    if dtype == "bfloat16":  # the fused kernels' bits (uint16), named bfloat16
        bits = np.zeros((5, 9), dtype=np.float32)
        blas.gemm(a.view(np.uint16), b.view(np.uint16), bits, dtype="bfloat16")
        np.testing.assert_array_equal(bits, (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32))
    before = out.copy()
    blas.gemm(a, b, out, accumulate=True)  # out += a @ b
    np.testing.assert_array_equal(out, (before.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))
                                  .astype(out.dtype))
    with pytest.raises(ValueError, match="neither row- nor column-major"):
        blas.gemm(a, np.zeros((24, 18), dtype=b.dtype)[:, ::2], out)  # (K, N), a stride of 2 along N
    with pytest.raises(ValueError, match="a .* is neither row- nor column-major"):
        blas.gemm(np.zeros((5, 48), dtype=a.dtype)[:, ::2], b, out)
    with pytest.raises(ValueError, match="out must be row-major"):
        blas.gemm(a, b, np.asfortranarray(out))
    with pytest.raises(ValueError, match="do not chain"):
        blas.gemm(a, b[:10], out)


@pytest.mark.parametrize("capturing", [False, True])
def test_blas_under_stream_capture_calls_cublas_directly(capturing):
    """CuPy's binding refuses every call while the stream captures (a CUDA graph): there Blas makes the
    same calls through its direct binding, and only there."""
    from types import SimpleNamespace

    from lm.products import Blas

    stream = SimpleNamespace(ptr=0, is_capturing=lambda: capturing)
    cp = SimpleNamespace(cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 0),
                                              get_current_stream=lambda: stream))
    blas = Blas(cp, cublas=FakeCublas(), direct=FakeCublas())
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 6)).astype(np.float32)
    out = np.full((4, 6), np.nan, np.float32)
    blas.gemm(a, b, out)
    np.testing.assert_array_equal(out, (a.astype(np.float64) @ b).astype(np.float32))
    used, unused = (blas.direct, blas.cublas) if capturing else (blas.cublas, blas.direct)
    assert len(used.calls) == 1 and unused.calls == []


@pytest.mark.parametrize("zero", [False, True])
def test_blas_zeroes_a_products_output_first_only_for_initcheck(monkeypatch, zero):
    """lm.products.ZERO_OUTPUTS (LAB_ZERO_PRODUCTS=1, tools/sanitize.py --initcheck-library zeroed): out set
    to zeros before cuBLAS writes it (a memset initcheck sees), never before an accumulating product;
    the product's values either way."""
    from types import SimpleNamespace

    import lm.products as products

    class Recording(np.ndarray):  # records fill(0) calls among cuBLAS's writes
        def fill(self, value):
            events.append(("fill", value))
            super().fill(value)

    class Cublas(FakeCublas):
        def sgemm(self, *args):
            events.append(("sgemm",))
            return super().sgemm(*args)

    events = []
    monkeypatch.setattr(products, "ZERO_OUTPUTS", zero)
    stream = SimpleNamespace(ptr=0, is_capturing=lambda: False)
    cp = SimpleNamespace(cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 0),
                                              get_current_stream=lambda: stream))
    blas = products.Blas(cp, cublas=Cublas())
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 6)).astype(np.float32)
    out = np.full((4, 6), np.nan, np.float32).view(Recording)
    blas.gemm(a, b, out)
    blas.gemm(a, b, out, accumulate=True)
    np.testing.assert_allclose(np.asarray(out), 2 * (a.astype(np.float64) @ b), rtol=1e-6)
    assert events == ([("fill", 0), ("sgemm",), ("sgemm",)] if zero else [("sgemm",), ("sgemm",)])


@pytest.mark.parametrize("zero", [False, True])
def test_float32_products_leave_cupy_matmul_where_initcheck_needs_their_outputs_zeroed(monkeypatch, zero):
    """cupy.matmul makes its own output, which ZERO_OUTPUTS could not zero first: under it (and under
    capture, and wherever out is given or the operands are 16-bit) a product goes through Blas."""
    import lm.products as products

    monkeypatch.setattr(products, "ZERO_OUTPUTS", zero)
    assert products.through_cupy(np.dtype(np.float32), None, capturing=False) is not zero
    out = np.empty((2, 2), np.float32)
    assert not any(products.through_cupy(np.dtype(dtype), given, capturing)
                   for dtype, given, capturing in [(np.float32, None, True), (np.float32, out, False),
                                                   (np.float16, None, False), (np.uint16, None, False)])


def test_loaded_library_finds_the_mapped_cublas_not_cublaslt(tmp_path):
    from lm.products import loaded_library

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /opt/cuda/lib/libcublasLt.so.13.1.0\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /opt/cuda/lib/libcublas.so.13.1.0\n"
                    "7f04-7f05 rw-p 00000000 00:00 0\n")
    assert loaded_library("libcublas.so", str(maps)) == "/opt/cuda/lib/libcublas.so.13.1.0"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /opt/cuda/lib/libcublasLt.so.13\n")
    with pytest.raises(RuntimeError, match="no libcublas.so loaded"):
        loaded_library("libcublas.so", str(maps))
