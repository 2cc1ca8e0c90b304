"""The PNG plots beside the sweep, e2e and scale result files (matplotlib is optional: the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from . import ceilings
from .device import progress
from .results import E2E_MODELS, e2e_model


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_or_none(plot, result: dict, path: Path) -> str | None:
    """Draw the plot beside the result file; its name, or None (saying why) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        progress("matplotlib is not installed (pip install -e '.[plot]'): no plot written; the JSON has the data")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plot(plt, result)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _device_title(result: dict) -> str:
    dev = result["setup"].get("device") or {}
    return f"{dev.get('name', 'no GPU')}, {result['setup']['date'][:10]}"


def _colors(plt, names: list[str]) -> dict[str, tuple]:
    """One distinct colour per name (tab20, then tab20b), stable across both plots."""
    palette = [plt.get_cmap("tab20")(i) for i in range(20)] + [plt.get_cmap("tab20b")(i) for i in range(20)]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def sweep_causal(result: dict) -> bool:
    """Whether a sweep's shapes are causal (files before the non-causal sweep have no "causal" key: causal)."""
    return result["shapes"][0].get("causal", True)


def plot_sweep(plt, result: dict):
    """TFLOP/s against T, one line per rung (solid) and peer (dashed: SDPA flash is FlashAttention-2), with
    the ceiling of the dtype's arithmetic measured in the same run (fp32 FFMA; bf16 or fp16 tensor GEMM)."""
    fig, ax = plt.subplots(figsize=(11, 5.5))
    names = result["kernels"] + result["peers"]
    color = _colors(plt, names)
    for name in names:
        points = [(r["shape"]["T"], r["tflops"]) for r in result["rows"] if r["name"] == name and r["status"] == "ok"]
        if points:
            label = next(r["label"] for r in result["rows"] if r["name"] == name)
            ax.plot(*zip(*points, strict=True), marker="o", label=label, color=color[name],
                    linestyle="-" if name in result["kernels"] else "--")
    top, what = ceilings.ceiling(ceilings.DTYPE_MATH[result["dtype"]], result["ceilings"])  # the dtype's own
    if top:
        ax.axhline(top, color="gray", linestyle=":", label=f"{what} ceiling ({top:.0f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"sequence length T (B = {result['tokens']} // T, NH = {result['shapes'][0]['NH']}, "
                  f"d = {result['shapes'][0]['d']})")
    causal = sweep_causal(result)
    ax.set_ylabel("TFLOP/s (causal: 4 B NH T^2 d / 2)" if causal else "TFLOP/s (non-causal: 4 B NH T^2 d)")
    ax.set_title(f"{'causal' if causal else 'non-causal'} attention forward, {result['dtype']}: {_device_title(result)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_e2e(plt, result: dict):
    """Elapsed time against tokens generated, one panel per mode, one colour per attention."""
    modes = [m for m in ("no-cache", "kv-cache") if any(r["mode"] == m and r["status"] == "ok" for r in result["rows"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes) + 3, 5.5), squeeze=False)
    labels = list(dict.fromkeys(r["label"] for r in result["rows"]))
    color = _colors(plt, labels)
    for ax, mode in zip(axes[0], modes, strict=True):
        for r in result["rows"]:
            if r["status"] == "ok" and r["mode"] == mode:
                ax.plot(range(1, len(r["elapsed"]) + 1), r["elapsed"], label=r["label"], color=color[r["label"]],
                        linestyle="--" if r["kind"] != "rung" else "-")
        ax.set_xlabel("tokens generated")
        ax.set_ylabel("elapsed seconds")
        ax.set_title("no KV cache (the seed's mode)" if mode == "no-cache" else "KV cache")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    prompt = repr(result["prompt"]) if isinstance(result["prompt"], str) else f"{result['prompt_tokens']} token ids"
    fig.suptitle(f"{E2E_MODELS[e2e_model(result)]}, greedy, {result['dtype']}, prompt {prompt}: {_device_title(result)}")
    return fig


def plot_scale(plt, result: dict):
    """Decode tokens/s per model (log scale), one line per dtype, beside its bandwidth floor (the copy
    ceiling over the weight bytes a token reads, dashed) and the HF peer's points."""
    fig, ax = plt.subplots(figsize=(10, 5.5))
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    series = list(dict.fromkeys((r["kind"], r["dtype"]) for r in ok))
    color = _colors(plt, [f"{kind} {dtype}" for kind, dtype in series])
    for kind, dtype in series:
        rows = [r for r in ok if (r["kind"], r["dtype"]) == (kind, dtype)]
        xs = [models.index(r["model"]) for r in rows]
        c = color[f"{kind} {dtype}"]
        if kind == "hf":
            ax.plot(xs, [r["decode_tokens_per_s"] for r in rows], marker="s", linestyle="none", color=c,
                    label=f"HF transformers, {dtype}, static cache")
            continue
        ax.plot(xs, [r["decode_tokens_per_s"] for r in rows], marker="o", color=c, label=f"lab, {dtype}")
        ax.plot(xs, [r["floor_tokens_per_s"] for r in rows], marker="_", linestyle="--", color=c,
                label=f"bandwidth floor, {dtype} ({result['ceilings']['copy_tbps']:.2f} TB/s copy)")
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (greedy, batch 1, KV cache)")
    ax.set_title(f"decode at scale: {_device_title(result)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
