/*
 * gemm - C (M, N) = A (M, K) @ W (K, N), then + bias, or gelu(. + bias): float32 in and out, on
 * Hopper's TF32 warpgroup MMA at float32 accuracy (3xTF32).
 *
 * Replaces cuBLAS SGEMM and the bias_act kernel after it in the whole-sequence forward pass
 * (gpt2/fast/engine.py's sequence(): the prefill, and every step of the no-cache mode). A and C are
 * row-major; W arrives prepared once by gpt2/fast/weights.py (gemm_weight): transposed to (N, K), split,
 * cut into tiles and swizzled, as described below. GELU is gelu_tanh, as bias_act and
 * gpt2/model.py's gelu().
 *
 * Why: a float32 FFMA product peaks near 51 TFLOP/s on an H200 (cuBLAS, 8192^3), and the
 * sequence's products are small (M = tokens so far, N and K 768 to 3072), where cuBLAS stays at
 * 15-33 TFLOP/s. TF32 keeps 10 of float32's 23 mantissa bits, so, as in the attention rungs v14 and
 * v20, every operand is split into a TF32 big part and the remainder, big = round(x) and
 * small = x - big (exact in float32), and a b = a_big b_big + a_big b_small + a_small b_big: three
 * products per product, the dropped a_small b_small below 2^-22 of a b. A first version on v14's
 * mma.sync (m16n8k8, a warp per 32 x 32 tile, the split in registers) ran at cuBLAS's speed at best
 * on an H200: 78 us against 75 for (519 x 768) @ (768 x 3072), 30 us for any M at K = 768 and 104 us
 * at K = 3072, where cuBLAS took 12-80: three TF32 mma.sync per product leave less than the FFMA
 * ceiling. wgmma runs TF32 at several times mma.sync's rate.
 *
 * The operands:
 *   - W is the same for every call, so its split is done once: W_big and W_small, each (N, K)
 *     (K-major, as TF32 wgmma requires for both operands), in tiles of 64 rows (n) x 32 columns (k),
 *     each tile 8 KB contiguous, tile (n / 64, k / 32) at float offset ((n / 64) * (K / 32) + k / 32) * 2048,
 *     and within a tile the 128-byte swizzle (v18/v20's): row r's 16-byte chunk c at c ^ (r mod 8).
 *     A stage's two W tiles arrive as two bulk copies (cp.async.bulk, completion on an mbarrier)
 *     and the tensor cores read them as they land, through descriptors.
 *   - A (the activations) arrives by cp.async into a padded tile (pitch 36 floats, so that the
 *     fragment reads, lane = 4 g + t at row g and column t, hit 32 different banks), and each warp
 *     loads its 16 rows' fragments into registers and splits them there: wgmma takes A from registers.
 * Accuracy: the tensor core adds into its float32 accumulator truncating, not rounding, so long
 * chains drift toward zero (v14's header). Every tile of 32 columns of K is summed from zero in two
 * accumulators of its own, big x big and the corrections (4 k8 steps, 12 wgmma), then added to the
 * running sum in ordinary float32 arithmetic.
 *
 * Geometry: one warpgroup (128 threads) per 64 x 64 tile of C and split of K, grid (N / 64,
 * ceil(M / 64), splits); warp w owns rows 16 w .. 16 w + 15 (wgmma's layout). K streams through
 * STAGES buffers, STAGES - 1 tiles in flight while one is multiplied; each tile's products are
 * waited for before its stage is refilled. Rows of A past M are zero-filled and never stored.
 * Split K: with few output tiles (short sequences; N = 768) a block per tile leaves most SMs idle
 * and walks all of K alone (at K = 3072, 70 us for any M up to 64 on an H200, against 16 with 11
 * splits). Split z sums its K tiles, stores the sum to `partials` (float4s, thread-major), fences and
 * takes a ticket; the split that draws the last ticket adds all the sums in split order (the same
 * bits whichever finishes last), resets the ticket to zero for the next launch and applies the
 * epilogue. gpt2/fast/plan.py's gemm_splits picks the splits. Shared memory: 1024 bytes for the
 * mbarriers and alignment, then per stage W_big, W_small (8 KB each, 1024-aligned for the swizzle)
 * and A (64 x 36 floats): 1024 + 1024 + STAGES * 25,600 bytes = 104,448 at STAGES = 4; registers:
 * the sum, big x big and the corrections (32 each) and the split A fragments of 4 k8 steps (32).
 *
 * Limits: sm_90a only. N % 64 == 0 and K % 32 == 0 (every GPT-2 width), A, C and bias 16-byte
 * aligned, M >= 1. An infinite input becomes NaN (its remainder is inf - inf); finite inputs within
 * 2^-11 of FLT_MAX may round up to infinity.
 */
#include "common.cuh"

namespace gemm_detail {

constexpr int BM = 64, BN = 64, BK = 32, STAGES = 4, THREADS = 128;
constexpr int A_PITCH = BK + 4;                         // floats
constexpr int W_TILE = BN * BK * 4;                      // bytes of one W tile
constexpr int STAGE_BYTES = 2 * W_TILE + BM * A_PITCH * 4;

__device__ __forceinline__ unsigned tf32_big(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ unsigned tf32_small(float x, unsigned big) { return __float_as_uint(x - __uint_as_float(big)); }

__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, asynchronously; src_bytes 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void copy16(float* dst, const float* src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// A K-major operand in the 128-byte swizzle: 8-row groups 1024 bytes apart (v20's descriptor).
__device__ __forceinline__ unsigned long long descriptor(unsigned address)
{
    return (unsigned long long)((address & 0x3ffff) >> 4) | (unsigned long long)(16 >> 4) << 16 |
           (unsigned long long)(1024 >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

#define ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ACC16(i) ACC4(i), ACC4(i + 4), ACC4(i + 8), ACC4(i + 12)
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// D (+)= A B: A 64 x 8 in registers (per warp: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)),
// B 8 x 64 in shared memory, K-major; D = A B when accumulate is 0.
__device__ __forceinline__ void wgmma(float (&d)[32], const unsigned (&a)[4], unsigned long long b, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " REGS32 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}"
                 : ACC16(0), ACC16(16) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

}  // namespace gemm_detail

template <int EPI>  // 0: C = A W; 1: + bias; 2: gelu(. + bias)
__global__ void __launch_bounds__(gemm_detail::THREADS)
gemm_tf32x3(const float* __restrict__ A, const float* __restrict__ W_big, const float* __restrict__ W_small,
            const float* __restrict__ bias, float* __restrict__ C, int M, int N, int K,
            float4* __restrict__ partials, unsigned* __restrict__ tickets)
{
    using namespace gemm_detail;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* base = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // 1024-aligned
    unsigned long long* full = reinterpret_cast<unsigned long long*>(base);          // one per stage
    unsigned char* stages = base + 1024;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int splits = gridDim.z, split = blockIdx.z;
    const int k_begin = split * (K / BK) / splits, tiles = (split + 1) * (K / BK) / splits - k_begin;
    const long long w_first = ((long long)blockIdx.x * (K / BK) + k_begin) * (BN * BK);  // its first W tile, floats

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(full + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Tile kt of W (both parts, bulk copies) and of A (cp.async, one commit group) into stage s.
    auto load = [&](int kt, int s) {
        unsigned char* stage = stages + s * STAGE_BYTES;
        if (tid == 0) {
            mbar_expect(full + s, 2 * W_TILE);
            bulk_copy(stage, W_big + w_first + (long long)kt * BN * BK, W_TILE, full + s);
            bulk_copy(stage + W_TILE, W_small + w_first + (long long)kt * BN * BK, W_TILE, full + s);
        }
        float* As = reinterpret_cast<float*>(stage + 2 * W_TILE);
        for (int c = tid; c < BM * BK / 4; c += THREADS) {
            const int r = c / (BK / 4), col = c % (BK / 4) * 4;
            const bool in = m0 + r < M;
            copy16(As + r * A_PITCH + col, A + (long long)(in ? m0 + r : 0) * K + (k_begin + kt) * BK + col, in ? 16 : 0);
        }
    };

    float acc[32] = {};  // wgmma's layout: [4 j + i], columns 8 j + 2 t (+1), rows g (i < 2) and g + 8
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load(s, s);
        copy_commit();
    }
    for (int kt = 0; kt < tiles; ++kt) {
        const int s = kt % STAGES;
        copy_wait<STAGES - 2>();                  // this thread's rows of A for tile kt have landed,
        mbar_wait(full + s, (kt / STAGES) & 1);  // and both W tiles;
        __syncthreads();                          // every thread's rows, and stage (kt - 1) % STAGES is free
        if (kt + STAGES - 1 < tiles) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        copy_commit();

        unsigned char* stage = stages + s * STAGE_BYTES;
        const unsigned wb = smem_addr(stage), ws = wb + W_TILE;
        const float* As = reinterpret_cast<const float*>(stage + 2 * W_TILE) + (16 * warp + g) * A_PITCH + t;
        unsigned a_big[4][4], a_small[4][4];  // k8 step, register
#pragma unroll
        for (int k8 = 0; k8 < 4; ++k8) {
            const float* a = As + 8 * k8;
            const float v[4] = {a[0], a[8 * A_PITCH], a[4], a[8 * A_PITCH + 4]};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a_big[k8][i] = tf32_big(v[i]);
                a_small[k8][i] = tf32_small(v[i], a_big[k8][i]);
            }
        }
        float big[32], corr[32];
        wgmma_fence();
#pragma unroll
        for (int k8 = 0; k8 < 4; ++k8) {  // k8 step k8 starts 32 k8 bytes into each swizzled row
            wgmma(corr, a_small[k8], descriptor(wb + 32 * k8), k8 != 0);
            wgmma(corr, a_big[k8], descriptor(ws + 32 * k8), 1);
            wgmma(big, a_big[k8], descriptor(wb + 32 * k8), k8 != 0);
        }
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] += big[i] + corr[i];
    }

    if (splits > 1) {  // leave this split's sum; the last split of the tile to finish adds them all
        const int tile = blockIdx.y * gridDim.x + blockIdx.x, tiles_c = gridDim.x * gridDim.y;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            partials[((long long)(split * tiles_c + tile) * 8 + i) * THREADS + tid] =
                make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
        __threadfence();
        __syncthreads();
        __shared__ unsigned last;
        if (tid == 0) {
            last = atomicAdd(tickets + tile, 1u) == (unsigned)splits - 1;
            if (last) tickets[tile] = 0;  // every launch leaves the tickets at zero
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
        for (int z = 0; z < splits; ++z) {  // in split order: the same bits whichever split is last
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 p = __ldcg(partials + ((long long)(z * tiles_c + tile) * 8 + i) * THREADS + tid);
                acc[4 * i] += p.x; acc[4 * i + 1] += p.y; acc[4 * i + 2] += p.z; acc[4 * i + 3] += p.w;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = n0 + 8 * j + 2 * t;
        float2 b = make_float2(0.0f, 0.0f);
        if (EPI != 0) b = *reinterpret_cast<const float2*>(bias + col);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + 16 * warp + g + 8 * h;
            if (row >= M) continue;
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (EPI != 0) { v.x += b.x; v.y += b.y; }
            if (EPI == 2) { v.x = gelu_tanh(v.x); v.y = gelu_tanh(v.y); }
            *reinterpret_cast<float2*>(C + (long long)row * N + col) = v;
        }
    }
}
