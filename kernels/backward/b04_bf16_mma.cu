/*
 * b04 - bf16 and fp16 on mma.sync m16n8k16: 16-bit Q, K, V, O, dO and gradients, float32 accumulation,
 * P^T and dS^T straight from the accumulators into the A operands, every other operand by ldmatrix.
 *
 * The change: b03's partitioning and products (a block per K_j, V_j; warps own 16 keys; S^T, dP^T,
 * then dV_j += P^T dO_i, dK_j += dS^T Q_i, and dQ_i^T's share K_j^T dS^T through atomics), on 16-bit
 * data: mma.sync.aligned.m16n8k16 with float32 accumulators, one mma per product where b03 issued
 * three, its operands loaded by ldmatrix from XOR-swizzled shared memory (v15's swizzle).
 *
 * Why it helps: half the bytes to move and keep, and the 16-bit tensor-core rate twice TF32's with a
 * k of 16 per instruction; and v15's layouts need no index games:
 *   - the accumulators of two n-tiles of S^T (lane: keys g, g + 8; queries 2 t, 2 t + 1 of each) are
 *     exactly the A fragment of a 16 x 16 tile with the queries as k: P^T (and dS^T) are rounded to
 *     16 bits in place (cvt.rn.bf16x2) and multiplied at once, as v15 multiplies P_ij;
 *   - ldmatrix reads 8 x 8 blocks of 16-bit values with one 16-byte row per lane: plain for an
 *     operand whose rows are its m or n index (K_j, V_j as A of S^T and dP^T; Q_i, dO_i as B of them),
 *     .trans for one whose rows are its k index (dO_i, Q_i as B of dV_j and dK_j; K_j as the A of
 *     K_j^T dS^T, the blocks transposed; dS^T as its B). Every tile is stored as it arrives, rows of
 *     keys or queries, swizzled so that the 8 rows one ldmatrix phase reads fall in 8 bank groups;
 *     dS^T (B_c x B_r, 16 bits) goes to shared memory as 32-bit pairs, the accumulators' layout.
 * As in the reference's recipe (kernels.reference_attention_backward), P^T and dS^T are rounded to the
 * dtype before the products that take them, the products accumulate in float32, D_i comes from the
 * 16-bit O and dO, and dK_j, dV_j and dQ are rounded to the dtype once, at the end. The accumulators
 * take each product directly: the float32 accumulator's truncation is far below 16-bit rounding.
 *
 * Geometry: backward_dk_dv on grid (T_c, NH_kv, B), heavy first as b02; block 2 B_c threads, B_c / 16
 * warps; B_c = 128 by preference (8 warps: half the reloads of Q_i and dO_i and half the dQ atomics of
 * B_c = 64, for the same warps per SM). Per query tile a warp issues (d / 16) (B_r / 8) mma for S^T and
 * as many for dP^T, dV_j and dK_j, and its share of dQ^T's: the warps split dQ^T's d / 16 m-tiles, and
 * the queries too where there are more warps than m-tiles. Registers per thread: dK_j and dV_j d / 2
 * each, S^T and dP^T B_r / 2 each (209 in all at d = 64, B_r = 64, B_c = 128; about 235 at d = 128).
 * Q_i and dO_i are double-buffered through cp.async as in b03. Shared memory, 2-byte elements: K_j, V_j
 * (B_c x d each) + 2 stages of Q_i, dO_i (B_r x d each) + dS^T (B_c x B_r), then 2 stages of lse_i and
 * D_i (float32, B_r each):
 *   d = 64, B_r = 64, B_c = 128: 2 * (2 * 8192 + 4 * 4096 + 8192) + 4 * 256 = 82,944 bytes;
 *   d = 64, B_r = 64, B_c = 64: 2 * (2 * 4096 + 4 * 4096 + 4096) + 4 * 256 = 58,368 bytes;
 *   d = 128, B_r = 32, B_c = 128: 2 * (2 * 16384 + 4 * 4096 + 4096) + 4 * 128 = 107,008 bytes;
 *   d = 128, B_r = 32, B_c = 64: 2 * (2 * 8192 + 4 * 4096 + 2048) + 4 * 128 = 70,144 bytes.
 * backward_preprocess (D_i from the 16-bit O and dO, in float32, a warp a row; dQ_accum cleared) and
 * backward_dq (dQ = scale dQ_accum rounded to the dtype, b02's on 16-bit data) run on 256 threads.
 *
 * Limits: d 64 or 128; B_c a multiple of 16 whose warps share dQ^T's tiles evenly (static_assert),
 * B_r a multiple of 16; rows on 16-byte boundaries (the launcher's copies are). dtype_id 0 is
 * bfloat16, 1 float16 (lab.dtype_param); deterministic = 1 takes turns per query tile as b02 (declared
 * for the B_c = 64 tiles: the option is there for reproducibility, not speed).
 *
 * lab.template    d_head, B_r, B_c, dtype_id, deterministic
 * lab.configs     (64, 64, 128, 0, 0), (64, 64, 128, 1, 0), (64, 64, 64, 0, 0), (64, 64, 64, 1, 0), (128, 32, 128, 0, 0), (128, 32, 128, 1, 0), (128, 32, 64, 0, 0), (128, 32, 64, 1, 0), (64, 64, 64, 0, 1), (64, 64, 64, 1, 1), (128, 32, 64, 0, 1), (128, 32, 64, 1, 1)
 * lab.threads     256
 * lab.smem        0
 * lab.phase       backward_preprocess: query tiles
 * lab.phase       backward_dk_dv: key tiles, threads 2 * B_c, smem 2 * (2 * B_c * d_head + 4 * B_r * d_head + B_c * B_r) + 16 * B_r
 * lab.phase       backward_dq: query tiles
 * lab.dq_accum    true
 * lab.deterministic deterministic
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr int AUX_THREADS = 256;  // backward_preprocess and backward_dq (lab.threads)
constexpr unsigned FULL_WARP = 0xffffffffu;

// One bfloat16 or float16 value as raw bits: the mma and cvt instructions decide how they read.
using element = unsigned short;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// A 16-bit value as float32 (exact), and two floats rounded to nearest into one register, lo low.
template <int dtype_id>
__device__ __forceinline__ float to_float(element x)
{
    if (dtype_id == 0)
        return __uint_as_float((unsigned)x << 16);
    float y;
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x));
    return y;
}

template <int dtype_id>
__device__ __forceinline__ unsigned pack_rounded(float lo, float hi)
{
    unsigned r;
    if (dtype_id == 0)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// D += A B for one m16n8k16 tile: A 16 x 16 (4 registers of 2 values), B 16 x 8 (2), D 16 x 8 fp32 (4).
template <int dtype_id>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1)
{
    if (dtype_id == 0)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 matrices of 16-bit values: lanes 8 i .. 8 i + 7 give the row addresses of matrix i,
// register i receives it as an mma fragment (lane l: row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// The same, each matrix transposed: lane l receives rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void store_shared_u32(unsigned address, unsigned value)
{
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(address), "r"(value));
}

// cp.async: 16 bytes from global to shared memory, or zeros when valid is false (src_size = 0 reads nothing).
__device__ __forceinline__ void copy_async_16(unsigned dst, const element* src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// v15's swizzle: byte offset of 16-byte chunk c (8 values) of row r in a tile `width` values wide.
// An ldmatrix phase reads chunk c of 8 consecutive rows, the first a multiple of 8: a row of 8 or more
// chunks starts in bank group 0 and c ^ (r % 8) spreads the 8 rows; a row of 4 chunks (dS^T at
// B_r = 32) puts two rows in a 128-byte line, and c ^ ((r / 2) % 4) spreads the pairs.
template <int width>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    constexpr int chunks = width / 8;
    constexpr int phases = chunks >= 8 ? 8 : chunks;
    return r * width * 2 + 16 * (c ^ ((r / (8 / phases)) % phases));
}

// Start copying rows row_start .. row_start + rows - 1 (d_head values each) into a swizzled tile;
// rows at or past `limit` become zeros.
template <int d_head, int rows, int threads>
__device__ __forceinline__ void load_tile_async(unsigned tile, const element* src, int row_start, int limit)
{
    constexpr int chunks = d_head / 8;
    static_assert((rows * chunks) % threads == 0, "whole passes");
    #pragma unroll
    for (int n = 0; n < rows * chunks / threads; ++n) {
        const int idx = threadIdx.x + n * threads, r = idx / chunks, c = idx % chunks;
        const bool valid = row_start + r < limit;
        copy_async_16(tile + swizzled<d_head>(r, c), valid ? src + (long long)(row_start + r) * d_head + 8 * c : src, valid);
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

// D_i = rowsum(dO_i o O_i) in float32 from the 16-bit values, one warp a row; dQ_accum's rows and the
// tile's turn zeroed.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_preprocess(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
                    const element* __restrict__ O, const element* __restrict__ dO, const float* __restrict__ /* lse */,
                    element* __restrict__ /* dQ */, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
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
            sum = fmaf(to_float<dtype_id>(dO[offset + c]), to_float<dtype_id>(O[offset + c]), sum);
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

// dQ = scale dQ_accum, rounded to the dtype, 4 values at a time.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_dq(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
            const element* __restrict__ /* O */, const element* __restrict__ /* dO */, const float* __restrict__ /* lse */,
            element* __restrict__ dQ, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ dQ_accum, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T_q - row_start);
    const long long offset = (bh * T_q + row_start) * d_head;
    for (int idx = threadIdx.x; idx < rows * d_head / 4; idx += AUX_THREADS) {
        const float4 a = *(const float4*)&dQ_accum[offset + 4 * idx];
        *(uint2*)&dQ[offset + 4 * idx] = make_uint2(pack_rounded<dtype_id>(a.x * scale, a.y * scale),
                                                    pack_rounded<dtype_id>(a.z * scale, a.w * scale));
    }
}

template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(2 * B_c, 1)
backward_dk_dv(const element* __restrict__ Q, const element* __restrict__ K, const element* __restrict__ V,
               const element* __restrict__ /* O */, const element* __restrict__ dO, const float* __restrict__ lse,
               element* __restrict__ /* dQ */, element* __restrict__ dK, element* __restrict__ dV,
               float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
               int T_q, int T_k, int kv_group, int causal, float scale)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    constexpr int THREADS = 2 * B_c;
    constexpr int WARPS = B_c / 16;
    constexpr int NT = B_r / 8;              // n-tiles of S^T (queries 8 p .. 8 p + 7)
    constexpr int ND = d_head / 8;           // n-tiles of dV_j, dK_j (columns 8 n .. 8 n + 7)
    // dQ_i^T (d x B_r) among the warps: M_WARPS of them across its d / 16 m-tiles, M_TILES each; the
    // rest, if more warps than m-tiles, split the queries into N_GROUPS of NT_E n-tiles each.
    constexpr int M_WARPS = WARPS < d_head / 16 ? WARPS : d_head / 16;
    constexpr int M_TILES = d_head / 16 / M_WARPS;
    constexpr int N_GROUPS = WARPS / M_WARPS;
    constexpr int NT_E = NT / N_GROUPS;
    constexpr unsigned KV_BYTES = B_c * d_head * 2, QO_BYTES = B_r * d_head * 2;
    static_assert((d_head == 64 || d_head == 128) && B_r % 16 == 0 && B_c % 16 == 0, "tile shapes");
    static_assert((d_head / 16) % M_WARPS == 0 && WARPS % M_WARPS == 0 && NT_E % 2 == 0 && NT_E * N_GROUPS == NT,
                  "dQ's tiles shared evenly among the warps, pairs of n-tiles each");

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned K_j = (unsigned)__cvta_generic_to_shared(smem);  // B_c x d, swizzled
    const unsigned V_j = K_j + KV_BYTES;                            // B_c x d
    const unsigned Q_buf = V_j + KV_BYTES;                          // 2 stages x B_r x d
    const unsigned dO_buf = Q_buf + 2 * QO_BYTES;                   // 2 stages x B_r x d
    const unsigned dS_T = dO_buf + 2 * QO_BYTES;                    // B_c x B_r, swizzled
    float* lse_buf = (float*)(smem + 2 * KV_BYTES + 4 * QO_BYTES + B_c * B_r * 2);  // 2 stages x B_r, +inf past T_q
    float* D_buf = lse_buf + 2 * B_r;                               // 2 stages x B_r

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
        load_tile_async<d_head, B_r, THREADS>(Q_buf + (n % 2) * QO_BYTES, Q + bh * T_q * d_head, row_start, T_q);
        load_tile_async<d_head, B_r, THREADS>(dO_buf + (n % 2) * QO_BYTES, dO + bh * T_q * d_head, row_start, T_q);
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

    float dK_acc[ND][4], dV_acc[ND][4];      // keys 16 w + g (e < 2), + 8; columns 8 n + 2 t + e % 2
    #pragma unroll
    for (int n = 0; n < ND; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e)
            dK_acc[n][e] = 0.0f, dV_acc[n][e] = 0.0f;

    const int key0 = 16 * warp;              // the warp's first key in the tile
    for (int n = 0; n < steps; ++n) {
        const long long bh = kv_bh * kv_group + n / tiles_per_head;
        const int i = first_tile + n % tiles_per_head;
        const int row_start = i * B_r;
        const unsigned Q_i = Q_buf + (n % 2) * QO_BYTES, dO_i = dO_buf + (n % 2) * QO_BYTES;
        const float* lse_i = lse_buf + (n % 2) * B_r;
        const float* D_i = D_buf + (n % 2) * B_r;
        // Step n has landed for every thread, and every thread is done with step n - 1 (its stage and
        // dS^T), so step n + 1's copies may overwrite that stage.
        copy_async_wait_all();
        __syncthreads();
        if (n + 1 < steps)
            start_step(n + 1);

        // S^T = K_j Q_i^T and dP^T = V_j dO_i^T. A: the warp's 16 rows of K_j (V_j), matrices (rows 0-7,
        // d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15) = a0 .. a3. B: rows of Q_i
        // (dO_i) are the n index, so plain ldmatrix: (queries 0-7, d 0-7), (queries 0-7, d 8-15),
        // (queries 8-15, d 0-7), (queries 8-15, d 8-15) = b0, b1 of n-tile 2 np and of 2 np + 1.
        float S[NT][4], dP[NT][4];
        #pragma unroll
        for (int p = 0; p < NT; ++p)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                S[p][e] = 0.0f, dP[p][e] = 0.0f;
        #pragma unroll 1
        for (int ks = 0; ks < d_head / 16; ++ks) {
            unsigned Ka[4], Va[4];
            ldmatrix_x4(Ka, K_j + swizzled<d_head>(key0 + lane % 16, 2 * ks + lane / 16));
            ldmatrix_x4(Va, V_j + swizzled<d_head>(key0 + lane % 16, 2 * ks + lane / 16));
            #pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned Qb[4], Ob[4];
                ldmatrix_x4(Qb, Q_i + swizzled<d_head>(16 * np + lane % 8 + 8 * (lane / 16), 2 * ks + (lane / 8) % 2));
                ldmatrix_x4(Ob, dO_i + swizzled<d_head>(16 * np + lane % 8 + 8 * (lane / 16), 2 * ks + (lane / 8) % 2));
                mma_m16n8k16<dtype_id>(S[2 * np], Ka, Qb[0], Qb[1]);
                mma_m16n8k16<dtype_id>(S[2 * np + 1], Ka, Qb[2], Qb[3]);
                mma_m16n8k16<dtype_id>(dP[2 * np], Va, Ob[0], Ob[1]);
                mma_m16n8k16<dtype_id>(dP[2 * np + 1], Va, Ob[2], Ob[3]);
            }
        }

        // P^T = exp(scale S^T - lse_i), 0 where masked; dS^T = P^T o (dP^T - D_i). Accumulator e of n-tile
        // p is key key0 + g + 8 (e / 2), query 8 p + 2 t + e % 2. dS^T, rounded to the dtype, also goes to
        // shared memory for dQ's product, a 32-bit pair of queries per store (8 rows x 4 lanes: 32 banks).
        const bool masked = (causal && col_start + key0 + 15 > row_start + offset) || col_start + key0 + 16 > T_k;
        #pragma unroll
        for (int p = 0; p < NT; ++p) {
            const float2 l2 = *(const float2*)&lse_i[8 * p + 2 * t];
            const float2 d2 = *(const float2*)&D_i[8 * p + 2 * t];
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = col_start + key0 + g + 8 * (e / 2);
                const int query = row_start + 8 * p + 2 * t + e % 2;
                const bool visible = !masked || (key < T_k && (!causal || key <= query + offset));
                const float P = visible ? exp2_approx(fmaf(S[p][e], scale, -(e % 2 ? l2.y : l2.x)) * LOG2_E) : 0.0f;
                S[p][e] = P;
                dP[p][e] = P * (dP[p][e] - (e % 2 ? d2.y : d2.x));
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                store_shared_u32(dS_T + swizzled<B_r>(key0 + g + 8 * h, p) + 4 * t,
                                 pack_rounded<dtype_id>(dP[p][2 * h], dP[p][2 * h + 1]));
        }

        // dV_j += P^T dO_i and dK_j += dS^T Q_i, a k-step of 16 queries at a time. A: n-tiles 2 kk and
        // 2 kk + 1 of P^T (dS^T), rounded to 16 bits. B: rows of dO_i (Q_i) are the k index, so
        // ldmatrix.trans: (queries 0-7, d 0-7), (queries 8-15, d 0-7), (queries 0-7, d 8-15),
        // (queries 8-15, d 8-15) = b0, b1 of d-tile 2 dp and of 2 dp + 1.
        #pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            unsigned Pa[4], dSa[4];
            Pa[0] = pack_rounded<dtype_id>(S[2 * kk][0], S[2 * kk][1]);
            Pa[1] = pack_rounded<dtype_id>(S[2 * kk][2], S[2 * kk][3]);
            Pa[2] = pack_rounded<dtype_id>(S[2 * kk + 1][0], S[2 * kk + 1][1]);
            Pa[3] = pack_rounded<dtype_id>(S[2 * kk + 1][2], S[2 * kk + 1][3]);
            dSa[0] = pack_rounded<dtype_id>(dP[2 * kk][0], dP[2 * kk][1]);
            dSa[1] = pack_rounded<dtype_id>(dP[2 * kk][2], dP[2 * kk][3]);
            dSa[2] = pack_rounded<dtype_id>(dP[2 * kk + 1][0], dP[2 * kk + 1][1]);
            dSa[3] = pack_rounded<dtype_id>(dP[2 * kk + 1][2], dP[2 * kk + 1][3]);
            #pragma unroll
            for (int dp = 0; dp < d_head / 16; ++dp) {
                unsigned Ob[4], Qb[4];
                ldmatrix_x4_trans(Ob, dO_i + swizzled<d_head>(16 * kk + lane % 8 + 8 * ((lane / 8) % 2), 2 * dp + lane / 16));
                ldmatrix_x4_trans(Qb, Q_i + swizzled<d_head>(16 * kk + lane % 8 + 8 * ((lane / 8) % 2), 2 * dp + lane / 16));
                mma_m16n8k16<dtype_id>(dV_acc[2 * dp], Pa, Ob[0], Ob[1]);
                mma_m16n8k16<dtype_id>(dV_acc[2 * dp + 1], Pa, Ob[2], Ob[3]);
                mma_m16n8k16<dtype_id>(dK_acc[2 * dp], dSa, Qb[0], Qb[1]);
                mma_m16n8k16<dtype_id>(dK_acc[2 * dp + 1], dSa, Qb[2], Qb[3]);
            }
        }

        // dQ_i^T's share = K_j^T dS^T: this warp's m-tiles (columns 16 mt .. + 15 of d), its n-tiles.
        // A = K_j^T: K_j's rows are the k index (keys), so ldmatrix.trans of (keys 0-7, columns 0-7),
        // (keys 0-7, columns 8-15), (keys 8-15, columns 0-7), (keys 8-15, columns 8-15) = a0 .. a3.
        // B = dS^T, rows the k index (keys): ldmatrix.trans as dO_i's above, n-tiles of queries.
        __syncthreads();  // dS^T is whole
        if (deterministic)
            wait_turn(dQ_turns + bh * T_r + i, j);
        float* acc_head = dQ_accum + bh * T_q * d_head;
        const int first_np = warp / M_WARPS * NT_E / 2;  // this warp's first pair of n-tiles
        #pragma unroll 1
        for (int m = 0; m < M_TILES; ++m) {
            const int mt = warp % M_WARPS + M_WARPS * m;
            float dQ_T[NT_E][4];             // column 16 mt + g + 8 (e / 2), query 8 (first + p) + 2 t + e % 2
            #pragma unroll
            for (int p = 0; p < NT_E; ++p)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    dQ_T[p][e] = 0.0f;
            #pragma unroll 1
            for (int u = 0; u < B_c / 16; ++u) {
                unsigned Ka[4];
                ldmatrix_x4_trans(Ka, K_j + swizzled<d_head>(16 * u + lane % 8 + 8 * (lane / 16), 2 * mt + (lane / 8) % 2));
                #pragma unroll
                for (int np = 0; np < NT_E / 2; ++np) {
                    unsigned Sb[4];
                    ldmatrix_x4_trans(Sb, dS_T + swizzled<B_r>(16 * u + lane % 8 + 8 * ((lane / 8) % 2), 2 * (first_np + np) + lane / 16));
                    mma_m16n8k16<dtype_id>(dQ_T[2 * np], Ka, Sb[0], Sb[1]);
                    mma_m16n8k16<dtype_id>(dQ_T[2 * np + 1], Ka, Sb[2], Sb[3]);
                }
            }
            #pragma unroll
            for (int p = 0; p < NT_E; ++p)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row_start + 8 * (2 * first_np + p) + 2 * t + e % 2;
                    if (row < T_q)
                        atomicAdd(&acc_head[(long long)row * d_head + 16 * mt + g + 8 * (e / 2)], dQ_T[p][e]);
                }
        }
        if (deterministic)
            pass_turn(dQ_turns + bh * T_r + i, j + 1);
    }

    // dK_j = scale sum dS^T Q and dV_j, rounded to the dtype: lane (g, t) holds columns 8 n + 2 t, + 1 of
    // keys key0 + g and + 8; none past T_k.
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = col_start + key0 + g + 8 * h;
        if (key < T_k) {
            element* dK_row = dK + (kv_bh * T_k + key) * d_head;
            element* dV_row = dV + (kv_bh * T_k + key) * d_head;
            #pragma unroll
            for (int n = 0; n < ND; ++n) {
                *(unsigned*)&dK_row[8 * n + 2 * t] = pack_rounded<dtype_id>(dK_acc[n][2 * h] * scale, dK_acc[n][2 * h + 1] * scale);
                *(unsigned*)&dV_row[8 * n + 2 * t] = pack_rounded<dtype_id>(dV_acc[n][2 * h], dV_acc[n][2 * h + 1]);
            }
        }
    }
}
