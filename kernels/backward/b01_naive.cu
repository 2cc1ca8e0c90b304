/*
 * b01 - naive backward: P recomputed from Q, K and the forward's log-sum-exp, one kernel per gradient.
 *
 * The gradients of O = softmax(scale Q K^T + mask) V, given dO (FlashAttention-2, Algorithm 2):
 *   P_ij = exp(scale q_i . k_j - lse_i)        the forward's probabilities, from its log-sum-exp
 *   D_i = rowsum(dO_i o O_i)                   = sum_j P_ij dP_ij
 *   dV_j = sum_i P_ij dO_i
 *   dP_ij = dO_i . v_j,  dS_ij = P_ij (dP_ij - D_i)
 *   dQ_i = scale sum_j dS_ij k_j,  dK_j = scale sum_i dS_ij q_i
 * Nothing of the forward is kept but O and lse (4 bytes a row): every kernel recomputes the scores it
 * needs, tile by tile, in shared memory, so memory stays linear in T as in the forward.
 *
 * The change: none yet; this is the ladder's first rung, the formulas as three kernels, each owning
 * one gradient so that no two blocks ever write the same element:
 *   backward_dq (a block per tile Q_i of B_r query rows): D_i from dO_i and O_i, then for every key tile
 *     K_j, V_j: dS_ij into shared memory, dQ_i += dS_ij K_j;
 *   backward_dk (a block per tile K_j of B_c keys): for every query head of its K/V head's group and
 *     every query tile that sees a key of K_j: Q_i, dO_i, lse_i and D_i, dS_ij, dK_j += dS_ij^T Q_i;
 *   backward_dv: the same loop, with P_ij only, dV_j += P_ij^T dO_i.
 * S_ij is computed three times and dP_ij twice: the cost of owning one gradient per kernel. The sums
 * run in a fixed order, so the results are the same bits on every run (lab.deterministic).
 *
 * Float32 accuracy (FlashAttention's rule holds each gradient to 3x the error of a plain float32
 * implementation, down to T = 1, where that error is a rounding): the dot products over d, the scores,
 * dP and D, are summed compensated (dot_compensated), the exponent of P is rounded once (fma), and
 * the gradients are summed in two levels, each tile's share from zero and then into the total. The
 * compensation's three adds a term run beside the term's two shared-memory loads.
 *
 * Geometry: 128 threads. A score tile (B_r x B_c) is dealt out row-major, thread t taking elements
 * t, t + 128, ...: each a dot product of d over a row of Q_i (or dO_i), the same for the 32 lanes of
 * a warp (a broadcast), and a row of K_j (or V_j), 32 different rows, their pitch d + 1 floats so the
 * lanes read 32 different banks. An accumulator tile (B_r x d or B_c x d) is dealt out the same way,
 * B_r d / 128 elements a thread, kept in registers; its inner loop reads one score (a broadcast) and
 * one element of 32 consecutive columns. Shared memory, in floats: Q_i, dO_i (B_r x d each), K_j,
 * V_j (B_c x (d + 1) each), the score tile (B_r x (B_c + 1)), lse_i and D_i (B_r each); B_r = B_c = 32:
 * 37,504 bytes at d = 64, 70,272 at d = 128. The query tiles of backward_dk and backward_dv start at
 * the first that sees a key of K_j (causal), and backward_dq stops at the last key tile its rows see.
 *
 * Limits: float32; B_r d and B_c d multiples of 128. Rows that see no key (causal, T_q > T_k) have
 * lse = +inf: their P is exactly 0, and so are their dQ and their share of dK and dV.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (128, 32, 32), (32, 32, 32), (96, 32, 32)
 * lab.threads    128
 * lab.smem       4 * (2 * B_r * d_head + 2 * B_c * (d_head + 1) + B_r * (B_c + 1) + 2 * B_r)
 * lab.phase      backward_dq: query tiles
 * lab.phase      backward_dk: key tiles
 * lab.phase      backward_dv: key tiles
 * lab.supports   noncausal, cross, gqa
 * lab.deterministic 1
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

// The kernels are __launch_bounds__(THREADS, 1): without the 1, ptxas held some at 64 registers and spilled.
constexpr int THREADS = 128;

// The shared-memory tiles, carved in the order of lab.smem.
struct Tiles {
    float* Q;    // B_r x d_head: Q_i
    float* dO;   // B_r x d_head: dO_i
    float* K;    // B_c x (d_head + 1): K_j
    float* V;    // B_c x (d_head + 1): V_j
    float* S;    // B_r x (B_c + 1): P_ij or dS_ij
    float* lse;  // B_r: lse_i (+inf for rows past T_q)
    float* D;    // B_r: D_i
};

template <int d_head, int B_r, int B_c>
__device__ __forceinline__ Tiles carve(float* smem)
{
    Tiles t;
    t.Q = smem;
    t.dO = t.Q + B_r * d_head;
    t.K = t.dO + B_r * d_head;
    t.V = t.K + B_c * (d_head + 1);
    t.S = t.V + B_c * (d_head + 1);
    t.lse = t.S + B_r * (B_c + 1);
    t.D = t.lse + B_r;
    return t;
}

// x . y over d_head floats, summed compensated (Kahan): each product goes in by an fma that also takes back
// the error of the last add, and each add's error is kept for the next. A float32 chain rounds d_head times
// at the sum's magnitude, a few units of its last place in all; P = exp(scale s - lse) turns that error of
// scale s into P's relative error, against an lse that is the scores' log-sum-exp rounded once. dP and D
// take the same function, so that where O_i = V_j (a row that sees one key) D_i is dP_ij to the bit and
// dS_ij = P_ij (dP_ij - D_i) is exactly 0, as it is in exact arithmetic.
template <int d_head>
__device__ __forceinline__ float dot_compensated(const float* x, const float* y)
{
    float sum = 0.0f, comp = 0.0f;
    #pragma unroll 8
    for (int e = 0; e < d_head; ++e) {
        const float term = fmaf(x[e], y[e], -comp);
        const float t = sum + term;
        comp = (t - sum) - term;
        sum = t;
    }
    return sum;
}

// Q_i, dO_i, lse_i and D_i = rowsum(dO_i o O_i) of query rows row_start .. row_start + B_r - 1 of one
// head; rows past T_q are zeros with lse = +inf, so that their P is 0.
template <int d_head, int B_r>
__device__ void load_query_tile(const Tiles& t, const float* Q, const float* O, const float* dO, const float* lse,
                                int row_start, int T_q)
{
    for (int idx = threadIdx.x; idx < B_r * d_head; idx += THREADS) {
        const int r = idx / d_head, c = idx % d_head;
        const bool valid = row_start + r < T_q;
        t.Q[idx] = valid ? Q[(long long)(row_start + r) * d_head + c] : 0.0f;
        t.dO[idx] = valid ? dO[(long long)(row_start + r) * d_head + c] : 0.0f;
    }
    for (int r = threadIdx.x; r < B_r; r += THREADS) {
        const int row = row_start + r;
        t.D[r] = row < T_q ? dot_compensated<d_head>(dO + (long long)row * d_head, O + (long long)row * d_head) : 0.0f;
        t.lse[r] = row < T_q ? lse[row] : INFINITY;
    }
}

// K_j and V_j: keys col_start .. col_start + B_c - 1 of one K/V head, zeros past T_k.
template <int d_head, int B_c>
__device__ void load_key_tile(const Tiles& t, const float* K, const float* V, int col_start, int T_k)
{
    for (int idx = threadIdx.x; idx < B_c * d_head; idx += THREADS) {
        const int r = idx / d_head, c = idx % d_head;
        const bool valid = col_start + r < T_k;
        t.K[r * (d_head + 1) + c] = valid ? K[(long long)(col_start + r) * d_head + c] : 0.0f;
        t.V[r * (d_head + 1) + c] = valid ? V[(long long)(col_start + r) * d_head + c] : 0.0f;
    }
}

// The score tile: P_ij = exp(scale q_i . k_j - lse_i), or with_dS dS_ij = P_ij (dO_i . v_j - D_i); 0
// where the mask hides the key (query row i sees keys j <= i + offset, causal) or past T_q or T_k.
template <int d_head, int B_r, int B_c, bool with_dS>
__device__ void score_tile(const Tiles& t, int row_start, int col_start, int T_q, int T_k, int causal, float scale)
{
    const int offset = T_k - T_q;  // the causal mask aligned bottom-right
    for (int idx = threadIdx.x; idx < B_r * B_c; idx += THREADS) {
        const int r = idx / B_c, c = idx % B_c;
        const int row = row_start + r, key = col_start + c;
        float value = 0.0f;
        if (row < T_q && key < T_k && (!causal || key <= row + offset)) {
            const float s = dot_compensated<d_head>(&t.Q[r * d_head], &t.K[c * (d_head + 1)]);
            value = expf(fmaf(s, scale, -t.lse[r]));  // P_ij, its exponent rounded once
            if (with_dS) {
                const float dP = dot_compensated<d_head>(&t.dO[r * d_head], &t.V[c * (d_head + 1)]);
                value *= dP - t.D[r];  // dS_ij
            }
        }
        t.S[r * (B_c + 1) + c] = value;
    }
}

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(THREADS, 1)
backward_dq(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
            const float* __restrict__ O, const float* __restrict__ dO, const float* __restrict__ lse,
            float* __restrict__ dQ, float* __restrict__ /* dK */, float* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ /* dQ_accum */, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    static_assert(B_r * d_head % THREADS == 0, "whole accumulator elements per thread");
    constexpr int PER_THREAD = B_r * d_head / THREADS;
    extern __shared__ float smem[];
    const Tiles t = carve<d_head, B_r, B_c>(smem);
    // Block (query tile, head, batch); query head h reads K/V head h / kv_group.
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // = batch * NH + head
    const long long kv_bh = (long long)blockIdx.z * (gridDim.y / kv_group) + blockIdx.y / kv_group;
    const long long q_head = bh * T_q * d_head, kv_head = kv_bh * T_k * d_head;
    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T_q - row_start);

    // Stop at the tile of the last key the block's last row sees (causal); none if it sees none.
    int T_c = (T_k + B_c - 1) / B_c;
    if (causal) {
        const int last_key = row_start + rows - 1 + T_k - T_q;
        T_c = last_key < 0 ? 0 : min(T_c, last_key / B_c + 1);
    }

    load_query_tile<d_head, B_r>(t, Q + q_head, O + q_head, dO + q_head, lse + bh * T_q, row_start, T_q);
    float dQ_acc[PER_THREAD];  // element threadIdx.x + n THREADS of dQ_i, row-major
    #pragma unroll
    for (int n = 0; n < PER_THREAD; ++n)
        dQ_acc[n] = 0.0f;
    for (int j = 0; j < T_c; ++j) {
        __syncthreads();  // every thread is done with the last tile (and Q_i, D_i are in place)
        load_key_tile<d_head, B_c>(t, K + kv_head, V + kv_head, j * B_c, T_k);
        __syncthreads();
        score_tile<d_head, B_r, B_c, true>(t, row_start, j * B_c, T_q, T_k, causal, scale);
        __syncthreads();
        // dQ_i += dS_ij K_j
        #pragma unroll
        for (int n = 0; n < PER_THREAD; ++n) {
            const int idx = threadIdx.x + n * THREADS, r = idx / d_head, c = idx % d_head;
            float sum = 0.0f;
            #pragma unroll 8
            for (int k = 0; k < B_c; ++k)
                sum += t.S[r * (B_c + 1) + k] * t.K[k * (d_head + 1) + c];
            dQ_acc[n] += sum;
        }
    }
    #pragma unroll
    for (int n = 0; n < PER_THREAD; ++n) {
        const int idx = threadIdx.x + n * THREADS, r = idx / d_head, c = idx % d_head;
        if (r < rows)
            dQ[q_head + (long long)(row_start + r) * d_head + c] = dQ_acc[n] * scale;
    }
}

// backward_dk and backward_dv: dK_j = scale sum_i dS_ij^T Q_i, or dV_j = sum_i P_ij^T dO_i, over the
// query heads of the K/V head's group and the query tiles that see a key of K_j.
template <int d_head, int B_r, int B_c, bool is_dk>
__device__ void key_gradient(const float* Q, const float* K, const float* V, const float* O, const float* dO,
                             const float* lse, float* dX, int T_q, int T_k, int kv_group, int causal, float scale)
{
    static_assert(B_c * d_head % THREADS == 0, "whole accumulator elements per thread");
    constexpr int PER_THREAD = B_c * d_head / THREADS;
    extern __shared__ float smem[];
    const Tiles t = carve<d_head, B_r, B_c>(smem);
    const int col_start = blockIdx.x * B_c;
    // The first query row that sees key col_start (causal: row + T_k - T_q >= col_start), its tile.
    const int first_row = causal ? max(0, col_start - (T_k - T_q)) : 0;
    const int T_r = (T_q + B_r - 1) / B_r;

    // Block (key tile, K/V head, batch); it serves query heads kv_head * kv_group .. + kv_group - 1.
    const long long kv_bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // = batch * NH_kv + K/V head
    const long long kv_head = kv_bh * T_k * d_head;
    load_key_tile<d_head, B_c>(t, K + kv_head, V + kv_head, col_start, T_k);
    float acc[PER_THREAD];  // element threadIdx.x + n THREADS of dK_j or dV_j, row-major
    #pragma unroll
    for (int n = 0; n < PER_THREAD; ++n)
        acc[n] = 0.0f;
    for (int h = 0; h < kv_group; ++h) {
        const long long bh = kv_bh * kv_group + h;  // = batch * NH + query head
        const long long q_head = bh * T_q * d_head;
        for (int i = first_row / B_r; i < T_r; ++i) {
            __syncthreads();  // every thread is done with the last tile (and K_j, V_j are in place)
            load_query_tile<d_head, B_r>(t, Q + q_head, O + q_head, dO + q_head, lse + bh * T_q, i * B_r, T_q);
            __syncthreads();
            score_tile<d_head, B_r, B_c, is_dk>(t, i * B_r, col_start, T_q, T_k, causal, scale);
            __syncthreads();
            // dK_j += dS_ij^T Q_i, or dV_j += P_ij^T dO_i
            const float* X = is_dk ? t.Q : t.dO;
            #pragma unroll
            for (int n = 0; n < PER_THREAD; ++n) {
                const int idx = threadIdx.x + n * THREADS, c = idx / d_head, e = idx % d_head;
                float sum = 0.0f;
                #pragma unroll 8
                for (int r = 0; r < B_r; ++r)
                    sum += t.S[r * (B_c + 1) + c] * X[r * d_head + e];
                acc[n] += sum;
            }
        }
    }
    #pragma unroll
    for (int n = 0; n < PER_THREAD; ++n) {
        const int idx = threadIdx.x + n * THREADS, c = idx / d_head, e = idx % d_head;
        if (col_start + c < T_k)
            dX[kv_head + (long long)(col_start + c) * d_head + e] = is_dk ? acc[n] * scale : acc[n];
    }
}

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(THREADS, 1)
backward_dk(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
            const float* __restrict__ O, const float* __restrict__ dO, const float* __restrict__ lse,
            float* __restrict__ /* dQ */, float* __restrict__ dK, float* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ /* dQ_accum */, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    key_gradient<d_head, B_r, B_c, true>(Q, K, V, O, dO, lse, dK, T_q, T_k, kv_group, causal, scale);
}

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(THREADS, 1)
backward_dv(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
            const float* __restrict__ O, const float* __restrict__ dO, const float* __restrict__ lse,
            float* __restrict__ /* dQ */, float* __restrict__ /* dK */, float* __restrict__ dV,
            float* __restrict__ /* D */, float* __restrict__ /* dQ_accum */, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    key_gradient<d_head, B_r, B_c, false>(Q, K, V, O, dO, lse, dV, T_q, T_k, kv_group, causal, scale);
}
