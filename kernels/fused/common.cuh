/*
 * Helpers shared by the fused kernels of the decode steps, GPT-2's and Llama's (kernels/fused/*.cu).
 *
 * Weights arrive as 16-byte vectors: float (4 per vector) or bfloat16 held as its raw bits in an
 * unsigned short (8 per vector). No cuda_bf16.h: a bfloat16 is the top half of a float, so widening
 * is a shift, and rounding (to nearest even) is integer arithmetic on the float's bits.
 * Every reduction accumulates in float32.
 */
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

typedef unsigned short bf16_bits;

// -- bfloat16 <-> float ----------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_float(bf16_bits b) { return __uint_as_float(((unsigned int)b) << 16); }

__device__ __forceinline__ bf16_bits float_to_bf16(float f)
{
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_bits)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (bf16_bits)(u >> 16);
}

// A storage type's value as float, and a float stored as that type (the KV cache's element).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_bits x) { return bf16_to_float(x); }
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(bf16_bits* p, float v) { *p = float_to_bf16(v); }
// v as it reads back after a store to T: rounding the current key to the cache's dtype keeps a
// step's arithmetic identical to reading it from the cache on a later step.
template <typename T> __device__ __forceinline__ float round_as(float v);
template <> __device__ __forceinline__ float round_as<float>(float v) { return v; }
template <> __device__ __forceinline__ float round_as<bf16_bits>(float v) { return bf16_to_float(float_to_bf16(v)); }

// -- 16-byte vectors ---------------------------------------------------------------------------------

template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);  // elements per 16-byte load
};

// Widen the 16 bytes in v to Vec16<T>::N floats.
__device__ __forceinline__ void unpack(const uint4& v, float (&out)[4])
{
    out[0] = __uint_as_float(v.x); out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z); out[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void unpack(const uint4& v, float (&out)[8])
{
    out[0] = __uint_as_float(v.x << 16); out[1] = __uint_as_float(v.x & 0xffff0000u);
    out[2] = __uint_as_float(v.y << 16); out[3] = __uint_as_float(v.y & 0xffff0000u);
    out[4] = __uint_as_float(v.z << 16); out[5] = __uint_as_float(v.z & 0xffff0000u);
    out[6] = __uint_as_float(v.w << 16); out[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Whether p lies on a 16-byte boundary (a 16-byte access there is legal), and 16 bytes moved as one
// load and one store (a copy kernel's unit: kv_store.cu, merge_heads.cu).
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15u) == 0; }
__device__ __forceinline__ void move16(void* dst, const void* src)
{
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

// A read-only 16-byte load through the non-coherent path (the weights never change in a step).
__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// What an earlier kernel of the step wrote (activations, the KV cache, the state), read through L2
// (ld.global.cg). Under programmatic dependent launch a kernel starts while the previous one runs, and
// an SM's L1 is not coherent with other SMs' stores: a line of x that a block of the previous kernel
// read on this SM before blocks on other SMs wrote their parts of it may still sit in this SM's L1
// after griddep_wait(). L2 holds the one current copy. (Under ordinary launches L1 starts clean.)
template <typename T>
__device__ __forceinline__ T fresh(const T* p) { return __ldcg(p); }

// -- reductions -------------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum over the block, in every thread. `scratch` holds one float per warp; the barrier at the
// end lets the caller reuse it at once.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch)
{
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w];  // the same order in every thread
    __syncthreads();
    return total;
}

// The block's best (value, index) in every thread, from each thread's own: the larger value, and of
// equal values the smaller index. warp_best and warp_arg hold one entry per warp; the barrier at the
// end lets the caller reuse them at once.
template <int WARPS>
__device__ __forceinline__ void block_argmax(float& best, int& arg, float* warp_best, int* warp_arg)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int a = __shfl_xor_sync(0xffffffffu, arg, o);
        if (v > best || (v == best && a < arg)) { best = v; arg = a; }
    }
    if (lane == 0) { warp_best[warp] = best; warp_arg[warp] = arg; }
    __syncthreads();
    best = -INFINITY;
    arg = 0x7fffffff;
#pragma unroll
    for (int w = 0; w < WARPS; ++w)
        if (warp_best[w] > best || (warp_best[w] == best && warp_arg[w] < arg)) { best = warp_best[w]; arg = warp_arg[w]; }
    __syncthreads();
}

// -- the block's input vector -----------------------------------------------------------------------

// x_s = LN(x_s) * ln_w + ln_b in place, K floats in shared memory, as GPT-2's LayerNorm: biased
// variance, eps inside the square root. The statistics are two-pass (the mean, then the centred sum
// of squares). Every thread must have finished writing x_s (a __syncthreads() before).
template <int K, int THREADS>
__device__ __forceinline__ void layernorm_inplace(float* x_s, const float* __restrict__ ln_w,
                                                  const float* __restrict__ ln_b, float eps, float* scratch)
{
    float s = 0.0f;
    for (int i = threadIdx.x; i < K; i += THREADS) s += x_s[i];
    const float mean = block_sum<THREADS>(s, scratch) / K;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += THREADS) {
        const float d = x_s[i] - mean;
        ss += d * d;
    }
    const float rstd = 1.0f / sqrtf(block_sum<THREADS>(ss, scratch) / K + eps);
    for (int i = threadIdx.x; i < K; i += THREADS) x_s[i] = (x_s[i] - mean) * rstd * ln_w[i] + ln_b[i];
    __syncthreads();
}

// x_s = LN(x + y + y_bias) * ln_w + ln_b (y and y_bias may be null; LN = false skips the norm),
// K floats in shared memory (layernorm_inplace above).
template <int K, int THREADS, bool LN>
__device__ __forceinline__ void stage_input(const float* __restrict__ x, const float* __restrict__ y,
                                            const float* __restrict__ y_bias, const float* __restrict__ ln_w,
                                            const float* __restrict__ ln_b, float eps, float* x_s,
                                            float* scratch)
{
    static_assert(K % 4 == 0, "rows are read as float4");
    for (int i = threadIdx.x; i < K / 4; i += THREADS) {
        float4 v = fresh(reinterpret_cast<const float4*>(x) + i);
        if (y != nullptr) {
            const float4 a = fresh(reinterpret_cast<const float4*>(y) + i);
            const float4 b = reinterpret_cast<const float4*>(y_bias)[i];
            v.x += a.x + b.x; v.y += a.y + b.y; v.z += a.z + b.z; v.w += a.w + b.w;
        }
        reinterpret_cast<float4*>(x_s)[i] = v;
    }
    __syncthreads();
    if (LN) layernorm_inplace<K, THREADS>(x_s, ln_w, ln_b, eps, scratch);
}

// -- copies into shared memory ---------------------------------------------------------------------

// 16 bytes from global to shared memory, through L2 only (cp.async.cg), landing by cp_async_wait_all().
__device__ __forceinline__ void cp_async16(void* dst, const void* src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// -- epilogues --------------------------------------------------------------------------------------

// GPT-2's GELU, the tanh approximation (transformers' gelu_new), 0.044715 as in the paper.
__device__ __forceinline__ float gelu_tanh(float x)
{
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * (x * x * x))));
}

// -- programmatic dependent launch (sm_90) ----------------------------------------------------------

// The decode step's kernels are launched with programmatic stream serialization where the device has
// it (gpt2/fast/engine.py): the next kernel starts while this one runs, issues its weight loads, and waits
// in griddep_wait() until this grid has completed and its writes are visible. Every decode kernel
// calls griddep_wait() and then griddep_launch_dependents(), so a kernel starts only after the one
// two launches back has completed. Rule for every decode kernel: before griddep_wait() read only the
// weights and what kernels two or more launches back wrote (decode_attention stages its cache rows),
// and write nothing; after it, read what earlier kernels wrote with fresh().
// Under an ordinary launch both calls return at once.
__device__ __forceinline__ void griddep_wait()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel in the stream launch once every block of this grid has got here (or exited).
__device__ __forceinline__ void griddep_launch_dependents()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// -- keeping memory busy across a kernel boundary ---------------------------------------------------

// Ask L2 to fetch this block's share of [p, p + bytes): the next kernel's weights, so that DRAM keeps
// streaming through the launch gap. A hint only: nothing waits for it. bytes is a multiple of 16.
__device__ __forceinline__ void prefetch_l2(const char* p, unsigned long long bytes)
{
    if (p == nullptr || bytes == 0) return;
    const unsigned long long blocks = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    const unsigned long long block = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    const unsigned long long share = ((bytes + blocks - 1) / blocks + 255) / 256 * 256;
    const unsigned long long start = block * share;
    const unsigned long long end = start + share < bytes ? start + share : bytes;
    constexpr unsigned long long PIECE = 4096;
    const unsigned long long threads = (unsigned long long)blockDim.x * blockDim.y * blockDim.z;
    for (unsigned long long off = start + threadIdx.x * PIECE; off < end; off += threads * PIECE) {
        const unsigned int size = (unsigned int)(end - off < PIECE ? end - off : PIECE);
#if __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
#else
        for (unsigned int b = 0; b < size; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off + b));
#endif
    }
}
