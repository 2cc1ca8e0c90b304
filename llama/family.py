"""Llama 3 as lm.family.Family: what lab.py and bench.py call, with the signatures every family shares."""

from __future__ import annotations

from lm.family import Family

from . import fast, tokenizer
from .config import SIZES, LlamaConfig, to_json
from .generate import generate
from .load import load_folder, random_weights, save, weight_bytes_per_token
from .model import forward, forward_activation_bytes

DEFAULT_DTYPE = "bfloat16"  # Llama's checkpoints are stored in it
BEGIN_OF_TEXT = LlamaConfig.bos_token_id  # <|begin_of_text|>


def encode(encoding, text: str, *, chat: bool) -> list[int]:
    """After <|begin_of_text|>; with chat, in the Llama 3 instruct format (one user turn, then the
    assistant's header)."""
    return tokenizer.chat(encoding, text) if chat else tokenizer.encode(encoding, text)


def stop_ids(config, encoding, *, chat: bool) -> tuple[int, ...]:
    """The config's eos_token_id, and with chat <|eot_id|>, which ends the assistant's turn."""
    turn = (tokenizer.special(encoding, "<|eot_id|>"),) if chat else ()
    return tuple(dict.fromkeys(config.eos_token_id + turn))


FAMILY = Family(
    name="llama", sizes=SIZES, default_dtype=DEFAULT_DTYPE, decode_attention="gqa_decode_attention",
    fast_dtypes=fast.DTYPES, load_folder=load_folder, random_weights=random_weights,
    load_tokenizer=tokenizer.load_tokenizer, encode=encode, stop_ids=stop_ids, generate=generate, forward=forward,
    backward=None,  # train.py refuses it: no backward pass yet
    fast_reason=fast.unsupported_reason, decode_layout=fast.decode_layout,
    engine=lambda params, config, positions: fast.engine_for(params, config, positions=positions),
    activation_bytes=forward_activation_bytes, weight_bytes_per_token=weight_bytes_per_token, config_json=to_json, save=save,
    hf_classes=("LlamaForCausalLM", "LlamaConfig"), bos_ids=(BEGIN_OF_TEXT,),
    prompt_ids=(BEGIN_OF_TEXT, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13),  # then ids picked by hand
)
