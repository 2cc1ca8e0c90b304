/*
 * v12 - O_i in registers, K_j swizzled instead of padded, 64 x 64 tiles with a 4 x 4 register
 * tile per thread.
 *
 * The change: each thread owns a 4 x 4 tile of S_ij and the same 4 rows of O_i (d_head / 16
 * columns at B_c = 64), which stay in registers from the first K_j to the final store; shared
 * memory holds only Q_i, K_j, V_j and P~_ij. K_j is stored unpadded with its float4s XOR-swizzled.
 * The loop around the two products is trimmed so that it is almost all multiply-adds: only tiles
 * that cross the diagonal are masked; exp2 with log2(e) folded into the scale; each thread keeps
 * its own part of l_i and the row's parts are summed once, at the end; all loads of a tile are
 * issued before the first store; the query tile with the most keys starts first.
 *
 * Why it helps: with a 4 x 4 tile, four float4 loads of Q_i and four of K_j feed 64 multiply-adds
 * (P~_ij and V_j likewise feed O_i): eight per 128-bit load, twice v11's, and O_i no longer passes
 * through shared memory on every tile. What is left is issuing FFMAs, which make up nearly all of
 * the inner loops; the kernel is limited by the FMA pipe and by how well its warps hide latency.
 *   Bank conflicts. A thread's four columns of S_ij are consecutive keys, so the 16 lanes of a row
 * read rows 0, 4, 8, ..., 60 of K_j at the same float4 k4. With a pitch of 64 floats they all start
 * in one bank; a pad of 4 floats moves row x by 4x banks, so lanes tx and tx + 2 (keys 8 apart)
 * still meet, a four-way conflict in each 8-lane phase. Storing float4 k4 of key x at position
 * k4 ^ ((x / 4) % 8) gives the 8 lanes of a phase 8 different 16-byte bank groups: the minimum of
 * two wavefronts for 256 bytes. Q_i and P~_ij are read as broadcasts from the consecutive rows of
 * a warp's row groups (two at B_c = 64, four at B_c = 32), which a pad of 4 floats puts 4 banks
 * apart. V_j is read along its rows, conflict-free without a pad.
 *   Occupancy. At d = 64 a block is 8 warps and 66 KiB of shared memory (three would fit); its
 * registers are capped at 128 by __launch_bounds__ so that two blocks, 16 warps, share an SM: while
 * one block waits at a barrier or for K_j and V_j, the other computes. The 16 independent
 * accumulators of each thread's tile hide the latency of the FMA pipe and of shared memory.
 *
 * Geometry: grid (ceil(T / B_r), n_heads, batch), blockIdx.x read in reverse so that the tiles with
 * the most keys start first; block (B_c / 4, B_r / 4) threads, (16, 16) at B_r = B_c = 64. Thread
 * (tx, ty) owns rows ty + (B_r / 4) t, t = 0..3, and columns 4 tx .. 4 tx + 3 of S_ij; of O_i the
 * same rows and columns 4 tx + B_c g .. 4 tx + B_c g + 3 for g < d_head / B_c. The B_c / 4 lanes
 * of a row lie in one warp, so the row statistics need only shuffles.
 * Shared memory, in floats: Q_i (B_r x (d + 4)) + K_j (B_c x d) + V_j (B_c x d) + P~_ij (B_r x (B_c + 4))
 *   d = 64, B_r = B_c = 64: 4 * (64 * 68 + 2 * 64 * 64 + 64 * 68) = 67,584 bytes;
 *   d = 64, B_r = 64, B_c = 32: 4 * (64 * 68 + 2 * 32 * 64 + 64 * 36) = 43,008 bytes;
 *   d = 32, B_r = 64, B_c = 32: 26,624 bytes; d = 128, B_r = 32, B_c = 64: 91,136 bytes.
 * On an H200 the 64 x 32 tile (4 warps a block, three blocks and 12 warps an SM) ran faster than
 * the 64 x 64 tile at the benchmark shapes, so it comes first; the seed's 64 x 64 is the second.
 *
 * Limits: causal only; unit stride in the last dimension and rows 16-byte aligned (row strides a
 * multiple of 4 floats); d_head a multiple of 32 and of B_c; B_c / 4 a power of two up to 32.
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 64, 32), (64, 64, 64), (64, 32, 64), (32, 64, 32), (128, 32, 64)
 * lab.threads    B_c // 4, B_r // 4
 * lab.smem       4 * (B_r * (d_head + 4) + 2 * B_c * d_head + B_r * (B_c + 4))
 * lab.strided    true
 * lab.options    --use_fast_math
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

// Ask the register allocator for enough registers to keep a thread's slice of O_i without spills:
// with a 4 x 4 slice (d_head <= B_c) 512 resident threads per SM, at most 128 registers each;
// with a 4 x 8 slice (d = 64 at B_c = 32) 384 threads, at most 168 registers; d_head = 128 needs
// more still, and its shared memory allows only two blocks per SM anyway.
template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__((B_c / 4) * (B_r / 4),
                                  (d_head > 64 ? 256 : d_head <= B_c ? 512 : 384) / ((B_c / 4) * (B_r / 4)))
attention_forward(const float* __restrict__ Q, const float* __restrict__ K,
                  const float* __restrict__ V, float* __restrict__ O,
                  float* __restrict__ workspace, int T, int /* T_k */, int /* kv_group */, int /* causal */, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
    constexpr int rows_per_thread = 4;                    // the register tile: 4 rows x 4 columns
    constexpr int cols_per_thread = 4;
    constexpr int row_threads = B_c / cols_per_thread;    // lanes that share a row: blockDim.x
    constexpr int row_groups = B_r / rows_per_thread;     // blockDim.y
    constexpr int n_threads = row_threads * row_groups;
    constexpr int o_chunks = d_head / (4 * row_threads);  // float4s of O_i per row per thread
    constexpr int d4 = d_head / 4;                        // float4s per row of Q, K, V
    constexpr int Q_pitch = d_head + 4;                   // pad: rows ty and ty + 1 four banks apart
    constexpr int P_pitch = B_c + 4;
    static_assert(32 % row_threads == 0, "the lanes of a row lie within one warp");
    static_assert(d_head % (4 * row_threads) == 0, "each thread owns whole float4s of O_i");
    static_assert(d_head % 32 == 0, "the K_j swizzle permutes aligned groups of 8 float4s");
    constexpr int q_loads = B_r * d4 / n_threads;         // float4s of Q_i each thread loads
    constexpr int kv_loads = B_c * d4 / n_threads;        // float4s of K_j, and of V_j, each thread loads
    constexpr int kv_batch = (kv_loads < 4) ? kv_loads : 4;  // in flight at once: 32 registers at most
    static_assert(q_loads * n_threads == B_r * d4 && kv_loads % kv_batch == 0 && kv_loads * n_threads == B_c * d4,
                  "whole tiles per pass");
    constexpr unsigned FULL_WARP = 0xffffffffu;
    constexpr float log2e = 1.4426950408889634f;

    extern __shared__ __align__(16) float smem[];
    float* Q_i = smem;                    // B_r x (d_head + 4)
    float* K_j = Q_i + B_r * Q_pitch;     // B_c x d_head, float4 k4 of key x stored at k4 ^ ((x / 4) % 8)
    float* V_j = K_j + B_c * d_head;      // B_c x d_head
    float* P_ij = V_j + B_c * d_head;     // B_r x (B_c + 4): P~_ij = exp(S_ij - m_i), not yet divided by l_i

    // Q, K, V: head h of batch b starts at b * batch_stride + h * head_stride, rows row_stride apart.
    const float* Q_head = Q + blockIdx.z * q_batch_stride + blockIdx.y * q_head_stride;
    const float* K_head = K + blockIdx.z * kv_batch_stride + blockIdx.y * kv_head_stride;
    const float* V_head = V + blockIdx.z * kv_batch_stride + blockIdx.y * kv_head_stride;
    // O is contiguous (B, NH, T, d): head h of batch b starts at ((b * NH) + h) * T * d.
    const long long head = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    float* O_head = O + head * T * d_head;

    // The last query tile visits the most K_j, V_j tiles: start it first, leave light ones for the tail.
    const int row_start = (gridDim.x - 1 - blockIdx.x) * B_r;
    const int tx = threadIdx.x;           // S_ij columns 4 tx .. 4 tx + 3
    const int ty = threadIdx.y;           // rows ty + row_groups * t
    const int tid = ty * row_threads + tx;
    const float scale_log2 = scale * log2e;  // exp(x) = exp2(x log2(e)): fold log2(e) into the scale
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    // Load Q_i; rows past T are zero so that every score stays finite. Each load reads a valid row
    // (clamped to T - 1) and is replaced by zero afterwards, so no branch stands between the loads.
    {
        float4 q[q_loads];
        for (int n = 0; n < q_loads; ++n) {
            const int i = tid + n * n_threads, r = i / d4, c = 4 * (i % d4);
            q[n] = *(const float4*)&Q_head[min(row_start + r, T - 1) * q_row_stride + c];
        }
        for (int n = 0; n < q_loads; ++n) {
            const int i = tid + n * n_threads, r = i / d4, c = 4 * (i % d4);
            *(float4*)&Q_i[r * Q_pitch + c] = (row_start + r < T) ? q[n] : zero4;
        }
    }

    float O_reg[rows_per_thread][4 * o_chunks];  // O_i, unnormalised, for this thread's rows and columns
    float m_i[rows_per_thread], l_i[rows_per_thread];  // row max (log2 units), this thread's part of the row sum
    for (int t = 0; t < rows_per_thread; ++t) {
        m_i[t] = -INFINITY;
        l_i[t] = 0.0f;
        for (int c = 0; c < 4 * o_chunks; ++c)
            O_reg[t][c] = 0.0f;
    }

    // Causal: stop at the tile of the last key the tile's last row sees.
    const int T_c = (min(T, row_start + B_r) - 1) / B_c + 1;
    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;

        __syncthreads();  // every warp is done reading the previous K_j and V_j
        // Load K_j (swizzled) and V_j; keys past T are zero so that masked products stay finite.
        // A batch of loads is issued before its first store, so their latencies overlap.
        for (int batch = 0; batch < kv_loads; batch += kv_batch) {
            float4 k_ld[kv_batch], v_ld[kv_batch];
            for (int n = 0; n < kv_batch; ++n) {
                const int i = tid + (batch + n) * n_threads, x = i / d4, k4 = i % d4;
                const long long at = min(col_start + x, T - 1) * kv_row_stride + 4 * k4;
                k_ld[n] = *(const float4*)&K_head[at];
                v_ld[n] = *(const float4*)&V_head[at];
            }
            for (int n = 0; n < kv_batch; ++n) {
                const int i = tid + (batch + n) * n_threads, x = i / d4, k4 = i % d4;
                const bool in_range = col_start + x < T;
                *(float4*)&K_j[x * d_head + 4 * (k4 ^ ((x / 4) % 8))] = in_range ? k_ld[n] : zero4;
                *(float4*)&V_j[x * d_head + 4 * k4] = in_range ? v_ld[n] : zero4;
            }
        }
        __syncthreads();

        // S_ij = Q_i K_j^T for the 4 x 4 tile: each step, 8 float4 loads feed 64 multiply-adds
        float S[rows_per_thread][cols_per_thread];
        for (int t = 0; t < rows_per_thread; ++t)
            for (int u = 0; u < cols_per_thread; ++u)
                S[t][u] = 0.0f;
#pragma unroll
        for (int k4 = 0; k4 < d4; ++k4) {
            const int k_swizzled = 4 * (k4 ^ (tx % 8));  // keys 4 tx .. 4 tx + 3 share (x / 4) % 8 = tx % 8
            float4 q[rows_per_thread], k[cols_per_thread];
            for (int t = 0; t < rows_per_thread; ++t)
                q[t] = *(const float4*)&Q_i[(ty + row_groups * t) * Q_pitch + 4 * k4];
            for (int u = 0; u < cols_per_thread; ++u)
                k[u] = *(const float4*)&K_j[(cols_per_thread * tx + u) * d_head + k_swizzled];
            for (int t = 0; t < rows_per_thread; ++t) {
                for (int u = 0; u < cols_per_thread; ++u) {  // one chain of fused multiply-adds
                    S[t][u] += q[t].x * k[u].x;
                    S[t][u] += q[t].y * k[u].y;
                    S[t][u] += q[t].z * k[u].z;
                    S[t][u] += q[t].w * k[u].w;
                }
            }
        }

        // Only a tile that reaches past the block's first row needs the causal mask (key > row).
        const bool diagonal = col_start + B_c - 1 > row_start;
        for (int t = 0; t < rows_per_thread; ++t) {
            const int row = row_start + ty + row_groups * t;
            for (int u = 0; u < cols_per_thread; ++u) {
                const int key = col_start + cols_per_thread * tx + u;
                S[t][u] = (diagonal && key > row) ? -INFINITY : S[t][u] * scale_log2;
            }
        }

        for (int t = 0; t < rows_per_thread; ++t) {
            // m_new = max(m_i, rowmax(S_ij)): a butterfly over the row's lanes leaves it in each
            float m_new = fmaxf(fmaxf(S[t][0], S[t][1]), fmaxf(S[t][2], S[t][3]));
            for (int offset = row_threads / 2; offset > 0; offset /= 2)
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, offset));
            m_new = fmaxf(m_i[t], m_new);
            // A row that has seen no key yet subtracts 0, so that exp2(-inf - 0) = 0, not NaN.
            const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
            const float alpha = exp2f(m_i[t] - m_use);  // rescales what was summed under the old max
            m_i[t] = m_new;
            // P~_ij = exp(S_ij - m_new); l_i = alpha l_i + rowsum(P~_ij), over this thread's columns only
            float row_sum = 0.0f;
            for (int u = 0; u < cols_per_thread; ++u) {
                S[t][u] = exp2f(S[t][u] - m_use);
                row_sum += S[t][u];
            }
            l_i[t] = alpha * l_i[t] + row_sum;
            // O_i = alpha O_i, before P~_ij V_j is added
            for (int c = 0; c < 4 * o_chunks; ++c)
                O_reg[t][c] *= alpha;
            *(float4*)&P_ij[(ty + row_groups * t) * P_pitch + cols_per_thread * tx] =
                make_float4(S[t][0], S[t][1], S[t][2], S[t][3]);
        }
        __syncwarp();  // the row group's lanes, all in this warp, wrote its rows of P~_ij and alone read them

        // O_i += P~_ij V_j: per key, one float4 of V_j per chunk feeds 4 rows, one P~ value 4 columns
#pragma unroll
        for (int x4 = 0; x4 < B_c / 4; ++x4) {
            float p[rows_per_thread][4];  // P~_ij[row][4 x4 .. 4 x4 + 3] for the thread's rows
            for (int t = 0; t < rows_per_thread; ++t) {
                const float4 p4 = *(const float4*)&P_ij[(ty + row_groups * t) * P_pitch + 4 * x4];
                p[t][0] = p4.x;
                p[t][1] = p4.y;
                p[t][2] = p4.z;
                p[t][3] = p4.w;
            }
            for (int e = 0; e < 4; ++e) {
                const int x = 4 * x4 + e;
                for (int g = 0; g < o_chunks; ++g) {
                    const float4 v = *(const float4*)&V_j[x * d_head + 4 * (row_threads * g + tx)];
                    for (int t = 0; t < rows_per_thread; ++t) {
                        O_reg[t][4 * g + 0] += p[t][e] * v.x;
                        O_reg[t][4 * g + 1] += p[t][e] * v.y;
                        O_reg[t][4 * g + 2] += p[t][e] * v.z;
                        O_reg[t][4 * g + 3] += p[t][e] * v.w;
                    }
                }
            }
        }
    }

    // l_i = the sum of the row's partial sums; O_i / l_i goes to global memory, float4 per chunk.
    for (int t = 0; t < rows_per_thread; ++t) {
        float l = l_i[t];
        for (int offset = row_threads / 2; offset > 0; offset /= 2)
            l += __shfl_xor_sync(FULL_WARP, l, offset);
        const int row = row_start + ty + row_groups * t;
        if (row < T) {
            const float inv_l = 1.0f / l;
            for (int g = 0; g < o_chunks; ++g)
                *(float4*)&O_head[(long long)row * d_head + 4 * (row_threads * g + tx)] =
                    make_float4(O_reg[t][4 * g + 0] * inv_l, O_reg[t][4 * g + 1] * inv_l,
                                O_reg[t][4 * g + 2] * inv_l, O_reg[t][4 * g + 3] * inv_l);
        }
    }
}
