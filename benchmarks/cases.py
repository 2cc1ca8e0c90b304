"""What is measured: the shapes and feature cases, the FLOP conventions TFLOP/s come from, the random
inputs every implementation sees, and the gate every output passes before it is timed (its error
against a float64 reference, at most TOLERANCE_FACTOR x that of the plain float32 implementation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import kernels

from . import device

GPT2_SHAPES = ((1, 512), (8, 1024), (16, 2048), (6, 4096), (1, 8192))  # B x T; NH = 12, d = 64
DTYPES = ("float32", "bfloat16", "float16")
TOLERANCE_FACTOR = 8.0
EPS = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0**-7}

FLOP_CONVENTION = ("causal forward = 4 * B * NH * T^2 * d / 2 FLOPs: the two T x T x d matrix products, half "
                   "of them under the mask; exp and the softmax arithmetic are not counted")
NONCAUSAL_FLOP_CONVENTION = ("non-causal forward = 4 * B * NH * T^2 * d FLOPs: the two T x T x d matrix products; "
                             "exp and the softmax arithmetic are not counted")


def flop_convention(shapes) -> str:
    """FLOP_CONVENTION where every shape is causal, NONCAUSAL_FLOP_CONVENTION where none is."""
    kinds = {s.causal for s in shapes}
    if len(kinds) != 1:
        raise ValueError("one run's shapes are all causal or all non-causal: the table states one FLOP convention")
    return FLOP_CONVENTION if kinds == {True} else NONCAUSAL_FLOP_CONVENTION


def attention_flops(B: int, NH: int, T: int, d: int, causal: bool = True) -> int:
    """The FLOP count every TFLOP/s in this lab is computed from (FLOP_CONVENTION)."""
    full = 4 * B * NH * T * T * d  # S = Q K^T and O = P V: 2 * T * T * d each
    return full // 2 if causal else full


FEATURE_FLOP_CONVENTION = (
    "4 * d FLOPs per (query, key) pair of every query head (S = Q K^T and O = P V, 2 * d each; exp and the "
    "softmax arithmetic are not counted; grouped-query heads count every query head). Pairs: T_q * T_k without "
    "the mask; T^2 / 2 for causal self-attention (T_q = T_k, as in the kernels table); with T_q != T_k the exact "
    "number the bottom-right causal mask lets through, T_q * T_k - T_q * (T_q - 1) / 2 for T_q <= T_k")


def visible_pairs(T_q: int, T_k: int, causal: bool = True) -> int:
    """(query, key) pairs the mask lets through. Causal is aligned bottom-right, as in the rungs and
    kernels.reference.causal_mask: query i sees keys j <= i + T_k - T_q (so with T_q > T_k the first
    T_q - T_k queries see nothing)."""
    if not causal:
        return T_q * T_k
    if T_q <= T_k:  # query i sees i + T_k - T_q + 1 keys
        return T_q * T_k - T_q * (T_q - 1) // 2
    return T_k * (T_k + 1) // 2  # the last T_k queries see 1, 2, ..., T_k keys


def attention_flops_qk(B: int, NH: int, T_q: int, T_k: int, d: int, causal: bool = True) -> int:
    """FLOPs of q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d) (FEATURE_FLOP_CONVENTION): 4 * d per pair.
    Causal self-attention (T_q == T_k) keeps attention_flops' T^2 / 2, so these TFLOP/s compare with
    the kernels table; without the mask every T_q x T_k pair counts; causal with T_q != T_k counts the
    pairs the bottom-right mask lets through exactly (visible_pairs)."""
    if causal and T_q == T_k:
        return attention_flops(B, NH, T_q, d, causal=True)
    return 4 * B * NH * visible_pairs(T_q, T_k, causal) * d

@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    NH: int = 12
    d: int = 64
    causal: bool = True

    @property
    def label(self) -> str:
        return f"{self.B}x{self.T}"

    def as_dict(self) -> dict:
        """The shape as result files hold it; "causal" only where it is not (every file before the non-causal
        sweep held causal shapes without the key)."""
        return {"B": self.B, "T": self.T, "NH": self.NH, "d": self.d} | ({} if self.causal else {"causal": False})

    # self-attention, one K/V head per query head: the general fields Case spells out
    T_q = property(lambda self: self.T)
    T_k = property(lambda self: self.T)
    NH_kv = property(lambda self: self.NH)


@dataclass(frozen=True)
class Case:
    """A shape of the features benchmark: q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d), causal (the
    mask aligned bottom-right) or not. `part` names the table it belongs to."""

    part: str
    B: int
    NH: int
    NH_kv: int
    T_q: int
    T_k: int
    d: int
    causal: bool = True

    @property
    def label(self) -> str:
        lengths = f"{self.T_q}" if self.T_q == self.T_k else f"{self.T_q}/{self.T_k}"
        return f"{self.part} {self.B}x{lengths}"

    def needs(self) -> set[str]:
        """The lab.supports features a rung must declare to run this case."""
        return {f for f, needed in (("noncausal", not self.causal), ("cross", self.T_q != self.T_k),
                                    ("gqa", self.NH_kv != self.NH)) if needed}

    def describe(self) -> str:
        heads = f"NH={self.NH}" + (f", NH_kv={self.NH_kv}" if self.NH_kv != self.NH else "")
        lengths = f"T={self.T_q}" if self.T_q == self.T_k else f"T_q={self.T_q}, T_k={self.T_k}"
        mask = ("causal" + (", bottom-right" if self.T_q != self.T_k else "")) if self.causal else "non-causal"
        return f"B={self.B}, {heads}, {lengths}, d={self.d}, {mask}"

    def as_dict(self) -> dict:
        return {"part": self.part, "B": self.B, "NH": self.NH, "NH_kv": self.NH_kv, "T_q": self.T_q,
                "T_k": self.T_k, "d": self.d, "causal": self.causal}


def shape_flops(shape) -> int:
    """attention_flops_qk of a Shape or a Case (for a Shape: attention_flops)."""
    return attention_flops_qk(shape.B, shape.NH, shape.T_q, shape.T_k, shape.d, shape.causal)


def _round_to(x32, dtype: str):
    """float32 values rounded to `dtype` and held in float32 (exact: both halves are subsets of float32)."""
    cupy = device.get_cupy()
    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(cupy.float16).astype(cupy.float32)
    bits = x32.view(cupy.uint32)  # bfloat16: round to nearest even on the top 16 bits
    bits = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) & cupy.uint32(0xFFFF0000)
    return bits.view(cupy.float32)


class Inputs:
    """One shape's random Q, K, V: the float32 values every implementation sees (rounded to the
    benchmark dtype), the arrays a rung gets, and torch views of the same memory (DLPack)."""

    def __init__(self, shape: Shape | Case, dtype: str, seed: int):
        cupy = device.get_cupy()
        self.shape, self.dtype = shape, dtype
        rng = cupy.random.default_rng(seed)
        q_dims = (shape.B, shape.NH, shape.T_q, shape.d)
        kv_dims = (shape.B, shape.NH_kv, shape.T_k, shape.d)
        self.q32, self.k32, self.v32 = (_round_to(rng.standard_normal(dims, dtype=cupy.float32), dtype)
                                        for dims in (q_dims, kv_dims, kv_dims))
        self.rung_inputs_problem = None
        if dtype == "float32":
            self.qkv = (self.q32, self.k32, self.v32)
        else:
            try:
                target = np.float16 if dtype == "float16" else _ml_dtypes_bfloat16()
                self.qkv = tuple(x.astype(target) for x in (self.q32, self.k32, self.v32))
            except Exception as exc:
                self.qkv, self.rung_inputs_problem = None, f"CuPy cannot hold {dtype} here ({exc})"
        self._torch = None

    def torch_qkv(self):
        if self._torch is None:
            torch = device.get_torch()
            tensors = [torch.from_dlpack(x) for x in (self.q32, self.k32, self.v32)]  # zero-copy
            if self.dtype != "float32":
                tensors = [t.to(getattr(torch, self.dtype)) for t in tensors]  # exact: values already rounded
            self._torch = tuple(tensors)
        return self._torch


def _ml_dtypes_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def as_cupy_float(out):
    """A peer's or rung's output as a CuPy array (torch tensors through DLPack)."""
    cupy = device.get_cupy()
    if isinstance(out, cupy.ndarray):
        return out
    return cupy.from_dlpack(out.float().contiguous())


def check_outputs(inputs: Inputs, outputs: dict[str, object]) -> dict:
    """Every output's error against a float64 reference on the same inputs, with the plain float32
    implementation's own error beside it. Computed over chunks of K/V heads (each with the query heads
    it serves) so that the float64 score matrices fit in memory at any shape; every slice is checked."""
    cupy = device.get_cupy()
    s = inputs.shape
    B, NH, NH_kv, T_q, T_k, d = s.B, s.NH, s.NH_kv, s.T_q, s.T_k, s.d
    group, kv_heads = NH // NH_kv, B * NH_kv
    as_q = lambda x: x.reshape(kv_heads, group, T_q, d)  # noqa: E731  (B, NH, T_q, d) -> (B*NH_kv, group, T_q, d)
    as_kv = lambda x: x.reshape(kv_heads, 1, T_k, d)  # noqa: E731  (B, NH_kv, T_k, d) -> (B*NH_kv, 1, T_k, d)
    q, k, v = as_q(inputs.q32), as_kv(inputs.k32), as_kv(inputs.v32)
    outs = {name: as_q(as_cupy_float(o)) for name, o in outputs.items()}
    budget = min(0.4 * device.free_memory(), 8 * 2**30)
    per_kv_head = 32 * group * T_q * T_k + 32 * T_k * d  # ~3 float64 T_q x T_k temporaries per query head, K and V
    chunk = int(max(1, min(kv_heads, budget // per_kv_head)))
    plain = ref_max = 0.0
    stats = {name: {"max": 0.0, "sum": 0.0, "nonfinite": 0} for name in outs}
    for start in range(0, kv_heads, chunk):
        part = slice(start, min(kv_heads, start + chunk))
        ref = kernels.reference_attention(*(x[part].astype(cupy.float64) for x in (q, k, v)), causal=s.causal)
        plain32 = kernels.reference_attention(q[part], k[part], v[part], causal=s.causal)
        plain = max(plain, float(cupy.abs(plain32 - ref).max()))
        del plain32
        ref_max = max(ref_max, float(cupy.abs(ref).max()))
        for name, out in outs.items():
            o = out[part].astype(cupy.float64)
            bad = int((~cupy.isfinite(o)).sum())
            diff = cupy.abs(o - ref)
            st = stats[name]
            st["nonfinite"] += bad
            st["max"] = math.inf if bad else max(st["max"], float(diff.max()))
            st["sum"] += float(diff.sum()) if not bad else 0.0
        del ref
    device.release_memory()
    floor = EPS[inputs.dtype] * ref_max
    bound = TOLERANCE_FACTOR * max(plain, floor)
    n = B * NH * T_q * d
    return {
        "plain32_err": plain,
        "ref_max": ref_max,
        "bound": bound,
        "outputs": {name: {"max_err": st["max"], "mean_err": (st["sum"] / n) if not st["nonfinite"] else math.inf,
                           "nonfinite": st["nonfinite"], "ok": st["max"] <= bound} for name, st in stats.items()},
    }


def describe_launch(launch, shape: Shape | Case) -> str:
    """The configuration a prepared rung runs, with its number of key splits for a split-KV rung."""
    inst = launch.instance
    text = inst.describe()
    rung = getattr(inst, "rung", None)
    if rung is not None and rung.split_kv:
        text += f", splits={inst.splits(shape.B, shape.NH, shape.T_q, shape.T_k)}"
    return text


def apply_check(rows: list[dict], check: dict | None, outputs: dict) -> None:
    """The gate: each output's error against float64 goes into its row; a rung over the bound is wrong."""
    for r in rows:
        if r["name"] in outputs:
            e = check["outputs"][r["name"]]
            r |= {"max_err": e["max_err"], "mean_err": e["mean_err"], "nonfinite": e["nonfinite"],
                  "bound": check["bound"], "plain32_err": check["plain32_err"]}
            if not e["ok"] and r["kind"] == "rung":
                r["status"] = "wrong"
                r["reason"] = (f"max error {e['max_err']:.2e} > bound {check['bound']:.2e}"
                               + (f"; {e['nonfinite']} elements NaN/inf (unwritten?)" if e["nonfinite"] else ""))
