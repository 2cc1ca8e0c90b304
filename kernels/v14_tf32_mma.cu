/*
 * v14 - tensor cores: S_ij = Q_i K_j^T and O_i += P_ij V_j on mma.sync m16n8k8 TF32.
 *
 * The change: v13's partitioning (a block per tile Q_i, each warp owning whole rows, O_i in
 * registers, K_j and V_j streamed through shared memory) with both products issued to the tensor
 * cores as mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32. The template parameter split picks
 * the arithmetic: split = 1 is 3xTF32 (float32-level accuracy, the default), split = 0 plain TF32.
 * It also takes non-causal, cross (T_q != T_k) and grouped-query attention.
 *
 * Why it helps: one mma is 16 x 8 x 8 = 1024 multiply-adds for a warp, against 32 for an FFMA, on
 * a pipe whose TF32 rate is several times the FFMA rate (DEVICE.md has the measured ceilings).
 * 3xTF32 issues three mma per product and still leaves the FFMA ceiling far behind.
 *
 * Fragments (PTX ISA, m16n8k8 .tf32; lane = 4 g + t):
 *   A 16x8 row-major: a0 (g, t)  a1 (g + 8, t)  a2 (g, t + 4)  a3 (g + 8, t + 4)
 *   B 8x8 col-major:  b0 (k = t, n = g)  b1 (k = t + 4, n = g)
 *   C/D 16x8:         c0 (g, 2t)  c1 (g, 2t + 1)  c2 (g + 8, 2t)  c3 (g + 8, 2t + 1)
 * Three index orders are free, and choosing them makes every operand either a register already
 * held or one 128-bit load, with no shuffles and no trip through shared memory for P_ij:
 *   - the reduction over d (summed, so any order): in k-pair kk, logical k = t and t + 4 of block b
 *     are columns 16 kk + 4 t + 2 b and + 1, so a thread's Q_i and K_j operands for two k-blocks
 *     are 4 consecutive floats;
 *   - the keys within a group of 16: n-tile p = 2 u + s, logical column n is key
 *     16 u + 4 (n / 2) + 2 s + n % 2. The accumulators c0, c1 of tile p are then keys 16 u + 4 t + 2 s
 *     and + 1, which is the A layout of P_ij V_j when its logical k = t is key 16 u + 4 t + 2 s and
 *     k = t + 4 the next key: P_ij is the S_ij accumulator as it stands (a0 = c0, a1 = c2, a2 = c1,
 *     a3 = c3), and a thread's V_j operands are keys 16 u + 4 t .. 16 u + 4 t + 3;
 *   - the columns of O_i: n-tile 4 w + z, logical column n is column 32 w + 4 n + z, so the V_j
 *     operands of 4 n-tiles are 4 consecutive floats and a thread's 8 values of a row of O_i are
 *     8 consecutive floats, stored as two float4. There are d / 32 groups w (3 at d = 96) and
 *     d / 16 k-pairs kk (6 at d = 96): d a multiple of 32 is all either needs.
 * Shared memory is swizzled in 16-byte chunks (so that cp.async writes whole chunks): chunk c of
 * row r of K_j sits at c ^ 4 (r % 2), of V_j at c ^ 2 ((r / 4) % 4). A quarter-warp's 8 float4
 * loads then land on 8 distinct groups of 4 banks, for K_j (rows r, r + 1) and V_j (4 rows apart).
 * A row is d / 4 chunks, a multiple of 8 (d = 96: 24 chunks, 384 bytes), so every row starts in
 * bank group 0 and the XOR, which touches only the 3 low bits, keeps a chunk within its aligned 8.
 * The 24 chunks of a d = 96 row do not divide the 128 threads of a block, so the copies go by
 * segments of 8 chunks, 16 rows a pass (load_tile_async); d = 32, 64, 128 copy whole rows.
 *
 * 3xTF32: x = big + small with big = x rounded to TF32 (10 mantissa bits) and small = x - big,
 * exact in float32; a b ~ big_a big_b + big_a small_b + small_a big_b, dropping small_a small_b
 * (about 2^-22 of a b). NVRTC 12.9 assembles cvt.rna.tf32.f32 for sm_80 and sm_90 into a test for
 * inf and NaN around an integer add and a mask (FSETP, IADD, LOP3, and a SEL once unrolled), and
 * the inner loops split every element of K_j, V_j and P_ij they read; so big is computed by the add
 * and the mask alone (the same rounding, nearest with ties away, for every finite x), and small
 * goes to the tensor core unrounded: it uses the 19 TF32 bits of an operand, an error of at most
 * 2^-10 |small| <= 2^-21 |x|. Three instructions per element: add, and, subtract.
 * The tensor core adds into its float32 accumulator with truncation, which biases long chains
 * toward zero; so S_ij is summed one pair of k-blocks at a time (6 mma from zero) and the pairs
 * added in float32, and P_ij V_j goes per tile and per 32 columns into two fresh accumulators,
 * big x big and the corrections, which join O_i in one FFMA with the rescale exp2(m_old - m_new).
 * As in v13: the softmax scale and log2(e) are folded into Q_i, masking only on tiles that cross a
 * warp's first row, a warp skips tiles none of its rows sees, heavy tiles first, O_i / l_i once.
 *
 * Beyond causal self-attention, all the extra work is block- or warp-uniform and before the loop
 * over tiles. Query row i sees keys j <= i + T_k - T_q when causal: the mask aligned bottom-right,
 * as in the reference. The block stops at the tile of the last key its last row sees (non-causal:
 * the last tile of T_k). Each warp keeps one number, warp_key, the last key its first row sees
 * (causal: warp_row + T_k - T_q; non-causal: T_k - 1; -16 for a warp whose rows all lie past
 * T_q): it skips a tile that starts past warp_key + 15 and masks one that reaches past warp_key,
 * keys past row + T_k - T_q (or past T_k - 1) becoming -inf. With T_q = T_k and causal these are
 * the same tests on the same tiles as before, one compare each. Query head h reads K/V head
 * h / kv_group (kv_group = NH / NH_kv) through the K/V strides, with no copies. A row that sees no
 * key (causal, T_q > T_k: rows i < T_q - T_k) is written as zeros, as in the reference. Its
 * scores are all -inf, 2^(-inf - (-inf)) makes its l_i and O_i NaN, in its own row only (the quad
 * shuffles and each mma row stay within a row), and the store selects zeros for it, so no test
 * is added to the loop. A block whose rows all see no key still loads K_0 and V_0 (T_c = 1) and
 * every warp skips it: the first tile's copies stay unconditional, so ptxas keeps hoisting the
 * copies' addresses out of the loop over tiles.
 *
 * The log-sum-exp (lab.lse): given an lse array, lane t = 0 of each quad also writes its two rows'
 * log-sum-exp, (m_i + log2 l_i) ln 2 in the scores' log2 units, or +inf for a row that sees no key.
 *
 * Geometry: grid (T_r = ceil(T_q / B_r), n_heads, batch), block 2 B_r threads = B_r / 16 warps;
 * warp w owns rows 16 w .. 16 w + 15 of Q_i, lane (g, t) rows 16 w + g and 16 w + g + 8.
 * K_j and V_j are double-buffered: the copies of tile j + 1 start right after the one barrier of
 * tile j and land while tile j is computed. Q_i's fragments are loaded once, scaled, split and
 * kept in shared memory, each thread reading back only its own.
 * Shared memory, in floats: K_j, V_j (2 x 2 x B_c x d) + Q_i fragments ((1 + split) x B_r x d)
 *   d = 64, B_r = 64, B_c = 64, split = 1: 4 * (4 * 4096 + 2 * 4096) = 98,304 bytes, two blocks in
 *   the 228 KB of an H100 SM; B_r = 128: 131,072 bytes, one block of 8 warps; split = 0: 81,920.
 *   d = 128 with split uses B_c = 16 (98,304 bytes): at B_c = 32 its registers spill.
 *   d = 96, B_r = 64: with split B_c = 16, 4 * (4 * 1536 + 2 * 6144) = 73,728 bytes (at B_c = 32
 *   its registers spill); without, B_c = 32, 4 * (4 * 3072 + 6144) = 73,728 bytes.
 *
 * Tolerance: split = 1 is held to float32's own (8 times plain float32's error). Plain TF32 rounds
 * every operand to 11 significant bits, 2^13 = 8192 times float32's unit roundoff; at T = 1, where
 * O = V, its error alone reaches up to 4096 times the tests' floor (float32 epsilon times max |O|).
 *
 * Limits: sm_80 or newer (cp.async, mma TF32). d_head a multiple of 32, B_r and B_c multiples of
 * 16, B_c also of the rows one pass of copies covers (2 B_r / gcd(2 B_r, d / 4): 16 at d = 96 and
 * B_r = 64); rows of Q, K and V 16-byte aligned (the launcher copies views whose rows are not).
 * Every warp splits the K_j and V_j elements it reads, so each is split once per warp of the
 * block. A NaN or inf in V_j also reaches the rows of its tile that mask its key (0 x NaN in the
 * product), as in v13; keys past T_k are zero-filled, so only real inputs can.
 * The rounding add of the split turns a NaN whose mantissa is 0x7ff000 or more (0x7fffffff, the NaN
 * the GPU's arithmetic returns) into +-0 (tf32_big_keep_nan). Q_i's fragments, always such a NaN
 * after the scaling, are rounded NaN-safe once per block. In the inner loops: P_ij's NaN still
 * reaches l_i (summed unrounded) and alpha; with split a NaN in K_j or V_j reaches the tensor core
 * through small; without split a K_j or V_j NaN of that form (written by GPU arithmetic, e.g. an
 * earlier layer's) is lost, which the loops do not test for (an instruction per element).
 *
 * lab.template   d_head, B_r, B_c, split
 * lab.configs    (64, 64, 64, 1), (64, 128, 64, 1), (32, 64, 64, 1), (96, 64, 16, 1), (128, 64, 16, 1), (64, 64, 64, 0), (32, 64, 64, 0), (96, 64, 32, 0), (128, 64, 32, 0)
 * lab.threads    2 * B_r
 * lab.smem       4 * (4 * B_c * d_head + (1 + split) * B_r * d_head)
 * lab.strided    true
 * lab.tolerance  8 + 8192 * (1 - split)
 * lab.supports   noncausal, cross, gqa
 * lab.tf32_products 1 + 2 * split
 * lab.lse        true
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x = big + small: big is x rounded to TF32 (nearest, ties away: add half an ulp of the 10-bit
// mantissa to the bit pattern, then clear the 13 low bits); small = x - big is exact in float32,
// and the tensor core reads only its 19 TF32 bits.
__device__ __forceinline__ unsigned tf32_big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ unsigned tf32_small(float x, unsigned big) { return __float_as_uint(x - __uint_as_float(big)); }

// tf32_big turns one kind of NaN into a zero: a NaN whose mantissa is 0x7ff000 or more, where the
// half ulp carries through the all-ones exponent into the sign (0x7fffffff + 0x1000 = 0x80000fff,
// masked to 0x80000000 = -0). The GPU's own NaN is that NaN: a float32 operation with a NaN result
// returns 0x7fffffff whatever the inputs' payloads, so a NaN in Q_i, which is rounded after the
// multiplication by scale log2(e), always is. With split it still reaches the tensor core through
// small = NaN - (-0) = NaN; without split big is all the tensor core sees, and the NaN would vanish.
// So Q_i's fragments, rounded once per block, keep a NaN a NaN (0x7fffe000, a TF32 NaN) there.
__device__ __forceinline__ unsigned tf32_big_keep_nan(float x) { return isnan(x) ? 0x7fffe000u : tf32_big(x); }

// D = A B + D for one 16x8x8 tile; the fragment layouts are in the header.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2])
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
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

// Float4 chunk c of row r of a K_j tile sits at chunk c ^ (4 (r & 1)); of a V_j tile at c ^ (2 ((r / 4) & 3)).
__device__ __forceinline__ int k_chunk(int r, int c) { return c ^ ((r & 1) << 2); }
__device__ __forceinline__ int v_chunk(int r, int c) { return c ^ (((r >> 2) & 3) << 1); }

__device__ constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// Start copying keys (or values) col_start .. col_start + rows - 1 of one head into a swizzled
// tile; keys at or past T become zeros. The block copies a row's d / 4 chunks as segments of
// width = gcd(threads, d / 4) chunks (the whole row when d / 4 divides the threads; 3 segments of
// 8 at d = 96), one pass covering threads / width rows of one segment. The swizzles change only
// the 3 low bits of a chunk index and width is a multiple of 8, so a segment's chunks stay in it.
template <int d_head, int rows, int threads, bool is_v>
__device__ __forceinline__ void load_tile_async(float* tile, const float* head, long long row_stride,
                                                int col_start, int T)
{
    constexpr int d4 = d_head / 4;
    constexpr int width = gcd(threads, d4);
    constexpr int rows_per_pass = threads / width;
    static_assert(width % 8 == 0 && rows % rows_per_pass == 0, "whole segments per pass, whole passes per tile");
    const int r0 = threadIdx.x / width, c4 = threadIdx.x % width;
    #pragma unroll
    for (int seg = 0; seg < d4 / width; ++seg) {
        const float* src = head + (long long)(col_start + r0) * row_stride + 4 * (width * seg + c4);
        #pragma unroll
        for (int n = 0; n < rows / rows_per_pass; ++n, src += rows_per_pass * row_stride) {
            const int r = r0 + n * rows_per_pass, c = width * seg + c4;
            const bool valid = col_start + r < T;  // a key past T reads nothing (at a valid address)
            copy_async_16(&tile[r * d_head + 4 * (is_v ? v_chunk(r, c) : k_chunk(r, c))], valid ? src : head, valid);
        }
    }
}

// The 1 (at least one block per SM) keeps ptxas from capping registers below 255 to fit more
// blocks: without it some configurations spill.
template <int d_head, int B_r, int B_c, int split>
__global__ void __launch_bounds__(2 * B_r, 1)
attention_forward(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
                  float* __restrict__ O, float* __restrict__ workspace,
                  int T_q, int T_k, int kv_group, int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride,
                  float* __restrict__ lse)
{
    constexpr int THREADS = 2 * B_r;
    constexpr int WARPS = B_r / 16;
    constexpr int KB = d_head / 8;          // k-blocks of S_ij = Q_i K_j^T
    constexpr int NT = B_c / 8;             // n-tiles of S_ij = k-blocks of P_ij V_j
    constexpr int ND = d_head / 8;          // n-tiles of O_i
    constexpr unsigned FULL_WARP = 0xffffffffu;
    static_assert(B_r % 16 == 0 && B_c % 16 == 0 && d_head % 32 == 0, "tile shapes");

    extern __shared__ __align__(16) float smem[];
    float* K_buf = smem;                    // 2 x B_c x d_head: tiles j and j + 1, swizzled
    float* V_buf = smem + 2 * B_c * d_head; // 2 x B_c x d_head
    uint4* Q_frag = (uint4*)(smem + 4 * B_c * d_head);  // [big, small][warp][k-block][lane]

    // Heavy tiles first: the flat block index, read as (tile rank, head), counts tiles down.
    const long long n_heads = (long long)gridDim.y * gridDim.z;
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int q_tile = gridDim.x - 1 - (int)(flat / n_heads);
    const long long bh = flat % n_heads;   // = batch * NH + head
    const long long batch = bh / gridDim.y;
    const long long head = bh % gridDim.y;
    const int kv_head = (int)head / kv_group;  // grouped-query attention: kv_group query heads per K/V head

    const float* Q_head = Q + batch * q_batch_stride + head * q_head_stride;
    const float* K_head = K + batch * kv_batch_stride + kv_head * kv_head_stride;
    const float* V_head = V + batch * kv_batch_stride + kv_head * kv_head_stride;
    float* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d)

    const int row_start = q_tile * B_r;
    const int rows = min(B_r, T_q - row_start);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row = row_start + 16 * warp;  // this warp's first query row (index in T_q)
    const int row0 = warp_row + g, row1 = row0 + 8;

    // Query row i sees keys j <= i + offset: the causal mask aligned bottom-right when T_q != T_k.
    // Causal: stop at the tile of the last key the block's last row sees. If it sees none, keep
    // tile 0, which every warp skips: the copies of K_0 and V_0 below stay unconditional.
    const int offset = T_k - T_q;
    int T_c = (T_k + B_c - 1) / B_c;
    if (causal) {
        const int last_key = row_start + rows - 1 + offset;
        T_c = min(T_c, max(last_key, 0) / B_c + 1);
    }
    // Per warp, once: the last key its first row sees (causal: warp_row + offset, and its last row
    // 15 more; non-causal: T_k - 1), so that a tile past warp_key + 15 has nothing for the warp and
    // a tile reaching past warp_key needs the mask; -16 when all its rows lie past T_q.
    const int warp_key = warp_row >= T_q ? -16 : causal ? warp_row + offset : T_k - 1;

    // K_j fragment: row 4 (g / 2) + (g % 2) of each 16-key group, chunk (4 kk + t) ^ 4 (g % 2), i.e. chunk
    // 4 (kk ^ (g % 2)) + t: one base for even kk and one for odd kk, the rest is a compile-time offset.
    int K_off[2];
    #pragma unroll
    for (int m = 0; m < 2; ++m)
        K_off[m] = (4 * (g / 2) + g % 2) * d_head + 16 * (m ^ (g % 2)) + 4 * t;
    // V_j fragment: rows 16 u + 4 t + e, columns 32 w + 4 g .. 32 w + 4 g + 3, in chunk (8 w + g) ^ 2 t.
    const int V_off = 4 * t * d_head + 4 * (g ^ (2 * t));

    // K_0 and V_0 start arriving while Q_i is loaded.
    load_tile_async<d_head, B_c, THREADS, false>(K_buf, K_head, kv_row_stride, 0, T_k);
    load_tile_async<d_head, B_c, THREADS, true>(V_buf, V_head, kv_row_stride, 0, T_k);
    copy_async_commit();

    // Q_i's A fragments, once: rows g and g + 8, columns 16 kk + 4 t .. + 3 (two k-blocks), scaled
    // by scale log2(e) so that S_ij is in log2 units, split, and parked in shared memory.
    // Rows past T_q are zeros: finite scores that nobody stores.
    const float scale_log2 = scale * LOG2_E;
    uint4* Q_big_frag = Q_frag + warp * KB * 32 + lane;
    uint4* Q_small_frag = Q_big_frag + WARPS * KB * 32;
    #pragma unroll
    for (int kk = 0; kk < KB / 2; ++kk) {
        float q[2][4];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = h ? row1 : row0;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (row < T_q) {
                v = *(const float4*)&Q_head[(long long)row * q_row_stride + 16 * kk + 4 * t];
            }
            q[h][0] = v.x * scale_log2, q[h][1] = v.y * scale_log2, q[h][2] = v.z * scale_log2, q[h][3] = v.w * scale_log2;
        }
        #pragma unroll
        for (int b = 0; b < 2; ++b) {
            const float a[4] = {q[0][2 * b], q[1][2 * b], q[0][2 * b + 1], q[1][2 * b + 1]};
            unsigned big[4], small[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                big[i] = split ? tf32_big(a[i]) : tf32_big_keep_nan(a[i]);  // a NaN here is 0x7fffffff
                small[i] = tf32_small(a[i], big[i]);
            }
            Q_big_frag[(2 * kk + b) * 32] = make_uint4(big[0], big[1], big[2], big[3]);
            if (split)
                Q_small_frag[(2 * kk + b) * 32] = make_uint4(small[0], small[1], small[2], small[3]);
        }
    }

    float O_acc[ND][4];                    // C layout: rows g, g + 8; columns as in the header
    #pragma unroll
    for (int n = 0; n < ND; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            O_acc[n][i] = 0.0f;
    // Rows g and g + 8; l_i is this lane's share of the row sum, reduced over the quad at the end.
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};

    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        const float* K_frag[2] = {K_buf + (j & 1) * B_c * d_head + K_off[0], K_buf + (j & 1) * B_c * d_head + K_off[1]};
        const float* V_frag = V_buf + (j & 1) * B_c * d_head + V_off;
        // Tile j has landed for every thread, and every warp is done with tile j - 1, whose
        // buffers the copies of tile j + 1 now overwrite.
        copy_async_wait_all();
        __syncthreads();
        if (j + 1 < T_c) {
            load_tile_async<d_head, B_c, THREADS, false>(K_buf + ((j + 1) & 1) * B_c * d_head, K_head, kv_row_stride, col_start + B_c, T_k);
            load_tile_async<d_head, B_c, THREADS, true>(V_buf + ((j + 1) & 1) * B_c * d_head, V_head, kv_row_stride, col_start + B_c, T_k);
            copy_async_commit();
        }
        // A warp none of whose rows sees a key of this tile, or whose rows all lie past T_q, has
        // nothing to do in it.
        if (col_start > warp_key + 15)
            continue;

        // S_ij = Q_i K_j^T, one k-pair (16 columns of d) at a time: with split, a pair's 6 mma
        // start from zero and the pair joins S_ij by a float32 add (truncation stays local).
        float S[NT][4];
        #pragma unroll
        for (int p = 0; p < NT; ++p)
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                S[p][i] = 0.0f;
        #pragma unroll
        for (int kk = 0; kk < KB / 2; ++kk) {
            unsigned Q_big[2][4], Q_small[2][4];
            #pragma unroll
            for (int b = 0; b < 2; ++b) {
                const uint4 qb = Q_big_frag[(2 * kk + b) * 32];
                Q_big[b][0] = qb.x, Q_big[b][1] = qb.y, Q_big[b][2] = qb.z, Q_big[b][3] = qb.w;
                if (split) {
                    const uint4 qs = Q_small_frag[(2 * kk + b) * 32];
                    Q_small[b][0] = qs.x, Q_small[b][1] = qs.y, Q_small[b][2] = qs.z, Q_small[b][3] = qs.w;
                }
            }
            #pragma unroll
            for (int p = 0; p < NT; ++p) {
                // keys 16 (p / 2) + 4 (g / 2) + 2 (p % 2) + g % 2, columns 16 kk + 4 t .. + 3
                const float4 kf = *(const float4*)&K_frag[kk % 2][(16 * (p / 2) + 2 * (p % 2)) * d_head + 16 * (kk & ~1)];
                const float kv[2][2] = {{kf.x, kf.y}, {kf.z, kf.w}};
                float D[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                float (&acc)[4] = (split && kk > 0) ? D : S[p];
                #pragma unroll
                for (int b = 0; b < 2; ++b) {
                    unsigned K_big[2], K_small[2];
                    #pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        K_big[i] = tf32_big(kv[b][i]);
                        K_small[i] = tf32_small(kv[b][i], K_big[i]);
                    }
                    if (split) {
                        mma_tf32(acc, Q_small[b], K_big);
                        mma_tf32(acc, Q_big[b], K_small);
                    }
                    mma_tf32(acc, Q_big[b], K_big);
                }
                if (split && kk > 0) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i)
                        S[p][i] += D[i];
                }
            }
        }

        // Only a tile that reaches past the last key this warp's first row sees (causal: the
        // diagonal; else: the end of the keys) holds masked scores. Select, do not add: whatever
        // sits in a masked score becomes -inf and then exactly 0.
        if (__builtin_expect(col_start + B_c - 1 > warp_key, 0)) {
            // Rows past T_q see keys past T_k: zero-filled, finite scores in rows nobody stores.
            const int key_limit[2] = {causal ? row0 + offset : T_k - 1, causal ? row1 + offset : T_k - 1};
            #pragma unroll
            for (int p = 0; p < NT; ++p)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = col_start + 16 * (p / 2) + 4 * t + 2 * (p % 2) + (i % 2);
                    if (key > key_limit[i / 2])
                        S[p][i] = -INFINITY;
                }
        }

        float alpha[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            // m_new = max(m_i, rowmax(S_ij)), over this lane's keys and then the quad's 4 lanes.
            // Tile 0 holds key 0, which every row that sees a key sees, so m_new is finite from
            // then on. A row that sees none (causal, T_q > T_k) keeps m = -inf, and 2^(-inf + inf)
            // makes its alpha, P_ij, l_i and O_i NaN: its own row only, written as zeros at the end.
            float m_new = m_i[h];
            #pragma unroll
            for (int p = 0; p < NT; ++p)
                m_new = fmaxf(m_new, fmaxf(S[p][2 * h], S[p][2 * h + 1]));
            m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 1));
            m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 2));
            // P_ij = 2^(S_ij - m_new); l_i = 2^(m_i - m_new) l_i + rowsum(P_ij)
            alpha[h] = exp2_approx(m_i[h] - m_new);  // 0 on the first tile: m_i = -inf
            m_i[h] = m_new;
            float row_sum = 0.0f;
            #pragma unroll
            for (int p = 0; p < NT; ++p)
                #pragma unroll
                for (int i = 2 * h; i < 2 * h + 2; ++i) {
                    S[p][i] = exp2_approx(S[p][i] - m_new);
                    row_sum += S[p][i];
                }
            l_i[h] = l_i[h] * alpha[h] + row_sum;
        }

        // P_ij as A fragments: the accumulators of S tile p are the A fragment of k-block p.
        unsigned P_big[NT][4], P_small[NT][4];
        #pragma unroll
        for (int p = 0; p < NT; ++p) {
            const float a[4] = {S[p][0], S[p][2], S[p][1], S[p][3]};
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                P_big[p][i] = tf32_big(a[i]);
                P_small[p][i] = tf32_small(a[i], P_big[p][i]);
            }
        }

        // O_i = 2^(m_i - m_new) O_i + P_ij V_j, 32 columns (4 n-tiles) at a time: P_ij V_j is summed
        // from zero, big x big in O_tile and with split the corrections in O_corr.
        #pragma unroll
        for (int w = 0; w < ND / 4; ++w) {
            float O_tile[4][4], O_corr[4][4];
            #pragma unroll
            for (int z = 0; z < 4; ++z)
                #pragma unroll
                for (int i = 0; i < 4; ++i)
                    O_tile[z][i] = 0.0f, O_corr[z][i] = 0.0f;
            #pragma unroll
            for (int u = 0; u < NT / 2; ++u) {
                // keys 16 u + 4 t + e, columns 32 w + 4 g + z: B operands of n-tiles 4 w + z
                float v[4][4];
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float4 vf = *(const float4*)&V_frag[(16 * u + e) * d_head + 32 * w];
                    v[e][0] = vf.x, v[e][1] = vf.y, v[e][2] = vf.z, v[e][3] = vf.w;
                }
                #pragma unroll
                for (int z = 0; z < 4; ++z) {
                    #pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        unsigned V_big[2], V_small[2];
                        #pragma unroll
                        for (int i = 0; i < 2; ++i) {
                            V_big[i] = tf32_big(v[2 * s + i][z]);
                            V_small[i] = tf32_small(v[2 * s + i][z], V_big[i]);
                        }
                        if (split) {
                            mma_tf32(O_corr[z], P_small[2 * u + s], V_big);
                            mma_tf32(O_corr[z], P_big[2 * u + s], V_small);
                        }
                        mma_tf32(O_tile[z], P_big[2 * u + s], V_big);
                    }
                }
            }
            #pragma unroll
            for (int z = 0; z < 4; ++z)
                #pragma unroll
                for (int i = 0; i < 4; ++i)
                    O_acc[4 * w + z][i] = fmaf(O_acc[4 * w + z][i], alpha[i / 2], split ? O_tile[z][i] + O_corr[z][i] : O_tile[z][i]);
        }
    }

    // Decided here, not before the loop over tiles: one register fewer across it.
    const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;
    // O_i = O_i / l_i, once; l_i is the sum of the quad's 4 shares. Lane t writes columns
    // 32 w + 8 t .. 32 w + 8 t + 7 of its two rows. A row that sees no key is zeros, as in the
    // reference: selected, not scaled, since its l_i is 0 (tiles skipped) or NaN.
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(FULL_WARP, l, 1);
        l += __shfl_xor_sync(FULL_WARP, l, 2);
        const float inv_l = 1.0f / l;
        const int row = h ? row1 : row0;
        const bool sees_key = warp_key + g + 8 * h >= 0;
        if (row < T_q) {
            #pragma unroll
            for (int w = 0; w < ND / 4; ++w) {
                float* dst = O_head + (long long)row * d_head + 32 * w + 8 * t;
                float4 lo = make_float4(O_acc[4 * w][2 * h] * inv_l, O_acc[4 * w + 1][2 * h] * inv_l,
                                        O_acc[4 * w + 2][2 * h] * inv_l, O_acc[4 * w + 3][2 * h] * inv_l);
                float4 hi = make_float4(O_acc[4 * w][2 * h + 1] * inv_l, O_acc[4 * w + 1][2 * h + 1] * inv_l,
                                        O_acc[4 * w + 2][2 * h + 1] * inv_l, O_acc[4 * w + 3][2 * h + 1] * inv_l);
                if (!sees_key)
                    lo = hi = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (o_vec) {
                    *(float4*)dst = lo;
                    *(float4*)(dst + 4) = hi;
                } else {
                    dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
                    dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
                }
            }
            if (lse != nullptr && t == 0)
                lse[bh * T_q + row] = sees_key ? (m_i[h] + __log2f(l)) * LN_2 : INFINITY;
        }
    }
}
