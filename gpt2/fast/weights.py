"""The weights as the engine reads them, and the bytes a decode step reads: the layout chosen once at
load (decode_layout) and the engine's views of it (decode_weights), gemm.cu's split and tiled float32
copies, decode_step.cu's folds of a LayerNorm into the rows after it (bfloat16 rounding: lm/bf16.py).
Every function takes the array module (`cp`: CuPy, or NumPy in the CPU tests)."""

from __future__ import annotations

from dataclasses import dataclass

from lm.arrays import array_module
from lm.bf16 import bf16_bits, kernel_type, to_float32

from ..config import GPT2Config
from ..errors import LabError
from .plan import GEMM_BK, GEMM_TILE

LINEAR = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # a layer's Conv1D weights, in step order


def as_bfloat16(params: dict) -> dict:
    """Every parameter as a bfloat16 CuPy array (rounded to nearest even): the weights of a bfloat16
    run, from which the engine takes its dtype."""
    import cupy as cp
    import ml_dtypes

    try:
        return {name: bf16_bits(cp, to_float32(cp, a)).view(ml_dtypes.bfloat16) for name, a in params.items()}
    except (TypeError, ValueError) as exc:
        raise LabError(f"CuPy cannot hold bfloat16 arrays here ({type(exc).__name__}: {exc})") from None


MATRICES = ("wte.weight", "wpe.weight", "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
            "mlp.c_proj.weight")


def is_matrix(name: str) -> bool:
    return name.endswith(MATRICES)


def weight_bytes_per_token(config: GPT2Config, dtype: str) -> int:
    """Bytes of weights one decode step reads: every matrix once (wte whole, for the logits; one wpe
    row), and the float32 biases and LayerNorm parameters. The KV cache is not counted."""
    C, F, V = config.n_embd, config.mlp_width, config.vocab_size
    item = 2 if dtype == "bfloat16" else 4
    matrices = config.n_layer * (C * 3 * C + C * C + C * F + F * C) + V * C + C
    vectors = config.n_layer * (3 * C + C + F + C + 4 * C) + 2 * C
    return item * matrices + 4 * vectors


def kv_bytes_per_token(config: GPT2Config, dtype: str, position: int) -> int:
    """Bytes of keys and values one decode step at `position` reads (positions 0..position)."""
    item = 2 if dtype == "bfloat16" else 4
    return 2 * config.n_layer * config.n_embd * (position + 1) * item


def gemm_weight(cp, w) -> tuple:
    """A Conv1D weight (K, N) as gemm.cu reads it: W^T (N, K) split into big = W^T rounded to TF32
    (nearest, ties away: add half an ulp, clear 13 bits) and small = W^T - big, each cut into tiles of
    GEMM_TILE rows x GEMM_BK columns stored one after the other (a block's tiles along K contiguous),
    and within a tile the 128-byte swizzle: row r's 16-byte chunk c at c ^ (r mod 8)."""
    K, N = w.shape
    if N % GEMM_TILE or K % GEMM_BK:
        raise ValueError(f"gemm.cu needs N % {GEMM_TILE} == 0 and K % {GEMM_BK} == 0, got (K, N) = ({K}, {N})")
    wt = cp.ascontiguousarray(w.T, dtype=cp.float32)  # (N, K)
    big = ((wt.view(cp.uint32) + cp.uint32(0x1000)) & cp.uint32(0xffffe000)).view(cp.float32)
    small = wt - big
    r = cp.arange(GEMM_TILE)[:, None]
    k = cp.arange(GEMM_BK)[None, :]
    col = ((k // 4) ^ (r % 8)) * 4 + k % 4  # (row, k) -> its float within the swizzled row

    def tiles(a):
        a = a.reshape(N // GEMM_TILE, GEMM_TILE, K // GEMM_BK, GEMM_BK).transpose(0, 2, 1, 3)  # (n tile, k tile, r, k)
        out = cp.empty(a.shape, dtype=cp.float32)
        out[:, :, r, col] = a
        return out

    return tiles(big), tiles(small)


FOLD_BYTES = 8 << 20  # the float64 rows layernorm_fold widens at once (a transient: kept small)


def layernorm_fold(cp, W, bias, ln_w, ln_b):
    """decode_step.cu's fold of a LayerNorm into the rows after it: (N, 2) float32 pairs, per row n of
    W (out, in) the sum_k W_nk ln_w_k and bias_n + sum_k W_nk ln_b_k, computed in float64, so that
    LN(x) . W_n + bias_n = r (sum_k W_nk ln_w_k x_k - mean * fold[n, 0]) + fold[n, 1], r = 1 / std.
    W may be float32 or bfloat16 (bits); it is widened FOLD_BYTES of float64 rows at a time."""
    N, K = W.shape
    step = max(1, FOLD_BYTES // (8 * K))  # rows at a time
    ln_w64, ln_b64 = ln_w.astype(cp.float64), ln_b.astype(cp.float64)
    out = cp.empty((N, 2), dtype=cp.float32)
    for n in range(0, N, step):
        rows = W[n:n + step]
        W64 = (to_float32(cp, rows) if rows.dtype.name in ("bfloat16", "uint16") else rows).astype(cp.float64)
        out[n:n + step] = cp.stack([W64 @ ln_w64, bias[n:n + step].astype(cp.float64) + W64 @ ln_b64], axis=1)
    return out


def decode_layout(params: dict) -> dict:
    """In place, the layout the engine reads without a copy: each Conv1D weight (in, out) re-laid
    column-major (the same values and shape, so the eager model reads it as before), so that its
    transpose is the row-major (out, in) matrix of the decode kernels, each output's weights
    contiguous. One weight at a time: at most one matrix more exists at once. Returns params."""
    for name, a in params.items():
        if name.endswith(tuple(f"{linear}.weight" for linear in LINEAR)) and not a.T.flags.c_contiguous:
            xp = array_module(a)
            bits = a.view(xp.uint16) if a.dtype.name == "bfloat16" else a  # a plain copy, whatever the dtype
            params[name] = xp.asfortranarray(bits).view(a.dtype)
    return params


@dataclass
class DecodeWeights:
    """The weights as the engine's kernels read them: the matrices in the run's element type (float32
    or bfloat16 bits), each row contiguous; the vectors (biases, LayerNorm) in float32."""

    wte: object  # (V, C)
    wpe: object  # (n_positions, C)
    layers: list  # per layer, LINEAR name -> (out, in)
    vectors: dict  # checkpoint-native name -> (n,) float32

    def arrays(self) -> dict:
        """Every array, by name (the layers' as h.N.<linear>)."""
        return {"wte": self.wte, "wpe": self.wpe, **self.vectors,
                **{f"h.{i}.{name}": a for i, layer in enumerate(self.layers) for name, a in layer.items()}}


def decode_weights(cp, params: dict, config: GPT2Config, dtype: str) -> DecodeWeights:
    """The engine's weights from params: views of them where params already hold what the kernels read
    (the run's dtype; the Conv1D weights as decode_layout lays them out), else one copy each."""

    def matrix(a):
        a = kernel_type(cp, a, dtype)
        return a if a.flags.c_contiguous else cp.ascontiguousarray(a)

    return DecodeWeights(
        wte=matrix(params["wte.weight"]), wpe=matrix(params["wpe.weight"]),
        layers=[{name: matrix(params[f"h.{i}.{name}.weight"].T) for name in LINEAR} for i in range(config.n_layer)],
        vectors={name: to_float32(cp, a) for name, a in params.items() if a.ndim == 1})
