/*
 * v13 - FA2 work partitioning: each warp owns a band of whole rows of Q_i, 8 x 8 register tiles,
 * K_j and V_j copied asynchronously.
 *
 * The change: v12 already keeps O_i in registers and the statistics of a row within one warp, but
 * it deals the rows of Q_i out to warps 16 apart and loads K_j and V_j through registers between two
 * barriers. v13 takes the partitioning of FlashAttention-2 (Dao, 2023, section 3.3) all the way: a
 * block of 4 warps takes a tile Q_i of B_r query rows (128 by default), and warp w owns the
 * contiguous band of rows w B_r / 4 .. (w + 1) B_r / 4 - 1 with their S_ij, P_ij, m_i, l_i and O_i.
 * Each thread computes a TM x TN register tile of S_ij = Q_i K_j^T and a TM x (d / 8) tile of
 * O_i += P_ij V_j (8 x 8 and 8 x 8 at B_r = 128, B_c = 64, d = 64), and K_j and V_j arrive by
 * cp.async while the other product is computed. It also takes non-causal attention, query and key
 * lengths that differ, grouped-query attention, and head size 96.
 *
 * Why it helps:
 *   - Causal work at warp granularity: a warp whose band lies wholly above a tile of keys skips
 *     the tile (its S_ij, softmax and P_ij V_j), and only tiles that cross a warp's first row are
 *     masked. No warp needs another warp's rows: the row max and row sum are shuffles among the 8
 *     lanes of a row, P_ij goes through a slice of shared memory only its warp reads, and the only
 *     block-wide barriers are the two per tile that hand K_j and V_j over.
 *   - Register tiles: per 4 steps along the reduction, a thread of the 8 x 8 tile loads 8 float4 of
 *     the left operand and 8 float4 of the right one and issues 256 FFMAs, so loads are 1 in 17
 *     instructions of the inner loops (v12's 4 x 4 tile: 1 in 9). Every load is conflict-free.
 *   - Copies overlap math: cp.async fetches V_j while S_ij is computed and K_{j+1} while P_ij V_j is,
 *     into the same two buffers (K_j is dead once S_ij is in registers, V_j once O_i is updated),
 *     without passing through registers.
 *   - Cheaper softmax: the scale and log2(e) are folded into Q_i once, when it is loaded, so a
 *     score costs one subtraction and one ex2.approx; O_i is divided by l_i once, at the end.
 *   - Heavy tiles first across heads: the launcher's grid is (T_r, NH, B) with blockIdx.x fastest,
 *     and the hardware in practice hands out blocks in about that order. The kernel reads the flat
 *     block index as (tile rank, head): the first NH * B blocks take the last (longest, causally)
 *     tile of every head, the next ones the tile before it, ..., so the short tiles fill the tail
 *     of the grid. Which block computes which tile changes, not what is computed.
 *
 * Beyond causal self-attention (lab.supports), with the inner loops untouched: what differs is
 * decided once per block or per warp, in the block-uniform branches around them.
 *   - Query row i sees keys j <= min(i + diag, T_k - 1): causal, diag = T_k - T_q, the mask aligned
 *     bottom-right (the last query sees every key, as in a block of new tokens over a KV cache);
 *     non-causal, diag = T_k, which never binds. The block computes diag once, and from it T_c, the
 *     tile of the last key its last row sees; each warp the last key its last row sees (skip the
 *     tiles past it) and the last key all its rows see (mask only the tiles past that one). Causal
 *     masking compares key - row with diag; non-causal masks the keys past T_k in the last tile.
 *   - With T_q > T_k the first T_q - T_k rows see no key. A block all of whose rows are such runs
 *     no tile and writes zeros. In a warp that has some, those rows start at m_i = 0 instead of
 *     -inf: all their scores are -inf, so P_ij is exactly 0 and no -inf - (-inf) makes a NaN; l_i
 *     stays 0, and a row with l_i = 0 writes zeros (as the reference defines it).
 *   - Grouped-query attention: query head h reads K/V head h / kv_group through the K/V strides, so
 *     the kv_group query heads of a group share one copy of K and V in memory.
 *
 * Geometry: grid (T_r = ceil(T_q / B_r), n_heads, batch), block 128 threads = 4 warps. Lane l of
 * warp w has row group rg = l / 8 and column group cg = l % 8; it owns
 *   rows      w * B_r / 4 + rg + 4 i,  i < TM = B_r / 16  (consecutive lanes: consecutive rows)
 *   S columns cg + 8 j,                j < TN = B_c / 8
 *   O columns 32 q + 4 cg + e,         q < d / 32, e < 4  (8 lanes: 32 consecutive floats)
 * so d = 96 gives each thread TD = 3 float4 groups of O_i columns, the same layout as d = 64 or 128.
 * Shared memory, in floats (every row 16-byte aligned):
 *   Q_i (B_r x (d + 4)) + K_j (B_c x (d + 4)) + V_j (B_c x d) + P_ij (B_r x (B_c + 8))
 *   B_r = 128, B_c = 64, d = 64: 4 * (128 * 68 + 64 * 68 + 64 * 64 + 128 * 72) = 105,472 bytes,
 *   two blocks in the 228 KB of an H100 SM; B_r = 64: 69,632 bytes, three blocks;
 *   d = 32, B_r = 128, B_c = 64: 72,704 bytes; d = 128, B_r = 64, B_c = 32: 77,312 bytes;
 *   d = 128, B_r = 128, B_c = 32: 121,344 bytes, one block;
 *   d = 96, B_r = 128, B_c = 32: 4 * (128 * 100 + 32 * 100 + 32 * 96 + 128 * 40) = 96,768 bytes,
 *   two blocks; B_r = 64, B_c = 64: 94,208 bytes, two blocks; B_r = 64, B_c = 32: 60,928 bytes, three.
 *   For d = 96 the 128 x 32 tile comes first, by the rule of the other head sizes: the tallest
 *   register tile (TM = 8) that still leaves two blocks per SM (d = 96, B_c = 64 at B_r = 128
 *   would leave one); the 64 x 32 tile also fits devices with less shared memory.
 * Banks: a warp reads K_j[cg + 8 j][4 k .. 4 k + 3] for 8 consecutive rows; with a pitch of d + 4
 *   floats (4 mod 32 for every multiple of 32, 96 included), row r starts 4 r banks further, so the
 *   8 float4 cover the 32 banks once. Q_i and P_ij reads are 4 consecutive rows (broadcast to 8
 *   lanes each), 4 or 8 banks apart. V_j reads are 8 consecutive float4 of one row. The P_ij stores
 *   (one float per lane) land at bank 8 rg + cg (mod 32) with the pitch of B_c + 8: all distinct.
 * Copies: a row of K_j or V_j is d / 4 chunks of 16 bytes. For d = 32, 64, 128 that divides the 128
 *   threads, and one pass copies 128 / (d / 4) whole rows; at d = 96 (24 chunks) the pattern repeats
 *   every lcm(128, 24) = 384 chunks = 16 rows: each thread has 3 (row, chunk) starting points among
 *   the first 16 rows and steps 16 rows from each (B_c, a multiple of 32, is whole periods).
 *
 * The log-sum-exp (lab.lse): given an lse array, the lanes with cg = 0 also write each row's
 * log-sum-exp, (m_i + log2 l_i) ln 2 (m_i and the scores are in log2 units), or +inf for a row that
 * sees no key (l_i = 0): the statistic the backward pass recomputes P_ij from.
 *
 * Limits: d_head a multiple of 32 (32, 64, 96, 128 declared); B_r a multiple of 16, B_c a multiple
 * of 32. Rows of Q, K and V 16-byte aligned (the launcher copies views whose rows are not), K and V
 * with the same strides. Keys past T_k are zero-filled, so no garbage reaches P_ij V_j; but a NaN or
 * inf in V_j itself also reaches the rows of its tile that mask its key (0 x NaN in the product).
 *
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 128, 64), (64, 64, 64), (32, 128, 64), (128, 64, 32), (128, 128, 32), (96, 128, 32), (96, 64, 64), (96, 64, 32)
 * lab.threads    128
 * lab.smem       4 * (B_r * (d_head + 4) + B_c * (d_head + 4) + B_c * d_head + B_r * (B_c + 8))
 * lab.strided    true
 * lab.supports   noncausal, cross, gqa
 * lab.lse        true
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;
constexpr int THREADS = 128;

// The blocks of a configuration that Hopper's shared memory lets one SM hold (228 KB, 1 KB of it
// reserved per block; lab.smem's bytes), at most 2, is __launch_bounds__'s second argument: ptxas may
// then use up to 255 registers and picks its count without an occupancy target of its own. Left to
// itself it has given (128, 64, 32) and (96, 64, 32) 128 registers and spills in one build environment,
// 159 and 146 without spills in another (the same NVRTC release); told the smem-bound 3 blocks, it
// spills (32, 128, 64) at 168. With the hint every configuration compiles to 255 registers or fewer
// without spills; (32, 128, 64) takes 208, so 2 blocks an SM where shared memory would allow 3.
template <int d_head, int B_r, int B_c>
__host__ __device__ constexpr int min_blocks()
{
    constexpr int blocks = (228 * 1024) / (4 * (B_r * (d_head + 4) + B_c * (d_head + 4) + B_c * d_head + B_r * (B_c + 8)) + 1024);
    return blocks < 2 ? blocks : 2;
}

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// cp.async: copy 16 bytes from global to shared memory without passing through registers, or
// zero-fill the 16 bytes when valid is false (src_size = 0 reads nothing).
__device__ __forceinline__ void copy_async_16(float* dst, const float* src, bool valid)
{
    const unsigned dst_shared = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst_shared), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__host__ __device__ constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// Start copying keys (or values) col_start .. col_start + rows - 1 of one head into a tile with the
// given pitch; keys at or past T_k become zeros. The block's copies repeat every lcm(THREADS, d / 4)
// 16-byte chunks: each thread takes passes_per_period (row, chunk) starting points (1, or 3 at d = 96)
// and steps rows_per_period rows from each.
template <int d_head, int rows, int pitch>
__device__ __forceinline__ void load_tile_async(float* tile, const float* head, long long row_stride,
                                                int col_start, int T_k)
{
    constexpr int chunks = d_head / 4;                                 // 16-byte chunks per row
    constexpr int passes_per_period = chunks / gcd(THREADS, chunks);
    constexpr int rows_per_period = passes_per_period * THREADS / chunks;
    static_assert(rows % rows_per_period == 0, "whole periods per tile");
    #pragma unroll
    for (int s = 0; s < passes_per_period; ++s) {
        const unsigned idx = threadIdx.x + s * THREADS;
        const int r0 = idx / chunks, c = 4 * (idx % chunks);
        const float* src = head + (long long)(col_start + r0) * row_stride + c;
        #pragma unroll
        for (int n = 0; n < rows / rows_per_period; ++n, src += rows_per_period * row_stride) {
            const int r = r0 + n * rows_per_period;
            const bool valid = col_start + r < T_k;  // a key past T_k reads nothing (at a valid address)
            copy_async_16(&tile[r * pitch + c], valid ? src : head, valid);
        }
    }
    copy_async_commit();
}

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(THREADS, min_blocks<d_head, B_r, B_c>())
attention_forward(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
                  float* __restrict__ O, float* __restrict__ /* workspace */, int T_q, int T_k, int kv_group,
                  int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride,
                  float* __restrict__ lse)
{
    static_assert(d_head % 32 == 0, "8 lanes of a row group store 32 consecutive floats of O_i");
    static_assert(B_r % 16 == 0, "4 warps x 4 row groups x TM rows");
    static_assert(B_c % 32 == 0, "TN = B_c / 8 columns per thread; the P_ij pitch is 8 (mod 32)");
    constexpr int TM = B_r / 16;           // rows of the register tile
    constexpr int TN = B_c / 8;            // columns of S_ij per thread
    constexpr int TD = d_head / 32;        // float4 groups of O_i columns per thread
    constexpr int rows_per_warp = B_r / 4;
    constexpr int Q_pitch = d_head + 4;    // +4 floats: consecutive rows start 4 banks apart
    constexpr int K_pitch = d_head + 4;
    constexpr int V_pitch = d_head;        // read one row at a time: no pad needed
    constexpr int P_pitch = B_c + 8;       // +8 floats: the 4 row groups' stores land 8 banks apart
    constexpr unsigned FULL_WARP = 0xffffffffu;

    extern __shared__ __align__(16) float smem[];
    float* Q_i = smem;                     // B_r x Q_pitch, pre-scaled by scale * log2(e)
    float* K_j = Q_i + B_r * Q_pitch;      // B_c x K_pitch
    float* V_j = K_j + B_c * K_pitch;      // B_c x V_pitch
    float* P_ij = V_j + B_c * V_pitch;     // B_r x P_pitch; warp w reads and writes only its rows

    // Heavy tiles first: the flat block index, read as (tile rank, head), counts tiles down.
    const long long n_heads = (long long)gridDim.y * gridDim.z;
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int q_tile = gridDim.x - 1 - (int)(flat / n_heads);
    const long long bh = flat % n_heads;   // = batch * NH + head
    const long long batch = bh / gridDim.y;
    const long long head = bh % gridDim.y;
    // Grouped-query attention: kv_group consecutive query heads share a K/V head. Unsigned: no sign
    // fix-ups (compiled signed, it cost the d = 32 tile the register budget of a third block per SM).
    const long long kv_head = (unsigned)head / (unsigned)kv_group;

    const float* Q_head = Q + batch * q_batch_stride + head * q_head_stride;
    const float* K_head = K + batch * kv_batch_stride + kv_head * kv_head_stride;
    const float* V_head = V + batch * kv_batch_stride + kv_head * kv_head_stride;
    float* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d)
    const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;

    const int row_start = q_tile * B_r;
    const int rows = min(B_r, T_q - row_start);
    // Query row i sees keys j <= min(i + diag, T_k - 1). Causal: diag = T_k - T_q, the mask aligned
    // bottom-right (the last query sees every key); non-causal: diag = T_k, which never binds.
    const int diag = causal ? T_k - T_q : T_k;
    // Stop at the tile of the last key the block's last row sees; none if it sees none.
    const int block_last_key = row_start + rows - 1 + diag;
    const int T_c = block_last_key < 0 ? 0 : min((T_k + B_c - 1) / B_c, block_last_key / B_c + 1);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int rg = lane / 8, cg = lane % 8;
    const int warp_row = warp * rows_per_warp;         // first row of this warp in Q_i
    const int warp_first = row_start + warp_row;       // ... as a query index
    const int warp_last_key = warp_first + rows_per_warp - 1 + diag;  // the last key its last row sees
    const int warp_full_key = min(warp_first + diag, T_k - 1);        // ... and every row of it sees

    // K_0 starts arriving while Q_i is loaded and scaled: S = (scale log2 e) Q K^T is in log2 units.
    if (T_c > 0)
        load_tile_async<d_head, B_c, K_pitch>(K_j, K_head, kv_row_stride, 0, T_k);
    const float scale_log2 = scale * LOG2_E;
    for (int idx = threadIdx.x; idx < B_r * (d_head / 4); idx += THREADS) {
        const int r = idx / (d_head / 4), c = 4 * (idx % (d_head / 4));
        float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // rows past T_q: zeros, finite scores
        if (r < rows) {
            q = *(const float4*)&Q_head[(long long)(row_start + r) * q_row_stride + c];
        }
        *(float4*)&Q_i[r * Q_pitch + c] = make_float4(q.x * scale_log2, q.y * scale_log2, q.z * scale_log2, q.w * scale_log2);
    }

    float O_acc[TM][TD][4];                // O_i rows rg + 4 i, columns 32 q + 4 cg + e
    float m_i[TM], l_i[TM];                // l_i: this lane's share of the row sum, reduced at the end
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        // A row that sees a key sees key 0, in tile 0, and has a finite m_i from then on. A row that
        // sees none (causal, T_q > T_k) starts at m_i = 0, not -inf: its scores are all -inf, so
        // m_i stays 0, P_ij stays exactly 0 and no -inf - (-inf) turns it into NaN; l_i stays 0.
        m_i[i] = warp_first + rg + 4 * i + diag < 0 ? 0.0f : -INFINITY;
        l_i[i] = 0.0f;
        #pragma unroll
        for (int q = 0; q < TD; ++q)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                O_acc[i][q][e] = 0.0f;
    }

    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        // K_j has landed for every thread, and every warp is done with V_{j-1} and its P_ij slice.
        copy_async_wait_all();
        __syncthreads();
        load_tile_async<d_head, B_c, V_pitch>(V_j, V_head, kv_row_stride, col_start, T_k);

        // A warp none of whose rows sees a key of this tile, or whose rows all lie past T_q, has
        // nothing to do in it.
        const bool warp_active = col_start <= warp_last_key && warp_first < T_q;
        if (warp_active) {
            // S_ij = Q_i K_j^T: per 4 steps of d, 8 + 8 float4 loads feed 4 * TM * TN FFMAs
            float S[TM][TN];
            #pragma unroll
            for (int i = 0; i < TM; ++i)
                #pragma unroll
                for (int n = 0; n < TN; ++n)
                    S[i][n] = 0.0f;
            #pragma unroll 2
            for (int k = 0; k < d_head; k += 4) {
                float4 k_frag[TN];
                #pragma unroll
                for (int n = 0; n < TN; ++n)
                    k_frag[n] = *(const float4*)&K_j[(cg + 8 * n) * K_pitch + k];
                #pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float4 q = *(const float4*)&Q_i[(warp_row + rg + 4 * i) * Q_pitch + k];
                    #pragma unroll
                    for (int n = 0; n < TN; ++n) {
                        S[i][n] = fmaf(q.x, k_frag[n].x, S[i][n]);
                        S[i][n] = fmaf(q.y, k_frag[n].y, S[i][n]);
                        S[i][n] = fmaf(q.z, k_frag[n].z, S[i][n]);
                        S[i][n] = fmaf(q.w, k_frag[n].w, S[i][n]);
                    }
                }
            }

            // Only a tile that reaches past a key that every row of the warp sees (past the diagonal
            // of its first row, or past T_k) holds masked scores. Select, do not add: whatever sits in
            // a masked score, the zeros of keys past T_k included, becomes -inf and then exactly 0.
            if (col_start + B_c - 1 > warp_full_key) {
                if (causal) {  // key > row + diag; for a row before T_q, every key past T_k is too
                    // Key col_start + cg + 8 n, row warp_first + rg + 4 i: one comparison per 8 n - 4 i.
                    const int last = warp_first + rg + diag - col_start - cg;
                    #pragma unroll
                    for (int i = 0; i < TM; ++i)
                        #pragma unroll
                        for (int n = 0; n < TN; ++n)
                            if (8 * n - 4 * i > last)
                                S[i][n] = -INFINITY;
                } else {       // key >= T_k, the same columns in every row
                    #pragma unroll
                    for (int n = 0; n < TN; ++n)
                        if (col_start + cg + 8 * n >= T_k)
                            #pragma unroll
                            for (int i = 0; i < TM; ++i)
                                S[i][n] = -INFINITY;
                }
            }

            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                // m_new = max(m_i, rowmax(S_ij)), over this lane's columns and then the row group's 8 lanes;
                // finite from tile 0 on (see m_i's start).
                float m_new = m_i[i];
                #pragma unroll
                for (int n = 0; n < TN; ++n)
                    m_new = fmaxf(m_new, S[i][n]);
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 1));
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 2));
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 4));
                // P_ij = 2^(S_ij - m_new); l_i = 2^(m_i - m_new) l_i + rowsum(P_ij); O_i *= 2^(m_i - m_new)
                const float alpha = exp2_approx(m_i[i] - m_new);  // 0 on the first tile: m_i = -inf
                m_i[i] = m_new;
                float row_sum = 0.0f;
                float* P_row = &P_ij[(warp_row + rg + 4 * i) * P_pitch];
                #pragma unroll
                for (int n = 0; n < TN; ++n) {
                    const float p = exp2_approx(S[i][n] - m_new);
                    row_sum += p;
                    P_row[cg + 8 * n] = p;
                }
                l_i[i] = l_i[i] * alpha + row_sum;
                #pragma unroll
                for (int q = 0; q < TD; ++q)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        O_acc[i][q][e] *= alpha;
            }
        }

        // V_j has landed for every thread, every warp is done with K_j, and P_ij is written.
        copy_async_wait_all();
        __syncthreads();
        if (j + 1 < T_c)
            load_tile_async<d_head, B_c, K_pitch>(K_j, K_head, kv_row_stride, col_start + B_c, T_k);

        if (warp_active) {
            // O_i += P_ij V_j: per 4 keys, TM float4 of P_ij and 4 * TD float4 of V_j feed 16 * TM * TD FFMAs
            #pragma unroll 2
            for (int k = 0; k < B_c; k += 4) {
                float4 v_frag[4][TD];
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    #pragma unroll
                    for (int q = 0; q < TD; ++q)
                        v_frag[e][q] = *(const float4*)&V_j[(k + e) * V_pitch + 32 * q + 4 * cg];
                #pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float4 p = *(const float4*)&P_ij[(warp_row + rg + 4 * i) * P_pitch + k];
                    #pragma unroll
                    for (int q = 0; q < TD; ++q) {
                        float* o = O_acc[i][q];
                        o[0] = fmaf(p.x, v_frag[0][q].x, o[0]);
                        o[1] = fmaf(p.x, v_frag[0][q].y, o[1]);
                        o[2] = fmaf(p.x, v_frag[0][q].z, o[2]);
                        o[3] = fmaf(p.x, v_frag[0][q].w, o[3]);
                        o[0] = fmaf(p.y, v_frag[1][q].x, o[0]);
                        o[1] = fmaf(p.y, v_frag[1][q].y, o[1]);
                        o[2] = fmaf(p.y, v_frag[1][q].z, o[2]);
                        o[3] = fmaf(p.y, v_frag[1][q].w, o[3]);
                        o[0] = fmaf(p.z, v_frag[2][q].x, o[0]);
                        o[1] = fmaf(p.z, v_frag[2][q].y, o[1]);
                        o[2] = fmaf(p.z, v_frag[2][q].z, o[2]);
                        o[3] = fmaf(p.z, v_frag[2][q].w, o[3]);
                        o[0] = fmaf(p.w, v_frag[3][q].x, o[0]);
                        o[1] = fmaf(p.w, v_frag[3][q].y, o[1]);
                        o[2] = fmaf(p.w, v_frag[3][q].z, o[2]);
                        o[3] = fmaf(p.w, v_frag[3][q].w, o[3]);
                    }
                }
            }
        }
    }

    // O_i = O_i / l_i, once; l_i is the sum of the 8 lanes' shares, 0 for a row that sees no key,
    // whose output is 0 and log-sum-exp +inf.
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        float l = l_i[i];
        l += __shfl_xor_sync(FULL_WARP, l, 1);
        l += __shfl_xor_sync(FULL_WARP, l, 2);
        l += __shfl_xor_sync(FULL_WARP, l, 4);
        const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
        const int row = warp_first + rg + 4 * i;
        if (row < T_q) {
            if (lse != nullptr && cg == 0)
                lse[bh * T_q + row] = l == 0.0f ? INFINITY : (m_i[i] + __log2f(l)) * LN_2;
            #pragma unroll
            for (int q = 0; q < TD; ++q) {
                float* dst = O_head + (long long)row * d_head + 32 * q + 4 * cg;
                const float4 o = make_float4(O_acc[i][q][0] * inv_l, O_acc[i][q][1] * inv_l,
                                             O_acc[i][q][2] * inv_l, O_acc[i][q][3] * inv_l);
                if (o_vec) {
                    *(float4*)dst = o;
                } else {
                    dst[0] = o.x, dst[1] = o.y, dst[2] = o.z, dst[3] = o.w;
                }
            }
        }
    }
}
