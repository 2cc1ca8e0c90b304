/*
 * bias_act - y = y + b, or gelu(y + b), in place over a (rows, N) matrix: the epilogue that cuBLAS
 * (the eager path's matrix products) leaves out.
 *
 * Replaces `x @ w + b` (the `+ b`) and `gelu(linear(...))` of gpt2/model.py for whole sequences:
 * GELU is the tanh form with 0.044715, as gelu() there. In bfloat16 (the product's output as cuBLAS
 * wrote it), y + b is rounded to bfloat16 before GELU and the result rounded again, as the eager
 * model's `linear` output (in the weights' dtype) and its float32 GELU are.
 *
 * Template parameters: GELU; T, float or bfloat16 bits (unsigned short). Geometry: a grid-stride loop
 * over groups of 16 bytes (4 floats, or 8 bfloat16 where N % 8 == 0 and y lies on a 16-byte boundary:
 * every GPT-2 width), else of 4 elements (8 bytes of bfloat16); N % 4 == 0 (every GPT-2 width is), y
 * aligned to a group. The group is the bandwidth's question: at 8 bytes a thread the prefill's MLP
 * epilogue ran at about half of it.
 */
#include "common.cuh"

__device__ __forceinline__ void load4(const float* p, float (&v)[4])
{
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
}

__device__ __forceinline__ void load4(const bf16_bits* p, float (&v)[4])
{
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v[0] = bf16_to_float(u.x & 0xffffu); v[1] = bf16_to_float(u.x >> 16);
    v[2] = bf16_to_float(u.y & 0xffffu); v[3] = bf16_to_float(u.y >> 16);
}

__device__ __forceinline__ void store4(float* p, const float (&v)[4])
{
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void store4(bf16_bits* p, const float (&v)[4])
{
    uint2 u;
    u.x = float_to_bf16(v[0]) | ((unsigned int)float_to_bf16(v[1]) << 16);
    u.y = float_to_bf16(v[2]) | ((unsigned int)float_to_bf16(v[3]) << 16);
    *reinterpret_cast<uint2*>(p) = u;
}

__device__ __forceinline__ void store8(bf16_bits* p, const float (&v)[8])
{
    uint4 u;
    u.x = float_to_bf16(v[0]) | ((unsigned int)float_to_bf16(v[1]) << 16);
    u.y = float_to_bf16(v[2]) | ((unsigned int)float_to_bf16(v[3]) << 16);
    u.z = float_to_bf16(v[4]) | ((unsigned int)float_to_bf16(v[5]) << 16);
    u.w = float_to_bf16(v[6]) | ((unsigned int)float_to_bf16(v[7]) << 16);
    *reinterpret_cast<uint4*>(p) = u;
}

__device__ __forceinline__ void store8(float*, const float (&)[8]) {}  // never called: float takes the 4-group loop

// y[0..G) += bias[0..G), then GELU (after rounding to T, as the eager model's linear output) where asked.
template <bool GELU, typename T, int G>
__device__ __forceinline__ void add_bias(float (&v)[G], const float* bias)
{
#pragma unroll
    for (int j = 0; j < G; j += 4) {
        const float4 b = *reinterpret_cast<const float4*>(bias + j);
        v[j] += b.x; v[j + 1] += b.y; v[j + 2] += b.z; v[j + 3] += b.w;
    }
    if (GELU) {
#pragma unroll
        for (int j = 0; j < G; ++j) v[j] = gelu_tanh(round_as<T>(v[j]));
    }
}

template <bool GELU, typename T>
__global__ void __launch_bounds__(256)
bias_act(T* __restrict__ y, const float* __restrict__ bias, int rows, int N)
{
    if (sizeof(T) == 2 && N % 8 == 0 && aligned16(y)) {  // 8 bfloat16: one 16-byte load and store
        const long long total = (long long)rows * N / 8;
        for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
            float v[8];
            unpack(*reinterpret_cast<const uint4*>(y + 8 * i), v);
            add_bias<GELU, T, 8>(v, bias + i * 8 % N);
            store8(y + 8 * i, v);
        }
        return;
    }
    const long long total = (long long)rows * N / 4;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
        float v[4];
        load4(y + 4 * i, v);
        add_bias<GELU, T, 4>(v, bias + i * 4 % N);
        store4(y + 4 * i, v);
    }
}
