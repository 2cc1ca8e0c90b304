"""Matrix products in the weights' dtype, whatever the array module: what the models' linear layers
and logits call.

    y = matmul(x, w)                        x (M, K) @ w (K, N), in w's dtype
    y = matmul(x, w.T)                      an (N, K) weight read as its transpose, where it lies
    logits = matmul(x, head.T, np.float32)  the output in float32 whatever the weights' dtype
    dW = matmul(x.T, dy, np.float32)        a weight's gradient: x's transpose read where it lies
    matmul(x.T, dy, out=dW, accumulate=True)  dW += x^T dy in place (cuBLAS's beta = 1: no temporary)

A product takes its operands in the weights' dtype (x is cast to it) and accumulates in float32.
NumPy (the CPU's reference): `@` on the operands widened to float32 (float64 ones stay float64: the
gradient check's). CuPy: cuBLAS on the operands where they lie (a transposed view, of a weight or of
an activation, is read through cuBLAS's transpose flag, never copied): float32 through cupy.matmul
(SGEMM, the handle's default math: no TF32), float16 and bfloat16 through Blas.gemm (gemmEx with
CUBLAS_COMPUTE_32F), which writes the output in its dtype itself: no float32 copy of a 16-bit
weight, per call or ever.

Under stream capture (a CUDA graph: lm/step_graph.py) CuPy's cuBLAS binding refuses every call (its
setStream raises while the stream captures), though cuBLAS itself supports capture (its workspace comes
from the stream-ordered allocator since CUDA 12.2). There Blas calls the same four cuBLAS functions
through ctypes (DirectCublas), and float32 products go through Blas too, not cupy.matmul.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .arrays import address, array_module

_blas = {}  # device id -> Blas


def matmul(a, b, out_dtype=None, out=None, accumulate: bool = False):
    """a (M, K) @ b (K, N) in b's dtype, accumulated in float32; the result in out_dtype (default b's).
    a and b may each be row-major or the transpose of a row-major array (a weight or its transpose; an
    activation, or its transpose for a weight's gradient); a is copied only if neither. out: a row-major
    (M, N) array to write (its dtype the result's), or, with accumulate, to add the product into."""
    if accumulate and out is None:
        raise ValueError("accumulate needs out, the array to add the product into")
    out_dtype = np.dtype(out.dtype if out is not None else out_dtype or b.dtype)
    a = a.astype(b.dtype, copy=False)  # the product in the weights' dtype
    xp = array_module(b)
    if xp is np:  # the CPU's reference: float32 operands (NumPy has no 16-bit product into float32)
        wide = np.result_type(b.dtype, np.float32)
        y = (a.astype(wide, copy=False) @ b.astype(wide, copy=False)).astype(out_dtype, copy=False)
        if out is None:
            return y
        if accumulate:
            out += y
        else:
            out[...] = y
        return out
    if through_cupy(b.dtype, out, xp.cuda.get_current_stream().is_capturing()):
        return (a @ b).astype(out_dtype, copy=False)
    device = xp.cuda.runtime.getDevice()
    if device not in _blas:
        _blas[device] = Blas(xp)
    out = xp.empty((a.shape[0], b.shape[1]), dtype=out_dtype) if out is None else out
    _blas[device].gemm(a if a.flags.c_contiguous or a.T.flags.c_contiguous else xp.ascontiguousarray(a), b, out,
                       accumulate=accumulate)
    return out


def through_cupy(dtype, out, capturing: bool) -> bool:
    """Whether a product goes through cupy.matmul: float32 operands and no out given, unless the stream
    captures (CuPy's binding refuses) or ZERO_OUTPUTS asks for the output zeroed first (cupy.matmul
    makes its own; its split-K reduction's stores are the ones initcheck's zeroed mode leaves out)."""
    return dtype == np.float32 and out is None and not capturing and not ZERO_OUTPUTS


# For compute-sanitizer's initcheck alone (tools/sanitize.py --initcheck-library zeroed sets it): every
# product's output zeroed before cuBLAS writes it. initcheck does not see stores made through the async
# proxy (tools/initcheck_library.py's bulk-store case), as Hopper's GEMM kernels store their tiles, so
# without it a kernel reading a product is reported for memory cuBLAS wrote; the memset it does see.
# The product still overwrites every element, and the targets' result checks catch one that does not.
ZERO_OUTPUTS = os.environ.get("LAB_ZERO_PRODUCTS") == "1"


class Blas:
    """out (M, N) = a (M, K) @ b (K, N) through cuBLAS on CuPy's handle and current stream, row-major
    out, a and b each row-major or the transpose of a row-major array. float32 operands through
    SGEMM (the handle's default math mode: no TF32); float16 and bfloat16 ones (bfloat16 also as
    uint16 bits, as the fused kernels hold it: pass dtype="bfloat16") through gemmEx, products
    accumulated in float32, the output float32 or the operands' dtype; accumulate: out += a @ b
    (beta = 1). `cublas`: CuPy's binding, unless a test stands in for it; `direct`: the binding used
    while the current stream captures (DirectCublas, made at the first capture, unless a test's)."""

    TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF

    def __init__(self, cp, cublas=None, direct=None):
        if cublas is None:
            from cupy_backends.cuda.libs import cublas
        self.cp, self.cublas, self.direct = cp, cublas, direct
        self.handle = cp.cuda.device.get_cublas_handle()
        self.one, self.zero = np.ones(1, np.float32), np.zeros(1, np.float32)

    def gemm(self, a, b, out, dtype: str | None = None, accumulate: bool = False) -> None:
        """dtype: the operands' (default b's dtype); out's dtype is float32 or the operands'."""
        dtype = dtype or b.dtype.name
        (M, K), N = a.shape, b.shape[1]
        if b.shape[0] != K or out.shape != (M, N):
            raise ValueError(f"shapes {a.shape} @ {b.shape} -> {out.shape} do not chain")
        if not out.flags.c_contiguous:
            raise ValueError("out must be row-major (C-contiguous)")
        op_b, ld_b = self._operand("b", b, N, K)  # cuBLAS's A: b^T (N, K) column-major
        op_a, ld_a = self._operand("a", a, K, M)  # cuBLAS's B: a^T (K, M) column-major
        if min(M, N, K) == 0:
            if not accumulate:
                out.fill(0)
            return
        if ZERO_OUTPUTS and not accumulate:
            out.fill(0)  # a memset initcheck sees: the product's own stores it may not (see ZERO_OUTPUTS)
        beta = (self.one if accumulate else self.zero).ctypes.data
        stream = self.cp.cuda.get_current_stream()
        c = self.cublas
        if stream.is_capturing():
            self.direct = self.direct or DirectCublas()
            c = self.direct
        c.setPointerMode(self.handle, c.CUBLAS_POINTER_MODE_HOST)
        c.setStream(self.handle, stream.ptr)
        # column-major view of row-major: out^T (N, M) = b^T (N, K) @ a^T (K, M)
        if dtype == "float32" and out.dtype == np.float32:
            c.sgemm(self.handle, op_b, op_a, N, M, K, self.one.ctypes.data, address(b), ld_b,
                    address(a), ld_a, beta, address(out), N)
            return
        out_type = self.TYPES["float32" if out.dtype == np.float32 else dtype]
        c.gemmEx(self.handle, op_b, op_a, N, M, K, self.one.ctypes.data, address(b), self.TYPES[dtype], ld_b,
                 address(a), self.TYPES[dtype], ld_a, beta, address(out), out_type, N,
                 c.CUBLAS_COMPUTE_32F, c.CUBLAS_GEMM_DEFAULT)

    def _operand(self, name: str, x, rows: int, cols: int) -> tuple[int, int]:
        """cuBLAS's transpose flag and leading dimension for x^T as a column-major (rows, cols) matrix:
        a row-major x is that matrix as stored (leading dimension rows); the transpose of a row-major
        array is its transpose, stored (cols, rows) (leading dimension cols)."""
        if x.flags.c_contiguous:
            return self.cublas.CUBLAS_OP_N, rows
        if x.T.flags.c_contiguous:
            return self.cublas.CUBLAS_OP_T, cols
        raise ValueError(f"{name} {x.shape} with strides {x.strides} is neither row- nor column-major")


class DirectCublas:
    """The four cuBLAS calls Blas makes (CuPy's binding's names and constants), through ctypes on the
    libcublas CuPy has loaded: for stream capture, which CuPy's binding refuses. alpha and beta are host
    pointers (pointer mode host): a captured product keeps the values they held at capture."""

    CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_POINTER_MODE_HOST = 0, 1, 0
    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1

    def __init__(self, path: str | None = None):
        self.lib = ctypes.CDLL(path or loaded_library("libcublas.so"))
        p, i = ctypes.c_void_p, ctypes.c_int
        for name, args in {"cublasSetStream_v2": [p, p], "cublasSetPointerMode_v2": [p, i],
                           "cublasSgemm_v2": [p, i, i, i, i, i, p, p, i, p, i, p, p, i],
                           "cublasGemmEx": [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]}.items():
            getattr(self.lib, name).argtypes, getattr(self.lib, name).restype = args, i

    def _check(self, name: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{name} returned cuBLAS status {status}")

    def setStream(self, handle, stream):
        self._check("cublasSetStream", self.lib.cublasSetStream_v2(handle, stream))

    def setPointerMode(self, handle, mode):
        self._check("cublasSetPointerMode", self.lib.cublasSetPointerMode_v2(handle, mode))

    def sgemm(self, handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self._check("cublasSgemm", self.lib.cublasSgemm_v2(handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc))

    def gemmEx(self, handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo):
        self._check("cublasGemmEx", self.lib.cublasGemmEx(handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype,
                                                          ldb, beta, C, Ctype, ldc, compute, algo))


def loaded_library(stem: str, maps: str = "/proc/self/maps") -> str:
    """The path of the shared library named stem (e.g. libcublas.so, not libcublasLt.so) that this process
    has mapped: the very library CuPy's binding calls, whatever its version suffix."""
    with open(maps) as f:
        for line in f:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith(stem + ".") or path.endswith("/" + stem):
                return path
    raise RuntimeError(f"no {stem} loaded in this process (CuPy's cuBLAS binding loads it)")
