"""`bench.py fp8 --envelope`: the FP8 rung's error against the score scale, where it is safe to use.

q and k are drawn so that the scaled scores scale * q.k have a chosen standard deviation, from 1 (plain
N(0, 1) inputs) to 50 (a peaked softmax), in two families:
  scaled   q, k ~ N(0, s^2): the scores' std is s^2 (scale = 1/sqrt(d))
  offset   q + c, k + c with q, k ~ N(0, 1): a shared offset c; the std is sqrt(1 + 2 c^2)
v ~ N(0, 1) always. At each point, the relative Frobenius error ||O - O_64|| / ||O_64|| against float64
attention of the same bfloat16 inputs, of:
  v25              the FP8 rung as kernels.attention runs it (block scales, Hadamard rotation)
  v25 no rotation  the same kernel, block scales without the rotation
  per tensor       the same kernel, one scale per tensor, no rotation
  each one's emulation: kernels.fp8.emulated_attention, the same arithmetic in float64 on the same e4m3
                   codes; a kernel error above its emulation's (ratio > 1 beyond rounding) is a bug
  v24 bfloat16     the bfloat16 baseline
"""

from __future__ import annotations

import math

import numpy as np

import kernels
from kernels import fp8

from .device import progress
from .tables import table

STDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 50.0)  # the scores' standard deviation at the sweep's points
FAMILIES = ("scaled", "offset")
SHAPE = (1, 8, 1024, 128)  # B, NH, T, d; causal
BF16_BASELINE = "v24"
VARIANTS = {  # name: quantize_fp8's switches
    "block+hadamard": {"hadamard": True, "per_tensor": False},
    "block": {"hadamard": False, "per_tensor": False},
    "per tensor": {"hadamard": False, "per_tensor": True},
}


def magnitudes(family: str, score_std: float) -> tuple[float, float]:
    """(s, c): q and k drawn from N(c, s^2) give scaled scores of std score_std (scale 1/sqrt(d)): scaled,
    s = sqrt(score_std), c = 0; offset, s = 1 and c with 1 + 2 c^2 = score_std^2."""
    if score_std < 1:
        raise ValueError(f"score_std must be at least 1 (N(0, 1) inputs), got {score_std}")
    if family == "scaled":
        return math.sqrt(score_std), 0.0
    if family == "offset":
        return 1.0, math.sqrt((score_std**2 - 1) / 2)
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


def envelope_inputs(xp, family: str, score_std: float, shape=SHAPE, seed: int = 0):
    """q, k, v (float32 on xp) of one point: q, k ~ N(c, s^2) (magnitudes), v ~ N(0, 1)."""
    s, c = magnitudes(family, score_std)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    return xp.asarray(q * s + c), xp.asarray(k * s + c), xp.asarray(v)


def score_std(q, k) -> float:
    """The standard deviation of scale * q k^T over every (query, key) pair, scale 1/sqrt(d)."""
    xp = kernels.reference.array_module(q)
    S = (q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
    return float(xp.std(S))


def relative_error(out, ref) -> float:
    """||out - ref||_F / ||ref||_F, in float64."""
    xp = kernels.reference.array_module(ref)
    out = out.astype(np.float64)
    return float(xp.linalg.norm((out - ref).ravel()) / xp.linalg.norm(ref.ravel()))


def point(cp, family: str, std: float, seed: int) -> dict:
    """Every variant's error, and its emulation's, at one point of the sweep."""
    q32, k32, v32 = envelope_inputs(cp, family, std, seed=seed)
    q, k, v = (x.astype("bfloat16") for x in (q32, k32, v32))  # what a user passes kernels.attention
    ref = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)))
    row = {"family": family, "score_std": std, "measured_std": score_std(q, k),
           "estimate": fp8.score_scale_estimate(fp8.quantize_fp8(q, k, v, block_q=128, block_k=128))}
    rung = kernels.runtime.fp8_rung()
    B, NH, T, d = q.shape
    config = kernels.instance(rung, d, None, dtype="bfloat16", grid=(B, NH, T)).config
    for name, switches in VARIANTS.items():
        inputs = kernels.quantize_for(rung, q, k, v, config=config, **switches)
        row[name] = relative_error(kernels.attention_fp8(inputs, kernel=rung), ref)
        row[name + " emulated"] = relative_error(fp8.emulated_attention(inputs), ref)
    row["bfloat16"] = relative_error(kernels.attention(q, k, v, kernel=BF16_BASELINE), ref)
    return row


def envelope_rows(seed: int = 0) -> list[dict]:
    import cupy as cp

    rows = []
    for family in FAMILIES:
        for std in STDS:
            rows.append(point(cp, family, std, seed))
            r = rows[-1]
            progress(f"{family:>7} score std {std:5.1f}: " + ", ".join(f"{n} {r[n]:.1e} (x{ratio(r, n):.2f} emulated)"
                                                                       for n in VARIANTS) + f", bf16 {r['bfloat16']:.1e}")
    return rows


def ratio(row: dict, variant: str) -> float:
    """The kernel's error over its emulation's on the same codes: above 1 beyond rounding is a bug."""
    emulated = row[variant + " emulated"]
    return row[variant] / emulated if emulated else math.inf


def render_envelope(rows: list[dict]) -> list[str]:
    """The table: a row a point, each variant's error and its ratio to the emulation."""
    body = [[r["family"], f"{r['score_std']:g}", f"{r['measured_std']:.1f}", f"{r['estimate']:.0f}",
             *(f"{r[n]:.1e} (x{ratio(r, n):.2f})" for n in VARIANTS), f"{r['bfloat16']:.1e}"] for r in rows]
    head = ["inputs", "score std", "measured", "estimate (bound)", *(f"{n} (/ emulated)" for n in VARIANTS),
            f"{BF16_BASELINE} bfloat16"]
    return table(head, body, "lrrr" + "r" * (len(VARIANTS) + 1))


def threshold_verdict(rows: list[dict], threshold: float) -> str:
    """What kernels.fp8.PEAKED_SCORE_ESTIMATE does on these points: the largest error among those it leaves
    silent and the smallest among those it warns at (v25 as kernels.attention runs it)."""
    name = next(iter(VARIANTS))
    silent = [r[name] for r in rows if r["estimate"] <= threshold]
    warned = [r[name] for r in rows if r["estimate"] > threshold]
    if math.isinf(threshold):
        return "kernels.fp8.PEAKED_SCORE_ESTIMATE is unset: no warning."
    return (f"kernels.fp8.PEAKED_SCORE_ESTIMATE = {threshold:g}: silent at {len(silent)} points (v25's error at most "
            f"{max(silent, default=math.nan):.1e}), warns at {len(warned)} (at least {min(warned, default=math.nan):.1e}).")


def render_envelope_doc(result: dict, image: str | None) -> str:
    """docs/results.md's envelope section: the setup, the table, the warning threshold on these points, the plot."""
    e, dev = result["envelope"], result["setup"]["device"]
    shape = " x ".join(str(e["shape"][k]) for k in ("B", "NH", "T", "d"))
    lines = [f"{dev['name']} ({dev['arch']}), {result['setup']['date'][:10]}; B x NH x T x d = {shape}, "
             f"{'causal' if e['causal'] else 'non-causal'}, bfloat16 inputs, seed {result['seed']}. Relative "
             "Frobenius error against float64; in brackets each variant's error over its float64 emulation on the "
             "same e4m3 codes (above 1 beyond rounding would be a bug in the kernel). \"estimate\": "
             "kernels.fp8.score_scale_estimate, from the block maxima.", ""]
    lines += render_envelope(e["rows"])
    lines += ["", threshold_verdict(e["rows"], fp8.PEAKED_SCORE_ESTIMATE)]
    if image:
        lines += ["", f"![FP8 relative error against the scores' std]({image})"]
    return "\n".join(lines)


def plot_envelope(plt, result: dict):
    """Relative error against the scores' std, log-log: each variant solid, its emulation dashed."""
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(12, 4.5), sharey=True)
    for ax, family in zip(axes, FAMILIES):
        rows = [r for r in result["envelope"]["rows"] if r["family"] == family]
        x = [r["score_std"] for r in rows]
        for name in [*VARIANTS, "bfloat16"]:
            line, = ax.plot(x, [r[name] for r in rows], marker="o", label=name)
            if name in VARIANTS:
                ax.plot(x, [r[name + " emulated"] for r in rows], linestyle="--", color=line.get_color(),
                        label=f"{name}, emulated")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("std of the scaled scores")
        ax.set_title(f"{family}: " + ("q, k ~ N(0, s^2)" if family == "scaled" else "q + c, k + c"))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative Frobenius error vs float64")
    axes[-1].legend(fontsize=7)
    name = (result["setup"].get("device") or {}).get("name", "")
    fig.suptitle(f"FP8 accuracy envelope, {name}, "
                 f"B x NH x T x d = {' x '.join(map(str, SHAPE))}, causal")
    return fig
