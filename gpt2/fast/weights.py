"""The engine's copies of the weights, and the bytes a decode step reads: bfloat16 rounding (as
kernels/fused/common.cuh rounds), gemm.cu's split and tiled float32 copies, decode_step.cu's folds
of a LayerNorm into the rows after it. The engine makes each copy once, when it is built."""

from __future__ import annotations

from ..config import GPT2Config
from ..errors import LabError
from .plan import GEMM_BK, GEMM_TILE


def to_float32(cp, a):
    """float32 from float32 or bfloat16 (widened through its bits: no CuPy bfloat16 arithmetic needed)."""
    if a.dtype.name == "bfloat16":
        return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return cp.ascontiguousarray(a, dtype=cp.float32)


def bf16_bits(cp, a32):
    """float32 -> bfloat16 bits in uint16, rounded to nearest even (as kernels/fused/common.cuh does)."""
    bits = cp.ascontiguousarray(a32, dtype=cp.float32).view(cp.uint32)
    return ((bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def round_to_bf16(cp, a32):
    """float32 values rounded to bfloat16, held in float32."""
    return (bf16_bits(cp, a32).astype(cp.uint32) << 16).view(cp.float32)


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


def layernorm_fold(cp, W, bias, ln_w, ln_b):
    """decode_step.cu's fold of a LayerNorm into the rows after it: (N, 2) float32 pairs, per row n of
    W (out, in) the sum_k W_nk ln_w_k and bias_n + sum_k W_nk ln_b_k, computed in float64, so that
    LN(x) . W_n + bias_n = r (sum_k W_nk ln_w_k x_k - mean * fold[n, 0]) + fold[n, 1], r = 1 / std."""
    W64 = W.astype(cp.float64)
    return cp.stack([W64 @ ln_w.astype(cp.float64), bias.astype(cp.float64) + W64 @ ln_b.astype(cp.float64)],
                    axis=1).astype(cp.float32)
