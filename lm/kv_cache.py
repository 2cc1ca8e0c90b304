"""The KV cache of the eager path: every layer's keys and values, for the key/value heads only."""

from __future__ import annotations

import numpy as np


class KVCache:
    """Every layer's keys and values for the tokens seen so far, in preallocated buffers. A config
    gives n_layer, kv_heads (GPT-2: n_head; Llama: num_key_value_heads) and head_size."""

    def __init__(self, config, batch: int, max_len: int, xp=np, dtype=np.float32):
        shape = (config.n_layer, batch, config.kv_heads, max_len, config.head_size)
        self.k = xp.zeros(shape, dtype=dtype)  # dtype: the model's compute_dtype(params), that of k and v
        self.v = xp.zeros(shape, dtype=dtype)
        self.length = 0  # positions filled; forward() advances it after the last layer

    @classmethod
    def over(cls, k, v) -> KVCache:
        """A cache in buffers allocated elsewhere (a fast engine's arena): k and v zeros, each
        (n_layer, B, NH_kv, max_len, hs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.length = k, v, 0
        return cache

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, k, v):
        """Store this layer's new (B, NH_kv, T, hs) keys and values; return all of them so far."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # each (B, NH_kv, end, hs)


def kv_cache_bytes(config, positions: int, dtype) -> int:
    """Bytes of the keys and values of `positions` positions, every layer's key/value heads, in dtype."""
    return 2 * config.n_layer * config.kv_heads * config.head_size * positions * np.dtype(dtype).itemsize
