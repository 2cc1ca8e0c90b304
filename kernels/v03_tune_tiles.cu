/*
 * v03 - tune the tile and the thread block together: one thread per element of S_ij.
 *
 * The change: B_r = B_c = 32 and a block of (B_c, B_r) = (32, 32) threads, so thread (x, y) owns
 * S_ij[y][x] and warp y owns row y of the tile; the loop that walked the rows 16 at a time is gone.
 *
 * Why it helps: in v02 the 16 rows of threads walked a 64-row tile in four steps of two barriers
 * each, and the lone statistics thread of each row scanned 64 scores while its 31 warp-mates idled.
 * Now each tile is a single step of all 1024 threads, four barriers instead of ten, and the serial
 * scan is 32 long.
 * Smaller tiles also waste less work on the diagonal, where half of each tile is masked, and give
 * T / 32 blocks per head to spread over the SMs instead of T / 64.
 *
 * Geometry: grid (ceil(T / B_r), n_heads, batch); block (B_c, B_r) = (32, 32) threads.
 * Shared memory, in floats: Q_i (B_r x d) + K_j (B_c x (d + 1)) + V_j (B_c x d) + S_ij (B_r x B_c)
 *   B_r = B_c = 32, d = 64: 4 * (32 * 64 + 32 * 65 + 32 * 64 + 32 * 32) = 28,800 bytes;
 *   d = 128: 53,376 bytes, past the 48 KiB default (the launcher opts in).
 *
 * Limits: causal only; contiguous (B, NH, T, d) inputs (the launcher copies strided ones);
 * B_r * B_c <= 1024 threads per block.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (32, 32, 32), (128, 32, 32)
 * lab.threads    B_c, B_r
 * lab.smem       4 * (B_r * d_head + B_c * (d_head + 1) + B_c * d_head + B_r * B_c)
 * lab.workspace  2
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

template <int d_head, int B_r, int B_c>
__global__ void attention_forward(const float* Q, const float* K, const float* V, float* O,
                                  float* workspace, int T, int /* T_k */, int /* kv_group */, int /* causal */, float scale,
                                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
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
    float* m = workspace + head * 2 * T;  // running row max m_i, one per query row
    float* l = m + T;                     // running row sum l_i

    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T - row_start);

    // Load Q_i and start every row at O_i = 0, l_i = 0, m_i = -inf.
    for (int r = threadIdx.y; r < rows; r += blockDim.y) {
        for (int c = threadIdx.x; c < d_head; c += blockDim.x) {
            Q_i[r * d_head + c] = Q_head[(long long)(row_start + r) * d_head + c];
            O_head[(long long)(row_start + r) * d_head + c] = 0.0f;
        }
        if (threadIdx.x == 0) {
            m[row_start + r] = -INFINITY;
            l[row_start + r] = 0.0f;
        }
    }

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
        const bool active = n_cols > 0;

        // S_ij = scale * Q_i K_j^T, one element per thread
        if (active && threadIdx.x < n_cols) {
            float s = 0.0f;
            for (int c = 0; c < d_head; ++c)
                s += Q_i[r * d_head + c] * K_j[threadIdx.x * K_pitch + c];
            S_ij[r * B_c + threadIdx.x] = scale * s;
        }
        float m_old = 0.0f, l_old = 0.0f;
        if (active) {
            m_old = m[row];
            l_old = l[row];
        }
        __syncthreads();  // S_ij row complete, and every thread has read m_i, l_i before they change

        if (active && threadIdx.x == 0) {
            // m_ij = rowmax(S_ij); l_ij = rowsum(exp(S_ij - m_ij))
            float m_ij = -INFINITY;
            for (int x = 0; x < n_cols; ++x)
                m_ij = fmaxf(m_ij, S_ij[r * B_c + x]);
            float l_ij = 0.0f;
            for (int x = 0; x < n_cols; ++x)
                l_ij += expf(S_ij[r * B_c + x] - m_ij);
            // m_new = max(m_i, m_ij); l_new = exp(m_i - m_new) l_i + exp(m_ij - m_new) l_ij
            const float m_new = fmaxf(m_old, m_ij);
            m[row] = m_new;
            l[row] = expf(m_old - m_new) * l_old + expf(m_ij - m_new) * l_ij;
        }
        __syncthreads();  // the new statistics are in global memory for every thread to read

        if (active) {
            const float m_new = m[row];
            const float l_new = l[row];
            for (int c = threadIdx.x; c < d_head; c += blockDim.x) {
                // P_ij V_j, with P_ij = exp(S_ij - m_new) / l_new
                float pv = 0.0f;
                for (int x = 0; x < n_cols; ++x)
                    pv += expf(S_ij[r * B_c + x] - m_new) / l_new * V_j[x * d_head + c];
                // O_i = (l_i exp(m_i - m_new) / l_new) O_i + P_ij V_j
                float* o = &O_head[(long long)row * d_head + c];
                *o = *o * expf(m_old - m_new) * (l_old / l_new) + pv;
            }
        }
    }
}
