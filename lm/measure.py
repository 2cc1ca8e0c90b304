"""What lab.py and bench.py measure a fast engine by beside its own timings (lm/engine.py): a step's
kernels summed by kind, and the copy ceiling its weight bandwidth is held against."""

from __future__ import annotations

import re

import numpy as np


def kind_of(name: str) -> str:
    """A launch's kind: its name without the layer's `h.N.` prefix."""
    return re.sub(r"^h\.\d+\.", "", name)


def by_kind(kernels_ms: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(kind, launches, total ms) from profile_step's rows: the layers' kernels summed by their name
    without the `h.N.` prefix, in order of first appearance."""
    totals: dict[str, list] = {}
    for name, ms in kernels_ms:
        kind = kind_of(name)
        entry = totals.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    return [(kind, n, ms) for kind, (n, ms) in totals.items()]


def copy_ceiling(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of `repeats`
    copies of `nbytes`, measured now on the current device."""
    import cupy as cp

    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats + 1):
        start.record()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    stream.ptr)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * nbytes / float(np.median(times[1:]))
