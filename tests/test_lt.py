"""lm/lt.py on the CPU: the row-major product's column-major form (checked in NumPy, as cuBLASLt reads the
layouts), and what gemm() declines without a call into the library."""

import numpy as np
import pytest

from lm import lt


def column_major_product(a, W, shape):
    """What cuBLASLt computes from the stored bytes: each operand a column-major (rows, cols, ld) view of
    its buffer, op() applied, D = op(A) @ op(B), read back as the row-major out's buffer."""

    def view(buffer, rows, cols, ld):
        assert ld == rows
        return buffer.reshape(cols, rows).T  # column-major: element (i, j) at j * ld + i

    A, B = view(W.ravel(), *shape["A"]), view(a.ravel(), *shape["B"])
    A = A.T if shape["transa"] == lt.OP_T else A
    B = B.T if shape["transb"] == lt.OP_T else B
    D = A @ B  # (N, M) column-major
    rows, cols, ld = shape["D"]
    assert D.shape == (rows, cols) and ld == rows
    return D.T.ravel().reshape(cols, rows)  # its bytes, row-major (M, N)


@pytest.mark.parametrize("M,N,K", [(1, 96, 32), (17, 2304, 768), (1000, 6400, 1600)])
def test_the_row_major_product_reads_as_cublaslt_s_column_major_one(M, N, K):
    rng = np.random.default_rng(M)
    a, W = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    if M * N * K > 1e8:  # the shapes' bookkeeping alone at the prefill's size
        a, W = a[:, :8], W[:, :8]
        K = 8
    np.testing.assert_allclose(column_major_product(a, W, lt.column_major(M, N, K)), a @ W.T, rtol=1e-12)


class Recording:
    """A stand-in library: every call recorded, status 0; the heuristic offers `found` algorithms."""

    def __init__(self, found: int):
        self.calls, self.found = [], found

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cublasLtMatmulAlgoGetHeuristic":
                args[-1]._obj.value = self.found
            return 0

        return call


def stand_in(found: int, capturing: bool = False) -> lt.Lt:
    import types

    me = lt.Lt.__new__(lt.Lt)
    stream = types.SimpleNamespace(ptr=0, is_capturing=lambda: capturing)
    me.cp = types.SimpleNamespace(float32=np.float32, cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    me.lib, me.handle, me.plans, me.biases = Recording(found), None, {}, {}
    me.workspace = np.zeros(16, np.uint8)
    me.one, me.zero = lt.ctypes.c_float(1.0), lt.ctypes.c_float(0.0)
    return me


def test_gemm_declines_what_it_cannot_take_without_calling_the_library(monkeypatch):
    monkeypatch.setattr(lt, "address", lambda x: id(x))
    monkeypatch.setattr(lt, "bf16_bits", lambda cp, x: x.astype(np.uint16))  # the bias's bfloat16 copy
    bf16 = np.uint16
    a, W, out, bias = np.zeros((4, 8), bf16), np.zeros((6, 8), bf16), np.zeros((4, 6), bf16), np.zeros(6, np.float32)
    me = stand_in(found=1)
    for args in [(a.astype(np.float32), W, bias, out), (a, W.T.copy().T, bias, out), (a, W, bias.astype(bf16), out),
                 (a, W, bias, np.zeros((4, 5), bf16)), (a[:, ::2], W[:, ::2], bias, out)]:
        assert me.gemm(*args) is False
    assert me.lib.calls == []
    assert me.gemm(a, W, bias, out, gelu=True) is True
    assert me.lib.calls[-1] == "cublasLtMatmul" and "cublasLtMatmulAlgoGetHeuristic" in me.lib.calls
    planned = me.lib.calls.count("cublasLtMatmulAlgoGetHeuristic")
    assert me.gemm(a, W, bias, out, gelu=True) is True  # the plan kept: no second heuristic
    assert me.lib.calls.count("cublasLtMatmulAlgoGetHeuristic") == planned
    none = stand_in(found=0)  # no algorithm for the shape: declined, and remembered
    assert none.gemm(a, W, bias, out) is False and none.gemm(a, W, bias, out) is False
    assert none.lib.calls.count("cublasLtMatmulAlgoGetHeuristic") == 1 and "cublasLtMatmul" not in none.lib.calls
    capturing = stand_in(found=1, capturing=True)  # nothing planned or copied during a capture: declined
    assert capturing.gemm(a, W, bias, out) is False and capturing.lib.calls == [] and not capturing.biases
    assert me.biases and all(kept is bias and copy.dtype == np.uint16 for kept, copy in me.biases.values())
    monkeypatch.setattr(lt.products, "ZERO_OUTPUTS", True)  # initcheck's zeroed mode: out zeroed first
    out[...] = 7
    assert me.gemm(a, W, bias, out) is True and not out.any()


def test_an_adding_product_takes_a_float32_output_and_its_bias_as_it_is(monkeypatch):
    """add=True: x (float32) += a @ W^T + bias, planned apart from the bfloat16 epilogues; x is read, so
    initcheck's zeroed mode leaves it, and the float32 bias needs no bfloat16 copy."""
    monkeypatch.setattr(lt, "address", lambda x: id(x))
    monkeypatch.setattr(lt.products, "ZERO_OUTPUTS", True)
    bf16 = np.uint16
    a, W, bias = np.zeros((4, 8), bf16), np.zeros((6, 8), bf16), np.zeros(6, np.float32)
    x = np.full((4, 6), 3.0, np.float32)
    me = stand_in(found=1)
    for args, kw in [((a, W, bias, np.zeros((4, 6), bf16)), {"add": True}),  # a bfloat16 x: declined
                     ((a, W, bias, x), {"add": True, "gelu": True}),         # GELU of a residual: not offered
                     ((a, W, bias, x), {})]:                                   # a float32 out without add
        assert me.gemm(*args, **kw) is False
    assert me.lib.calls == []
    assert me.gemm(a, W, bias, x, add=True) is True
    assert me.lib.calls[-1] == "cublasLtMatmul" and (x == 3.0).all() and not me.biases
    assert list(me.plans) == [(4, 6, 8, False, True)]


def test_the_epilogues_are_cublaslt_s_codes():
    assert (lt.epilogue_of(False), lt.epilogue_of(True)) == (4, 36)  # CUBLASLT_EPILOGUE_BIAS, _GELU_BIAS
