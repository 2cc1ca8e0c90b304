"""`bench.py e2e --sizes LIST`: decode at scale. Every model size named (GPT-2's four, Llama's three),
from random weights of the real shapes loaded as lab.py loads them (in the run's dtype, one copy, laid out
once for the fast engine: GPT-2's Conv1D weights column-major, Llama's q/k/v and gate/up stacked), one
KV-cache generation per size and dtype on the fast engine (gpt2/fast, llama/fast) with the newest rung
that takes the model for the prefill, as lab.py picks it:

- decode tokens/s after the first token, and the weight bytes one step reads over the time per token
  against the device-to-device copy ceiling measured in the same run (the bandwidth floor: the tokens/s
  at which the weights would stream at the ceiling), held to the issue's targets;
- peak GPU memory (the CuPy pool's high-water mark from the weights in place) against 1.15 x (weights
  + KV cache) + 256 MiB, beside cudaMemGetInfo's count;
- time to first token of a --prefill-tokens prompt (1,000 by default), and the rate of the prefill's
  matrix products over that whole time against the bf16 GEMM ceiling measured in the same run;
- HF transformers beside each size (bfloat16, static cache; its own random weights of the same config:
  decode speed does not depend on the values): its decode tokens/s, and its first token after the same
  prompt timed as the lab's.

gpt2/ and llama/ are imported only when the subcommand runs."""

from __future__ import annotations

import re
import time

import numpy as np

from . import device, plots, timing
from .device import CannotRun, first_line, progress
from .results import SCHEMA, result_path, write_result, wrote

SIZES = {"gpt2": "GPT-2 small", "gpt2-medium": "GPT-2 medium", "gpt2-large": "GPT-2 large", "gpt2-xl": "GPT-2 XL",
         "llama-3.2-1b": "Llama 3.2 1B", "llama-3.2-3b": "Llama 3.2 3B", "llama-3.1-8b": "Llama 3.1 8B"}
FAMILY_DTYPES = {"gpt2": ("bfloat16", "float32"), "llama": ("bfloat16",)}  # without --dtypes
PREFILL_TOKENS = 1000
COPY_TARGETS = {"bfloat16": 80.0, "float32": 70.0}  # decode: % of the copy ceiling (weight bytes per second)
RATE_TARGETS = {("gpt2", "bfloat16"): 10_000.0, ("gpt2", "float32"): 6_000.0}  # tokens/s, by (size, dtype)
PREFILL_TARGET = 50.0  # the prefill's products: % of the bf16 GEMM ceiling (gpt2-xl and Llama shapes)
PREFILL_TARGET_SIZES = ("gpt2-xl", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")


def of_size(size: str):
    """The lm.family.Family that runs `size` (lab.FAMILIES), gpt2/ and llama/ imported now."""
    import lab
    from lm.family import of_size as by_size

    return by_size(lab.FAMILIES, size)


def family(size: str) -> str:
    return of_size(size).name


def prefill_ids(size: str, config, n: int) -> list[int]:
    """n token ids from a fixed generator (after the family's bos_ids, Llama's <|begin_of_text|>): any
    ids do on random weights."""
    ids = np.random.default_rng(25).integers(0, min(config.vocab_size, 50000), n).tolist()
    bos = list(of_size(size).bos_ids)
    return [*bos, *ids[len(bos):]]


def lab_model(size: str, dtype: str, seed: int, kernel: str | None = None) -> tuple:
    """(family, checkpoint, rung, attend): a size as the tools that profile its prefill load it, as `measure`
    does: random weights in the run's dtype, laid out for the fast engine; the newest rung that takes the
    model (or `kernel`) and lab.make_attend's attention of it."""
    import kernels
    import lab

    cupy = device.get_cupy()
    fam = of_size(size)
    ckpt = fam.random_weights(size, seed=seed, xp=cupy, dtype=dtype)
    fam.decode_layout(ckpt.params, ckpt.config)
    name = lab.fit_kernel(kernel or lab.REFERENCE, kernel, ckpt.config, dtype, "gpu", kernels.device_limits().arch)
    return fam, ckpt, name, lab.make_attend(name, dtype)


_LAYER = re.compile(r"(^|\.)(h|layers)\.\d+\.")  # h.0., model.layers.0., and HF's transformer.h.0.


def layer_matrices(shapes) -> int:
    """Elements of the layers' matrices among (name, shape) pairs, named as the lab's params or HF's
    parameters: the prefill's FLOP convention counts 2 x these per prompt token (the embeddings and the
    head left out)."""
    return sum(int(np.prod(shape)) for name, shape in shapes if len(shape) == 2 and _LAYER.search(name))


def prefill_rate(row: dict, matrices: int, seconds: list[float], bf16_tflops: float | None) -> dict:
    """A row's first-token figures from the timed generations' seconds: their median, and the rate of
    the layers' products over that whole time against the bf16 GEMM ceiling (None where not measured)."""
    median = float(np.median(seconds))
    tflops = 2 * matrices * row["prefill_tokens"] / median / 1e12
    return {"ttft_ms": 1e3 * median, "prefill_tflops": tflops,
            "pct_bf16_gemm": 100 * tflops / bf16_tflops if bf16_tflops else None}


def measure(size: str, dtype: str, args, copy_bps: float, bf16_tflops: float | None) -> dict:
    """One size in one dtype, as lab.py --random-weights --kv-cache runs it (see the module's docstring)."""
    import kernels
    import lab
    from lm import prefill_graph
    from lm.arrays import held_bytes
    from lm.kv_cache import kv_cache_bytes
    from lm.summary import memory_figures

    cupy = device.get_cupy()
    pool = cupy.get_default_memory_pool()
    fam = of_size(size)
    device.release_memory()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    ckpt = fam.random_weights(size, seed=args.seed, xp=cupy, dtype=dtype)
    config, params = ckpt.config, ckpt.params
    fam.decode_layout(params, config)
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()  # the draws' float32 transients: the peak counts from the weights in place
    kernel = lab.fit_kernel(lab.REFERENCE, None, config, dtype, "gpu", kernels.device_limits().arch)
    attend = lab.make_attend(kernel, dtype)
    prompt, long_prompt = list(fam.prompt_ids), prefill_ids(size, config, args.prefill_tokens)

    positions = max(len(prompt) + args.tokens, len(long_prompt) + 1)  # every run below on one engine (Llama's)

    def generate(ids, n, on_token=None):
        return fam.generate(params, config, ids, n, attend=attend, kv_cache=True, sampler=None, max_len=positions,
                            on_token=on_token)

    def sync():
        cupy.cuda.Device().synchronize()

    def first_token(ids) -> float:
        sync()
        start = time.perf_counter()
        generate(ids, 1)
        sync()
        return time.perf_counter() - start

    generate(prompt, args.warmup)  # compiles every kernel, warms up
    # and at the long prompt's length (a rung validated, the prefill's workspace); with the prefill graphs,
    # its bucket's first pass (eager) and second (captured), so that the timed ones replay the graph
    graphs = prefill_graph.PREFILL_GRAPHS
    once = [first_token(long_prompt) for _ in range(2 if graphs else 1)]
    stamps = []
    generate(prompt, args.tokens, lambda token: stamps.append(time.perf_counter()))
    sync()
    ttft = [first_token(long_prompt) for _ in range(3)]
    peak, used = pool.total_bytes(), free_before - cupy.cuda.runtime.memGetInfo()[0]
    why = fam.fast_reason(params, config, kv_cache=True, sampler=None)
    if why is None:
        engine = fam.engine(params, config, positions)
        kv, added = engine.k_cache.nbytes + engine.v_cache.nbytes, engine.added_bytes()
        step = "persistent step" if engine.persistent else f"CUDA graphs (persistent step {engine.persistent_note})"
        path = f"fast: {step}"
    else:
        positions = max(len(prompt) + args.tokens - 1, len(long_prompt))
        kv, added, path = kv_cache_bytes(config, positions, dtype), None, "eager"
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    bpt = fam.weight_bytes_per_token(config, dtype)
    row = {"size": size, "model": SIZES[size], "family": fam.name, "dtype": dtype, "kind": "lab", "status": "ok",
           "engine": path, "attention": kernel, "n_params": ckpt.n_params, "new_tokens": len(stamps),
           "decode_tokens_per_s": rate, "us_per_token": 1e6 / rate, "weight_bytes_per_token": bpt,
           "weight_tbps": bpt * rate / 1e12, "pct_copy": 100 * bpt * rate / copy_bps,
           "floor_tokens_per_s": copy_bps / bpt, "prefill_tokens": len(long_prompt), "peak_bytes": peak,
           "prefill_graphs": graphs, "prefill_first_ms": [1e3 * t for t in once],
           **memory_figures(peak, used, held_bytes(params.values()), kv, added)}
    row |= prefill_rate(row, layer_matrices((name, a.shape) for name, a in params.items()), ttft, bf16_tflops)
    return row | targets(row)


def release() -> None:
    """The last size's weights back to the device: the fast engines that view them, then the pools."""
    import sys

    for fast in ("gpt2.fast", "llama.fast"):
        if fast in sys.modules:
            sys.modules[fast].clear_cache()
    device.release_memory()


def targets(row: dict) -> dict:
    """The issue's targets for this row: None where none applies."""
    rate = RATE_TARGETS.get((row["size"], row["dtype"]))
    prefill = row["size"] in PREFILL_TARGET_SIZES and row.get("pct_bf16_gemm") is not None
    return {"copy_target_pct": COPY_TARGETS.get(row["dtype"]),
            "copy_target_met": row["pct_copy"] >= COPY_TARGETS[row["dtype"]] if row["dtype"] in COPY_TARGETS else None,
            "rate_target": rate, "rate_target_met": row["decode_tokens_per_s"] >= rate if rate else None,
            "prefill_target_met": row["pct_bf16_gemm"] >= PREFILL_TARGET if prefill else None}


def measure_hf(size: str, args, copy_bps: float, bf16_tflops: float | None) -> dict:
    """HF transformers on the same config in bfloat16 with a static cache (its own random weights): decode
    tokens/s after the first token as e2e's HF peer measures them, then the first token after the lab's
    long prompt, timed as measure times the lab's."""
    from .e2e import hf_transformers, time_hf_first_token, time_hf_model

    torch, transformers = hf_transformers()
    fam = of_size(size)
    config = fam.sizes[size]
    model_class, config_class = fam.hf_classes
    cls, hf_config = getattr(transformers, model_class), getattr(transformers, config_class)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bfloat16, on the device: no float32 copy anywhere
    try:
        with torch.device("cuda"):
            settings = {k: v for k, v in fam.config_json(config).items() if k != "model_type"}  # the class's own
            hf = cls(hf_config(**settings, attn_implementation=args.hf_attn)).eval()
    finally:
        torch.set_default_dtype(saved)
    out = time_hf_model(hf, list(fam.prompt_ids), args.tokens, True, args.warmup)
    long_prompt = prefill_ids(size, config, args.prefill_tokens)
    ttft = time_hf_first_token(hf, long_prompt)
    peak = max(out["peak_bytes"], torch.cuda.max_memory_reserved())  # to the end of the size's runs, as the lab's
    t = out["elapsed"]
    rate = (len(t) - 1) / (t[-1] - t[0])
    bpt = fam.weight_bytes_per_token(config, "bfloat16")
    row = {"size": size, "model": SIZES[size], "family": fam.name, "dtype": "bfloat16", "kind": "hf",
           "status": "ok", "engine": f"HF transformers {transformers.__version__} ({args.hf_attn}, static cache)",
           "decode_tokens_per_s": rate, "us_per_token": 1e6 / rate, "weight_bytes_per_token": bpt,
           "weight_tbps": bpt * rate / 1e12, "pct_copy": 100 * bpt * rate / copy_bps,
           "floor_tokens_per_s": copy_bps / bpt, "prefill_tokens": len(long_prompt), "peak_bytes": peak}
    matrices = layer_matrices((name, tuple(p.shape)) for name, p in hf.named_parameters())
    return row | prefill_rate(row, matrices, ttft, bf16_tflops)


def cmd_scale(args) -> int:
    device.require_gpu()
    try:
        for size in args.sizes:
            of_size(size)  # now, not after the first sizes' minutes
    except ImportError as exc:
        raise CannotRun(f"needs the packages gpt2/ and llama/ ({first_line(exc)})") from None
    setup = device.setup_info(args.argv) | {"model": "sizes"}
    method = timing.Method()
    copy = timing.measure_copy(method)
    tensor = timing.measure_tensor_ceilings(method)
    copy_bps = copy["copy_tbps"] * 1e12
    progress(f"{setup['device']['name']}: copy ceiling {copy['copy_tbps']:.2f} TB/s, bf16 GEMM "
             f"{tensor['bf16_tflops'] or 0:.0f} TFLOP/s; sizes {', '.join(args.sizes)}")
    rows = []
    for size in args.sizes:
        for dtype in args.dtypes or FAMILY_DTYPES[family(size)]:
            row = {"size": size, "model": SIZES[size], "family": family(size), "dtype": dtype, "kind": "lab"}
            try:
                row = measure(size, dtype, args, copy_bps, tensor["bf16_tflops"])
            except Exception as exc:  # out of memory, a LabError (too many tokens), a kernel that fails
                row |= {"status": "error", "reason": first_line(exc)}
            release()
            rows.append(row)
            progress(progress_line(row))
        if not args.no_hf:
            row = {"size": size, "model": SIZES[size], "family": family(size), "dtype": "bfloat16", "kind": "hf"}
            try:
                row = measure_hf(size, args, copy_bps, tensor["bf16_tflops"])
            except Exception as exc:  # Unavailable (no torch or transformers), out of memory
                row |= {"status": "unavailable", "reason": first_line(exc)}
            release()
            rows.append(row)
            progress(progress_line(row))
    result = {"schema": SCHEMA, "kind": "scale", "setup": setup, "sizes": args.sizes, "new_tokens": args.tokens,
              "prefill_tokens": args.prefill_tokens, "warmup_tokens": args.warmup, "seed": args.seed,
              "ceilings": {"copy_tbps": copy["copy_tbps"], "copy_what": copy["copy_what"],
                           "bf16_tflops": tensor["bf16_tflops"], "bf16_what": tensor["bf16_what"]},
              "targets": {"copy_pct": COPY_TARGETS, "tokens_per_s": {f"{s} {d}": v for (s, d), v in RATE_TARGETS.items()},
                          "prefill_pct_bf16_gemm": PREFILL_TARGET, "prefill_sizes": list(PREFILL_TARGET_SIZES),
                          "memory": "peak <= 1.15 x (weights + KV cache) + 256 MiB"},
              "method": METHOD, "rows": rows}
    path = result_path("scale", setup, args.results)
    result["plot"] = plots.plot_or_none(plots.plot_scale, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_scale(result, result["plot"]))
    progress(wrote(path, result["plot"]))
    return 0


METHOD = {
    "weights": "random weights of the real shapes, drawn in the run's dtype as lab.py --random-weights loads them "
               "(laid out once: GPT-2's Conv1D weights by gpt2.fast.decode_layout, Llama's q/k/v and gate/up "
               "stacked by llama.fast.decode_layout)",
    "decode": "the prompt's ids, then --tokens greedy tokens over the KV cache (gpt2.generate and llama.generate: "
              "the fast engine, a static cache; Llama's sized to the longest run here), after a --warmup-token "
              "generation; tokens/s from the first token's arrival on the host to the last's",
    "bandwidth": "weight bytes one decode step reads (every matrix once, the head whole) x tokens/s, against a "
                 "device-to-device copy (bytes read + written) measured in the same run; the floor is the tokens/s "
                 "at which the weights would stream at that ceiling",
    "prefill": "median of 3 generations of one token after a --prefill-tokens prompt (compiled before; with "
               "lm.prefill_graph.PREFILL_GRAPHS (the default), 'graphed', the prompt's bucket passed eagerly and "
               "then captured before them, "
               "so that they replay its CUDA graph: those passes' ms are the row's prefill_first_ms); the "
               "products' rate is 2 x the layers' matrix weights x the prompt's tokens over that whole time (a "
               "lower bound on the products' own rate), against torch.matmul bf16 8192^3 measured in the same run",
    "memory": "the CuPy pool's high-water mark (total_bytes; the pool keeps every block it has handed out) from "
              "the weights in place to the end of the size's runs, against 1.15 x (weights + KV cache) + 256 MiB: "
              "the fast engine's static cache (GPT-2: n_positions; Llama: the longest run's positions rounded up "
              "to 256), or the eager path's longest; cudaMemGetInfo's count beside it",
    "hf": "transformers' model of the same config, initialised on the device in bfloat16 (its own random "
          "weights), generate(do_sample=False, cache_implementation='static') after a warm-up of all --tokens "
          "tokens; its first token after the same --prefill-tokens prompt as the prefill's (a warm-up at that "
          "length, then the median of 3 generations of one token, from the ids on the host to the token on "
          "the host), the products' rate by the same convention from its own layers' matrices; peak: "
          "torch.cuda.max_memory_reserved() from the timed decode to the end of the first-token runs",
}


def progress_line(row: dict) -> str:
    where = f"{row['model']:<13} {row['dtype']:<8} {'HF' if row['kind'] == 'hf' else 'lab':<3}"
    if row["status"] != "ok":
        return f"{where} {row['status']}: {row['reason']}"
    line = (f"{where} {row['decode_tokens_per_s']:9.1f} tokens/s ({row['pct_copy']:4.0f}% of copy), peak "
            f"{row['peak_bytes'] / 2**30:6.2f} GiB")
    if row["kind"] == "lab":
        line += f" (bound {row['memory_bound_bytes'] / 2**30:.2f})"
    return line + f", first token {row['ttft_ms']:.1f} ms"


# -- rendering ----------------------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _met(value) -> str:
    return "-" if value is None else ("met" if value else "missed")


def _first_token(r: dict, lab_ms: float | None) -> str:
    """The first token's ms, and on an HF row the lab's (same size, bfloat16) over HF's; "-" on the HF
    rows of runs before HF's first token was timed."""
    if r.get("ttft_ms") is None:
        return "-"
    ratio = f" (lab / HF {lab_ms / r['ttft_ms']:.2f})" if r["kind"] == "hf" and lab_ms else ""
    return f"{r['ttft_ms']:,.1f}{' graphed' if r.get('prefill_graphs') else ''}{ratio}"


def _prefill(r: dict) -> str:
    if r.get("prefill_tflops") is None:
        return "-"
    pct = f" ({r['pct_bf16_gemm']:.0f}%)" if r.get("pct_bf16_gemm") is not None else ""
    met = f": {_met(r['prefill_target_met'])}" if r.get("prefill_target_met") is not None else ""
    return f"{r['prefill_tflops']:.0f}{pct}{met}"


def render_scale(result: dict, image: str | None = None) -> str:
    """Two tables (decode; memory and prefill), one row per size and dtype, the HF peer beside each size."""
    from .tables import setup_header, table

    c, t = result["ceilings"], result["targets"]
    bf16 = f"{c['bf16_tflops']:.0f} TFLOP/s" if c.get("bf16_tflops") else f"not measured ({c.get('bf16_what')})"
    lines = setup_header(result) + [
        "",
        f"Decode at scale: {result['new_tokens']} new tokens after a short prompt, greedy, KV cache; first token "
        f"after a {result['prefill_tokens']:,}-token prompt. Ceilings measured in the same run: copy "
        f"{c['copy_tbps']:.2f} TB/s ({c['copy_what']}), bf16 GEMM {bf16}. Targets: decode at least "
        + ", ".join(f"{p:.0f}% of the copy ceiling in {d}" for d, p in t["copy_pct"].items())
        + "; GPT-2 small " + ", ".join(f"{v:,.0f} tokens/s in {k.split()[1]}" for k, v in t["tokens_per_s"].items())
        + f"; {t['memory']}; the prefill's products at least {t['prefill_pct_bf16_gemm']:.0f}% of the bf16 GEMM "
        f"ceiling ({', '.join(t['prefill_sizes'])}). "
        + " ".join(f"{'HF' if k == 'hf' else k.capitalize()}: {v}." for k, v in result["method"].items()),
    ]
    if image:
        lines += ["", f"![decode tokens/s per model against its bandwidth floor]({image})"]
    decode, memory = [], []
    lab_ms = {r["size"]: r["ttft_ms"] for r in result["rows"]
              if r["kind"] == "lab" and r["status"] == "ok" and r["dtype"] == "bfloat16"}  # HF's dtype
    for r in result["rows"]:
        who = r["engine"] if r["status"] == "ok" else ("HF transformers" if r["kind"] == "hf" else "lab")
        if r["status"] != "ok":
            decode.append([r["model"], r["dtype"], who, f"**{r['status']}**", "-", "-", "-", "-", "-", r.get("reason", "")])
            continue
        target = r.get("copy_target_pct")
        met = ("-" if r["kind"] == "hf" else f"{target:.0f}%: {_met(r['copy_target_met'])}"
               + (f"; {r['rate_target']:,.0f}/s: {_met(r['rate_target_met'])}" if r.get("rate_target") else ""))
        decode.append([r["model"], r["dtype"], who, f"{r['decode_tokens_per_s']:,.1f}", f"{r['us_per_token']:,.0f}",
                       _gb(r["weight_bytes_per_token"]), f"{r['weight_tbps']:.2f} ({r['pct_copy']:.0f}%)",
                       f"{r['floor_tokens_per_s']:,.0f}", met, r.get("attention", "")])
        first = [_first_token(r, lab_ms.get(r["size"])), _prefill(r)]
        if r["kind"] == "lab":
            memory.append([r["model"], r["dtype"], _gb(r["weight_bytes"]), _gb(r["kv_cache_bytes"]),
                           _gb(r["peak_bytes"]), f"{r['peak_bytes'] / (r['weight_bytes'] + r['kv_cache_bytes']):.2f}x",
                           _gb(r["memory_bound_bytes"]), "within" if r["within_memory_bound"] else "**over**",
                           _gb(r["gpu_memory_used_bytes"]), *first])
        else:
            memory.append([r["model"], r["dtype"] + " (HF)", "-", "-", _gb(r["peak_bytes"]), "-", "-", "-", "-", *first])
    lines += ["", "**Decode**", ""] + table(
        ["model", "dtype", "engine", "decode tokens/s", "us/token", "weights GB/token", "weights TB/s (% of copy)",
         "floor tokens/s", "target", "attention"], decode, "lllrrrrrll")
    lines += ["", f"**Memory and the first token** (GB; first token after {result['prefill_tokens']:,} tokens)", ""] + table(
        ["model", "dtype", "weights", "KV cache", "peak", "peak / (weights + KV)", "bound", "memory",
         "device in use", "first token ms", "prefill TFLOP/s (% of bf16 GEMM)"], memory, "llrrrrrlrrl")
    return "\n".join(lines)
