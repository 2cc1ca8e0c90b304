#!/usr/bin/env python3
"""GPT-2 text generation with any attention rung, timed: the seed's 512-token run.

    python lab.py --kernel v02 --tokens 512 --random-weights   no KV cache: v02 runs for every token
    python lab.py --kernel v02 --kv-cache                       prefill with v02, then the fast decode step
    python lab.py --kernel v02 --check --json run.json          also rerun with the reference and compare
    python lab.py --device cpu --model FOLDER --tokens 20       NumPy and the reference attention
    python lab.py --random-weights --kv-cache --profile-step     where a decode step's time goes, per kernel
    python lab.py --dtype bfloat16 --kernel v15                  16-bit weights and attention (float16 too)

Prints the text as it is generated, then a summary: model, attention, mode, token counts, seconds
and tokens/s (warm-up and compilation excluded), time to first token and decode tokens/s, weight
bytes per token and the bandwidth they imply against a measured copy ceiling (KV cache on the GPU),
compile time, peak GPU memory, device. Greedy runs on the GPU use the fast path (gpt2/fast: fused
kernels, a static KV cache, the decode step as one persistent kernel where the device runs it, else
replayed as CUDA graphs); --no-graph runs the eager code.
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
from gpt2 import LabError, Sampler, StreamDecoder, generate, reference_attend
from gpt2.generate import decode_attention_name
from gpt2.model import cast_params

REFERENCE = "reference"
DEFAULT_PROMPT = "Hello, I'm a language model,"
DTYPES = ("float32", "float16", "bfloat16")
WARMUP_TOKENS = 2  # one full step and, with the KV cache, one decode step: every kernel compiled


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"lab.py: error: {message} (see lab.py --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="\n".join(__doc__.split("\n\n")[1:2]))
    p.add_argument("--kernel", help="attention rung (v02, v02_pad_k, a .cu path) or 'reference'; "
                                    "default: the newest rung that takes --dtype on the GPU, the reference on the CPU")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CuPy; cpu: NumPy with the reference attention; auto: gpu if there is one")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default {DEFAULT_PROMPT!r}")
    p.add_argument("--tokens", type=int, default=512, help="new tokens to generate (default 512)")
    p.add_argument("--kv-cache", action="store_true",
                   help="prefill with the rung, then decode one token per step over a KV cache "
                        "(decode attention: kernels/fused/decode_attention.cu on the fast path, v16_decode_split_kv "
                        "with --no-graph, the reference on the CPU); default: recompute the whole sequence every step")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (needs --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, and the random weights' seed (default 0)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop after <|endoftext|>")
    p.add_argument("--model", help=f"hub id or local folder (default {gpt2.DEFAULT_MODEL}); "
                                   "HF_HUB_OFFLINE=1 uses the cache only")
    p.add_argument("--random-weights", action="store_true", help="GPT-2-shaped weights from --seed, no download")
    p.add_argument("--size", choices=list(gpt2.SIZES), help="family member for --random-weights (default gpt2)")
    p.add_argument("--check", action="store_true",
                   help="rerun with the reference attention: identical tokens? largest logit difference?")
    p.add_argument("--json", metavar="PATH", help="write the summary, prompt and token ids as JSON")
    p.add_argument("--no-graph", action="store_true",
                   help="the readable eager path (gpt2/model.py one step at a time: no fused kernels, no CUDA "
                        "graph); default on the GPU for greedy runs: the fast path of gpt2/fast")
    p.add_argument("--profile-step", action="store_true",
                   help="after the run, time each kernel of one fast decode step (CUDA events) and the graph "
                        "replay per token, with and without the L2 prefetch hints (GPU, --kv-cache)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="weights cast once at load, and the attention's inputs: the rung must declare the dtype "
                        "(lab.dtypes). 16-bit: products, q, k, v and the KV cache in the dtype; LayerNorm, softmax, "
                        "GELU, accumulation and logits float32. bfloat16 greedy KV-cache runs take the fast path, "
                        "the rest the eager model; default float32")
    return p.parse_args(argv)


def check_args(args) -> None:
    if args.tokens < 1:
        raise LabError(f"--tokens must be at least 1, got {args.tokens}")
    if not args.prompt:
        raise LabError("--prompt is empty: give at least one character")
    if args.model is not None and args.random_weights:
        raise LabError("--model and --random-weights exclude each other")
    if args.size is not None and not args.random_weights:
        raise LabError("--size chooses the size of --random-weights; with --model the checkpoint sets it")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise LabError(f"--json {args.json}: folder {Path(args.json).parent} does not exist")
    Sampler(args.temperature, args.top_k, args.seed)  # raises LabError on a bad temperature or top-k
    if args.profile_step and (args.no_graph or not args.kv_cache):
        raise LabError("--profile-step times the fast decode step: it needs --kv-cache and no --no-graph")


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
    `arch` (the GPU's, "sm_90") keeps the default to rungs that run there (lab.min_arch)."""
    able = [n for n in kernels.names() if dtype in kernels.load(n).dtypes]  # the rungs that take dtype
    if name is None:  # the newest that takes dtype, runs on arch, and is made for whole sequences
        prefill = [n for n in able if not kernels.load(n).split_kv and (arch is None or kernels.load(n).runs_on(arch))]
        return prefill[-1] if device == "gpu" and prefill else REFERENCE
    if name.lower() in (REFERENCE, "ref"):
        return REFERENCE
    try:
        path = kernels.resolve(name)
    except ValueError as exc:
        raise LabError(f"{exc}, or 'reference'") from None
    if dtype not in kernels.load(path).dtypes:
        raise LabError(f"kernel {path.stem} takes {', '.join(kernels.load(path).dtypes)}, not --dtype {dtype}; "
                       f"{', '.join(able) + ' or ' if able else ''}the reference do")
    if device == "cpu":
        why = "--device cpu runs" if asked == "cpu" else "there is no CUDA device here, and the CPU runs"
        raise LabError(f"--kernel {name} runs on the GPU; {why} the reference attention only")
    return path.stem if path.parent == Path(kernels.__file__).parent else str(path)


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


def load_checkpoint(args, xp):
    if args.random_weights:
        return gpt2.random_weights(args.size or "gpt2", seed=args.seed, xp=xp)
    return gpt2.load(args.model or gpt2.DEFAULT_MODEL, xp=xp)


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
    kernel = pick_kernel(args.kernel, device, args.device, args.dtype,
                         kernels.device_limits().arch if device == "gpu" else None)
    if device == "gpu":
        import cupy as xp
    else:
        xp = np
    if device == "cpu" and args.profile_step:
        raise LabError("--profile-step needs the GPU (the fast path)")
    ckpt = load_checkpoint(args, xp)
    config = ckpt.config
    ckpt.params = cast_params(ckpt.params, args.dtype)  # once; float32: the arrays as loaded
    if kernel != REFERENCE and config.head_size not in kernels.load(kernel).head_sizes():
        sizes = ", ".join(map(str, kernels.load(kernel).head_sizes()))
        raise LabError(f"kernel {kernel} supports head sizes {sizes}; this model's is {config.head_size}")
    encoding = gpt2.load_tokenizer(ckpt.folder)
    prompt = encoding.encode(args.prompt, allowed_special="all")
    if len(prompt) + args.tokens > config.n_positions:
        raise LabError(f"{len(prompt)} prompt tokens + --tokens {args.tokens} = {len(prompt) + args.tokens} "
                       f"positions, but the model has {config.n_positions}")
    attend = make_attend(kernel, args.dtype)
    eos = config.eos_token_id if args.stop_at_eos else None
    fast_why = "--no-graph" if args.no_graph else "NumPy on the CPU" if device == "cpu" else gpt2.fast.unsupported_reason(
        ckpt.params, config, kv_cache=args.kv_cache, sampler=Sampler(args.temperature, args.top_k, args.seed))

    def sync():
        if device == "gpu":
            xp.cuda.Device().synchronize()

    def run_once(attention, n_new, **kw):
        return generate(ckpt.params, config, prompt, n_new, attend=attention, kv_cache=args.kv_cache,
                        sampler=Sampler(args.temperature, args.top_k, args.seed), eos_id=eos,
                        fast=not args.no_graph, **kw)

    # Warm-up outside the timing: compiles the rung (NVRTC) and CuPy's own elementwise kernels.
    compile_start = kernels.runtime.compile_seconds
    start = time.perf_counter()
    run_once(attend, min(WARMUP_TOKENS, args.tokens))
    sync()
    warmup_seconds = time.perf_counter() - start
    pool = xp.get_default_memory_pool() if device == "gpu" else None
    if pool is not None:
        pool.free_all_blocks()  # from here the pool only grows: what it holds at the end is its peak

    stream = StreamDecoder(encoding)
    stamps = []  # host time of each token's arrival: the first one is the time to first token

    def show(token):
        stamps.append(time.perf_counter())
        if token != eos:
            sys.stdout.write(stream(token))
            sys.stdout.flush()

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    sync()
    compile_before = kernels.runtime.compile_seconds
    start = time.perf_counter()
    result = run_once(attend, args.tokens, on_token=show)
    sync()
    seconds = time.perf_counter() - start - (kernels.runtime.compile_seconds - compile_before)
    sys.stdout.write(stream.flush() + "\n")
    peak = pool.total_bytes() if pool is not None else None

    check = compare_with_reference(run_once, attend, result, args.tokens, xp) if args.check else None
    n_new = len(result.tokens)
    phases = phase_times(stamps, start, n_new)
    if args.kv_cache and device == "gpu" and args.dtype in gpt2.fast.DTYPES:  # the dtypes it counts bytes for
        phases |= bandwidth(config, args.dtype, phases["decode_tokens_per_second"])
    profile = profile_step(ckpt, config, len(prompt) + n_new - 1) if args.profile_step else None
    summary = {
        "model": ckpt.name,
        "n_params": ckpt.n_params,
        "config": asdict(config),
        "kernel": kernel,
        "mode": "kv-cache" if args.kv_cache else "no-kv-cache",
        "decode_attention": (decode_attention_name(xp, config, args.dtype) if fast_why else "fused decode_attention")
        if args.kv_cache else None,
        "engine": "fast" if fast_why is None else "eager",
        "engine_note": fast_why,
        "pdl": gpt2.fast.engine_for(ckpt.params, config).pdl_note if fast_why is None and args.kv_cache else None,
        "persistent": gpt2.fast.engine_for(ckpt.params, config).persistent_note
        if fast_why is None and args.kv_cache else None,
        "products": gpt2.fast.engine_for(ckpt.params, config).products if fast_why is None else None,
        "dtype": args.dtype,
        "device": device,
        "device_name": device_name(device),
        "prompt": args.prompt,
        "prompt_tokens": prompt,
        "generated_tokens": result.tokens,
        "generated_text": encoding.decode(result.tokens),
        "n_prompt_tokens": len(prompt),
        "n_new_tokens": n_new,
        "seconds": seconds,
        "tokens_per_second": n_new / seconds if seconds > 0 else math.inf,
        **phases,
        "profile_step": profile,
        "compile_seconds": kernels.runtime.compile_seconds - compile_start,
        "warmup_seconds": warmup_seconds,
        "peak_gpu_memory_bytes": peak,
        "peak_gpu_memory_measure": "CuPy memory pool high-water mark (total_bytes), weights included"
        if peak is not None else None,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop_at_eos": args.stop_at_eos,
        "stopped_at_eos": result.stopped_at_eos,
        "check": check,
    }
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if check is not None and not check["identical"] else 0


def phase_times(stamps: list[float], start: float, n_new: int) -> dict:
    """Time to first token (the prefill: host clock when the first token arrived) and the rate of the
    tokens after it (from the first token's arrival to the last's)."""
    first = stamps[0] - start if stamps else None
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"time_to_first_token_seconds": first,
            "decode_tokens_per_second": (len(stamps) - 1) / span if span > 0 else None}


def bandwidth(config, dtype: str, decode_tokens_per_second) -> dict:
    """Weight bytes one decode step reads, the rate they imply, and a copy ceiling measured now."""
    per_token = gpt2.fast.weight_bytes_per_token(config, dtype)
    ceiling = gpt2.fast.copy_ceiling()
    achieved = per_token * decode_tokens_per_second if decode_tokens_per_second else None
    return {"weight_bytes_per_token": per_token, "achieved_weight_bytes_per_second": achieved,
            "copy_ceiling_bytes_per_second": ceiling,
            "copy_ceiling_measure": "device-to-device copy of 1 GiB (bytes read + written), median of 10, this run",
            "fraction_of_copy_ceiling": achieved / ceiling if achieved else None}


def profile_step(ckpt, config, position: int) -> dict:
    """Where a fast decode step's time goes at `position`: the per-operation kernels each timed alone
    (events), their graph replay per token with and without the L2 prefetch hints and PDL, and, where
    the persistent step runs, its time per token and its stages (global-timer trace, by kind)."""
    engine = gpt2.fast.engine_for(ckpt.params, config)
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


def compare_with_reference(run_once, attend, timed, n_new: int, xp) -> dict:
    """Rerun with the rung and with the reference attention, both recording each step's logits
    (kept out of the timed run). Logits are compared over the steps whose inputs were identical:
    up to and including the first differing token."""
    rung = run_once(attend, n_new, record_logits=True)
    ref = run_once(reference_attend, n_new, record_logits=True, decode_attend=reference_attend)
    n = min(len(rung.tokens), len(ref.tokens))
    first = next((i for i in range(n) if rung.tokens[i] != ref.tokens[i]), None)
    steps = n if first is None else first + 1
    diff = max(float(xp.abs(a - b).max()) for a, b in zip(rung.logits[:steps], ref.logits[:steps], strict=True))
    return {
        "identical": first is None and len(rung.tokens) == len(ref.tokens),
        "first_difference": first if first is not None else (n if len(rung.tokens) != len(ref.tokens) else None),
        "max_logit_diff": diff,
        "steps_compared": steps,
        "reference_tokens": ref.tokens,
        "rerun_matches_timed_run": rung.tokens == timed.tokens,
    }


def print_summary(s: dict) -> None:
    if s["mode"] == "kv-cache":
        mode = f"KV cache: prefill with {s['kernel']}, decode attention: {s['decode_attention']}"
    else:
        mode = f"no KV cache: every step recomputes the whole sequence with {s['kernel']}"
    peak = (f"{s['peak_gpu_memory_bytes'] / 2**20:.1f} MiB (CuPy memory pool high-water mark, weights included)"
            if s["peak_gpu_memory_bytes"] is not None else "n/a (cpu)")
    rows = [
        ("model", f"{s['model']}, {s['n_params'] / 1e6:.1f}M parameters"),
        ("attention", s["kernel"]),
        ("mode", mode),
        ("prompt tokens", s["n_prompt_tokens"]),
        ("new tokens", s["n_new_tokens"] if not s["stopped_at_eos"] else f"{s['n_new_tokens']} (stopped at end-of-text)"),
        ("seconds", f"{s['seconds']:.3f} (warm-up and compilation excluded)"),
        ("tokens/s", f"{s['tokens_per_second']:.1f}"),
        ("engine", engine_line(s)),
    ]
    if s["time_to_first_token_seconds"] is not None:
        rows.append(("first token", f"{1e3 * s['time_to_first_token_seconds']:.1f} ms after the start "
                                    f"(prefill of {s['n_prompt_tokens']} prompt tokens; host clock at its arrival)"))
    if s["decode_tokens_per_second"]:
        rows.append(("decode", f"{s['decode_tokens_per_second']:.1f} tokens/s after the first token "
                               f"({1e3 / s['decode_tokens_per_second']:.3f} ms per token)"))
    if s.get("weight_bytes_per_token"):
        rows.append(("weights/token", f"{s['weight_bytes_per_token'] / 1e6:.1f} MB ({s['dtype']}): every weight read "
                                      "once per decode step (KV cache not counted)"))
    if s.get("achieved_weight_bytes_per_second"):
        rows.append(("bandwidth", f"{s['achieved_weight_bytes_per_second'] / 1e9:.0f} GB/s of weights = "
                                  f"{100 * s['fraction_of_copy_ceiling']:.0f}% of a "
                                  f"{s['copy_ceiling_bytes_per_second'] / 1e9:.0f} GB/s copy ceiling "
                                  f"({s['copy_ceiling_measure']})"))
    rows += [
        ("compile time", f"{s['compile_seconds']:.3f} s (rungs and fused kernels; not in the timing)"),
        ("warm-up", f"{s['warmup_seconds']:.3f} s ({WARMUP_TOKENS} tokens before the timed run; not in the timing)"),
        ("peak GPU memory", peak),
        ("device", s["device_name"]),
    ]
    if s["check"] is not None:
        c = s["check"]
        if c["identical"]:
            verdict = f"tokens identical to the reference attention's ({s['n_new_tokens']} of {s['n_new_tokens']})"
        else:
            verdict = f"tokens DIFFER from the reference attention's from new token {c['first_difference']}"
        rows.append(("check", f"{verdict}; largest logit difference {c['max_logit_diff']:.3g} "
                              f"over {c['steps_compared']} steps"))
        if not c["rerun_matches_timed_run"]:
            rows.append(("", "note: rerunning the rung gave other tokens than the timed run (nondeterministic)"))
    print("-" * 60)
    for key, value in rows:
        print(f"{key:<17}{value}")
    if s["profile_step"] is not None:
        print_profile(s["profile_step"])


def engine_line(s: dict) -> str:
    if s["engine"] != "fast":
        return f"eager: gpt2/model.py step by step ({s['engine_note']})"
    if s["mode"] == "kv-cache" and s.get("persistent") == "on":
        return (f"fast ({s['dtype']}): static KV cache, the decode step as one persistent kernel per window of "
                "tokens (kernels/fused/decode_step.cu)")
    if s["mode"] == "kv-cache":
        return (f"fast ({s['dtype']}): fused kernels, static KV cache, the decode step replayed as a CUDA graph "
                f"(programmatic dependent launch {s['pdl']}; persistent step {s.get('persistent')})")
    products = "kernels/fused/gemm.cu (3xTF32 wgmma)" if s.get("products") == "3xtf32" else "cuBLAS SGEMM"
    return f"fast ({s['dtype']}): fused kernels, the products on {products}, the whole sequence every step"


def print_profile(p: dict) -> None:
    total = p["kernel_ms_sum"]
    print("-" * 60)
    print(f"one decode step at position {p['position']}, each kernel timed alone (events, launched back to back):")
    for row in p["by_kind"]:
        print(f"  {row['kind']:<28}{row['launches']:>4} x {1e3 * row['ms'] / row['launches']:7.1f} us = "
              f"{1e3 * row['ms']:8.1f} us  {100 * row['ms'] / total:5.1f}%")
    print(f"  {'sum of kernels':<28}{len(p['kernels']):>4} launches {1e3 * total:13.1f} us")
    print(f"graph replay ({p['graph_replay']}): {1e3 * p['graph_ms_per_token']:.1f} us per token as generate() "
          f"runs it (programmatic dependent launch {p['pdl']}, L2 prefetch hints on); "
          f"{1e3 * p['graph_ms_per_token_without_prefetch']:.1f} us without the prefetch hints"
          + (f", {1e3 * p['graph_ms_per_token_without_pdl']:.1f} us with plain launches"
             if p["graph_ms_per_token_without_pdl"] is not None else ""))
    if p.get("persistent_stages"):
        print(f"persistent step: {1e3 * p['persistent_ms_per_token']:.1f} us per token as generate() runs it; its "
              "stages (second of two steps; from the previous stage's last start to this one's, the slowest "
              "block's work, the median block's wait for the next stage's inputs):")
        for row in p["persistent_stages"]:
            n = row["stages"]
            print(f"  {row['kind']:<28}{n:>4} x {1e3 * row['ms'] / n:7.2f} us  (work {1e3 * row['work_ms'] / n:6.2f}, "
                  f"wait {1e3 * row['wait_ms'] / n:5.2f})")
    else:
        print(f"persistent step: {p.get('persistent')}")


def main(argv=None) -> int:
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
