/*
 * v07 - float4 loads and stores.
 *
 * The change: Q_i, K_j and V_j move from global to shared memory four floats at a time, and the
 * Q_i K_j^T dot products and the reads of S_ij in P~_ij V_j use 128-bit shared-memory loads. K_j's
 * pad grows from one float to four so that its rows stay 16-byte aligned.
 *
 * Why it helps: one 128-bit load or store instruction moves what took four, so the loads, the
 * address arithmetic and the issue slots they occupy drop by up to four times; a warp's 128-bit
 * global load of consecutive floats is still perfectly coalesced. Reading K_j as float4, lanes x to
 * x + 7 are served together; a pitch of d_head + 4 floats starts consecutive rows four banks apart,
 * so those eight 16-byte reads cover the 32 banks exactly once: still conflict-free.
 *
 * Geometry: as v03. grid (ceil(T / B_r), n_heads, batch); block (B_c, B_r) = (32, 32) threads.
 * Shared memory, in floats: Q_i (B_r x d) + K_j (B_c x (d + 4)) + V_j (B_c x d) + S_ij (B_r x B_c)
 *   B_r = B_c = 32, d = 64: 4 * (32 * 64 + 32 * 68 + 32 * 64 + 32 * 32) = 29,184 bytes;
 *   d = 128: 53,760 bytes, past the 48 KiB default (the launcher opts in).
 *
 * Limits: causal only; contiguous (B, NH, T, d) inputs (the launcher copies strided ones);
 * B_c = 32, one warp per row; B_r <= 32; d_head a multiple of 4 and 16-byte aligned rows.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (32, 32, 32), (128, 32, 32)
 * lab.threads    B_c, B_r
 * lab.smem       4 * (B_r * d_head + B_c * (d_head + 4) + B_c * d_head + B_r * B_c)
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
    static_assert(d_head % 4 == 0, "rows are moved as float4");
    constexpr unsigned FULL_WARP = 0xffffffffu;
    constexpr int K_pitch = d_head + 4;
    constexpr int d4 = d_head / 4;        // float4s per row
    extern __shared__ __align__(16) float smem[];
    float* Q_i = smem;                    // B_r x d_head
    float* K_j = Q_i + B_r * d_head;      // B_c x (d_head + 4): the pad shifts each row four banks
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
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int n_threads = blockDim.x * blockDim.y;

    // Load Q_i and start every row at O_i = 0, one float4 per thread and step, row after row.
    for (int i = tid; i < rows * d4; i += n_threads) {
        const int r = i / d4, c = 4 * (i % d4);
        const long long at = (long long)(row_start + r) * d_head + c;
        *(float4*)&Q_i[r * d_head + c] = *(const float4*)&Q_head[at];
        *(float4*)&O_head[at] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
            for (int c = 0; c < d_head; c += 4) {
                const float4 q = *(const float4*)&Q_i[r * d_head + c];
                const float4 k = *(const float4*)&K_j[threadIdx.x * K_pitch + c];
                dot += q.x * k.x;  // chained: each product is one fused multiply-add
                dot += q.y * k.y;
                dot += q.z * k.z;
                dot += q.w * k.w;
            }
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
                int x = 0;
                for (; x + 4 <= n_cols; x += 4) {  // four scores per 128-bit load
                    const float4 s4 = *(const float4*)&S_ij[r * B_c + x];
                    pv += expf(s4.x - m_new) * V_j[(x + 0) * d_head + c];
                    pv += expf(s4.y - m_new) * V_j[(x + 1) * d_head + c];
                    pv += expf(s4.z - m_new) * V_j[(x + 2) * d_head + c];
                    pv += expf(s4.w - m_new) * V_j[(x + 3) * d_head + c];
                }
                for (; x < n_cols; ++x)  // the last n_cols % 4 scores
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
