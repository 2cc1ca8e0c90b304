"""The training pass's non-GEMM work as fused kernels (kernels/fused/train.cu) on CuPy arrays: what
gpt2/backward.py's layer functions call when `fused` (loss_and_grads(..., fused=True), the default on
the GPU). The array code beside each layer function stays the spec, the CPU's path, and the reference
tests/test_train_kernels_gpu.py compares these against.

Each function here does in one or two launches what the array code does in several CuPy kernels, each
a pass over the arrays (about 20 us a launch from Python, and 25 us a pass over 16k x 768 float32 on
an H200): the softmax and cross-entropy of a chunk of logits (rows padded past the vocabulary),
LayerNorm's forward (with the residual add before it) and backward (the parameters' gradients summed
per block, then across blocks), GELU, a bias's gradient with the cast its products take, and the
heads' layouts. The precision is the array code's: float32 statistics, softmax, loss and sums, 16 bits
only where the array code stores 16 bits. float32 and bfloat16 runs; a float16 run (or a LayerNorm
wider than 2,048) keeps the array code.
"""

from __future__ import annotations

import numpy as np

from kernels import fused
from kernels.runtime import device_limits

TYPES = {"float32": "float", "bfloat16": "unsigned short"}  # train.cu's element types (bfloat16 as its bits)
LN_THREADS = 256  # train.cu's LN_THREADS and COLUMN_THREADS
MAX_COLS = 8  # LayerNorm columns a thread holds: widths up to 8 * 256 = 2,048 (GPT-2 xl's is 1,600)
SOFTMAX_THREADS = 512
GROUP_ROWS = 128  # rows a column_sums block adds up; its sums are added up again until one row is left
BLOCKS_PER_SM = 8  # of 256 threads: a full SM, the grid of the kernels that loop over rows
NULL = np.uint64(0)
NEXT = False  # gpt2/backward.py takes gpt2/train_next.py's kernels (train_next.cu) instead: use_next()


def use_next(on: bool = True) -> None:
    """Run the training pass's fused work on kernels/fused/train_next.cu (gpt2/train_next.py), not yet
    measured on a GPU, instead of train.cu: train.py --next-kernels, for an A/B of the two files."""
    global NEXT
    NEXT = on


def applies(xp, dtype, width: int) -> bool:
    """Whether the fused kernels run a pass in products' dtype `dtype` at LayerNorm width `width`."""
    return xp is not np and np.dtype(dtype).name in TYPES and width <= MAX_COLS * LN_THREADS


def _type(a) -> str:
    return TYPES[a.dtype.name]


def _launch(expression: str, grid, block: int, args) -> None:
    fused.launch(fused.function("train", expression), grid, block, args)


def _grid(n: int) -> int:
    """Blocks of a grid-stride loop over n elements: enough to fill the device, no more."""
    return max(1, min(-(-n // 256), BLOCKS_PER_SM * device_limits().sm_count))


# -- the classifier --------------------------------------------------------------------------------


def softmax_cross_entropy(logits, targets, n: int, out_dtype, V: int | None = None):
    """(dlogits, loss): logits (r, Vp) float32, of which the first V columns (default all) are the
    vocabulary's and the rest padding -> dlogits = (softmax - onehot(targets)) / n in out_dtype (over
    the logits, in place, when float32), zero in the padded columns; loss the sum of the rows' -log
    p(target) (a 0-d float32)."""
    import cupy as cp

    r, Vp = logits.shape
    assert logits.dtype == np.float32 and logits.flags.c_contiguous
    dlogits = logits if np.dtype(out_dtype) == np.float32 else cp.empty((r, Vp), dtype=out_dtype)
    losses = cp.empty(r, dtype=np.float32)
    _launch(f"softmax_xent<{_type(dlogits)}, {SOFTMAX_THREADS}>", r, SOFTMAX_THREADS,
            (logits, cp.ascontiguousarray(targets, dtype=np.int32), np.int32(V or Vp), np.int32(Vp), np.float32(n),
             dlogits, losses))
    return dlogits, losses.sum()


# -- LayerNorm -------------------------------------------------------------------------------------


def _cols(C: int) -> int:
    return -(-C // LN_THREADS)


def layernorm_forward(x, weight, bias, eps: float, out_dtype):
    """(out (N, C) in out_dtype, mean (N, 1), rstd (N, 1)) of x (N, C) float32."""
    return _layernorm_forward(x, None, None, weight, bias, eps, out_dtype)[1:]


def residual_layernorm_forward(x, y, y_bias, weight, bias, eps: float, out_dtype):
    """(x_new, out, mean, rstd): x_new = x + (y + y_bias) (N, C) float32, y (N, C) and y_bias (C,) a
    product's output and its bias in weight's dtype; then layernorm_forward of x_new. One pass."""
    return _layernorm_forward(x, y, y_bias, weight, bias, eps, out_dtype)


def _layernorm_forward(x, y, y_bias, weight, bias, eps: float, out_dtype):
    import cupy as cp

    N, C = x.shape
    x = cp.ascontiguousarray(x)
    residual = y is not None
    x_new = cp.empty((N, C), dtype=np.float32) if residual else None
    out = cp.empty((N, C), dtype=out_dtype)
    mean, rstd = cp.empty((N, 1), dtype=np.float32), cp.empty((N, 1), dtype=np.float32)
    if residual:
        assert y.dtype == y_bias.dtype == weight.dtype
        y = cp.ascontiguousarray(y)
    _launch(f"layernorm_fwd<{_type(weight)}, {_type(out)}, {_cols(C)}, {str(residual).lower()}>", N, LN_THREADS,
            (x, NULL if y is None else y, NULL if y_bias is None else y_bias, NULL if x_new is None else x_new,
             weight, bias, np.float32(eps), out, mean, rstd, np.int32(C)))
    return x_new, out, mean, rstd


def layernorm_backward(dout, x, mean, rstd, weight, dresid=None):
    """(dx, dweight, dbias) from dout (N, C) float32 and the forward's x, mean, rstd; dx is added into
    dresid (N, C) float32, in place, where given (the residual's gradient), else a new array."""
    import cupy as cp

    N, C = x.shape
    dout, x = cp.ascontiguousarray(dout, dtype=np.float32), cp.ascontiguousarray(x)
    accumulate = dresid is not None
    dx = dresid if accumulate else cp.empty((N, C), dtype=np.float32)
    assert dx.dtype == np.float32 and dx.flags.c_contiguous
    blocks = min(N, BLOCKS_PER_SM * device_limits().sm_count)
    partial = cp.empty((blocks, 2 * C), dtype=np.float32)  # per block: dweight's sums, then dbias's
    _launch(f"layernorm_bwd<{_type(weight)}, {_cols(C)}, {str(accumulate).lower()}>", blocks, LN_THREADS,
            (dout, x, mean, rstd, weight, dx, partial, np.int32(N), np.int32(C)))
    sums, _ = column_sums(partial)
    return dx, sums[:C], sums[C:]


# -- GELU, bias gradients and layouts ---------------------------------------------------------------


def gelu_forward(h):
    """GELU(h) in h's dtype, computed in float32."""
    import cupy as cp

    h = cp.ascontiguousarray(h)
    g = cp.empty_like(h)
    _launch(f"gelu_fwd<{_type(h)}>", _grid(h.size), 256, (h, g, np.int64(h.size)))
    return g


def column_sums(a, out_dtype=None, gelu_of=None):
    """(sums (C,) float32, copy) of a (rows, C): the column sums of v = a, or of v = a * GELU'(gelu_of)
    where given (gelu_of (rows, C), in out_dtype), summed in float32; copy is v in out_dtype (None
    where out_dtype is None). A bias's gradient, and the operand its products take, in one pass."""
    import cupy as cp

    rows, C = a.shape
    a = cp.ascontiguousarray(a)
    groups = -(-rows // GROUP_ROWS)
    sums = cp.empty((groups, C), dtype=np.float32)
    copy = None if out_dtype is None else cp.empty((rows, C), dtype=out_dtype)
    h = NULL if gelu_of is None else cp.ascontiguousarray(gelu_of)
    assert gelu_of is None or (copy is not None and gelu_of.dtype == copy.dtype)
    out_type = "float" if copy is None else _type(copy)
    _launch(f"column_sums<{_type(a)}, {out_type}, {str(gelu_of is not None).lower()}>",
            (-(-C // LN_THREADS), groups), LN_THREADS,
            (a, h, NULL if copy is None else copy, sums, np.int32(rows), np.int32(C), np.int32(GROUP_ROWS)))
    return (sums[0] if groups == 1 else column_sums(sums)[0]), copy


def heads_to_rows(arrays):
    """Arrays (B, NH, T, hs) of one dtype, one to three, side by side in rows: out (B * T, len(arrays) * C),
    the heads of each in turn (heads_side_by_side for one; dqkv from dq, dk, dv for three)."""
    import cupy as cp

    B, NH, T, hs = arrays[0].shape
    C = NH * hs
    arrays = [cp.ascontiguousarray(a) for a in arrays]
    out = cp.empty((B * T, len(arrays) * C), dtype=arrays[0].dtype)
    padded = arrays + [arrays[0]] * (3 - len(arrays))  # the kernel reads the array of its grid row y alone
    _launch(f"heads_to_rows<{_type(out)}>", (_grid(B * T * C), len(arrays)), 256,
            (*padded, out, np.int32(B), np.int32(NH), np.int32(T), np.int32(hs), np.int64(out.shape[1])))
    return out


def kernel_expressions(width: int, dtype) -> list[str]:
    """Every instantiation of train.cu that loss_and_grads launches for LayerNorm width `width` and
    products in `dtype` (float32 or bfloat16): what tests/test_fused_cpu.py compiles without a GPU."""
    t, cols = TYPES[np.dtype(dtype).name], _cols(width)
    return list(dict.fromkeys([f"softmax_xent<{t}, {SOFTMAX_THREADS}>", f"layernorm_fwd<{t}, {t}, {cols}, false>",
            f"layernorm_fwd<{t}, {t}, {cols}, true>",
            f"layernorm_bwd<{t}, {cols}, false>", f"layernorm_bwd<{t}, {cols}, true>", f"gelu_fwd<{t}>",
            "column_sums<float, float, false>",  # partial sums; a float32 run's float32 gradients
            f"column_sums<float, {t}, false>", f"column_sums<{t}, float, false>",  # cast; dqkv's sums alone
            f"column_sums<float, {t}, true>",
            f"heads_to_rows<{t}>"]))  # a float32 run's first column_sums twice
