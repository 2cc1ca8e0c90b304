/*
 * b03 - tensor cores: b02's five products on mma.sync m16n8k8 TF32, 3xTF32 for float32 accuracy.
 *
 * The change: b02's partitioning (a block per K_j, V_j looping over the query tiles, dK_j and dV_j in
 * registers, dQ through atomics) with every product issued as
 * mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, each operand x split as v14 splits it, into
 * big = x rounded to TF32 and small = x - big, and a b ~ big_a big_b + big_a small_b + small_a big_b
 * (three mma per product, float32-level accuracy: v14's header has the arithmetic).
 *
 * Why it helps: the products are all of b02's work, and the TF32 pipe runs each at several times the
 * FFMA rate, three times over included (DEVICE.md: 349 TF32 against 51 FFMA TFLOP/s on an H200).
 *
 * The products, per warp (16 keys of K_j: rows 16 w + g and + 8, lane = 4 g + t) and query tile:
 *   S^T = K_j Q_i^T, dP^T = V_j dO_i^T    A: K_j, V_j rows; B: Q_i, dO_i rows as its columns (n = query)
 *   dV_j += P^T dO_i, dK_j += dS^T Q_i    A: P^T, dS^T in the accumulators' layout; B: dO_i, Q_i (k = query)
 *   dQ_i^T += K_j^T dS^T                  (all warps, after a barrier) A: K_j^T; B: dS^T (k = key)
 * The index orders that the sums leave free are chosen as in v14, so that every operand is a register
 * already held or comes from one 16-byte load:
 *   - the reduction over d in S^T and dP^T: in k-pair kk, logical k = t and t + 4 of block b are
 *     columns 16 kk + 4 t + 2 b and + 1 (a thread's operands of two k-blocks are one float4);
 *   - the queries within a group of 16, as the n index of S^T: n-tile p = 2 u + s, logical column n is
 *     query 16 u + 4 (n / 2) + 2 s + n % 2. The accumulators c0, c1 of tile p are then queries
 *     16 u + 4 t + 2 s and + 1, the A layout of the products over the queries when their k = t is query
 *     16 u + 4 t + 2 s and k = t + 4 the next: P^T and dS^T are the accumulators as they stand (a0 = c0,
 *     a1 = c2, a2 = c1, a3 = c3), and a thread's B operands from dO_i and Q_i are rows 16 u + 4 t .. + 3.
 *     Both go to shared memory (dS^T for the dQ product, one float4 per key row and 4 queries, P^T
 *     beside it), and the thread reads its own back for the products over queries: held in registers
 *     through them, they made ptxas spill;
 *   - the columns of dV_j and dK_j: n-tile 4 w + z is column 32 w + 4 n + z (B: a float4 of a row
 *     feeds 4 n-tiles; a thread's 8 values of a row of dK_j are 8 consecutive floats);
 *   - dQ_i^T = K_j^T dS^T, the transpose of dQ_i's share: M is d (m-tile mt: columns 16 mt .. + 15,
 *     the warps taking every (B_c / 16)-th), N the queries (n-tile 4 w + z: query 32 w + 4 n + z, so
 *     that dS^T's rows give float4 B operands), K the keys (k-block 2 u + s: k = t is key 16 u + 4 t +
 *     2 s, k = t + 4 the next).
 * One swizzle serves every tile (K_j, V_j, Q_i, dO_i, P^T, dS^T, rows of d or B_r floats, each starting
 * in bank group 0): 16-byte chunk c of row r sits at c ^ (2 ((r / 4) % 4)) ^ (4 (r % 2)). The two read
 * patterns are rows r, r + 1 (r even) at 4 chunks (S^T's operands) and rows 4 t + e, t < 4, at 2 chunks
 * (the products over queries and keys); the first term tells the second pattern's 4 rows apart, the
 * second the first pattern's 2, and a quarter-warp's 8 loads land in 8 bank groups either way. The XOR
 * touches the 3 low bits of a chunk: a row of d floats is d / 4 chunks, a multiple of 8.
 * Truncation: the tensor core adds into its float32 accumulator toward zero; S^T and dP^T are summed a
 * k-pair at a time (6 mma from zero: the four corrections first, while the sum is below 2^-11 of the
 * products, then the two big x big, so that only those truncate at the pair's magnitude; S's error is
 * P's relative error) and added in float32; each query tile's share of dV_j, dK_j (and each key tile's of
 * dQ_i) goes into fresh accumulators, big x big and the corrections apart, joined in float32: no
 * accumulator runs a chain longer than a tile.
 * Tolerance: the scores still carry about twice plain float32's error (the split keeps 23 of float32's
 * 24 bits, the small x small product is dropped, the tensor core truncates), and where a row sees one
 * key P = exp(scale S - lse) is 1 with that error and dV = P dO shows it against the rule's floor: 3x
 * the plain error is broken by a few draws in 100 at T = 1 (tests/test_backward_numerics.py emulates
 * it), so the rung declares 8. Scores to float32's accuracy (the truncation of each k-block's big x big
 * given back by a second product from -R, Kahan adds) broke 3x far less often, at 1.27-1.29x the time.
 *
 * Pipeline: Q_i and dO_i are double-buffered; the copies (cp.async) of the next query tile start after
 * the first barrier of this one and land while it is computed. Two barriers per query tile: the
 * first hands over the stage, P^T and dS^T, the second dS^T to the dQ product. P comes from a fused
 * exponent, fmaf(S, scale, -lse) times log2(e) (b02's), on ex2.approx.
 *
 * Geometry: backward_dk_dv on grid (T_c, NH_kv, B), heavy first as b02; block 2 B_c threads, B_c / 16
 * warps. Registers: dK_j and dV_j take d / 2 each per thread, S^T and dP^T B_r / 2 each. Loops whose
 * index picks no register (over d in S^T, over queries in dV_j, dK_j, all of dQ's) are left rolled, so
 * that ptxas does not hoist every tile's loads at once: 213 registers at d = 64, B_r = 32 (two blocks
 * of 4 warps per SM), 255 at d = 128. Shared memory, in floats: K_j, V_j (B_c x d each) + 2 stages of
 * Q_i, dO_i (B_r x d each) + P^T, dS^T (B_c x B_r each) + 2 stages of lse_i and D_i (B_r each):
 *   d = 64, B_c = 64, B_r = 32: 4 * (8192 + 4 * 2048 + 2 * 2048 + 128) = 82,432 bytes, two blocks per SM;
 *   d = 128, B_c = 64, B_r = 32: 4 * (16384 + 4 * 4096 + 2 * 2048 + 128) = 147,968 bytes, one;
 *   d = 128, B_c = 128, B_r = 32: 4 * (32768 + 4 * 4096 + 2 * 4096 + 128) = 229,888 bytes, one.
 * At d = 128 the launcher takes B_c = 128: 8 warps an SM (254 registers, no spills; 256 x 256 fill the
 * SM's 65,536) where B_c = 64 ran 4, at 0.73-0.80x SDPA efficient's backward. Measured (H200, two runs,
 * the rungs' order swapped, docs/backward.md#b03): 1.37x of B_c = 64 at 4 x 16 x 2048 causal, 1.39-1.40x
 * at 2 x 16 x 4096 causal, 1.42x at 4 x 16 x 2048 non-causal (1.05-1.10x SDPA efficient); d = 64 is
 * unchanged. B_c = 64 stays declared (config=) for the comparison.
 * (B_r = 64 at d = 64 spilled.) backward_preprocess (D_i a warp a row: dP's order is the tensor core's,
 * which no float32 loop repeats) and backward_dq (b02's) run on 256 threads.
 *
 * Limits: float32; d 64 or 128 (a multiple of 32, whose d / 16 m-tiles the warps share evenly);
 * B_c a multiple of 16, B_r of 32; deterministic = 1 takes turns per query tile as b02.
 *
 * lab.template   d_head, B_r, B_c, deterministic
 * lab.configs    (64, 32, 64, 0), (128, 32, 128, 0), (64, 32, 64, 1), (128, 32, 128, 1), (128, 32, 64, 0), (128, 32, 64, 1)
 * lab.threads    256
 * lab.smem       0
 * lab.phase      backward_preprocess: query tiles
 * lab.phase      backward_dk_dv: key tiles, threads 2 * B_c, smem 4 * (2 * B_c * d_head + 4 * B_r * d_head + 2 * B_c * B_r + 4 * B_r)
 * lab.phase      backward_dq: query tiles
 * lab.dq_accum   true
 * lab.deterministic deterministic
 * lab.supports   noncausal, cross, gqa
 * lab.tf32_products 3
 * lab.tolerance  8
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr int AUX_THREADS = 256;  // backward_preprocess and backward_dq (lab.threads)
constexpr unsigned FULL_WARP = 0xffffffffu;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x = big + small: big is x rounded to TF32 (nearest, ties away), small = x - big exactly (v14).
__device__ __forceinline__ unsigned tf32_big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ unsigned tf32_small(float x, unsigned big) { return __float_as_uint(x - __uint_as_float(big)); }

// Both halves of n values.
template <int n>
__device__ __forceinline__ void split(const float (&x)[n], unsigned (&big)[n], unsigned (&small)[n])
{
    #pragma unroll
    for (int i = 0; i < n; ++i) {
        big[i] = tf32_big(x[i]);
        small[i] = tf32_small(x[i], big[i]);
    }
}

// D = A B + D for one 16x8x8 tile (fragments: v14's header).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2])
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 3xTF32: the corrections into `corr`, big x big into `acc` (one accumulator for both where they are the same).
__device__ __forceinline__ void mma_3xtf32(float (&acc)[4], float (&corr)[4], const unsigned (&a_big)[4],
                                           const unsigned (&a_small)[4], const unsigned (&b_big)[2], const unsigned (&b_small)[2])
{
    mma_tf32(corr, a_small, b_big);
    mma_tf32(corr, a_big, b_small);
    mma_tf32(acc, a_big, b_big);
}

// cp.async: 16 bytes from global to shared memory, or zeros when valid is false (src_size = 0 reads nothing).
__device__ __forceinline__ void copy_async_16(float* dst, const float* src, bool valid)
{
    const unsigned dst_shared = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst_shared), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// The swizzle of every tile: 16-byte chunk c of row r sits at chunk c ^ (2 ((r / 4) % 4)) ^ (4 (r % 2)).
__device__ __forceinline__ int chunk(int r, int c) { return c ^ (((r >> 2) & 3) << 1) ^ ((r & 1) << 2); }
// ... and float `col` of row r of a tile `width` floats wide, at this offset.
template <int width>
__device__ __forceinline__ int at(int r, int col) { return r * width + 4 * chunk(r, col / 4) + col % 4; }

__device__ __forceinline__ float4 load4(const float* tile, int offset) { return *(const float4*)&tile[offset]; }

// Start copying rows row_start .. row_start + rows - 1 (d_head floats each) into a swizzled tile; rows
// at or past `limit` become zeros.
template <int d_head, int rows, int threads>
__device__ __forceinline__ void load_tile_async(float* tile, const float* src, int row_start, int limit)
{
    constexpr int chunks = d_head / 4;
    static_assert((rows * chunks) % threads == 0, "whole passes");
    #pragma unroll
    for (int n = 0; n < rows * chunks / threads; ++n) {
        const int idx = threadIdx.x + n * threads, r = idx / chunks, c = idx % chunks;
        const bool valid = row_start + r < limit;
        copy_async_16(&tile[r * d_head + 4 * chunk(r, c)], valid ? src + (long long)(row_start + r) * d_head + 4 * c : src, valid);
    }
}

// C = A X^T for a warp's 16 rows of A (lane: rows r0 and r0 + 8) and the B_r rows of X as n-tiles
// (n-tile p = 2 u + s, logical column n: row 16 u + 4 (n / 2) + 2 s + n % 2), over d, a k-pair (16
// columns: k = t and t + 4 of block b are columns 16 kk + 4 t + 2 b and + 1) at a time, its 6 mma
// from zero and the pair added in float32.
template <int d_head, int NT>
__device__ __forceinline__ void product_over_d(float (&C)[NT][4], const float* A, const float* X, int r0)
{
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    #pragma unroll
    for (int p = 0; p < NT; ++p)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            C[p][e] = 0.0f;
    #pragma unroll 1
    for (int kk = 0; kk < d_head / 16; ++kk) {
        // A: rows r0, r0 + 8, columns 16 kk + 4 t .. + 3, the fragments of k-blocks b = 0, 1
        const float4 a0 = load4(A, r0 * d_head + 4 * chunk(r0, 4 * kk + t));
        const float4 a1 = load4(A, (r0 + 8) * d_head + 4 * chunk(r0 + 8, 4 * kk + t));
        const float a[2][4] = {{a0.x, a1.x, a0.y, a1.y}, {a0.z, a1.z, a0.w, a1.w}};
        unsigned a_big[2][4], a_small[2][4];
        split(a[0], a_big[0], a_small[0]);
        split(a[1], a_big[1], a_small[1]);
        #pragma unroll
        for (int p = 0; p < NT; ++p) {
            // B: row 16 (p / 2) + 4 (g / 2) + 2 (p % 2) + g % 2 of X, the same columns
            const int r = 16 * (p / 2) + 4 * (g / 2) + 2 * (p % 2) + g % 2;
            const float4 x = load4(X, r * d_head + 4 * chunk(r, 4 * kk + t));
            const float b[2][2] = {{x.x, x.y}, {x.z, x.w}};
            unsigned b_big[2][2], b_small[2][2];
            split(b[0], b_big[0], b_small[0]);
            split(b[1], b_big[1], b_small[1]);
            // The corrections of both k-blocks first, while the sum is small, then big x big: only the last
            // two mma truncate at the pair's magnitude.
            float pair[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int k = 0; k < 2; ++k) {
                mma_tf32(pair, a_small[k], b_big[k]);
                mma_tf32(pair, a_big[k], b_small[k]);
            }
            mma_tf32(pair, a_big[0], b_big[0]);
            mma_tf32(pair, a_big[1], b_big[1]);
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                C[p][e] += pair[e];
        }
    }
}

// acc += A X for a warp's 16 rows of A (P^T or dS^T, read back from the tile A_T where this thread stored
// them: rows r0, r0 + 8, queries 16 u + 4 t .. + 3, product_over_d's n-tiles 2 u and 2 u + 1, whose
// accumulators are the A fragments of k-blocks 2 u and 2 u + 1: a0 = c0, a1 = c2, a2 = c1, a3 = c3) and
// X's B_r rows (k = t of block 2 u + s is row 16 u + 4 t + 2 s, k = t + 4 the next), 32 columns of X
// (4 n-tiles: n-tile 4 w + z, n = column 32 w + 4 n + z) at a time into fresh accumulators, big x big
// and the corrections apart.
template <int d_head, int B_r>
__device__ __forceinline__ void product_over_queries(float (&acc)[d_head / 8][4], const float* A_T, const float* X, int r0)
{
    // Z of the 4 n-tiles of 32 columns at a time: all 4 (float4 B loads, conflict-free) at d = 64; 2 at
    // d = 128 (float2 loads, 2-way bank conflicts), where 4 fresh pairs of accumulators on top of dK_j
    // and dV_j's 128 registers made ptxas spill.
    constexpr int Z = d_head > 64 ? 2 : 4;
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    #pragma unroll
    for (int w = 0; w < d_head / 32; ++w)
        #pragma unroll
        for (int part = 0; part < 4 / Z; ++part) {
            float tile[Z][4], corr[Z][4];  // n-tiles 4 w + Z part + z
            #pragma unroll
            for (int z = 0; z < Z; ++z)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    tile[z][e] = 0.0f, corr[z][e] = 0.0f;
            #pragma unroll 1
            for (int u = 0; u < B_r / 16; ++u) {
                // A: P^T or dS^T as this thread stored them, rows r0 and r0 + 8, queries 16 u + 4 t .. + 3
                const float4 a0 = load4(A_T, r0 * B_r + 4 * chunk(r0, 4 * u + t));
                const float4 a1 = load4(A_T, (r0 + 8) * B_r + 4 * chunk(r0 + 8, 4 * u + t));
                const float a[2][4] = {{a0.x, a1.x, a0.y, a1.y}, {a0.z, a1.z, a0.w, a1.w}};
                float x[4][Z];  // B: rows 16 u + 4 t + e, columns 32 w + 4 g + Z part .. + Z - 1
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 16 * u + 4 * t + e;
                    const float* src = &X[r * d_head + 4 * chunk(r, 8 * w + g) + Z * part];
                    if (Z == 4) {
                        const float4 f = *(const float4*)src;
                        x[e][0] = f.x, x[e][1] = f.y, x[e][Z - 2] = f.z, x[e][Z - 1] = f.w;  // Z - 2, Z - 1: 2, 3
                    } else {
                        const float2 f = *(const float2*)src;
                        x[e][0] = f.x, x[e][1] = f.y;
                    }
                }
                #pragma unroll
                for (int s = 0; s < 2; ++s) {
                    unsigned a_big[4], a_small[4];
                    split(a[s], a_big, a_small);
                    #pragma unroll
                    for (int z = 0; z < Z; ++z) {
                        const float b[2] = {x[2 * s][z], x[2 * s + 1][z]};
                        unsigned b_big[2], b_small[2];
                        split(b, b_big, b_small);
                        mma_3xtf32(tile[z], corr[z], a_big, a_small, b_big, b_small);
                    }
                }
            }
            #pragma unroll
            for (int z = 0; z < Z; ++z)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[4 * w + Z * part + z][e] += tile[z][e] + corr[z][e];
        }
}

// The deterministic order (b02's): wait until the turn of a query tile is `mine`; hand it on.
__device__ __forceinline__ void wait_turn(const int* turn, int mine)
{
    if (threadIdx.x == 0) {
        int now;
        do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(turn) : "memory");
        } while (now != mine);
    }
    __syncthreads();
}

__device__ __forceinline__ void pass_turn(int* turn, int next)
{
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(turn), "r"(next) : "memory");
}

// D_i = rowsum(dO_i o O_i), one warp a row; dQ_accum's rows and the tile's turn zeroed.
template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_preprocess(const float* __restrict__ /* Q */, const float* __restrict__ /* K */, const float* __restrict__ /* V */,
                    const float* __restrict__ O, const float* __restrict__ dO, const float* __restrict__ /* lse */,
                    float* __restrict__ /* dQ */, float* __restrict__ /* dK */, float* __restrict__ /* dV */,
                    float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
                    int T_q, int T_k, int kv_group, int causal, float scale)
{
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // = batch * NH + head
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < B_r; r += AUX_THREADS / 32) {
        const int row = blockIdx.x * B_r + r;
        if (row >= T_q)
            break;
        const long long offset = (bh * T_q + row) * d_head;
        float sum = 0.0f;
        #pragma unroll
        for (int c = lane; c < d_head; c += 32) {
            sum = fmaf(dO[offset + c], O[offset + c], sum);
            dQ_accum[offset + c] = 0.0f;
        }
        #pragma unroll
        for (int m = 16; m > 0; m /= 2)
            sum += __shfl_xor_sync(FULL_WARP, sum, m);
        if (lane == 0)
            D[bh * T_q + row] = sum;
    }
    if (threadIdx.x == 0)
        dQ_turns[bh * gridDim.x + blockIdx.x] = 0;  // key tile 0 adds first
}

// b02's: dQ = scale dQ_accum.
template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_dq(const float* __restrict__ /* Q */, const float* __restrict__ /* K */, const float* __restrict__ /* V */,
            const float* __restrict__ /* O */, const float* __restrict__ /* dO */, const float* __restrict__ /* lse */,
            float* __restrict__ dQ, float* __restrict__ /* dK */, float* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ dQ_accum, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T_q - row_start);
    const long long offset = (bh * T_q + row_start) * d_head;
    for (int idx = threadIdx.x; idx < rows * d_head / 4; idx += AUX_THREADS) {
        const float4 a = *(const float4*)&dQ_accum[offset + 4 * idx];
        *(float4*)&dQ[offset + 4 * idx] = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);
    }
}

template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(2 * B_c, 1)
backward_dk_dv(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
               const float* __restrict__ /* O */, const float* __restrict__ dO, const float* __restrict__ lse,
               float* __restrict__ /* dQ */, float* __restrict__ dK, float* __restrict__ dV,
               float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
               int T_q, int T_k, int kv_group, int causal, float scale)
{
    constexpr int THREADS = 2 * B_c;
    constexpr int WARPS = B_c / 16;
    constexpr int NT = B_r / 8;              // n-tiles of S^T = k-blocks of the products over queries
    constexpr int ND = d_head / 8;           // n-tiles of dV_j, dK_j
    constexpr int M_TILES = d_head / 16 / WARPS;  // m-tiles of dQ_i^T per warp
    static_assert(d_head % 32 == 0 && B_r % 32 == 0 && B_c % 16 == 0 && (d_head / 16) % WARPS == 0, "tile shapes");

    extern __shared__ __align__(16) float smem[];
    float* K_j = smem;                       // B_c x d, swizzled
    float* V_j = K_j + B_c * d_head;         // B_c x d
    float* Q_buf = V_j + B_c * d_head;       // 2 stages x B_r x d
    float* dO_buf = Q_buf + 2 * B_r * d_head;  // 2 stages x B_r x d
    float* dS_T = dO_buf + 2 * B_r * d_head;   // B_c x B_r: dS_ij^T, swizzled
    float* P_T = dS_T + B_c * B_r;           // B_c x B_r: P_ij^T, swizzled
    float* lse_buf = P_T + B_c * B_r;        // 2 stages x B_r: lse_i, +inf past T_q
    float* D_buf = lse_buf + 2 * B_r;        // 2 stages x B_r

    // Heavy tiles first (b02's): the flat block index, read as (key tile, K/V head), counts key tiles up.
    const long long n_heads = (long long)gridDim.y * gridDim.z;  // = B * NH_kv
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int j = (int)(flat / n_heads);
    const long long kv_bh = flat % n_heads;  // = batch * NH_kv + K/V head
    const int col_start = j * B_c;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int offset = T_k - T_q;            // query row i sees keys <= i + offset (causal, bottom-right)
    const int T_r = (T_q + B_r - 1) / B_r;
    const int first_tile = (causal ? max(0, col_start - offset) : 0) / B_r;  // the first query tile that sees key col_start
    const int tiles_per_head = max(0, T_r - first_tile);
    const int steps = kv_group * tiles_per_head;  // (query head, query tile) pairs, head-major

    // The copies of step n: Q_i and dO_i of query head kv_bh * kv_group + n / tiles_per_head, query tile
    // first_tile + n % tiles_per_head, into stage n % 2; its lse_i and D_i by plain loads.
    auto start_step = [&](int n) {
        const long long bh = kv_bh * kv_group + n / tiles_per_head;
        const int row_start = (first_tile + n % tiles_per_head) * B_r;
        load_tile_async<d_head, B_r, THREADS>(Q_buf + (n % 2) * B_r * d_head, Q + bh * T_q * d_head, row_start, T_q);
        load_tile_async<d_head, B_r, THREADS>(dO_buf + (n % 2) * B_r * d_head, dO + bh * T_q * d_head, row_start, T_q);
        copy_async_commit();
        for (int r = threadIdx.x; r < B_r; r += THREADS) {
            const bool valid = row_start + r < T_q;
            lse_buf[(n % 2) * B_r + r] = valid ? lse[bh * T_q + row_start + r] : INFINITY;
            D_buf[(n % 2) * B_r + r] = valid ? D[bh * T_q + row_start + r] : 0.0f;
        }
    };

    if (steps > 0) {  // K_j and V_j go with step 0's copies, in its commit group
        load_tile_async<d_head, B_c, THREADS>(K_j, K + kv_bh * T_k * d_head, col_start, T_k);
        load_tile_async<d_head, B_c, THREADS>(V_j, V + kv_bh * T_k * d_head, col_start, T_k);
        start_step(0);
    }

    float dK_acc[ND][4], dV_acc[ND][4];      // C layout: keys 16 w + g, + 8; columns as in the header
    #pragma unroll
    for (int n = 0; n < ND; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            dK_acc[n][i] = 0.0f, dV_acc[n][i] = 0.0f;

    const int key0 = 16 * warp + g;          // this lane's keys in the tile: key0 and key0 + 8
    for (int n = 0; n < steps; ++n) {
        const long long bh = kv_bh * kv_group + n / tiles_per_head;
        const int i = first_tile + n % tiles_per_head;
        const int row_start = i * B_r;
        const float* Q_i = Q_buf + (n % 2) * B_r * d_head;
        const float* dO_i = dO_buf + (n % 2) * B_r * d_head;
        const float* lse_i = lse_buf + (n % 2) * B_r;
        const float* D_i = D_buf + (n % 2) * B_r;
        // Step n has landed for every thread, and every thread is done with step n - 1 (its stage and
        // dS^T), so step n + 1's copies may overwrite that stage.
        copy_async_wait_all();
        __syncthreads();
        if (n + 1 < steps)
            start_step(n + 1);

        // S^T = K_j Q_i^T and dP^T = V_j dO_i^T
        float S[NT][4], dP[NT][4];
        product_over_d<d_head, NT>(S, K_j, Q_i, key0);
        product_over_d<d_head, NT>(dP, V_j, dO_i, key0);

        // P^T = exp(scale S^T - lse_i), 0 where masked; dS^T = P^T o (dP^T - D_i), in place. Accumulator e of
        // n-tile p = 2 u + s is key key0 + 8 (e / 2), query 16 u + 4 t + 2 s + e % 2. Both go to shared
        // memory, one float4 per key row and 4 queries.
        const bool masked = (causal && col_start + 16 * warp + 15 > row_start + offset) || col_start + 16 * warp + 16 > T_k;
        #pragma unroll
        for (int u = 0; u < NT / 2; ++u) {
            const float4 l4 = *(const float4*)&lse_i[16 * u + 4 * t];
            const float4 d4 = *(const float4*)&D_i[16 * u + 4 * t];
            const float lq[4] = {l4.x, l4.y, l4.z, l4.w}, dq[4] = {d4.x, d4.y, d4.z, d4.w};
            #pragma unroll
            for (int s = 0; s < 2; ++s)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = col_start + key0 + 8 * (e / 2);
                    const int q = 2 * s + e % 2;  // query 16 u + 4 t + q
                    const bool visible = !masked || (key < T_k && (!causal || key <= row_start + 16 * u + 4 * t + q + offset));
                    const float P = visible ? exp2_approx(fmaf(S[2 * u + s][e], scale, -lq[q]) * LOG2_E) : 0.0f;
                    S[2 * u + s][e] = P;
                    dP[2 * u + s][e] = P * (dP[2 * u + s][e] - dq[q]);
                }
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = key0 + 8 * h;
                *(float4*)&dS_T[row * B_r + 4 * chunk(row, 4 * u + t)] =
                    make_float4(dP[2 * u][2 * h], dP[2 * u][2 * h + 1], dP[2 * u + 1][2 * h], dP[2 * u + 1][2 * h + 1]);
                *(float4*)&P_T[row * B_r + 4 * chunk(row, 4 * u + t)] =
                    make_float4(S[2 * u][2 * h], S[2 * u][2 * h + 1], S[2 * u + 1][2 * h], S[2 * u + 1][2 * h + 1]);
            }
        }

        // dV_j += P^T dO_i, dK_j += dS^T Q_i (this thread's own P^T and dS^T: no barrier needed)
        product_over_queries<d_head, B_r>(dV_acc, P_T, dO_i, key0);
        product_over_queries<d_head, B_r>(dK_acc, dS_T, Q_i, key0);

        // dQ_i^T's share = K_j^T dS^T: this warp's m-tiles (columns 16 mt .. + 15 of d), every query.
        __syncthreads();  // dS^T is whole
        int* turn = dQ_turns + bh * T_r + i;
        if (deterministic)
            wait_turn(turn, j);
        float* acc_head = dQ_accum + bh * T_q * d_head;
        #pragma unroll 1
        for (int m = 0; m < M_TILES; ++m) {
            const int mt = warp + WARPS * m;
            #pragma unroll 1
            for (int w = 0; w < B_r / 32; ++w) {
                float tile[4][4], corr[4][4];  // n-tiles 4 w + z: queries 32 w + 4 n + z
                #pragma unroll
                for (int z = 0; z < 4; ++z)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        tile[z][e] = 0.0f, corr[z][e] = 0.0f;
                #pragma unroll 1
                for (int u = 0; u < B_c / 16; ++u) {
                    // A = K_j^T: keys 16 u + 4 t + e (k-block 2 u + s: e = 2 s, 2 s + 1), columns 16 mt + g, + 8
                    float ka[4][2];
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        #pragma unroll
                        for (int h = 0; h < 2; ++h)
                            ka[e][h] = K_j[at<d_head>(16 * u + 4 * t + e, 16 * mt + g + 8 * h)];
                    // B = dS^T: keys 16 u + 4 t + e, queries 32 w + 4 g .. + 3
                    float x[4][4];
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = 16 * u + 4 * t + e;
                        const float4 f = load4(dS_T, row * B_r + 4 * chunk(row, 8 * w + g));
                        x[e][0] = f.x, x[e][1] = f.y, x[e][2] = f.z, x[e][3] = f.w;
                    }
                    #pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        const float a[4] = {ka[2 * s][0], ka[2 * s][1], ka[2 * s + 1][0], ka[2 * s + 1][1]};
                        unsigned a_big[4], a_small[4];
                        split(a, a_big, a_small);
                        #pragma unroll
                        for (int z = 0; z < 4; ++z) {
                            const float b[2] = {x[2 * s][z], x[2 * s + 1][z]};
                            unsigned b_big[2], b_small[2];
                            split(b, b_big, b_small);
                            mma_3xtf32(tile[z], corr[z], a_big, a_small, b_big, b_small);
                        }
                    }
                }
                // Accumulator e of n-tile 4 w + z: column 16 mt + g + 8 (e / 2), query 32 w + 8 t + 4 (e % 2) + z.
                #pragma unroll
                for (int z = 0; z < 4; ++z)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = row_start + 32 * w + 8 * t + 4 * (e % 2) + z;
                        if (row < T_q)
                            atomicAdd(&acc_head[(long long)row * d_head + 16 * mt + g + 8 * (e / 2)], tile[z][e] + corr[z][e]);
                    }
            }
        }
        if (deterministic)
            pass_turn(turn, j + 1);
    }

    // dK_j = scale sum dS^T Q, dV_j: lane t writes columns 32 w + 8 t .. + 7 of its keys; none past T_k.
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = col_start + key0 + 8 * h;
        if (key < T_k) {
            #pragma unroll
            for (int w = 0; w < d_head / 32; ++w) {
                const long long offset_out = (kv_bh * T_k + key) * d_head + 32 * w + 8 * t;
                *(float4*)&dK[offset_out] = make_float4(dK_acc[4 * w][2 * h] * scale, dK_acc[4 * w + 1][2 * h] * scale,
                                                        dK_acc[4 * w + 2][2 * h] * scale, dK_acc[4 * w + 3][2 * h] * scale);
                *(float4*)&dK[offset_out + 4] = make_float4(dK_acc[4 * w][2 * h + 1] * scale, dK_acc[4 * w + 1][2 * h + 1] * scale,
                                                            dK_acc[4 * w + 2][2 * h + 1] * scale, dK_acc[4 * w + 3][2 * h + 1] * scale);
                *(float4*)&dV[offset_out] = make_float4(dV_acc[4 * w][2 * h], dV_acc[4 * w + 1][2 * h],
                                                        dV_acc[4 * w + 2][2 * h], dV_acc[4 * w + 3][2 * h]);
                *(float4*)&dV[offset_out + 4] = make_float4(dV_acc[4 * w][2 * h + 1], dV_acc[4 * w + 1][2 * h + 1],
                                                            dV_acc[4 * w + 2][2 * h + 1], dV_acc[4 * w + 3][2 * h + 1]);
            }
        }
    }
}
