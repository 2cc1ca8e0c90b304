"""`bench.py e2e`: seconds for GPT-2 small to generate tokens greedily with each rung as its attention,
without and with a KV cache, beside HF transformers on the same weights; and the fast engine's decode
tokens/s (gpt2.fast, float32 and bfloat16, each decode step) against the lab's targets. gpt2/ is
imported only here, when the subcommand runs."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import kernels
from lm.measure import copy_ceiling

from . import device, plots
from .device import ROOT, CannotRun, Unavailable, first_line, progress
from .results import SCHEMA, result_path, write_result, wrote
from .tables import render_e2e

PROMPT = "Hello, I'm a language model,"


def gpt2_seam():
    """The GPT-2 of gpt2/: random_weights, load_tokenizer, generate(..., attend, kv_cache, on_token), save."""
    try:
        import gpt2
        from gpt2 import generate, load_tokenizer, random_weights, save  # noqa: F401  (the names e2e uses)
    except ImportError as exc:
        raise CannotRun(f"needs the GPT-2 package gpt2/ with random_weights, load_tokenizer, generate and save "
                        f"({type(exc).__name__}: {exc})") from None
    return gpt2


def attend_with(gpt2, path: Path | None):
    """The attention function gpt2.forward calls: the CuPy reference, or a rung (as lab.py runs them)."""
    if path is None:
        return gpt2.reference_attend
    return kernels.Attend(path)


def time_generation(generate, n_new: int, warmup: int) -> dict:
    """Wall-clock seconds for n_new greedy tokens of generate(n, on_token) (a model's generate with its
    attention and mode bound), a timestamp per token (on_token runs after the token is on the host, so
    each stamp follows that step's GPU work), and the CuPy pool's size."""
    cupy = device.get_cupy()
    pool = cupy.get_default_memory_pool()
    generate(warmup, None)  # compile, warm up
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    stamps = []
    compile_before = kernels.runtime.compile_seconds
    start = time.perf_counter()
    out = generate(n_new, lambda token: stamps.append(time.perf_counter()))
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "elapsed": [t - start for t in stamps], "tokens": list(out.tokens),
            "compile_seconds_in_run": kernels.runtime.compile_seconds - compile_before,  # 0: warm-up compiled all
            "peak_bytes": pool.total_bytes(),
            "peak_what": "CuPy memory pool after the run (its high-water mark: blocks are cached, not freed), weights included"}


def hf_transformers():
    """(torch, transformers), or Unavailable saying which is missing."""
    torch = device.get_torch()
    try:
        import transformers
    except Exception as exc:
        raise Unavailable(f"transformers is not importable ({type(exc).__name__}: {exc})") from None
    return torch, transformers


def time_hf_generation(folder: Path, prompt: list[int], n_new: int, kv_cache: bool, warmup: int,
                       attn_implementation: str, model_class: str = "GPT2LMHeadModel", dtype: str = "float32",
                       static_cache: bool = False) -> dict:
    """HF transformers' model_class on the same weights (saved by the model's save) in dtype, greedy;
    with static_cache, the KV-cache mode's cache is generate's static one (time_hf_model)."""
    torch, transformers = hf_transformers()
    # dtype at load (not .to(dtype) after it), so that buffers such as Llama's RoPE frequencies stay float32
    model = getattr(transformers, model_class).from_pretrained(str(folder), attn_implementation=attn_implementation,
                                                               dtype=getattr(torch, dtype))
    model = model.to("cuda").eval()
    try:
        out = time_hf_model(model, prompt, n_new, kv_cache, warmup, static_cache)
    finally:
        del model
        device.release_memory()
    return out | {"attn_implementation": attn_implementation, "transformers": transformers.__version__}


def time_hf_model(model, prompt: list[int], n_new: int, kv_cache: bool, warmup: int, static_cache: bool = False) -> dict:
    """An HF model on the device generating n_new tokens greedily after prompt: seconds, a host stamp per
    token, the tokens and torch's peak reserved memory. With static_cache, the KV-cache mode's cache is
    generate's static one, and the warm-up generates all n_new tokens so that the cache (and anything
    compiled for it) has the timed run's shape."""
    torch = device.get_torch()
    try:
        from transformers.generation.streamers import BaseStreamer
    except ImportError:  # generate() only calls put() and end()
        BaseStreamer = object

    class TokenClock(BaseStreamer):
        """generate() puts the prompt first, then each new token as it is chosen (already on the host)."""

        def __init__(self):
            self.stamps, self.first = [], True

        def put(self, value):
            if not (self.first and value.numel() == len(prompt) > 1):  # the prompt, not a token
                self.stamps.append(time.perf_counter())
            self.first = False

        def end(self):
            pass

    ids = torch.tensor([prompt], device="cuda")
    eos = model.config.eos_token_id
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, use_cache=kv_cache,
                   pad_token_id=eos[0] if isinstance(eos, list) else eos)
    if kv_cache and static_cache:
        options["cache_implementation"] = "static"
        warmup = n_new
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=warmup, min_new_tokens=warmup, **options)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        clock = TokenClock()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, streamer=clock, **options)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_reserved()
    return {"seconds": seconds, "elapsed": [t - start for t in clock.stamps], "tokens": out[0, len(prompt):].tolist(),
            "peak_bytes": peak, "peak_what": "torch.cuda.max_memory_reserved() during the run, weights included"}


DECODE_TARGETS = {"float32": 4000.0, "bfloat16": 7000.0}  # decode tokens/s with the KV cache, GPT-2 small
DECODE_STEPS = {"persistent": "one persistent kernel per window (kernels/fused/decode_step.cu)",
                "graphs": "CUDA graphs of the per-operation kernels (5 per layer + 2)"}


def time_decode(gpt2, ckpt, prompt: list[int], n_new: int, dtype: str, step: str, warmup: int) -> dict:
    """The fast engine's KV-cache generation in dtype with one decode step (DECODE_STEPS): time to the
    first token (the prefill, through the CuPy reference attention) and decode tokens/s from the
    first token's arrival on the host to the last's."""
    import gpt2.fast as fast

    cupy = device.get_cupy()
    params = ckpt.params if dtype == "float32" else fast.as_bfloat16(ckpt.params)
    engine = fast.Engine(params, ckpt.config, dtype=dtype, persistent=step == "persistent")
    try:
        engine.generate(prompt, warmup, attend=gpt2.reference_attend, kv_cache=True)  # compile, warm up
        cupy.cuda.Device().synchronize()
        stamps = []
        start = time.perf_counter()
        out = engine.generate(prompt, n_new, attend=gpt2.reference_attend, kv_cache=True,
                              on_token=lambda token: stamps.append(time.perf_counter()))
        cupy.cuda.Device().synchronize()
        seconds = time.perf_counter() - start
        note = f"programmatic dependent launch {engine.pdl_note}" if step == "graphs" else None
    finally:
        del engine
        fast.clear_cache()
        device.release_memory()
    return {"seconds": seconds, "elapsed": [t - start for t in stamps], "tokens": list(out.tokens), "note": note}


def decode_figures(row: dict, weight_bytes_per_token: int, ceiling: float) -> None:
    """From a row's per-token stamps: time to first token, decode tokens/s, the weight bytes streamed
    per second and their % of the copy ceiling (bytes/s), and, for gpt2.fast, whether the target is met."""
    t = row["elapsed"]
    row["ttft_ms"] = 1e3 * t[0]
    rate = row["decode_tokens_per_s"] = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None
    if rate is None:
        return
    row["weight_bytes_per_token"] = weight_bytes_per_token
    row["weight_tbps"] = weight_bytes_per_token * rate / 1e12
    row["pct_copy"] = 100 * weight_bytes_per_token * rate / ceiling
    if row["step"] in DECODE_STEPS:
        row["target_met"] = rate >= DECODE_TARGETS[row["dtype"]]


def report_generation(count: int, total: int, row: dict) -> None:
    where = f"[{count:>3}/{total}] {row['mode']:>8} {row['label']:<26}"
    if row["status"] == "ok":
        n = len(row["tokens"])
        progress(f"{where} {row['seconds']:8.2f} s  {n / row['seconds']:7.1f} tokens/s  "
                 f"peak {row['peak_bytes'] / 2**20:8.0f} MiB")
    else:
        progress(f"{where} {row['status']}: {row['reason']}")


def add_generation_comparisons(rows: list[dict]) -> None:
    """Per mode: speed-up against the CuPy reference, and how many leading tokens match its."""
    for mode in {r["mode"] for r in rows}:
        ref = next((r for r in rows if r["mode"] == mode and r["name"] == "reference" and r["status"] == "ok"), None)
        for r in rows:
            if r["mode"] != mode or r["status"] != "ok":
                continue
            r["tokens_per_s"] = len(r["tokens"]) / r["seconds"]
            r["ms_per_token"] = 1e3 * r["seconds"] / len(r["tokens"])
            if ref is not None:
                r["speedup_vs_reference"] = ref["seconds"] / r["seconds"]
                same = 0
                for a, b in zip(r["tokens"], ref["tokens"], strict=False):
                    if a != b:
                        break
                    same += 1
                r["same_tokens_as_reference"] = same


def generation_rows(modes: list[bool], impls: list[tuple], generate, hf, args) -> list[dict]:
    """Per mode (kv_cache False, True): each attention of impls (name, label, kind, attend; attend a str:
    the reason the model cannot take it, reported unsupported), timed through generate(attend, kv_cache,
    n, on_token); then HF transformers, hf(kv_cache) -> its timings (None: left out)."""
    rows, count = [], 0
    total = len(modes) * (len(impls) + (hf is not None))
    for kv in modes:
        mode = "kv-cache" if kv else "no-cache"
        for name, label, kind, attend in impls:
            count += 1
            row = {"name": name, "label": label, "kind": kind, "mode": mode, "kv_cache": kv}
            if isinstance(attend, str):
                row |= {"status": "unsupported", "reason": attend}
            else:
                try:
                    row |= time_generation(lambda n, on_token, a=attend, kv=kv: generate(a, kv, n, on_token), args.tokens,
                                           args.warmup)
                    row["status"] = "ok"
                except Exception as exc:
                    row |= {"status": "error", "reason": first_line(exc)}
            device.release_memory()
            rows.append(row)
            report_generation(count, total, row)
        if hf is not None:
            count += 1
            row = {"name": "hf", "label": f"HF transformers ({args.hf_attn})", "kind": "peer", "mode": mode,
                   "kv_cache": kv}
            try:
                row |= hf(kv)
                row["status"] = "ok"
            except Exception as exc:  # Unavailable, or transformers refusing something
                row |= {"status": "unavailable", "reason": first_line(exc)}
            rows.append(row)
            report_generation(count, total, row)
    return rows


def measure_decode(gpt2, ckpt, prompt: list[int], args, rows: list[dict]) -> dict:
    """The KV-cache decode table: the fast engine in float32 and bfloat16 with each decode step, and
    HF transformers' float32 kv-cache row measured above, each with its time to first token, decode
    tokens/s, the weight bytes streamed per second against the copy ceiling measured now, and the
    lab's decode target."""
    import gpt2.fast as fast

    ceiling = copy_ceiling()
    progress(f"decode: copy ceiling {ceiling / 1e12:.2f} TB/s (bytes read + written)")
    out = []
    for dtype in DECODE_TARGETS:
        for step in DECODE_STEPS:
            row = {"dtype": dtype, "step": step, "label": f"gpt2.fast, {step}"}
            try:
                row |= time_decode(gpt2, ckpt, prompt, args.tokens, dtype, step, args.warmup)
                row["status"] = "ok"
            except Exception as exc:
                row |= {"status": "error", "reason": first_line(exc)}
            out.append(row)
        hf = next((r for r in rows if r["name"] == "hf" and r["mode"] == "kv-cache"), None)
        if dtype == "float32" and hf is not None:  # the kv-cache row measured above
            out.append(dict(hf) | {"dtype": dtype, "step": "HF generate"})
    for r in out:
        if r["status"] != "ok":
            progress(f"decode {r['dtype']:<8} {r['label']:<30} {r['status']}: {r.get('reason', '')}")
            continue
        decode_figures(r, fast.weight_bytes_per_token(ckpt.config, r["dtype"]), ceiling)
        progress(f"decode {r['dtype']:<8} {r['label']:<30} first token {r['ttft_ms']:7.1f} ms, "
                 f"decode {r['decode_tokens_per_s'] or 0:8.1f} tokens/s")
    for r in out:
        r.pop("elapsed", None)
    return {"copy_tbps": ceiling / 1e12, "targets": DECODE_TARGETS, "steps": DECODE_STEPS, "rows": out,
            "method": "time.perf_counter stamps as each token reaches the host (gpt2.fast copies tokens back in "
                      f"windows, of {fast.STEPS_PER_LAUNCH} tokens with the persistent step and "
                      f"{fast.STEPS_PER_GRAPH} with graphs, while the GPU runs the next window): time to first "
                      "token = the prompt's "
                      "prefill and first argmax; decode tokens/s = (tokens - 1) / (last stamp - first stamp). "
                      "Weight bytes per token: gpt2.fast.weight_bytes_per_token (every matrix once, wte whole)."}


def cmd_e2e(args) -> int:
    device.require_gpu()
    gpt2 = gpt2_seam()
    cupy = device.get_cupy()
    setup = device.setup_info(args.argv) | {"model": "gpt2"}
    modes = [False, True] if args.mode == "both" else [args.mode == "kv-cache"]
    ckpt = gpt2.random_weights("gpt2", seed=args.seed, xp=cupy)
    text = PROMPT if args.prompt is None else args.prompt
    try:
        prompt = gpt2.load_tokenizer(None).encode(text, allowed_special="all")
    except Exception as exc:  # gpt2.LabError: no tiktoken files and no network
        raise CannotRun(str(exc)) from None
    progress(f"{setup['device']['name']}: GPT-2 small, {ckpt.name}, {len(prompt)} prompt tokens, "
             f"{args.tokens} new tokens, greedy, float32")
    impls = [("reference", "CuPy reference", "peer", gpt2.reference_attend)]
    impls += [(p.stem, p.stem, "rung", attend_with(gpt2, p)) for p in args.kernels]

    def generate(attend, kv, n, on_token):
        return gpt2.generate(ckpt.params, ckpt.config, prompt, n, attend=attend, kv_cache=kv, on_token=on_token)

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:  # the weights as HF reads them
        folder = Path(scratch) / "gpt2"

        def hf(kv):
            if not folder.exists():
                gpt2.save(ckpt, folder)
            return time_hf_generation(folder, prompt, args.tokens, kv, args.warmup, args.hf_attn)

        rows = generation_rows(modes, impls, generate, None if args.no_hf else hf, args)
    add_generation_comparisons(rows)
    decode = measure_decode(gpt2, ckpt, prompt, args, rows) if True in modes and not args.no_decode else None
    result = {
        "schema": SCHEMA, "kind": "e2e", "setup": setup,
        "model": ckpt.name, "prompt": text, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
        "sampling": "greedy", "dtype": "float32", "modes": ["kv-cache" if kv else "no-cache" for kv in modes],
        "method": {
            "clock": "time.perf_counter around gpt2.generate (device synchronized before and after), after a "
                     f"{args.warmup}-token warm-up generation that compiles every rung and CuPy kernel",
            "no-cache": "every step runs the whole sequence so far through the model (gpt2's fast path: fused "
                        "kernels, the products on kernels/fused/gemm.cu's 3xTF32 wgmma on sm_90, else cuBLAS "
                        "SGEMM; past the last layer's attention only the last position): the attention under "
                        "test runs on every token, at every length",
            "kv-cache": "the prompt is prefilled through the attention under test; each later step is one query "
                        "over a static cache, gpt2.fast's decode step (the persistent kernel where the device runs "
                        "it, else CUDA graphs of its fused kernels), the same for every rung",
            "hf": "transformers GPT2LMHeadModel.from_pretrained on the same weights (gpt2.save), fp32, "
                  "generate(do_sample=False, min_new_tokens=max_new_tokens), use_cache per mode",
        },
        "rows": rows,
        "decode": decode,
    }
    return publish(result, setup, args.results)


def publish(result: dict, setup: dict, results: str | None) -> int:
    """Write an e2e result (GPT-2's or a Llama size's) and its plot, print its table."""
    path = result_path("e2e", setup, results)
    result["plot"] = plots.plot_or_none(plots.plot_e2e, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_e2e([(path, result, set(result["modes"]))], ROOT))
    progress(wrote(path, result["plot"]))
    return 0
