"""t01 - FlashAttention-2's forward in Triton: the algorithm of v13, written per tile, not per thread.

The change: the first rung of the Triton family. One program per (query tile Q_i, head, batch), as
FlashAttention-2 partitions the work; it keeps m_i, l_i and O_i in registers while it walks the key
tiles K_j, V_j its rows can see, with the online softmax: S_ij = Q_i K_j^T, m_new = max(m_i,
rowmax(S_ij)), P_ij = exp2(S_ij - m_new), l_i = l_i exp2(m_i - m_new) + rowsum(P_ij), O_i =
O_i exp2(m_i - m_new) + P_ij V_j, and O_i / l_i once at the end. The scores are in log2 units (the
softmax scale times log2(e), one multiply per score), so every exponential is one exp2.

Why it should be fast: Triton picks the thread layout, the tensor-core instructions (mma.sync on
sm_80, wgmma on sm_90), the shared-memory staging and the software pipelining of the K_j, V_j loads
(num_stages) from this tile-level description; what is left to write is the algorithm. The loop over
key tiles is split in two: the tiles that every row of Q_i sees whole run without a mask (no compare,
no bounds), and only the tiles crossing the diagonal or the end of the keys build one. Causal query
tiles run heaviest first (the last tile sees the most keys), so the long programs start early.

Beyond causal self-attention, as the CUDA rungs: query row i sees keys j <= i + T_k - T_q when causal
(the mask aligned bottom-right); a row that sees no key (T_q > T_k) is written as zeros; query head
h reads K/V head h // (NH / NH_kv) (grouped-query attention); Q, K, V and O are read through their
strides (the last one 1), so views of a packed projection need no copies.

Arithmetic: float32 inputs use tl.dot's input_precision, the first of lab.precisions by default:
"tf32x3" splits each operand into a TF32 part and a TF32 remainder and sums three tensor-core
products (float32-level accuracy), "ieee" multiplies in plain float32 (no tensor cores), "tf32" rounds
every operand to TF32 (11 significant bits: 8192 times float32's unit roundoff, hence its
tolerance). bfloat16 and float16 multiply on the tensor cores and accumulate in float32; P_ij is
rounded to the input dtype before P_ij V_j, as the reference's low-precision recipe does.

Geometry: grid (ceil(T_q / BLOCK_M), NH, B); BLOCK_M, BLOCK_N, num_warps and num_stages autotuned
over CONFIGS per head size, causal, precision, dtypes and the power of two at or above the longer
length (T_TUNE), configs whose Q_i and num_stages K_j, V_j tiles exceed the device's shared memory
pruned first. Limits: head sizes a power of two from 16 (tl.arange, tl.dot); O contiguous in d.
A NaN or Inf in V_j also reaches the rows of its tile that mask its key (0 x NaN in P_ij V_j).

lab.dtypes      float32, bfloat16, float16
lab.head_sizes  32, 64, 128
lab.precisions  tf32x3, ieee, tf32
lab.tolerance   tf32x3 8, ieee 8, tf32 8200, bfloat16 2, float16 2
lab.supports    noncausal, cross, gqa
"""

import math

import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the declared search space of the autotuner
CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2))]


@triton.jit
def attend_tile(acc, l_i, m_i, q, K, V, start, rows, cols, dims, T_k, shift, qk_scale, stride_kt, stride_vt,
                PRECISION: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over the key tile starting at `start`."""
    keys = start + cols
    if MASKED:  # keys past T_k read as zeros and score -inf
        k = tl.load(K + keys[:, None] * stride_kt + dims[None, :], mask=keys[:, None] < T_k, other=0.0)
        v = tl.load(V + keys[:, None] * stride_vt + dims[None, :], mask=keys[:, None] < T_k, other=0.0)
    else:
        k = tl.load(K + keys[:, None] * stride_kt + dims[None, :])
        v = tl.load(V + keys[:, None] * stride_vt + dims[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # S_ij = Q_i K_j^T, in log2 units
    if MASKED:
        visible = keys[None, :] < T_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_new = max(m_i, rowmax(S_ij))
    m_sub = m_new
    if MASKED:  # a row that sees no key yet has m_new = -inf: subtract 0, so exp2 gives 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_sub[:, None])  # P_ij = exp2(S_ij - m_new)
    alpha = tl.math.exp2(m_i - m_sub)  # the old terms' rescale, exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)  # l_i = l_i alpha + rowsum(P_ij)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # O_i = O_i alpha + P_ij V_j
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["T_q", "T_k", "T_TUNE"])
def attention_forward(Q, K, V, O, T_q, T_k, kv_group, qk_scale, T_TUNE,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                      stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                      HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # T_TUNE is the autotuner's key only: the kernel never reads it
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # a head's heaviest causal tile first
    head, batch = tl.program_id(1), tl.program_id(2).to(tl.int64)  # 64-bit offsets past 2^31 elements
    kv_head = (head // kv_group).to(tl.int64)  # grouped-query attention: NH / NH_kv query heads per K/V head
    Q += batch * stride_qb + head.to(tl.int64) * stride_qh
    O += batch * stride_ob + head.to(tl.int64) * stride_oh
    K += batch * stride_kb + kv_head * stride_kh
    V += batch * stride_vb + kv_head * stride_vh
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qt + dims[None, :], mask=rows[:, None] < T_q, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    shift = T_k - T_q  # causal: row i sees keys j <= i + shift
    if CAUSAL:
        end = tl.minimum(T_k, tl.maximum((tile + 1) * BLOCK_M + shift, 0))  # past the last key the last row sees
        whole = tl.minimum(T_k, tl.maximum(tile * BLOCK_M + shift + 1, 0)) // BLOCK_N * BLOCK_N  # the first row's
    else:
        end = T_k
        whole = T_k // BLOCK_N * BLOCK_N
    for start in range(0, whole, BLOCK_N):  # tiles every row sees whole: no mask
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, K, V, start, rows, cols, dims, T_k, shift, qk_scale,
                                    stride_kt, stride_vt, PRECISION, CAUSAL, False)
    for start in range(whole, end, BLOCK_N):  # the diagonal and the end of the keys: masked
        acc, l_i, m_i = attend_tile(acc, l_i, m_i, q, K, V, start, rows, cols, dims, T_k, shift, qk_scale,
                                    stride_kt, stride_vt, PRECISION, CAUSAL, True)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # O_i / l_i; a row that saw no key stays 0
    tl.store(O + rows[:, None] * stride_ot + dims[None, :], o.to(O.dtype.element_ty), mask=rows[:, None] < T_q)


def fits_shared_memory(configs, named_args, **kwargs):
    """The configs whose Q_i tile and num_stages K_j, V_j tiles fit the device's shared memory."""
    d, item = kwargs["HEAD_DIM"], named_args["Q"].element_size()
    limit = triton.runtime.driver.active.utils.get_device_properties(named_args["Q"].device.index)["max_shared_mem"]
    fit = [c for c in configs if (c.kwargs["BLOCK_M"] + 2 * c.num_stages * c.kwargs["BLOCK_N"]) * d * item <= limit]
    return fit or configs[-1:]


autotuned = triton.autotune([triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]},
                                           num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in CONFIGS],
                            key=["HEAD_DIM", "CAUSAL", "PRECISION", "T_TUNE"],
                            prune_configs_by={"early_config_prune": fits_shared_memory})(attention_forward)


def forward(q, k, v, o, *, scale: float, causal: bool, precision: str, config: dict | None = None) -> dict:
    """o = attention of q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d), torch tensors, launched on
    torch's current stream: the autotuner's choice, or `config` (one of CONFIGS). Returns the config."""
    B, NH, T_q, d = q.shape
    NH_kv, T_k = k.shape[1], k.shape[2]
    args = (q, k, v, o, T_q, T_k, NH // NH_kv, scale * math.log2(math.e), min(triton.next_power_of_2(max(T_q, T_k)), 16384),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    meta = dict(HEAD_DIM=d, CAUSAL=bool(causal), PRECISION=precision)
    if config is None:
        autotuned[lambda META: (triton.cdiv(T_q, META["BLOCK_M"]), NH, B)](*args, **meta)
        best = autotuned.best_config
        return dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)
    attention_forward[(triton.cdiv(T_q, config["BLOCK_M"]), NH, B)](*args, **meta, **config)
    return config
