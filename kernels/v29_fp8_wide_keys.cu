/*
 * v29 - FP8 key tiles of 224 at d = 128: each step of the softmax over 224 keys instead of 128.
 *
 * The change: v27's consumers at d = 128 spend most of a step in the softmax, and part of that is the
 * step's own, paid once per key tile whatever its width: the waits on K_j's and V^T_j's full barriers,
 * the fence, commits and waits of the products, the releases, the two row maxima across the quad and
 * alpha's exponential, l_i's update, the vote and O_i's rescale when a maximum moves. With 224 keys a
 * tile (FlashAttention-3's FP8 tile at this head size) those costs are spread over 1.75 times the keys,
 * and S_ij = Q_i K_j^T is one m64n224k32 product a k32 step (112 accumulators a thread) where v27
 * issued m64n128k32.
 *
 * V^T_j is 224 keys wide: 224 bytes a row, more than the 128-byte swizzle spans, so it comes as two
 * boxes of 128 keys (lab.tma V: (d_head, 128)), the second reaching 32 keys into the next tile (or past
 * the padded array, where the copy engine writes zeros); key step kk of P V reads box kk / 4, 32 kk % 4
 * bytes along its rows. The row sums' block of ones stays 8 rows of 128 (every byte is 1.0, so any 32
 * of its columns will do). The ring holds two stages of K_j (28 KB) and V^T_j (32 KB), 448 keys in
 * flight where v27's four stages held 512.
 *
 * Everything else is v27's: the persistent block, the ring's protocol, V scaled per head, the row sums
 * on the tensor cores, the softmax, P's e4m3 packing (kernels.fp8.KEY_ORDER within each 16 keys;
 * 224 is a whole number of 32-key steps), the epilogue. d = 64 keeps v27's tiles of 128.
 *
 * Measured (H200, bench.py fp8, five runs against v27): 1.01-1.03x at 2 x 16 x 8192 and 1.02-1.05x at
 * 1 x 16 x 16384 (d = 128, causal), inside the spread of its bimodal times; 0.98-1.00x at 4 x 16 x 4096,
 * where the last key tile of a causal query tile, 224 keys not aligned with its 128 rows, masks more.
 * Key tiles of 160 at d = 64 were slower (docs/ladder.md#v29).
 *
 * Geometry: grid (min(tiles, SMs x blocks per SM), 1, 1), tiles = T_r x n_heads x batch; block B_r *
 * 2 + 128 threads (the producer warpgroup and B_r / 64 consumers), one block per SM. STAGES = (8 - d /
 * 32) x 128 / B_c: 6 stages of 128 keys at d = 64, 4 of 128 or 2 of 224 at d = 128. Shared memory: Q_i
 * (B_r x d, e4m3) + O_i (B_r x d, bfloat16) + STAGES x (K_j, B_c x d, + V^T_j, d x 128 a box) + the
 * ones (8 x 128) + 1024 to align the atoms; 2 + 4 STAGES mbarriers and the two tile slots (static):
 *   d = 64,  B_r = 192, B_c = 128, 6 stages: 3 * 192 * 64 + 6 * 256 * 64 + 2048 = 137,216 bytes
 *   d = 128, B_r = 128, B_c = 224, 2 stages: 3 * 128 * 128 + 2 * 480 * 128 + 2048 = 174,080 bytes
 *   d = 128, B_r = 128, B_c = 128, 4 stages: 3 * 128 * 128 + 4 * 256 * 128 + 2048 = 182,272 bytes
 * Named barriers: 0 (__syncthreads, before the role split), 1 + c (consumer c alone, for a scale
 * below zero).
 *
 * Limits: as v27; B_c 224 at d = 128 only.
 *
 * lab.template    d_head, B_r, B_c
 * lab.configs     (64, 192, 128), (64, 128, 128), (128, 128, 224), (128, 128, 128)
 * lab.threads     B_r * 2 + 128
 * lab.smem        3 * B_r * d_head + (8 - d_head // 32) * 128 // B_c * (B_c + (B_c + 127) // 128 * 128) * d_head + 2048
 * lab.dtypes      bfloat16
 * lab.fp8         true
 * lab.fp8_v       head
 * lab.persistent  true
 * lab.supports    noncausal, cross, gqa
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a
 * lab.tma         Q: (B_r, d_head), K: (B_c, d_head), V: (d_head, 128)
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float P_SHIFT = 8.0f;  // P = 2^8 p: 256 p in e4m3 (kernels.fp8.P_SCALE)
constexpr long long L2_ALL = 32ll << 20, L2_CHUNK = 16ll << 20;  // block order (measured on an H200's 60 MB L2)
constexpr float FLT_MIN_NORMAL = 1.17549435e-38f;
constexpr unsigned FULL_WARP = 0xffffffffu;

// An e4m3 code, and the output's bfloat16, as raw bits: the mma and cvt instructions decide how they read.
using byte = unsigned char;
using element = unsigned short;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats rounded to bfloat16 into one register, lo in the low half (cvt puts its first source high).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four floats rounded to e4m3 (to nearest even, saturating at 448, NaN kept) into one register,
// b0 in the lowest byte: byte e is the operand's element 4 t + e of its 4-key group.
__device__ __forceinline__ unsigned pack_e4m3(float b0, float b1, float b2, float b3)
{
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b1), "f"(b0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(b3), "f"(b2));
    return (unsigned)lo | (unsigned)hi << 16;
}

// -- wgmma -----------------------------------------------------------------------------------------

// A shared-memory matrix descriptor of a K-major tile whose rows are `row_bytes` (64 or 128) long,
// swizzled over that span: start address, leading byte offset 16 (unused for these layouts),
// stride byte offset 8 rows, all in 16-byte units; swizzle mode in bits 62-63 (1: 128 B, 2: 64 B).
template <int row_bytes>
__device__ __forceinline__ unsigned long long descriptor(unsigned address)
{
    static_assert(row_bytes == 64 || row_bytes == 128, "the 64- or 128-byte swizzle");
    constexpr unsigned long long mode = row_bytes == 128 ? 1 : 2;
    return (unsigned long long)((address & 0x3ffff) >> 4) | 1ull << 16 | (unsigned long long)(8 * row_bytes >> 4) << 32 |
           mode << 62;
}

// wgmma reads registers and shared memory asynchronously: fence before a batch (the accumulators
// and A registers were just written by ordinary instructions), commit the batch, wait for it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

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
#define ACC112 ACC64, ACC16(64), ACC16(80), ACC16(96)
#define REGS112 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
                "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}"
#define WGMMA_E4M3(N) "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "

// D (+)= A B, A 64 x 32 and B 32 x N e4m3 both in shared memory, K-major (FP8 has no transpose
// bits); D = A B when accumulate is 0.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate)
{
    static_assert(N == 64 || N == 128 || N == 224, "m64n64k32, m64n128k32 or m64n224k32");
    if constexpr (N == 224)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %114, 0;\n" WGMMA_E4M3(224) REGS112 ", %112, %113, p, 1, 1;\n}"
                     : ACC112 : "l"(a), "l"(b), "r"(accumulate));
    else if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" WGMMA_E4M3(64) REGS32 ", %32, %33, p, 1, 1;\n}"
                     : ACC32 : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" WGMMA_E4M3(128) REGS64 ", %64, %65, p, 1, 1;\n}"
                     : ACC64 : "l"(a), "l"(b), "r"(accumulate));
}

// D += A B, A 64 x 32 e4m3 in registers (4 per thread: rows g and g + 8 of the warp's 16, 4 keys
// each), B 32 x N e4m3 in shared memory, K-major.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b)
{
    static_assert(N == 64 || N == 128, "m64n64k32 or m64n128k32");
    if constexpr (N == 64)
        asm volatile(WGMMA_E4M3(64) REGS32 ", {%32, %33, %34, %35}, %36, 1, 1, 1;"
                     : ACC32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else
        asm volatile(WGMMA_E4M3(128) REGS64 ", {%64, %65, %66, %67}, %68, 1, 1, 1;"
                     : ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// The row sums of A: D (+)= A B with B 32 x 8 ones (m64n8k32), D = A B when accumulate is 0. Every
// column of D is the row's sum; thread (g, t) holds rows g (d[0], d[1]) and g + 8 (d[2], d[3]).
__device__ __forceinline__ void wgmma_row_sums(float (&d)[4], const unsigned (&a)[4], unsigned long long b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n" WGMMA_E4M3(8) "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}"
                 : ACC4(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// -- TMA and mbarriers -----------------------------------------------------------------------------

// CUtensorMap: 128 opaque bytes, 64-byte aligned (NVRTC compiles without cuda.h).
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbarrier_init(unsigned barrier, unsigned arrivals)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(arrivals) : "memory");
}

// The inits visible to the other threads and to the copy engine (the async proxy), which completes
// transactions on the barriers.
__device__ __forceinline__ void mbarrier_init_fence()
{
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
}

// This thread's arrival, announcing `bytes` still to come from the copies that complete_tx on it.
__device__ __forceinline__ void mbarrier_arrive_expect(unsigned barrier, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}

// Wait until the phase of parity `parity` has completed: arrivals and bytes all in, and the bytes
// the copies wrote visible to this thread.
__device__ __forceinline__ void mbarrier_wait(unsigned barrier, unsigned parity)
{
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
    } while (!done);
}

// This thread's arrival (release: its reads of the stage come before it).
__device__ __forceinline__ void mbarrier_arrive(unsigned barrier)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}

// A warpgroup's registers per thread, resized at run time (all its warps execute the same one).
template <int registers>
__device__ __forceinline__ void registers_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(registers)); }
template <int registers>
__device__ __forceinline__ void registers_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(registers)); }

// One tile: the box of the descriptor's 4-d array at (col, row, head, batch), innermost first, into
// shared memory at `dst` (1024-byte aligned: the swizzle pattern starts there), announced on `barrier`
// as one use of `bytes` bytes: the whole box, whether or not its rows lie past the array's end (the
// copy engine writes zeros there and counts them).
__device__ __forceinline__ void load_tile(unsigned dst, const TensorMap* map, int col, int row, int head, int batch,
                                          unsigned barrier, unsigned bytes)
{
    mbarrier_arrive_expect(barrier, bytes);
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(barrier) : "memory");
}

// A box as load_tile copies it, announced on `barrier` by an arrival made beforehand for all its boxes.
__device__ __forceinline__ void copy_box(unsigned dst, const TensorMap* map, int col, int row, int head, int batch,
                                         unsigned barrier)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(barrier) : "memory");
}

// Byte offset of 16-byte chunk c (of d_head / 8) of row r in O_i's bfloat16 buffer of `rows` rows:
// 64-column halves one after the other, chunk c % 8 of a half's row r at chunk (c % 8) ^ (r % 8).
template <int rows>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    return (c / 8) * rows * 128 + r * 128 + 16 * ((c % 8) ^ (r % 8));
}

// The thread's index, read afresh where it is used. Shared-memory addresses computed from it are the
// same for every tile; the compiler would hoist them out of the tile loop and hold them in registers
// through every step (with three consumers, in local memory), so the per-tile code reads it here.
__device__ __forceinline__ int thread_index()
{
    int i;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(i));
    return i;
}

// One tile of work: B_r query rows of one head, and the T_c key tiles they see (-1: no more work).
struct Tile {
    int row_start, head, batch, T_c;
};

// The tiles in the order they are handed out: heavy tiles first, in chunks of heads. Index k reads as
// (chunk, tile rank, head in the chunk), counting query tiles down within each chunk. When the K and
// V of all heads fit in L2 (L2_ALL), one chunk holds every head, as in v15; otherwise a chunk's K and
// V take L2_CHUNK, so the blocks at work at once share a few heads' K and V.
struct Schedule {
    int T_r, n_heads, heads, chunk, tiles;  // heads: (batch, head) pairs; tiles: T_r x heads

    __device__ Schedule(int T_q, int T_k, int n_heads_, int batches, int B_r, int d_head)
        : T_r((T_q + B_r - 1) / B_r), n_heads(n_heads_), heads(n_heads_ * batches)
    {
        const long long kv_bytes = 2LL * T_k * d_head;  // K and V^T of one head, 1 byte an element
        chunk = (long long)heads * kv_bytes <= L2_ALL ? heads : (int)max(1LL, min((long long)heads, L2_CHUNK / kv_bytes));
        tiles = T_r * heads;  // below 2^31: the launcher checks
    }

    template <int B_r, int B_c>
    __device__ Tile at(int k, int T_q, int T_k, int causal) const
    {
        const int chunk_tiles = chunk * T_r;
        const int first_head = k / chunk_tiles * chunk;
        const int heads_here = min(chunk, heads - first_head);  // the last chunk may be short
        const int within = k % chunk_tiles;
        const int q_tile = T_r - 1 - within / heads_here;
        const int bh = first_head + within % heads_here;  // = batch * NH + head
        Tile tile;
        tile.batch = bh / n_heads;
        tile.head = bh % n_heads;
        tile.row_start = q_tile * B_r;
        tile.T_c = (T_k + B_c - 1) / B_c;
        if (causal) {  // query row i sees keys j <= i + T_k - T_q (bottom-right causal mask)
            const int last_key = min(tile.row_start + B_r, T_q) - 1 + T_k - T_q;
            tile.T_c = last_key < 0 ? 0 : min(tile.T_c, last_key / B_c + 1);
        }
        return tile;
    }
};

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(B_r * 2 + 128, 1)
attention_forward(const byte* __restrict__ /* Q */, const byte* __restrict__ /* K */,
                  const byte* __restrict__ /* V^T */, element* __restrict__ O, float* __restrict__ workspace,
                  int T_q, int T_k, int kv_group, int causal, float scale,
                  long long /* q_batch_stride */, long long /* q_head_stride */, long long /* q_row_stride */,
                  long long /* kv_batch_stride */, long long /* kv_head_stride */, long long /* kv_row_stride */,
                  const float* __restrict__ q_scale, const float* __restrict__ k_scale,
                  const float* __restrict__ v_scale, int n_heads, int batches,
                  const __grid_constant__ TensorMap Q_map, const __grid_constant__ TensorMap K_map,
                  const __grid_constant__ TensorMap V_map)
{
    static_assert(d_head == 64 || d_head == 128, "rows of 64 or 128 bytes: one swizzled box per tile");
    static_assert(B_r == 128 || B_r == 192, "two or three consumer warpgroups of 64 rows");
    static_assert(B_c == 128 || (B_c == 224 && d_head == 128), "key tiles of 128, or of 224 at d = 128");
    constexpr int CONSUMERS = B_r / 64;     // consumer warpgroups
    constexpr int D_STEPS = d_head / 32;    // k32 steps of Q_i K_j^T
    constexpr int D_TILES = d_head / 8;     // n8 tiles of O_i
    constexpr int N_TILES = B_c / 8;        // n8 tiles of S_ij
    constexpr int KEY_STEPS = B_c / 32;     // k32 steps of P_ij V_j
    constexpr int chunks = d_head / 8;      // 16-byte chunks of a bfloat16 row of O_i
    constexpr unsigned Q_BYTES = B_r * d_head;
    constexpr int V_BOXES = (B_c + 127) / 128;     // V^T_j's boxes of 128 keys
    constexpr unsigned K_BYTES = B_c * d_head;     // K_j
    constexpr unsigned V_BOX_BYTES = d_head * 128;  // a box of V^T_j
    constexpr unsigned V_BYTES = V_BOXES * V_BOX_BYTES;
    constexpr int STAGES = (8 - d_head / 32) * 128 / B_c;  // of K_j, and of V^T_j: 6 or 4 of 128 keys, 2 of 224
    // Registers per thread after the split: the producer's few, the consumers' share of the rest.
    constexpr int PRODUCER_REGISTERS = 24;
    constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 240 : 160;
    static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * 128 * CONSUMERS <= 65536 / (128 * (1 + CONSUMERS)) / 8 * 8 * (128 * (1 + CONSUMERS)),
                  "the block's pool: 65536 / threads registers a thread, in 8s, as it launched (setmaxnreg.inc waits for more: a hang)");

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned Q_smem = ((unsigned)__cvta_generic_to_shared(smem) + 1023) & ~1023u;
    const unsigned O_smem = Q_smem + Q_BYTES;              // O_i in bfloat16 on its way out, while Q_i+1 comes in
    const unsigned K_smem = O_smem + 2 * B_r * d_head;     // STAGES stages of K_j
    const unsigned V_smem = K_smem + STAGES * K_BYTES;  // STAGES stages of V^T_j
    const unsigned ones_smem = V_smem + STAGES * V_BYTES;  // 8 rows of 128 e4m3 ones: the row sums' B
    // Q_i's full and empty barriers, then per stage the full barriers of K_j and V^T_j and their empty
    // barriers. Ring use u (the u-th K/V tile of the block, counted over all its tiles of work) goes
    // to stage u % STAGES as that stage's use u / STAGES; the block's n-th tile of work is Q's use n.
    __shared__ __align__(8) unsigned long long barriers[2 + 4 * STAGES];
    __shared__ Tile tile_slot[2];  // the block's n-th tile, in slot n % 2, handed over with Q's use n
    const unsigned Q_full = (unsigned)__cvta_generic_to_shared(barriers);
    const unsigned Q_empty = Q_full + 8;
    auto K_full = [&](int u) { return Q_full + 8 * (2 + u % STAGES); };
    auto V_full = [&](int u) { return Q_full + 8 * (2 + STAGES + u % STAGES); };
    auto K_empty = [&](int u) { return Q_full + 8 * (2 + 2 * STAGES + u % STAGES); };
    auto V_empty = [&](int u) { return Q_full + 8 * (2 + 3 * STAGES + u % STAGES); };
    auto parity = [](int u) { return (unsigned)(u / STAGES) & 1u; };  // ring use u: use u / STAGES of its stage

    // The ones (e4m3 1.0 = 0x38 in every byte, so the swizzle does not matter), written once through
    // the generic proxy and fenced for the products' async reads of them.
    for (int i = threadIdx.x; i < 128 * 8 / 16; i += blockDim.x)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(ones_smem + 16 * i), "r"(0x38383838u) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // Thread 0 makes the barriers; every thread waits for them to exist (the last block-wide barrier).
    if (threadIdx.x == 0) {
        mbarrier_init(Q_full, 1);  // the producer's arrival, and the bytes
        mbarrier_init(Q_empty, 128 * CONSUMERS);  // every consumer thread (the tile slots)
        for (int b = 2; b < 2 + 2 * STAGES; ++b)
            mbarrier_init(Q_full + 8 * b, 1);  // full: the producer's arrival, and the bytes
        for (int b = 2 + 2 * STAGES; b < 2 + 4 * STAGES; ++b)
            mbarrier_init(Q_full + 8 * b, 4 * CONSUMERS);  // empty: every consumer warp
        mbarrier_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // The producer (v24's). Its warpgroup gives its registers back; one thread draws the block's
        // tiles and issues every load, in the order the consumers read them: Q_i, then K_j and V^T_j
        // (which step j + 1 reads), each as soon as the consumers have released the stage's previous use.
        registers_down<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            unsigned* tile_counter = reinterpret_cast<unsigned*>(workspace);  // zero at launch
            const Schedule schedule(T_q, T_k, n_heads, batches, B_r, d_head);
            int u = 0;  // ring uses so far
            for (int n = 0, k = blockIdx.x;; ++n) {
                // Q's use n - 1 released: its bytes landed, and the consumers are done with slot n % 2.
                if (n > 0)
                    mbarrier_wait(Q_empty, (n - 1) & 1);
                const Tile tile = k < schedule.tiles ? schedule.at<B_r, B_c>(k, T_q, T_k, causal) : Tile{0, 0, 0, -1};
                tile_slot[n % 2] = tile;  // published by the arrival below (release), read after the wait (acquire)
                if (tile.T_c < 0) {
                    mbarrier_arrive(Q_full);  // no bytes: the consumers read T_c = -1 and leave
                    break;
                }
                const int kv_head = tile.head / kv_group;
                load_tile(Q_smem, &Q_map, 0, tile.row_start, tile.head, tile.batch, Q_full, Q_BYTES);
                for (int j = 0; j < tile.T_c; ++j, ++u) {
                    if (u >= STAGES)
                        mbarrier_wait(K_empty(u), parity(u) ^ 1u);
                    load_tile(K_smem + (u % STAGES) * K_BYTES, &K_map, 0, j * B_c, kv_head, tile.batch, K_full(u), K_BYTES);
                    if (u >= STAGES)
                        mbarrier_wait(V_empty(u), parity(u) ^ 1u);
                    // V^T (B, NH_kv, d, T_pad): column j B_c + 128 b (the key), row 0 (the first of d rows)
                    mbarrier_arrive_expect(V_full(u), V_BYTES);
#pragma unroll
                    for (int b = 0; b < V_BOXES; ++b)
                        copy_box(V_smem + (u % STAGES) * V_BYTES + b * V_BOX_BYTES, &V_map, j * B_c + 128 * b, 0, kv_head,
                                 tile.batch, V_full(u));
                }
                // The next tile, v24's draw: the last number drawn, tiles - 1, puts the counter back to
                // zero for the next launch.
                const unsigned ticket = atomicAdd(tile_counter, 1u);
                if (ticket == (unsigned)schedule.tiles - 1u)
                    atomicExch(tile_counter, 0u);
                k = gridDim.x + ticket;
            }
            // Leave with no copy in flight: Q's last bytes landed before its release; the last uses
            // of the ring are waited for here.
            for (int v = max(0, u - STAGES); v < u; ++v) {
                mbarrier_wait(K_full(v), parity(v));
                mbarrier_wait(V_full(v), parity(v));
            }
        }
        return;
    }

    // A consumer: warpgroup c + 1 takes rows 64 c .. 64 c + 63 of each Q_i.
    registers_up<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1;
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;  // warp within the warpgroup
    const int g = lane / 4, t = lane % 4;
    const int wg_row = 64 * consumer;  // first row of this warpgroup in Q_i
    const int offset = T_k - T_q;      // query row i sees keys j <= i + offset (bottom-right causal mask)
    const int T_r = (T_q + B_r - 1) / B_r, T_ck = (T_k + B_c - 1) / B_c;  // Q's and K's tiles of scales
    // The warp's arrival on an empty barrier, once its products have read the stage.
    auto release = [&](unsigned barrier) {
        if (lane == 0)
            mbarrier_arrive(barrier);
    };

    // S = Q_i K_j^T: d / 32 k32 steps, each 32 bytes further along the rows.
    auto issue_S = [&](float (&S)[B_c / 2], int u) {
        const unsigned K_j = K_smem + (u % STAGES) * K_BYTES;
#pragma unroll
        for (int s = 0; s < D_STEPS; ++s) {
            const unsigned a = Q_smem + wg_row * d_head + 32 * s;
            wgmma_ss<B_c>(S, descriptor<d_head>(a), descriptor<d_head>(K_j + 32 * s), s > 0);
        }
        wgmma_commit();
    };
    float O_acc[d_head / 2];  // n8 tile n, entry e: row my_row + 8 (e / 2), column 8 n + 2 t + e % 2
    float P_sum[4];  // the tile's row sums of P: rows my_row (entries 0, 1) and my_row + 8 (2, 3)
    // O_i += P V_j, P the e4m3 probabilities of ring use u: key step kk is columns 32 (kk % 4) .. of
    // V^T_j's box kk / 4;
    // and P_sum = rowsum(P), from zero at the tile's first key step.
    auto issue_PV = [&](const unsigned (&P)[KEY_STEPS][4], int u) {
        const unsigned V_j = V_smem + (u % STAGES) * V_BYTES;
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk) {
            wgmma_rs<d_head>(O_acc, P[kk], descriptor<128>(V_j + kk / 4 * V_BOX_BYTES + 32 * (kk % 4)));
            wgmma_row_sums(P_sum, P[kk], descriptor<128>(ones_smem + 32 * (kk % 4)), kk > 0);
        }
        wgmma_commit();
    };
    // P_ij as the A operand of each key step, in kernels.fp8.KEY_ORDER (v25's).
    auto round_P = [&](unsigned (&P)[KEY_STEPS][4], const float (&S)[B_c / 2]) {
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int n = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);  // S[4 n + e] is tile n, row g + 8 (e / 2)
                P[kk][r] = pack_e4m3(S[4 * n + e], S[4 * n + e + 1], S[4 * n + 4 + e], S[4 * n + 4 + e + 1]);
            }
    };

    int u0 = 0;  // ring uses of the block's earlier tiles
    for (int n = 0;; ++n) {
        mbarrier_wait(Q_full, n & 1);
        // The tile from shared memory, read where needed (v24's).
        const Tile& tile = tile_slot[n % 2];
        const int T_c = tile.T_c;
        if (T_c < 0)
            break;
        const int wg_first = tile.row_start + wg_row;  // first row of this warpgroup as a query index
        const int my_row = wg_first + 16 * warp + g;   // this thread's rows: my_row and my_row + 8
        const long long bh = (long long)tile.batch * n_heads + tile.head;
        // The tile's scales: Q_i's, and the rows of K's and V's scales for this K/V head.
        const long long kv_tiles = ((long long)tile.batch * (n_heads / kv_group) + tile.head / kv_group) * T_ck;
        const float* K_scale = k_scale + kv_tiles;
        const float* V_scale = v_scale + kv_tiles;
        const float score_log2 = fabsf(scale) * LOG2_E * q_scale[bh * T_r + tile.row_start / B_r];  // times s_K,j per tile
        // The consumers' release of Q_i once the last product that reads it has landed, every thread
        // arriving (v24's).
        auto release_Q = [&]() { mbarrier_arrive(Q_empty); };

        if (scale < 0.0f && T_c > 0) {  // S with -Q_i and |scale|: flip the sign bit of every byte of this warpgroup's rows
            for (int i = thread_index() % 128; i < 64 * d_head / 16; i += 128) {
                const unsigned at = Q_smem + wg_row * d_head + 16 * i;  // the rows are contiguous: the swizzle stays in a row
                unsigned w[4];
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at));
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0] ^ 0x80808080u), "r"(w[1] ^ 0x80808080u),
                             "r"(w[2] ^ 0x80808080u), "r"(w[3] ^ 0x80808080u));
            }
            // Back to the async proxy, then the warpgroup's own barrier (1 + c: 0 is __syncthreads').
            asm volatile("fence.proxy.async.shared::cta;\nbar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
        }

        float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};  // m_i in scaled log2 units
#pragma unroll
        for (int i = 0; i < d_head / 2; ++i)
            O_acc[i] = 0.0f;

        // The online softmax of one tile in place, f = score_log2 s_K,j: S becomes 2^(f S - m_new + 8),
        // m_i moves on, alpha holds each row's rescale factor; true if some row max of the warp moved.
        // No row sums: P V writes each tile's into O_i's last tile.
        auto softmax = [&](float (&S)[B_c / 2], int j, float f, float (&alpha)[2]) {
            const int col_start = j * B_c;
            if ((causal && col_start + B_c - 1 > wg_first + offset) || col_start + B_c > T_k) {
#pragma unroll
                for (int i = 0; i < B_c / 2; ++i) {
                    const int row = my_row + 8 * (i % 4 / 2);
                    const int key = col_start + 8 * (i / 4) + 2 * t + i % 2;
                    if (key >= T_k || (causal && key > row + offset))
                        S[i] = -INFINITY;
                }
            }
            bool max_moved = false;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float raw_max = -INFINITY;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
                    raw_max = fmaxf(raw_max, fmaxf(S[4 * n + 2 * h], S[4 * n + 2 * h + 1]));
                raw_max = fmaxf(raw_max, __shfl_xor_sync(FULL_WARP, raw_max, 1));
                raw_max = fmaxf(raw_max, __shfl_xor_sync(FULL_WARP, raw_max, 2));
                const float m_new = fmaxf(m_i[h], raw_max * f);  // f > 0: the maximum of f S
                const float m_scaled = m_new == -INFINITY ? 0.0f : m_new;
                max_moved |= m_new != m_i[h];
                alpha[h] = m_new == m_i[h] ? 1.0f : exp2_approx(m_i[h] - m_scaled);
                const float shift = P_SHIFT - m_scaled;
                m_i[h] = m_new;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e)
                        S[4 * n + e] = exp2_approx(fmaf(S[4 * n + e], f, shift));
            }
            return __any_sync(FULL_WARP, max_moved);
        };

        // No branch around a wgmma depends on the warpgroup (v24's): every consumer runs every step of
        // every tile and arrives on every empty barrier the producer counts.
        const float s_V = V_scale[0];  // O_i's unit: V's scale, the same in every tile of the head
        if (T_c == 0) {
            release_Q();  // no key to see: O_i is zero
        } else {
            float S[B_c / 2], alpha[2];
            unsigned P[KEY_STEPS][4];  // P_i,j-1 in e4m3: the A registers of each key step
            mbarrier_wait(K_full(u0), parity(u0));
            wgmma_fence();
            issue_S(S, u0);
            wgmma_wait_all();
            settle(S);
            release(K_empty(u0));
            if (T_c == 1)
                release_Q();
            softmax(S, 0, fmaxf(score_log2 * K_scale[0], FLT_MIN_NORMAL), alpha);  // O_i is still zero
            round_P(P, S);
            for (int j = 1; j < T_c; ++j) {
                const int u = u0 + j;
                const float s_K = K_scale[j];
                mbarrier_wait(K_full(u), parity(u));
                mbarrier_wait(V_full(u - 1), parity(u - 1));
                wgmma_fence();
                issue_S(S, u);
                issue_PV(P, u - 1);
                wgmma_wait_one();  // S_ij has landed; P_i,j-1 V_j-1 may still run
                settle(S);
                release(K_empty(u));
                if (j == T_c - 1)
                    release_Q();
                // while P_i,j-1 V_j-1 runs
                const bool moved = softmax(S, j, fmaxf(score_log2 * s_K, FLT_MIN_NORMAL), alpha);
                wgmma_wait_all();
                settle(O_acc);
                release(V_empty(u - 1));
                settle(P_sum);
                l_i[0] = (l_i[0] + P_sum[0]) * alpha[0];  // l_i = alpha (l_i + rowsum(P_i,j-1)), in float32
                l_i[1] = (l_i[1] + P_sum[2]) * alpha[1];
                if (moved) {  // O_i = alpha (O_i + P_i,j-1 V_j-1)
#pragma unroll
                    for (int i = 0; i < d_head / 2; ++i)
                        O_acc[i] *= alpha[i % 4 / 2];
                }
                round_P(P, S);
            }
            const int last = u0 + T_c - 1;
            mbarrier_wait(V_full(last), parity(last));
            wgmma_fence();
            issue_PV(P, last);
            wgmma_wait_all();
            settle(O_acc);
            settle(P_sum);
            release(V_empty(last));
            l_i[0] += P_sum[0];
            l_i[1] += P_sum[2];
        }
        u0 += T_c;

        element* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d) bfloat16
        const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;
        // O_i = O_i s_V / l_i, rounded to bfloat16 into this warp's own rows of O_smem, then out in
        // 16-byte stores. The warp wrote and read the same rows for its previous tile: sync before writing.
        __syncwarp();
        const int tid = thread_index(), out_lane = tid % 32, out_warp = tid / 32 % 4;
        const int out_row = wg_row + 16 * out_warp + out_lane / 4, out_t = out_lane % 4;  // as my_row - row_start, and t
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float out_scale = l_i[h] > 0.0f ? s_V / l_i[h] : 0.0f;
            const int r = out_row + 8 * h;
#pragma unroll
            for (int n = 0; n < D_TILES; ++n) {
                const unsigned o = pack_bf16(O_acc[4 * n + 2 * h] * out_scale, O_acc[4 * n + 2 * h + 1] * out_scale);
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(O_smem + swizzled<B_r>(r, n) + 4 * out_t), "r"(o));
            }
        }
        __syncwarp();
        const int warp_row = wg_row + 16 * out_warp;
#pragma unroll
        for (int idx = out_lane; idx < 16 * chunks; idx += 32) {
            const int r = idx / chunks, c = idx % chunks;
            const int row = tile.row_start + warp_row + r;
            if (row < T_q) {
                unsigned w[4];
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(O_smem + swizzled<B_r>(warp_row + r, c)));
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
}
