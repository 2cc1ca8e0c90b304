"""Family: a model family as lab.py, bench.py and train.py run it, each field a function with the same signature
in every family, so that the callers choose a family once (config.json's model_type, or a --size name)
and never branch on it. gpt2.FAMILY and llama.FAMILY fill it in; lab.FAMILIES lists them (lm/ sits
below the families and imports neither).

A family's fast path (gpt2/fast, llama/fast) is reached through fast_reason, decode_layout and engine:
fast_reason(...) is None where generate() takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import LabError


@dataclass(frozen=True)
class Family:
    name: str  # config.json's model_type
    sizes: dict  # --size name -> config (random weights of that shape)
    default_dtype: str  # the dtype a run takes when none is asked
    decode_attention: str  # the fast decode step's fused attention (kernels/fused/<name>.cu)
    fast_dtypes: tuple  # the dtypes the fast path counts weight bytes for
    load_folder: Callable  # (folder, *, xp, name, file, dtype) -> Checkpoint
    random_weights: Callable  # (size, *, seed, xp, dtype) -> Checkpoint
    load_tokenizer: Callable  # (folder or None) -> encoding, or None where there is no tokenizer
    encode: Callable  # (encoding, text, *, chat) -> token ids; LabError for chat where the family has none
    stop_ids: Callable  # (config, encoding, *, chat) -> the ids that end a run stopped at end of text
    generate: Callable  # (params, config, prompt, n_new, *, attend, kv_cache, sampler, eos_ids, fast, max_len,
    #                      on_token=None, record_logits=False, decode_attend=None) -> Generation
    forward: Callable  # (params, config, idx (B, T), attend) -> float32 logits (B, T, V): the eager model
    backward: object | None  # what train.py steps with (loss_and_grads, Attention), or None: the family has no backward
    fast_reason: Callable  # (params, config, *, kv_cache, sampler) -> None where the fast path runs, else why not
    decode_layout: Callable  # (params, config): in place, the layout the fast engine reads without a copy
    engine: Callable  # (params, config, positions) -> the fast engine generate() ran on
    weight_bytes_per_token: Callable  # (config, dtype) -> bytes of weights one decode step reads
    activation_bytes: Callable  # (config, B, T, dtype, *, reference) -> the most bytes one eager forward over T
    #                             positions without a cache holds beside the weights (model.forward_activation_bytes)
    config_json: Callable  # (config) -> its config.json as a dict (what transformers' config class takes)
    save: Callable  # (checkpoint, folder): config.json and model.safetensors as transformers reads them
    hf_classes: tuple  # transformers' (model class, config class) names for the family's config.json
    bos_ids: tuple  # the ids every prompt starts with (Llama's <|begin_of_text|>; GPT-2 has none)
    prompt_ids: tuple  # a fixed prompt of token ids, for random weights without a tokenizer


def of_size(families, size: str) -> Family:
    """The family whose sizes name `size` (--size with random weights)."""
    for family in families:
        if size in family.sizes:
            return family
    raise LabError(f"unknown size {size!r}: known sizes are {', '.join(all_sizes(families))}")


def of_folder(families, folder: Path, model_type: str | None) -> Family:
    """The family of a checkpoint folder by config.json's model_type (a folder without it is GPT-2's)."""
    known = {family.name: family for family in families}
    if (model_type or "gpt2") not in known:
        raise LabError(f"{folder / 'config.json'}: model_type {model_type!r} is not a model the lab runs "
                       f"({', '.join(known)})")
    return known[model_type or "gpt2"]


def all_sizes(families) -> list[str]:
    return [size for family in families for size in family.sizes]
