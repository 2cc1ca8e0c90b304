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
"""

from __future__ import annotations

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
    if b.dtype == np.float32 and out is None:
        return (a @ b).astype(out_dtype, copy=False)
    device = xp.cuda.runtime.getDevice()
    if device not in _blas:
        _blas[device] = Blas(xp)
    out = xp.empty((a.shape[0], b.shape[1]), dtype=out_dtype) if out is None else out
    _blas[device].gemm(a if a.flags.c_contiguous or a.T.flags.c_contiguous else xp.ascontiguousarray(a), b, out,
                       accumulate=accumulate)
    return out


class Blas:
    """out (M, N) = a (M, K) @ b (K, N) through cuBLAS on CuPy's handle and current stream, row-major
    out, a and b each row-major or the transpose of a row-major array. float32 operands through
    SGEMM (the handle's default math mode: no TF32); float16 and bfloat16 ones (bfloat16 also as
    uint16 bits, as the fused kernels hold it: pass dtype="bfloat16") through gemmEx, products
    accumulated in float32, the output float32 or the operands' dtype; accumulate: out += a @ b
    (beta = 1). `cublas`: CuPy's binding,
    unless a test stands in for it."""

    TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF

    def __init__(self, cp, cublas=None):
        if cublas is None:
            from cupy_backends.cuda.libs import cublas
        self.cp, self.cublas, self.handle = cp, cublas, cp.cuda.device.get_cublas_handle()
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
        beta = (self.one if accumulate else self.zero).ctypes.data
        c = self.cublas
        c.setPointerMode(self.handle, c.CUBLAS_POINTER_MODE_HOST)
        c.setStream(self.handle, self.cp.cuda.get_current_stream().ptr)
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
