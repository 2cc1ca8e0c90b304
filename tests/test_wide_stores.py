"""The 16-byte stores at a tile's end, emulated in NumPy (no GPU): each lane's four words of dK_j or dV_j (b13 at
d = 128, b14 at d = 64) or of O_i (v40, d = 128), its two adjacent columns in four 8-column blocks, through
quad_transpose's two shuffle rounds as the kernels write them, must give lane t of every quad the 8 columns
of block 4 q + t in order, so that its 16-byte store writes the row's columns 8 (4 q + t) .. + 7 and every
column of the row is written once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
RUNGS = {"backward/b13_wide_stores": 128, "backward/b14_wide_stores_d64": 64, "v40_wide_o_stores": 128}  # head sizes
STORES = {"backward/b13_wide_stores": "*(uint4*)&dK_row[8 * (4 * q + t)] = k4;",
          "backward/b14_wide_stores_d64": "*(uint4*)&dK_row[8 * (4 * q + t)] = k4;",
          "v40_wide_o_stores": "element* dst = dst_row + 8 * (4 * q + t);"}


def shfl_xor(values: list[int], mask: int) -> list[int]:
    """__shfl_xor_sync over a warp: lane l gets lane l ^ mask's value."""
    return [values[lane ^ mask] for lane in range(32)]


def quad_transpose(a: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """The kernel's quad_transpose for every lane at once, a[lane] = [a0, a1, a2, a3]."""
    t = [lane % 4 for lane in range(32)]
    odd = [x & 1 for x in t]
    high = [x & 2 for x in t]
    r0 = shfl_xor([a[i][0] if odd[i] else a[i][1] for i in range(32)], 1)
    r1 = shfl_xor([a[i][2] if odd[i] else a[i][3] for i in range(32)], 1)
    m0 = [r0[i] if odd[i] else a[i][0] for i in range(32)]
    m1 = [a[i][1] if odd[i] else r0[i] for i in range(32)]
    m2 = [r1[i] if odd[i] else a[i][2] for i in range(32)]
    m3 = [a[i][3] if odd[i] else r1[i] for i in range(32)]
    v0 = shfl_xor([m0[i] if high[i] else m2[i] for i in range(32)], 2)
    v1 = shfl_xor([m1[i] if high[i] else m3[i] for i in range(32)], 2)
    return [(v0[i], v1[i], m2[i], m3[i]) if high[i] else (m0[i], m1[i], v0[i], v1[i]) for i in range(32)]


@pytest.mark.parametrize("rung", RUNGS)
def test_the_kernel_has_the_transpose_emulated_here(rung):
    source = (KERNELS / f"{rung}.cu").read_text()
    for line in ("__shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 1)", "__shfl_xor_sync(0xffffffffu, odd ? a2 : a3, 1)",
                 "m0 = odd ? r0 : a0, m1 = odd ? a1 : r0, m2 = odd ? r1 : a2, m3 = odd ? a3 : r1",
                 "__shfl_xor_sync(0xffffffffu, high ? m0 : m2, 2)", "__shfl_xor_sync(0xffffffffu, high ? m1 : m3, 2)",
                 "high ? make_uint4(v0, v1, m2, m3) : make_uint4(m0, m1, v0, v1)",
                 "const int e = 4 * (4 * q + j) + 2 * h;", STORES[rung]):
        assert line in source, line


@pytest.mark.parametrize("D", sorted(set(RUNGS.values())))
def test_each_lane_stores_eight_columns_of_its_row_in_order(D):
    rng = np.random.default_rng(13)
    for h in range(2):
        rows = rng.permutation(1 << 20)[: 16 * D].reshape(16, D)  # a warp's 16 keys: distinct values
        written = np.full((16, D), -1)
        for q in range(D // 32):
            # lane (g, t)'s word j: the bf16 pair at columns 8 (4 q + j) + 2 t, + 1 of row g + 8 h, as one value
            words = [[int(rows[lane // 4 + 8 * h, 8 * (4 * q + j) + 2 * (lane % 4)]) for j in range(4)]
                     for lane in range(32)]
            for lane, got in enumerate(quad_transpose(words)):
                g, t = lane // 4, lane % 4
                column = 8 * (4 * q + t)  # the 16-byte store's first column
                for s, word in enumerate(got):  # word s: columns column + 2 s, + 1
                    assert word == rows[g + 8 * h, column + 2 * s], (h, q, lane, s)
                    assert written[g + 8 * h, column + 2 * s] == -1
                    written[g + 8 * h, column + 2 * s] = word
        assert (written[8 * h: 8 * h + 8, 0::2] == rows[8 * h: 8 * h + 8, 0::2]).all()
