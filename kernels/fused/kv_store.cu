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
 * Geometry: a grid-stride loop over the T * C elements of each of k and v.
 */
template <typename kv_t>
__global__ void __launch_bounds__(256)
kv_store(const kv_t* __restrict__ qkv, kv_t* __restrict__ k_cache, kv_t* __restrict__ v_cache, int T, int n_head,
         int head_size, int max_len)
{
    const int C = n_head * head_size;
    const long long total = (long long)T * C;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
        const long long t = i / C;
        const int c = (int)(i % C), h = c / head_size, d = c % head_size;
        const long long at = ((long long)h * max_len + t) * head_size + d;
        k_cache[at] = qkv[t * 3 * C + C + c];
        v_cache[at] = qkv[t * 3 * C + 2 * C + c];
    }
}
