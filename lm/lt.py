"""cuBLASLt's fused epilogues for the whole-sequence pass's bfloat16 products (LAB_LT_EPILOGUES=0 turns
them off: cuBLAS's product, then bias_act.cu):

    lt.gemm(a, W, bias, out)              out = a @ W^T + bias           (CUBLASLT_EPILOGUE_BIAS)
    lt.gemm(a, W, bias, out, gelu=True)   out = gelu(a @ W^T + bias)     (CUBLASLT_EPILOGUE_GELU_BIAS)
    lt.gemm(a, W, bias, x, add=True)      x += a @ W^T + bias           (CUBLASLT_EPILOGUE_BIAS, beta = 1)

a (M, K) and out (M, N) row-major bfloat16, W the (N, K) row-major weight the decode step reads, bias (N,)
float32; with add, x (M, N) row-major float32, the residual stream, read and written by the epilogue
(the products that feed the residual: no pass of its own over x and the product's output to add them).
The bias and GELU (the tanh form, GPT-2's) are applied to the float32 accumulator in the product's own
epilogue, and the result rounded to bfloat16 once: one kernel where cuBLAS's product and bias_act.cu made
two passes over the output. cuBLASLt takes a bfloat16 output's bias in bfloat16 only (a float32 one: no
algorithm, on an H200 with CUDA 13's cuBLASLt), so the bias is rounded to bfloat16 once, a copy kept per
bias array; the eager model rounds the product before it adds the float32 bias instead. The two differ
by about a bfloat16 step where bias and product cancel. A float32 output (add) takes its float32 bias as
it is.

Through ctypes on the libcublasLt this process has loaded (cuBLAS loads it), as DirectCublas: the calls
work under stream capture, and the algorithm is chosen once per shape by cuBLASLt's heuristic, with a
workspace of its own allocated at the first product (never during a capture). A shape for which the
heuristic offers no algorithm is remembered, and gemm() returns False: the caller takes its unfused path,
as it does for a shape or bias first seen while the stream captures (planned and copied on the pass
before).
"""

from __future__ import annotations

import ctypes
import os

from . import products
from .arrays import address
from .bf16 import bf16_bits
from .products import loaded_library

ENABLED = os.environ.get("LAB_LT_EPILOGUES", "1") != "0"

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14  # cublasComputeType_t, cudaDataType_t
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 4, 36
PREFERENCE_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 16 << 20


class Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (opaque, 64 bytes), its workspace and state."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def epilogue_of(gelu: bool) -> int:
    return EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS


def column_major(M: int, N: int, K: int) -> dict:
    """The row-major product out (M, N) = a (M, K) @ W^T, W (N, K), as cuBLASLt's column-major one:
    out^T (N, M) = op(A) (N, K) @ op(B) (K, M), A = W read transposed (stored (K, N) column-major, ld K),
    B = a (stored (K, M) column-major, ld K), D = out^T (ld N); the bias runs along D's N rows, one a
    column of out."""
    return {"transa": OP_T, "transb": OP_N, "A": (K, N, K), "B": (K, M, K), "D": (N, M, N)}


class Lt:
    """A cuBLASLt handle, its workspace, and a plan (descriptors and algorithm) per shape and epilogue."""

    def __init__(self, cp, path: str | None = None):
        self.cp = cp
        self.lib = ctypes.CDLL(path or loaded_library("libcublasLt.so"))
        self.handle = ctypes.c_void_p()
        self._check("cublasLtCreate", self.lib.cublasLtCreate(ctypes.byref(self.handle)))
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.plans: dict[tuple, tuple | None] = {}
        self.biases: dict[int, tuple] = {}  # a float32 bias's address -> (the bias, kept so that the address
        #                                     stays its own, and its bfloat16 copy in bits)
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(name: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{name} returned cuBLAS status {status}")

    def _set(self, desc, attribute: int, value) -> None:
        self._check("cublasLtMatmulDescSetAttribute", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))))

    def _layout(self, rows: int, cols: int, ld: int, dtype: int = R_16BF):
        layout = ctypes.c_void_p()
        self._check("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)))
        return layout

    def _plan(self, M: int, N: int, K: int, gelu: bool, add: bool = False):
        """(desc, A, B, D layouts, algorithm) for the shape and epilogue (add: D float32, read as C with
        beta = 1), or None where none is offered."""
        shape = column_major(M, N, K)
        desc = ctypes.c_void_p()
        self._check("cublasLtMatmulDescCreate", self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F))
        self._set(desc, DESC_TRANSA, ctypes.c_int32(shape["transa"]))
        self._set(desc, DESC_TRANSB, ctypes.c_int32(shape["transb"]))
        self._set(desc, DESC_EPILOGUE, ctypes.c_int32(epilogue_of(gelu)))
        out_type = R_32F if add else R_16BF
        self._set(desc, DESC_BIAS_DATA_TYPE, ctypes.c_int32(out_type))
        layouts = [self._layout(*shape[m], dtype=out_type if m == "D" else R_16BF) for m in ("A", "B", "D")]
        preference = ctypes.c_void_p()
        self._check("cublasLtMatmulPreferenceCreate", self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)))
        limit = ctypes.c_size_t(WORKSPACE_BYTES)
        self._check("cublasLtMatmulPreferenceSetAttribute", self.lib.cublasLtMatmulPreferenceSetAttribute(
            preference, PREFERENCE_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.c_size_t(ctypes.sizeof(limit))))
        found, count = Heuristic(), ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2],
                                                         layouts[2], preference, 1, ctypes.byref(found),
                                                         ctypes.byref(count))
        self.lib.cublasLtMatmulPreferenceDestroy(preference)
        if status != 0 or count.value == 0:
            return None
        return desc, *layouts, found

    def gemm(self, a, W, bias, out, gelu: bool = False, add: bool = False) -> bool:
        """out = a @ W^T + bias, or its GELU, or (add) out += a @ W^T + bias, on the current stream; False
        (nothing launched) where the arrays are not as the module's docstring says or cuBLASLt offers no
        algorithm for the shape."""
        (M, K), N = a.shape, W.shape[0]
        out_size = 4 if add else 2
        if not (W.shape == (N, K) and out.shape == (M, N) and bias.shape == (N,) and bias.dtype == self.cp.float32
                and not (gelu and add) and out.flags.c_contiguous and out.dtype.itemsize == out_size
                and all(x.flags.c_contiguous and x.dtype.itemsize == 2 for x in (a, W))):
            return False
        key, capturing = (M, N, K, gelu, add), self.cp.cuda.get_current_stream().is_capturing()
        if key not in self.plans and not capturing:
            self.plans[key] = self._plan(M, N, K, gelu, add)
        if not add and address(bias) not in self.biases and not capturing:  # made on a pass before any capture
            self.biases[address(bias)] = bias, bf16_bits(self.cp, bias)
        plan = self.plans.get(key)
        bias_used = bias if add else self.biases.get(address(bias), (None, None))[1]
        if plan is None or bias_used is None:
            return False
        desc, A, B, D, found = plan
        if products.ZERO_OUTPUTS and not add:
            out.fill(0)  # initcheck's zeroed mode, as Blas.gemm does (lm/products.py's ZERO_OUTPUTS)
        self._set(desc, DESC_BIAS_POINTER, ctypes.c_void_p(address(bias_used)))
        stream = self.cp.cuda.get_current_stream().ptr
        self._check("cublasLtMatmul", self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.one), ctypes.c_void_p(address(W)), A, ctypes.c_void_p(address(a)), B,
            ctypes.byref(self.one if add else self.zero), ctypes.c_void_p(address(out)), D, ctypes.c_void_p(address(out)), D,
            ctypes.byref(found.algo), ctypes.c_void_p(address(self.workspace)), ctypes.c_size_t(WORKSPACE_BYTES),
            ctypes.c_void_p(stream)))
        return True
