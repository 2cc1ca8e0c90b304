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
 *
 * Where C is a multiple of 4 (every GPT-2), each access moves 4 elements (16 bytes of float): a row of
 * GPT-2 XL is 400 vectors, 6 or 7 a thread of 64 (gpt2/fast/plan.py's LAYERNORM_THREADS), where an
 * element at a time took 7 accesses a thread of 256 and was a fifth slower on an H200. A thread adds
 * its 4 elements together first, so the statistics' order of addition is the vector path's own (a
 * last-place difference from the element path's); the residual x + (y + b) is the same in both.
 */
#include "common.cuh"

// V floats (V = 4: one 16-byte access; V = 1: a float) and V outputs, aligned as one access.
template <int V> struct alignas(4 * V) Floats { float v[V]; };
template <typename T, int V> struct alignas(sizeof(T) * V) Outs { T v[V]; };

template <int THREADS, int V, typename out_t>
__device__ __forceinline__ void add_layernorm_row(float* __restrict__ xr, const float* __restrict__ yr,
                                                  const float* __restrict__ y_bias, const float* __restrict__ ln_w,
                                                  const float* __restrict__ ln_b, float eps, out_t* __restrict__ outr,
                                                  int C, float* row, float* scratch)
{
    typedef Floats<V> F;
    const int n = C / V;
    F* row_v = reinterpret_cast<F*>(row);
    float s = 0.0f;
    for (int c = threadIdx.x; c < n; c += THREADS) {
        F v = reinterpret_cast<const F*>(xr)[c];
        if (yr != nullptr) {
            const F a = reinterpret_cast<const F*>(yr)[c], b = reinterpret_cast<const F*>(y_bias)[c];
#pragma unroll
            for (int i = 0; i < V; ++i) v.v[i] += a.v[i] + b.v[i];
            reinterpret_cast<F*>(xr)[c] = v;
        }
        row_v[c] = v;
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < V; ++i) t += v.v[i];
        s += t;
    }
    const float mean = block_sum<THREADS>(s, scratch) / C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < n; c += THREADS) {
        const F v = row_v[c];
#pragma unroll
        for (int i = 0; i < V; ++i) ss += (v.v[i] - mean) * (v.v[i] - mean);
    }
    const float rstd = 1.0f / sqrtf(block_sum<THREADS>(ss, scratch) / C + eps);
    for (int c = threadIdx.x; c < n; c += THREADS) {
        const F v = row_v[c], w = reinterpret_cast<const F*>(ln_w)[c], b = reinterpret_cast<const F*>(ln_b)[c];
        Outs<out_t, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) store_as(&o.v[i], (v.v[i] - mean) * rstd * w.v[i] + b.v[i]);
        reinterpret_cast<Outs<out_t, V>*>(outr)[c] = o;
    }
}

template <int THREADS, typename out_t>
__global__ void __launch_bounds__(THREADS)
add_layernorm(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ y_bias,
              const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps, out_t* __restrict__ out,
              int C)
{
    extern __shared__ float row[];
    __shared__ float scratch[THREADS / 32];
    const long long r = blockIdx.x;
    const float* yr = y != nullptr ? y + r * C : nullptr;
    if (C % 4 == 0)  // every row of every array on a 16-byte boundary (CuPy's allocations are 256-byte aligned)
        add_layernorm_row<THREADS, 4>(x + r * C, yr, y_bias, ln_w, ln_b, eps, out + r * C, C, row, scratch);
    else
        add_layernorm_row<THREADS, 1>(x + r * C, yr, y_bias, ln_w, ln_b, eps, out + r * C, C, row, scratch);
}
