/*
 * v09 - register tiling over columns: each thread computes two columns of S_ij and of O_i.
 *
 * The change: the block shrinks to (B_c / 2, B_r) = (16, 32) threads. Thread x computes S_ij[r][x]
 * and S_ij[r][x + 16], and then O_i[r][c] and O_i[r][c + 1] for c = 2x, 2x + 32, ...; a row is
 * now owned by half a warp, so the statistics butterfly takes four steps instead of five.
 *
 * Why it helps: a value loaded into a register can feed more than one multiply-add. Each float4 of
 * Q_i now serves two dot products, and each exp(S_ij - m_new) computed in P~_ij V_j serves two
 * output columns (read as one float2 of V_j), so shared-memory loads and exponentials per
 * multiply-add halve. Arithmetic intensity per thread goes up; this is the first step toward a
 * kernel limited by arithmetic rather than by loads.
 *
 * Geometry: grid (ceil(T / B_r), n_heads, batch); block (B_c / 2, B_r) = (16, 32) threads; warp w
 * holds rows 2w (lanes 0-15) and 2w + 1 (lanes 16-31). The S_ij columns of a thread are 16 apart so
 * that the 16 lanes of a row read 16 consecutive rows of K_j: with the pitch of d_head + 4 floats
 * that is two conflict-free 128-bit wavefronts.
 * Shared memory, in floats:
 *   Q_i (B_r x d) + K_j (B_c x (d + 4)) + V_j (B_c x d) + S_ij (B_r x B_c) + O_i (B_r x d)
 *   B_r = B_c = 32, d = 64: 4 * (32 * 64 + 32 * 68 + 32 * 64 + 32 * 32 + 32 * 64) = 37,376 bytes;
 *   d = 128: 70,144 bytes, past the 48 KiB default (the launcher opts in).
 *
 * Limits: causal only; contiguous (B, NH, T, d) inputs (the launcher copies strided ones);
 * B_c = 32, half a warp per row; B_r <= 64; d_head a multiple of 4 and 16-byte aligned rows. The two
 * rows of a warp read Q_i and S_ij at the same bank (the pitches are multiples of 32 floats): a
 * two-way conflict on those broadcasts, which v12 removes.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (32, 32, 32), (128, 32, 32)
 * lab.threads    B_c // 2, B_r
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
    constexpr int cols_per_thread = 2;     // the register tile: 1 row x 2 columns per thread
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
    // Running statistics of this warp's row, the same value in every lane.
    float m_i = -INFINITY;
    float l_i = 0.0f;

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

        // This thread's elements of S_ij: row r of the tile, columns x and x + 16.
        const int r = threadIdx.y;
        const int row = row_start + r;
        // Columns of this tile that row may see: keys col_start .. row.
        const int n_cols = (r < rows) ? min(cols, row - col_start + 1) : 0;
        const bool active = n_cols > 0;  // the same in all 16 lanes of the row

        // S_ij = scale * Q_i K_j^T for both columns; -inf where masked
        float s[cols_per_thread];
        float dot[cols_per_thread] = {0.0f, 0.0f};
        if (active) {
            for (int c = 0; c < d_head; c += 4) {
                const float4 q = *(const float4*)&Q_i[r * d_head + c];  // loaded once, used twice
                for (int t = 0; t < cols_per_thread; ++t) {
                    const float4 k = *(const float4*)&K_j[(threadIdx.x + t * row_threads) * K_pitch + c];
                    dot[t] += q.x * k.x;  // one fused multiply-add each
                    dot[t] += q.y * k.y;
                    dot[t] += q.z * k.z;
                    dot[t] += q.w * k.w;
                }
            }
        }
        for (int t = 0; t < cols_per_thread; ++t) {
            const int x = threadIdx.x + t * row_threads;
            s[t] = (x < n_cols) ? scale * dot[t] : -INFINITY;
            if (x < n_cols)
                S_ij[r * B_c + x] = s[t];
        }

        // m_ij = rowmax(S_ij): a butterfly over the 16 lanes of the row (offsets below 16 stay in it)
        float m_ij = fmaxf(s[0], s[1]);
        for (int offset = row_threads / 2; offset > 0; offset /= 2)
            m_ij = fmaxf(m_ij, __shfl_xor_sync(FULL_WARP, m_ij, offset));
        // l_ij = rowsum(exp(S_ij - m_ij)), reduced the same way
        float l_ij = 0.0f;
        for (int t = 0; t < cols_per_thread; ++t)
            if (threadIdx.x + t * row_threads < n_cols)
                l_ij += expf(s[t] - m_ij);
        for (int offset = row_threads / 2; offset > 0; offset /= 2)
            l_ij += __shfl_xor_sync(FULL_WARP, l_ij, offset);
        __syncwarp();  // row r of S_ij is written; only this warp reads it

        if (active) {
            // m_new = max(m_i, m_ij); l_new = exp(m_i - m_new) l_i + exp(m_ij - m_new) l_ij
            const float m_new = fmaxf(m_i, m_ij);
            const float l_new = expf(m_i - m_new) * l_i + expf(m_ij - m_new) * l_ij;
            for (int c = cols_per_thread * threadIdx.x; c < d_head; c += B_c) {
                // P~_ij V_j for columns c and c + 1: each exponential feeds two multiply-adds
                float pv0 = 0.0f, pv1 = 0.0f;
                int x = 0;
                for (; x + 4 <= n_cols; x += 4) {  // four scores per 128-bit load
                    const float4 s4 = *(const float4*)&S_ij[r * B_c + x];
                    const float p[4] = {expf(s4.x - m_new), expf(s4.y - m_new), expf(s4.z - m_new), expf(s4.w - m_new)};
                    for (int e = 0; e < 4; ++e) {
                        const float2 v = *(const float2*)&V_j[(x + e) * d_head + c];
                        pv0 += p[e] * v.x;
                        pv1 += p[e] * v.y;
                    }
                }
                for (; x < n_cols; ++x) {  // the last n_cols % 4 scores
                    const float p = expf(S_ij[r * B_c + x] - m_new);
                    const float2 v = *(const float2*)&V_j[x * d_head + c];
                    pv0 += p * v.x;
                    pv1 += p * v.y;
                }
                // O_i = (l_i exp(m_i - m_new) O_i + P~_ij V_j) / l_new, in shared memory
                float2* o = (float2*)&O_i[r * d_head + c];
                const float rescale = expf(m_i - m_new) * l_i;
                *o = make_float2((o->x * rescale + pv0) / l_new, (o->y * rescale + pv1) / l_new);
            }
            m_i = m_new;
            l_i = l_new;
        }
    }

    __syncthreads();  // O_i is final; the store below reads elements that other threads wrote
    for (int i = tid; i < rows * d4; i += n_threads) {
        const int r = i / d4, c = 4 * (i % d4);
        *(float4*)&O_head[(long long)(row_start + r) * d_head + c] = *(const float4*)&O_i[r * d_head + c];
    }
}
