/*
 * add_layernorm - the residual add and the LayerNorm that follows it, one pass over each row:
 *   x[r] += y[r] + y_bias      (when y is not null; x is written back: it is the residual stream)
 *   out[r] = LN(x[r]) * ln_w + ln_b
 *
 * Replaces, in gpt2/model.py forward() over a whole sequence, `x = x + linear(...)` followed by
 * `layer_norm(x, ...)` (five or more CuPy element-wise kernels and two reductions). The linear layer
 * before it leaves out its bias (cuBLAS writes y = h @ W), so the bias is added here:
 * x + (y + b) is the association of the eager model. Statistics as GPT-2's LayerNorm: float32,
 * two passes over the row held in shared memory (mean, then the centred sum of squares), biased
 * variance, eps inside the square root.
 *
 * Template parameters: THREADS (the block size); out_t, float or bfloat16 bits (unsigned short: a
 * bfloat16 run's next product takes its operand so, rounded to nearest even once). Geometry: grid
 * (rows), block THREADS; dynamic shared memory C floats. Limits: none on C beyond shared memory (C * 4
 * bytes per block).
 */
#include "common.cuh"

template <int THREADS, typename out_t>
__global__ void __launch_bounds__(THREADS)
add_layernorm(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ y_bias,
              const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps, out_t* __restrict__ out,
              int C)
{
    extern __shared__ float row[];
    __shared__ float scratch[THREADS / 32];
    const long long r = blockIdx.x;
    float* xr = x + r * C;
    for (int c = threadIdx.x; c < C; c += THREADS) {
        float v = xr[c];
        if (y != nullptr) {
            v += y[r * C + c] + y_bias[c];
            xr[c] = v;
        }
        row[c] = v;
    }
    __syncthreads();
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += THREADS) s += row[c];
    const float mean = block_sum<THREADS>(s, scratch) / C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += THREADS) {
        const float d = row[c] - mean;
        ss += d * d;
    }
    const float rstd = 1.0f / sqrtf(block_sum<THREADS>(ss, scratch) / C + eps);
    for (int c = threadIdx.x; c < C; c += THREADS) store_as(out + r * C + c, (row[c] - mean) * rstd * ln_w[c] + ln_b[c]);
}
