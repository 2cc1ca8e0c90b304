"""Llama 3 in CuPy (or NumPy) arrays, with the attention passed in: the lab's second model, whose
grouped-query attention (fewer key/value heads than query heads) the rungs that declare gqa take.

    from llama import load, load_tokenizer, generate, tokenizer
    ckpt = load("meta-llama/Llama-3.2-1B", xp=cupy)       # or load.random_weights("llama-3.2-1b", xp=cupy)
    enc = load_tokenizer(ckpt.folder)                     # tokenizer.model; None if the folder has none
    out = generate(ckpt.params, ckpt.config, tokenizer.encode(enc, "Hello"), 32, attend=my_attention)

Modules: config (the dataclass, the three sizes, RoPE's frequencies), load (hub, folder, seed; every
checkpoint quirk), tokenizer, model (the forward pass), generate, family (FAMILY: Llama as lab.py and
bench.py call it, lm.family.Family). What is not Llama's own (safetensors,
the hub, the KV cache, sampling, the generation loop) is lm/'s, shared with gpt2/.
"""

from .config import SIZES, LlamaConfig, RopeScaling
from .family import DEFAULT_DTYPE, FAMILY
from .generate import generate
from .load import Checkpoint, load, load_folder, random_weights, save
from .model import compute_dtype, forward
from .tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_DTYPE",
    "FAMILY",
    "SIZES",
    "Checkpoint",
    "LlamaConfig",
    "RopeScaling",
    "compute_dtype",
    "forward",
    "generate",
    "load",
    "load_folder",
    "load_tokenizer",
    "random_weights",
    "save",
]
