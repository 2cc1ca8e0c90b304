/*
 * gqa_decode_attention - one query per head over a static KV cache, grouped-query: a block per (key
 * split, key/value head) reads its keys and values once for all GROUP query heads that share them,
 * the position read from device memory so that a CUDA graph can replay the launch.
 *
 * The operation, and what it replaces (llama/model.py attention() for one new token with a KVCache,
 * the attention itself: q, k and v are projected, rotated and stored by rms_gemv_rope before it):
 *   y_h = softmax(q_h . K_g[0..pos] / sqrt(HS)) V_g[0..pos]    for each query head h, g = h / GROUP
 * (HF's repeat_kv: key/value head g serves query heads g * GROUP .. g * GROUP + GROUP - 1); y (NH * HS,),
 * the heads side by side. pos comes from state[1]: T_k = pos + 1 changes every step, the launch does not.
 *
 * The change against decode_attention.cu (GPT-2's, one block per (split, head)): the block takes a
 * key/value head and its whole group of query heads, so each key and value row is read from memory
 * once, not GROUP times, and a lane's 8 elements of a row feed GROUP dot products; the new token's key
 * and value are already in the cache (written by the projection before this kernel), so every row is
 * read from the cache.
 *
 * Why it is shaped this way: with one query a head is a matrix-vector product over its cached rows,
 * memory- and latency-bound; 8 key/value heads would put 8 SMs to work, so the keys are split across
 * S blocks (flash-decoding): block (s, g) takes keys [s * chunk, (s + 1) * chunk), chunk = ceil(T_k / used),
 * where only used = min(S, ceil(T_k / split_keys)) of the launch's S splits take keys, split_keys
 * (>= ceil(max_len / S)) being the most a split takes: the rest return at once, and where one split
 * takes every key it writes y itself, with no partials and no combine (every split more adds a partial
 * result to wait for and combine, a chain of round trips through L2),
 *   S_jt = q_j . k_t / sqrt(HS) (HS / 8 lanes per key, each lane 8 elements: one 16-byte bf16 load or
 *   two float4), m_j = max_t S_jt, p_jt = exp(S_jt - m_j), l_j = sum_t p_jt, o_j = sum_t p_jt v_t
 * for the group's heads j, in one pass a warp (below), and writes (o_j, m_j, l_j) to `partial`; the
 * last block of the key/value head to finish (a ticket from counters[g], reset to 0 by that block)
 * combines the used partials of each of its heads: y_h = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s,
 * M = max_s m_s, in split order whichever block is last, so the result does not depend on scheduling.
 * Empty splits contribute m = -inf, l = 0. The combine is a chain of loads from L2 on the step's
 * critical path, so it runs a warp per head with the splits across the lanes (M and the denominator by
 * shuffles), and each lane's loads of o_s, one per split, do not wait for each other: with a thread per
 * element looping over the splits, M's loads and then each split's were one L2 round trip after another.
 *
 * Under programmatic dependent launch the block starts while the projection runs; by then the state
 * and every cache row before pos are final (common.cuh's rule: written two or more launches back), so
 * the block copies its first staged_rows keys and values before pos to shared memory (cp.async)
 * before griddep_wait(). Row pos, and rows past the staged ones, are read from the cache after it,
 * through L2 (fresh()).
 *
 * The combine's loads all go out at once where at most COMBINE_SPLITS splits are in use (the plan's
 * 16 splits, on caches up to 32,768 positions): a lane's split's m and l and its elements of every
 * split's o, before the first shuffle, where loading M's inputs, then m and l again, then the o's were
 * three round trips through L2 after the ticket. The same operations in the same order on the same values, so y's bits
 * did not change (a GPU test compares the logits). On an H200 (tools/llama_step_variants.py, graph
 * replay, two rounds, as a template flag) a token took 0.960-0.977x the time of the three-trip combine
 * at Llama 3.2 1B, 0.977-0.984x at 3B, 0.988-0.993x at 3.1 8B, positions 40 to 1,000; the trees before
 * and after over 256 tokens (tools/decode_before_after.sh) 1.022x, 1.013x and 0.998x the tokens/s. Null:
 * copying row pos to shared memory beside q's loads (the score and value loops then read it from L2
 * after q): 0.999-1.009x.
 *
 * One pass a warp: the warps split the split's keys (key base + u * KPB + sub, UNROLL keys a lane a
 * step, the K and V rows of a key loaded together), and each takes its keys' scores, softmax and values
 * at once with its own running max mw_j and sum lw_j (flash attention's rescaling by e^(m_old - m_new),
 * inside a warp); the block's m_j = max_w mw_j and the warps' lw_j and o_j scaled by e^(mw_j - m_j) are
 * summed at the end: two block barriers in all. Before it, the split's scores went to shared memory,
 * the block's max and sum were two block reductions (four barriers), then a second loop read the values:
 * on an H200 (tools/attention_trace.py) those three phases took 2.9-3.5 us after the wait at Llama 3.2 1B
 * of a layer's 5.2-7.7 us from its projection's end to its y. Against that, as a template flag
 * (tools/llama_step_variants.py, graph replay, two rounds, positions 40 / 260 in a 512-position cache,
 * 1000 in 2,048, the time a token): with the warps that take a split's keys in one step each (llama/fast/
 * plan.py attention_warps) 1B 0.977 / 0.979x at 512 (8 warps), 3B 0.982 / 0.988x and 3.1 8B 0.991 /
 * 0.993x (16 warps), 0.995-1.002x at 2,048; 4 keys a lane (168 registers, 4 warps only) no faster.
 * The trees before and after over 256 tokens (tools/decode_before_after.sh): 1.022x, 1.019x and
 * 1.010x the tokens/s; the critical path above became 3.6-7.6 us at 1B (tools/attention_trace.py).
 *
 * CLUSTER (sm_90; off in the plan, a measured null): the S splits of a key/value head are launched as
 * one thread-block cluster (the launch's cluster dimension (S, 1, 1), S <= 16, beyond 8 by opting in),
 * so rank s is split s. Each split stores (o_j, m_j, l_j) into the shared memory of rank 0 (mapa,
 * st.shared::cluster) and arrives at the cluster barrier (release); rank 0 waits (acquire) and combines
 * from its own shared memory with the ticket's arithmetic in the ticket's order, so y has the same bits:
 * no partial in L2, no fence, no ticket. Every block arrives once (relaxed) as it starts and waits before
 * its first remote store, so that rank 0's shared memory exists; blocks past `used` exit at once, which
 * the barrier allows (it waits for the cluster's non-exited threads). On an H200 it was no faster
 * (llama/fast/plan.py ATTENTION_CLUSTER has the figures): the ticket's round trips are not what the
 * attention's time in the step is made of.
 *
 * TRACE (a diagnostic build, tools/attention_trace.py): thread 0 of each block records the global timer
 * into trace (gridDim.y x gridDim.x x TRACE_MARKS, may be null without TRACE) at 0 its start (mark 0
 * zeroes the rest: a mark not reached reads 0), 1 its wait's end (the projection has completed), 2 q
 * and the staged rows in hand, 3 warp 0's pass done, 4 every warp's, 5 the warps combined, 6 its
 * partial stored (with the ticket drawn; y stored where it is the only split), 7 the combine's end (the
 * combining block).
 * Without it the kernel is the same instructions (a CPU test compares the PTX).
 *
 * Template parameters: kv_t (float or bfloat16 bits), HS (head size; a multiple of 8 with HS / 8
 * dividing 32: 8 to 256), GROUP (query heads per key/value head), WARPS, CLUSTER, TRACE.
 * Geometry: grid (S, NKV), block WARPS * 32; with CLUSTER, clusters of (S, 1, 1). Shared memory:
 * dynamic, staged_rows rows of K and of V (llama/fast/plan.py attention_plan), then with CLUSTER S x
 * GROUP rows of HS + 2 floats (rank 0's partials); static WARPS x GROUP x HS floats for the per-warp
 * outputs. Register use: GROUP x 8 of q and of o and UNROLL x 8 of K and of V per lane. Caches are
 * (NKV, max_len, HS) for this layer; q is (NH * HS,) float32, not yet scaled; partial is (NH, S, HS + 2)
 * floats.
 */
#include "common.cuh"

#define UNROLL 2  // keys a lane whose K and V rows are loaded before their use (4: no faster, 168 registers)
#define COMBINE_SPLITS 16  // splits whose o the combine loads at once: one round trip through L2

// Widen 8 elements held in 16-byte vectors: two vectors of float, one of bfloat16 bits.
__device__ __forceinline__ void widen8(const uint4* raw, float (&v)[8], float)
{
    const uint4 a = raw[0], b = raw[1];
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y); v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
}
__device__ __forceinline__ void widen8(const uint4* raw, float (&v)[8], bf16_bits) { unpack(raw[0], v); }

// This lane's 8 elements of a row: from shared memory (staged) or from the cache through L2.
template <typename kv_t>
__device__ __forceinline__ void read8(const kv_t* p, bool staged, float (&v)[8])
{
    constexpr int N = 8 * sizeof(kv_t) / 16;  // 16-byte vectors in 8 elements
    uint4 raw[N];
#pragma unroll
    for (int i = 0; i < N; ++i)
        raw[i] = staged ? reinterpret_cast<const uint4*>(p)[i] : fresh(reinterpret_cast<const uint4*>(p) + i);
    widen8(raw, v, kv_t{});
}

// -- the cluster's combine (sm_90): distributed shared memory and the cluster barrier ---------------

// The barrier in two halves, the forms without .aligned: arrive.relaxed orders nothing (it says "this
// block runs"); arrive (release) then wait (acquire) makes every store before the arrive visible after
// the wait. Each waits for the cluster's non-exited threads only, so blocks may return early.
__device__ __forceinline__ void cluster_arrive_relaxed()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// p's place in the shared memory of the cluster's block `rank`, and a float stored there.
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank)
{
    unsigned a = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
#endif
    return a;
}
__device__ __forceinline__ void store_cluster(unsigned a, float x)
{
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(x) : "memory");
#endif
}

// -- the trace (TRACE: a diagnostic build, tools/attention_trace.py) ---------------------------------

#define TRACE_MARKS 8  // global-timer marks a block: see the header

// Thread 0 records the global timer as mark `which` of its block in trace (gridDim.y x gridDim.x x
// TRACE_MARKS); mark 0, at the start, zeroes the others, so a mark the block does not reach reads 0.
template <bool TRACE>
__device__ __forceinline__ void mark(unsigned long long* trace, int which)
{
    if constexpr (TRACE) {
        if (threadIdx.x != 0) return;
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        unsigned long long* mine = trace + ((long long)blockIdx.y * gridDim.x + blockIdx.x) * TRACE_MARKS;
        mine[which] = now;
        if (which == 0)
            for (int i = 1; i < TRACE_MARKS; ++i) mine[i] = 0ull;
    }
}

template <typename kv_t, int HS, int GROUP, int WARPS, bool CLUSTER, bool TRACE>
__global__ void __launch_bounds__(WARPS * 32)
gqa_decode_attention(const float* __restrict__ q, const kv_t* __restrict__ k_cache, const kv_t* __restrict__ v_cache,
                     const int* __restrict__ state, int max_len, int split_keys, int staged_rows, float scale,
                     float* partial,
                     unsigned int* counters, float* __restrict__ y, const char* prefetch,
                     unsigned long long prefetch_bytes, unsigned long long* trace)
{
    constexpr int THREADS = WARPS * 32;
    constexpr int LPK = HS / 8;       // lanes per key
    constexpr int KPW = 32 / LPK;     // keys per warp and pass
    constexpr int KPB = KPW * WARPS;  // keys per block and pass
    constexpr int EPV = 16 / (int)sizeof(kv_t);  // elements per 16-byte vector
    static_assert(HS % 8 == 0 && 32 % (HS / 8) == 0, "HS: a multiple of 8, HS / 8 divides 32");
    extern __shared__ __align__(16) float rows_s[];  // staged_rows K rows, as many V rows, CLUSTER's partials
    __shared__ float m_w[WARPS][GROUP], l_w[WARPS][GROUP];  // each warp's max and sum for each head
    __shared__ __align__(16) float o_s[WARPS][GROUP][HS];
    __shared__ bool is_last;

    mark<TRACE>(trace, 0);  // the block runs (under programmatic dependent launch: before the wait)
    prefetch_l2(prefetch, prefetch_bytes);

    // Before griddep_wait(): the state and the cache rows before pos are final (see the header).
    const int S = gridDim.x, s = blockIdx.x, g = blockIdx.y;
    const int pos = fresh(state + 1);
    const int T_k = pos + 1;
    const int used = min(S, (T_k + split_keys - 1) / split_keys);  // splits in use
    if (s >= used) return;  // nothing to read: the splits before it take the T_k keys
    if constexpr (CLUSTER) cluster_arrive_relaxed();  // this block runs: its shared memory exists
    const int chunk = (T_k + used - 1) / used;  // <= split_keys (split_keys >= ceil(max_len / S))
    const int start = min(s * chunk, T_k), end = min(start + chunk, T_k);
    const long long head = (long long)g * max_len * HS;  // this key/value head's rows
    kv_t* k_s = reinterpret_cast<kv_t*>(rows_s);
    kv_t* v_s = k_s + (long long)staged_rows * HS;
    const int staged = max(0, min(min(end, pos) - start, staged_rows));  // rows [start, start + staged)
    for (int c = threadIdx.x; c < staged * HS / EPV; c += THREADS) {
        const long long from = head + (long long)start * HS + c * EPV;
        cp_async16(k_s + c * EPV, k_cache + from);
        cp_async16(v_s + c * EPV, v_cache + from);
    }
    griddep_wait();  // q and the cache's row pos are the projection's from here on
    mark<TRACE>(trace, 1);  // the projection has completed
    griddep_launch_dependents();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPK;   // which of the warp's KPW keys
    const int part = lane % LPK;  // which 8 elements of it
    float qr[GROUP][8];
#pragma unroll
    for (int j = 0; j < GROUP; ++j) {
        const float4* qp = reinterpret_cast<const float4*>(q + (g * GROUP + j) * HS + part * 8);
        const float4 a = fresh(qp), b = fresh(qp + 1);
        qr[j][0] = a.x * scale; qr[j][1] = a.y * scale; qr[j][2] = a.z * scale; qr[j][3] = a.w * scale;
        qr[j][4] = b.x * scale; qr[j][5] = b.y * scale; qr[j][6] = b.z * scale; qr[j][7] = b.w * scale;
    }
    cp_async_wait_all();
    __syncthreads();  // every thread's copies have landed
    mark<TRACE>(trace, 2);  // q in registers, the staged rows in shared memory

    // Each warp its own keys in one pass (key base + u * KPB + sub of each step): their K and V rows
    // loaded together, S_jt, then the warp's running max mw_j and sum lw_j, lw_j and o_j rescaled by
    // e^(m_old - m_new) where the max grows. No scores in shared memory, no block barrier until the end.
    float mw[GROUP], lw[GROUP], o[GROUP][8];  // the warp's max and sum; this lane's part of the warp's o_j
#pragma unroll
    for (int j = 0; j < GROUP; ++j) {
        mw[j] = -INFINITY, lw[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[j][e] = 0.0f;
    }
    for (int base = start + warp * KPW; base < end; base += KPB * UNROLL) {
        float k[UNROLL][8], v[UNROLL][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = base + u * KPB + sub;
            if (t < end) {
                const bool in_smem = t - start < staged;
                const long long at = in_smem ? (long long)(t - start) * HS : head + (long long)t * HS;
                read8<kv_t>((in_smem ? k_s : k_cache) + at + part * 8, in_smem, k[u]);
                read8<kv_t>((in_smem ? v_s : v_cache) + at + part * 8, in_smem, v[u]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) k[u][e] = v[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            float sc[UNROLL], mx = -INFINITY;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qr[j][e], k[u][e], d);
#pragma unroll
                for (int off = LPK / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
                sc[u] = base + u * KPB + sub < end ? d : -INFINITY;
                mx = fmaxf(mx, sc[u]);
            }
#pragma unroll
            for (int off = LPK; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(mw[j], mx);  // finite: key base (sub 0, u 0) is < end
            const float c = expf(mw[j] - m_new);    // 0 on the warp's first pass
            lw[j] *= c;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[j][e] *= c;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float p = expf(sc[u] - m_new);  // 0 past the end
                lw[j] += p;
#pragma unroll
                for (int e = 0; e < 8; ++e) o[j][e] = fmaf(p, v[u][e], o[j][e]);
            }
            mw[j] = m_new;
        }
    }
#pragma unroll
    for (int off = LPK; off < 32; off *= 2)  // sum over the warp's KPW keys (a key's lanes hold the same p)
#pragma unroll
        for (int j = 0; j < GROUP; ++j) lw[j] += __shfl_xor_sync(0xffffffffu, lw[j], off);
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < GROUP; ++j) m_w[warp][j] = mw[j];
    mark<TRACE>(trace, 3);  // warp 0's pass
    __syncthreads();
    mark<TRACE>(trace, 4);  // every warp's pass
    // The warps combined: m_j = max_w mw_j; each warp's lw_j and o_j times e^(mw_j - m_j), summed below.
    float m[GROUP], l[GROUP];  // the block's
#pragma unroll
    for (int j = 0; j < GROUP; ++j) {
        m[j] = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m[j] = fmaxf(m[j], m_w[w][j]);
        const float c = mw[j] == -INFINITY ? 0.0f : expf(mw[j] - m[j]);  // 0 for a warp without keys
        lw[j] *= c;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[j][e] *= c;
    }
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < GROUP; ++j) l_w[warp][j] = lw[j];
#pragma unroll
    for (int off = LPK; off < 32; off *= 2)  // sum over the warp's KPW keys
#pragma unroll
        for (int j = 0; j < GROUP; ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) o[j][e] += __shfl_xor_sync(0xffffffffu, o[j][e], off);
    if (sub == 0)
#pragma unroll
        for (int j = 0; j < GROUP; ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e) o_s[warp][j][part * 8 + e] = o[j][e];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < GROUP; ++j) {  // in warp order in every thread
        l[j] = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) l[j] += l_w[w][j];
    }
    mark<TRACE>(trace, 5);  // the warps combined: o_j in o_s (summed over the warps below), l_j

    if (used == 1) {  // the only split: y_j = o_j / l_j, what the combine below gives for one split
#pragma unroll
        for (int j = 0; j < GROUP; ++j)  // l[j] by a constant index: l stays in registers
            for (int d = threadIdx.x; d < HS; d += THREADS) {
                float acc = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) acc += o_s[w][j][d];
                y[(g * GROUP + j) * HS + d] = acc / l[j];
            }
        mark<TRACE>(trace, 6);  // y stored
        return;
    }

    if constexpr (CLUSTER) {  // the key/value head's splits are one cluster: rank s is split s
        // This split's (o_j, m_j, l_j) into rank 0's shared memory (S x GROUP rows of HS + 2 floats past
        // the staged rows), one barrier, then rank 0 combines them there: no ticket, no round trip to L2.
        float* merge = reinterpret_cast<float*>(v_s + (long long)staged_rows * HS);
        cluster_wait();  // every block of the cluster has arrived once: rank 0's shared memory exists
        const unsigned mine = cluster_address(merge + s * GROUP * (HS + 2), 0);
        for (int i = threadIdx.x; i < GROUP * HS; i += THREADS) {
            const int j = i / HS, d = i % HS;
            float acc = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) acc += o_s[w][j][d];
            store_cluster(mine + 4 * (j * (HS + 2) + d), acc);
        }
#pragma unroll
        for (int j = 0; j < GROUP; ++j)
            if (threadIdx.x == j) {
                store_cluster(mine + 4 * (j * (HS + 2) + HS), m[j]);
                store_cluster(mine + 4 * (j * (HS + 2) + HS + 1), l[j]);
            }
        cluster_arrive();  // release: the stores above
        mark<TRACE>(trace, 6);  // the partial stored
        if (s != 0) return;  // nobody reads this block's shared memory
        cluster_wait();  // acquire: the used splits' partials are in merge
        // y_h = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, M = max_s m_s: a thread an element of the
        // group's heads, each its head's M and denominator. The ticket's arithmetic in the ticket's order
        // (the numerator in split order, the denominator in its shuffles' tree; S <= COMBINE_SPLITS), so
        // y has the same bits either way.
        for (int i = threadIdx.x; i < GROUP * HS; i += THREADS) {
            const int j = i / HS, d = i % HS;
            float M = -INFINITY;
            for (int r = 0; r < used; ++r) M = fmaxf(M, merge[(r * GROUP + j) * (HS + 2) + HS]);
            float num = 0.0f;
            for (int r = 0; r < used; ++r) {  // in split order
                const float* pr = merge + (r * GROUP + j) * (HS + 2);
                num = fmaf(expf(pr[HS] - M), pr[d], num);
            }
            auto t = [&](int r) {  // e^(m_r - M) l_r, 0 past the splits in use: the ticket's lane r
                const float* pr = merge + (r * GROUP + j) * (HS + 2);
                return r < used ? fmaf(expf(pr[HS] - M), pr[HS + 1], 0.0f) : 0.0f;
            };
            static_assert(COMBINE_SPLITS == 16, "the ticket's shuffles by 16 (lanes past 16 add 0), 8, 4, 2, 1");
            const float den = (((t(0) + t(8)) + (t(4) + t(12))) + ((t(2) + t(10)) + (t(6) + t(14)))) +
                              (((t(1) + t(9)) + (t(5) + t(13))) + ((t(3) + t(11)) + (t(7) + t(15))));
            y[(g * GROUP + j) * HS + d] = num / den;
        }
        mark<TRACE>(trace, 7);  // y combined and stored
        return;
    }

    // This split's (o_j, m_j, l_j) for each head of the group, then a ticket per key/value head.
    for (int i = threadIdx.x; i < GROUP * HS; i += THREADS) {
        const int j = i / HS, d = i % HS;
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) acc += o_s[w][j][d];
        partial[((long long)(g * GROUP + j) * S + s) * (HS + 2) + d] = acc;
    }
#pragma unroll
    for (int j = 0; j < GROUP; ++j)
        if (threadIdx.x == j) {
            float* mine = partial + ((long long)(g * GROUP + j) * S + s) * (HS + 2);
            mine[HS] = m[j];
            mine[HS + 1] = l[j];
        }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counters + g, 1u) == (unsigned int)used - 1;
    __syncthreads();
    mark<TRACE>(trace, 6);  // the partial stored, the ticket drawn
    if (!is_last) return;
    __threadfence();

    // The last block of key/value head g, warps per head h of the group: M = max_s m_s and
    // den = sum_s e^(m_s - M) l_s across the lanes (split s in lane s % 32), then
    // y_h = sum_s e^(m_s - M) o_s / den, each lane its elements of y_h over the splits in split order,
    // every split's weight broadcast from its lane: the loads of o_s do not wait on each other.
    constexpr int PER_LANE = (HS + 31) / 32;  // elements of y_h a lane computes: lane, lane + 32, ...
    if (used <= COMBINE_SPLITS) {  // every load first, then the same arithmetic as the loop below
        // WPH warps a head, each SPAN elements of y_h: with more warps than heads, fewer of o a lane
        // (4 x 16 floats at head size 128 with a warp a head spilled in float32, 8 warps, group 4)
        constexpr int WPH = WARPS / GROUP > 0 ? WARPS / GROUP : 1;
        constexpr int SPAN = (HS + WPH - 1) / WPH, PER = (SPAN + 31) / 32;
        for (int wj = warp; wj < GROUP * WPH; wj += WARPS) {
            const int h = g * GROUP + wj / WPH, first = wj % WPH * SPAN;
            const float* mine_h = partial + (long long)h * S * (HS + 2);
            const float m_r = lane < used ? __ldcg(mine_h + lane * (HS + 2) + HS) : -INFINITY;
            const float l_r = lane < used ? __ldcg(mine_h + lane * (HS + 2) + HS + 1) : 0.0f;
            float o_i[COMBINE_SPLITS][PER];
#pragma unroll
            for (int i = 0; i < COMBINE_SPLITS; ++i)
#pragma unroll
                for (int e = 0; e < PER; ++e) {
                    const int d = first + lane + 32 * e;
                    o_i[i][e] = i < used && lane + 32 * e < SPAN && d < HS ? __ldcg(mine_h + i * (HS + 2) + d) : 0.0f;
                }
            float M = m_r;
#pragma unroll
            for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
            const float weight = lane < used ? expf(m_r - M) : 0.0f;
            float den = fmaf(expf(m_r - M), l_r, 0.0f);  // 0 past the splits in use (m = -inf, l = 0)
#pragma unroll
            for (int o = 16; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffffu, den, o);
            float num[PER];
#pragma unroll
            for (int e = 0; e < PER; ++e) num[e] = 0.0f;
#pragma unroll
            for (int i = 0; i < COMBINE_SPLITS; ++i) {
                if (i < used) {  // the same in every lane
                    const float w_i = __shfl_sync(0xffffffffu, weight, i);
#pragma unroll
                    for (int e = 0; e < PER; ++e) num[e] = fmaf(w_i, o_i[i][e], num[e]);
                }
            }
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                const int d = first + lane + 32 * e;
                if (lane + 32 * e < SPAN && d < HS) y[h * HS + d] = num[e] / den;
            }
        }
        if (threadIdx.x == 0) counters[g] = 0u;
        mark<TRACE>(trace, 7);  // y combined and stored
        return;
    }
    for (int j = warp; j < GROUP; j += WARPS) {
        const int h = g * GROUP + j;
        const float* mine_h = partial + (long long)h * S * (HS + 2);
        float M = -INFINITY;
        for (int r = lane; r < used; r += 32) M = fmaxf(M, __ldcg(mine_h + r * (HS + 2) + HS));
#pragma unroll
        for (int o = 16; o > 0; o /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float den = 0.0f;
        for (int r = lane; r < used; r += 32) {
            const float* pr = mine_h + r * (HS + 2);
            den = fmaf(expf(__ldcg(pr + HS) - M), __ldcg(pr + HS + 1), den);  // 0 for an empty split (m = -inf)
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffffu, den, o);
        float num[PER_LANE];
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) num[e] = 0.0f;
        for (int base = 0; base < used; base += 32) {
            const int r = base + lane;
            const float weight = r < used ? expf(__ldcg(mine_h + r * (HS + 2) + HS) - M) : 0.0f;
            const int n = min(32, used - base);
#pragma unroll 4
            for (int i = 0; i < n; ++i) {
                const float w_i = __shfl_sync(0xffffffffu, weight, i);
                const float* pr = mine_h + (base + i) * (HS + 2);
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e)
                    if (lane + 32 * e < HS) num[e] = fmaf(w_i, __ldcg(pr + lane + 32 * e), num[e]);
            }
        }
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e)
            if (lane + 32 * e < HS) y[h * HS + lane + 32 * e] = num[e] / den;
    }
    if (threadIdx.x == 0) counters[g] = 0u;
    mark<TRACE>(trace, 7);  // y combined and stored
}
