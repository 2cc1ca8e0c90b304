/*
 * v06 - divide by the softmax denominator once per update, and declare the pointers __restrict__.
 *
 * The change: P_ij V_j is accumulated with the unnormalised P~_ij = exp(S_ij - m_new) and the sum
 * is divided by l_new once per output element, as in Algorithm 1 of the paper, instead of once per
 * term; and Q, K, V, O and the workspace are declared __restrict__. (The seed's third change of
 * this step, making d_head, B_r and B_c template parameters so that loops have fixed trip counts
 * the compiler can unroll, is already in place: every rung has been a template since v01.)
 *
 * Why it helps: the inner loop of P_ij V_j divided every term by l_new (under fast math, a multiply
 * by its reciprocal) before the multiply-add; it is now exp and one fused multiply-add, with one
 * division per output element and tile. __restrict__
 * promises the compiler that O never aliases Q, K or V, so the loads of Q, K and V may use the
 * read-only data path (LDG.E.CONSTANT) and need not be reissued after each store to O.
 *
 * Geometry: as v03. grid (ceil(T / B_r), n_heads, batch); block (B_c, B_r) = (32, 32) threads.
 * Shared memory, in floats: Q_i (B_r x d) + K_j (B_c x (d + 1)) + V_j (B_c x d) + S_ij (B_r x B_c)
 *   B_r = B_c = 32, d = 64: 4 * (32 * 64 + 32 * 65 + 32 * 64 + 32 * 32) = 28,800 bytes;
 *   d = 128: 53,376 bytes, past the 48 KiB default (the launcher opts in).
 *
 * Limits: causal only; contiguous (B, NH, T, d) inputs (the launcher copies strided ones);
 * B_c = 32, one warp per row; B_r <= 32.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (32, 32, 32), (128, 32, 32)
 * lab.threads    B_c, B_r
 * lab.smem       4 * (B_r * d_head + B_c * (d_head + 1) + B_c * d_head + B_r * B_c)
 * lab.options    --use_fast_math
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

template <int d_head, int B_r, int B_c>
__global__ void attention_forward(const float* __restrict__ Q, const float* __restrict__ K,
                                  const float* __restrict__ V, float* __restrict__ O,
                                  float* __restrict__ workspace, int T, int /* T_k */, int /* kv_group */, int /* causal */, float scale,
                                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
    static_assert(B_c == 32, "one warp per row of S_ij: the shuffles reduce across exactly 32 lanes");
    constexpr unsigned FULL_WARP = 0xffffffffu;
    constexpr int K_pitch = d_head + 1;
    extern __shared__ float smem[];
    float* Q_i = smem;                    // B_r x d_head
    float* K_j = Q_i + B_r * d_head;      // B_c x (d_head + 1): the pad column shifts each row one bank
    float* V_j = K_j + B_c * K_pitch;     // B_c x d_head
    float* S_ij = V_j + B_c * d_head;     // B_r x B_c

    // Contiguous (B, NH, T, d): head h of batch b starts at ((b * NH) + h) * T * d.
    const long long head = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const float* Q_head = Q + head * T * d_head;
    const float* K_head = K + head * T * d_head;
    const float* V_head = V + head * T * d_head;
    float* O_head = O + head * T * d_head;

    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T - row_start);

    // Load Q_i and start every row at O_i = 0.
    for (int r = threadIdx.y; r < rows; r += blockDim.y) {
        for (int c = threadIdx.x; c < d_head; c += blockDim.x) {
            Q_i[r * d_head + c] = Q_head[(long long)(row_start + r) * d_head + c];
            O_head[(long long)(row_start + r) * d_head + c] = 0.0f;
        }
    }
    // Running statistics of this warp's row, the same value in every lane.
    float m_i = -INFINITY;
    float l_i = 0.0f;

    // Causal: no row of this tile sees a key past its last row, so stop at that key's tile.
    const int T_c = (row_start + rows - 1) / B_c + 1;
    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        const int cols = min(B_c, T - col_start);

        __syncthreads();  // every thread is done with the previous K_j, V_j and S_ij
        for (int r = threadIdx.y; r < cols; r += blockDim.y) {
            for (int c = threadIdx.x; c < d_head; c += blockDim.x) {
                K_j[r * K_pitch + c] = K_head[(long long)(col_start + r) * d_head + c];
                V_j[r * d_head + c] = V_head[(long long)(col_start + r) * d_head + c];
            }
        }
        __syncthreads();

        // This thread's element of S_ij: row r of the tile, column threadIdx.x.
        const int r = threadIdx.y;
        const int row = row_start + r;
        // Columns of this tile that row may see: keys col_start .. row.
        const int n_cols = (r < rows) ? min(cols, row - col_start + 1) : 0;
        const bool active = n_cols > 0;  // the same in every lane of the warp

        // S_ij = scale * Q_i K_j^T, one element per thread; -inf where masked
        float s = -INFINITY;
        if (threadIdx.x < n_cols) {
            float dot = 0.0f;
            for (int c = 0; c < d_head; ++c)
                dot += Q_i[r * d_head + c] * K_j[threadIdx.x * K_pitch + c];
            s = scale * dot;
            S_ij[r * B_c + threadIdx.x] = s;
        }

        // m_ij = rowmax(S_ij): after the butterfly every lane holds the maximum of all 32
        float m_ij = s;
        for (int offset = 16; offset > 0; offset /= 2)
            m_ij = fmaxf(m_ij, __shfl_xor_sync(FULL_WARP, m_ij, offset));
        // l_ij = rowsum(exp(S_ij - m_ij)), reduced the same way
        float l_ij = (threadIdx.x < n_cols) ? expf(s - m_ij) : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2)
            l_ij += __shfl_xor_sync(FULL_WARP, l_ij, offset);
        __syncwarp();  // row r of S_ij is written; only this warp reads it

        if (active) {
            // m_new = max(m_i, m_ij); l_new = exp(m_i - m_new) l_i + exp(m_ij - m_new) l_ij
            const float m_new = fmaxf(m_i, m_ij);
            const float l_new = expf(m_i - m_new) * l_i + expf(m_ij - m_new) * l_ij;
            for (int c = threadIdx.x; c < d_head; c += blockDim.x) {
                // P~_ij V_j, with P~_ij = exp(S_ij - m_new) not yet divided by l_new
                float pv = 0.0f;
                for (int x = 0; x < n_cols; ++x)
                    pv += expf(S_ij[r * B_c + x] - m_new) * V_j[x * d_head + c];
                // O_i = (l_i exp(m_i - m_new) O_i + P~_ij V_j) / l_new: one division per element
                float* o = &O_head[(long long)row * d_head + c];
                *o = (*o * expf(m_i - m_new) * l_i + pv) / l_new;
            }
            m_i = m_new;
            l_i = l_new;
        }
    }
}
