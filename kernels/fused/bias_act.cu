/*
 * bias_act - y = y + b, or gelu(y + b), in place over a (rows, N) matrix: the epilogue that cuBLAS
 * (the eager path's matrix products) leaves out.
 *
 * Replaces `x @ w + b` (the `+ b`) and `gelu(linear(...))` of gpt2/model.py for whole sequences:
 * GELU is the tanh form with 0.044715, as gelu() there.
 *
 * Template parameter: GELU. Geometry: a grid-stride loop over float4s; N % 4 == 0 (every GPT-2
 * width is), y 16-byte aligned.
 */
#include "common.cuh"

template <bool GELU>
__global__ void __launch_bounds__(256)
bias_act(float* __restrict__ y, const float* __restrict__ bias, int rows, int N)
{
    const long long total = (long long)rows * N / 4;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
        float4 v = reinterpret_cast<float4*>(y)[i];
        const float4 b = reinterpret_cast<const float4*>(bias)[(i * 4 % N) / 4];
        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
        if (GELU) { v.x = gelu_tanh(v.x); v.y = gelu_tanh(v.y); v.z = gelu_tanh(v.z); v.w = gelu_tanh(v.w); }
        reinterpret_cast<float4*>(y)[i] = v;
    }
}
