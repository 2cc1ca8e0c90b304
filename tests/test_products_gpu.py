"""lm/products.py on the GPU under stream capture: CuPy's cuBLAS binding refuses every call while a
stream captures, so Blas calls cuBLAS through ctypes there (DirectCublas). The captured products, replayed,
give the eager ones bit for bit (the same cuBLAS calls on the same operands), each operand as it lies."""

import numpy as np
import pytest

from lm.products import DirectCublas, matmul

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def test_direct_binding_speaks_cupys_constants():
    from cupy_backends.cuda.libs import cublas

    for name in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_POINTER_MODE_HOST", "CUBLAS_COMPUTE_32F", "CUBLAS_GEMM_DEFAULT"):
        assert getattr(DirectCublas, name) == getattr(cublas, name), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_products_replay_the_eager_ones(dtype):
    rng = np.random.default_rng(1)
    import ml_dtypes

    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    x = cp.asarray(rng.standard_normal((97, 64)).astype(np.float32)).astype(dt)
    w = cp.asarray(rng.standard_normal((48, 64)).astype(np.float32)).astype(dt)  # (N, K): read transposed
    dy = cp.asarray(rng.standard_normal((97, 48)).astype(np.float32)).astype(dt)

    def products(acc):
        y = matmul(x, w.T)                               # (97, 48), the weights' dtype
        logits = matmul(x, w.T, np.float32)              # float32 out
        matmul(x.T, dy, out=acc, accumulate=True)        # acc (64, 48) += x^T dy, x^T read where it lies
        return y, logits

    acc_eager = cp.ones((64, 48), np.float32)
    eager = products(acc_eager)
    stream = cp.cuda.Stream(non_blocking=True)
    acc_graph = cp.ones((64, 48), np.float32)
    with stream:
        stream.begin_capture()
        try:
            captured = products(acc_graph)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    for e, g in zip(eager, captured, strict=True):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(cp.asnumpy(g.astype(np.float32)), cp.asnumpy(e.astype(np.float32)))
    np.testing.assert_array_equal(cp.asnumpy(acc_graph), cp.asnumpy(acc_eager))
    want = x.astype(np.float64).T @ dy.astype(np.float64) + 1
    np.testing.assert_allclose(cp.asnumpy(acc_graph), cp.asnumpy(want), rtol=2e-2, atol=2e-2)
