"""`bench.py e2e`: seconds for a model (GPT-2 small, or a Llama size: random weights in the family's
default dtype) to generate tokens greedily with each rung that takes it as its attention, without and with
a KV cache, beside HF transformers on the same weights; and, for GPT-2 small, the fast engine's decode
tokens/s (gpt2.fast, float32 and bfloat16, each decode step) against the lab's targets. The model's
family (lm.family.Family, lab.FAMILIES) supplies the weights, the prompt and generate(); gpt2/ and llama/
are imported only here, when the subcommand runs."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import kernels
from lm.generate import decode_attention_name, reference_attend
from lm.measure import copy_ceiling

from . import device, plots
from .device import ROOT, CannotRun, Unavailable, first_line, progress
from .results import SCHEMA, result_path, write_result, wrote
from .tables import render_e2e

PROMPT = "Hello, I'm a language model,"  # the text prompt of a family with a tokenizer


def family_of(size: str):
    """The lm.family.Family whose sizes name `size` (lab.FAMILIES), gpt2/ and llama/ imported now."""
    try:
        import lab
        from lm.family import of_size
    except ImportError as exc:
        raise CannotRun(f"needs the model packages gpt2/ and llama/ ({type(exc).__name__}: {exc})") from None
    return of_size(lab.FAMILIES, size)


def refusal(path: Path, config, dtype: str, able: list[str]) -> str | None:
    """Why the rung at path cannot be this model's attention (naming those that can), or None."""
    rung = kernels.load(path)
    lacks = [what for what, ok in (
        (f"head size {config.head_size}", config.head_size in rung.head_sizes()),
        (f"grouped-query attention ({config.kv_heads} key/value heads for {config.n_head} query heads)",
         config.kv_heads == config.n_head or "gqa" in rung.supports),
        (dtype, dtype in rung.dtypes)) if not ok]
    if not lacks:
        return None
    return f"does not take {' or '.join(lacks)}; {', '.join(able) or 'no rung'} take{'s' * (len(able) == 1)} it"


def attentions(config, dtype: str, named: list[Path] | None) -> list[tuple]:
    """(name, label, kind, attend) per attention to time: the CuPy reference, then the rungs named, or
    every rung that takes the model (head size, grouped-query attention, dtype) on this device; a named
    rung that does not take it has the reason for its attend."""
    able = kernels.rungs_for(dtype, config.head_size, config.kv_heads != config.n_head, kernels.device_limits().arch)
    if not able and not named:
        raise CannotRun(f"no rung takes the model (head size {config.head_size}, "
                        f"{config.kv_heads} key/value heads for {config.n_head} query heads, {dtype}) on this device")
    paths = [kernels.resolve(n) for n in able] if named is None else named
    return [("reference", "CuPy reference", "peer", reference_attend)] + [
        (p.stem, p.stem, "rung", refusal(p, config, dtype, able) or kernels.Attend(p)) for p in paths]


def prompt_of(family, text: str | None) -> tuple[str | list[int], list[int]]:
    """(the prompt as the result records it, its ids): text through the family's tokenizer (PROMPT by
    default), or, for random weights without one, the family's fixed ids."""
    try:
        encoding = family.load_tokenizer(None)
    except Exception as exc:  # LabError: no tiktoken files and no network
        raise CannotRun(first_line(exc)) from None
    if encoding is None:
        if text is not None:
            raise CannotRun(f"--prompt is text for a tokenizer; random {family.name} weights have none (the prompt "
                            "is fixed token ids)")
        return list(family.prompt_ids), list(family.prompt_ids)
    text = PROMPT if text is None else text
    return text, family.encode(encoding, text, chat=False)


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
                       attn_implementation: str, model_class: str, dtype: str) -> dict:
    """HF transformers' model_class on the same weights (saved by the family's save) in dtype, greedy
    (time_hf_model)."""
    torch, transformers = hf_transformers()
    # dtype at load (not .to(dtype) after it), so that buffers such as Llama's RoPE frequencies stay float32
    model = getattr(transformers, model_class).from_pretrained(str(folder), attn_implementation=attn_implementation,
                                                               dtype=getattr(torch, dtype))
    model = model.to("cuda").eval()
    try:
        out = time_hf_model(model, prompt, n_new, kv_cache, warmup)
    finally:
        del model
        device.release_memory()
    return out | {"attn_implementation": attn_implementation, "transformers": transformers.__version__}


def time_hf_model(model, prompt: list[int], n_new: int, kv_cache: bool, warmup: int) -> dict:
    """An HF model on the device generating n_new tokens greedily after prompt: seconds, a host stamp per
    token, the tokens and torch's peak reserved memory. The KV-cache mode's cache is generate's static
    one, as the lab's engines hold a static cache, and its warm-up generates all n_new tokens so that the
    cache (and anything compiled for it) has the timed run's shape."""
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
    options = hf_greedy(torch, model, ids, kv_cache)
    if kv_cache:
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


def time_hf_first_token(model, prompt: list[int], runs: int = 3) -> list[float]:
    """Seconds for an HF model on the device to choose its first token after prompt, greedily with its
    static cache, as the lab's first token is timed: a warm-up generation at the prompt's length (the
    cache and anything compiled for it get the timed runs' shape), then `runs` generations of one token,
    each synchronized before and after, from the prompt's ids on the host to the token on the host."""
    torch = device.get_torch()

    def first_token() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, max_new_tokens=1, min_new_tokens=1, **hf_greedy(torch, model, ids, True))
        out[0, -1].item()  # on the host, as the lab's generate hands its token back
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        first_token()  # the warm-up
        return [first_token() for _ in range(runs)]


def hf_greedy(torch, model, ids, kv_cache: bool) -> dict:
    """generate()'s options for greedy tokens after ids (one prompt, all of it attended): with kv_cache,
    the static cache, as the lab's engines hold a static cache."""
    eos = model.config.eos_token_id
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, use_cache=kv_cache,
                   pad_token_id=eos[0] if isinstance(eos, list) else eos)
    if kv_cache:
        options["cache_implementation"] = "static"
    return options


DECODE_TARGETS = {"float32": 4000.0, "bfloat16": 7000.0}  # decode tokens/s with the KV cache, GPT-2 small
DECODE_TABLES = ("gpt2",)  # the sizes with a decode table: gpt2.fast's decode steps against its targets
DECODE_STEPS = {"persistent": "one persistent kernel per window (kernels/fused/decode_step.cu)",
                "graphs": "CUDA graphs of the per-operation kernels (5 per layer + 2)"}


def time_decode(ckpt, prompt: list[int], n_new: int, dtype: str, step: str, warmup: int) -> dict:
    """The fast engine's KV-cache generation in dtype with one decode step (DECODE_STEPS): time to the
    first token (the prefill, through the CuPy reference attention) and decode tokens/s from the
    first token's arrival on the host to the last's."""
    import gpt2.fast as fast
    cupy = device.get_cupy()
    params = ckpt.params if dtype == "float32" else fast.as_bfloat16(ckpt.params)
    engine = fast.Engine(params, ckpt.config, dtype=dtype, persistent=step == "persistent")
    try:
        engine.generate(prompt, warmup, attend=reference_attend, kv_cache=True)  # compile, warm up
        cupy.cuda.Device().synchronize()
        stamps = []
        start = time.perf_counter()
        out = engine.generate(prompt, n_new, attend=reference_attend, kv_cache=True,
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


def measure_decode(ckpt, prompt: list[int], args, rows: list[dict]) -> dict:
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
                row |= time_decode(ckpt, prompt, args.tokens, dtype, step, args.warmup)
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
    family = family_of(args.model)
    device.require_gpu()
    shown, prompt = prompt_of(family, args.prompt)
    cupy = device.get_cupy()
    dtype = family.default_dtype
    setup = device.setup_info(args.argv) | {"model": args.model}
    modes = [False, True] if args.mode == "both" else [args.mode == "kv-cache"]
    ckpt = family.random_weights(args.model, seed=args.seed, xp=cupy, dtype=dtype)
    config = ckpt.config
    family.decode_layout(ckpt.params, config)  # as lab.py lays them out: the fast engine holds views
    device.release_memory()  # the float32 draw, the layout's transients
    impls = attentions(config, dtype, args.kernels)
    decoder = (f"{family.name}.fast's decode step (fused kernels, a CUDA graph)"
               if family.fast_reason(ckpt.params, config, kv_cache=True, sampler=None) is None
               else decode_attention_name(cupy, config, dtype))
    progress(f"{setup['device']['name']}: {ckpt.name}, {dtype}, {len(prompt)} prompt tokens, {args.tokens} new "
             f"tokens, greedy; KV-cache decode steps with {decoder}")
    positions = len(prompt) + args.tokens  # the warm-up and the timed run on one engine

    def generate(attend, kv, n, on_token):
        return family.generate(ckpt.params, config, prompt, n, attend=attend, kv_cache=kv, sampler=None,
                               max_len=positions, on_token=on_token)

    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:  # the weights as HF reads them
        folder = Path(scratch) / args.model

        def hf(kv):
            if not folder.exists():
                family.save(ckpt, folder)  # float32 on disk: HF rounds to the dtype as the draw did
            return time_hf_generation(folder, prompt, args.tokens, kv, args.warmup, args.hf_attn,
                                      family.hf_classes[0], dtype)

        rows = generation_rows(modes, impls, generate, None if args.no_hf else hf, args)
    add_generation_comparisons(rows)
    tabled = args.model in DECODE_TABLES and True in modes and not args.no_decode
    result = {
        "schema": SCHEMA, "kind": "e2e", "setup": setup,
        "model": ckpt.name, "prompt": shown, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
        "sampling": "greedy", "dtype": dtype, "modes": ["kv-cache" if kv else "no-cache" for kv in modes],
        "method": method(family, dtype, decoder, shown, args),
        "rows": rows,
        "decode": measure_decode(ckpt, prompt, args, rows) if tabled else None,
    }
    return publish(result, setup, args.results)


def method(family, dtype: str, decoder: str, shown, args) -> dict:
    """How cmd_e2e measured, for the result file."""
    hf_class = family.hf_classes[0]
    return {
        "clock": f"time.perf_counter around {family.name}.generate (device synchronized before and after), after "
                 f"a {args.warmup}-token warm-up generation that compiles every rung and CuPy kernel",
        "prompt": ("the text through the family's tokenizer" if isinstance(shown, str) else
                   "the family's fixed ids (lm.family.Family.prompt_ids): random weights have no tokenizer"),
        "no-cache": f"every step runs the whole sequence so far through {family.name}/model.py (with its fast "
                    "path's fused kernels where it has them; past the last layer only the last position): the "
                    "attention under test runs on every token, at every length",
        "kv-cache": f"the prompt is prefilled through the attention under test; each later step is one query over "
                    f"a static cache with {decoder}, the same for every rung",
        "hf": f"transformers {hf_class}.from_pretrained on the same weights ({family.name}.save), dtype={dtype}, "
              "generate(do_sample=False, min_new_tokens=max_new_tokens); no cache: use_cache=False; KV cache: "
              "cache_implementation=\"static\", after a warm-up of all the tokens (the static cache's shape, and "
              "whatever generate compiles for it)",
    }


def publish(result: dict, setup: dict, results: str | None) -> int:
    """Write an e2e result (GPT-2's or a Llama size's) and its plot, print its table."""
    path = result_path("e2e", setup, results)
    result["plot"] = plots.plot_or_none(plots.plot_e2e, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_e2e([(path, result, set(result["modes"]))], ROOT))
    progress(wrote(path, result["plot"]))
    return 0
