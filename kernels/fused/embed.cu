/*
 * embed - token plus position embedding: x[t] = wte[ids[t]] + wpe[pos0 + t], in float32; the token's
 * row alone where wpe is null (Llama: positions enter through RoPE).
 *
 * Replaces `w["wte.weight"][idx] + w["wpe.weight"][start:start + T]` of gpt2/model.py forward(), and
 * `w["model.embed_tokens.weight"][idx]` of llama/model.py's.
 * pos0 is read from device memory (null means 0): the decode step passes ids = state (the token) and
 * pos0 = state + 1 (its position), so the launch needs no host arguments; the eager path passes the
 * token history and null.
 *
 * Template parameter: weight_t (float, or unsigned short holding bfloat16 bits).
 * Geometry: grid (T), block 256 threads striding over the C columns of row t.
 * Each block also asks L2 to prefetch its share of `prefetch` (the first layer's weights).
 */
#include "common.cuh"

template <typename weight_t>
__global__ void __launch_bounds__(256)
embed(const weight_t* __restrict__ wte, const weight_t* __restrict__ wpe, const int* __restrict__ ids,
      const int* __restrict__ pos0, int C, float* __restrict__ x, const char* prefetch,
      unsigned long long prefetch_bytes)
{
    prefetch_l2(prefetch, prefetch_bytes);
    griddep_wait();  // ids and pos0 (the decode step's state) are the previous step's from here on
    griddep_launch_dependents();
    const int t = blockIdx.x;
    const long long token = fresh(ids + t);
    const long long position = (pos0 != nullptr ? fresh(pos0) : 0) + t;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        x[(long long)t * C + c] = to_float(wte[token * C + c]) + (wpe != nullptr ? to_float(wpe[position * C + c]) : 0.0f);
}
