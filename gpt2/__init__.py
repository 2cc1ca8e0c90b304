"""GPT-2 in CuPy (or NumPy) arrays, with the attention passed in.

    from gpt2 import load, load_tokenizer, generate
    ckpt = load("openai-community/gpt2", xp=cupy)          # or load.random_weights("gpt2", xp=cupy)
    enc = load_tokenizer(ckpt.folder)
    out = generate(ckpt.params, ckpt.config, enc.encode("Hello"), 32, attend=my_attention)

Modules: config (the dataclass and the four sizes), load (hub, folder, seed; every checkpoint
quirk), tokenizer, model (the forward pass), generate (sampling, both modes), backward (training:
the loss and every gradient, `from gpt2.backward import Attention, loss_and_grads`), family (FAMILY:
GPT-2 as lab.py and bench.py call it, lm.family.Family).
"""

from .config import SIZES, GPT2Config
from .errors import CheckpointError, LabError, ModelSourceError
from .family import FAMILY
from .generate import Generation, Sampler, generate, reference_attend
from .load import DEFAULT_MODEL, Checkpoint, load, random_weights, save
from .model import KVCache, forward
from .tokenizer import StreamDecoder, load_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "FAMILY",
    "SIZES",
    "Checkpoint",
    "CheckpointError",
    "GPT2Config",
    "Generation",
    "KVCache",
    "LabError",
    "ModelSourceError",
    "Sampler",
    "StreamDecoder",
    "forward",
    "generate",
    "load",
    "load_tokenizer",
    "random_weights",
    "reference_attend",
    "save",
]
