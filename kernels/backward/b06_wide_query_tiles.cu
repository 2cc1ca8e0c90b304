/*
 * b06 - b05 with query tiles of 128 at d = 64: half the steps, each twice as wide, and dQ_i split
 * between the two consumer warpgroups by its rows instead of its columns.
 *
 * The change: b05 walks a key tile's query tiles 64 rows at a time (B_r = 64: S^T and dP^T are m64n64,
 * a row of dS^T one 128-byte swizzle row). Here B_r = 128:
 *   - S^T = K_j Q_i^T and dP^T = V_j dO_i^T are m64n128 per consumer (its 64 keys by the tile's 128
 *     queries), 64 accumulators each; P^T and dS^T become 8 k16 A fragments of dV_j += P^T dO_i and
 *     dK_j += dS^T Q_i, as in b05 but twice as many;
 *   - dS^T's rows (keys) are 256 bytes of queries, stored as two swizzled halves of 64 queries, B_c x 128
 *     bytes each, as K_j's two column halves lie at d = 128;
 *   - dQ_i = dS K_j: consumer c takes queries 64 c .. 64 c + 63, all d columns, m64n64 over the tile's
 *     128 keys (8 k16 steps): A = dS^T's half c read transposed (its rows are the keys, k), B = K_j's
 *     rows, MN-major. b05's split by columns (m64n32 each at d = 64) would leave M = 128 queries for one
 *     m64 instruction; split by rows, each warpgroup's share is one m64n64 accumulator of 32 registers;
 *   - each warpgroup adds its 64 rows into dQ_accum through its own boxes of 64 rows x 32 floats
 *     (lab.tma's dQ_accum box), so the rows past T_q of either half are skipped by the copy engine.
 * Everything else is b05's: the producer warp and its ring of two stages, the named barrier of the two
 * consumers before dQ_i, the deterministic order of the reductions (the halves are disjoint rows, so
 * each warpgroup still counts one turn), the preprocessing and the conversion of dQ.
 *
 * Why it helps: a step of b05 pays fixed costs beside its products (the full-barrier wait, wgmma waits
 * between dependent products, the barrier of both consumers, dQ's store, fence, barrier and bulk
 * reduction, the empty-barrier arrival), and at d = 64 its products are small: under Nsight Compute
 * b05's dK/dV kernel at 16 x 12 x 2048 keeps the tensor pipe busy 30% of the time, its top stalls
 * long_scoreboard, wait and barrier (docs/backward.md's counters). With B_r = 128 the same work takes
 * half the steps, so half those costs, and each wgmma does twice the work. dQ's traffic into L2 is
 * unchanged (T_q x d floats per key tile either way); the Q_i and dO_i copies are fewer and larger.
 * Measured on an H200 (bench.py backward --dtype bfloat16, the newest run, docs/results.md#backward, both
 * rungs with dQ's conflict-free stores, b05 with its non-causal chunks of heads, b06 with its long causal
 * grid's chunks, below): 1.05x b05 at 8 x 12 x 1024, 1.13x at 16 x 12 x 2048, 1.15x at 6 x 12 x 4096,
 * 1.17x at 1 x 12 x 8192 (1.01x cuDNN there), 1.16x non-causal at 4 x 12 x 2048; deterministic
 * 1.16-1.25x. At 1 x 12 x 512, a pass of tens of microseconds whose spread is wide, 1.03x (0.96x, 1.04x,
 * 0.93x and level in earlier runs).
 *
 * The block order of a long causal grid (16 waves of blocks or more): heads in chunks whose Q, dO and
 * dQ_accum fit 16 MB of L2, two waves of blocks at least, heavy first within a chunk (the kernel's
 * comment). At 16 x 12 x 2048 b02's order, key tile first, has every one of the 192 heads' 1 MB in
 * flight at once. Measured as a variant file beside b06 on an H200, three `bench.py backward --cases
 * gpt2` runs with the order of the files rotated: 16 x 12 x 2048 0.916-0.920 ms against 0.969-0.970
 * (1.055x), 6 x 12 x 4096 1.125 against 1.131-1.138 (1.01x); the other GPT-2 shapes are shorter grids,
 * unchanged. Chunks of four waves at least: 1.085x at 2048 but 0.97x at 4096. Without the mask (b05's
 * chunks, docs/backward.md#l2-chunks) 0.99x at 4 x 12 x 2048: the non-causal grid keeps b02's order.
 *
 * Registers: a consumer holds dK_j and dV_j (32 each at d = 64), S^T and dP^T (64 each), then P^T and
 * dS^T rounded (32 each) and dQ's share (32): within the 240 setmaxnreg gives, no spills (ptxas).
 * At d = 128 S^T and dP^T at n128 beside dK_j and dV_j (64 each) would pass 240: b05 keeps d = 128.
 *
 * Geometry: backward_dk_dv on grid (T_c, NH_kv, B), heavy first, 384 threads (the producer warpgroup
 * and two consumers of 64 keys: B_c = 128); one block per SM. B_r = 128. Shared memory, 2-byte elements
 * unless said, plus 1 KB to align the atoms: K_j, V_j (B_c x d each) + 2 stages of Q_i, dO_i (B_r x d
 * each) + 2 buffers of dS^T (B_c x B_r) + dQ's tile (B_r x d float32) + 2 stages of lse_i and D_i
 * (float32, B_r each) + 1024:
 *   d = 64: 2 * (2 * 128 * 64 + 4 * 128 * 64 + 2 * 128 * 128) + 4 * 128 * 64 + 16 * 128 + 1024 = 199,680 bytes
 * backward_preprocess and backward_dq are b05's (b04's), on query tiles of 128 rows.
 *
 * Limits: sm_90a only; d 64; B_r 128, B_c 128; dtype_id 0 bfloat16, 1 float16. The launcher's arrays
 * are contiguous and 16-byte aligned, as a descriptor needs.
 *
 * lab.template    d_head, B_r, B_c, dtype_id, deterministic
 * lab.configs     (64, 128, 128, 0, 0), (64, 128, 128, 1, 0), (64, 128, 128, 0, 1), (64, 128, 128, 1, 1)
 * lab.threads     256
 * lab.smem        0
 * lab.phase       backward_preprocess: query tiles
 * lab.phase       backward_dk_dv: key tiles, threads 128 + 2 * B_c, smem 2 * (2 * B_c * d_head + 4 * B_r * d_head + 2 * B_c * B_r) + 4 * B_r * d_head + 16 * B_r + 1024
 * lab.phase       backward_dq: query tiles
 * lab.dq_accum    true
 * lab.deterministic deterministic
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a
 * lab.tma         Q: (B_r, 64), K: (B_c, 64), V: (B_c, 64), dO: (B_r, 64), dQ_accum: (64, 32)
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr long long L2_CHUNK = 16ll << 20;  // a long causal grid's chunk of heads (below)
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
#define REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
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
    static_assert(N == 32 || N == 64 || N == 128, "m64n32k16, m64n64k16 or m64n128k16");
    if constexpr (N == 32 && dtype_id == 0)
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

// Named barrier `id` (1 .. 15; 0 is __syncthreads') for `threads` threads, whole warps.
__device__ __forceinline__ void barrier_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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

// D_i = rowsum(dO_i o O_i) in float32 from the 16-bit values, one warp a row; dQ_accum's rows and the
// tile's count of dQ additions zeroed.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_preprocess(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
                    const element* __restrict__ O, const element* __restrict__ dO, const float* __restrict__ /* lse */,
                    element* __restrict__ /* dQ */, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
                    float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
                    int T_q, int T_k, int kv_group, int causal, float scale, TENSOR_MAPS)
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
        dQ_turns[bh * gridDim.x + blockIdx.x] = 0;
}

// dQ = scale dQ_accum, rounded to the dtype, 4 values at a time.
template <int d_head, int B_r, int B_c, int dtype_id, int deterministic>
__global__ void __launch_bounds__(AUX_THREADS)
backward_dq(const element* __restrict__ /* Q */, const element* __restrict__ /* K */, const element* __restrict__ /* V */,
            const element* __restrict__ /* O */, const element* __restrict__ /* dO */, const float* __restrict__ /* lse */,
            element* __restrict__ dQ, element* __restrict__ /* dK */, element* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ dQ_accum, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale, TENSOR_MAPS)
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
               int T_q, int T_k, int kv_group, int causal, float scale, TENSOR_MAPS)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    static_assert(d_head == 64, "dQ_i's 64 rows of a warpgroup over every column: m64n64");
    static_assert(B_r == 128, "a warpgroup's dQ_i rows: 64 of them");
    static_assert(B_c == 128, "two consumer warpgroups of 64 keys");
    constexpr int CONSUMERS = B_c / 64;      // consumer warpgroups, 64 keys each
    constexpr int STAGES = 2;                // of Q_i and dO_i
    constexpr int D_STEPS = d_head / 16;     // k16 steps of S^T and dP^T (over d)
    constexpr int Q_STEPS = B_r / 16;        // k16 steps of dV_j and dK_j (over queries)
    constexpr int KEY_STEPS = B_c / 16;      // k16 steps of dQ_i (over keys)
    constexpr int DQ_BOXES = d_head / 32;    // dQ_accum's boxes of 64 rows x 32 float32 columns per warpgroup
    constexpr unsigned KV_BYTES = B_c * d_head * 2, QO_BYTES = B_r * d_head * 2;
    constexpr unsigned DS_BYTES = B_c * B_r * 2, DQ_BYTES = B_r * d_head * 4;
    constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
    static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * 128 * CONSUMERS <= 65536 / (128 * (1 + CONSUMERS)) / 8 * 8 * (128 * (1 + CONSUMERS)),
                  "the block's pool: 65536 / threads registers a thread, in 8s, as it launched (setmaxnreg.inc waits for more: a hang)");

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned smem_start = (unsigned)__cvta_generic_to_shared(smem);
    const unsigned K_smem = (smem_start + 1023) & ~1023u;   // K_j, B_c x d
    const unsigned V_smem = K_smem + KV_BYTES;              // V_j
    const unsigned Q_smem = V_smem + KV_BYTES;              // STAGES stages of Q_i, B_r x d
    const unsigned dO_smem = Q_smem + STAGES * QO_BYTES;    // STAGES stages of dO_i
    const unsigned dS_smem = dO_smem + STAGES * QO_BYTES;   // 2 buffers of dS^T, B_c x B_r
    const unsigned dQ_smem = dS_smem + 2 * DS_BYTES;        // dQ_i's share, float32, B_r x d
    float* lse_smem = (float*)(smem + (dQ_smem + DQ_BYTES - smem_start));  // STAGES x B_r, log2 units
    float* D_smem = lse_smem + STAGES * B_r;                                 // STAGES x B_r
    // K_j and V_j's full barrier, then per stage of Q_i and dO_i a full and an empty barrier.
    __shared__ __align__(8) unsigned long long barriers[1 + 2 * STAGES];
    const unsigned KV_full = (unsigned)__cvta_generic_to_shared(barriers);
    auto QdO_full = [&](int n) { return KV_full + 8 * (1 + n % STAGES); };
    auto QdO_empty = [&](int n) { return KV_full + 8 * (1 + STAGES + n % STAGES); };
    auto parity = [](int n) { return (unsigned)(n / STAGES) & 1u; };  // step n: use n / STAGES of its stage

    // The block order. The flat block index reads as (chunk of K/V heads, key tile, head in the chunk): key
    // tiles count up within a chunk, heavy first where causal (b02's order). One chunk holds every head
    // (b02's order exactly) unless the grid is causal, not deterministic and at least 16 waves of blocks
    // long: then a chunk is as many heads as fit their query-side tensors (Q_i, dO_i: 2 bytes an element;
    // dQ_accum: 4) in L2_CHUNK, and two waves of blocks at least, so that the blocks in flight share
    // those tensors in L2 while the heavy tiles of a chunk still go first (the header has the
    // measurements).
    const long long n_heads = (long long)gridDim.y * gridDim.z;  // = B * NH_kv
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    long long chunk = n_heads;
    if (causal && !deterministic) {
        unsigned sms;
        asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
        if ((long long)gridDim.x * n_heads >= 16LL * sms) {  // sms: the SM identifiers, at least the SMs
            const long long head_bytes = 8LL * kv_group * T_q * d_head;
            chunk = min(n_heads, max(L2_CHUNK / head_bytes, (2LL * sms + gridDim.x - 1) / gridDim.x));
        }
    }
    const long long first_head = flat / (chunk * gridDim.x) * chunk;
    const long long heads_here = min(chunk, n_heads - first_head);  // the last chunk may be short
    const long long within = flat % (chunk * gridDim.x);
    const int j = (int)(within / heads_here);
    const long long kv_bh = first_head + within % heads_here;  // = batch * NH_kv + K/V head
    const int batch = (int)(kv_bh / gridDim.y), kv_head = (int)(kv_bh % gridDim.y);
    const int col_start = j * B_c;
    const int offset = T_k - T_q;            // query row i sees keys <= i + offset (causal, bottom-right)
    const int T_r = (T_q + B_r - 1) / B_r;
    const int first_tile = (causal ? max(0, col_start - offset) : 0) / B_r;  // the first query tile that sees key col_start
    const int tiles_per_head = max(0, T_r - first_tile);
    const int steps = kv_group * tiles_per_head;  // (query head, query tile) pairs, head-major
    auto head_of = [&](int n) { return kv_head * kv_group + n / tiles_per_head; };
    auto row_start_of = [&](int n) { return (first_tile + n % tiles_per_head) * B_r; };

    // Thread 0 makes the barriers; every thread waits for them to exist (the last block-wide barrier).
    if (threadIdx.x == 0) {
        mbarrier_init(KV_full, 1);  // the producer's arrival, and the bytes
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(QdO_full(s), 32);              // every producer lane, one with the bytes
            mbarrier_init(QdO_empty(s), 128 * CONSUMERS);  // every consumer thread
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
            if (lane == 0 && steps > 0) {
                mbarrier_arrive_expect(KV_full, 2 * KV_BYTES);
                load_tile<d_head, B_c>(K_smem, &K_map, col_start, kv_head, batch, KV_full);
                load_tile<d_head, B_c>(V_smem, &V_map, col_start, kv_head, batch, KV_full);
            }
            // lse_i and D_i of step n are loaded into registers before the wait for step n's stage, so
            // that their latency passes while the consumers still work; the tiles' copies go out first
            // (the header has what that gained).
            float lse_r[B_r / 32], D_r[B_r / 32];
            auto fetch = [&](int n) {
                const long long bh = (long long)batch * gridDim.y * kv_group + head_of(n);
                const int row_start = row_start_of(n);
#pragma unroll
                for (int k = 0; k < B_r / 32; ++k) {
                    const int r = lane + 32 * k;
                    const bool valid = row_start + r < T_q;
                    lse_r[k] = valid ? lse[bh * T_q + row_start + r] * LOG2_E : INFINITY;
                    D_r[k] = valid ? D[bh * T_q + row_start + r] : 0.0f;
                }
            };
            if (steps > 0)
                fetch(0);
            for (int n = 0; n < steps; ++n) {
                if (n >= STAGES)
                    mbarrier_wait(QdO_empty(n), parity(n) ^ 1u);
                const int head = head_of(n), row_start = row_start_of(n);
                if (lane == 0) {
                    mbarrier_expect(QdO_full(n), 2 * QO_BYTES);
                    load_tile<d_head, B_r>(Q_smem + (n % STAGES) * QO_BYTES, &Q_map, row_start, head, batch, QdO_full(n));
                    load_tile<d_head, B_r>(dO_smem + (n % STAGES) * QO_BYTES, &dO_map, row_start, head, batch, QdO_full(n));
                }
                float* lse_s = lse_smem + (n % STAGES) * B_r;
                float* D_s = D_smem + (n % STAGES) * B_r;
#pragma unroll
                for (int k = 0; k < B_r / 32; ++k) {
                    lse_s[lane + 32 * k] = lse_r[k];
                    D_s[lane + 32 * k] = D_r[k];
                }
                mbarrier_arrive(QdO_full(n));
                if (n + 1 < steps)
                    fetch(n + 1);
            }
            // Leave with no copy in flight: K_j, V_j and the last stages have landed (the earlier
            // stages were released, so theirs had).
            if (lane == 0 && steps > 0) {
                mbarrier_wait(KV_full, 0);
                for (int n = max(0, steps - STAGES); n < steps; ++n)
                    mbarrier_wait(QdO_full(n), parity(n));
            }
        }
        return;
    }

    // A consumer: warpgroup c + 1 owns keys 64 c .. 64 c + 63 of the tile, dK_j and dV_j's rows for
    // them in registers, and queries 64 c .. 64 c + 63 of dQ_i.
    registers_up<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1;
    const int thread = threadIdx.x % 128;
    const int warp = thread / 32, g = lane / 4, t = lane % 4;
    const int wg_key = 64 * consumer;                  // first key of this warpgroup in the tile
    const int warp_key = col_start + wg_key + 16 * warp;  // this warp's first key; a thread's: + g, + g + 8
    const float scale_log2 = scale * LOG2_E;
    const unsigned dQ_share = dQ_smem + consumer * DQ_BOXES * 64 * 128;  // DQ_BOXES boxes of 64 x 32 floats

    float dK_acc[d_head / 2], dV_acc[d_head / 2];  // 4 n + e: key warp_key + g + 8 (e / 2), column 8 n + 2 t + e % 2
#pragma unroll
    for (int i = 0; i < d_head / 2; ++i)
        dK_acc[i] = 0.0f, dV_acc[i] = 0.0f;

    if (steps > 0)
        mbarrier_wait(KV_full, 0);
#pragma unroll 1
    for (int n = 0; n < steps; ++n) {
        const int head = head_of(n), row_start = row_start_of(n);
        const long long bh = (long long)batch * gridDim.y * kv_group + head;
        const unsigned Q_i = Q_smem + (n % STAGES) * QO_BYTES, dO_i = dO_smem + (n % STAGES) * QO_BYTES;
        const float* lse_i = lse_smem + (n % STAGES) * B_r;
        const float* D_i = D_smem + (n % STAGES) * B_r;
        const unsigned dS_T = dS_smem + (n % 2) * DS_BYTES;

        // S^T = K_j Q_i^T and dP^T = V_j dO_i^T: this warpgroup's 64 rows of K_j (V_j) by the rows of
        // Q_i (dO_i), both K-major, d / 16 k16 steps 32 bytes apart (the next 64-column half at 4).
        float S[B_r / 2], dP[B_r / 2];  // 4 p + e: key warp_key + g + 8 (e / 2), query 8 p + 2 t + e % 2
        mbarrier_wait(QdO_full(n), parity(n));
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < D_STEPS; ++s) {
            const unsigned a = K_smem + (s / 4) * B_c * 128 + wg_key * 128 + (s % 4) * 32;
            const unsigned b = Q_i + (s / 4) * B_r * 128 + (s % 4) * 32;
            wgmma_ss<B_r, dtype_id, 0, 0>(S, descriptor(a, 16, 1024), descriptor(b, 16, 1024), s > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int s = 0; s < D_STEPS; ++s) {
            const unsigned a = V_smem + (s / 4) * B_c * 128 + wg_key * 128 + (s % 4) * 32;
            const unsigned b = dO_i + (s / 4) * B_r * 128 + (s % 4) * 32;
            wgmma_ss<B_r, dtype_id, 0, 0>(dP, descriptor(a, 16, 1024), descriptor(b, 16, 1024), s > 0);
        }
        wgmma_commit();

        // P^T = exp(scale S^T - lse_i), 0 where masked; dS^T = P^T o (dP^T - D_i); both rounded to 16
        // bits as they are made: the accumulators of n8 tiles 2 kk and 2 kk + 1 are the A fragment of
        // k16 step kk (queries 16 kk ..), pair h of tile p its register 2 (p % 2) + h. dS^T also goes to
        // shared memory as it lies, rows of keys in two halves of 64 queries (128 bytes each, B_c * 128
        // bytes apart), swizzled: a 32-bit pair per store (8 rows x 4 lanes: 32 banks). Both products
        // have landed first, as in b05.
        wgmma_wait_all();
        settle(S);
        settle(dP);
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
                const int row = wg_key + 16 * warp + g + 8 * h;  // row % 8 = g
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(dS_T + (p / 8) * B_c * 128 + row * 128 + 16 * ((p % 8) ^ g) + 4 * t),
                             "r"(dSa[p / 2][r]));
            }
        }

        // dV_j += P^T dO_i: A from registers, B the rows of dO_i k16 at a time, MN-major (the next
        // 64-column half B_r * 128 bytes on).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Q_STEPS; ++kk)
            wgmma_rs<d_head, dtype_id>(dV_acc, Pa[kk], descriptor(dO_i + kk * 2048, B_r * 128, 1024));
        wgmma_commit();

        // dQ_i's queries 64 c .. = dS K_j: A = dS^T's half c, every key of both warpgroups, read
        // transposed (MN-major: its rows are the keys, k); B = K_j's rows, MN-major. Both warpgroups'
        // dS^T must be written (fenced for the async proxy), and this warpgroup's last reduction must
        // have read dQ's shared memory, before anyone goes on. Then dK_j += dS^T Q_i (as dV_j), which
        // runs while dQ_i's share goes out.
        fence_async_shared();
        if (!deterministic && thread == 0)
            bulk_wait_read();
        __syncwarp();
        barrier_sync(1, 128 * CONSUMERS);
        float dQ[d_head / 2];  // 4 m + e: query 64 c + 16 warp + g + 8 (e / 2), column 8 m + 2 t + e % 2
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
            wgmma_ss<d_head, dtype_id, 1, 1>(dQ, descriptor(dS_T + consumer * B_c * 128 + kk * 2048, B_c * 128, 1024),
                                             descriptor(K_smem + kk * 2048, B_c * 128, 1024), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < Q_STEPS; ++kk)
            wgmma_rs<d_head, dtype_id>(dK_acc, dSa[kk], descriptor(Q_i + kk * 2048, B_r * 128, 1024));
        wgmma_commit();
        wgmma_wait_one();  // dV_j's and dQ_i's products done, dK_j's may run on
        settle(dQ);

        // dQ_i's share into shared memory as dQ_accum's boxes lie (B_r rows of 32 floats, 128-byte
        // swizzle), then one thread adds the boxes into dQ_accum through the copy engine.
#pragma unroll
        for (int m = 0; m < d_head / 8; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // A 64-bit store is issued a half warp (rows g = 0-3 or 4-7) at a time. Stored in
                // order of m, a half warp's chunk pairs (m ^ g / 2) are two, each written twice: a 2-way
                // bank conflict on every store (ncu's source view: all of the kernel's excessive shared
                // wavefronts). Odd rows store columns m ^ 3 (the same group of four): pairs m, m ^ 3,
                // m ^ 1, m ^ 2, every bank once.
                const bool odd = g & 1;
                const int mm = odd ? m ^ 3 : m;
                const int row = 16 * warp + g + 8 * h, chunk = 2 * (mm % 4) + t / 2;
                const unsigned at = dQ_share + (mm / 4) * 64 * 128 + row * 128 + 16 * (chunk ^ (row % 8)) + 8 * (t % 2);
                const float v0 = odd ? dQ[4 * (m ^ 3) + 2 * h] : dQ[4 * m + 2 * h];
                const float v1 = odd ? dQ[4 * (m ^ 3) + 2 * h + 1] : dQ[4 * m + 2 * h + 1];
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(v0), "f"(v1));
            }
        fence_async_shared();
        barrier_sync(2 + consumer, 128);
        if (thread == 0) {
            int* count = dQ_turns + bh * T_r + row_start / B_r;
            if (deterministic)
                wait_turn(count, CONSUMERS * j);  // every addition of key tiles 0 .. j - 1 done
#pragma unroll
            for (int b = 0; b < DQ_BOXES; ++b)
                tma_reduce_add(dQ_share + b * 64 * 128, &dQ_map, 32 * b, row_start + 64 * consumer, head, batch);
            bulk_commit();
            if (deterministic)
                pass_turn(count);
        }
        __syncwarp();
        wgmma_wait_all();
        settle(dV_acc);
        settle(dK_acc);
        mbarrier_arrive(QdO_empty(n));  // this thread's reads of Q_i, dO_i, lse_i and D_i done
    }
    if (thread == 0)
        bulk_wait_all();  // no reduction in flight from a block that is gone

    // dK_j = scale sum dS^T Q and dV_j, rounded to the dtype: lane (g, t) holds columns 8 n + 2 t, + 1 of
    // keys warp_key + g and + 8; none past T_k.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = warp_key + g + 8 * h;
        if (key < T_k) {
            element* dK_row = dK + (kv_bh * T_k + key) * d_head;
            element* dV_row = dV + (kv_bh * T_k + key) * d_head;
#pragma unroll
            for (int n = 0; n < d_head / 8; ++n) {
                *(unsigned*)&dK_row[8 * n + 2 * t] = pack_rounded<dtype_id>(dK_acc[4 * n + 2 * h] * scale, dK_acc[4 * n + 2 * h + 1] * scale);
                *(unsigned*)&dV_row[8 * n + 2 * t] = pack_rounded<dtype_id>(dV_acc[4 * n + 2 * h], dV_acc[4 * n + 2 * h + 1]);
            }
        }
    }
}
