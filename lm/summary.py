"""The run summary lab.py prints and writes as JSON, whatever the model: the phases' times, the
check against the reference attention, and the table of rows (with the fast path's step profile
when one was taken)."""

from __future__ import annotations

from .generate import reference_attend

WARMUP_TOKENS = 2  # one full step and, with the KV cache, one decode step: every kernel compiled
# The memory a run may hold: MEMORY_FACTOR x (weights in the run's dtype + what the run holds beside them)
# + MEMORY_HEADROOM; beside them, its KV cache, or without a cache one forward's activations at its longest
MEMORY_FACTOR, MEMORY_HEADROOM = 1.15, 256 * 2**20
PEAK_MEASURE = ("CuPy memory pool high-water mark (total_bytes: the pool never returns a block unasked), from the "
                "weights in place (the load's transient float32 draws returned first) to the end of the timed run")
USED_MEASURE = ("device memory in use at the end, cudaMemGetInfo against before the weights: the pool, plus "
                "cuBLAS's workspace, loaded modules and captured graphs")


def memory_figures(peak: int, used: int, weight_bytes: int, kv_bytes: int, engine_bytes: int | None = None,
                   activation_bytes: int | None = None, activation_basis: str | None = None) -> dict:
    """The run's memory against its bound: peak (the pool's high-water mark) and used (cudaMemGetInfo's
    delta) beside the weights and the KV cache it holds, and what the fast engine holds beside the weights.
    With activation_bytes (the mode without a cache: what one forward at the longest length holds, as
    activation_basis says), the bound is on the weights and those instead of the KV cache."""
    held = kv_bytes if activation_bytes is None else activation_bytes
    bound = MEMORY_FACTOR * (weight_bytes + held) + MEMORY_HEADROOM
    return {"weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes, "memory_bound_bytes": int(bound),
            "within_memory_bound": peak <= bound, "gpu_memory_used_bytes": used,
            "gpu_memory_used_measure": USED_MEASURE, "engine_added_bytes": engine_bytes,
            "activation_bytes": activation_bytes,
            "memory_bound_basis": "weights + KV cache" if activation_bytes is None else f"weights + {activation_basis}"}


def memory_rows(s: dict) -> list[tuple[str, str]]:
    """The summary's memory rows: the peak against weights + KV cache and the bound; the device's view."""
    if s["peak_gpu_memory_bytes"] is None:
        return [("peak GPU memory", "n/a (cpu)")]
    mib = 2**20
    peak, w, kv, act = s["peak_gpu_memory_bytes"], s["weight_bytes"], s["kv_cache_bytes"], s.get("activation_bytes")
    held, what = (kv, "KV cache") if act is None else (act, "activations")
    verdict = "within" if s["within_memory_bound"] else "OVER"
    rows = [("peak GPU memory", f"{peak / mib:.1f} MiB = {peak / (w + held):.2f} x (weights {w / mib:.1f} + {what} "
                                f"{held / mib:.1f} MiB); bound {MEMORY_FACTOR} x that + {MEMORY_HEADROOM // mib} MiB = "
                                f"{s['memory_bound_bytes'] / mib:.1f} MiB: {verdict} (CuPy pool high-water mark, from "
                                "the weights in place)"),
            *([("bound", f"{s['memory_bound_basis']} (no KV cache: each step a forward over the whole sequence)")]
              if act is not None else []),
            ("device memory", f"{s['gpu_memory_used_bytes'] / mib:.1f} MiB in use at the end (cudaMemGetInfo, against "
                              "before the weights: the pool, cuBLAS's workspace, modules, graphs)")]
    if s.get("engine_added_bytes") is not None:
        rows.append(("fast engine", f"{s['engine_added_bytes'] / mib:.1f} MiB beside the weights (KV cache, "
                                    "activations, the decode step's buffers, folds and copies)"))
    return rows


def phase_times(stamps: list[float], start: float, n_new: int) -> dict:
    """Time to first token (the prefill: host clock when the first token arrived) and the rate of the
    tokens after it (from the first token's arrival to the last's)."""
    first = stamps[0] - start if stamps else None
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"time_to_first_token_seconds": first,
            "decode_tokens_per_second": (len(stamps) - 1) / span if span > 0 else None}


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


def attention_line(s: dict) -> str:
    """The rung, and why it is no default yet where it declares lab.unverified (it ran because it was named)."""
    why = s.get("kernel_unverified")
    return f"{s['kernel']} ({why}: lab.unverified)" if why else s["kernel"]


def print_summary(s: dict) -> None:
    if s["mode"] == "kv-cache":
        mode = f"KV cache: prefill with {s['kernel']}, decode attention: {s['decode_attention']}"
    else:
        mode = f"no KV cache: every step recomputes the whole sequence with {s['kernel']}"
    rows = [
        ("model", f"{s['model']}, {s['n_params'] / 1e6:.1f}M parameters"),
        ("attention", attention_line(s)),
        ("mode", mode),
        ("prompt tokens", s["n_prompt_tokens"]),
        *([("tokenizer", s["tokenizer_note"])] if s.get("tokenizer_note") else []),
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
        *memory_rows(s),
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
        return f"eager: {s.get('family', 'gpt2')}/model.py step by step ({s['engine_note']})"
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
    if p.get("graph_ms_per_token_without"):
        print("each kind's cost inside the graph (the replay per token, less the replay without that kind's launches):")
        for kind, ms in p["graph_ms_per_token_without"].items():
            print(f"  {kind:<28}{1e3 * (p['graph_ms_per_token'] - ms):8.1f} us")
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
