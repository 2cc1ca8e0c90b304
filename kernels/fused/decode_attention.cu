/*
 * decode_attention - one query per head over a static KV cache, the keys split across blocks
 * (flash-decoding), the position read from device memory so that a CUDA graph can replay it.
 *
 * The operation, and what it replaces (gpt2/model.py attention() for one new token with a KVCache):
 *   k_pos, v_pos = the new token's key and value (columns C..3C of qkv), stored into the cache at pos
 *   y_h = softmax(q_h . K_h[0..pos] / sqrt(HS)) V_h[0..pos]        for every head h; y = (C,)
 * pos comes from state[1] (see lm_head_argmax.cu), so the key count T_k = pos + 1 changes every step
 * while the launch stays the same.
 *
 * Why it is shaped this way: with one query, each head is a matrix-vector product over its cached
 * keys and values, memory-bound like the linear layers; one block per head would put 12 SMs to
 * work. Instead block (s, h) takes keys [s * chunk, (s + 1) * chunk), chunk = ceil(T_k / S):
 *   S_j = q . k_j (8 lanes per key at HS = 64, each lane 8 elements: one 16-byte bf16 load or two
 *   float4), m = max S_j, p_j = exp(S_j - m), l = sum p_j, o = sum p_j v_j,
 * and writes (o, m, l) to `partial`; the last block of a head to finish (a ticket from counters[h],
 * reset to 0 by that block) combines the S partials: y = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
 * with M = max_s m_s. The combination runs in split order whichever block is last, so the result
 * does not depend on scheduling. Empty splits (T_k < S) contribute m = -inf, l = 0.
 * The key and value at pos are taken from qkv (rounded to the cache's dtype, exactly as they will
 * read back later) by every block, and stored into the cache by the block whose range holds pos:
 * no block reads a cache entry that another block of this launch writes.
 *
 * Under programmatic dependent launch the block starts while c_attn computes q; by then the
 * state and every cache row before pos are final (common.cuh), so the block copies its first
 * staged_rows keys and values to shared memory (cp.async) before griddep_wait(): the reads of the
 * cache leave the critical path, which then holds q, the new row, and the arithmetic. Rows past
 * staged_rows (a chunk longer than the shared memory the engine gives) are read after the wait.
 *
 * Template parameters: kv_t (float or bfloat16 bits), HS (head size; a multiple of 8 with HS / 8
 * dividing 32: 8 to 256), WARPS. Geometry: grid (S, NH), block WARPS * 32 (>= HS).
 * Shared memory: dynamic, cap = ceil(max_len / S) floats for the scores (rounded up to 16 bytes),
 * then staged_rows rows of K and of V (gpt2/fast/plan.py attention_staging: at GPT-2 small's
 * max_len 1024 and S = 11, cap = 94 and all 94 rows, 384 + 2 x 94 x 256 = 48,512 bytes in float32);
 * static WARPS * HS floats for the per-warp outputs. Loads from the cache past the staged rows are
 * read in groups of UNROLL per lane before use.
 * Caches are (NH, max_len, HS) for this layer; partial is (NH, S, HS + 2) floats.
 */
#include "common.cuh"

#define UNROLL 4
#define NEW 0     // row j == pos: the new token's, from qkv
#define STAGED 1  // a row copied to shared memory before griddep_wait()
#define CACHED 2  // a row read from the cache after it

// This lane's 8 elements of key or value row j: from qkv (j == pos: the new token's), from the rows
// staged in shared memory, or from the cache.
template <typename kv_t>
__device__ __forceinline__ void widen8(const uint4* raw, float (&v)[8]);
template <>
__device__ __forceinline__ void widen8<float>(const uint4* raw, float (&v)[8])
{
    const uint4 a = raw[0], b = raw[1];
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y); v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
}
template <>
__device__ __forceinline__ void widen8<bf16_bits>(const uint4* raw, float (&v)[8]) { unpack(raw[0], v); }

template <typename kv_t>
__device__ __forceinline__ void load8(const kv_t* staged_row, const kv_t* cache_row, const float* new_row, int where,
                                      float (&v)[8])
{
    constexpr int N = 8 * sizeof(kv_t) / 16;  // 16-byte vectors in 8 elements
    uint4 raw[N];
    if (where == NEW) {
        const float4 a = fresh(reinterpret_cast<const float4*>(new_row)), b = fresh(reinterpret_cast<const float4*>(new_row) + 1);
        const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = round_as<kv_t>(f[e]);  // as the cache will hold it
        return;
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
        raw[i] = where == STAGED ? reinterpret_cast<const uint4*>(staged_row)[i]
                                 : fresh(reinterpret_cast<const uint4*>(cache_row) + i);
    widen8<kv_t>(raw, v);
}

template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* scratch)
{
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) m = fmaxf(m, scratch[w]);
    __syncthreads();
    return m;
}

template <typename kv_t, int HS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, 1)
decode_attention(const float* __restrict__ qkv, kv_t* k_cache, kv_t* v_cache, const int* __restrict__ state,
                 int n_head, int max_len, int staged_rows, float scale, float* partial, unsigned int* counters,
                 float* __restrict__ y, const char* prefetch, unsigned long long prefetch_bytes)
{
    constexpr int THREADS = WARPS * 32;
    constexpr int LPK = HS / 8;         // lanes per key
    constexpr int KPW = 32 / LPK;       // keys per warp and pass
    constexpr int KPB = KPW * WARPS;    // keys per block and pass
    static_assert(HS % 8 == 0 && 32 % (HS / 8) == 0 && HS <= THREADS, "HS: a multiple of 8, HS / 8 divides 32");
    extern __shared__ __align__(16) float p_s[];  // S_j, then p_j, for this block's keys; then K, V rows
    __shared__ float scratch[WARPS];
    __shared__ __align__(16) float o_s[WARPS][HS];
    __shared__ bool is_last;

    prefetch_l2(prefetch, prefetch_bytes);

    // Before griddep_wait(): every kernel two or more launches back has completed (each decode kernel
    // lets the next one launch only once its own wait has returned), so the state (written by the
    // previous step's lm_head) and the cache rows before pos (earlier steps') are final. Copy this
    // block's first staged_rows of them to shared memory now, while c_attn computes q.
    const int S = gridDim.x, s = blockIdx.x, h = blockIdx.y;
    const int C = n_head * HS;
    const int pos = fresh(state + 1);
    const int T_k = pos + 1;
    const int chunk = (T_k + S - 1) / S;
    const int start = min(s * chunk, T_k), end = min(start + chunk, T_k);
    const long long head = (long long)h * max_len * HS;
    const int cap = (max_len + S - 1) / S;  // the longest chunk: p_s's length
    kv_t* k_s = reinterpret_cast<kv_t*>(p_s + (cap + 3) / 4 * 4);
    kv_t* v_s = k_s + (long long)staged_rows * HS;
    const int staged = max(0, min(min(end, pos) - start, staged_rows));  // rows [start, start + staged)
    {
        constexpr int VPR = HS * (int)sizeof(kv_t) / 16;  // 16-byte vectors per row
        for (int c = threadIdx.x; c < staged * VPR; c += THREADS) {
            const long long from = head + (long long)start * HS + c * (16 / (int)sizeof(kv_t));
            cp_async16(k_s + c * (16 / (int)sizeof(kv_t)), k_cache + from);
            cp_async16(v_s + c * (16 / (int)sizeof(kv_t)), v_cache + from);
        }
    }
    griddep_wait();  // qkv is c_attn's from here on
    griddep_launch_dependents();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPK;   // which of the warp's KPW keys
    const int part = lane % LPK;  // which 8 elements of it
    const float* k_new = qkv + C + h * HS;
    const float* v_new = qkv + 2 * C + h * HS;
    cp_async_wait_all();
    __syncthreads();  // every thread's copies have landed

    float q[8];
    {
        const float4* qp = reinterpret_cast<const float4*>(qkv + h * HS + part * 8);
        const float4 a = fresh(qp), b = fresh(qp + 1);
        q[0] = a.x * scale; q[1] = a.y * scale; q[2] = a.z * scale; q[3] = a.w * scale;
        q[4] = b.x * scale; q[5] = b.y * scale; q[6] = b.z * scale; q[7] = b.w * scale;
    }

    // S_j = q . k_j / sqrt(HS) for j in [start, end)
    for (int base = start + warp * KPW; base < end; base += KPB * UNROLL) {
        float k[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = base + u * KPB + sub;
            if (j < end)
                load8<kv_t>(k_s + (j - start) * HS + part * 8, k_cache + head + (long long)j * HS + part * 8,
                            k_new + part * 8, j == pos ? NEW : j - start < staged ? STAGED : CACHED, k[u]);
            else
#pragma unroll
                for (int e = 0; e < 8; ++e) k[u][e] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = base + u * KPB + sub;
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) d = fmaf(q[e], k[u][e], d);
#pragma unroll
            for (int o = LPK / 2; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
            if (part == 0 && j < end) p_s[j - start] = d;
        }
    }
    __syncthreads();

    // m = max S_j; p_j = exp(S_j - m); l = sum p_j
    const int n = end - start;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += THREADS) m = fmaxf(m, p_s[i]);
    m = block_max<THREADS>(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const float p = expf(p_s[i] - m);
        p_s[i] = p;
        l += p;
    }
    l = block_sum<THREADS>(l, scratch);  // its barriers also publish p_s

    // o = sum p_j v_j: lanes as above, each accumulating 8 elements over its keys
    float o[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int base = start + warp * KPW; base < end; base += KPB * UNROLL) {
        float v[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = base + u * KPB + sub;
            if (j < end)
                load8<kv_t>(v_s + (j - start) * HS + part * 8, v_cache + head + (long long)j * HS + part * 8,
                            v_new + part * 8, j == pos ? NEW : j - start < staged ? STAGED : CACHED, v[u]);
            else
#pragma unroll
                for (int e = 0; e < 8; ++e) v[u][e] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = base + u * KPB + sub;
            const float p = j < end ? p_s[j - start] : 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = fmaf(p, v[u][e], o[e]);
        }
    }
#pragma unroll
    for (int off = LPK; off < 32; off *= 2)  // sum over the warp's KPW keys
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] += __shfl_xor_sync(0xffffffffu, o[e], off);
    if (sub == 0)
#pragma unroll
        for (int e = 0; e < 8; ++e) o_s[warp][part * 8 + e] = o[e];

    // The new key and value into the cache, by the one block whose range holds pos.
    if (start <= pos && pos < end && threadIdx.x < HS) {
        store_as(k_cache + head + (long long)pos * HS + threadIdx.x, fresh(k_new + threadIdx.x));
        store_as(v_cache + head + (long long)pos * HS + threadIdx.x, fresh(v_new + threadIdx.x));
    }
    __syncthreads();

    float* mine = partial + ((long long)h * S + s) * (HS + 2);
    if (threadIdx.x < HS) {
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) acc += o_s[w][threadIdx.x];
        mine[threadIdx.x] = acc;
    }
    if (threadIdx.x == 0) {
        mine[HS] = m;
        mine[HS + 1] = l;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counters + h, 1u) == (unsigned int)S - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // The last block of head h: y_h = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
    if (threadIdx.x < HS) {
        const float* mine_h = partial + (long long)h * S * (HS + 2);
        float M = -INFINITY;
        for (int r = 0; r < S; ++r) M = fmaxf(M, __ldcg(mine_h + r * (HS + 2) + HS));
        float num = 0.0f, den = 0.0f;
        for (int r = 0; r < S; ++r) {
            const float* pr = mine_h + r * (HS + 2);
            const float weight = expf(__ldcg(pr + HS) - M);  // 0 for an empty split (m = -inf)
            num = fmaf(weight, __ldcg(pr + threadIdx.x), num);
            den = fmaf(weight, __ldcg(pr + HS + 1), den);
        }
        y[h * HS + threadIdx.x] = num / den;
    }
    if (threadIdx.x == 0) counters[h] = 0u;
}
