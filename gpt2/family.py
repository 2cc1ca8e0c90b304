"""GPT-2 as lm.family.Family: what lab.py and bench.py call, with the signatures every family shares."""

from __future__ import annotations

from lm.errors import LabError
from lm.family import Family

from . import backward, fast
from .config import SIZES
from .generate import generate
from .load import load_folder, random_weights, save, to_json
from .model import forward, forward_activation_bytes
from .tokenizer import load_tokenizer


def encode(encoding, text: str, *, chat: bool) -> list[int]:
    if chat:
        raise LabError("--chat wraps the prompt in Llama 3's instruct format; GPT-2 has none")
    return encoding.encode(text, allowed_special="all")


def stop_ids(config, encoding, *, chat: bool) -> tuple[int, ...]:
    """<|endoftext|>."""
    return (config.eos_token_id,)


def generate_run(params, config, prompt, n_new, *, attend, kv_cache, sampler, eos_ids=(), fast=True, max_len=None,
                 **kw):
    """gpt2.generate under the family's signature: eos_ids holds <|endoftext|> or nothing; max_len is
    Llama's (GPT-2's engine always holds n_positions)."""
    return generate(params, config, prompt, n_new, attend=attend, kv_cache=kv_cache, sampler=sampler,
                    eos_id=eos_ids[0] if eos_ids else None, fast=fast, **kw)


FAMILY = Family(
    name="gpt2", sizes=SIZES, default_dtype="float32", decode_attention="decode_attention", fast_dtypes=fast.DTYPES,
    load_folder=load_folder, random_weights=random_weights, load_tokenizer=load_tokenizer, encode=encode,
    stop_ids=stop_ids, generate=generate_run, forward=forward, backward=backward, fast_reason=fast.unsupported_reason,
    decode_layout=lambda params, config: fast.decode_layout(params),
    engine=lambda params, config, positions: fast.engine_for(params, config),
    activation_bytes=forward_activation_bytes, weight_bytes_per_token=fast.weight_bytes_per_token, config_json=to_json, save=save,
    hf_classes=("GPT2LMHeadModel", "GPT2Config"), bos_ids=(),
    prompt_ids=(15496, 11, 314, 1101, 257, 3303, 2746, 11),  # "Hello, I'm a language model,"
)
