#!/usr/bin/env python3
"""GPT-2 or Llama 3 text generation with any attention rung, timed: the seed's 512-token run.

    python lab.py --kernel v02 --tokens 512 --random-weights   no KV cache: v02 runs for every token
    python lab.py --kernel v02 --kv-cache                       prefill with v02, then the fast decode step
    python lab.py --kernel v02 --check --json run.json          also rerun with the reference and compare
    python lab.py --device cpu --model FOLDER --tokens 20       NumPy and the reference attention
    python lab.py --random-weights --kv-cache --profile-step     where a decode step's time goes, per kernel
    python lab.py --dtype bfloat16 --kernel v15                  16-bit weights and attention (float16 too)
    python lab.py --model FOLDER --chat --prompt "Hi"           a Llama 3 checkpoint (config.json's model_type)
    python lab.py --random-weights --size llama-3.2-1b --prompt-ids 128000,791   Llama's shapes, ids in and out
    python lab.py watch v24                                     compile, check and time a rung on every save

Prints the text as it is generated, then a summary: model, attention, mode, token counts, seconds
and tokens/s (warm-up and compilation excluded), time to first token and decode tokens/s, weight
bytes per token and the bandwidth they imply against a measured copy ceiling (KV cache on the GPU),
compile time, peak GPU memory against the weights and KV cache the run holds (bound: 1.15 x their sum
+ 256 MiB), device. Weights are loaded in --dtype. Greedy runs on the GPU use the fast path (gpt2/fast: fused
kernels, a static KV cache, the decode step as one persistent kernel where the device runs it, else
replayed as CUDA graphs; llama/fast for Llama's greedy KV-cache runs: the decode step a CUDA graph of
fused kernels); --no-graph runs the eager code (gpt2/model.py, llama/model.py), Llama's grouped-query
attention through the rung (docs/llama.md).
User errors print one line to stderr and exit 2; --check exits 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import gpt2
import gpt2.fast
import kernels
import llama
import llama.fast
from gpt2 import LabError, Sampler, StreamDecoder, reference_attend
from gpt2.generate import decode_attention_name
from gpt2.load import load_folder as gpt2_load_folder
from gpt2.model import cast_params
from kernels import triton as triton_rungs
from lm import checkpoint
from lm.arrays import held_bytes
from lm.kv_cache import kv_cache_bytes
from lm.summary import PEAK_MEASURE, WARMUP_TOKENS, compare_with_reference, memory_figures, phase_times, print_summary

REFERENCE = "reference"
DEFAULT_PROMPT = "Hello, I'm a language model,"
DTYPES = ("float32", "float16", "bfloat16")
FAMILIES = {"gpt2": gpt2, "llama": llama}  # config.json's model_type -> the package (its fast path: .fast)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"lab.py: error: {message} (see lab.py --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="\n".join(__doc__.split("\n\n")[1:2]))
    p.add_argument("--kernel", help="attention rung (v02, v02_pad_k, a .cu path; a Triton rung: t01, a .py path) "
                                    "or 'reference'; "
                                    "default: the newest rung that takes --dtype, the head size and (Llama) grouped-query "
                                    "attention on the GPU, the reference on the CPU")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CuPy; cpu: NumPy with the reference attention; auto: gpu if there is one")
    p.add_argument("--prompt", help=f"default {DEFAULT_PROMPT!r}")
    p.add_argument("--prompt-ids", metavar="IDS", help="the prompt as token ids, 128000,791,... (as given: no "
                                                        "<|begin_of_text|> added); a model without a tokenizer "
                                                        "(random Llama weights) then shows its output as ids")
    p.add_argument("--chat", action="store_true", help="Llama: wrap --prompt in the Llama 3 instruct format (one "
                                                       "user turn, then the assistant's header); "
                                                       "--stop-at-eos then stops at <|eot_id|> too")
    p.add_argument("--tokens", type=int, default=512, help="new tokens to generate (default 512)")
    p.add_argument("--kv-cache", action="store_true",
                   help="prefill with the rung, then decode one token per step over a KV cache "
                        "(decode attention: kernels/fused/decode_attention.cu, Llama's gqa_decode_attention.cu, on the "
                        "fast path, v16_decode_split_kv "
                        "with --no-graph, the reference on the CPU); default: recompute the whole sequence every step")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (needs --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, and the random weights' seed (default 0)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop after <|endoftext|> (GPT-2), after the config's eos_token_id (Llama)")
    p.add_argument("--model", help=f"hub id or local folder (default {gpt2.DEFAULT_MODEL}); the model is "
                                   "config.json's model_type (gpt2 or llama); HF_HUB_OFFLINE=1 uses the cache only")
    p.add_argument("--random-weights", action="store_true",
                   help="GPT-2- or Llama-shaped weights from --seed, no download")
    p.add_argument("--size", choices=[*gpt2.SIZES, *llama.SIZES],
                   help="family member for --random-weights (default gpt2)")
    p.add_argument("--check", action="store_true",
                   help="rerun with the reference attention: identical tokens? largest logit difference?")
    p.add_argument("--json", metavar="PATH", help="write the summary, prompt and token ids as JSON")
    p.add_argument("--no-graph", action="store_true",
                   help="the readable eager path (gpt2/model.py or llama/model.py one step at a time: no fused "
                        "kernels, no CUDA graph); default on the GPU for greedy runs: the fast path of gpt2/fast "
                        "(llama/fast: greedy KV-cache runs)")
    p.add_argument("--profile-step", action="store_true",
                   help="after the run, time each kernel of one fast decode step (CUDA events) and the graph "
                        "replay per token, with and without the L2 prefetch hints (GPU, --kv-cache)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="weights cast once at load, and the attention's inputs: the rung must declare the dtype "
                        "(lab.dtypes). 16-bit: products, q, k, v and the KV cache in the dtype; LayerNorm, softmax, "
                        "GELU, accumulation and logits float32. bfloat16 greedy KV-cache runs take the fast path, "
                        "the rest the eager model; default float32 for GPT-2, bfloat16 for Llama")
    return p.parse_args(argv)


def check_args(args) -> None:
    if args.tokens < 1:
        raise LabError(f"--tokens must be at least 1, got {args.tokens}")
    if args.prompt is not None and not args.prompt:
        raise LabError("--prompt is empty: give at least one character")
    if args.prompt_ids is not None:
        if args.prompt is not None or args.chat:
            raise LabError("--prompt-ids is the prompt: it excludes --prompt and --chat")
        args.prompt_ids = parse_ids(args.prompt_ids)
    if args.model is not None and args.random_weights:
        raise LabError("--model and --random-weights exclude each other")
    if args.size is not None and not args.random_weights:
        raise LabError("--size chooses the size of --random-weights; with --model the checkpoint sets it")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise LabError(f"--json {args.json}: folder {Path(args.json).parent} does not exist")
    Sampler(args.temperature, args.top_k, args.seed)  # raises LabError on a bad temperature or top-k
    if args.profile_step and (args.no_graph or not args.kv_cache):
        raise LabError("--profile-step times the fast decode step: it needs --kv-cache and no --no-graph")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise LabError(f"--prompt-ids {text!r}: expected token ids separated by commas, e.g. 128000,791") from None
    if min(ids) < 0:
        raise LabError(f"--prompt-ids: token id {min(ids)} is negative")
    return ids


def pick_device(choice: str) -> str:
    if choice == "cpu":
        return "cpu"
    has_gpu = kernels.gpu_available()
    if choice == "gpu" and not has_gpu:
        raise LabError("--device gpu: no CUDA device (or CuPy) here; use --device cpu")
    return "gpu" if has_gpu else "cpu"


def pick_kernel(name: str | None, device: str, asked: str = "auto", dtype: str = "float32",
                arch: str | None = None) -> str:
    """The rung's full name (v02_pad_k), a .cu path, or "reference" (which takes every dtype).
    `arch` (the GPU's, "sm_90") keeps the default to rungs that run there (lab.min_arch); an FP8 rung
    (lab.fp8), which quantizes its inputs, is never the default."""
    able = [n for n in kernels.names() if dtype in kernels.load(n).dtypes]  # the rungs that take dtype
    if name is None:  # the newest that takes dtype, runs on arch, and is made for whole sequences in that dtype
        prefill = [n for n in able if not kernels.load(n).split_kv and not kernels.load(n).fp8
                   and (arch is None or kernels.load(n).runs_on(arch))]
        return prefill[-1] if device == "gpu" and prefill else REFERENCE
    if name.lower() in (REFERENCE, "ref"):
        return REFERENCE
    triton = triton_rungs.owns(name)
    try:
        path = triton_rungs.resolve(name) if triton else kernels.resolve(name)
    except ValueError as exc:
        raise LabError(f"{exc}, or 'reference'") from None
    if dtype not in load_rung(path).dtypes:
        raise LabError(f"kernel {path.stem} takes {', '.join(load_rung(path).dtypes)}, not --dtype {dtype}; "
                       f"{', '.join(able) + ' or ' if able else ''}the reference do")
    if device == "cpu":
        why = "--device cpu runs" if asked == "cpu" else "there is no CUDA device here, and the CPU runs"
        raise LabError(f"--kernel {name} runs on the GPU; {why} the reference attention only")
    if triton and kernels.triton_unavailable():
        raise LabError(f"--kernel {name}: {kernels.triton_unavailable()}")
    return path.stem if path.parent in (Path(kernels.__file__).parent, triton_rungs.TRITON_DIR) else str(path)


def load_rung(kernel):
    """A rung's declarations (dtypes, head sizes, supports): a .cu rung's, or a Triton rung's (t01)."""
    return triton_rungs.load(kernel) if triton_rungs.owns(kernel) else kernels.load(kernel)


def tune_length_buckets(attend, config, longest: int) -> None:
    """A Triton rung autotunes on its first call in each power-of-two length bucket: call it once in
    every bucket up to `longest` positions now, so that no tuning lands in the timed run."""
    import cupy

    T = 1
    while True:
        q = cupy.zeros((1, config.n_head, T, config.head_size), dtype=cupy.float32)  # attend casts to the run's dtype
        kv = cupy.zeros((1, config.kv_heads, T, config.head_size), dtype=cupy.float32)
        attend(q, kv, kv)
        if T >= longest:
            break
        T = min(2 * T, longest)
    cupy.cuda.Device().synchronize()


def make_attend(kernel: str, dtype: str = "float32"):
    """The attention in `dtype`: inputs of another dtype (the fast path's float32 prefill in a
    bfloat16 run) are cast to it, and the output back to theirs."""
    # the rung takes (B, NH, T, hs) views of the packed qkv projection as they are
    in_dtype = reference_attend if kernel == REFERENCE else kernels.Attend(kernel)

    def attend(q, k, v):
        if q.dtype.name == dtype:
            return in_dtype(q, k, v)
        return in_dtype(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(q.dtype)

    if kernel != REFERENCE:  # launched many times on one layout: see kernels.Attend.prepare
        attend.prepare = lambda q, k, v: in_dtype.prepare(q, k, v) if q.dtype.name == dtype else lambda: attend(q, k, v)
    return attend


def locate_model(args) -> tuple[str, Path | None, Path | None]:
    """The family ("gpt2" or "llama": --size's, or config.json's model_type; a folder without
    config.json is GPT-2's) and, for --model, its folder (a hub id downloaded) and a named .safetensors."""
    if args.random_weights:
        return ("llama" if args.size in llama.SIZES else "gpt2"), None, None
    folder, file = checkpoint.locate(args.model or gpt2.DEFAULT_MODEL)
    family = checkpoint.model_type(folder) or "gpt2"
    if family not in FAMILIES:
        raise LabError(f"{folder / 'config.json'}: model_type {family!r} is not a model the lab runs "
                       f"({', '.join(FAMILIES)})")
    return family, folder, file


def load_checkpoint(args, family: str, folder: Path | None, file: Path | None, xp):
    """The weights in --dtype, each tensor cast as it is drawn or read (no float32 copy of a 16-bit run's
    weights on the device)."""
    if args.random_weights:
        return FAMILIES[family].random_weights(args.size or "gpt2", seed=args.seed, xp=xp, dtype=args.dtype)
    load_folder = gpt2_load_folder if family == "gpt2" else llama.load_folder
    return load_folder(folder, xp=xp, name=args.model or gpt2.DEFAULT_MODEL, file=file, dtype=args.dtype)


def rungs_taking(config, dtype: str) -> list[str]:
    """The rungs that take the model's head size, grouped-query attention if it has it, and dtype, computing
    in it: not an FP8 rung (lab.fp8), which quantizes its inputs and runs only when named."""
    gqa = config.kv_heads != config.n_head
    return [n for n in kernels.names() if config.head_size in kernels.load(n).head_sizes()
            and dtype in kernels.load(n).dtypes and (not gqa or "gqa" in kernels.load(n).supports)
            and not kernels.load(n).fp8]


def fit_kernel(kernel: str, asked: str | None, config, dtype: str, device: str, arch: str | None) -> str:
    """The rung for this model: the one asked for, refused (naming the rungs that would do) if it
    lacks the head size or grouped-query attention; by default on the GPU the newest whole-sequence
    rung that takes the model and runs there, else the reference."""
    able = rungs_taking(config, dtype)
    if asked is None:
        if device != "gpu":
            return REFERENCE
        prefill = [n for n in able if not kernels.load(n).split_kv and kernels.load(n).runs_on(arch)]
        return prefill[-1] if prefill else REFERENCE
    if kernel == REFERENCE:
        return kernel
    rung = load_rung(kernel)
    others = f"; {', '.join(able)} take it in {dtype}" if able else f"; no rung takes it in {dtype}"
    if config.head_size not in rung.head_sizes():
        sizes = ", ".join(map(str, rung.head_sizes()))
        raise LabError(f"kernel {kernel} supports head sizes {sizes}; this model's is {config.head_size}{others}")
    if config.kv_heads != config.n_head and "gqa" not in rung.supports:
        raise LabError(f"kernel {kernel} does not take grouped-query attention ({config.kv_heads} key/value heads "
                       f"for {config.n_head} query heads){others}")
    return kernel


def encode_prompt(args, family: str, encoding) -> list[int]:
    """--prompt-ids as given, or --prompt through the tokenizer (Llama: after <|begin_of_text|>, or in
    the chat format with --chat)."""
    if args.chat and family != "llama":
        raise LabError("--chat wraps the prompt in Llama 3's instruct format; GPT-2 has none")
    if args.prompt_ids is not None:
        return args.prompt_ids
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if family == "gpt2":
        return encoding.encode(text, allowed_special="all")
    if encoding is None:
        where = "random weights have" if args.random_weights else f"{args.model} has"
        raise LabError(f"{where} no tokenizer.model: give the prompt as token ids, --prompt-ids 128000,791,...")
    return llama.tokenizer.chat(encoding, text) if args.chat else llama.tokenizer.encode(encoding, text)


def eos_ids(args, family: str, config, encoding) -> tuple[int, ...]:
    """What --stop-at-eos stops at: <|endoftext|> (GPT-2); the config's eos_token_id (Llama), and with
    --chat <|eot_id|>, which ends the assistant's turn."""
    if not args.stop_at_eos:
        return ()
    if family == "gpt2":
        return (config.eos_token_id,)
    chat = (llama.tokenizer.special(encoding, "<|eot_id|>"),) if args.chat else ()
    return tuple(dict.fromkeys(config.eos_token_id + chat))


def device_name(device: str) -> str:
    if device == "gpu":
        import cupy

        return f"{kernels.device_limits().name} (CuPy {cupy.__version__})"
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} (NumPy {np.__version__})"


def run(args) -> int:
    check_args(args)
    device = pick_device(args.device)
    family, folder, file = locate_model(args)
    args.dtype = args.dtype or ("float32" if family == "gpt2" else llama.DEFAULT_DTYPE)
    arch = kernels.device_limits().arch if device == "gpu" else None
    kernel = pick_kernel(args.kernel, device, args.device, args.dtype, arch)
    if device == "gpu":
        import cupy as xp
    else:
        xp = np
    if args.profile_step and device == "cpu":
        raise LabError("--profile-step needs the GPU (the fast path)")
    encoding = gpt2.load_tokenizer(folder) if family == "gpt2" else llama.load_tokenizer(folder)
    prompt = encode_prompt(args, family, encoding)
    free_before = xp.cuda.runtime.memGetInfo()[0] if device == "gpu" else None
    ckpt = load_checkpoint(args, family, folder, file, xp)
    config = ckpt.config
    kernel = fit_kernel(kernel, args.kernel, config, args.dtype, device, arch)
    ckpt.params = cast_params(ckpt.params, args.dtype)  # loaded in it: the arrays as they are
    if device == "gpu":  # the layout the fast engine reads without a copy
        if family == "gpt2":
            gpt2.fast.decode_layout(ckpt.params)
        else:
            llama.fast.decode_layout(ckpt.params, config)
    pool = xp.get_default_memory_pool() if device == "gpu" else None
    if pool is not None:
        pool.free_all_blocks()  # the load's transients; from here the pool only grows: it ends at its peak
    if len(prompt) + args.tokens > config.n_positions:
        raise LabError(f"{len(prompt)} prompt tokens + --tokens {args.tokens} = {len(prompt) + args.tokens} "
                       f"positions, but the model has {config.n_positions}")
    attend = make_attend(kernel, args.dtype)
    eos = eos_ids(args, family, config, encoding)
    fast_why = ("--no-graph" if args.no_graph else "NumPy on the CPU" if device == "cpu"
                else FAMILIES[family].fast.unsupported_reason(ckpt.params, config, kv_cache=args.kv_cache,
                                                              sampler=Sampler(args.temperature, args.top_k, args.seed)))
    positions = len(prompt) + args.tokens  # every run of this call, warm-up and check included, on one engine

    def sync():
        if device == "gpu":
            xp.cuda.Device().synchronize()

    def run_once(attention, n_new, **kw):
        sampler = Sampler(args.temperature, args.top_k, args.seed)
        if family == "gpt2":
            return gpt2.generate(ckpt.params, config, prompt, n_new, attend=attention, kv_cache=args.kv_cache,
                                 sampler=sampler, eos_id=eos[0] if eos else None, fast=not args.no_graph, **kw)
        return llama.generate(ckpt.params, config, prompt, n_new, attend=attention, kv_cache=args.kv_cache,
                              sampler=sampler, eos_ids=eos, fast=not args.no_graph, max_len=positions, **kw)

    # Warm-up outside the timing: compiles the rung (NVRTC) and CuPy's own elementwise kernels.
    compile_start = kernels.runtime.compile_seconds
    start = time.perf_counter()
    run_once(attend, min(WARMUP_TOKENS, args.tokens))
    if triton_rungs.owns(kernel):
        tune_length_buckets(attend, config, len(prompt) + args.tokens)
    sync()
    warmup_seconds = time.perf_counter() - start

    # without a tokenizer (random Llama weights) the prompt and the new tokens are shown as ids
    stream = StreamDecoder(encoding) if encoding is not None else lambda token: f" {token}"
    stamps = []  # host time of each token's arrival: the first one is the time to first token

    def show(token):
        stamps.append(time.perf_counter())
        if token not in eos:
            sys.stdout.write(stream(token))
            sys.stdout.flush()

    if args.prompt_ids is None:  # the text as typed (with --chat: the user's turn)
        shown_prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    else:
        shown_prompt = encoding.decode(prompt) if encoding is not None else None
    sys.stdout.write(shown_prompt if shown_prompt is not None else ",".join(map(str, prompt)))
    sys.stdout.flush()
    sync()
    compile_before = kernels.runtime.compile_seconds
    start = time.perf_counter()
    result = run_once(attend, args.tokens, on_token=show)
    sync()
    seconds = time.perf_counter() - start - (kernels.runtime.compile_seconds - compile_before)
    sys.stdout.write((stream.flush() if encoding is not None else "") + "\n")
    peak = pool.total_bytes() if pool is not None else None
    memory = (memory_figures(peak, free_before - xp.cuda.runtime.memGetInfo()[0], held_bytes(ckpt.params.values()),
                             *held_by_run(ckpt, config, args, fast_why, len(prompt), family))
              if pool is not None else {})

    check = compare_with_reference(run_once, attend, result, args.tokens, xp) if args.check else None
    n_new = len(result.tokens)
    phases = phase_times(stamps, start, n_new)
    if args.kv_cache and device == "gpu" and args.dtype in FAMILIES[family].fast.DTYPES:  # the dtypes it counts bytes for
        phases |= bandwidth(family, config, args.dtype, phases["decode_tokens_per_second"])
    engine = fast_engine(family, ckpt, config, positions) if fast_why is None else None
    profile = (profile_step(engine or fast_engine(family, ckpt, config, positions), len(prompt) + n_new - 1)
               if args.profile_step else None)
    summary = {
        "model": ckpt.name,
        "family": family,
        "n_params": ckpt.n_params,
        "config": asdict(config),
        "kernel": kernel,
        "mode": "kv-cache" if args.kv_cache else "no-kv-cache",
        "decode_attention": (decode_attention_name(xp, config, args.dtype) if fast_why else
                             f"fused {'decode_attention' if family == 'gpt2' else 'gqa_decode_attention'}")
        if args.kv_cache else None,
        "engine": "fast" if fast_why is None else "eager",
        "engine_note": fast_why,
        "pdl": engine.pdl_note if engine is not None and args.kv_cache else None,
        "persistent": engine.persistent_note if engine is not None and args.kv_cache else None,
        "products": getattr(engine, "products", "cublas") if engine is not None else None,
        "dtype": args.dtype,
        "device": device,
        "device_name": device_name(device),
        "prompt": shown_prompt,
        "prompt_tokens": prompt,
        "generated_tokens": result.tokens,
        "generated_text": encoding.decode(result.tokens) if encoding is not None else None,
        "tokenizer_note": None if encoding is not None else
        "none (no tokenizer.model: random weights, or a folder without one): prompt and output as token ids",
        "n_prompt_tokens": len(prompt),
        "n_new_tokens": n_new,
        "seconds": seconds,
        "tokens_per_second": n_new / seconds if seconds > 0 else math.inf,
        **phases,
        "profile_step": profile,
        "compile_seconds": kernels.runtime.compile_seconds - compile_start,
        "warmup_seconds": warmup_seconds,
        "peak_gpu_memory_bytes": peak,
        "peak_gpu_memory_measure": PEAK_MEASURE if peak is not None else None,
        **memory,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop_at_eos": args.stop_at_eos,
        "eos_ids": list(eos),
        "stopped_at_eos": result.stopped_at_eos,
        "check": check,
    }
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if check is not None and not check["identical"] else 0


def fast_engine(family: str, ckpt, config, positions: int):
    """The fast engine generate() ran on: GPT-2's (n_positions long), or Llama's for these positions."""
    if family == "gpt2":
        return gpt2.fast.engine_for(ckpt.params, config)
    return llama.fast.engine_for(ckpt.params, config, positions=positions)


def held_by_run(ckpt, config, args, fast_why: str | None, n_prompt: int, family: str) -> tuple[int, int | None]:
    """The KV cache's bytes in this run (the fast engine's static one: GPT-2's n_positions long, Llama's
    the run's positions rounded up; the eager path's, prompt + new tokens; none without --kv-cache on the
    eager path) and what the fast engine holds beside the weights (None on the eager path)."""
    if fast_why is None:
        engine = fast_engine(family, ckpt, config, n_prompt + args.tokens)
        return engine.k_cache.nbytes + engine.v_cache.nbytes, engine.added_bytes()
    positions = n_prompt + args.tokens - 1 if args.kv_cache else 0
    return kv_cache_bytes(config, positions, args.dtype), None


def bandwidth(family: str, config, dtype: str, decode_tokens_per_second) -> dict:
    """Weight bytes one decode step reads, the rate they imply, and a copy ceiling measured now."""
    per_token = FAMILIES[family].fast.weight_bytes_per_token(config, dtype)
    ceiling = gpt2.fast.copy_ceiling()
    achieved = per_token * decode_tokens_per_second if decode_tokens_per_second else None
    return {"weight_bytes_per_token": per_token, "achieved_weight_bytes_per_second": achieved,
            "copy_ceiling_bytes_per_second": ceiling,
            "copy_ceiling_measure": "device-to-device copy of 1 GiB (bytes read + written), median of 10, this run",
            "fraction_of_copy_ceiling": achieved / ceiling if achieved else None}


def profile_step(engine, position: int) -> dict:
    """Where a fast decode step's time goes at `position` (GPT-2's engine or Llama's): the per-operation
    kernels each timed alone (events), their graph replay per token with and without the L2 prefetch
    hints and PDL, and, where the persistent step runs, its time per token and its stages (global-timer
    trace, by kind)."""
    position = max(0, min(position, engine.max_len - 3))
    kernels_ms = engine.profile_step(position)
    steps = max(1, min(64, engine.max_len - 1 - position) // engine.steps_per_graph) * engine.steps_per_graph
    replay_from = max(0, min(position, engine.max_len - 1 - steps))
    out = {
        "position": position,
        "kernels": [{"name": name, "ms": ms} for name, ms in kernels_ms],
        "by_kind": [{"kind": kind, "launches": n, "ms": ms} for kind, n, ms in gpt2.fast.by_kind(kernels_ms)],
        "kernel_ms_sum": sum(ms for _, ms in kernels_ms),
        "graph_ms_per_token": engine.replay_ms(replay_from, steps, persistent=False),
        "graph_ms_per_token_without_prefetch": engine.replay_ms(replay_from, steps, prefetch=False),
        "graph_ms_per_token_without_pdl": engine.replay_ms(replay_from, steps, pdl=False) if engine.pdl else None,
        "pdl": engine.pdl_note,
        "graph_replay": f"{steps} steps from position {replay_from}, graphs of {engine.steps_per_graph} steps",
        "persistent": engine.persistent_note,
        "persistent_ms_per_token": None,
        "persistent_stages": None,
    }
    if engine.persistent:
        out["persistent_ms_per_token"] = engine.replay_ms(replay_from, steps, persistent=True)
        stages = engine.profile_persistent(position)
        work = dict((k, ms) for k, _, ms in gpt2.fast.by_kind([(name, w) for name, _, w, _ in stages]))
        wait = dict((k, ms) for k, _, ms in gpt2.fast.by_kind([(name, b) for name, _, _, b in stages]))
        out["persistent_stages"] = [
            {"kind": kind, "stages": n, "ms": ms, "work_ms": work[kind], "wait_ms": wait[kind]}
            for kind, n, ms in gpt2.fast.by_kind([(name, total) for name, total, _, _ in stages])]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["watch"]:  # a subcommand of its own: benchmarks/watch.py
        from benchmarks import watch

        return watch.main(argv[1:])
    args = parse_args(argv)
    try:
        return run(args)
    except (LabError, kernels.KernelCompileError) as exc:
        sys.stdout.flush()
        print(f"lab.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
