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
+ 256 MiB; without a KV cache, the weights and one forward's activations at the longest length), device. Weights are loaded in --dtype. Greedy runs on the GPU use the fast path (gpt2/fast: fused
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
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

import gpt2
import kernels
import llama
from kernels import triton as triton_rungs
from lm import checkpoint
from lm.arrays import cast_params, held_bytes
from lm.attention import attention_bytes
from lm.cli import Parser, command
from lm.errors import LabError
from lm.family import Family, all_sizes, of_folder, of_size
from lm.generate import Sampler, StreamDecoder, decode_attention_name, reference_attend
from lm.kv_cache import kv_cache_bytes
from lm.measure import by_kind, copy_ceiling
from lm.summary import PEAK_MEASURE, WARMUP_TOKENS, compare_with_reference, memory_figures, phase_times, print_summary
from lm.switch import ASKED, ON, Switch

REFERENCE = "reference"
DEFAULT_PROMPT = "Hello, I'm a language model,"
DTYPES = ("float32", "float16", "bfloat16")
FAMILIES = (gpt2.FAMILY, llama.FAMILY)  # chosen by config.json's model_type, or by --size


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="lab.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.add_argument("--size", choices=all_sizes(FAMILIES),
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
    if name is None:  # fit_kernel narrows it to the model's head size once the model is read
        return (kernels.default_rung(dtype, arch=arch) if device == "gpu" else None) or REFERENCE
    able = [n for n in kernels.names() if dtype in kernels.load(n).dtypes]  # the rungs that take dtype
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


def unverified(kernel: str) -> str | None:
    """Why a .cu rung has not run on a GPU yet (its lab.unverified line), for the summary; else None."""
    if kernel == REFERENCE or triton_rungs.owns(kernel):
        return None
    return kernels.load(kernel).unverified


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
    if kernel != REFERENCE:  # the rung takes (B, NH, T, hs) views of the packed qkv projection as they are
        return kernels.Attend(kernel, dtype=dtype)

    def attend(q, k, v):
        if q.dtype.name == dtype:
            return reference_attend(q, k, v)
        return reference_attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(q.dtype)

    return attend


def locate_model(args) -> tuple[Family, Path | None, Path | None]:
    """The family (--size's, or config.json's model_type; a folder without config.json is GPT-2's) and,
    for --model, its folder (a hub id downloaded) and a named .safetensors."""
    if args.random_weights:
        return of_size(FAMILIES, args.size or "gpt2"), None, None
    folder, file = checkpoint.locate(args.model or gpt2.DEFAULT_MODEL)
    return of_folder(FAMILIES, folder, checkpoint.model_type(folder)), folder, file


def load_checkpoint(args, family: Family, folder: Path | None, file: Path | None, xp):
    """The weights in --dtype, each tensor cast as it is drawn or read (no float32 copy of a 16-bit run's
    weights on the device)."""
    if args.random_weights:
        return family.random_weights(args.size or "gpt2", seed=args.seed, xp=xp, dtype=args.dtype)
    return family.load_folder(folder, xp=xp, name=args.model or gpt2.DEFAULT_MODEL, file=file, dtype=args.dtype)


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
    if asked is None:
        gqa = config.kv_heads != config.n_head
        return (kernels.default_rung(dtype, config.head_size, gqa, arch) if device == "gpu" else None) or REFERENCE
    able = rungs_taking(config, dtype)
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


def encode_prompt(args, family: Family, encoding) -> list[int]:
    """--prompt-ids as given, or --prompt through the family's tokenizer (Llama: after <|begin_of_text|>,
    or in the chat format with --chat)."""
    if args.prompt_ids is not None:
        return args.prompt_ids
    if encoding is None:
        where = "random weights have" if args.random_weights else f"{args.model} has"
        raise LabError(f"{where} no tokenizer.model: give the prompt as token ids, --prompt-ids 128000,791,...")
    return family.encode(encoding, args.prompt if args.prompt is not None else DEFAULT_PROMPT, chat=args.chat)


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


@dataclass
class Setup:
    """What a run holds once loaded: its family, device, weights, tokenizer, prompt and attention."""

    family: Family
    device: str
    xp: object  # NumPy or CuPy
    ckpt: object  # the family's Checkpoint, its params in --dtype
    encoding: object  # the tokenizer; None where there is none (random Llama weights)
    prompt: list[int]
    kernel: str
    eos: tuple[int, ...]  # what --stop-at-eos stops at
    attend: object  # the rung (or the reference) in --dtype
    fast: Switch  # whether generate() takes the family's fast path
    free_before: int | None  # device bytes free before the weights (GPU)
    positions: int  # prompt + --tokens: every run of this call, warm-up and check included, on one engine

    @property
    def config(self):
        return self.ckpt.config


@dataclass
class Timed:
    """The timed run: its Generation, seconds (compilation excluded), each token's host arrival time."""

    result: object
    seconds: float
    start: float
    stamps: list[float]
    shown_prompt: str | None
    warmup_seconds: float
    compile_start: float  # kernels.runtime.compile_seconds before the warm-up


def run(args) -> int:
    setup = load(args)
    timed = timed_generation(args, setup)
    measured = measure(args, setup, timed)
    summary = summarize(args, setup, timed, measured)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    check = summary["check"]
    return 1 if check is not None and not check["identical"] else 0


def load(args) -> Setup:
    """The arguments checked, the model located and its weights loaded in --dtype (laid out for the fast
    engine on the GPU), the prompt encoded, the rung chosen for the model."""
    check_args(args)
    device = pick_device(args.device)
    family, folder, file = locate_model(args)
    args.dtype = args.dtype or family.default_dtype
    arch = kernels.device_limits().arch if device == "gpu" else None
    kernel = pick_kernel(args.kernel, device, args.device, args.dtype, arch)
    if device == "gpu":
        import cupy as xp
    else:
        xp = np
    if args.profile_step and device == "cpu":
        raise LabError("--profile-step needs the GPU (the fast path)")
    encoding = family.load_tokenizer(folder)
    prompt = encode_prompt(args, family, encoding)
    free_before = xp.cuda.runtime.memGetInfo()[0] if device == "gpu" else None
    ckpt = load_checkpoint(args, family, folder, file, xp)
    kernel = fit_kernel(kernel, args.kernel, ckpt.config, args.dtype, device, arch)
    ckpt.params = cast_params(ckpt.params, args.dtype)  # loaded in it: the arrays as they are
    if device == "gpu":  # the layout the fast engine reads without a copy
        family.decode_layout(ckpt.params, ckpt.config)
        xp.get_default_memory_pool().free_all_blocks()  # the load's transients; from here the pool only grows
    if len(prompt) + args.tokens > ckpt.config.n_positions:
        raise LabError(f"{len(prompt)} prompt tokens + --tokens {args.tokens} = {len(prompt) + args.tokens} "
                       f"positions, but the model has {ckpt.config.n_positions}")
    eos = family.stop_ids(ckpt.config, encoding, chat=args.chat) if args.stop_at_eos else ()
    return Setup(family, device, xp, ckpt, encoding, prompt, kernel, eos, make_attend(kernel, args.dtype),
                 fast_path(args, family, ckpt, device), free_before, len(prompt) + args.tokens)


def generate_once(args, setup: Setup, attention, n_new: int, **kw):
    """One generation of n_new tokens with `attention`, as the family's generate() runs it."""
    return setup.family.generate(setup.ckpt.params, setup.config, setup.prompt, n_new, attend=attention,
                                 kv_cache=args.kv_cache, sampler=Sampler(args.temperature, args.top_k, args.seed),
                                 eos_ids=setup.eos, fast=not args.no_graph, max_len=setup.positions, **kw)


def timed_generation(args, setup: Setup) -> Timed:
    """A warm-up outside the timing (it compiles the rung, NVRTC, and CuPy's own elementwise kernels),
    then the timed run, its text streamed as it arrives."""
    attend = setup.attend
    compile_start = kernels.runtime.compile_seconds
    start = time.perf_counter()
    generate_once(args, setup, attend, min(WARMUP_TOKENS, args.tokens))
    if triton_rungs.owns(setup.kernel):
        tune_length_buckets(attend, setup.config, setup.positions)
    sync(setup)
    warmup_seconds = time.perf_counter() - start

    encoding = setup.encoding  # without one (random Llama weights) the prompt and new tokens show as ids
    stream = StreamDecoder(encoding) if encoding is not None else lambda token: f" {token}"
    stamps = []  # host time of each token's arrival: the first one is the time to first token

    def show(token):
        stamps.append(time.perf_counter())
        if token not in setup.eos:
            sys.stdout.write(stream(token))
            sys.stdout.flush()

    if args.prompt_ids is None:  # the text as typed (with --chat: the user's turn)
        shown_prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    else:
        shown_prompt = encoding.decode(setup.prompt) if encoding is not None else None
    sys.stdout.write(shown_prompt if shown_prompt is not None else ",".join(map(str, setup.prompt)))
    sys.stdout.flush()
    sync(setup)
    compile_before = kernels.runtime.compile_seconds
    start = time.perf_counter()
    result = generate_once(args, setup, attend, args.tokens, on_token=show)
    sync(setup)
    seconds = time.perf_counter() - start - (kernels.runtime.compile_seconds - compile_before)
    sys.stdout.write((stream.flush() if encoding is not None else "") + "\n")
    return Timed(result, seconds, start, stamps, shown_prompt, warmup_seconds, compile_start)


def sync(setup: Setup) -> None:
    if setup.device == "gpu":
        setup.xp.cuda.Device().synchronize()


def measure(args, setup: Setup, timed: Timed) -> dict:
    """What the run is measured by beside its time, taken in this order after it: memory (the pool's
    peak first), the check against the reference, the phases and bandwidth, the step's profile."""
    xp, gpu = setup.xp, setup.device == "gpu"
    peak = xp.get_default_memory_pool().total_bytes() if gpu else None
    memory = (memory_figures(peak, setup.free_before - xp.cuda.runtime.memGetInfo()[0],
                             held_bytes(setup.ckpt.params.values()), *held_by_run(args, setup),
                             *(activations(args, setup) if not args.kv_cache else ())) if gpu else {})
    run_once = partial(generate_once, args, setup)
    check = (compare_with_reference(run_once, setup.attend, timed.result, args.tokens, xp)
             if args.check else None)
    n_new = len(timed.result.tokens)
    phases = phase_times(timed.stamps, timed.start, n_new)
    if args.kv_cache and gpu and args.dtype in setup.family.fast_dtypes:  # the dtypes it counts bytes for
        phases |= bandwidth(setup.family, setup.config, args.dtype, phases["decode_tokens_per_second"])
    engine = fast_engine(setup) if setup.fast or args.profile_step else None
    profile = profile_step(engine, len(setup.prompt) + n_new - 1) if args.profile_step else None
    return {"peak": peak, "memory": memory, "check": check, "phases": phases, "profile": profile,
            "engine": engine if setup.fast else None}


def summarize(args, setup: Setup, timed: Timed, measured: dict) -> dict:
    """The run's summary: what print_summary shows and --json writes."""
    engine, config, n_new, seconds = measured["engine"], setup.config, len(timed.result.tokens), timed.seconds
    fused = f"fused {setup.family.decode_attention}"
    peak = measured["peak"]
    return {
        "model": setup.ckpt.name,
        "family": setup.family.name,
        "n_params": setup.ckpt.n_params,
        "config": asdict(config),
        "kernel": setup.kernel,
        "kernel_unverified": unverified(setup.kernel),
        "mode": "kv-cache" if args.kv_cache else "no-kv-cache",
        "decode_attention": (fused if setup.fast else decode_attention_name(setup.xp, config, args.dtype))
        if args.kv_cache else None,
        "engine": "fast" if setup.fast else "eager",
        "engine_note": setup.fast.why,
        "pdl": engine.pdl_note if engine is not None and args.kv_cache else None,
        "persistent": engine.persistent_note if engine is not None and args.kv_cache else None,
        "products": getattr(engine, "products", "cublas") if engine is not None else None,
        "dtype": args.dtype,
        "device": setup.device,
        "device_name": device_name(setup.device),
        "prompt": timed.shown_prompt,
        "prompt_tokens": setup.prompt,
        "generated_tokens": timed.result.tokens,
        "generated_text": setup.encoding.decode(timed.result.tokens) if setup.encoding is not None else None,
        "tokenizer_note": None if setup.encoding is not None else
        "none (no tokenizer.model: random weights, or a folder without one): prompt and output as token ids",
        "n_prompt_tokens": len(setup.prompt),
        "n_new_tokens": n_new,
        "seconds": seconds,
        "tokens_per_second": n_new / seconds if seconds > 0 else math.inf,
        **measured["phases"],
        "profile_step": measured["profile"],
        "compile_seconds": kernels.runtime.compile_seconds - timed.compile_start,
        "warmup_seconds": timed.warmup_seconds,
        "peak_gpu_memory_bytes": peak,
        "peak_gpu_memory_measure": PEAK_MEASURE if peak is not None else None,
        **measured["memory"],
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop_at_eos": args.stop_at_eos,
        "eos_ids": list(setup.eos),
        "stopped_at_eos": timed.result.stopped_at_eos,
        "check": measured["check"],
    }


def fast_path(args, family: Family, ckpt, device: str) -> Switch:
    """Whether generate() takes the family's fast path (gpt2/fast, llama/fast), or off and why not."""
    if args.no_graph:
        return Switch.off("--no-graph", ASKED)
    if device == "cpu":
        return Switch.off("NumPy on the CPU")
    why = family.fast_reason(ckpt.params, ckpt.config, kv_cache=args.kv_cache,
                             sampler=Sampler(args.temperature, args.top_k, args.seed))
    return ON if why is None else Switch.off(why)


def fast_engine(setup: Setup):
    """The fast engine generate() ran on: GPT-2's (n_positions long), or Llama's for the run's positions."""
    return setup.family.engine(setup.ckpt.params, setup.config, setup.positions)


def held_by_run(args, setup: Setup) -> tuple[int, int | None]:
    """The KV cache's bytes in this run (the fast engine's static one: GPT-2's n_positions long, Llama's
    the run's positions rounded up; the eager path's, prompt + new tokens; none without --kv-cache on the
    eager path) and what the fast engine holds beside the weights (None on the eager path)."""
    if setup.fast:
        engine = fast_engine(setup)
        return engine.k_cache.nbytes + engine.v_cache.nbytes, engine.added_bytes()
    positions = setup.positions - 1 if args.kv_cache else 0
    return kv_cache_bytes(setup.config, positions, args.dtype), None


def activations(args, setup: Setup) -> tuple[int, str]:
    """Without a KV cache, what the run holds beside the weights for its longest step, a forward over
    prompt + new tokens - 1 positions, and how that was counted: on the fast engine, everything it holds
    (its buffers for that length, its tiled weight copies, its static cache: arrays(), counted after the
    run) and the attention's own at that length, on its float32 views; on the eager path, the model's
    forward_activation_bytes."""
    config, T = setup.config, setup.positions - 1
    reference = setup.kernel == REFERENCE
    if setup.fast:
        engine = fast_engine(setup)
        attend = attention_bytes(1, config.n_head, config.kv_heads, T, T, config.head_size, 4, reference=reference)
        return (engine.added_bytes() + attend,
                f"what the fast engine holds for a pass over T = {T} positions (its buffers, weight copies and "
                "static cache) + the attention's own")
    return (setup.family.activation_bytes(config, 1, T, args.dtype, reference=reference),
            f"one forward's activations at T = {T} ({setup.family.name}/model.py forward_activation_bytes)")


def bandwidth(family: Family, config, dtype: str, decode_tokens_per_second) -> dict:
    """Weight bytes one decode step reads, the rate they imply, and a copy ceiling measured now."""
    per_token = family.weight_bytes_per_token(config, dtype)
    ceiling = copy_ceiling()
    achieved = per_token * decode_tokens_per_second if decode_tokens_per_second else None
    return {"weight_bytes_per_token": per_token, "achieved_weight_bytes_per_second": achieved,
            "copy_ceiling_bytes_per_second": ceiling,
            "copy_ceiling_measure": "device-to-device copy of 1 GiB (bytes read + written), median of 10, this run",
            "fraction_of_copy_ceiling": achieved / ceiling if achieved else None}


def profile_step(engine, position: int) -> dict:
    """Where a fast decode step's time goes at `position` (GPT-2's engine or Llama's): the per-operation
    kernels each timed alone (events), their graph replay per token with and without the L2 prefetch
    hints and PDL and without each kind of launch, and, where the persistent step runs, its time per
    token and its stages (global-timer trace, by kind)."""
    position = max(0, min(position, engine.max_len - 3))
    kernels_ms = engine.profile_step(position)
    steps = max(1, min(64, engine.max_len - 1 - position) // engine.steps_per_graph) * engine.steps_per_graph
    replay_from = max(0, min(position, engine.max_len - 1 - steps))
    out = {
        "position": position,
        "kernels": [{"name": name, "ms": ms} for name, ms in kernels_ms],
        "by_kind": [{"kind": kind, "launches": n, "ms": ms} for kind, n, ms in by_kind(kernels_ms)],
        "kernel_ms_sum": sum(ms for _, ms in kernels_ms),
        "graph_ms_per_token": engine.replay_ms(replay_from, steps, persistent=False),
        "graph_ms_per_token_without_prefetch": engine.replay_ms(replay_from, steps, prefetch=False),
        "graph_ms_per_token_without_pdl": engine.replay_ms(replay_from, steps, pdl=False) if engine.pdl else None,
        # each kind's cost inside the graph: the replay without its launches (the steps then compute
        # nothing meaningful; only their time is kept), against the whole replay
        "graph_ms_per_token_without": {kind: engine.replay_ms(replay_from, steps, persistent=False, drop={kind})
                                       for kind, _, _ in by_kind(kernels_ms)},
        "pdl": engine.pdl_note,
        "graph_replay": f"{steps} steps from position {replay_from}, graphs of {engine.steps_per_graph} steps",
        "persistent": engine.persistent_note,
        "persistent_ms_per_token": None,
        "persistent_stages": None,
    }
    if engine.persistent:
        out["persistent_ms_per_token"] = engine.replay_ms(replay_from, steps, persistent=True)
        stages = engine.profile_persistent(position)
        work = dict((k, ms) for k, _, ms in by_kind([(name, w) for name, _, w, _ in stages]))
        wait = dict((k, ms) for k, _, ms in by_kind([(name, b) for name, _, _, b in stages]))
        out["persistent_stages"] = [
            {"kind": kind, "stages": n, "ms": ms, "work_ms": work[kind], "wait_ms": wait[kind]}
            for kind, n, ms in by_kind([(name, total) for name, total, _, _ in stages])]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["watch"]:  # a subcommand of its own: benchmarks/watch.py
        from benchmarks import watch

        return watch.main(argv[1:])
    return command("lab.py", run, parse_args(argv))



if __name__ == "__main__":
    sys.exit(main())
