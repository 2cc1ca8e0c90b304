"""Autoregressive generation in the eager path, for any model, in the two modes the lab compares.

- no KV cache (the seed's setup): every step runs the whole sequence so far through the model,
  so the attention under test runs on every token, at every length up to prompt + new tokens;
- KV cache: one prefill of the prompt with the attention under test, then one token per step,
  each a single query over the cached keys (`decode_attend`: by default the decode rung,
  kernels/v16_decode_split_kv.cu, on CuPy arrays, and the reference on NumPy ones).

A model hands in its forward(params, config, idx, attend, *, cache, last_only) (gpt2.model.forward,
llama.model.forward); gpt2.generate puts its fast path in front.
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass, field

import numpy as np

import kernels
from kernels import reference_attention

from .arrays import array_module
from .errors import LabError
from .kv_cache import KVCache


def reference_attend(q, k, v):
    """kernels.reference_attention in the array type it is given (causal, aligned bottom-right)."""
    return reference_attention(q, k, v, causal=True)


def decode_rung(config, dtype: str) -> str | None:
    """The newest split-KV rung (one query over the cached keys, the keys split across blocks) that
    runs on this device and takes the model's head size, dtype and grouped-query attention if it has
    it; None if none does."""
    gqa = config.kv_heads != config.n_head
    return kernels.default_rung(dtype, config.head_size, gqa, kernels.device_limits().arch, decode=True)


def decode_rung_attend(name: str):
    """The decode rung `name` on CuPy arrays: q (B, NH, 1, hs) over the cache views k, v
    (B, NH_kv, T_k, hs), read through their strides (unit last stride)."""
    return lambda q, k, v: kernels.attention(q, k, v, kernel=name, causal=True)


def decode_attention_name(xp, config, dtype: str) -> str:
    """What the eager KV-cache path decodes with: the decode rung for CuPy arrays of a head size and
    dtype it takes, else "reference"."""
    if xp is np:
        return "reference"
    return decode_rung(config, dtype) or "reference"


class Sampler:
    """Greedy when temperature is 0; otherwise softmax(logits / temperature) over the top_k
    largest logits (all if top_k is None), drawn from a NumPy generator seeded with `seed`."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, seed: int | None = 0):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise LabError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise LabError(f"top-k must be at least 1, got {top_k}")
        if top_k is not None and temperature == 0:
            raise LabError("top-k needs a temperature > 0 (temperature 0 is greedy)")
        self.temperature, self.top_k = float(temperature), top_k
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits) -> int:
        """The next token from one position's logits (vocab,), a NumPy or CuPy array."""
        if self.temperature == 0:
            return int(logits.argmax())
        z = (logits.get() if hasattr(logits, "get") else np.asarray(logits)).astype(np.float64)
        z /= self.temperature
        if self.top_k is not None and self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z[z < kth] = -np.inf
        p = np.exp(z - z.max())
        return int(self.rng.choice(z.size, p=p / p.sum()))


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, the end-of-text one included when generation stopped at it
    stopped_at_eos: bool = False
    logits: list = field(default_factory=list)  # each step's last-position logits (vocab,), if recorded


def check_request(config, prompt: list[int], n_new: int) -> None:
    """A prompt and a token count the model can take, or a LabError saying why not."""
    if not prompt:
        raise LabError("the prompt must have at least one token")
    if n_new < 1:
        raise LabError(f"the number of new tokens must be at least 1, got {n_new}")
    if len(prompt) + n_new > config.n_positions:
        raise LabError(f"{len(prompt)} prompt tokens + {n_new} new tokens = {len(prompt) + n_new} positions, "
                       f"but the model has {config.n_positions}")
    if max(prompt) >= config.vocab_size or min(prompt) < 0:
        bad = max(prompt) if max(prompt) >= config.vocab_size else min(prompt)
        raise LabError(f"token id {bad} is outside the model's vocabulary of {config.vocab_size}")


def generate(forward, params: dict, config, prompt: list[int], n_new: int, *, attend, dtype, kv_cache: bool = False,
             decode_attend=None, sampler: Sampler | None = None, eos_ids=(), on_token=None,
             record_logits: bool = False) -> Generation:
    """n_new tokens after `prompt` (one sequence), model.forward step by step; on_token(token) is
    called as each is chosen. Stops early after any of `eos_ids`. dtype: that of the model's q, k, v
    (its compute_dtype), so that of the cache; decode steps use `decode_attend`, by default as
    decode_attention_name says."""
    check_request(config, prompt, n_new)
    xp = array_module(next(iter(params.values())))
    sampler = sampler or Sampler()
    if decode_attend is None:
        name = decode_attention_name(xp, config, np.dtype(dtype).name)
        decode_attend = reference_attend if name == "reference" else decode_rung_attend(name)
    ids = list(prompt)
    out = Generation(tokens=[])
    cache = KVCache(config, 1, len(prompt) + n_new - 1, xp, dtype) if kv_cache else None
    for step in range(n_new):
        if cache is None:  # the whole sequence, every step
            logits = forward(params, config, xp.asarray([ids]), attend, last_only=True)  # (1, 1, vocab)
        elif step == 0:  # prefill: the prompt through the attention under test
            logits = forward(params, config, xp.asarray([ids]), attend, cache=cache, last_only=True)
        else:  # decode: the newest token's query over every cached key
            logits = forward(params, config, xp.asarray([ids[-1:]]), decode_attend, cache=cache, last_only=True)
        row = logits[0, -1]  # (vocab,)
        if record_logits:
            out.logits.append(row)
        token = sampler(row)
        ids.append(token)
        out.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids:
            out.stopped_at_eos = True
            break
    return out


class StreamDecoder:
    """Token ids in, text out as soon as it is whole: a character split across two tokens is held
    back until its last byte arrives."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> str:
        try:
            data = self.encoding.decode_single_token_bytes(token)
        except KeyError:  # an id past the tokenizer's vocabulary (a padded embedding row)
            data = "\ufffd".encode()
        return self.utf8.decode(data)

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
