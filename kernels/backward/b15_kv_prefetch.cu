/*
 * b15 - the next tile's K_j and V_j asked of L2 ahead, after b13's stores: b13 with its producer warp, once it
 * has drawn the block's next key tile (about a step and a half before the consumers finish the current one),
 * asking L2 for that tile's K_j and V_j (cp.async.bulk.prefetch.tensor), so that the copy into shared memory
 * at the tile's start reads L2 instead of HBM.
 *
 * Why: on b10 the same prefetch was a null (1.00x at every shape): the tile's start was then dK_j's and dV_j's
 * 4-byte stores, 4,350-5,950 cycles a consumer. b13 made them 16 bytes a lane; its trace after them
 * (docs/backward.md#b13) has consumer 0's stores at 1,750-2,150 cycles and consumer 1 getting the next tile's
 * K_j and V_j 5,950-6,750 cycles after the boundary begins, their copy landing 2,050-4,000 cycles after it
 * is issued, with all 132 blocks switching tiles at once without the mask (8.4 MB of K_j and V_j). So the
 * copy's wait is now the larger part of the boundary, and it is what the prefetch hides.
 *
 * Everything else is b13's: the 16-byte stores, the tiles of 80 queries, dQ_i transposed, the pingpong turns,
 * the ring of two stages, the persistent tiles, deterministic mode, the STEP_TRACE diagnostic with the key
 * tiles' ends and starts (tile_trace).
 *
 * Geometry: backward_dk_dv on grid (min(T_c x NH_kv x B, SMs), 1, 1), 384 threads, one block per SM;
 * shared memory 231,680 bytes, 14 mbarriers and two ints (static). Named barriers: 2 + c (consumer c's own
 * 128 threads), 4 + c (consumer c's turn, 256 threads).
 *
 * Limits: sm_90a only; d 128 (B_r 80), B_c 128; dtype_id 0 bfloat16, 1 float16.
 *
 * lab.template    d_head, B_r, B_c, dtype_id, deterministic
 * lab.configs     (128, 80, 128, 0, 0), (128, 80, 128, 1, 0), (128, 80, 128, 0, 1), (128, 80, 128, 1, 1)
 * lab.threads     256
 * lab.smem        0
 * lab.phase       backward_preprocess: query tiles
 * lab.phase       backward_dk_dv: key tiles persistent, threads 128 + 2 * B_c, smem 2 * (2 * B_c * d_head + 4 * B_r * d_head + 2 * B_c * B_r) + 4 * B_r * d_head + 16 * B_r + 1024
 * lab.phase       backward_dq: query tiles
 * lab.dq_accum    true
 * lab.deterministic deterministic
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a -default-device
 * lab.unverified not yet run on a GPU
 * lab.tma         Q: (B_r, 64), K: (B_c, 64), V: (B_c, 64), dO: (B_r, 64), dQ_accum: (B_r, 32)
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr long long L2_CHUNK = 16ll << 20;  // a chunk of heads (below)
constexpr int CAUSAL_ROUNDS = 16;           // a causal grid in chunks from this many rounds of the blocks
constexpr int AUX_THREADS = 256;  // backward_preprocess and backward_dq (lab.threads)
constexpr unsigned FULL_WARP = 0xffffffffu;

// A diagnostic build (tools/rung_trace.py compiles a copy with -DSTEP_TRACE=1; off, nothing is compiled
// in): block 0's consumers read the SM clock at six points of each step of the dK/dV loop (its top, the
// first turn's products issued, S^T and dP^T landed, dS^T written, the second turn's products issued,
// those landed), thread 0 of each warpgroup, the block's steps below TRACE_STEPS, into
// step_trace[consumer][step][point].
#ifndef STEP_TRACE
#define STEP_TRACE 0
#endif
#if STEP_TRACE
constexpr int TRACE_STEPS = 512, TRACE_POINTS = 6;
__device__ long long step_trace[2][TRACE_STEPS][TRACE_POINTS];
// And the block's first key tiles' ends and starts: tile_trace[c][u] of consumer c at tile u (its last dQ_i
// turn begun, the turn taken, the share landed, stored, dK_j and dV_j stored; then, at tile u's start, its
// number read and its K_j and V_j landed), tile_trace[2][u] of the producer (tile u drawn, its K_j and V_j
// copy issued).
constexpr int TRACE_TILES = 24;
__device__ long long tile_trace[3][TRACE_TILES][8];
#endif

// STEP_TRACE's clock read at `point` of the block's step n, by thread 0 of consumer c's warpgroup in block 0.
__device__ __forceinline__ void trace_point(int c, int n, int point)
{
#if STEP_TRACE
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && n < TRACE_STEPS) {
        long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
        step_trace[c][n][point] = t;
    }
#endif
}

// STEP_TRACE's clock read at `point` of the block's tile u, by thread 0 of warpgroup `who` - 1 (the
// producer: who = 2) in block 0.
__device__ __forceinline__ void tile_point(int who, int u, int point)
{
#if STEP_TRACE
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && u >= 0 && u < TRACE_TILES) {
        long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
        tile_trace[who][u][point] = t;
    }
#endif
}

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

// A 4 x 4 transpose of 32-bit words within a quad (lanes 4 g + t, t = 0..3, all 32 lanes taking part):
// lane t gives a[j], its word of column block j, and gets back the four lanes' words of block t, lane
// s's as word s. Lanes t and t ^ 1 trade one word of each pair of blocks, then lanes t and t ^ 2 two.
__device__ __forceinline__ uint4 quad_transpose(unsigned a0, unsigned a1, unsigned a2, unsigned a3, int t)
{
    const bool odd = t & 1, high = t & 2;
    const unsigned r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 1);
    const unsigned r1 = __shfl_xor_sync(0xffffffffu, odd ? a2 : a3, 1);
    // words (lane t & ~1's, lane t | 1's) of blocks t & 1 (m0, m1) and 2 + (t & 1) (m2, m3)
    const unsigned m0 = odd ? r0 : a0, m1 = odd ? a1 : r0, m2 = odd ? r1 : a2, m3 = odd ? a3 : r1;
    const unsigned v0 = __shfl_xor_sync(0xffffffffu, high ? m0 : m2, 2);
    const unsigned v1 = __shfl_xor_sync(0xffffffffu, high ? m1 : m3, 2);
    return high ? make_uint4(v0, v1, m2, m3) : make_uint4(m0, m1, v0, v1);
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

// A compile-time flag for a generic lambda's argument (NVRTC's C++17 has no template lambdas).
template <bool value_>
struct Flag {
    static constexpr bool value = value_;
};

// One tile of the persistent loop: key tile j of K/V head kv_bh (= batch * NH_kv + kv_head), its first
// query tile and its steps, (query head, query tile) pairs.
struct Item {
    int j, kv_bh, batch, kv_head, col_start, first_tile, tiles_per_head, steps;
};

// -- wgmma -----------------------------------------------------------------------------------------

// A shared-memory matrix descriptor for the 128-byte swizzle: start address, leading and stride
// byte offsets (all in 16-byte units), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned lbo, unsigned sbo)
{
    return (unsigned long long)((address & 0x3ffff) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(sbo >> 4) << 32 | 1ull << 62;
}

// The descriptor of the matrix `offset` bytes past `address`, whose descriptor is `base`. By adds,
// base + offset / 16: the start-address field is address / 16 in the low 14 bits, and a shared-memory
// address is below 256 KB, so nothing carries out of the field. One add where building it from its
// address takes a dozen integer instructions; 1.03x at d = 128 causal, within resolution elsewhere
// (docs/backward.md#b08-descriptors). Not in deterministic mode, where at d = 128 the hoisted
// descriptors spill.
template <bool adds>
__device__ __forceinline__ unsigned long long descriptor_past(unsigned long long base, unsigned address, unsigned offset,
                                                              unsigned lbo, unsigned sbo)
{
    if constexpr (adds)
        return base + (offset >> 4);
    else
        return descriptor(address + offset, lbo, sbo);
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
#define ACC40 ACC32, ACC4(32), ACC4(36)
#define ACC64 ACC32, ACC16(32), ACC16(48)
#define REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39}"
#define REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WGMMA(N, T) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " "
// Both operands from shared memory: D registers, then descriptors a and b, the accumulate flag
// (a predicate: D = A B when it is 0) and the two transpose immediates, operands A .. TB.
#define WGMMA_SS(N, T, REGS, A, B, P, TA, TB) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n" WGMMA(N, T) REGS ", %" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}"

// D (+)= A B, A 64 x 16 and B 16 x N both in shared memory; D = A B when accumulate is 0. trans_a,
// trans_b 0: the operand is K-major (its rows are its m or n index, k contiguous), 1: MN-major
// (its rows are the k index, m or n contiguous), read transposed.
template <int N, int dtype_id, int trans_a, int trans_b>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate)
{
    static_assert(N == 32 || N == 64 || N == 80 || N == 128, "m64n32k16, m64n64k16, m64n80k16 or m64n128k16");
    if constexpr (N == 80 && dtype_id == 0)
        asm volatile(WGMMA_SS(80, "bf16", REGS40, 40, 41, 42, 43, 44)
                     : ACC40 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (N == 80)
        asm volatile(WGMMA_SS(80, "f16", REGS40, 40, 41, 42, 43, 44)
                     : ACC40 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (N == 32 && dtype_id == 0)
        asm volatile(WGMMA_SS(32, "bf16", REGS16, 16, 17, 18, 19, 20)
                     : ACC16(0) : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (N == 32)
        asm volatile(WGMMA_SS(32, "f16", REGS16, 16, 17, 18, 19, 20)
                     : ACC16(0) : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (N == 64 && dtype_id == 0)
        asm volatile(WGMMA_SS(64, "bf16", REGS32, 32, 33, 34, 35, 36)
                     : ACC32 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (N == 64)
        asm volatile(WGMMA_SS(64, "f16", REGS32, 32, 33, 34, 35, 36)
                     : ACC32 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else if constexpr (dtype_id == 0)
        asm volatile(WGMMA_SS(128, "bf16", REGS64, 64, 65, 66, 67, 68)
                     : ACC64 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
    else
        asm volatile(WGMMA_SS(128, "f16", REGS64, 64, 65, 66, 67, 68)
                     : ACC64 : "l"(a), "l"(b), "r"(accumulate), "n"(trans_a), "n"(trans_b));
}

// D += A B, A 64 x 16 in registers (mma.sync's A fragment, per warp), B 16 x N in shared memory,
// MN-major (its rows are the k index), read transposed (the last immediate).
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

// -- TMA, bulk reductions, barriers ----------------------------------------------------------------

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

// `bytes` more to come in the current phase from the copies that complete_tx on it; no arrival.
__device__ __forceinline__ void mbarrier_expect(unsigned barrier, unsigned bytes)
{
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}

// This thread's arrival (release: its reads and writes of shared memory come before it).
__device__ __forceinline__ void mbarrier_arrive(unsigned barrier)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
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

// Named barrier `id` (1 .. 15; 0 is __syncthreads') for `threads` threads, whole warps: wait there, or
// arrive and go on (the threads that wait see this thread's earlier writes).
__device__ __forceinline__ void barrier_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void barrier_arrive(int id, int threads)
{
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A warpgroup's registers per thread, resized at run time (all its warps execute the same one).
template <int registers>
__device__ __forceinline__ void registers_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(registers)); }
template <int registers>
__device__ __forceinline__ void registers_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(registers)); }

// One box of the descriptor's (B, NH, T, d) array, at column `col` of row `row` of (head, batch),
// into shared memory at `dst` (1024-byte aligned: the swizzle pattern starts there); its bytes
// complete_tx on `barrier`. Coordinates go innermost first, as the descriptor's dimensions.
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap* map, int col, int row, int head, int batch,
                                         unsigned barrier)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(barrier) : "memory");
}

// Rows row_start .. row_start + rows - 1 of one head into a swizzled tile, one box per 64-column
// half (the halves one after the other, rows * 128 bytes each); rows past T arrive as zeros.
template <int d_head, int rows>
__device__ __forceinline__ void load_tile(unsigned tile, const TensorMap* map, int row_start, int head, int batch,
                                          unsigned barrier)
{
#pragma unroll
    for (int half = 0; half < d_head / 64; ++half)
        tma_load(tile + half * rows * 128, map, 64 * half, row_start, head, batch, barrier);
}

// The same rows asked of L2 only, nothing written to shared memory and no barrier: a hint that the copy
// above will read them soon (cp.async.bulk.prefetch.tensor, one per 64-column half).
template <int d_head, int rows>
__device__ __forceinline__ void prefetch_tile(const TensorMap* map, int row_start, int head, int batch)
{
#pragma unroll
    for (int half = 0; half < d_head / 64; ++half)
        asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
                     ::"l"(map), "r"(64 * half), "r"(row_start), "r"(head), "r"(batch) : "memory");
}

// The box of the descriptor's float32 array at (col, row, head, batch) += the shared-memory tile at
// `src`, element by element, in L2 (a bulk reduction: the copy engine reads src and adds; rows past T
// are left alone). Committed as this thread's bulk group.
__device__ __forceinline__ void tma_reduce_add(unsigned src, const TensorMap* map, int col, int row, int head, int batch)
{
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 ::"l"(map), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(src) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until this thread's bulk groups have read their shared memory (it may be written again) ...
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... or have completed, their writes done.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Four 8 x 8 matrices of 16-bit values stored transposed: register i of every lane holds its row g, columns
// 2 t and 2 t + 1 of matrix i (mma's fragment layout, g = lane / 4, t = lane % 4); lane l gives the address
// of row l % 8 of the stored matrix l / 8 (16 bytes: what was its column l % 8).
__device__ __forceinline__ void stmatrix_trans(unsigned row_address, const unsigned (&r)[4])
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(row_address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Ordinary writes of shared memory made visible to the async proxy (wgmma, the copy engine).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The deterministic order: wait until a query tile's count of finished dQ additions is at least
// `turn`; add one to it once this thread's additions have completed.
__device__ __forceinline__ void wait_turn(const int* count, int turn)
{
    int now;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
    } while (now < turn);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the reductions after the wait
}

__device__ __forceinline__ void pass_turn(int* count)
{
    bulk_wait_all();
    asm volatile("fence.proxy.async.global;\nred.release.gpu.global.add.s32 [%0], 1;" ::"l"(count) : "memory");
}

// -- the phases ------------------------------------------------------------------------------------

#define TENSOR_MAPS                                                                                  \
    const __grid_constant__ TensorMap Q_map, const __grid_constant__ TensorMap K_map,               \
        const __grid_constant__ TensorMap V_map, const __grid_constant__ TensorMap dO_map,          \
        const __grid_constant__ TensorMap dQ_map

// D_i = rowsum(dO_i o O_i) in float32 from the 16-bit values and dQ_accum's rows zeroed, 16 bytes a lane (a
// row's d / 8 lanes, 32 / (d / 8) rows a warp at a time, every pass's loads issued before the first sum:
// one 2-byte load a lane at a time kept the loads' latency in front of every product, 3.0 TB/s at
// 16 x 12 x 2048, d = 64, docs/backward.md#b08-preprocess); the tile's count of dQ additions zeroed, and by
// the first block the tile counter after the counts.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_preprocess(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
                    const element* __restrict__ O, const element* __restrict__ dO, const float* __restrict__ /* lse */,
                    element* __restrict__ /* dQ */, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
                    float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
                    int T_q, int T_k, int kv_group, int causal, float scale, int n_kv_heads, int batches, TENSOR_MAPS)
{
    constexpr int ROW_LANES = d_head / 8, WARP_ROWS = 32 / ROW_LANES;    // 8 elements (16 bytes) a lane
    constexpr int PASSES = B_r / (AUX_THREADS / 32 * WARP_ROWS);         // rows a thread sums, one a pass
    static_assert(PASSES * AUX_THREADS / 32 * WARP_ROWS == B_r, "whole passes of the block over the tile");
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // = batch * NH + head
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first_row = blockIdx.x * B_r + warp * WARP_ROWS + lane / ROW_LANES, col = 8 * (lane % ROW_LANES);
    uint4 dO_v[PASSES], O_v[PASSES];
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int row = first_row + pass * (AUX_THREADS / 32) * WARP_ROWS;
        const long long at = (bh * T_q + row) * d_head + col;
        dO_v[pass] = row < T_q ? *(const uint4*)&dO[at] : make_uint4(0, 0, 0, 0);
        O_v[pass] = row < T_q ? *(const uint4*)&O[at] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int row = first_row + pass * (AUX_THREADS / 32) * WARP_ROWS;
        const long long at = (bh * T_q + row) * d_head + col;
        const unsigned a[4] = {dO_v[pass].x, dO_v[pass].y, dO_v[pass].z, dO_v[pass].w};
        const unsigned b[4] = {O_v[pass].x, O_v[pass].y, O_v[pass].z, O_v[pass].w};
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sum = fmaf(to_float<dtype_id>((element)(a[i] & 0xffff)), to_float<dtype_id>((element)(b[i] & 0xffff)), sum);
            sum = fmaf(to_float<dtype_id>((element)(a[i] >> 16)), to_float<dtype_id>((element)(b[i] >> 16)), sum);
        }
#pragma unroll
        for (int m = ROW_LANES / 2; m > 0; m /= 2)  // the row's lanes, ROW_LANES apart from the next row's
            sum += __shfl_xor_sync(FULL_WARP, sum, m);
        if (row < T_q) {
            *(float4*)&dQ_accum[at] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *(float4*)&dQ_accum[at + 4] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (lane % ROW_LANES == 0)
                D[bh * T_q + row] = sum;
        }
    }
    if (threadIdx.x == 0)
        dQ_turns[bh * gridDim.x + blockIdx.x] = 0;
    if (threadIdx.x == 0 && bh == 0 && blockIdx.x == 0)
        dQ_turns[(long long)gridDim.x * gridDim.y * gridDim.z] = 0;  // backward_dk_dv's tile counter
}

// dQ = scale dQ_accum, rounded to the dtype, 4 values at a time.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_dq(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
            const element* __restrict__ /* O */, const element* __restrict__ /* dO */, const float* __restrict__ /* lse */,
            element* __restrict__ dQ, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ dQ_accum, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale, int n_kv_heads, int batches, TENSOR_MAPS)
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
__global__ void __launch_bounds__(128 + 2 * B_c, 1)
backward_dk_dv(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
               const element* __restrict__ /* O */, const element* __restrict__ /* dO */, const float* __restrict__ lse,
               element* __restrict__ /* dQ */, element* __restrict__ dK, element* __restrict__ dV,
               float* __restrict__ D, float* __restrict__ /* dQ_accum */, int* __restrict__ dQ_turns,
               int T_q, int T_k, int kv_group, int causal, float scale, int n_kv_heads, int batches, TENSOR_MAPS)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    static_assert(d_head == 128 && B_r == 80, "80 queries a tile at d = 128 (b08 keeps d = 64)");
    static_assert(B_c == 128, "two consumer warpgroups of 64 keys");
    constexpr int CONSUMERS = B_c / 64;      // consumer warpgroups, 64 keys each
    constexpr int STAGES = 2;                // of Q_i and dO_i
    constexpr int D_STEPS = d_head / 16;     // k16 steps of S^T and dP^T (over d)
    constexpr int Q_STEPS = B_r / 16;        // k16 steps of dV_j and dK_j (over queries)
    constexpr int KEY_STEPS = B_c / 16;      // k16 steps of dQ_i (over keys)
    // dQ_i's share of a warpgroup, computed transposed: its DQ_D columns of d (from DQ_D c) by the B_r queries.
    constexpr int DQ_D = d_head / CONSUMERS;  // 64: the M of dQ_i^T
    constexpr int DQ_BOXES = DQ_D / 32;       // dQ_accum's boxes of B_r rows x 32 float32 columns per warpgroup
    constexpr unsigned KV_BYTES = B_c * d_head * 2, QO_BYTES = B_r * d_head * 2;
    constexpr unsigned DS_BYTES = B_c * B_r * 2, DQ_BYTES = B_r * d_head * 4;
    constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;  // S^T and dP^T at N = 80 take 16 more than b08's
    constexpr int TURN = 4;  // named barriers 4 + c: consumer c's turn (0 is __syncthreads', 2 + c its own)
    // The turns (below). Without them the consumers still need not meet, and the protocol holds
    // (tests/test_backward_protocol.py models both ways), but on an H200 they then lose 2-6% to b07.
    constexpr bool TURNS = true;
    // The second turn issues the dQ_i share first, in a commit group of its own, and the consumer stores it
    // to dQ_accum while its dV_j and dK_j run (b08's order at d = 128, docs/backward.md#b08-order).
    constexpr bool DQ_FIRST = true;
    constexpr bool ADDS = !deterministic;  // descriptors by adds (descriptor_past)
    static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * 128 * CONSUMERS <= 65536 / (128 * (1 + CONSUMERS)) / 8 * 8 * (128 * (1 + CONSUMERS)),
                  "the block's pool: 65536 / threads registers a thread, in 8s, as it launched (setmaxnreg.inc waits for more: a hang)");

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned smem_start = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned K_smem = (smem_start + 1023) & ~1023u;   // K_j, B_c x d
    const unsigned V_smem = K_smem + KV_BYTES;              // V_j
    const unsigned Q_smem = V_smem + KV_BYTES;              // STAGES stages of Q_i, B_r x d
    const unsigned dO_smem = Q_smem + STAGES * QO_BYTES;    // STAGES stages of dO_i
    const unsigned dS_smem = dO_smem + STAGES * QO_BYTES;   // 2 buffers of dS, B_r x B_c (queries x keys)
    const unsigned dQ_smem = dS_smem + 2 * DS_BYTES;        // dQ_i's share, float32, B_r x d
    float* lse_smem = (float*)(smem + (dQ_smem + DQ_BYTES - smem_start));  // STAGES x B_r, log2 units
    float* D_smem = lse_smem + STAGES * B_r;                                 // STAGES x B_r
    // K_j and V_j's full and empty barriers, then per stage of Q_i and dO_i a full and an empty barrier.
    // Then the two slots of the tiles' numbers, each with a full and an empty barrier; last, the two
    // buffers of dS^T, each with a full and an empty barrier.
    __shared__ __align__(8) unsigned long long barriers[2 + 2 * STAGES + 4 + 4];
    __shared__ int item_slot[2];
    const unsigned KV_full = (unsigned)__cvta_generic_to_shared(barriers), KV_empty = KV_full + 8;
    auto QdO_full = [&](int n) { return KV_full + 8 * (2 + n % STAGES); };
    auto QdO_empty = [&](int n) { return KV_full + 8 * (2 + STAGES + n % STAGES); };
    auto item_full = [&](int w) { return KV_full + 8 * (2 + 2 * STAGES + w % 2); };
    auto item_empty = [&](int w) { return KV_full + 8 * (4 + 2 * STAGES + w % 2); };
    auto dS_full = [&](int n) { return KV_full + 8 * (6 + 2 * STAGES + n % 2); };
    auto dS_empty = [&](int n) { return KV_full + 8 * (8 + 2 * STAGES + n % 2); };
    auto parity = [](int n) { return (unsigned)(n / STAGES) & 1u; };  // step n: use n / STAGES of its stage
    auto ds_parity = [](int n) { return (unsigned)(n / 2) & 1u; };   // step n: use n / 2 of dS^T buffer n % 2

    // The tiles of work: (key tile, K/V head) pairs in b06's order, item k of the flat order read as (chunk
    // of K/V heads, key tile, head in the chunk), heavy first where causal; a chunk holds every head where
    // the grid is deterministic, or causal and shorter than CAUSAL_ROUNDS times the resident blocks;
    // otherwise as many heads as fit their query-side tensors (Q_i, dO_i: 2 bytes an element; dQ_accum: 4)
    // in L2_CHUNK, and where causal two rounds of the blocks at least. Block b takes item b first, then
    // whichever item the tile counter hands out next (G + the counter's old value, G = gridDim.x, one block
    // an SM): the block that comes free first takes the next heaviest, as the hardware hands b06's blocks
    // to the SMs. Taking items b, b + G, b + 2 G, ... instead left the low blocks the heaviest of every
    // round: 0.87-0.99x of b06 on causal grids (docs/backward.md#b07).
    const int T_c = (T_k + B_c - 1) / B_c;
    const int n_heads = n_kv_heads * batches;  // K/V heads of the whole batch
    const int items = T_c * n_heads;
    int chunk = n_heads;
    if (!deterministic && (!causal || items >= CAUSAL_ROUNDS * (int)gridDim.x)) {
        const long long head_bytes = 8LL * kv_group * T_q * d_head;
        const long long least = causal ? (2LL * gridDim.x + T_c - 1) / T_c : 1;  // two rounds where causal
        chunk = (int)min((long long)n_heads, max(L2_CHUNK / head_bytes, least));
    }
    const int G = gridDim.x;
    const int offset = T_k - T_q;            // query row i sees keys <= i + offset (causal, bottom-right)
    const int T_r = (T_q + B_r - 1) / B_r;
    int* tile_counter = dQ_turns + (long long)n_heads * kv_group * T_r;  // after the counts; zeroed by backward_preprocess
    auto item_at = [&](int k) {
        const int first_head = k / (chunk * T_c) * chunk;
        const int heads_here = min(chunk, n_heads - first_head);  // the last chunk may be short
        const int within = k % (chunk * T_c);
        Item it;
        it.j = within / heads_here;
        it.kv_bh = first_head + within % heads_here;  // = batch * NH_kv + K/V head
        it.batch = it.kv_bh / n_kv_heads;
        it.kv_head = it.kv_bh % n_kv_heads;
        it.col_start = it.j * B_c;
        it.first_tile = (causal ? max(0, it.col_start - offset) : 0) / B_r;  // the first query tile that sees key col_start
        it.tiles_per_head = max(0, T_r - it.first_tile);
        it.steps = kv_group * it.tiles_per_head;  // (query head, query tile) pairs, head-major
        return it;
    };

    // Thread 0 makes the barriers; every thread waits for them to exist (the last block-wide barrier).
    if (threadIdx.x == 0) {
        mbarrier_init(KV_full, 1);                 // the producer's arrival, and the bytes
        mbarrier_init(KV_empty, 128 * CONSUMERS);  // every consumer thread, after its tile's last product
        for (int w = 0; w < 2; ++w) {
            mbarrier_init(item_full(w), 1);               // producer lane 0, once it wrote the slot
            mbarrier_init(item_empty(w), 128 * CONSUMERS);  // every consumer thread, once it read it
        }
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(QdO_full(s), 32);              // every producer lane, one with the bytes
            mbarrier_init(QdO_empty(s), 128 * CONSUMERS);  // every consumer thread
        }
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(dS_full(b), 128 * CONSUMERS);   // every consumer thread, once its part of dS^T is written
            mbarrier_init(dS_empty(b), 128 * CONSUMERS);  // every consumer thread, once its dQ_i share that read it landed
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;
    if (warpgroup == 0) {
        // The producer: its warpgroup gives registers back; warp 0 fills the stages, lane 0 issuing
        // the copies (K_j and V_j once, then Q_i and dO_i of each step as soon as the consumers have
        // released the stage's previous use), every lane writing lse_i (in log2 units) and D_i.
        registers_down<PRODUCER_REGISTERS>();
        if (threadIdx.x < 32) {
            int n = 0, u = 0;  // steps (uses of the ring) and tiles with steps (uses of K_j and V_j) so far
            for (int w = 0;; ++w) {
                // Tile w's number, drawn and handed to the consumers in slot w % 2 (once they have read
                // tile w - 2's there); a number past the end tells everyone to leave.
                int k = 0;
                if (lane == 0) {
                    k = w == 0 ? (int)blockIdx.x : G + atomicAdd(tile_counter, 1);
                    if (w >= 2)
                        mbarrier_wait(item_empty(w), (unsigned)(w / 2 - 1) & 1u);
                    item_slot[w % 2] = k;
                    mbarrier_arrive(item_full(w));  // releases the write
                }
                k = __shfl_sync(FULL_WARP, k, 0);
                if (k >= items)
                    break;
                const Item it = item_at(k);
                tile_point(2, u, 0);
                // The tile's K_j and V_j asked of L2 now, while the consumers finish the tile before (its last
                // steps' Q_i and dO_i issued): its copy below waits for their release of that tile's.
                if (lane == 0 && w > 0 && it.steps > 0) {
                    prefetch_tile<d_head, B_c>(&K_map, it.col_start, it.kv_head, it.batch);
                    prefetch_tile<d_head, B_c>(&V_map, it.col_start, it.kv_head, it.batch);
                }
                for (int step = 0; step < it.steps; ++step, ++n) {
                    // lse_i and D_i into registers first, so that their latency passes in the wait for the stage.
                    const int head = it.kv_head * kv_group + step / it.tiles_per_head;
                    const int row_start = (it.first_tile + step % it.tiles_per_head) * B_r;
                    const long long bh = (long long)it.batch * n_kv_heads * kv_group + head;
                    constexpr int ROUNDS = (B_r + 31) / 32;  // of 32 lanes; the last in part (B_r = 80)
                    float lse_r[ROUNDS], D_r[ROUNDS];
#pragma unroll
                    for (int r = 0; r < ROUNDS; ++r) {
                        const int row = row_start + lane + 32 * r;
                        lse_r[r] = row < T_q ? lse[bh * T_q + row] * LOG2_E : INFINITY;
                        D_r[r] = row < T_q ? D[bh * T_q + row] : 0.0f;
                    }
                    if (n >= STAGES)
                        mbarrier_wait(QdO_empty(n), parity(n) ^ 1u);
                    if (lane == 0) {
                        mbarrier_expect(QdO_full(n), 2 * QO_BYTES);
                        load_tile<d_head, B_r>(Q_smem + (n % STAGES) * QO_BYTES, &Q_map, row_start, head, it.batch, QdO_full(n));
                        load_tile<d_head, B_r>(dO_smem + (n % STAGES) * QO_BYTES, &dO_map, row_start, head, it.batch, QdO_full(n));
                    }
                    float* lse_s = lse_smem + (n % STAGES) * B_r;
                    float* D_s = D_smem + (n % STAGES) * B_r;
#pragma unroll
                    for (int r = 0; r < ROUNDS; ++r)
                        if (lane + 32 * r < B_r) {
                            lse_s[lane + 32 * r] = lse_r[r];
                            D_s[lane + 32 * r] = D_r[r];
                        }
                    mbarrier_arrive(QdO_full(n));
                    // The tile's K_j and V_j after its first step's copies, which need no wait for them: once
                    // the consumers are done with the previous tile's, while they write its dK_j and dV_j out.
                    if (step == 0 && lane == 0) {
                        if (u > 0)
                            mbarrier_wait(KV_empty, (unsigned)(u - 1) & 1u);
                        tile_point(2, u, 1);
                        mbarrier_arrive_expect(KV_full, 2 * KV_BYTES);
                        load_tile<d_head, B_c>(K_smem, &K_map, it.col_start, it.kv_head, it.batch, KV_full);
                        load_tile<d_head, B_c>(V_smem, &V_map, it.col_start, it.kv_head, it.batch, KV_full);
                    }
                    if (step == 0)
                        ++u;
                }
            }
            // Leave with no copy in flight: the last K_j and V_j and the last stages have landed (the
            // earlier ones were released, so theirs had).
            if (lane == 0 && u > 0) {
                mbarrier_wait(KV_full, (unsigned)(u - 1) & 1u);
                for (int m = max(0, n - STAGES); m < n; ++m)
                    mbarrier_wait(QdO_full(m), parity(m));
            }
        }
        return;
    }

    // A consumer: warpgroup c + 1 owns keys 64 c .. 64 c + 63 of the tile, dK_j and dV_j's rows for
    // them in registers, and dQ_i's columns DQ_D c .. + DQ_D - 1 (of every query of the tile).
    if (TURNS && warpgroup == CONSUMERS)
        barrier_arrive(TURN, 256);  // consumer 0 takes the first turn (here, not later: ptxas spills otherwise)
    registers_up<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1;
    const int thread = threadIdx.x % 128;
    const int warp = thread / 32, g = lane / 4, t = lane % 4;
    const int wg_key = 64 * consumer;                  // first key of this warpgroup in the tile
    const float scale_log2 = scale * LOG2_E;
    const unsigned dQ_share = dQ_smem + consumer * DQ_BOXES * B_r * 128;  // DQ_BOXES boxes of B_r x 32 floats

    // The turns: consumer c issues each batch of products between its own turn barrier and the other's,
    // so the batches reach the tensor core alternately (S^T and dP^T of consumer 0, then of consumer 1,
    // then the dV_j / dK_j / dQ_i batch of 0, then of 1, ...) and each consumer's exponentials run under
    // the other's products. Consumer 1 passes first so that consumer 0 takes the first turn; consumer 0
    // takes one more turn at the end (consumer 1's last pass), so that every barrier ends with as many
    // passes as waits. Both take the same turns: two a step and one after a tile's last step.
    auto take_turn = [&]() {
        if constexpr (TURNS)
            barrier_sync(TURN + consumer, 256);
    };
    auto give_turn = [&]() {
        if constexpr (TURNS)
            barrier_arrive(TURN + (consumer + 1) % CONSUMERS, 256);
    };

    // dQ_i's share for step m, transposed: dQ_i^T = K_j^T dS^T, this warpgroup's DQ_D columns of d as M. A =
    // K_j's columns DQ_D c .. (its half c of d: B_c rows of 128 bytes), read transposed (MN-major: its rows
    // are the keys, k); B = dS(m), K-major: the B_r queries' rows, 128 keys in two halves of 64 (B_r * 128
    // bytes apart), k16 steps 32 bytes apart. Issued in the turn after step m's (with step m + 1's dV_j and
    // dK_j, or alone after the tile's last step), once both consumers have arrived on dS_full(m): its
    // accumulators are never live through the exponentials.
    // dQ: 4 m + 2 h + e is d column DQ_D c + 16 warp + g + 8 h, query 8 m + 2 t + e. Declared where it is
    // made, so that it is not live between the shares.
    auto issue_dQ = [&](float (&dQ)[B_r / 2], int m) {
        const unsigned dS_rows = dS_smem + (m % 2) * DS_BYTES;
        const unsigned K_cols = K_smem + consumer * B_c * 128;
        const unsigned long long K_d = descriptor(K_cols, B_c * 128, 1024), dS_d = descriptor(dS_rows, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
            wgmma_ss<B_r, dtype_id, 1, 0>(dQ, descriptor_past<ADDS>(K_d, K_cols, kk * 2048, B_c * 128, 1024),
                                          descriptor_past<ADDS>(dS_d, dS_rows, (kk / 4) * B_r * 128 + (kk % 4) * 32, 16, 1024),
                                          kk > 0);
    };
    // Once step m's dQ_i share has landed: this thread's reads of dS(m) done, then the share into shared
    // memory as dQ_accum's boxes lie (B_r rows of 32 floats, 128-byte swizzle), transposed: this thread's d
    // column DQ_D c + 16 warp + g + 8 h is column g + 8 h + 16 (warp % 2) of box warp / 2, its chunk
    // 4 (warp % 2) + 2 h + g / 4; query 8 m + 2 t + e is the row. In each store the lanes' chunks, swizzled
    // by the row (2 t + e), are 8 different ones and g % 4 picks the bank in them: all 32 banks once. One
    // thread adds the boxes into dQ_accum through the copy engine (share_free ran before the turn that
    // issued it). Step m of the block is step `step` of tile `it` (its query head and query tile recomputed
    // here, not kept in registers through the next step).
    auto store_dQ = [&](float (&dQ)[B_r / 2], int m, const Item& it, int step) {
        const int head = it.kv_head * kv_group + step / it.tiles_per_head;
        const int row_start = (it.first_tile + step % it.tiles_per_head) * B_r;
        const long long bh = (long long)it.batch * n_kv_heads * kv_group + head;
        settle(dQ);
        mbarrier_arrive(dS_empty(m));
        const unsigned box = dQ_share + (warp / 2) * B_r * 128;
#pragma unroll
        for (int mm = 0; mm < B_r / 8; ++mm)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int row = 8 * mm + 2 * t + e, chunk = 4 * (warp % 2) + 2 * h + g / 4;
                    asm volatile("st.shared.f32 [%0], %1;" ::"r"(box + row * 128 + 16 * (chunk ^ (row % 8)) + 4 * (g % 4)),
                                 "f"(dQ[4 * mm + 2 * h + e]));
                }
        fence_async_shared();
        barrier_sync(2 + consumer, 128);
        if (thread == 0) {
            int* count = dQ_turns + bh * T_r + row_start / B_r;
            if (deterministic)
                wait_turn(count, CONSUMERS * it.j);  // every addition of key tiles 0 .. j - 1 done
#pragma unroll
            for (int b = 0; b < DQ_BOXES; ++b)
                tma_reduce_add(dQ_share + b * B_r * 128, &dQ_map, DQ_D * consumer + 32 * b, row_start, head, it.batch);
            bulk_commit();
            if (deterministic)
                pass_turn(count);
        }
        __syncwarp();
        wgmma_fence();  // here, after thread 0's wait for its turn: else ptxas fences in that branch and serializes every product
    };
    // Before a turn whose products include a dQ_i share: thread 0's last reduction has read dQ's shared
    // memory (in deterministic mode its pass_turn waited for it), and every thread of the warpgroup knows so
    // before it writes the share again: the turn's barrier tells them, or without the turns barrier 2 + c.
    auto share_free = [&]() {
        if (!deterministic && thread == 0)
            bulk_wait_read();
        __syncwarp();
        if constexpr (!TURNS)
            barrier_sync(2 + consumer, 128);
    };

    int n = 0, u = 0;  // steps and tiles with steps so far, as the producer counts them
#pragma unroll 1
    for (int w = 0;; ++w) {
        mbarrier_wait(item_full(w), (unsigned)(w / 2) & 1u);
        const int k = item_slot[w % 2];
        mbarrier_arrive(item_empty(w));  // the read done (the arrival releases it)
        tile_point(consumer, u, 5);
        if (k >= items)
            break;
        const Item it = item_at(k);
        const int warp_key = it.col_start + wg_key + 16 * warp;  // this warp's first key; a thread's: + g, + g + 8
        float dK_acc[d_head / 2], dV_acc[d_head / 2];  // 4 n + e: key warp_key + g + 8 (e / 2), column 8 n + 2 t + e % 2
#pragma unroll
        for (int i = 0; i < d_head / 2; ++i)
            dK_acc[i] = 0.0f, dV_acc[i] = 0.0f;

        if (it.steps > 0)
            mbarrier_wait(KV_full, (unsigned)u & 1u);
        tile_point(consumer, u, 6);
        // Step `step` of the tile, the block's step n: both turns' products and the exponentials between them;
        // with_dQ (every step but the tile's first, a constant so that no branch goes around a product): the
        // dQ_i share of the step before in the second turn.
        auto one_step = [&](int step, auto with_dQ) {
            const int row_start = (it.first_tile + step % it.tiles_per_head) * B_r;
            const unsigned Q_i = Q_smem + (n % STAGES) * QO_BYTES, dO_i = dO_smem + (n % STAGES) * QO_BYTES;
            const float* lse_i = lse_smem + (n % STAGES) * B_r;
            const float* D_i = D_smem + (n % STAGES) * B_r;
            const unsigned dS_T = dS_smem + (n % 2) * DS_BYTES;

            // First turn: S^T = K_j Q_i^T and dP^T = V_j dO_i^T: this warpgroup's 64 rows of K_j (V_j) by
            // the rows of Q_i (dO_i), both K-major, d / 16 k16 steps 32 bytes apart (the next 64-column
            // half at 4).
            float S[B_r / 2], dP[B_r / 2];  // 4 p + e: key warp_key + g + 8 (e / 2), query 8 p + 2 t + e % 2
            trace_point(consumer, n, 0);
            mbarrier_wait(QdO_full(n), parity(n));
            take_turn();
            wgmma_fence();
            const unsigned K_rows = K_smem + wg_key * 128, V_rows = V_smem + wg_key * 128;
            const unsigned long long K_d = descriptor(K_rows, 16, 1024), Q_d = descriptor(Q_i, 16, 1024);
            const unsigned long long V_d = descriptor(V_rows, 16, 1024), dO_d = descriptor(dO_i, 16, 1024);
#pragma unroll
            for (int s = 0; s < D_STEPS; ++s)
                wgmma_ss<B_r, dtype_id, 0, 0>(S, descriptor_past<ADDS>(K_d, K_rows, (s / 4) * B_c * 128 + (s % 4) * 32, 16, 1024),
                                              descriptor_past<ADDS>(Q_d, Q_i, (s / 4) * B_r * 128 + (s % 4) * 32, 16, 1024), s > 0);
#pragma unroll
            for (int s = 0; s < D_STEPS; ++s)
                wgmma_ss<B_r, dtype_id, 0, 0>(dP, descriptor_past<ADDS>(V_d, V_rows, (s / 4) * B_c * 128 + (s % 4) * 32, 16, 1024),
                                              descriptor_past<ADDS>(dO_d, dO_i, (s / 4) * B_r * 128 + (s % 4) * 32, 16, 1024), s > 0);
            wgmma_commit();
            give_turn();
            trace_point(consumer, n, 1);

            // P^T = exp(scale S^T - lse_i), 0 where masked; dS^T = P^T o (dP^T - D_i); both rounded to 16
            // bits as they are made: the accumulators of n8 tiles 2 kk and 2 kk + 1 are the A fragment of
            // k16 step kk (queries 16 kk ..), pair h of tile p its register 2 (p % 2) + h. dS also goes to
            // buffer n % 2 of shared memory, transposed: rows of queries, this warpgroup's 64 keys its half
            // of each (B_r * 128 bytes from the other's), swizzled, once both consumers' products of step
            // n - 2 (its last readers) have landed.
            wgmma_wait_all();
            settle(S);
            settle(dP);
            trace_point(consumer, n, 2);
            const bool masked = (causal && warp_key + 15 > row_start + offset) || warp_key + 16 > T_k;
            unsigned Pa[Q_STEPS][4], dSa[Q_STEPS][4];
#pragma unroll
            for (int p = 0; p < B_r / 8; ++p) {
                const float2 l2 = *(const float2*)&lse_i[8 * p + 2 * t];
                const float2 d2 = *(const float2*)&D_i[8 * p + 2 * t];
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // keys warp_key + g + 8 h, queries 8 p + 2 t and + 1
                    const int e = 4 * p + 2 * h, r = 2 * (p % 2) + h;  // accumulator e, e + 1; A register r
                    float P0 = exp2_approx(fmaf(S[e], scale_log2, -l2.x));
                    float P1 = exp2_approx(fmaf(S[e + 1], scale_log2, -l2.y));
                    if (masked) {
                        const int key = warp_key + g + 8 * h, query = row_start + 8 * p + 2 * t;
                        P0 = key < T_k && (!causal || key <= query + offset) ? P0 : 0.0f;
                        P1 = key < T_k && (!causal || key <= query + 1 + offset) ? P1 : 0.0f;
                    }
                    Pa[p / 2][r] = pack_rounded<dtype_id>(P0, P1);
                    dSa[p / 2][r] = pack_rounded<dtype_id>(P0 * (dP[e] - d2.x), P1 * (dP[e + 1] - d2.y));
                }
            }
            // The stores after every exponential: a load of lse_i or D_i after a store to shared memory waits
            // behind it (ptxas cannot tell them apart), so stores among the exponentials made them a chain.
            if (n >= 2)
                mbarrier_wait(dS_empty(n), ds_parity(n) ^ 1u);
            // dSa[kk]'s register r is the 8 x 8 matrix of keys 16 warp + 8 (r % 2) .., queries 16 kk + 8 (r / 2) ..
            // (in the accumulators' layout); stored transposed, lane l gives the address of its row l % 8, query
            // 16 kk + 8 (l / 16) + l % 8, whose 16 bytes of keys are 16-byte chunk 2 warp + (l / 8) % 2 of the
            // row's 128 (its half's), swizzled by the query (query % 8 = l % 8).
            {
                const int mat = lane / 8, row_in = lane % 8;
                const unsigned half = dS_T + consumer * B_r * 128;
#pragma unroll
                for (int kk = 0; kk < Q_STEPS; ++kk) {
                    const int query = 16 * kk + 8 * (mat / 2) + row_in;
                    stmatrix_trans(half + query * 128 + 16 * ((2 * warp + mat % 2) ^ row_in), dSa[kk]);
                }
            }
            fence_async_shared();
            mbarrier_arrive(dS_full(n));  // this thread's part of dS^T(n), visible to the products
            trace_point(consumer, n, 3);

            // Second turn: dV_j += P^T dO_i and dK_j += dS^T Q_i, A from registers, B the rows of dO_i (Q_i)
            // k16 at a time, MN-major (the next 64-column half B_r * 128 bytes on); with them the dQ_i share
            // of step n - 1, whose dS^T both consumers wrote a turn ago.
            if constexpr (decltype(with_dQ)::value) {
                mbarrier_wait(dS_full(n - 1), ds_parity(n - 1));
                share_free();
            }
            float dQ[B_r / 2];
            constexpr bool dQ_first = DQ_FIRST && decltype(with_dQ)::value;
            take_turn();
            wgmma_fence();
            if constexpr (dQ_first) {
                issue_dQ(dQ, n - 1);
                wgmma_commit();
            }
            const unsigned long long dO_t = descriptor(dO_i, B_r * 128, 1024), Q_t = descriptor(Q_i, B_r * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; ++kk)
                wgmma_rs<d_head, dtype_id>(dV_acc, Pa[kk], descriptor_past<ADDS>(dO_t, dO_i, kk * 2048, B_r * 128, 1024));
#pragma unroll
            for (int kk = 0; kk < Q_STEPS; ++kk)
                wgmma_rs<d_head, dtype_id>(dK_acc, dSa[kk], descriptor_past<ADDS>(Q_t, Q_i, kk * 2048, B_r * 128, 1024));
            if constexpr (decltype(with_dQ)::value && !DQ_FIRST)
                issue_dQ(dQ, n - 1);
            wgmma_commit();
            give_turn();
            trace_point(consumer, n, 4);
            if constexpr (dQ_first) {
                wgmma_wait_one();  // the dQ_i share landed: out to dQ_accum while dV_j and dK_j run
                store_dQ(dQ, n - 1, it, step - 1);
            }
            wgmma_wait_all();
            settle(dV_acc);
            settle(dK_acc);
            trace_point(consumer, n, 5);
            mbarrier_arrive(QdO_empty(n));  // this thread's reads of Q_i, dO_i, lse_i and D_i done
            if constexpr (decltype(with_dQ)::value && !DQ_FIRST)
                store_dQ(dQ, n - 1, it, step - 1);
        };
        if (it.steps > 0) {
            one_step(0, Flag<false>{});
            ++n;
        }
#pragma unroll 1
        for (int step = 1; step < it.steps; ++step, ++n)
            one_step(step, Flag<true>{});
        if (it.steps > 0) {
            // The tile's last dQ_i share, in a turn of its own: it reads K_j, so before K_j's release.
            tile_point(consumer, u, 0);
            mbarrier_wait(dS_full(n - 1), ds_parity(n - 1));
            share_free();
            float dQ[B_r / 2];
            take_turn();
            tile_point(consumer, u, 1);
            wgmma_fence();
            issue_dQ(dQ, n - 1);
            wgmma_commit();
            give_turn();
            wgmma_wait_all();
            tile_point(consumer, u, 2);
            mbarrier_arrive(KV_empty);  // this thread's products that read K_j and V_j have landed
            store_dQ(dQ, n - 1, it, it.steps - 1);
            tile_point(consumer, u, 3);
            ++u;
        }

        // dK_j = scale sum dS^T Q and dV_j, rounded to the dtype: lane (g, t) holds columns 8 n + 2 t, + 1 of
        // keys warp_key + g and + 8, a quad 8 n .. 8 n + 7; after quad_transpose over blocks n = 4 q + j, lane t
        // holds columns 8 (4 q + t) .. + 7 of its row, 16 bytes. None past T_k (every lane shuffles first).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = warp_key + g + 8 * h;
            element* dK_row = dK + ((long long)it.kv_bh * T_k + key) * d_head;
            element* dV_row = dV + ((long long)it.kv_bh * T_k + key) * d_head;
#pragma unroll
            for (int q = 0; q < d_head / 32; ++q) {
                unsigned k[4], v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int e = 4 * (4 * q + j) + 2 * h;
                    k[j] = pack_rounded<dtype_id>(dK_acc[e] * scale, dK_acc[e + 1] * scale);
                    v[j] = pack_rounded<dtype_id>(dV_acc[e], dV_acc[e + 1]);
                }
                const uint4 k4 = quad_transpose(k[0], k[1], k[2], k[3], t);
                const uint4 v4 = quad_transpose(v[0], v[1], v[2], v[3], t);
                if (key < T_k) {
                    *(uint4*)&dK_row[8 * (4 * q + t)] = k4;
                    *(uint4*)&dV_row[8 * (4 * q + t)] = v4;
                }
            }
        }
        tile_point(consumer, u - 1, 4);
    }
    if (consumer == 0)
        take_turn();  // consumer 1's last pass
    if (thread == 0)
        bulk_wait_all();  // no reduction in flight from a block that is gone
}
