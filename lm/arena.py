"""One allocation for a fast engine's buffers: a family declares each buffer (name, shape, dtype, fill)
and the Arena lays them out in a single uint8 buffer, every one a C-contiguous view starting on a
256-byte boundary, so that the engine holds one allocation whose bytes it can list buffer by buffer."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .arrays import address
from .errors import LabError

ALIGN = 256  # bytes: what cudaMalloc guarantees, so a kernel's vector loads see what a buffer of its own gives


@dataclass(frozen=True)
class Buffer:
    """One buffer of an arena: zeros, or `fill` in every element (NaN: a poisoned output, so that an
    element no kernel wrote shows)."""

    name: str
    shape: tuple[int, ...] | int
    dtype: object
    fill: float = 0


class Arena(Mapping):
    """Buffers in one zeroed uint8 allocation of xp (NumPy or CuPy), each a view by its name (arena["x"]),
    in the order declared and each aligned to ALIGN bytes. `buffer` spans them all, the padding between
    them included: what the arena holds (nbytes)."""

    def __init__(self, xp, buffers: list[Buffer]):
        self.buffers, offsets, end = _layout(buffers)
        # ALIGN - 1 bytes of slack, so that the first view is aligned whatever the allocator's alignment
        # (NumPy's is 16 or 64 bytes; CuPy's pool hands out 512-byte blocks)
        raw = xp.zeros(end + ALIGN - 1, dtype=np.uint8)
        first = -address(raw) % ALIGN
        self.buffer = raw[first:first + end]
        self._views = {}
        for b, offset in zip(self.buffers, offsets, strict=True):
            dtype = np.dtype(b.dtype)
            view = self.buffer[offset:offset + math.prod(b.shape) * dtype.itemsize].view(dtype).reshape(b.shape)
            if b.fill != 0:  # NaN too: NaN != 0
                view.fill(b.fill)
            self._views[b.name] = view

    def __getitem__(self, name: str):
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def table(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """Each buffer's (name, shape, dtype, bytes), in the order declared; nbytes adds the padding."""
        return [(b.name, b.shape, np.dtype(b.dtype).name, self._views[b.name].nbytes) for b in self.buffers]


def _layout(buffers: list[Buffer]) -> tuple[list[Buffer], list[int], int]:
    """The buffers, each shape a tuple; each one's offset, aligned; the end of the last (LabError on a
    name used twice or not an identifier, or a dimension that is not a positive integer)."""
    out, offsets, end, seen = [], [], 0, set()
    for b in buffers:
        shape = tuple(b.shape) if isinstance(b.shape, (tuple, list)) else (b.shape,)
        if not b.name.isidentifier() or b.name in seen:
            raise LabError(f"arena buffer {b.name!r}: " + ("declared twice" if b.name in seen else "not a name"))
        if not shape or not all(isinstance(n, (int, np.integer)) and n > 0 for n in shape):
            raise LabError(f"arena buffer {b.name!r}: shape {shape} needs one or more positive integer dimensions")
        seen.add(b.name)
        offset = -(-end // ALIGN) * ALIGN
        out.append(Buffer(b.name, tuple(int(n) for n in shape), b.dtype, b.fill))
        offsets.append(offset)
        end = offset + math.prod(shape) * np.dtype(b.dtype).itemsize
    return out, offsets, end
