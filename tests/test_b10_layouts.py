"""b10's two new layouts, emulated in NumPy against what reads them (no GPU): dS stored transposed by
stmatrix .trans into the [queries][keys] tile that dQ_i^T's wgmma reads K-major (128-byte swizzle), and
dQ_i^T's accumulators stored transposed into dQ_accum's boxes that the copy engine reduces (the same
swizzle, float32). The writers' address arithmetic is the kernel's (kernels/backward/b10_tiles_of_80.cu);
the readers' is the hardware's: a 16-byte chunk's index XOR the row's index mod 8, rows of 128 bytes. Each
is checked for every element and for bank conflicts, instruction by instruction."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

B_R, B_C, D, CONSUMERS = 80, 128, 128, 2
SOURCE = (Path(__file__).resolve().parents[1] / "kernels" / "backward" / "b10_tiles_of_80.cu").read_text()


def swizzled(row: int, byte: int) -> int:
    """A tile's byte `byte` of row `row` (rows of 128 bytes, 128-byte swizzle): where it lies."""
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def banks(addresses) -> int:
    """Distinct 4-byte banks a set of 4-byte words lies in."""
    return len({(a // 4) % 32 for a in addresses})


def test_the_kernel_declares_the_tiles_emulated_here():
    assert "(128, 80, 128, 0, 0)" in SOURCE and "dQ_accum: (B_r, 32)" in SOURCE
    assert re.search(r"stmatrix_trans\(half \+ query \* 128 \+ 16 \* \(\(2 \* warp \+ mat % 2\) \^ row_in\), dSa\[kk\]\)",
                     SOURCE)
    assert "box + row * 128 + 16 * (chunk ^ (row % 8)) + 4 * (g % 4)" in SOURCE


def test_ds_stored_transposed_is_the_k_major_tile_dq_reads():
    rng = np.random.default_rng(0)
    dS_T = rng.integers(1, 2**15, size=(B_C, B_R))  # [key][query] as the consumers hold it: distinct, nonzero
    tile = np.zeros(B_C * B_R * 2, dtype=np.int64)  # the buffer, 2-byte elements by byte address
    written = np.zeros_like(tile)
    for c in range(CONSUMERS):
        half = c * B_R * 128
        for warp in range(4):
            for kk in range(B_R // 16):
                # the registers of dSa[kk]: r = 2 (p % 2) + h holds keys 16 warp + g + 8 h, queries 16 kk + 8 (p % 2) + 2 t, + 1
                regs = np.zeros((32, 4, 2), dtype=np.int64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for r in range(4):
                        key = 64 * c + 16 * warp + g + 8 * (r % 2)
                        q = 16 * kk + 8 * (r // 2) + 2 * t
                        regs[lane, r] = dS_T[key, q], dS_T[key, q + 1]
                rows = []
                for lane in range(32):  # the kernel's address, lane by lane
                    mat, row_in = lane // 8, lane % 8
                    query = 16 * kk + 8 * (mat // 2) + row_in
                    rows.append(half + query * 128 + 16 * ((2 * warp + mat % 2) ^ row_in))
                # stmatrix .trans: matrix i's element (row a, column b), held by lane 4 a + b // 2 in register i,
                # goes to row b's address (lane 8 i + b), element a
                for i in range(4):
                    words = []
                    for b in range(8):
                        for a in range(8):
                            at = rows[8 * i + b] + 2 * a
                            tile[at] = regs[4 * a + b // 2, i, b % 2]
                            written[at] += 1
                            words.append(at // 4 * 4)
                    assert banks(words) == 32, "a matrix's 8 rows of 16 bytes fill the 32 banks once"
    assert (written[::2] == 1).all() and (written[1::2] == 0).all()  # every element once
    for key in range(B_C):  # the reader: B[k = key][n = query], K-major, keys in halves of 64
        for query in range(B_R):
            at = (key // 64) * B_R * 128 + swizzled(query, 2 * (key % 64))
            assert tile[at] == dS_T[key, query]


def test_dq_transposed_goes_into_dq_accum_s_boxes_without_conflicts():
    rng = np.random.default_rng(1)
    dQ = rng.standard_normal((B_R, D))  # [query][d]
    share = np.full((CONSUMERS, 2 * B_R * 128 // 4), np.nan)  # each consumer's two boxes, float32 words
    for c in range(CONSUMERS):
        for warp in range(4):
            box = (warp // 2) * B_R * 128
            for mm in range(B_R // 8):
                for h in range(2):
                    for e in range(2):
                        addresses = []
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            # the accumulator 4 mm + 2 h + e: d column 64 c + 16 warp + g + 8 h, query 8 mm + 2 t + e
                            d, q = 64 * c + 16 * warp + g + 8 * h, 8 * mm + 2 * t + e
                            row, chunk = 8 * mm + 2 * t + e, 4 * (warp % 2) + 2 * h + g // 4
                            at = box + row * 128 + 16 * (chunk ^ (row % 8)) + 4 * (g % 4)
                            assert np.isnan(share[c, at // 4])
                            share[c, at // 4] = dQ[q, d]
                            addresses.append(at)
                        assert banks(addresses) == 32, "each store instruction: the 32 banks once"
    assert not np.isnan(share).any()
    for c in range(CONSUMERS):  # the reader: box b holds columns 64 c + 32 b .. of rows row_start ..
        for b in range(2):
            for row in range(B_R):
                for x in range(32):
                    at = b * B_R * 128 + swizzled(row, 4 * x)
                    assert share[c, at // 4] == dQ[row, 64 * c + 32 * b + x]


def test_the_producer_writes_every_row_of_lse_and_d_once():
    rounds = (B_R + 31) // 32
    rows = [lane + 32 * r for r in range(rounds) for lane in range(32) if lane + 32 * r < B_R]
    assert sorted(rows) == list(range(B_R))


def test_shared_memory_fits_a_block():
    smem = 2 * (2 * B_C * D + 4 * B_R * D + 2 * B_C * B_R) + 4 * B_R * D + 16 * B_R + 1024
    assert smem == 231_680 and smem + 256 <= 232_448  # the static mbarriers and ints beside it
    assert all(x % 1024 == 0 for x in (B_C * D * 2, B_R * D * 2, B_C * B_R * 2, B_R * D * 4))  # tiles stay aligned
