"""kernels/fused/train.cu's launch geometry without a GPU (tests/test_fused_cpu.py compiles every
instantiation gpt2/train_kernels.py launches): each kernel, emulated in NumPy with its vector width and
loop strides, writes every output element exactly once (row counts 1, 17, 97, 1000; GPT-2's widths
768, 1024, 1600 and their 3C and 4C; odd T), the heads' layout moving each element to where the array
code's transpose puts it; and which passes the fused path takes."""

import numpy as np
import pytest

import gpt2
from gpt2 import train_kernels

ROWS = (1, 17, 97, 1000)
WIDTHS = (768, 1024, 1600)
SMS = 132  # an H200's


def test_the_fused_kernels_take_every_gpt2_size_and_nothing_they_cannot_vectorize():
    assert all(train_kernels.applies(object(), d, c.n_embd, c.head_size) for c in gpt2.SIZES.values()
               for d in ("float32", "bfloat16"))
    assert not train_kernels.applies(np, "bfloat16", 768, 64)  # NumPy: the array code
    assert not train_kernels.applies(object(), "float16", 768, 64)
    assert not train_kernels.applies(object(), "bfloat16", 772, 64)  # a width not of whole vectors
    assert not train_kernels.applies(object(), "bfloat16", 768, 12)  # a head size not of whole vectors
    assert not train_kernels.applies(object(), "bfloat16", 2056, 8)  # wider than MAX_C


def row_vectors(C: int, block: int) -> list[int]:
    """Columns of the 8-element vectors each thread of a row's block takes, in train.cu's loop."""
    return [c for x in range(block) for c in range(8 * x, C, 8 * block)]


@pytest.mark.parametrize("C", [w * k for w in WIDTHS for k in (1, 3, 4)])
def test_a_row_block_takes_every_vector_once(C):
    block = train_kernels._row_block(C)
    assert block % 32 == 0 and block <= 256
    starts = row_vectors(C, block)
    assert sorted(starts) == list(range(0, C, 8))
    if C <= train_kernels.MAX_C:  # LayerNorm's: one vector a thread, all in registers
        assert block * 8 >= C and (block - 32) * 8 < C


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("C", WIDTHS)
def test_layernorm_backward_takes_every_row_once(monkeypatch, rows, C):
    monkeypatch.setattr(train_kernels, "device_limits", lambda: type("L", (), {"sm_count": SMS}))
    blocks = max(1, min(-(-rows // train_kernels.LN_ROWS), train_kernels.LN_BLOCKS_PER_SM * SMS))
    seen = np.zeros(rows, int)
    for bx in range(blocks):
        for first in range(bx * train_kernels.LN_ROWS, rows, blocks * train_kernels.LN_ROWS):
            for y in range(train_kernels.LN_ROWS):
                if first + y < rows:
                    seen[first + y] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("C", [w * k for w in WIDTHS for k in (1, 3, 4)] + [2 * w for w in WIDTHS])
def test_column_sums_groups_cover_every_element_once(monkeypatch, rows, C):
    monkeypatch.setattr(train_kernels, "device_limits", lambda: type("L", (), {"sm_count": SMS}))
    groups, per_group = train_kernels._grouping(rows, C)
    block = train_kernels._row_block(C)
    seen = np.zeros((rows, C), int)
    for gy in range(groups):
        first, last = gy * per_group, min(gy * per_group + per_group, rows)
        assert first < last  # no empty group
        for bx in range(-(-C // (8 * block))):
            for x in range(block):
                c = 8 * (bx * block + x)
                if c < C:
                    seen[first:last, c:c + 8] += 1
    assert (seen == 1).all()
    assert per_group >= train_kernels.MIN_GROUP_ROWS


def emulate_heads_rows(heads: list, rows: np.ndarray, to_rows: bool, grid_x: int, block: int) -> np.ndarray:
    """train.cu's heads_rows on flat arrays: each thread's 8 elements; returns a count of writes."""
    B, NH, T, hs = heads[0].shape
    C = NH * hs
    flat_heads = [h.reshape(-1) for h in heads]
    flat_rows = rows.reshape(-1)
    writes = np.zeros(rows.size if to_rows else len(heads) * heads[0].size, int)
    for y, h in enumerate(flat_heads):
        for bx in range(grid_x):
            for r in range(bx, B * T, grid_x):
                b, t = r // T, r - (r // T) * T
                for c in row_vectors(C, block):
                    head, d = c // hs, c - (c // hs) * hs
                    at_heads = ((b * NH + head) * T + t) * hs + d
                    at_rows = r * rows.shape[1] + y * C + c
                    if to_rows:
                        flat_rows[at_rows:at_rows + 8] = h[at_heads:at_heads + 8]
                        writes[at_rows:at_rows + 8] += 1
                    else:
                        h[at_heads:at_heads + 8] = flat_rows[at_rows:at_rows + 8]
                        writes[y * h.size + at_heads:y * h.size + at_heads + 8] += 1
    return writes


@pytest.mark.parametrize("B,T,NH,hs", [(1, 1, 12, 64), (1, 17, 12, 64), (3, 33, 16, 64), (2, 97, 25, 64)])
@pytest.mark.parametrize("count", [1, 3])
def test_heads_rows_moves_each_element_where_the_transpose_puts_it(B, T, NH, hs, count):
    rng = np.random.default_rng(0)
    C = NH * hs
    block = train_kernels._row_block(C)
    grid_x = max(1, min(B * T, train_kernels.THREADS_PER_SM // block * 2))  # a small device: rows strided
    heads = [rng.standard_normal((B, NH, T, hs)) for _ in range(count)]
    rows = np.full((B * T, count * C), np.nan)
    writes = emulate_heads_rows(heads, rows, True, grid_x, block)
    assert (writes == 1).all()
    want = np.concatenate([h.transpose(0, 2, 1, 3).reshape(B * T, C) for h in heads], axis=1)
    np.testing.assert_array_equal(rows, want)
    back = [np.full_like(h, np.nan) for h in heads]
    writes = emulate_heads_rows(back, rows, False, grid_x, block)
    assert (writes == 1).all()
    for h, b in zip(heads, back, strict=True):
        np.testing.assert_array_equal(b, h)


@pytest.mark.parametrize("ld,V", [(50304, 50257), (128, 100), (8, 8), (1024, 1000)])
def test_softmax_vectors_cover_the_padded_row_once(ld, V):
    threads = train_kernels.SOFTMAX_THREADS
    starts = [c for x in range(threads) for c in range(8 * x, ld, 8 * threads)]
    assert sorted(starts) == list(range(0, ld, 8))
    live = sum(min(8, max(0, V - c)) for c in starts)
    assert live == V
