"""How the engine launches: Launch (one kernel with fixed arguments, plainly or as a programmatic
dependent launch through kernels/driver.py), DecodeGraphs (the decode step's launches kept, captured
into CUDA graphs and timed: what GPT-2's and Llama's engines share) and gemm.cu's launcher (cuBLAS:
lm/products.py's Blas)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import driver
from lm.errors import LabError

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


class DecodeGraphs:
    """What both fast engines (gpt2.fast, llama.fast) do with their decode step's launches: keep them
    per variant, capture them into CUDA graphs, copy the tokens back, time each kernel. The engine
    provides _decode_launches(prefetch, pdl), cp, stream, state, history, pinned, max_len, prefetch,
    pdl, step_launches, fn["spin"], and the dicts _variants and graphs."""

    def launches(self, prefetch: bool | None = None, pdl: bool | None = None) -> list[Launch]:
        """The decode step's launches in one variant (default: the engine's): with or without the L2
        prefetch hints, through plain launches or programmatic dependent launches."""
        key = (self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        if key not in self._variants:
            self._variants[key] = self._decode_launches(*key)
        return self._variants[key]

    def graph(self, steps: int, prefetch: bool | None = None, pdl: bool | None = None):
        """A CUDA graph of `steps` decode steps in one launch variant (captured once, then kept)."""
        key = (steps, self.prefetch if prefetch is None else prefetch, self.pdl if pdl is None else pdl)
        if key not in self.graphs:
            launches = self.launches(*key[1:])
            with self.stream:
                self.stream.begin_capture()
                try:
                    for _ in range(steps):
                        for launch in launches:
                            launch()
                finally:
                    graph = self.stream.end_capture()
            graph.upload(self.stream)
            self.graphs[key] = graph
        return self.graphs[key]

    def _copy_back(self, first: int, count: int):
        """Queue history[first:first + count] -> pinned host memory; the event that says it is there."""
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.pinned.ptr + 4 * first, self.history.data.ptr + 4 * first, 4 * count,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return event, first, count

    def profile_step(self, position: int, repeats: int = 20) -> list[tuple[str, float]]:
        """Milliseconds of each kernel of one decode step at `position` (median of `repeats`), timed
        with events around each launch, the kernels queued behind a spin kernel so that they run
        back to back. Changes state, history and the cache at `position`: run generate() again after."""
        cp = self.cp
        if not 0 <= position < self.max_len - 1:
            raise LabError(f"position {position} outside the engine's 0..{self.max_len - 2}")
        n = len(self.step_launches)
        times = np.zeros((repeats, n))
        start = np.asarray([0, position], dtype=np.int32)
        with self.stream:
            events = [cp.cuda.Event() for _ in range(n + 1)]
            for r in range(repeats):
                self.state.set(start, stream=self.stream)
                self.fn["spin"]((1,), (1,), (np.int64(5_000_000),))  # 5 ms: the host queues the whole step
                events[0].record(self.stream)
                for i, launch in enumerate(self.step_launches):
                    launch()
                    events[i + 1].record(self.stream)
                self.stream.synchronize()
                times[r] = [cp.cuda.get_elapsed_time(events[i], events[i + 1]) for i in range(n)]
        return list(zip([launch.name for launch in self.step_launches], np.median(times, axis=0).tolist(), strict=True))
