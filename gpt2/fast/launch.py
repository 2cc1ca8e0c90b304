"""How the engine launches: Launch (one kernel with fixed arguments, plainly or as a programmatic
dependent launch through kernels/driver.py) and gemm.cu's launcher (cuBLAS: lm/products.py's Blas)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import driver

from .plan import GEMM_SMEM, GEMM_TILE, gemm_splits


@dataclass
class Launch:
    """One kernel launch with fixed arguments: the unit of the decode step. With pdl, launched through
    cuLaunchKernelEx with programmatic stream serialization on `stream` (see kernels/fused/common.cuh)."""

    name: str
    fn: object
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int = 0
    pdl: bool = False
    stream: int = 0  # the CUstream handle of a pdl launch

    def __call__(self):
        if not self.pdl:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem)
            return
        if not hasattr(self, "_packed"):  # packed on first use, after the engine sets pdl and stream
            self._packed = driver.PackedLaunch(self.fn, self.grid, self.block, self.args, shared_mem=self.shared_mem,
                                               stream=self.stream, pdl=True, name=self.name)
        self._packed()


def gemm(fn, a, w_parts: tuple, bias, out, partials, tickets, sm_count: int, splits: int | None = None) -> None:
    """Launch gemm.cu's kernel fn: out (M, N) = a (M, K) @ W with fn's epilogue, W as gemm_weight
    made it; partials (2 x sm_count x 64 x 64 float32) and tickets (sm_count uint32, zeros, left
    zeros) serve split K. splits: gemm_splits' choice unless given."""
    (M, K), N = a.shape, out.shape[1]
    splits = splits or gemm_splits(M, N, K, sm_count)
    tiles = (N // GEMM_TILE) * -(-M // GEMM_TILE)
    if splits > 1 and (splits * tiles * GEMM_TILE**2 > partials.size or tiles > tickets.size):
        raise ValueError(f"{splits} splits of a ({M}, {N}) output need more partial sums or tickets than the buffers hold")
    fn((N // GEMM_TILE, -(-M // GEMM_TILE), splits), (128,),
       (a, *w_parts, bias, out, np.int32(M), np.int32(N), np.int32(K), partials, tickets), shared_mem=GEMM_SMEM)
