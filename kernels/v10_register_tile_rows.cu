/*
 * v10 - register tiling over rows too: each thread computes a 2 x 2 tile of S_ij and of O_i.
 *
 * The change: thread (x, y) now owns rows 2y and 2y + 1 of the tile as well as columns x and x + 16,
 * so B_r doubles to 64 with the block unchanged at (16, 32) threads. Masked scores are stored as
 * -inf, so that P~_ij V_j can run both rows over the longer of their two causal ranges.
 *
 * Why it helps: each float4 of K_j loaded from shared memory now also serves two dot products, as
 * Q_i's already did, so the S_ij loop does four multiply-adds per pair of loads instead of two. In
 * P~_ij V_j each float2 of V_j serves both rows, each exponential both columns: again twice the
 * work per load. A taller tile also halves how often K_j and V_j are loaded per query row.
 *
 * Geometry: grid (ceil(T / B_r), n_heads, batch); block (B_c / 2, B_r / 2) = (16, 32) threads;
 * warp w holds rows 4w .. 4w + 3, two per half-warp.
 * Shared memory, in floats:
 *   Q_i (B_r x d) + K_j (B_c x (d + 4)) + V_j (B_c x d) + S_ij (B_r x B_c) + O_i (B_r x d)
 *   B_r = 64, B_c = 32, d = 64: 4 * (64 * 64 + 32 * 68 + 32 * 64 + 64 * 32 + 64 * 64) = 57,856 bytes;
 *   d = 128: 107,008 bytes. Both are past the 48 KiB default (the launcher opts in); the seed's
 *   64 KiB Turing part could not also hold B_c = 64, which fits easily here.
 *
 * Limits: causal only; contiguous (B, NH, T, d) inputs (the launcher copies strided ones);
 * B_c = 32, half a warp per row pair; B_r <= 128; d_head a multiple of 4 and 16-byte aligned
 * rows. The two halves of a warp read Q_i and S_ij at the same bank: a two-way conflict on those
 * broadcasts, which v12 removes.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 64, 32), (32, 64, 32), (128, 64, 32)
 * lab.threads    B_c // 2, B_r // 2
 * lab.smem       4 * (B_r * d_head + B_c * (d_head + 4) + B_c * d_head + B_r * B_c + B_r * d_head)
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
    constexpr int rows_per_thread = 2;     // the register tile: 2 rows x 2 columns per thread
    constexpr int cols_per_thread = 2;
    constexpr int row_threads = B_c / cols_per_thread;  // 16 lanes, half a warp, share a row
    static_assert(B_c == 32, "half a warp per row of S_ij: the shuffles reduce across 16 lanes");
    static_assert(d_head % (2 * row_threads) == 0, "every thread takes whole column pairs of O_i");
    constexpr unsigned FULL_WARP = 0xffffffffu;
    constexpr int K_pitch = d_head + 4;
    constexpr int d4 = d_head / 4;        // float4s per row
    extern __shared__ __align__(16) float smem[];
    float* Q_i = smem;                    // B_r x d_head
    float* K_j = Q_i + B_r * d_head;      // B_c x (d_head + 4): the pad shifts each row four banks
    float* V_j = K_j + B_c * K_pitch;     // B_c x d_head
    float* S_ij = V_j + B_c * d_head;     // B_r x B_c
    float* O_i = S_ij + B_r * B_c;        // B_r x d_head

    // Contiguous (B, NH, T, d): head h of batch b starts at ((b * NH) + h) * T * d.
    const long long head = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const float* Q_head = Q + head * T * d_head;
    const float* K_head = K + head * T * d_head;
    const float* V_head = V + head * T * d_head;
    float* O_head = O + head * T * d_head;

    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T - row_start);
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int n_threads = blockDim.x * blockDim.y;

    // Load Q_i and start every row at O_i = 0, one float4 per thread and step, row after row.
    for (int i = tid; i < rows * d4; i += n_threads) {
        const int r = i / d4, c = 4 * (i % d4);
        *(float4*)&Q_i[r * d_head + c] = *(const float4*)&Q_head[(long long)(row_start + r) * d_head + c];
        *(float4*)&O_i[r * d_head + c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // Running statistics of this thread's two rows, the same values in the 16 lanes of the rows.
    float m_i[rows_per_thread] = {-INFINITY, -INFINITY};
    float l_i[rows_per_thread] = {0.0f, 0.0f};

    // Causal: no row of this tile sees a key past its last row, so stop at that key's tile.
    const int T_c = (row_start + rows - 1) / B_c + 1;
    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        const int cols = min(B_c, T - col_start);

        __syncthreads();  // every thread is done with the previous K_j, V_j and S_ij
        for (int i = tid; i < cols * d4; i += n_threads) {
            const int r = i / d4, c = 4 * (i % d4);
            const long long at = (long long)(col_start + r) * d_head + c;
            *(float4*)&K_j[r * K_pitch + c] = *(const float4*)&K_head[at];
            *(float4*)&V_j[r * d_head + c] = *(const float4*)&V_head[at];
        }
        __syncthreads();

        // This thread's elements of S_ij: rows 2y and 2y + 1 of the tile, columns x and x + 16.
        int r[rows_per_thread], n_cols[rows_per_thread];
        for (int t = 0; t < rows_per_thread; ++t) {
            r[t] = rows_per_thread * threadIdx.y + t;
            // Columns of this tile that row may see: keys col_start .. row.
            n_cols[t] = (r[t] < rows) ? min(cols, row_start + r[t] - col_start + 1) : 0;
        }
        const int n_cols_max = max(n_cols[0], n_cols[1]);  // the same in all 16 lanes of the rows

        // S_ij = scale * Q_i K_j^T for the 2 x 2 tile; -inf where masked, stored so for P~_ij V_j
        float s[rows_per_thread][cols_per_thread];
        float dot[rows_per_thread][cols_per_thread] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
        if (n_cols_max > 0) {
            for (int c = 0; c < d_head; c += 4) {
                float4 q[rows_per_thread], k[cols_per_thread];  // each load feeds two dot products
                for (int t = 0; t < rows_per_thread; ++t)
                    q[t] = *(const float4*)&Q_i[r[t] * d_head + c];
                for (int u = 0; u < cols_per_thread; ++u)
                    k[u] = *(const float4*)&K_j[(threadIdx.x + u * row_threads) * K_pitch + c];
                for (int t = 0; t < rows_per_thread; ++t) {
                    for (int u = 0; u < cols_per_thread; ++u) {  // one fused multiply-add each
                        dot[t][u] += q[t].x * k[u].x;
                        dot[t][u] += q[t].y * k[u].y;
                        dot[t][u] += q[t].z * k[u].z;
                        dot[t][u] += q[t].w * k[u].w;
                    }
                }
            }
        }
        for (int t = 0; t < rows_per_thread; ++t) {
            for (int u = 0; u < cols_per_thread; ++u) {
                const int x = threadIdx.x + u * row_threads;
                s[t][u] = (x < n_cols[t]) ? scale * dot[t][u] : -INFINITY;
                S_ij[r[t] * B_c + x] = s[t][u];
            }
        }

        float m_new[rows_per_thread], l_new[rows_per_thread], m_use[rows_per_thread];
        for (int t = 0; t < rows_per_thread; ++t) {
            // m_ij = rowmax(S_ij): a butterfly over the 16 lanes of the row (offsets below 16 stay in it)
            float m_ij = fmaxf(s[t][0], s[t][1]);
            for (int offset = row_threads / 2; offset > 0; offset /= 2)
                m_ij = fmaxf(m_ij, __shfl_xor_sync(FULL_WARP, m_ij, offset));
            // l_ij = rowsum(exp(S_ij - m_ij)), reduced the same way
            float l_ij = 0.0f;
            for (int u = 0; u < cols_per_thread; ++u)
                if (threadIdx.x + u * row_threads < n_cols[t])
                    l_ij += expf(s[t][u] - m_ij);
            for (int offset = row_threads / 2; offset > 0; offset /= 2)
                l_ij += __shfl_xor_sync(FULL_WARP, l_ij, offset);
            // m_new = max(m_i, m_ij); a row that has seen no key yet subtracts 0 so exp(-inf) = 0
            m_new[t] = fmaxf(m_i[t], m_ij);
            m_use[t] = (m_new[t] == -INFINITY) ? 0.0f : m_new[t];
            // l_new = exp(m_i - m_new) l_i + exp(m_ij - m_new) l_ij
            l_new[t] = expf(m_i[t] - m_use[t]) * l_i[t] + expf(m_ij - m_use[t]) * l_ij;
        }
        __syncwarp();  // rows r of S_ij are written; only this warp reads them

        if (n_cols_max > 0) {
            for (int c = cols_per_thread * threadIdx.x; c < d_head; c += B_c) {
                // P~_ij V_j for two rows and columns c, c + 1: each float2 of V_j feeds both rows
                float pv[rows_per_thread][cols_per_thread] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
                int x = 0;
                for (; x + 4 <= n_cols_max; x += 4) {  // four scores per 128-bit load
                    float p[rows_per_thread][4];
                    for (int t = 0; t < rows_per_thread; ++t) {
                        const float4 s4 = *(const float4*)&S_ij[r[t] * B_c + x];
                        p[t][0] = expf(s4.x - m_use[t]);
                        p[t][1] = expf(s4.y - m_use[t]);
                        p[t][2] = expf(s4.z - m_use[t]);
                        p[t][3] = expf(s4.w - m_use[t]);
                    }
                    for (int e = 0; e < 4; ++e) {
                        const float2 v = *(const float2*)&V_j[(x + e) * d_head + c];
                        for (int t = 0; t < rows_per_thread; ++t) {
                            pv[t][0] += p[t][e] * v.x;
                            pv[t][1] += p[t][e] * v.y;
                        }
                    }
                }
                for (; x < n_cols_max; ++x) {  // the last n_cols_max % 4 scores
                    const float2 v = *(const float2*)&V_j[x * d_head + c];
                    for (int t = 0; t < rows_per_thread; ++t) {
                        const float p = expf(S_ij[r[t] * B_c + x] - m_use[t]);
                        pv[t][0] += p * v.x;
                        pv[t][1] += p * v.y;
                    }
                }
                for (int t = 0; t < rows_per_thread; ++t) {
                    if (n_cols[t] > 0) {  // a row with no key in this tile keeps its O_i
                        // O_i = (l_i exp(m_i - m_new) O_i + P~_ij V_j) / l_new, in shared memory
                        float2* o = (float2*)&O_i[r[t] * d_head + c];
                        const float rescale = expf(m_i[t] - m_use[t]) * l_i[t];
                        *o = make_float2((o->x * rescale + pv[t][0]) / l_new[t], (o->y * rescale + pv[t][1]) / l_new[t]);
                    }
                }
            }
        }
        for (int t = 0; t < rows_per_thread; ++t) {
            m_i[t] = m_new[t];
            l_i[t] = l_new[t];
        }
    }

    __syncthreads();  // O_i is final; the store below reads elements that other threads wrote
    for (int i = tid; i < rows * d4; i += n_threads) {
        const int r = i / d4, c = 4 * (i % d4);
        *(float4*)&O_head[(long long)(row_start + r) * d_head + c] = *(const float4*)&O_i[r * d_head + c];
    }
}
