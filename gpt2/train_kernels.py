"""The training pass's non-GEMM work as fused kernels (kernels/fused/train.cu) on CuPy arrays: what
gpt2/backward.py's layer functions call when `fused` (loss_and_grads(..., fused=True), the default on
the GPU). The array code beside each layer function stays the spec, the CPU's path, and the reference
tests/test_train_kernels_gpu.py compares these against.

Each function here does in one launch what the array code does in several CuPy kernels, each a pass
over the arrays (about 20 us a launch from Python, and 25 us a pass over 16k x 768 float32 on an
H200), every row moved as 16-byte vectors: the softmax and cross-entropy of a chunk of logits (rows
padded past the vocabulary), LayerNorm's forward (with the residual add before it) and backward (the
parameters' gradients summed per block, then across blocks), linear_forward's bias add folded into
GELU (bias_gelu) and into the heads' split of q, k, v (rows_to_heads), a bias's gradient with the cast
its products take, and the heads' layouts both ways (the backward rung's do written contiguous, so it
copies nothing). The precision is the array code's: float32 statistics, softmax, loss and sums, 16 bits
only where the array code stores 16 bits. float32 and bfloat16 runs at widths and head sizes of
multiples of 8 (one vector: GPT-2's all are) and LayerNorms up to MAX_C wide; anything else (a float16
run) keeps the array code.
"""

from __future__ import annotations

import numpy as np

from kernels import fused
from kernels.runtime import device_limits

TYPES = {"float32": "float", "bfloat16": "unsigned short"}  # train.cu's element types (bfloat16 as its bits)
SOFTMAX_THREADS = 512
NULL = np.uint64(0)
MAX_C = 2048  # train.cu's MAX_C: LayerNorm widths up to 2,048 (GPT-2 xl's is 1,600)
LN_ROWS = 2  # train.cu's LN_ROWS: rows a layernorm_bwd block takes at once
LN_BLOCKS_PER_SM = 4  # of layernorm_bwd: ~70 KB of loads in flight an SM at C = 768, and few partial rows
MIN_GROUP_ROWS = 16  # rows a column_sums group adds up, at least; more groups where the device has room
THREADS_PER_SM = 2048


def applies(xp, dtype, width: int, head_size: int) -> bool:
    """Whether the fused kernels run a pass in products' dtype `dtype` at LayerNorm width `width` and
    head size `head_size`."""
    return (xp is not np and np.dtype(dtype).name in TYPES and width <= MAX_C and width % 8 == 0
            and head_size % 8 == 0)


def _type(a) -> str:
    return TYPES[a.dtype.name]


def _launch(expression: str, grid, block, args) -> None:
    fused.launch(fused.function("train", expression), grid, block, args)


def _row_block(width: int) -> int:
    """Threads a row: one per 8 elements, rounded up to a warp, at most 256 (wider rows loop)."""
    return min(256, -(-width // 256) * 32)


def _row_grid(rows: int, block: int) -> int:
    """Blocks of a kernel that strides rows by its grid: a full device, no more."""
    return max(1, min(rows, THREADS_PER_SM // block * device_limits().sm_count))


# -- the classifier --------------------------------------------------------------------------------


def softmax_cross_entropy(logits, targets, n: int, out_dtype, V: int | None = None):
    """(dlogits, loss): logits (r, Vp) float32, Vp a multiple of 8 (the classifier pads to 128), of
    which the first V columns (default all) are the vocabulary's and the rest padding -> dlogits =
    (softmax - onehot(targets)) / n in out_dtype (over the logits, in place, when float32), zero in the
    padded columns; loss the sum of the rows' -log p(target) (a 0-d float32)."""
    import cupy as cp

    r, Vp = logits.shape
    assert logits.dtype == np.float32 and logits.flags.c_contiguous and Vp % 8 == 0
    dlogits = logits if np.dtype(out_dtype) == np.float32 else cp.empty((r, Vp), dtype=out_dtype)
    losses = cp.empty(r, dtype=np.float32)
    _launch(f"softmax_xent<{_type(dlogits)}, {SOFTMAX_THREADS}>", r, SOFTMAX_THREADS,
            (logits, cp.ascontiguousarray(targets, dtype=np.int32), np.int32(V or Vp), np.int32(Vp), np.float32(n),
             dlogits, losses))
    return dlogits, losses.sum()


# -- LayerNorm -------------------------------------------------------------------------------------


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
    _launch(f"layernorm_fwd<{_type(weight)}, {_type(out)}, {str(residual).lower()}>", N, _row_block(C),
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
    block = _row_block(C)
    blocks = max(1, min(-(-N // LN_ROWS), LN_BLOCKS_PER_SM * device_limits().sm_count))
    partial = cp.empty((blocks, 2 * C), dtype=np.float32)  # per block: dweight's sums, then dbias's
    _launch(f"layernorm_bwd<{_type(weight)}, {str(accumulate).lower()}>", blocks, (block, LN_ROWS),
            (dout, x, mean, rstd, weight, dx, partial, np.int32(N), np.int32(C)))
    sums = column_total(partial)
    return dx, sums[:C], sums[C:]


# -- bias adds, GELU, bias gradients ---------------------------------------------------------------


def bias_gelu(y, bias):
    """(h, g) of the MLP's first product y (N, 4C) and its bias: h = y + bias in y's dtype (kept for the
    backward, as linear_forward adds it) and g = GELU(h) in y's dtype, computed in float32. One pass."""
    import cupy as cp

    rows, C = y.shape
    y = cp.ascontiguousarray(y)
    assert bias.dtype == y.dtype and C % 8 == 0
    h, g = cp.empty_like(y), cp.empty_like(y)
    block = _row_block(C)
    _launch(f"bias_gelu<{_type(y)}>", _row_grid(rows, block), block, (y, bias, h, g, np.int32(rows), np.int32(C)))
    return h, g


def _grouping(rows: int, width: int) -> tuple[int, int]:
    """column_sums' (groups, rows a group): groups of >= MIN_GROUP_ROWS rows, as many as fill the device
    with threads of 8 columns."""
    fill = max(1, THREADS_PER_SM * device_limits().sm_count // -(-width // 8))
    per_group = max(MIN_GROUP_ROWS, -(-rows // fill))
    return -(-rows // per_group), per_group


def column_sums(a, out_dtype=None, gelu_of=None):
    """(sums (C,) float32, copy) of a (rows, C): the column sums of v = a, or of v = a * GELU'(gelu_of)
    where given (gelu_of (rows, C), in out_dtype), summed in float32; copy is v in out_dtype (None
    where out_dtype is None). A bias's gradient, and the operand its products take, in one pass: each
    group's sums, then column_total."""
    import cupy as cp

    rows, C = a.shape
    a = cp.ascontiguousarray(a)
    groups, per_group = _grouping(rows, C)
    sums = cp.empty((groups, C), dtype=np.float32)
    copy = None if out_dtype is None else cp.empty((rows, C), dtype=out_dtype)
    h = NULL if gelu_of is None else cp.ascontiguousarray(gelu_of)
    assert gelu_of is None or (copy is not None and gelu_of.dtype == copy.dtype)
    out_type = "float" if copy is None else _type(copy)
    block = _row_block(C)
    _launch(f"column_sums<{_type(a)}, {out_type}, {str(gelu_of is not None).lower()}>",
            (-(-C // (8 * block)), groups), block,
            (a, h, NULL if copy is None else copy, sums, np.int32(rows), np.int32(C), np.int32(per_group)))
    return (sums[0] if groups == 1 else column_total(sums)), copy


def column_total(partial):
    """The column sums (C,) float32 of partial (G, C) float32, in one launch."""
    import cupy as cp

    groups, C = partial.shape
    sums = cp.empty(C, dtype=np.float32)
    _launch("column_total", -(-C // 32), (32, 32), (partial, sums, np.int32(groups), np.int32(C)))
    return sums


# -- layouts ---------------------------------------------------------------------------------------


def _heads_rows(heads, rows, bias, to_rows: bool) -> None:
    B, NH, T, hs = heads[0].shape
    assert hs % 8 == 0 and all(a.flags.c_contiguous for a in heads) and rows.flags.c_contiguous
    padded = heads + [heads[0]] * (3 - len(heads))  # the kernel reads the array of its grid row y alone
    C = NH * hs
    block = _row_block(C)
    _launch(f"heads_rows<{_type(rows)}, {str(to_rows).lower()}, {str(bias is not None).lower()}>",
            (_row_grid(B * T, block), len(heads)), block,
            (*padded, rows, NULL if bias is None else bias, np.int32(B * T), np.int32(T), np.int32(NH),
             np.int32(hs), np.int64(rows.shape[1])))


def heads_to_rows(arrays):
    """Arrays (B, NH, T, hs) of one dtype, one to three, side by side in rows: out (B * T, len(arrays) * C),
    the heads of each in turn (heads_side_by_side for one; dqkv from dq, dk, dv for three)."""
    import cupy as cp

    B, NH, T, hs = arrays[0].shape
    arrays = [cp.ascontiguousarray(a) for a in arrays]
    out = cp.empty((B * T, len(arrays) * NH * hs), dtype=arrays[0].dtype)
    _heads_rows(arrays, out, None, to_rows=True)
    return out


def rows_to_heads(rows, B: int, n_head: int, bias=None):
    """Rows (B * T, k C), k = 1 (dy) or 3 (the QKV product), into k contiguous (B, NH, T, hs) arrays (do;
    q, k, v), bias (k C,) added where given (linear_forward's add, rounded to the rows' dtype)."""
    import cupy as cp

    rows = cp.ascontiguousarray(rows)
    N, width = rows.shape
    k = 3 if bias is not None else 1
    C = width // k
    heads = [cp.empty((B, n_head, N // B, C // n_head), dtype=rows.dtype) for _ in range(k)]
    assert bias is None or (bias.dtype == rows.dtype and bias.shape == (width,))
    _heads_rows(heads, rows, bias, to_rows=False)
    return heads


def embedding_backward(dwte, dx, idx) -> None:
    """dwte (V, C) float32 += the rows of dx (N, C) float32 at the tokens idx (N ids), each token's rows
    added one after another in row order, as NumPy's add.at adds them: the same bits on every run (an
    atomic scatter adds in whatever order the rows arrive). The ids sorted on the device (a stable sort:
    ties keep row order), then one launch."""
    import cupy as cp

    N, C = dx.shape
    assert dx.dtype == dwte.dtype == np.float32 and dx.flags.c_contiguous and dwte.flags.c_contiguous
    assert C % 8 == 0 and dwte.shape[1] == C and idx.size == N
    ids = idx.reshape(-1)
    order = cp.argsort(ids)  # CuPy's sort is stable
    _launch("embed_bwd", N, _row_block(C), (dx, order.astype(np.int32), ids[order].astype(np.int32), dwte,
                                            np.int32(N), np.int32(C)))


def kernel_expressions(width: int, dtype) -> list[str]:
    """Every instantiation of train.cu that loss_and_grads launches for LayerNorm width `width` and
    products in `dtype`: what tests/test_fused_cpu.py compiles without a GPU."""
    t = TYPES[np.dtype(dtype).name]
    return list(dict.fromkeys([
        f"softmax_xent<{t}, {SOFTMAX_THREADS}>", f"layernorm_fwd<{t}, {t}, false>", f"layernorm_fwd<{t}, {t}, true>",
        f"layernorm_bwd<{t}, false>", f"layernorm_bwd<{t}, true>", f"bias_gelu<{t}>",
        f"column_sums<float, {t}, false>", f"column_sums<{t}, float, false>", f"column_sums<float, {t}, true>",
        "column_sums<float, float, false>", "column_total",
        f"heads_rows<{t}, true, false>", f"heads_rows<{t}, false, false>", f"heads_rows<{t}, false, true>",
        "embed_bwd"]))
