"""lm/arena.py on the CPU, NumPy standing in for CuPy: every buffer a C-contiguous view of one
allocation, aligned, of its shape and dtype, no two overlapping, zeros or NaN as declared, the table's
bytes those of the views; bad declarations a LabError of one line."""

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from lm.arena import ALIGN, Arena, Buffer
from lm.arrays import address, byte_span
from lm.errors import LabError

BUFFERS = [
    Buffer("k_cache", (2, 3, 17, 8), np.uint16),
    Buffer("x", 37, np.float32),
    Buffer("history", 5, np.int32),
    Buffer("handoff", (3, 7), np.uint64),
    Buffer("logits", 101, np.float32, fill=np.nan),
    Buffer("cache16", (4, 9), ml_dtypes.bfloat16),
    Buffer("counter", 1, np.uint32),
]


def test_every_view_is_aligned_contiguous_and_as_declared():
    arena = Arena(np, BUFFERS)
    assert list(arena) == [b.name for b in BUFFERS] and len(arena) == len(BUFFERS)
    for b in BUFFERS:
        view = arena[b.name]
        assert address(view) % ALIGN == 0, b.name
        assert view.flags.c_contiguous and view.dtype == np.dtype(b.dtype), b.name
        assert view.shape == (b.shape if isinstance(b.shape, tuple) else (b.shape,)), b.name
        assert view.strides == np.zeros(view.shape, view.dtype).strides, b.name  # as a buffer of its own
        lo, hi = byte_span(view)
        assert byte_span(arena.buffer)[0] <= lo and hi <= byte_span(arena.buffer)[1], b.name


def test_views_do_not_overlap():
    """A distinct value written into every element of every view, then each view read back whole."""
    arena = Arena(np, BUFFERS)
    for k, b in enumerate(BUFFERS):
        arena[b.name][...] = k + 1
    for k, b in enumerate(BUFFERS):
        assert (arena[b.name].astype(np.float64) == k + 1).all(), b.name
    spans = sorted(byte_span(arena[b.name]) for b in BUFFERS)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))


def test_fills_are_zeros_unless_nan_is_asked():
    """Every byte zero (the padding's too) but the NaN-filled buffer's."""
    arena = Arena(np, BUFFERS)
    assert np.isnan(arena["logits"]).all()
    start = byte_span(arena["logits"])[0] - address(arena.buffer)
    rest = arena.buffer.copy()
    rest[start:start + arena["logits"].nbytes] = 0
    assert not rest.any()


def test_the_table_lists_each_buffer_s_bytes_and_the_padding_is_less_than_an_alignment_each():
    arena = Arena(np, BUFFERS)
    table = arena.table()
    assert [row[0] for row in table] == [b.name for b in BUFFERS]
    assert table[0] == ("k_cache", (2, 3, 17, 8), "uint16", 2 * 3 * 17 * 8 * 2)
    assert table[5] == ("cache16", (4, 9), "bfloat16", 4 * 9 * 2)
    assert [row[3] for row in table] == [arena[b.name].nbytes for b in BUFFERS]
    total = sum(row[3] for row in table)
    assert total <= arena.nbytes < total + ALIGN * (len(BUFFERS) - 1)
    assert arena.nbytes == byte_span(arena["counter"])[1] - byte_span(arena["k_cache"])[0]  # first to last


def test_an_integer_shape_is_one_axis_and_an_empty_arena_is_empty():
    assert Arena(np, [Buffer("x", np.int64(4), np.float32)])["x"].shape == (4,)
    assert Arena(np, []).nbytes == 0


@pytest.mark.parametrize("buffers, message", [
    ([Buffer("x", 0, np.float32)], r"'x': shape \(0,\) needs one or more positive integer dimensions"),
    ([Buffer("x", (3, -1), np.float32)], r"shape \(3, -1\)"),
    ([Buffer("x", (), np.float32)], r"shape \(\)"),
    ([Buffer("x", 2.5, np.float32)], r"shape \(2.5,\)"),
    ([Buffer("x", 4, np.float32), Buffer("x", 2, np.int32)], "'x': declared twice"),
    ([Buffer("k cache", 4, np.float32)], "'k cache': not a name"),
])
def test_bad_declarations_say_which_buffer_in_one_line(buffers, message):
    with pytest.raises(LabError, match=message) as info:
        Arena(np, buffers)
    assert "\n" not in str(info.value)



def test_views_are_aligned_whatever_the_allocator_s_alignment():
    """An allocator whose arrays start one byte past an aligned address: the slack realigns the views."""

    def zeros(n, dtype):
        raw = np.zeros(n + 2 * ALIGN, dtype)
        first = -address(raw) % ALIGN + 1
        return raw[first:first + n]

    xp = SimpleNamespace(zeros=zeros)
    assert address(xp.zeros(10, np.uint8)) % ALIGN == 1
    arena = Arena(xp, BUFFERS)
    assert all(address(arena[b.name]) % ALIGN == 0 for b in BUFFERS)
    assert np.isnan(arena["logits"]).all() and not arena["x"].any()


@pytest.mark.gpu
def test_cupy_views_are_aligned_as_declared_and_apart():
    """The same on the device: CuPy's views of a uint8 allocation (bfloat16 among them), aligned and
    contiguous, NaN where asked, zeros elsewhere, and each keeps what is written into it."""
    import cupy as cp

    arena = Arena(cp, BUFFERS)
    for k, b in enumerate(BUFFERS):
        view = arena[b.name]
        assert view.data.ptr % ALIGN == 0 and view.flags.c_contiguous and view.dtype == np.dtype(b.dtype), b.name
        assert view.strides == np.zeros(view.shape, view.dtype).strides, b.name
        assert bool(cp.isnan(view).all()) if b.fill != 0 else not bool(view.astype(cp.float32).any()), b.name
        view[...] = k + 1
    assert all(bool((arena[b.name].astype(cp.float64) == k + 1).all()) for k, b in enumerate(BUFFERS))
