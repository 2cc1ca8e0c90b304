"""The ceiling each row is held against: that of the precision it computes at, measured in the same run
(timing.measure_ceilings). A float32 rung on FFMA (v01..v13) against cuBLAS SGEMM with TF32 off; a
float32 rung on the TF32 tensor cores (lab.tf32_products) against cuBLAS with TF32 allowed, over the TF32
products it issues per product (3xTF32: a third of the TF32 ceiling, since every product counted is three
on the tensor cores); bfloat16 and float16 rows against their tensor GEMM; an FP8 rung (lab.fp8: bfloat16
in and out, e4m3 on the tensor cores) against the e4m3 GEMM. Peers are held to their dtype's
natural ceiling: float32 SDPA and the CuPy reference to FFMA (whatever arithmetic they use inside)."""

from __future__ import annotations

import re
from pathlib import Path

import kernels

MATHS = {  # what a row computes with -> the ceilings' key, and the name its tables give that ceiling
    "ffma": ("ffma_tflops", "fp32 FFMA"),
    "tf32": ("tf32_tflops", "TF32 tensor"),
    "bf16": ("bf16_tflops", "bf16 tensor"),
    "fp16": ("fp16_tflops", "fp16 tensor"),
    "fp8": ("fp8_tflops", "fp8 tensor (e4m3)"),
}
DTYPE_MATH = {"float32": "ffma", "bfloat16": "bf16", "float16": "fp16"}
_TF32X = re.compile(r"^tf32x(\d+)$")


def config_params(text: str | None) -> dict[str, int]:
    """A row's config, "d_head=64, B_r=64, B_c=64, split=1" -> {"d_head": 64, ..., "split": 1}."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", text or "")}


def rung_math(rung, dtype: str, params: dict[str, int]) -> str | None:
    """"fp8" for an FP8 rung (lab.fp8); "ffma", "tf32", "tf32x3" (3xTF32) for float32; the dtype's ("bf16",
    "fp16") for 16-bit inputs. The TF32 products come from the configs matching `params` (the row's config;
    every config where none matches); None if they disagree."""
    if rung.fp8:
        return "fp8"
    if dtype != "float32":
        return DTYPE_MATH.get(dtype)
    configs = [c for c in rung.configs if all(params.get(k, v) == v for k, v in rung.params(c).items())]
    products = {rung.tf32_products_of(c) for c in configs or rung.configs}
    if len(products) != 1:
        return None
    n = products.pop()
    return "ffma" if n == 0 else "tf32" if n == 1 else f"tf32x{n}"


def row_math(r: dict, paths: dict[str, Path] | None = None) -> str | None:
    """What a kernels or sweep row computes with: its "math" where the run recorded it; else from its dtype
    and (a rung) the rung's declarations; for a rung no longer found, its dtype's, or None in float32."""
    if r.get("math"):
        return r["math"]
    if r["kind"] != "rung":
        return DTYPE_MATH.get(r["dtype"])
    try:
        rung = kernels.load((paths or {}).get(r["name"], r["name"]))
    except (ValueError, OSError):
        return None if r["dtype"] == "float32" else DTYPE_MATH.get(r["dtype"])
    return rung_math(rung, r["dtype"], config_params(r.get("config")))


def ceiling(math: str | None, ceilings: dict) -> tuple[float | None, str]:
    """The TFLOP/s a row of this math is held to, and its name ("TF32 tensor / 3" for 3xTF32); None where
    the run did not measure it (an older result: only FFMA)."""
    if math is None:
        return None, "unknown"
    m = _TF32X.match(math)
    key, label = MATHS["tf32" if m else math]
    value = ceilings.get(key)
    if m:
        n = int(m[1])
        return (value / n if value else None), f"{label} / {n}"
    return value, label


def pct_of_ceiling(r: dict, ceilings: dict, paths: dict[str, Path] | None = None) -> float | None:
    """A timed row's TFLOP/s as % of its own precision's ceiling; None where it has none."""
    top, _ = ceiling(row_math(r, paths), ceilings)
    return 100.0 * r["tflops"] / top if top and r.get("tflops") is not None else None


def annotate(rows: list[dict], ceilings: dict, paths: list[Path]) -> None:
    """Record in each row what it computes with and its % of that ceiling (the JSON's "math", "pct_ceiling")."""
    by_name = {p.stem: p for p in paths}
    for r in rows:
        r["math"] = row_math(r, by_name)
        r["pct_ceiling"] = pct_of_ceiling(r, ceilings) if r["status"] == "ok" else None


def math_name(math: str) -> str:
    m = _TF32X.match(math)
    return f"{m[1]}xTF32" if m else {"ffma": "FFMA", "tf32": "TF32", "bf16": "bf16", "fp16": "fp16", "fp8": "FP8 (e4m3)"}[math]


def describe(rows: list[dict], ceilings: dict) -> str:
    """The sentence under a table's header: which rows are held to which ceiling, and its value."""
    groups: dict[str | None, list[str]] = {}
    for r in rows:
        groups.setdefault(row_math(r), [])
        label = f"`{r['name']}`" if r["kind"] == "rung" else r["label"]
        if label not in groups[row_math(r)]:
            groups[row_math(r)].append(label)
    parts = []
    for math, names in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        top, label = ceiling(math, ceilings)
        if math and _TF32X.match(math):
            label += f" ({_TF32X.match(math)[1]} TF32 products per product counted)"
        value = f"{top:.1f} TFLOP/s" if top else "not measured in this run (-)"
        who = ", ".join(names)
        parts.append(f"{math_name(math) if math else 'unknown arithmetic'} ({who}): {label}, {value}")
    return ("\"% of ceiling\" holds each row to the ceiling of the precision it computes at (peers to their "
            "dtype's: float32 to FFMA), measured in the same run: " + "; ".join(parts) + ".")


def measured(ceilings: dict) -> str:
    """The compute ceilings a run measured, each with how: for the header of a table."""
    parts = []
    for key, label in MATHS.values():
        what = ceilings.get(key.replace("_tflops", "_what"), "?")
        if ceilings.get(key):
            clock = (ceilings.get(key.replace("_tflops", "_timing")) or {}).get("sm_clock")
            at = f" at a {clock['median_mhz']:,.0f} MHz SM clock (median)" if clock else ""
            parts.append(f"{label} {ceilings[key]:.1f} TFLOP/s{at} ({what})")
        elif key in ceilings:  # measured, and unavailable: what says why
            parts.append(f"{label} {what}")
    return "; ".join(parts)
