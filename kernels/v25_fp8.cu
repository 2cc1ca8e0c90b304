/*
 * v25 - FP8: Q, K, V and P in e4m3 on FP8 wgmma (m64nNk32, twice bf16's rate), each tile with
 * one float32 scale, Q and K optionally rotated by a random Hadamard matrix; O in bfloat16.
 *
 * The change: v22's warp-specialized kernel with its operands in e4m3 (float8_e4m3fn: 3 mantissa
 * bits, largest value 448). The tensor cores multiply e4m3 at twice bf16's rate and a tile of K or V
 * is half the bytes, so the same ring holds twice the keys in flight. v22 rather than v24 as the
 * base: at d = 128, T >= 4096 causal, the FP8 table's shapes, v22 is level with or ahead of v24 (a
 * head-heavy grid has little causal tail for persistence to save), and its one-block-per-tile
 * protocol leaves this rung's diff to one idea, the data type.
 *
 * The inputs: kernels.quantize_fp8 (kernels/fp8.py; prepare calls it on bfloat16 inputs with this
 * configuration's B_r and B_c, or takes Fp8Inputs made beforehand) stores e4m3 codes and one float32
 * scale per tile: s_Q per B_r x d block of Q, s_K and s_V per B_c x d block of K and V, each block's
 * largest finite magnitude over 448. With Hadamard on (the default), Q and K are both multiplied along
 * d by R = D H / sqrt(d) (a random +-1 diagonal times the normalized Hadamard matrix, orthogonal), so
 * (Q R)(K R)^T = Q K^T: an outlier is spread over the row and costs its neighbours less precision.
 *
 * V^T: FP8 wgmma reads both operands K-major from shared memory; the transpose bits exist only for
 * 16-bit types. S = Q K^T is K-major as loaded (d innermost in Q and K). For O += P V the reduction
 * runs over keys, so the B operand must be V^T, the keys innermost. The quantize step writes V^T
 * (B, NH_kv, d, T_k padded to whole tiles) in global memory instead of this kernel transposing V in
 * shared memory after each copy lands (FlashAttention-3's LDSM.T/STSM by the producer warpgroup): that
 * step reads and writes every element of V anyway, so the transpose costs no extra pass, while in here it
 * would cost a second ring of V tiles, a barrier per tile between the transposing warps and the
 * consumers, generic-proxy stores that need fence.proxy.async before wgmma reads them, and registers
 * in the producer warpgroup. The TMA lands V^T_j (d rows x B_c keys, 128 bytes) already K-major.
 *
 * P as the A operand: the accumulator of S gives thread (g, t) of a warp, for each 8 keys n, keys
 * 8 n + 2 t and 8 n + 2 t + 1 of rows g and g + 8; the e4m3 A fragment of m64nNk32 wants, per 32-key
 * step, 4 consecutive keys in each register: 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3 of rows g and
 * g + 8 (PTX ISA, wgmma register fragments; CUTLASS's ALayout_64x32). Instead of shuffling bytes
 * between the threads of a quad into that layout (as FlashAttention-3 does, with byte permutes), each
 * register packs what the thread holds, keys {2 t, 2 t + 1, 8 + 2 t, 9 + 2 t} of a 16-key
 * half, with two cvt.rn.satfinite.e4m3x2.f32: byte e of thread t's register, the slot of key 4 t + e
 * in the product, carries key 2 t + e % 2 + 8 (e / 2). A product sums over its keys in any order as
 * long as P and V agree, so the quantize step writes each 16 keys of V^T in that order
 * (kernels.fp8.KEY_ORDER): the slot and the V^T column then hold the same key.
 *
 * Scales: the accumulator of S_ij is in units of s_Q s_K_j, so the softmax's exponent factor is per
 * tile, f_j = |scale| log2(e) s_Q s_K_j, and the running maximum m_i is kept in those scaled log2
 * units (max(m_i, f_j rowmax(S_ij)): f_j > 0 keeps the maximum). P_ij = 2^(f_j S_ij - m_i + 8), i.e.
 * 256 p in [0, 256] in e4m3, where the small probabilities keep 8 binades more than p itself would (l_i
 * sums the same 256 p, unrounded, and the factor cancels in O_i / l_i). V_j's scale folds into the
 * online rescale of O_i, kept in units of the latest V tile's scale: O_i = O_i alpha s_V,j-1 / s_V,j +
 * P_ij V_j, and O_i s_V,last / l_i at the end, so no second accumulator. The rescale runs whenever a row
 * maximum moved or the two V scales differ.
 *
 * Shared memory, the swizzle: a row of Q_i or K_j is d bytes, one TMA box per tile (box inner extent d
 * bytes). d = 128 takes the 128-byte swizzle, d = 64 the 64-byte one (the launcher encodes each
 * descriptor with the swizzle that spans its box's inner extent, driver.swizzle_for); the wgmma
 * descriptors name the same mode (bits 62-63: 1 for 128 bytes, 2 for 64), with stride byte offset 8
 * rows x d bytes, and each k32 step is 32 bytes further along the row. V^T_j's rows are B_c = 128 keys,
 * 128 bytes, 128-byte swizzle. O_i (bfloat16) goes out through a buffer of its own (Q_i's B_r x d bytes
 * are half of it), v22's epilogue otherwise.
 *
 * Everything else - the roles, setmaxnreg, the ring and its full and empty mbarriers (only the bytes
 * per tile change: B_r d for Q_i, B_c d for K_j and V^T_j), masking, heavy-first order, features - is
 * v22's, and so is the negative scale's sign flip of the warpgroup's rows of Q_i (every byte's bit 7).
 *
 * Geometry: grid (T_r = ceil(T_q / B_r), n_heads, batch), heavy tiles first; block B_r * 2 + 128 threads
 * (the producer warpgroup and B_r / 64 consumers). STAGES = 8 - d / 32: 6 stages of 8 KB tiles at d =
 * 64, 4 of 16 KB at d = 128. Shared memory, e4m3 tiles: Q_i (B_r x d) + O_i (B_r x d x 2, bfloat16) +
 * STAGES x (K_j + V^T_j) + 1024 to align the atoms, and 1 + 4 STAGES mbarriers (static):
 *   d = 64,  B_r = 192, 6 stages: 3 * 192 * 64 + 12 * 128 * 64 + 1024 = 136,192 bytes
 *   d = 64,  B_r = 128, 6 stages: 3 * 128 * 64 + 12 * 128 * 64 + 1024 = 123,904 bytes
 *   d = 128, B_r = 128, 4 stages: 3 * 128 * 128 + 8 * 128 * 128 + 1024 = 181,248 bytes
 * Registers: a consumer holds S_ij (B_c / 2 = 64), P_i,j-1 (4 x B_c / 32 = 16, a quarter of S_ij where
 * bf16 took half) and O_i (d / 2).
 *
 * Limits: sm_90a only; d 64 or 128 (Hadamard: a power of two); B_r 128 or 192; B_c 128; output
 * bfloat16; the accuracy is FP8's, held to its float64 emulation (kernels.fp8.emulated_attention) and
 * to RMSE bounds by tests/test_fp8_gpu.py instead of the ladder's bf16 tolerance. V tiles whose scales
 * differ by more than about 2^100 overflow O_i's float32 rescale. The FP8 tensor cores add with
 * fewer than float32's bits; O_i keeps accumulating across tiles through them.
 *
 * lab.template    d_head, B_r, B_c
 * lab.configs     (64, 192, 128), (64, 128, 128), (128, 128, 128)
 * lab.threads     B_r * 2 + 128
 * lab.smem        3 * B_r * d_head + 2 * (8 - d_head // 32) * B_c * d_head + 1024
 * lab.dtypes      bfloat16
 * lab.fp8         true
 * lab.supports    noncausal, cross, gqa
 * lab.min_arch    sm_90
 * lab.options     -arch=sm_90a
 * lab.tma         Q: (B_r, d_head), K: (B_c, d_head), V: (d_head, B_c)
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
#define WGMMA_E4M3(N) "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "

// D (+)= A B, A 64 x 32 and B 32 x N e4m3 both in shared memory, K-major (FP8 has no transpose
// bits); D = A B when accumulate is 0.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate)
{
    static_assert(N == 64 || N == 128, "m64n64k32 or m64n128k32");
    if constexpr (N == 64)
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

// Byte offset of 16-byte chunk c (of d_head / 8) of row r in O_i's bfloat16 buffer of `rows` rows:
// 64-column halves one after the other, chunk c % 8 of a half's row r at chunk (c % 8) ^ (r % 8).
template <int rows>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    return (c / 8) * rows * 128 + r * 128 + 16 * ((c % 8) ^ (r % 8));
}

template <int d_head, int B_r, int B_c>
__global__ void __launch_bounds__(B_r * 2 + 128, 1)
attention_forward(const byte* __restrict__ /* Q */, const byte* __restrict__ /* K */,
                  const byte* __restrict__ /* V^T */, element* __restrict__ O, float* __restrict__ /* workspace */,
                  int T_q, int T_k, int kv_group, int causal, float scale,
                  long long /* q_batch_stride */, long long /* q_head_stride */, long long /* q_row_stride */,
                  long long /* kv_batch_stride */, long long /* kv_head_stride */, long long /* kv_row_stride */,
                  const float* __restrict__ q_scale, const float* __restrict__ k_scale,
                  const float* __restrict__ v_scale,
                  const __grid_constant__ TensorMap Q_map, const __grid_constant__ TensorMap K_map,
                  const __grid_constant__ TensorMap V_map)
{
    static_assert(d_head == 64 || d_head == 128, "rows of 64 or 128 bytes: one swizzled box per tile");
    static_assert(B_r == 128 || B_r == 192, "two or three consumer warpgroups of 64 rows");
    static_assert(B_c == 128, "V^T_j's rows are 128 keys: 128 bytes, one 128-byte-swizzled box");
    constexpr int CONSUMERS = B_r / 64;     // consumer warpgroups
    constexpr int D_STEPS = d_head / 32;    // k32 steps of Q_i K_j^T
    constexpr int D_TILES = d_head / 8;     // n8 tiles of O_i
    constexpr int N_TILES = B_c / 8;        // n8 tiles of S_ij
    constexpr int KEY_STEPS = B_c / 32;     // k32 steps of P_ij V_j
    constexpr int chunks = d_head / 8;      // 16-byte chunks of a bfloat16 row of O_i
    constexpr unsigned Q_BYTES = B_r * d_head;
    constexpr unsigned TILE_BYTES = B_c * d_head;  // K_j, and V^T_j
    constexpr int STAGES = 8 - d_head / 32;  // of K_j, and of V^T_j: 6 of 8 KB tiles, 4 of 16 KB
    // Registers per thread after the split: the producer's few, the consumers' share of the rest.
    constexpr int PRODUCER_REGISTERS = 24;
    constexpr int CONSUMER_REGISTERS = CONSUMERS == 2 ? 240 : 160;
    static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * 128 * CONSUMERS <= 65536 / (128 * (1 + CONSUMERS)) / 8 * 8 * (128 * (1 + CONSUMERS)),
                  "the block's pool: 65536 / threads registers a thread, in 8s, as it launched (setmaxnreg.inc waits for more: a hang)");

    extern __shared__ unsigned char smem[];
    // Every tile on a 1024-byte boundary, where the swizzle pattern starts (lab.smem has 1 KB spare).
    const unsigned Q_smem = ((unsigned)__cvta_generic_to_shared(smem) + 1023) & ~1023u;
    const unsigned O_smem = Q_smem + Q_BYTES;                   // O_i in bfloat16 on its way out
    const unsigned K_smem = O_smem + 2 * B_r * d_head;          // STAGES stages of K_j
    const unsigned V_smem = K_smem + STAGES * TILE_BYTES;       // STAGES stages of V^T_j
    // Q_i's full barrier, then per stage the full barriers of K_j and V^T_j and their empty barriers.
    __shared__ __align__(8) unsigned long long barriers[1 + 4 * STAGES];
    const unsigned Q_full = (unsigned)__cvta_generic_to_shared(barriers);
    auto K_full = [&](int j) { return Q_full + 8 * (1 + j % STAGES); };
    auto V_full = [&](int j) { return Q_full + 8 * (1 + STAGES + j % STAGES); };
    auto K_empty = [&](int j) { return Q_full + 8 * (1 + 2 * STAGES + j % STAGES); };
    auto V_empty = [&](int j) { return Q_full + 8 * (1 + 3 * STAGES + j % STAGES); };
    auto parity = [](int j) { return (unsigned)(j / STAGES) & 1u; };  // tile j: use j / STAGES of its stage

    // Heavy tiles first, in chunks of heads (v22's order); K and V of a head are now 2 T_k d bytes.
    const long long n_heads = (long long)gridDim.y * gridDim.z;
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const long long kv_bytes = 2LL * T_k * d_head;  // K and V of one head, 1 byte an element
    const long long chunk = n_heads * kv_bytes <= L2_ALL ? n_heads : max(1LL, min(n_heads, L2_CHUNK / kv_bytes));
    const long long chunk_blocks = chunk * gridDim.x;
    const long long first_head = flat / chunk_blocks * chunk;
    const long long heads_here = min(chunk, n_heads - first_head);  // the last chunk may be short
    const long long within = flat % chunk_blocks;
    const int q_tile = gridDim.x - 1 - (int)(within / heads_here);
    const long long bh = first_head + within % heads_here;  // = batch * NH + head
    const int batch = (int)(bh / gridDim.y);
    const int head = (int)(bh % gridDim.y);
    const int kv_head = head / kv_group;

    const int row_start = q_tile * B_r;
    const int rows = min(B_r, T_q - row_start);
    const int offset = T_k - T_q;  // query row i sees keys j <= i + offset (bottom-right causal mask)
    int T_c = (T_k + B_c - 1) / B_c;
    if (causal) {
        const int last_key = row_start + rows - 1 + offset;
        T_c = last_key < 0 ? 0 : min(T_c, last_key / B_c + 1);
    }

    // Thread 0 makes the barriers; every thread waits for them to exist (the last block-wide barrier).
    if (threadIdx.x == 0) {
        for (int b = 0; b < 1 + 2 * STAGES; ++b)
            mbarrier_init(Q_full + 8 * b, 1);  // full: the producer's arrival, and the bytes
        for (int b = 1 + 2 * STAGES; b < 1 + 4 * STAGES; ++b)
            mbarrier_init(Q_full + 8 * b, 4 * CONSUMERS);  // empty: every consumer warp
        mbarrier_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        // The producer (v22's): one thread issues every load, K_j then V^T_j, each as soon as the
        // consumers have released the stage's previous tile, j - STAGES. One box per tile.
        registers_down<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            load_tile(Q_smem, &Q_map, 0, row_start, head, batch, Q_full, Q_BYTES);
            for (int j = 0; j < T_c; ++j) {
                if (j >= STAGES)
                    mbarrier_wait(K_empty(j), parity(j) ^ 1u);
                load_tile(K_smem + (j % STAGES) * TILE_BYTES, &K_map, 0, j * B_c, kv_head, batch, K_full(j), TILE_BYTES);
                if (j >= STAGES)
                    mbarrier_wait(V_empty(j), parity(j) ^ 1u);
                // V^T (B, NH_kv, d, T_pad): column j B_c (the key), row 0 (the first of d rows)
                load_tile(V_smem + (j % STAGES) * TILE_BYTES, &V_map, j * B_c, 0, kv_head, batch, V_full(j), TILE_BYTES);
            }
            // Leave with no copy in flight: Q_i's and the last tiles' bytes have landed (the earlier
            // tiles' stages were released, so theirs had).
            mbarrier_wait(Q_full, 0);
            for (int j = max(0, T_c - STAGES); j < T_c; ++j) {
                mbarrier_wait(K_full(j), parity(j));
                mbarrier_wait(V_full(j), parity(j));
            }
        }
        return;
    }

    // A consumer: warpgroup c + 1 takes rows 64 c .. 64 c + 63 of Q_i.
    registers_up<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1;
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;  // warp within the warpgroup
    const int g = lane / 4, t = lane % 4;
    const int wg_row = 64 * consumer;         // first row of this warpgroup in Q_i
    const int wg_first = row_start + wg_row;  // ... as a query index
    const int my_row = wg_first + 16 * warp + g;  // this thread's rows: my_row and my_row + 8
    // The tiles' scales: Q_i's, and the rows of K's and V's scales for this K/V head.
    const long long kv_tiles = ((long long)batch * (gridDim.y / kv_group) + kv_head) * ((T_k + B_c - 1) / B_c);
    const float* K_scale = k_scale + kv_tiles;
    const float* V_scale = v_scale + kv_tiles;
    const float score_log2 = fabsf(scale) * LOG2_E * q_scale[bh * gridDim.x + q_tile];  // times s_K,j per tile
    // The warp's arrival on an empty barrier, once its products have read the stage.
    auto release = [&](unsigned barrier) {
        if (lane == 0)
            mbarrier_arrive(barrier);
    };

    mbarrier_wait(Q_full, 0);
    if (scale < 0.0f) {  // S with -Q_i and |scale|: flip the sign bit of every byte of this warpgroup's rows
        for (int i = threadIdx.x % 128; i < 64 * d_head / 16; i += 128) {
            const unsigned at = Q_smem + wg_row * d_head + 16 * i;  // the rows are contiguous: the swizzle stays in a row
            unsigned w[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at));
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0] ^ 0x80808080u), "r"(w[1] ^ 0x80808080u),
                         "r"(w[2] ^ 0x80808080u), "r"(w[3] ^ 0x80808080u));
        }
        // Back to the async proxy, then the warpgroup's own barrier (1 + c: 0 is __syncthreads').
        asm volatile("fence.proxy.async.shared::cta;\nbar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
    }

    float O_acc[d_head / 2];  // n8 tile n, entry e: row my_row + 8 (e / 2), column 8 n + 2 t + e % 2
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.0f, 0.0f};  // m_i in scaled log2 units
#pragma unroll
    for (int i = 0; i < d_head / 2; ++i)
        O_acc[i] = 0.0f;

    // S = Q_i K_j^T: d / 32 k32 steps, each 32 bytes further along the rows.
    auto issue_S = [&](float (&S)[B_c / 2], int j) {
        const unsigned K_j = K_smem + (j % STAGES) * TILE_BYTES;
#pragma unroll
        for (int s = 0; s < D_STEPS; ++s) {
            const unsigned a = Q_smem + wg_row * d_head + 32 * s;
            wgmma_ss<B_c>(S, descriptor<d_head>(a), descriptor<d_head>(K_j + 32 * s), s > 0);
        }
        wgmma_commit();
    };
    // O_i += P V_j, P the e4m3 probabilities of tile j: key step kk is columns 32 kk .. of V^T_j.
    auto issue_PV = [&](const unsigned (&P)[KEY_STEPS][4], int j) {
        const unsigned V_j = V_smem + (j % STAGES) * TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
            wgmma_rs<d_head>(O_acc, P[kk], descriptor<B_c>(V_j + 32 * kk));
        wgmma_commit();
    };
    // The online softmax of one tile in place, f = score_log2 s_K,j (above FLT_MIN_NORMAL, so that a
    // masked -inf never meets a zero factor): S becomes 2^(f S - m_new + 8), m_i and l_i move on, alpha
    // holds each row's rescale factor; true if some row max of the warp moved.
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
            float row_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    S[4 * n + e] = exp2_approx(fmaf(S[4 * n + e], f, shift));
                    row_sum += S[4 * n + e];
                }
            l_i[h] = l_i[h] * alpha[h] + row_sum;
        }
        return __any_sync(FULL_WARP, max_moved);
    };
    // P_ij as the A operand of each key step: register r of step kk holds row g (r even) or g + 8
    // (r odd) and the 8-key tiles 4 kk, 4 kk + 1 (r < 2) or 4 kk + 2, 4 kk + 3, two keys of each: the
    // keys of V^T's columns 32 kk + 16 (r / 2) + 4 t .. + 3 (kernels.fp8.KEY_ORDER).
    auto round_P = [&](unsigned (&P)[KEY_STEPS][4], const float (&S)[B_c / 2]) {
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int n = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);  // S[4 n + e] is tile n, row g + 8 (e / 2)
                P[kk][r] = pack_e4m3(S[4 * n + e], S[4 * n + e + 1], S[4 * n + 4 + e], S[4 * n + 4 + e + 1]);
            }
    };

    // No branch around a wgmma depends on the warpgroup: every consumer runs every step of the block
    // (a tile its rows do not see is masked whole and adds zeros), so that ptxas can keep the
    // products in flight, and every consumer warp arrives on every empty barrier the producer counts.
    float s_V = 1.0f;  // O_i's unit: the scale of the V tile whose product it holds last
    if (T_c > 0) {
        float S[B_c / 2], alpha[2];
        unsigned P[KEY_STEPS][4];  // P_i,j-1 in e4m3: the A registers of each key step
        float s_K = K_scale[0];
        s_V = V_scale[0];
        mbarrier_wait(K_full(0), parity(0));
        wgmma_fence();
        issue_S(S, 0);
        wgmma_wait_all();
        settle(S);
        release(K_empty(0));
        softmax(S, 0, fmaxf(score_log2 * s_K, FLT_MIN_NORMAL), alpha);  // O_i is still zero: nothing to rescale
        round_P(P, S);
        for (int j = 1; j < T_c; ++j) {
            s_K = K_scale[j];
            const float s_V_next = V_scale[j];
            mbarrier_wait(K_full(j), parity(j));
            mbarrier_wait(V_full(j - 1), parity(j - 1));
            wgmma_fence();
            issue_S(S, j);
            issue_PV(P, j - 1);
            wgmma_wait_one();  // S_ij has landed; P_i,j-1 V_j-1 may still run
            settle(S);
            release(K_empty(j));
            const bool moved = softmax(S, j, fmaxf(score_log2 * s_K, FLT_MIN_NORMAL), alpha);  // while P_i,j-1 V_j-1 runs
            wgmma_wait_all();
            settle(O_acc);
            release(V_empty(j - 1));
            if (moved || s_V_next != s_V) {  // O_i = alpha (O_i + P_i,j-1 V_j-1), from units of s_V,j-1 to s_V,j
                const float units = s_V / s_V_next;
                const float factor[2] = {alpha[0] * units, alpha[1] * units};
#pragma unroll
                for (int i = 0; i < d_head / 2; ++i)
                    O_acc[i] *= factor[i % 4 / 2];
            }
            s_V = s_V_next;
            round_P(P, S);
        }
        mbarrier_wait(V_full(T_c - 1), parity(T_c - 1));
        wgmma_fence();
        issue_PV(P, T_c - 1);
        wgmma_wait_all();
        settle(O_acc);
        release(V_empty(T_c - 1));
    }

    element* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d) bfloat16
    const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;
    // O_i = O_i s_V / l_i, rounded to bfloat16 into this warp's own rows of O_smem, then out in
    // 16-byte stores.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(FULL_WARP, l, 1);
        l += __shfl_xor_sync(FULL_WARP, l, 2);
        const float out_scale = l > 0.0f ? s_V / l : 0.0f;
        const int r = wg_row + 16 * warp + g + 8 * h;
#pragma unroll
        for (int n = 0; n < D_TILES; ++n) {
            const unsigned o = pack_bf16(O_acc[4 * n + 2 * h] * out_scale, O_acc[4 * n + 2 * h + 1] * out_scale);
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(O_smem + swizzled<B_r>(r, n) + 4 * t), "r"(o));
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
