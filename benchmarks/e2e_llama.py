"""`bench.py e2e --model llama-3.2-1b`: seconds for Llama-shaped random weights in bfloat16 to generate
tokens greedily with the rung that takes the model (and any --kernels), without and with a KV cache (the
KV-cache mode on llama/fast's decode step, the rung prefilling), beside HF transformers'
LlamaForCausalLM on the same weights with a static cache. Random weights have no tokenizer: the prompt
is token ids. llama/ is imported only here, when the subcommand runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import kernels

from . import device
from .device import CannotRun, progress
from .e2e import add_generation_comparisons, generation_rows, publish, time_hf_generation
from .results import SCHEMA

DTYPE = "bfloat16"  # Llama's checkpoints are stored in it
# <|begin_of_text|>, then ids picked by hand: any ids do, the weights are random
PROMPT_IDS = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13]


def llama_seam():
    """The Llama of llama/: SIZES, random_weights, generate, save, its fast path, and lm/'s cast and reference
    attention."""
    try:
        import llama
        import llama.fast  # noqa: F401
        from llama import SIZES, generate, random_weights, save  # noqa: F401  (the names e2e uses)
        from lm.arrays import cast_params  # noqa: F401
    except ImportError as exc:
        raise CannotRun(f"needs the Llama package llama/ with SIZES, random_weights, generate and save "
                        f"({type(exc).__name__}: {exc})") from None
    return llama


def refusal(path: Path, config, dtype: str, able: list[str]) -> str | None:
    """Why the rung at path cannot be this model's attention (naming those that can), or None."""
    rung = kernels.load(path.stem)
    lacks = [what for what, ok in (
        (f"head size {config.head_size}", config.head_size in rung.head_sizes()),
        (f"grouped-query attention ({config.kv_heads} key/value heads for {config.n_head} query heads)",
         config.kv_heads == config.n_head or "gqa" in rung.supports),
        (dtype, dtype in rung.dtypes)) if not ok]
    if not lacks:
        return None
    return f"does not take {' or '.join(lacks)}; {', '.join(able) or 'no rung'} take{'s' * (len(able) == 1)} it"


def cmd_e2e_llama(args) -> int:
    device.require_gpu()
    llama = llama_seam()
    from lm.arrays import cast_params
    from lm.generate import decode_attention_name, reference_attend

    cupy = device.get_cupy()
    setup = device.setup_info(args.argv) | {"model": args.model}
    modes = [False, True] if args.mode == "both" else [args.mode == "kv-cache"]
    ckpt = llama.random_weights(args.model, seed=args.seed, xp=cupy)
    ckpt.params = cast_params(ckpt.params, DTYPE)  # rounded once, as lab.py --dtype bfloat16 does
    config, prompt = ckpt.config, PROMPT_IDS
    llama.fast.decode_layout(ckpt.params, config)  # as lab.py lays them out: the fast engine holds views
    device.release_memory()  # the float32 draw, the layout's transients
    able = kernels.rungs_for(DTYPE, config.head_size, config.kv_heads != config.n_head, kernels.device_limits().arch)
    if not able:
        raise CannotRun(f"no rung takes {args.model} (head size {config.head_size}, grouped-query attention, "
                        f"{DTYPE}) on this device")
    paths = list(dict.fromkeys([kernels.resolve(able[-1]), *args.kernels]))  # the newest that takes it, first
    impls = [("reference", "CuPy reference", "peer", reference_attend)]
    impls += [(p.stem, p.stem, "rung", refusal(p, config, DTYPE, able) or kernels.Attend(p)) for p in paths]
    decoder = ("llama.fast's decode step (fused kernels, a CUDA graph)" if llama.fast.unsupported_reason(
        ckpt.params, config, kv_cache=True) is None else decode_attention_name(cupy, config, DTYPE))
    progress(f"{setup['device']['name']}: {ckpt.name}, {DTYPE}, {len(prompt)} prompt tokens (ids), "
             f"{args.tokens} new tokens, greedy; KV-cache decode steps with {decoder}")
    positions = len(prompt) + args.tokens  # the warm-up and the timed run on one engine

    def generate(attend, kv, n, on_token):
        return llama.generate(ckpt.params, config, prompt, n, attend=attend, kv_cache=kv, on_token=on_token,
                              max_len=positions)

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:  # the weights as HF reads them
        folder = Path(scratch) / args.model

        def hf(kv):
            if not folder.exists():
                llama.save(ckpt, folder)  # float32 on disk: HF rounds to bfloat16 as cast_params did
            return time_hf_generation(folder, prompt, args.tokens, kv, args.warmup, args.hf_attn,
                                      model_class="LlamaForCausalLM", dtype=DTYPE, static_cache=True)

        rows = generation_rows(modes, impls, generate, None if args.no_hf else hf, args)
    add_generation_comparisons(rows)
    result = {
        "schema": SCHEMA, "kind": "e2e", "setup": setup,
        "model": ckpt.name, "prompt": prompt, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
        "sampling": "greedy", "dtype": DTYPE, "modes": ["kv-cache" if kv else "no-cache" for kv in modes],
        "method": {
            "clock": "time.perf_counter around llama.generate (device synchronized before and after), after a "
                     f"{args.warmup}-token warm-up generation that compiles every rung and CuPy kernel",
            "prompt": "<|begin_of_text|> (128000) then ids picked by hand: random weights have no tokenizer",
            "no-cache": "every step runs the whole sequence so far through llama/model.py (CuPy, eager; products "
                        "on bfloat16 operands accumulated in float32; past the last layer only the last "
                        "position): the attention under test runs on every token, at every length",
            "kv-cache": "the prompt is prefilled through the attention under test (llama/model.py's forward); "
                        f"each later step is one query over the cached key/value heads with {decoder}, the "
                        "same for every rung",
            "hf": "transformers LlamaForCausalLM.from_pretrained on the same weights (llama.save), "
                  f"dtype=bfloat16, generate(do_sample=False, min_new_tokens=max_new_tokens); no cache: "
                  "use_cache=False; KV cache: cache_implementation=\"static\", after a warm-up of all "
                  f"{args.tokens} tokens (the static cache's shape, and whatever generate compiles for it)",
        },
        "rows": rows,
        "decode": None,
    }
    return publish(result, setup, args.results)

