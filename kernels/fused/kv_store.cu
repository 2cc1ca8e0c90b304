/*
 * kv_store - a prefill's keys and values into the static cache, in the cache's dtype.
 *
 * qkv is the (T, 3C) projection of T tokens at positions 0..T-1 (columns [q | k | v], each NH heads of
 * HS); the cache of one layer is (NH, max_len, HS). Replaces KVCache.append of gpt2/model.py for the
 * fast engine, whose cache has a fixed shape so that the decode step can be captured once.
 *
 * Template parameter: kv_t (float, or unsigned short holding bfloat16 bits), the dtype of the run: of
 * the projection qkv as of the cache (a bfloat16 run's projection is bfloat16 already), so an element
 * is copied as it is.
 * Geometry: a block a row of qkv (a grid-stride loop over the T rows), its threads over the row's C
 * columns of k and of v: 16 bytes a thread at a time (Vec16) where a head's HS elements are whole
 * vectors and the arrays start on a 16-byte boundary (every GPT-2 size), else one element. A copy is
 * a bandwidth question: 16-byte accesses keep enough bytes in flight per SM, where one 2-byte access
 * a thread left the prefill's copy at under half the bandwidth.
 */
#include "common.cuh"

template <typename kv_t>
__global__ void __launch_bounds__(256)
kv_store(const kv_t* __restrict__ qkv, kv_t* __restrict__ k_cache, kv_t* __restrict__ v_cache, int T, int n_head,
         int head_size, int max_len)
{
    const int C = n_head * head_size;
    const bool wide = head_size % Vec16<kv_t>::N == 0 && aligned16(qkv) && aligned16(k_cache) && aligned16(v_cache);
    const int step = wide ? Vec16<kv_t>::N : 1;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const kv_t* row = qkv + (long long)t * 3 * C;
        for (int c = threadIdx.x * step; c < C; c += blockDim.x * step) {
            const int h = c / head_size, d = c % head_size;
            const long long at = ((long long)h * max_len + t) * head_size + d;
            if (wide) {
                move16(k_cache + at, row + C + c);
                move16(v_cache + at, row + 2 * C + c);
            } else {
                k_cache[at] = row[C + c];
                v_cache[at] = row[2 * C + c];
            }
        }
    }
}
