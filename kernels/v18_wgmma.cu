/*
 * v18 - Hopper's warpgroup MMA: S_ij = Q_i K_j^T and O_i += P_ij V_j as wgmma.mma_async, four warps
 * at a time, its B operand (and Q_i) read by the tensor cores straight from shared memory.
 *
 * The change: v15's kernel with mma.sync replaced by wgmma (sm_90a). A warpgroup (4 warps, 128
 * threads) multiplies a 64-row A by an N-column B in one instruction, m64nNk16: for S_ij the A
 * operand is Q_i and the B operand K_j, both read from shared memory through 64-bit matrix
 * descriptors; for P_ij V_j the A operand is P_ij in registers and the B operand V_j in shared
 * memory, read transposed. The work is partitioned as in v13 and v15 (FA2: one Q_i per block, whole
 * rows per warpgroup), and the softmax, the masking, the heavy-first tile order and the features are
 * v15's.
 *
 * Why it helps:
 *   - mma.sync is Ampere's instruction: each m16n8k16 is issued by one warp, with its operands in
 *     that warp's registers (v15 loads them by ldmatrix, 2 ldmatrix.x4 per 4 mma). wgmma is the one
 *     Hopper's tensor cores are built around: one m64n128k16 does the work of 64 m16n8k16, and the
 *     tensor cores fetch Q_i, K_j and V_j from shared memory themselves, so no register holds them
 *     and no instruction loads them.
 *   - It is asynchronous: wgmma.mma_async only starts the product; commit_group and wait_group end
 *     it. Here each product is waited for at once (the simplest correct pipeline); the warpgroups
 *     sharing an SM (three blocks of one at B_r = 64, B_c = 128) overlap one another's softmax with
 *     their MMA. v19 overlaps them inside one warpgroup.
 *   - Tiles of 64 queries x 128 keys: a warpgroup's S_ij is 64 registers per thread, with no Q_i
 *     fragments held (v15 held 32), so one warpgroup per block keeps three blocks on an SM.
 *   - Heads in L2-sized chunks. At 400 TFLOP/s the first waves of heavy tiles, one tile rank across
 *     every head, read every head's K and V: 96 MB at B = 16, T = 2048, more than L2 holds, so
 *     those waves wait on DRAM and the time swung by 10% from run to run. When the K and V of all
 *     heads pass 32 MB, heads go in chunks whose K and V take 16 MB, heavy tiles first within each
 *     chunk (the same order v15 tried without gain: for the slower kernel DRAM was not the limit).
 *     Both numbers were picked on the issue's shapes on an H200.
 *   - The accumulator of m64nNk16 gives thread l of warp w of the warpgroup rows 16 w + l / 4 and
 *     + 8, columns 8 n + 2 (l % 4) and + 1 of each n8 tile: within a warp, exactly mma.sync's
 *     m16n8 fragment, so v15's softmax on fragments and its P_ij-into-A-operand trick carry over
 *     unchanged (two n8 tiles of S_ij are the 4 A registers of one k16 step of P_ij V_j).
 *
 * Shared memory: the 128-byte swizzle that wgmma understands. A descriptor names a tile's start,
 * the swizzle mode and two strides. Rows of 64 16-bit values (128 bytes) are stored 8 to a 1024-byte
 * atom, 16-byte chunk c of row r at chunk c ^ (r mod 8): the hardware applies the same XOR (address
 * bits 4-6 with bits 7-9), so every atom starts on a 1024-byte boundary. This is v15's swizzle for
 * d = 64; a tile of d = 128 is stored as two such halves of 64 columns, one after the other.
 *   Q_i, K_j (K-major: the reduction index d is contiguous): stride between 8-row groups (SBO) 1024
 *     bytes; k16 step s starts 32 s bytes into the half s / 4.
 *   V_j (B of P_ij V_j, whose reduction index is the key: "MN-major", transposed on read): 8 keys
 *     per atom at 128 bytes each, SBO = 1024 between groups of 8 keys, LBO = B_c * 128 bytes between
 *     the two 64-column halves of d = 128; k16 step kk starts 16 kk rows in (2048 kk bytes).
 *   cp.async writes through the generic proxy and wgmma reads through the async proxy: every thread
 *   runs fence.proxy.async after its copies land and before the barrier that publishes them.
 *
 * The log-sum-exp (lab.lse): given an lse array, lane t = 0 of each quad also writes its rows'
 * log-sum-exp, (m_i scale log2(e) + log2 l_i) ln 2 (m_i is a raw score, as in v15), or +inf for a
 * row that sees no key (m_i = -inf).
 *
 * Geometry: grid (T_r = ceil(T_q / B_r), n_heads, batch), heavy tiles first; block B_r * 2 threads,
 * B_r / 64 warpgroups of 64 query rows each. Per K_j tile a warpgroup issues d / 16 m64n{B_c}k16
 * (S_ij) and B_c / 16 m64n{d}k16 (P_ij V_j). Registers per thread: S_ij B_c / 2, O_i d / 2, P_ij
 * B_c / 4. Shared memory, 2-byte elements, plus 1 KB to align the atoms:
 *   Q_i (B_r x d) + 2 stages x (K_j + V_j) (B_c x d each) + 1024
 *   d = 64,  B_r = 64,  B_c = 128: 2 * (64 * 64 + 4 * 128 * 64) + 1024 = 74,752 bytes
 *   d = 64,  B_r = 128, B_c = 64:  2 * (128 * 64 + 4 * 64 * 64) + 1024 = 50,176 bytes
 *   d = 64,  B_r = 128, B_c = 128: 2 * (128 * 64 + 4 * 128 * 64) + 1024 = 82,944 bytes
 *   d = 128, B_r = 128, B_c = 64:  2 * (128 * 128 + 4 * 64 * 128) + 1024 = 99,328 bytes
 *
 * Limits: sm_90a only (wgmma is not in sm_80, nor carried forward to later architectures); d 64 or
 * 128; B_r 64 or 128; B_c 64 or 128; a scale below zero is taken as |scale| with Q negated (exact
 * in 16 bits, flipped in shared memory). Rows must start on 16-byte boundaries, for cp.async (the
 * launcher copies views whose rows do not). dtype_id 0 reads and writes bfloat16, 1 float16.
 *
 * lab.template    d_head, B_r, B_c, dtype_id
 * lab.configs     (64, 64, 128, 0), (64, 64, 128, 1), (64, 128, 128, 0), (64, 128, 128, 1), (64, 128, 64, 0), (64, 128, 64, 1), (64, 64, 64, 0), (64, 64, 64, 1), (128, 128, 64, 0), (128, 128, 64, 1), (128, 64, 64, 0), (128, 64, 64, 1)
 * lab.threads     B_r * 2
 * lab.smem        2 * (B_r * d_head + 4 * B_c * d_head) + 1024
 * lab.strided     true
 * lab.tolerance   2
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.lse         true
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;
constexpr long long L2_ALL = 32ll << 20, L2_CHUNK = 16ll << 20;  // block order (measured on an H200's 60 MB L2)
constexpr float FLT_MIN_NORMAL = 1.17549435e-38f;
constexpr unsigned FULL_WARP = 0xffffffffu;

// One bfloat16 or float16 value as raw bits: the mma and cvt instructions decide how they read.
using element = unsigned short;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats rounded to nearest into one register, lo in the low half (cvt puts its first source high).
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

// -- wgmma -----------------------------------------------------------------------------------------

// A shared-memory matrix descriptor for the 128-byte swizzle: start address, leading and stride
// byte offsets (all in 16-byte units), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned lbo, unsigned sbo)
{
    return (unsigned long long)((address & 0x3ffff) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(sbo >> 4) << 32 | 1ull << 62;
}

// wgmma reads registers and shared memory asynchronously: fence before a batch (the accumulators
// and A registers were just written by ordinary instructions), commit the batch, wait for it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// After the wait: a volatile no-op that "writes" each accumulator, so that no read of it is
// scheduled before the wait (the compiler sees the wgmma's outputs as written at its issue).
template <int N>
__device__ __forceinline__ void settle(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i])::"memory");
}

#define ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ACC16(i) ACC4(i), ACC4(i + 4), ACC4(i + 8), ACC4(i + 12)
#define ACC32 ACC16(0), ACC16(16)
#define ACC64 ACC32, ACC16(32), ACC16(48)
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WGMMA(N, T) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " "

// D (+)= A B, A 64 x 16 and B 16 x N both in shared memory (K-major); D = A B when accumulate is 0.
template <int N, int dtype_id>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate)
{
    static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
    if constexpr (N == 64 && dtype_id == 0)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" WGMMA(64, "bf16") REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}"
                     : ACC32 : "l"(a), "l"(b), "r"(accumulate));
    else if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" WGMMA(64, "f16") REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}"
                     : ACC32 : "l"(a), "l"(b), "r"(accumulate));
    else if constexpr (dtype_id == 0)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" WGMMA(128, "bf16") REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}"
                     : ACC64 : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" WGMMA(128, "f16") REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}"
                     : ACC64 : "l"(a), "l"(b), "r"(accumulate));
}

// D += A B, A 64 x 16 in registers (mma.sync's A fragment, per warp), B 16 x N in shared memory,
// stored N-contiguous and read transposed (the last immediate).
template <int N, int dtype_id>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b)
{
    static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
    if constexpr (N == 64 && dtype_id == 0)
        asm volatile(WGMMA(64, "bf16") REGS32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
                     : ACC32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else if constexpr (N == 64)
        asm volatile(WGMMA(64, "f16") REGS32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
                     : ACC32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else if constexpr (dtype_id == 0)
        asm volatile(WGMMA(128, "bf16") REGS64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;"
                     : ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile(WGMMA(128, "f16") REGS64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;"
                     : ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// -- copies into the swizzled tiles ----------------------------------------------------------------

__device__ __forceinline__ void copy_async_16(unsigned dst, const element* src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }

// The copies have landed (this thread's), and are visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void copy_async_wait_all()
{
    asm volatile("cp.async.wait_group 0;\nfence.proxy.async.shared::cta;" ::: "memory");
}

// Byte offset of 16-byte chunk c (of d_head / 8) of row r in a tile of `rows` rows: 64-column
// halves one after the other, chunk c % 8 of a half's row r at chunk (c % 8) ^ (r % 8).
template <int rows>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    return (c / 8) * rows * 128 + r * 128 + 16 * ((c % 8) ^ (r % 8));
}

// Start copying rows row_start .. row_start + rows - 1 of one head into a swizzled tile: thread i
// takes chunk i % chunks of rows i / chunks, + THREADS / chunks, ...; rows at or past T become
// zeros (a row past T reads nothing and points at row 0, which exists).
template <int d_head, int rows, int THREADS>
__device__ __forceinline__ void load_tile(unsigned tile, const element* head, long long row_stride, int row_start, int T)
{
    constexpr int chunks = d_head / 8;
    constexpr int period = THREADS / chunks;
    static_assert(rows % period == 0, "whole passes of the block per tile");
    const int r0 = threadIdx.x / chunks, c = threadIdx.x % chunks;
    const element* src = head + (long long)(row_start + r0) * row_stride + 8 * c;
    if (row_start + rows <= T) {
#pragma unroll
        for (int n = 0; n < rows / period; ++n)
            copy_async_16(tile + swizzled<rows>(r0 + n * period, c), src + n * period * row_stride, true);
    } else {
#pragma unroll
        for (int n = 0; n < rows / period; ++n) {
            const bool valid = row_start + r0 + n * period < T;
            copy_async_16(tile + swizzled<rows>(r0 + n * period, c), valid ? src + n * period * row_stride : head, valid);
        }
    }
}

template <int d_head, int B_r, int B_c, int dtype_id>
__global__ void __launch_bounds__(B_r * 2)
attention_forward(const element* __restrict__ Q, const element* __restrict__ K, const element* __restrict__ V,
                  element* __restrict__ O, float* __restrict__ /* workspace */, int T_q, int T_k, int kv_group,
                  int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride,
                  float* __restrict__ lse)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    static_assert(d_head == 64 || d_head == 128, "whole 64-column halves of 128 bytes");
    static_assert(B_r == 64 || B_r == 128, "one or two warpgroups of 64 rows");
    static_assert(B_c == 64 || B_c == 128, "S_ij is m64n64 or m64n128");
    constexpr int THREADS = B_r * 2;
    constexpr int D_STEPS = d_head / 16;    // k16 steps of Q_i K_j^T
    constexpr int D_TILES = d_head / 8;     // n8 tiles of O_i
    constexpr int N_TILES = B_c / 8;        // n8 tiles of S_ij
    constexpr int KEY_STEPS = B_c / 16;     // k16 steps of P_ij V_j
    constexpr int chunks = d_head / 8;
    constexpr unsigned TILE_BYTES = B_c * d_head * 2;

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned Q_smem = ((unsigned)__cvta_generic_to_shared(smem) + 1023) & ~1023u;  // later O_i
    const unsigned KV_smem = Q_smem + B_r * d_head * 2;  // stage s: K_j, then V_j, at 2 s TILE_BYTES

    // Heavy tiles first, in chunks of heads: the flat block index, read as (chunk, tile rank, head
    // in the chunk), counts tiles down within each chunk. When the K and V of all heads fit in L2
    // (L2_ALL), one chunk holds every head, as in v15; otherwise a chunk's K and V take L2_CHUNK.
    const long long n_heads = (long long)gridDim.y * gridDim.z;
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const long long kv_bytes = 4LL * T_k * d_head;  // K and V of one head, 2 bytes an element
    const long long chunk = n_heads * kv_bytes <= L2_ALL ? n_heads : max(1LL, min(n_heads, L2_CHUNK / kv_bytes));
    const long long chunk_blocks = chunk * gridDim.x;
    const long long first_head = flat / chunk_blocks * chunk;
    const long long heads_here = min(chunk, n_heads - first_head);  // the last chunk may be short
    const long long within = flat % chunk_blocks;
    const int q_tile = gridDim.x - 1 - (int)(within / heads_here);
    const long long bh = first_head + within % heads_here;  // = batch * NH + head
    const long long batch = bh / gridDim.y;
    const long long head = bh % gridDim.y;
    const long long kv_head = head / kv_group;

    const element* Q_head = Q + batch * q_batch_stride + head * q_head_stride;
    const element* K_head = K + batch * kv_batch_stride + kv_head * kv_head_stride;
    const element* V_head = V + batch * kv_batch_stride + kv_head * kv_head_stride;
    element* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d)
    const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;

    const int row_start = q_tile * B_r;
    const int rows = min(B_r, T_q - row_start);
    const int offset = T_k - T_q;  // query row i sees keys j <= i + offset (bottom-right causal mask)
    int T_c = (T_k + B_c - 1) / B_c;
    if (causal) {
        const int last_key = row_start + rows - 1 + offset;
        T_c = last_key < 0 ? 0 : min(T_c, last_key / B_c + 1);
    }

    load_tile<d_head, B_r, THREADS>(Q_smem, Q_head, q_row_stride, row_start, T_q);
    if (T_c > 0) {
        load_tile<d_head, B_c, THREADS>(KV_smem, K_head, kv_row_stride, 0, T_k);
        load_tile<d_head, B_c, THREADS>(KV_smem + TILE_BYTES, V_head, kv_row_stride, 0, T_k);
    }
    copy_async_commit();
    copy_async_wait_all();
    if (scale < 0.0f) {  // S with -Q_i and |scale|: flip the sign bits of the chunks this thread copied
        for (int i = threadIdx.x; i < B_r * chunks; i += THREADS) {
            const unsigned at = Q_smem + swizzled<B_r>(i / chunks, i % chunks);
            unsigned w[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at));
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0] ^ 0x80008000u), "r"(w[1] ^ 0x80008000u),
                         "r"(w[2] ^ 0x80008000u), "r"(w[3] ^ 0x80008000u));
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;  // warp within the warpgroup
    const int g = lane / 4, t = lane % 4;
    const int wg_row = 64 * warpgroup;      // first row of this warpgroup in Q_i
    const int wg_first = row_start + wg_row;  // ... as a query index
    const int wg_last = wg_first + 63;
    const int my_row = wg_first + 16 * warp + g;  // this thread's rows: my_row and my_row + 8
    const float scale_log2 = fmaxf(fabsf(scale) * LOG2_E, FLT_MIN_NORMAL);  // as in v15

    float O_acc[d_head / 2];  // n8 tile n, entry e: row my_row + 8 (e / 2), column 8 n + 2 t + e % 2
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < d_head / 2; ++i)
        O_acc[i] = 0.0f;

    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        const unsigned K_j = KV_smem + (j % 2) * 2 * TILE_BYTES;
        const unsigned V_j = K_j + TILE_BYTES;
        if (j + 1 < T_c) {  // the other stage was last read in tile j - 1, finished before the barrier
            const unsigned K_next = KV_smem + ((j + 1) % 2) * 2 * TILE_BYTES;
            load_tile<d_head, B_c, THREADS>(K_next, K_head, kv_row_stride, col_start + B_c, T_k);
            load_tile<d_head, B_c, THREADS>(K_next + TILE_BYTES, V_head, kv_row_stride, col_start + B_c, T_k);
            copy_async_commit();
        }

        // A warpgroup whose rows all lie past T_q, or none of whose rows sees a key of this tile,
        // skips it (uniform across the warpgroup, as wgmma requires).
        if (wg_first < T_q && !(causal && col_start > wg_last + offset)) {
            // S_ij = Q_i K_j^T: d / 16 k16 steps, each 32 bytes further along a row (next half at 4).
            float S[B_c / 2];
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < D_STEPS; ++s) {
                const unsigned a = Q_smem + (s / 4) * B_r * 128 + wg_row * 128 + (s % 4) * 32;
                const unsigned b = K_j + (s / 4) * B_c * 128 + (s % 4) * 32;
                wgmma_ss<B_c, dtype_id>(S, descriptor(a, 16, 1024), descriptor(b, 16, 1024), s > 0);
            }
            wgmma_commit();
            wgmma_wait_all();
            settle(S);

            // Masked scores only in tiles that cross the diagonal (for the warpgroup's first row) or T_k.
            if ((causal && col_start + B_c - 1 > wg_first + offset) || col_start + B_c > T_k) {
#pragma unroll
                for (int i = 0; i < B_c / 2; ++i) {
                    const int row = my_row + 8 * (i % 4 / 2);
                    const int key = col_start + 8 * (i / 4) + 2 * t + i % 2;
                    if (key >= T_k || (causal && key > row + offset))
                        S[i] = -INFINITY;
                }
            }

            // Online softmax in exp2, as v15: row h's scores are entries 2 h, 2 h + 1 of each n8 tile.
            float alpha[2];
            bool max_moved = false;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m_new = m_i[h];
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
                    m_new = fmaxf(m_new, fmaxf(S[4 * n + 2 * h], S[4 * n + 2 * h + 1]));
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 1));
                m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 2));
                const float m_scaled = m_new == -INFINITY ? 0.0f : m_new * scale_log2;
                max_moved |= m_new != m_i[h];
                alpha[h] = m_new == m_i[h] ? 1.0f : exp2_approx(fmaf(m_i[h], scale_log2, -m_scaled));
                m_i[h] = m_new;
                float row_sum = 0.0f;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        S[4 * n + e] = exp2_approx(fmaf(S[4 * n + e], scale_log2, -m_scaled));
                        row_sum += S[4 * n + e];
                    }
                l_i[h] = l_i[h] * alpha[h] + row_sum;
            }
            if (__any_sync(FULL_WARP, max_moved)) {
#pragma unroll
                for (int i = 0; i < d_head / 2; ++i)
                    O_acc[i] *= alpha[i % 4 / 2];
            }

            // O_i += P_ij V_j: n8 tiles 2 kk and 2 kk + 1 of P_ij, rounded to 16 bits, are the A
            // registers of key step kk; V_j's rows 16 kk .. 16 kk + 15 are its B.
            unsigned P[KEY_STEPS][4];
#pragma unroll
            for (int kk = 0; kk < KEY_STEPS; ++kk) {
                P[kk][0] = pack_rounded<dtype_id>(S[8 * kk + 0], S[8 * kk + 1]);
                P[kk][1] = pack_rounded<dtype_id>(S[8 * kk + 2], S[8 * kk + 3]);
                P[kk][2] = pack_rounded<dtype_id>(S[8 * kk + 4], S[8 * kk + 5]);
                P[kk][3] = pack_rounded<dtype_id>(S[8 * kk + 6], S[8 * kk + 7]);
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KEY_STEPS; ++kk)
                wgmma_rs<d_head, dtype_id>(O_acc, P[kk], descriptor(V_j + kk * 2048, B_c * 128, 1024));
            wgmma_commit();
            wgmma_wait_all();
            settle(O_acc);
        }

        // Tile j + 1 has landed for every thread, and every warpgroup is done with tile j's stage.
        copy_async_wait_all();
        __syncthreads();
    }

    // O_i = O_i / l_i, rounded to 16 bits into this warp's own rows of Q_i's shared memory (no
    // wgmma reads it any more), then out in 16-byte stores.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(FULL_WARP, l, 1);
        l += __shfl_xor_sync(FULL_WARP, l, 2);
        const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
        const int r = wg_row + 16 * warp + g + 8 * h;
        if (lse != nullptr && t == 0 && row_start + r < T_q)
            lse[bh * T_q + row_start + r] = m_i[h] == -INFINITY ? INFINITY : (m_i[h] * scale_log2 + __log2f(l)) * LN_2;
#pragma unroll
        for (int n = 0; n < D_TILES; ++n) {
            const unsigned o = pack_rounded<dtype_id>(O_acc[4 * n + 2 * h] * inv_l, O_acc[4 * n + 2 * h + 1] * inv_l);
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(Q_smem + swizzled<B_r>(r, n) + 4 * t), "r"(o));
        }
    }
    __syncwarp();
    const int warp_row = wg_row + 16 * warp;
#pragma unroll
    for (int idx = lane; idx < 16 * chunks; idx += 32) {
        const int r = idx / chunks, c = idx % chunks;
        const int row = row_start + warp_row + r;
        if (row < T_q) {
            unsigned w[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(Q_smem + swizzled<B_r>(warp_row + r, c)));
            element* dst = O_head + (long long)row * d_head + 8 * c;
            if (o_vec) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    dst[e] = (element)(w[e / 2] >> (16 * (e % 2)));
            }
        }
    }
}
