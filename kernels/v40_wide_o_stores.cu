/*
 * v40 - O_i out 16 bytes a lane at d = 128: v39 with the tile's end, where O_i goes from registers to
 * memory (d = 128, B_c = 128: no shared memory to stage it), gathering each row's 8 columns within the quad
 * (quad_transpose, two shuffle rounds) and storing 16 bytes a lane, where v39 stores 4.
 *
 * Why: the backward ladder's cycle traces found the step at every key tile's start taking about three, most
 * of it in dK_j's and dV_j's 4-byte stores, 8 rows and half a sector each an instruction, the two consumers'
 * one after the other; 16 bytes a lane made its rungs 1.02-1.10x faster, the more the shorter the tiles
 * (docs/backward.md#b13). v39's consumers at d = 128 share a tile (64 rows each, no turns), so both reach
 * its end together and write O_i together, 32 stores a thread, while the tensor core waits for the next
 * tile's first products; here 8 a thread, each instruction 64 contiguous bytes in each of 8 rows. So it
 * takes only that configuration: d = 64, and d = 128 at B_c = 64, stage O_i through shared memory and
 * already store 16 bytes a lane (v39's code, unchanged here, compiled only where O_STAGED).
 *
 * Measured (H200, two bench.py frontier --interleave runs against v39, docs/ladder.md#v40): 1.02x at
 * 2 x 32 x 4096 causal, with and without grouped heads; 1.00-1.02x, within resolution, at 1 x 16 x 16384
 * and 4 x 16 x 4096 non-causal; under ncu the tensor pipe 0.4-1.4 points busier.
 *
 * Geometry: grid (min(tiles, SMs x blocks per SM), 1, 1), tiles = T_r x n_heads x batch, with
 * T_r = ceil(T_q / B_r); the kernel takes n_heads and batch as two more int parameters (before the
 * descriptors) and its workspace's first word is the tile counter. Block B_r * 2 + 128 threads, one
 * block per SM. Shared memory, 2-byte elements: Q_i, 3 stages of K_j and 2 of V_j + 1024 to align the
 * atoms, 2 * (128 * 128 + 5 * 128 * 128) + 1024 = 197,632 bytes, and 2 + 2 (3 + 2) mbarriers and the two
 * tile slots (static), as v39's. Named barriers: 0 (__syncthreads, before the role split), 1 + c (consumer
 * c alone, for a scale below zero). Static shared memory also holds a slot of 8 bytes per consumer thread
 * for the pinning store (2 KB).
 *
 * Everything else - the persistent schedule, the roles, K_j's third stage, the pinned softmax, the lazy
 * rescale, the exponentials first, S_ij again by the warp alone - is v39's at d = 128.
 *
 * Limits: as v24 and v23: sm_90a only; d 128, B_r 128, B_c 128; dtype_id 0 bfloat16, 1 float16; inputs as
 * v21.
 *
 * lab.template    d_head, B_r, B_c, dtype_id
 * lab.configs     (128, 128, 128, 0), (128, 128, 128, 1)
 * lab.threads     B_r * 2 + 128
 * lab.smem        2 * (2 * B_r * d_head + 2 * (3 - B_c * d_head // 16384) * B_c * d_head) + 1024
 * lab.strided     true
 * lab.tolerance   2
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a
 * lab.tma         Q: (B_r, 64), K: (B_c, 64), V: (B_c, 64)
 * lab.persistent  true
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr long long L2_ALL = 32ll << 20, L2_CHUNK = 16ll << 20;  // block order (measured on an H200's 60 MB L2)
constexpr float FLT_MIN_NORMAL = 1.17549435e-38f;
constexpr unsigned FULL_WARP = 0xffffffffu;
constexpr float RESCALE_LOG2 = 8.0f;  // m_i moves when a row's maximum passes it by more (scaled, base 2)
constexpr float SUM_BOUND = 256.0f;   // 2^RESCALE_LOG2: a partial row sum at most this, no exponential passed it

// A diagnostic build (tools/rung_trace.py compiles a copy with -DSTEP_TRACE=1; off, nothing is compiled
// in): block 0's consumers read the SM clock at five points of each step of the loop (its top, the
// products issued, S_ij landed, the softmax done, P V landed), thread 0 of each warpgroup, ring uses
// below TRACE_STEPS, into step_trace[consumer][use][point].
#ifndef STEP_TRACE
#define STEP_TRACE 0
#endif
#if STEP_TRACE
constexpr int TRACE_STEPS = 512, TRACE_POINTS = 5;
__device__ long long step_trace[3][TRACE_STEPS][TRACE_POINTS];
#endif

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
// The row sums stored before the wait for P V, each thread's into a slot of its own that nothing reads:
// ptxas moves wgmma.wait_group up past all arithmetic but keeps a shared-memory store ahead of it, and
// with the store every exponential the sums add (docs/ladder.md#pinned-softmax). A slot per thread: lanes
// sharing one word race (compute-sanitizer's racecheck), and lane 0 storing for its warp (a predicated
// store) kept the same exponentials ahead in SASS but measured 1-6% slower at d = 64 in v22.
__device__ __forceinline__ void pin_row_sums(float2* slot, const float (&l)[2]) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"((unsigned)__cvta_generic_to_shared(slot)), "f"(l[0]), "f"(l[1]) : "memory");
}

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

// D += A B on one warp: m16n8k16, A 16 x 16 (row-major fragments), B 16 x 8 (column-major), float32 D.
template <int dtype_id>
__device__ __forceinline__ void mma_16816(float* d, const unsigned (&a)[4], unsigned b0, unsigned b1)
{
    if constexpr (dtype_id == 0)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 matrices of 16-bit elements from shared memory, lane l's row address for matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
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

// The thread's index, read afresh where it is used. Shared-memory addresses computed from it are the
// same for every tile; the compiler would hoist them out of the tile loop and hold them in registers
// through every step (with three consumers, in local memory), so the per-tile code reads it here.
__device__ __forceinline__ int thread_index()
{
    int i;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(i));
    return i;
}

// STEP_TRACE's clock read at `point` of ring use u, by thread 0 of consumer c's warpgroup in block 0.
__device__ __forceinline__ void trace_point(int c, int u, int point)
{
#if STEP_TRACE
    if (blockIdx.x == 0 && thread_index() % 128 == 0 && u < TRACE_STEPS) {
        long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
        step_trace[c][u][point] = t;
    }
#endif
}

// True on every thread of the `threads` at named barrier `id` if `p` holds on any of them (and a barrier).
template <int threads>
__device__ __forceinline__ bool barrier_any(int id, bool p)
{
    unsigned r;
    asm volatile("{\n.reg .pred a, b;\nsetp.ne.u32 a, %1, 0;\nbar.red.or.pred b, %2, %3, a;\nselp.u32 %0, 1, 0, b;\n}"
                 : "=r"(r) : "r"((unsigned)p), "r"(id), "n"(threads) : "memory");
    return r != 0;
}
// Named barrier `id` of `threads` threads: wait there (bar.sync), or count in and go on (bar.arrive).
template <int threads>
__device__ __forceinline__ void barrier_wait(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(threads) : "memory"); }
template <int threads>
__device__ __forceinline__ void barrier_pass(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(threads) : "memory"); }

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
// half, announced on `barrier` as one use: rows * d_head * 2 bytes, whether or not they lie past T.
template <int d_head, int rows>
__device__ __forceinline__ void load_tile(unsigned tile, const TensorMap* map, int row_start, int head, int batch,
                                          unsigned barrier)
{
    mbarrier_arrive_expect(barrier, rows * d_head * 2);
#pragma unroll
    for (int half = 0; half < d_head / 64; ++half)
        tma_load(tile + half * rows * 128, map, 64 * half, row_start, head, batch, barrier);
}

// Byte offset of 16-byte chunk c (of d_head / 8) of row r in a tile of `rows` rows: 64-column
// halves one after the other, chunk c % 8 of a half's row r at chunk (c % 8) ^ (r % 8), as the
// TMA's 128-byte swizzle writes it.
template <int rows>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    return (c / 8) * rows * 128 + r * 128 + 16 * ((c % 8) ^ (r % 8));
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
        const long long kv_bytes = 4LL * T_k * d_head;  // K and V of one head, 2 bytes an element
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

template <int d_head, int B_r, int B_c, int dtype_id>
__global__ void __launch_bounds__(B_r * 2 + 128, 1)
attention_forward(const element* __restrict__ /* Q */, const element* __restrict__ /* K */,
                  const element* __restrict__ /* V */, element* __restrict__ O, float* __restrict__ workspace,
                  int T_q, int T_k, int kv_group, int causal, float scale,
                  long long /* q_batch_stride */, long long /* q_head_stride */, long long /* q_row_stride */,
                  long long /* kv_batch_stride */, long long /* kv_head_stride */, long long /* kv_row_stride */,
                  int n_heads, int batches,
                  const __grid_constant__ TensorMap Q_map, const __grid_constant__ TensorMap K_map,
                  const __grid_constant__ TensorMap V_map)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    static_assert(d_head == 64 || d_head == 128, "whole 64-column halves of 128 bytes");
    static_assert(B_r == 128 || B_r == 192, "two or three consumer warpgroups of 64 rows");
    static_assert(B_c == 64 || B_c == 128, "S_ij is m64n64 or m64n128");
    constexpr int CONSUMERS = B_r / 64;     // consumer warpgroups
    constexpr int D_STEPS = d_head / 16;    // k16 steps of Q_i K_j^T
    constexpr int D_TILES = d_head / 8;     // n8 tiles of O_i
    constexpr int N_TILES = B_c / 8;        // n8 tiles of S_ij
    constexpr int KEY_STEPS = B_c / 16;     // k16 steps of P_ij V_j
    constexpr int chunks = d_head / 8;
    constexpr unsigned TILE_BYTES = B_c * d_head * 2;
    // Stages of K_j: 3, so that holding K_j through the softmax delays no load. Of V_j: 3, or 2 where two
    // 32 KB tiles would not fit beside them (d = 128, B_c = 128), and there O_i goes out from registers.
    constexpr int K_STAGES = 3;
    constexpr int V_STAGES = 3 - B_c * d_head / (128 * 128);
    constexpr bool O_STAGED = V_STAGES == 3;
    // S_ij again per warp on mma.sync where the consumers have the registers for its fragments (two
    // consumers, 240 registers each); three consumers of 160 spilled in the steady loop, and take it
    // again with the warpgroup's wgmma, as v38.
    constexpr bool WARP_REDO = CONSUMERS == 2;
    // Registers per thread after the split: the producer's few, the consumers' share of the rest.
    constexpr int PRODUCER_REGISTERS = 24;
    constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 240 : 160;
    static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * 128 * CONSUMERS <= 65536 / (128 * (1 + CONSUMERS)) / 8 * 8 * (128 * (1 + CONSUMERS)),
                  "the block's pool: 65536 / threads registers a thread, in 8s, as it launched (setmaxnreg.inc waits for more: a hang)");

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned Q_smem = ((unsigned)__cvta_generic_to_shared(smem) + 1023) & ~1023u;
    const unsigned O_smem = Q_smem + B_r * d_head * 2;    // O_i on its way out, while Q_i+1 comes in (O_STAGED)
    const unsigned K_smem = O_smem + (O_STAGED ? B_r * d_head * 2 : 0);  // K_STAGES stages of K_j
    const unsigned V_smem = K_smem + K_STAGES * TILE_BYTES;  // V_STAGES stages of V_j
    // Q_i's full and empty barriers, then per stage the full barriers of K_j and V_j and their empty
    // barriers. Ring use u (the u-th K/V tile of the block, counted over all its tiles of work) goes
    // to K's stage u % K_STAGES and V's stage u % V_STAGES (each that stage's use u / its count); the
    // block's n-th tile of work is Q's use n.
    __shared__ __align__(8) unsigned long long barriers[2 + 2 * (K_STAGES + V_STAGES)];
    __shared__ float2 pin[d_head == 64 ? 1 : B_r * 2];  // at d = 128 a consumer thread's slot for the pinning store
    __shared__ Tile tile_slot[2];  // the block's n-th tile, in slot n % 2, handed over with Q's use n
    const unsigned Q_full = (unsigned)__cvta_generic_to_shared(barriers);
    const unsigned Q_empty = Q_full + 8;
    constexpr int FULL = 2, EMPTY = 2 + K_STAGES + V_STAGES;  // the full barriers of K then V, then the empty ones
    auto K_full = [&](int u) { return Q_full + 8 * (FULL + u % K_STAGES); };
    auto V_full = [&](int u) { return Q_full + 8 * (FULL + K_STAGES + u % V_STAGES); };
    auto K_empty = [&](int u) { return Q_full + 8 * (EMPTY + u % K_STAGES); };
    auto V_empty = [&](int u) { return Q_full + 8 * (EMPTY + K_STAGES + u % V_STAGES); };
    auto K_parity = [](int u) { return (unsigned)(u / K_STAGES) & 1u; };  // ring use u: use u / K_STAGES of its stage
    auto V_parity = [](int u) { return (unsigned)(u / V_STAGES) & 1u; };

    // Thread 0 makes the barriers; every thread waits for them to exist (the last block-wide barrier).
    if (threadIdx.x == 0) {
        mbarrier_init(Q_full, 1);  // the producer's arrival, and the bytes
        mbarrier_init(Q_empty, 128 * CONSUMERS);  // every consumer thread (the tile slots)
        for (int b = FULL; b < EMPTY; ++b)
            mbarrier_init(Q_full + 8 * b, 1);  // full: the producer's arrival, and the bytes
        for (int b = EMPTY; b < EMPTY + K_STAGES + V_STAGES; ++b)
            mbarrier_init(Q_full + 8 * b, 4 * CONSUMERS);  // empty: every consumer warp
        mbarrier_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // The producer. Its warpgroup gives its registers back; one thread draws the block's tiles
        // and issues every load, in the order the consumers read them: Q_i, then K_j and V_j (which
        // step j + 1 reads), each as soon as the consumers have released the stage's previous use.
        registers_down<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            unsigned* tile_counter = reinterpret_cast<unsigned*>(workspace);  // zero at launch
            const Schedule schedule(T_q, T_k, n_heads, batches, B_r, d_head);
            int u = 0;  // ring uses so far
            for (int n = 0, k = blockIdx.x;; ++n) {
                // Q's use n - 1 released: its bytes landed, and the consumers are done with slot n % 2
                // (tile n - 2's: they read it before they released Q's use n - 1).
                if (n > 0)
                    mbarrier_wait(Q_empty, (n - 1) & 1);
                const Tile tile = k < schedule.tiles ? schedule.at<B_r, B_c>(k, T_q, T_k, causal) : Tile{0, 0, 0, -1};
                tile_slot[n % 2] = tile;  // published by the arrival below (release), read after the wait (acquire)
                if (tile.T_c < 0) {
                    mbarrier_arrive(Q_full);  // no bytes: the consumers read T_c = -1 and leave
                    break;
                }
                const int kv_head = tile.head / kv_group;
                load_tile<d_head, B_r>(Q_smem, &Q_map, tile.row_start, tile.head, tile.batch, Q_full);
                for (int j = 0; j < tile.T_c; ++j, ++u) {
                    if (u >= K_STAGES)
                        mbarrier_wait(K_empty(u), K_parity(u) ^ 1u);
                    load_tile<d_head, B_c>(K_smem + (u % K_STAGES) * TILE_BYTES, &K_map, j * B_c, kv_head, tile.batch, K_full(u));
                    if (u >= V_STAGES)
                        mbarrier_wait(V_empty(u), V_parity(u) ^ 1u);
                    load_tile<d_head, B_c>(V_smem + (u % V_STAGES) * TILE_BYTES, &V_map, j * B_c, kv_head, tile.batch, V_full(u));
                }
                // The next tile: the first gridDim.x tiles go one to a block, the rest to whichever
                // block asks first. Every block draws until it draws past the end, so the draws
                // number the tiles past the first gridDim.x and then gridDim.x more: the last one
                // drawn, tiles - 1, puts the counter back to zero for the next launch.
                const unsigned ticket = atomicAdd(tile_counter, 1u);
                if (ticket == (unsigned)schedule.tiles - 1u)
                    atomicExch(tile_counter, 0u);
                k = gridDim.x + ticket;
            }
            // Leave with no copy in flight: Q's last bytes landed before its release; the last uses
            // of the ring are waited for here (their stages have no later phase to confuse the parity).
            for (int v = max(0, u - K_STAGES); v < u; ++v)
                mbarrier_wait(K_full(v), K_parity(v));
            for (int v = max(0, u - V_STAGES); v < u; ++v)
                mbarrier_wait(V_full(v), V_parity(v));
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
    const float scale_log2 = fmaxf(fabsf(scale) * LOG2_E, FLT_MIN_NORMAL);  // as in v15
    // The warp's arrival on an empty barrier, once its products have read the stage.
    auto release = [&](unsigned barrier) {
        if (lane == 0)
            mbarrier_arrive(barrier);
    };
    // Turns (d = 64): consumer c issues its products between its own turn barrier and the next
    // consumer's. At d = 128 none: each consumer pins its softmax under its own P V instead.
    constexpr bool TURNS = d_head == 64;
    constexpr int TURN = 4;  // named barriers 4 .. 4 + CONSUMERS - 1 (0 is __syncthreads', 1 + c the scale flip's)
    auto wait_turn = [&]() {
        if constexpr (TURNS)
            barrier_wait<256>(TURN + consumer);
    };
    auto pass_turn = [&]() {
        if constexpr (TURNS)
            barrier_pass<256>(TURN + (consumer + 1) % CONSUMERS);
    };

    // S = Q_i K_j^T: d / 16 k16 steps, each 32 bytes further along a row (next half at 4).
    auto issue_S = [&](float (&S)[B_c / 2], int u) {
        const unsigned K_j = K_smem + (u % K_STAGES) * TILE_BYTES;
#pragma unroll
        for (int s = 0; s < D_STEPS; ++s) {
            const unsigned a = Q_smem + (s / 4) * B_r * 128 + wg_row * 128 + (s % 4) * 32;
            const unsigned b = K_j + (s / 4) * B_c * 128 + (s % 4) * 32;
            wgmma_ss<B_c, dtype_id>(S, descriptor(a, 16, 1024), descriptor(b, 16, 1024), s > 0);
        }
        wgmma_commit();
    };
    float O_acc[d_head / 2];  // n8 tile n, entry e: row my_row + 8 (e / 2), column 8 n + 2 t + e % 2
    // O_i += P V_j, P the rounded probabilities of ring use u: key step kk is rows 16 kk .. of V_j.
    auto issue_PV = [&](const unsigned (&P)[KEY_STEPS][4], int u) {
        const unsigned V_j = V_smem + (u % V_STAGES) * TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
            wgmma_rs<d_head, dtype_id>(O_acc, P[kk], descriptor(V_j + kk * 2048, B_c * 128, 1024));
        wgmma_commit();
    };
    auto round_P = [&](unsigned (&P)[KEY_STEPS][4], const float (&S)[B_c / 2]) {
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk) {
            P[kk][0] = pack_rounded<dtype_id>(S[8 * kk + 0], S[8 * kk + 1]);
            P[kk][1] = pack_rounded<dtype_id>(S[8 * kk + 2], S[8 * kk + 3]);
            P[kk][2] = pack_rounded<dtype_id>(S[8 * kk + 4], S[8 * kk + 5]);
            P[kk][3] = pack_rounded<dtype_id>(S[8 * kk + 6], S[8 * kk + 7]);
        }
    };

    // The turns run on from tile to tile: every consumer passes after each of its turns, consumer 0
    // takes the first (the last consumer's pass here) and one more after the block's last tile (to
    // take the last consumer's last pass), so every barrier ends with as many passes as waits.
    if (consumer == CONSUMERS - 1)
        pass_turn();
    int u0 = 0;  // ring uses of the block's earlier tiles
    for (int n = 0;; ++n) {
        mbarrier_wait(Q_full, n & 1);
        // The tile from shared memory, read where needed: after the barriers' "memory" clobbers the
        // compiler reloads it instead of holding registers through the steps.
        const Tile& tile = tile_slot[n % 2];
        const int T_c = tile.T_c;
        if (T_c < 0)
            break;
        const int wg_first = tile.row_start + wg_row;  // first row of this warpgroup as a query index
        const int my_row = wg_first + 16 * warp + g;   // this thread's rows: my_row and my_row + 8
        // The consumers' release of Q_i, once the last product that reads it has landed, so that the
        // producer loads Q_i+1 under this tile's last steps and epilogue. It also hands back the
        // other slot, which the producer fills next: every thread read it last in the previous tile's
        // epilogue, so every thread arrives. (A warp's lanes synced and lane 0 arriving for them
        // order the same reads, but compute-sanitizer's racecheck counts only a thread's own arrival:
        // where blocks took several tiles it reported the slot's rewrite racing those reads.)
        auto release_Q = [&]() { mbarrier_arrive(Q_empty); };

        if (scale < 0.0f && T_c > 0) {  // S with -Q_i and |scale|: flip the sign bits of this warpgroup's rows
            for (int i = thread_index() % 128; i < 64 * chunks; i += 128) {
                const unsigned at = Q_smem + swizzled<B_r>(wg_row + i / chunks, i % chunks);
                unsigned w[4];
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at));
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0] ^ 0x80008000u), "r"(w[1] ^ 0x80008000u),
                             "r"(w[2] ^ 0x80008000u), "r"(w[3] ^ 0x80008000u));
            }
            // Back to the async proxy, then the warpgroup's own barrier (1 + c: 0 is __syncthreads').
            asm volatile("fence.proxy.async.shared::cta;\nbar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
        }

        float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < d_head / 2; ++i)
            O_acc[i] = 0.0f;

        // The online softmax of one tile in place: S becomes 2^(scale log2(e) (S - m_i)), where m_i, the
        // reference, moves to the row's maximum only when that passes it by more than RESCALE_LOG2 (scaled);
        // l_i moves on, alpha holds each row's rescale factor; true if some reference of the warp moved.
        auto mask = [&](float (&S)[B_c / 2], int j) {
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
        };
        auto softmax = [&](float (&S)[B_c / 2], int j, float (&alpha)[2]) {
            mask(S, j);
            float m_new[2];
            bool move[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float step_max = -INFINITY;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
                    step_max = fmaxf(step_max, fmaxf(S[4 * n + 2 * h], S[4 * n + 2 * h + 1]));
                step_max = fmaxf(step_max, __shfl_xor_sync(FULL_WARP, step_max, 1));
                step_max = fmaxf(step_max, __shfl_xor_sync(FULL_WARP, step_max, 2));
                // From m_i = -inf any finite maximum moves it (inf > 8); a row with no key yet stays
                // (-inf - -inf is NaN, and NaN > 8 is false), its exponentials 2^-inf = 0.
                move[h] = (step_max - m_i[h]) * scale_log2 > RESCALE_LOG2;
                m_new[h] = move[h] ? step_max : m_i[h];
            }
            // The rescale factors' exponentials only where some row of the warp moved (a uniform branch).
            const bool moved = __any_sync(FULL_WARP, move[0] || move[1]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_scaled = m_new[h] == -INFINITY ? 0.0f : m_new[h] * scale_log2;
                alpha[h] = moved && move[h] ? exp2_approx(fmaf(m_i[h], scale_log2, -m_scaled)) : 1.0f;
                m_i[h] = m_new[h];
                float row_sum = 0.0f;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        S[4 * n + e] = exp2_approx(fmaf(S[4 * n + e], scale_log2, -m_scaled));
                        row_sum += S[4 * n + e];
                    }
                l_i[h] = moved ? l_i[h] * alpha[h] + row_sum : l_i[h] + row_sum;
            }
            return moved;
        };
        // The vote on taking S_ij again: the warp's own where it takes its rows again alone (WARP_REDO),
        // else the warpgroup's (its barrier 1 + c), whose four warps issue the wgmma together.
        auto vote = [&](bool p) {
            if constexpr (WARP_REDO)
                return __any_sync(FULL_WARP, p);
            else
                return barrier_any<128>(1 + consumer, p);
        };
        // This warp's 16 rows of S_ij = Q_i K_j^T (ring use u) again, on mma.sync: per k16 step the rows'
        // A fragment (matrices: rows 0-7 and 8-15 of the low 8 columns, then of the high 8), and per two n8
        // tiles of keys their B fragments (keys 0-7 low and high columns, then keys 8-15), so that S holds
        // them as wgmma's accumulators do: n8 tile n, entry e at row my_row + 8 (e / 2), key 8 n + 2 t + e % 2.
        auto warp_S = [&](float (&S)[B_c / 2], int u) {
            const unsigned K_j = K_smem + (u % K_STAGES) * TILE_BYTES;
            const int q_row = wg_row + 16 * warp + lane % 8 + 8 * (lane / 8 % 2);
#pragma unroll
            for (int i = 0; i < B_c / 2; ++i)
                S[i] = 0.0f;
#pragma unroll 1  // a rare path: kept short, and off the registers of the steady loop
            for (int ks = 0; ks < D_STEPS; ++ks) {
                unsigned a[4];
                ldmatrix_x4(a, Q_smem + swizzled<B_r>(q_row, 2 * ks + lane / 16));
#pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    unsigned b[4];
                    ldmatrix_x4(b, K_j + swizzled<B_c>(16 * np + lane % 8 + 8 * (lane / 16), 2 * ks + lane / 8 % 2));
                    mma_16816<dtype_id>(&S[8 * np], a, b[0], b[1]);
                    mma_16816<dtype_id>(&S[8 * np + 4], a, b[2], b[3]);
                }
            }
        };
        // A step's softmax with every row's reference finite: the exponentials against m_i as it stands,
        // their sums, and a vote; where no partial sum of the warp passed SUM_BOUND, m_i stays and l_i
        // moves on (v34's values when nothing moves). Else S_ij again from K_j (ring use u) and v34's
        // softmax on it. True if some reference of the warp moved.
        auto softmax_first = [&](float (&S)[B_c / 2], int j, int u, float (&alpha)[2]) {
            mask(S, j);
            float row_sum[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_scaled = m_i[h] * scale_log2;
                row_sum[h] = 0.0f;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        S[4 * n + e] = exp2_approx(fmaf(S[4 * n + e], scale_log2, -m_scaled));
                        row_sum[h] += S[4 * n + e];
                    }
            }
            // Written as "not at most" so that a NaN sum counts as passed.
            if (!vote(!(row_sum[0] <= SUM_BOUND && row_sum[1] <= SUM_BOUND))) {
                l_i[0] += row_sum[0];
                l_i[1] += row_sum[1];
                return false;
            }
            if constexpr (WARP_REDO) {
                wgmma_wait_all();  // P_i,j-1 V_j-1 done: P's registers free for the products' fragments
                settle(O_acc);
                warp_S(S, u);
            } else {
                wgmma_fence();
                issue_S(S, u);
                wgmma_wait_all();  // and P_i,j-1 V_j-1 with it
                settle(S);
            }
            return softmax(S, j, alpha);
        };
        // True while some row of the warp (of the warpgroup, where it takes S_ij again with a wgmma) has
        // seen no key: its reference is -inf, and a sum of exponentials against it bounds nothing (v34's
        // softmax then, every step).
        auto unsettled = [&]() { return vote(m_i[0] == -INFINITY || m_i[1] == -INFINITY); };

        // No branch around a wgmma depends on the warpgroup: every consumer runs every step of every
        // tile (a tile its rows do not see is masked whole and adds zeros), so that ptxas can keep the
        // products in flight, every consumer warp arrives on every empty barrier the producer counts,
        // and every consumer takes the same number of turns.
        if (T_c == 0) {
            release_Q();  // no key to see: O_i is zero
        } else {
            float S[B_c / 2], alpha[2];
            unsigned P[KEY_STEPS][4];  // P_i,j-1 rounded to 16 bits: the A registers of each key step
            mbarrier_wait(K_full(u0), K_parity(u0));
            wait_turn();
            wgmma_fence();
            issue_S(S, u0);
            pass_turn();
            wgmma_wait_all();
            settle(S);
            release(K_empty(u0));
            if (T_c == 1)
                release_Q();
            softmax(S, 0, alpha);  // O_i is still zero: nothing to rescale
            bool exact = unsettled();
            round_P(P, S);
            bool moved = false;  // O_i = alpha O_i + P_i,j-1 V_j-1: the rescale before the product is issued
            for (int j = 1; j < T_c; ++j) {
                const int u = u0 + j;
                trace_point(consumer, u, 0);
                mbarrier_wait(K_full(u), K_parity(u));
                mbarrier_wait(V_full(u - 1), V_parity(u - 1));
                if (moved) {
#pragma unroll
                    for (int i = 0; i < d_head / 2; ++i)
                        O_acc[i] *= alpha[i % 4 / 2];
                }
                wait_turn();
                wgmma_fence();
                issue_S(S, u);
                issue_PV(P, u - 1);
                pass_turn();  // the products run on; the next consumer may issue behind them
                trace_point(consumer, u, 1);
                wgmma_wait_one();  // S_ij has landed; P_i,j-1 V_j-1 may still run
                settle(S);
                trace_point(consumer, u, 2);
                // While P_i,j-1 V_j-1 and the next consumer's products run. A tile's last step takes v34's
                // softmax, so that Q_i goes back at once for the next tile; the others hold K_j until
                // softmax_first is done (it may take S_ij again).
                if (exact || j == T_c - 1) {
                    release(K_empty(u));
                    if (j == T_c - 1)
                        release_Q();
                    moved = softmax(S, j, alpha);
                    exact = unsettled();
                } else {
                    moved = softmax_first(S, j, u, alpha);
                    release(K_empty(u));
                }
                if constexpr (!TURNS)
                    pin_row_sums(&pin[threadIdx.x - 128], l_i);  // the softmax stays ahead of the wait
                trace_point(consumer, u, 3);
                wgmma_wait_all();
                settle(O_acc);
                trace_point(consumer, u, 4);
                release(V_empty(u - 1));
                round_P(P, S);
            }
            const int last = u0 + T_c - 1;
            mbarrier_wait(V_full(last), V_parity(last));
            if (moved) {
#pragma unroll
                for (int i = 0; i < d_head / 2; ++i)
                    O_acc[i] *= alpha[i % 4 / 2];
            }
            wait_turn();
            wgmma_fence();
            issue_PV(P, last);
            pass_turn();
            wgmma_wait_all();
            settle(O_acc);
            release(V_empty(last));
        }
        u0 += T_c;

        const long long bh = (long long)tile.batch * n_heads + tile.head;
        element* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d)
        const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;
        if constexpr (!O_STAGED) {
            // O_i = O_i / l_i, rounded to 16 bits, from each thread's fragment: a quad's four threads hold 8
            // contiguous columns of a row (2 each) in each n8 tile; quad_transpose over tiles 4 q .. 4 q + 3
            // gives lane t tile 4 q + t's 8 columns, one 16-byte store (2 bytes at a time where O is not
            // 16-byte aligned). Every lane shuffles, rows past T_q included.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float l = l_i[h];
                l += __shfl_xor_sync(FULL_WARP, l, 1);
                l += __shfl_xor_sync(FULL_WARP, l, 2);
                const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
                const int row = my_row + 8 * h;
                element* dst_row = O_head + (long long)row * d_head;
#pragma unroll
                for (int q = 0; q < D_TILES / 4; ++q) {
                    unsigned w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int e = 4 * (4 * q + j) + 2 * h;
                        w[j] = pack_rounded<dtype_id>(O_acc[e] * inv_l, O_acc[e + 1] * inv_l);
                    }
                    const uint4 o = quad_transpose(w[0], w[1], w[2], w[3], t);
                    if (row < T_q) {
                        element* dst = dst_row + 8 * (4 * q + t);
                        if (o_vec) {
                            *reinterpret_cast<uint4*>(dst) = o;
                        } else {
                            const unsigned v[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
                            for (int e = 0; e < 8; ++e)
                                dst[e] = (element)(v[e / 2] >> (16 * (e % 2)));
                        }
                    }
                }
            }
            continue;
        }
        // O_i = O_i / l_i, rounded to 16 bits into this warp's own rows of O_smem, then out in 16-byte
        // stores. The warp wrote and read the same rows for its previous tile: sync before writing.
        __syncwarp();
        const int tid = thread_index(), out_lane = tid % 32, out_warp = tid / 32 % 4;
        const int out_row = wg_row + 16 * out_warp + out_lane / 4, out_t = out_lane % 4;  // as my_row - row_start, and t
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_i[h];
            l += __shfl_xor_sync(FULL_WARP, l, 1);
            l += __shfl_xor_sync(FULL_WARP, l, 2);
            const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
            const int r = out_row + 8 * h;
#pragma unroll
            for (int n = 0; n < D_TILES; ++n) {
                const unsigned o = pack_rounded<dtype_id>(O_acc[4 * n + 2 * h] * inv_l, O_acc[4 * n + 2 * h + 1] * inv_l);
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
    if (consumer == 0)
        wait_turn();  // the last consumer's last pass
}
