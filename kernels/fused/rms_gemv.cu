/*
 * rms_gemv - one matrix of a Llama decode step, streamed at the speed of memory: out = epilogue(W h),
 * h the input vector or, fused in front, its RMSNorm. Four kernels share the stream, one per epilogue:
 *
 *   rms_gemv_rope      h = RMSNorm(x) * input_layernorm; [q | k | v] = W_qkv h; q and k rotated by
 *                      RoPE at pos (HF's pairing: element i of a head with element i + HS / 2); q into
 *                      `q`, k and v into the cache at pos in its dtype
 *                                     replaces attention()'s q/k/v_proj, rope() and KVCache.append
 *   rms_gemv_silu      h = RMSNorm(x) * post_attention_layernorm; g = silu(W_gate h) * (W_up h)
 *                                     replaces mlp() up to down_proj
 *   rms_gemv_residual  x += W y       replaces o_proj or down_proj and the residual add
 *   rms_gemv_argmax    h = RMSNorm(x) * norm; logits = W_head h; token = argmax (the first of equal
 *                      values); history[pos + 1] = token; state = {token, pos + 1}
 *                                     replaces forward()'s last RMSNorm and head, and greedy sampling
 * (llama/model.py, one token; pos is state[1], the token's position, so a graph replays the launch.)
 *
 * The rows of W come in tasks of R rows that one warp reduces together: R = 1 for residual and argmax
 * (task n is row n); R = 2 for silu (W is [gate; up] stacked, llama/fast/weights.py: task n is rows n
 * and F + n) and for rope (W is [q; k; v] stacked: task t is head t / (HS/2)'s rows i and i + HS/2,
 * i = t % (HS/2), the pair RoPE rotates; v's pairs pass unrotated).
 *
 * Why it is shaped this way: at batch 1 a matrix is read once and each weight feeds one FMA, so the
 * kernel is a stream and its speed is the bytes it keeps in flight. Every matrix is (N, K) row-major,
 * so a warp reads its rows with 16-byte loads, 512 contiguous bytes per instruction; lane l takes
 * vectors l, l + 32, ... of each row, UNROLL of them per item, and an item's R x UNROLL loads are
 * issued together. Two items are in flight per warp (register buffers w0 and w1, refilled as soon as
 * they are reduced): 2 x R x UNROLL 16-byte loads per lane. The first two items are issued before
 * griddep_wait() (common.cuh's rule), so under programmatic dependent launch they overlap the previous
 * kernel and the staging of the input. So is everything else a stream reads that is final by then:
 * RMSNorm's weight, and what the first task's epilogue reads beside its sums (the residual's x, RoPE's
 * position and angle; an epilogue's ahead(), which reads the next task's as a task ends): after the
 * wait the only round trips left are the input's and the stores. Against the same kernels reading
 * those after the wait (H200, tools/decode_before_after.sh, 256 tokens, one run each, the trees
 * alternating; the same tokens): 1.056x the tokens/s at Llama 3.2 1B, 1.112x at 3B, 1.043x at 3.1 8B.
 * K is looped in items of UNROLL vectors, so a row of any length fits (down_proj's 14,336), and the
 * input lives in dynamic shared memory.
 * The grid is one wave (the SMs times the blocks an SM holds, no more than the tasks need), so no
 * block waits for a second wave, and the grid's warps take tasks 0 .. warps - 1 first, then the next
 * stretch: at any moment the device reads one contiguous stretch of W. Where the tasks outnumber the
 * grid's warps (the grid is the whole wave), they are dealt out block by block: block b takes the
 * tasks equal to b modulo the grid, so every block, and every SM, reads as many rows give or take one
 * task. Dealt warp by warp instead, the last round's tasks would all go to the first blocks (Llama 3.2
 * 3B's qkv: 2,560 tasks over 264 blocks of 8 warps, the last 448 to blocks 0-55, which read 16 tasks'
 * rows where the others read 8; dealt block by block, every block reads 9 or 10). Where the grid has a
 * warp for every task (1B's qkv: 192 blocks of 8 for 1,536 tasks), a block's warps take neighbouring
 * tasks. llama/fast/plan.py has what dealing block by block measured.
 * Each output's arithmetic is the same wherever it runs (a lane sums its vectors in order, then a
 * fixed shuffle tree), so the results do not depend on the grid.
 *
 * Template parameters: weight_t (float, or unsigned short holding bfloat16 bits; the KV cache's
 * element too), K (input width, whole 16-byte vectors), WARPS per block, UNROLL (vectors per lane and
 * row in an item), HS (rope: the head size).
 * Geometry: any grid (the engine's: one wave), block WARPS * 32. Shared memory: K floats dynamic
 * (57 KB at K = 14,336: past 48 KB the host opts in), static one float per warp (and, argmax, a value
 * and an index per warp).
 * Registers: 2 x R x UNROLL x 4 of weights (64 where R x UNROLL = 8, the plan's ITEM_LOADS; 32 with
 * Llama 3.2 1B's items of 4, llama/fast/plan.py's STREAM_ITEM_LOADS), at most 128 a thread
 * (__launch_bounds__: two blocks of 8 warps per SM at least; left to itself ptxas spilled some short
 * rows' residual streams at 40 to 48 registers).
 * After its stream each block asks L2 to prefetch its share of `prefetch` (the next kernel's weights):
 * at the end, so that the rest of a large W streaming through L2 does not evict it first.
 * Limits: K % (16 / sizeof(weight_t)) == 0; the input, the norm's weight and the outputs are float32;
 * accumulation is float32.
 */
#include "common.cuh"

// -- which rows a task reads -----------------------------------------------------------------------

struct SingleRows {  // residual, argmax: task n is row n
    static constexpr int R = 1;
    __device__ __forceinline__ long long row(int t, int) const { return t; }
};

struct StackedRows {  // silu: [gate; up], task n is rows n and F + n
    static constexpr int R = 2;
    int F;
    __device__ __forceinline__ long long row(int t, int r) const { return t + (long long)r * F; }
};

template <int HS>
struct RopePairs {  // rope: [q; k; v], task t is rows i and i + HS / 2 of head t / (HS / 2)
    static constexpr int R = 2;
    __device__ __forceinline__ long long row(int t, int r) const
    {
        return (long long)(t / (HS / 2)) * HS + t % (HS / 2) + r * (HS / 2);
    }
};

// -- the stream --------------------------------------------------------------------------------------

template <typename weight_t, int K, int UNROLL>
struct Chunks {
    static constexpr int VEC = Vec16<weight_t>::N;  // elements per 16-byte vector
    static_assert(K % VEC == 0, "a row must be whole 16-byte vectors");
    static constexpr int PER_ROW = K / VEC;
    static constexpr int PER_LANE = (PER_ROW + 31) / 32;
    static constexpr int GROUPS = (PER_LANE + UNROLL - 1) / UNROLL;  // items per task
};

// Issue item (task, g): vectors (g * UNROLL + u) * 32 + lane, u < UNROLL, of each of the task's rows.
// Past the last task, or past a row's end, nothing is read and the buffer holds zeros.
template <typename weight_t, int K, int UNROLL, typename Rows>
__device__ __forceinline__ void load_item(uint4 (&w)[Rows::R][UNROLL], const weight_t* __restrict__ W, const Rows& rows,
                                          int task, int g, int tasks, int lane)
{
    using S = Chunks<weight_t, K, UNROLL>;
#pragma unroll
    for (int r = 0; r < Rows::R; ++r) {
        const weight_t* row = W + (task < tasks ? rows.row(task, r) : 0LL) * K;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = (g * UNROLL + u) * 32 + lane;
            w[r][u] = (task < tasks && c < S::PER_ROW) ? load16(row + c * S::VEC) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// acc[r] += this lane's share of item g's dot products with the input in x_s.
template <typename weight_t, int K, int UNROLL, int R>
__device__ __forceinline__ void dot_item(const uint4 (&w)[R][UNROLL], const float* x_s, int g, int lane, float (&acc)[R])
{
    using S = Chunks<weight_t, K, UNROLL>;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int c = (g * UNROLL + u) * 32 + lane;
        if (c < S::PER_ROW) {
            const float4* xv = reinterpret_cast<const float4*>(x_s + c * S::VEC);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float wv[S::VEC];
                unpack(w[r][u], wv);
#pragma unroll
                for (int e = 0; e < S::VEC / 4; ++e) {
                    const float4 xe = xv[e];
                    acc[r] = fmaf(wv[4 * e + 0], xe.x, acc[r]);
                    acc[r] = fmaf(wv[4 * e + 1], xe.y, acc[r]);
                    acc[r] = fmaf(wv[4 * e + 2], xe.z, acc[r]);
                    acc[r] = fmaf(wv[4 * e + 3], xe.w, acc[r]);
                }
            }
        }
    }
}

// RMSNorm's weight, this thread's float4s of it (i = threadIdx.x, + THREADS, ...), read before
// griddep_wait(): a weight, so it is final, and the scaling pass after the row sum needs no round trip.
template <int K, int THREADS>
struct NormAhead {
    static constexpr int N = (K / 4 + THREADS - 1) / THREADS;
    float4 w[N];
    __device__ __forceinline__ void load(const float* __restrict__ norm_w)
    {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int i = threadIdx.x + k * THREADS;
            w[k] = i < K / 4 ? __ldg(reinterpret_cast<const float4*>(norm_w) + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
};

// x_s = x, or RMSNorm(x) * norm_w = (x * (mean(x^2) + eps)^-1/2) * norm_w as llama/model.py's rms_norm,
// K floats: a thread scales the float4s it staged, with its float4s of norm_w (nw, read before the wait);
// ends with a barrier (the whole vector in place for every warp).
template <int K, int THREADS, bool RMS>
__device__ __forceinline__ void stage_rms(const float* __restrict__ x, const NormAhead<K, THREADS>& nw, float eps,
                                          float* x_s, float* scratch)
{
    static_assert(K % 4 == 0, "the input is read as float4");
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K / 4; i += THREADS) {
        const float4 v = fresh(reinterpret_cast<const float4*>(x) + i);
        reinterpret_cast<float4*>(x_s)[i] = v;
        if (RMS) ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
    if (RMS) {
        const float r = 1.0f / sqrtf(block_sum<THREADS>(ss, scratch) / K + eps);  // its barriers publish x_s
#pragma unroll
        for (int k = 0; k < NormAhead<K, THREADS>::N; ++k) {
            const int i = threadIdx.x + k * THREADS;
            if (i < K / 4) {
                float4* p = reinterpret_cast<float4*>(x_s) + i;
                const float4 v = *p, w = nw.w[k];
                *p = make_float4(v.x * r * w.x, v.y * r * w.y, v.z * r * w.z, v.w * r * w.w);
            }
        }
    }
    __syncthreads();
}

// Reduce item `item` from buffer w into acc, then refill w with item + 2; when the item ends its task,
// hand the task's R dot products (in every lane) to epi and start the next task's from zero. False
// (and nothing done) past this warp's last task: warp-uniform, so every lane leaves together.
template <typename weight_t, int K, int UNROLL, typename Rows, typename Epilogue>
__device__ __forceinline__ bool advance(uint4 (&w)[Rows::R][UNROLL], int item, const weight_t* __restrict__ W,
                                        const Rows& rows, int tasks, int first, int stride, const float* x_s,
                                        float (&acc)[Rows::R], Epilogue& epi)
{
    using S = Chunks<weight_t, K, UNROLL>;
    const int lane = threadIdx.x % 32;
    const int task = first + (item / S::GROUPS) * stride, g = item % S::GROUPS;
    if (task >= tasks) return false;
    dot_item<weight_t, K, UNROLL, Rows::R>(w, x_s, g, lane, acc);
    const int next = item + 2;
    load_item<weight_t, K, UNROLL>(w, W, rows, first + (next / S::GROUPS) * stride, next % S::GROUPS, tasks, lane);
    if (g == S::GROUPS - 1) {
#pragma unroll
        for (int r = 0; r < Rows::R; ++r) acc[r] = warp_sum(acc[r]);
        epi(task, acc, lane);
        epi.ahead(task + stride, tasks, lane);  // the warp's next task's
#pragma unroll
        for (int r = 0; r < Rows::R; ++r) acc[r] = 0.0f;
    }
    return true;
}

// This warp's tasks through two register buffers: item j is (task first + (j / GROUPS) * stride, group
// j % GROUPS), the even items in w0 and the odd ones in w1. The first two items are in flight before
// griddep_wait() and the input's staging. Where the grid has a warp for every task, warp i of block b
// starts at task b * WARPS + i (a block's warps on neighbouring tasks); where the tasks outnumber its
// warps, at b + i * gridDim.x (block b's tasks are those equal to b modulo the grid: as many in every
// block, give or take one). Either way the grid's warps read tasks 0 .. warps - 1 first, one stretch
// of W, and every task once.
template <typename weight_t, int K, int WARPS, int UNROLL, bool RMS, typename Rows, typename Epilogue>
__device__ __forceinline__ void stream_tasks(const weight_t* __restrict__ W, const Rows& rows, int tasks,
                                             const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                             float* x_s, float* scratch, Epilogue& epi)
{
    using S = Chunks<weight_t, K, UNROLL>;
    constexpr int R = Rows::R;
    const int lane = threadIdx.x % 32;
    const int stride = gridDim.x * WARPS;
    const int first = tasks > stride ? blockIdx.x + gridDim.x * (threadIdx.x / 32) : blockIdx.x * WARPS + threadIdx.x / 32;
    uint4 w0[R][UNROLL], w1[R][UNROLL];
    load_item<weight_t, K, UNROLL>(w0, W, rows, first, 0, tasks, lane);
    load_item<weight_t, K, UNROLL>(w1, W, rows, first + (1 / S::GROUPS) * stride, 1 % S::GROUPS, tasks, lane);
    NormAhead<K, WARPS * 32> nw;
    if (RMS) nw.load(norm_w);
    epi.ahead(first, tasks, lane);  // what the first task's epilogue reads beside its sums (common.cuh's rule)
    griddep_wait();  // from here on, the previous kernels' outputs (x, the state) are complete
    griddep_launch_dependents();
    stage_rms<K, WARPS * 32, RMS>(x, nw, eps, x_s, scratch);

    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll 1
    for (int j = 0;; j += 2) {
        if (!advance<weight_t, K, UNROLL>(w0, j, W, rows, tasks, first, stride, x_s, acc, epi)) return;
        if (!advance<weight_t, K, UNROLL>(w1, j + 1, W, rows, tasks, first, stride, x_s, acc, epi)) return;
    }
}

// -- epilogues ---------------------------------------------------------------------------------------

// An epilogue's ahead(n, tasks, lane) reads what task n's epilogue will need besides its sums, for the
// warp's first task before griddep_wait() and for each next one as the task before it ends, so that
// no epilogue waits on a round trip through L2 at the end of the stream. Before the wait only the
// weights and what kernels two or more launches back wrote (common.cuh's rule): x for the residual
// streams (o_proj's x is down_proj's of the layer before, down_proj's is o_proj's: each two launches
// back), the state's position and RoPE's tables.

struct AddResidual {  // x[n] += W_n . y, as the eager model adds x + o_proj(...)
    float* x;
    float x_n = 0.0f;  // lane 0: x[n] of the warp's next task, read ahead
    __device__ __forceinline__ void ahead(int n, int tasks, int lane)
    {
        if (lane == 0 && n < tasks) x_n = fresh(x + n);
    }
    __device__ __forceinline__ void operator()(int n, const float (&acc)[1], int lane) const
    {
        if (lane == 0) x[n] = x_n + acc[0];
    }
};

struct SiluMul {  // g[n] = silu(gate_n . h) * (up_n . h), silu(a) = a / (1 + e^-a) as llama/model.py's
    float* g;
    __device__ __forceinline__ void ahead(int, int, int) {}
    __device__ __forceinline__ void operator()(int n, const float (&acc)[2], int lane) const
    {
        if (lane == 0) g[n] = acc[0] / (1.0f + expf(-acc[0])) * acc[1];
    }
};

// RoPE of q and k at pos (llama/model.py's rope(): x * cos + rotate_half(x) * sin, each product and
// sum rounded as the eager model's separate array operations round them), then q to `q`, k and v to
// this layer's cache rows at pos. cos and sin are the eager model's own tables (rope_tables: the
// angle pos * inv_freq[i] in float32, shared by elements i and i + HS / 2), (max_len, HS / 2) each.
template <typename kv_t, int HS>
struct RopeStore {
    float* q;
    kv_t* k_cache;  // (kv_heads, max_len, HS)
    kv_t* v_cache;
    const float* rope_cos;  // (max_len, HS / 2)
    const float* rope_sin;
    int n_head, kv_heads, max_len;

    int pos;                           // state[1], read before griddep_wait() (the rule allows it)
    float cos_t = 0.0f, sin_t = 0.0f;  // lane 0: the next task's cos and sin at pos (q's and k's heads)

    __device__ __forceinline__ void ahead(int t, int tasks, int lane)
    {
        constexpr int HALF = HS / 2;
        if (lane != 0 || t >= tasks) return;
        if (t / HALF < n_head + kv_heads) {
            cos_t = rope_cos[(long long)pos * HALF + t % HALF];
            sin_t = rope_sin[(long long)pos * HALF + t % HALF];
        }
    }

    __device__ __forceinline__ void operator()(int t, const float (&acc)[2], int lane) const
    {
        if (lane != 0) return;
        constexpr int HALF = HS / 2;
        const int head = t / HALF, i = t % HALF;  // heads: n_head of q, kv_heads of k, kv_heads of v
        float a = acc[0], b = acc[1];  // elements i and i + HALF
        if (head < n_head + kv_heads) {
            const float c = cos_t, s = sin_t;
            const float ra = __fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, s));
            const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
            a = ra;
            b = rb;
        }
        if (head < n_head) {
            q[head * HS + i] = a;
            q[head * HS + i + HALF] = b;
            return;
        }
        const bool is_k = head < n_head + kv_heads;
        kv_t* cache = is_k ? k_cache : v_cache;
        const long long at = ((long long)(head - n_head - (is_k ? 0 : kv_heads)) * max_len + pos) * HS + i;
        store_as(cache + at, a);
        store_as(cache + at + HALF, b);
    }
};

struct Argmax {  // each warp's best (value, row) over its rows, ascending: the first of equal values stays
    float* logits;  // written if not null
    float best;
    int arg;
    __device__ __forceinline__ void ahead(int, int, int) {}
    __device__ __forceinline__ void operator()(int n, const float (&acc)[1], int lane)
    {
        if (logits != nullptr && lane == 0) logits[n] = acc[0];
        if (acc[0] > best) {  // NaN is never taken
            best = acc[0];
            arg = n;
        }
    }
};

// -- the kernels -------------------------------------------------------------------------------------

template <typename weight_t, int K, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32, 2)
rms_gemv_residual(const weight_t* __restrict__ W, const float* __restrict__ y, int N, float* __restrict__ x,
                  const char* prefetch, unsigned long long prefetch_bytes)
{
    extern __shared__ __align__(16) float x_s[];  // K floats
    __shared__ float scratch[WARPS];
    AddResidual epi{x};
    stream_tasks<weight_t, K, WARPS, UNROLL, false>(W, SingleRows{}, N, y, nullptr, 0.0f, x_s, scratch, epi);
    prefetch_l2(prefetch, prefetch_bytes);
}

template <typename weight_t, int K, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32, 2)
rms_gemv_silu(const weight_t* __restrict__ W, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
              int F, float* __restrict__ g, const char* prefetch, unsigned long long prefetch_bytes)
{
    extern __shared__ __align__(16) float x_s[];
    __shared__ float scratch[WARPS];
    SiluMul epi{g};
    stream_tasks<weight_t, K, WARPS, UNROLL, true>(W, StackedRows{F}, F, x, norm_w, eps, x_s, scratch, epi);
    prefetch_l2(prefetch, prefetch_bytes);
}

template <typename weight_t, int K, int HS, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32, 2)
rms_gemv_rope(const weight_t* __restrict__ W, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
              int n_head, int kv_heads, const int* __restrict__ state, const float* __restrict__ rope_cos,
              const float* __restrict__ rope_sin, float* __restrict__ q, weight_t* __restrict__ k_cache, weight_t* __restrict__ v_cache, int max_len,
              const char* prefetch, unsigned long long prefetch_bytes)
{
    static_assert(HS % 2 == 0, "RoPE rotates pairs");
    extern __shared__ __align__(16) float x_s[];
    __shared__ float scratch[WARPS];
    RopeStore<weight_t, HS> epi{q, k_cache, v_cache, rope_cos, rope_sin, n_head, kv_heads, max_len, fresh(state + 1)};
    const int tasks = (n_head + 2 * kv_heads) * (HS / 2);
    stream_tasks<weight_t, K, WARPS, UNROLL, true>(W, RopePairs<HS>{}, tasks, x, norm_w, eps, x_s, scratch, epi);
    prefetch_l2(prefetch, prefetch_bytes);
}

template <typename weight_t, int K, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32, 2)
rms_gemv_argmax(const weight_t* __restrict__ W, const float* __restrict__ x, const float* __restrict__ norm_w,
                float eps, int V, float* __restrict__ logits, float* block_max, int* block_arg, unsigned int* counter,
                int* state, int* history, const char* prefetch, unsigned long long prefetch_bytes)
{
    constexpr int THREADS = WARPS * 32;
    extern __shared__ __align__(16) float x_s[];
    __shared__ float scratch[WARPS];
    __shared__ float warp_best[WARPS];
    __shared__ int warp_arg[WARPS];
    __shared__ bool is_last;
    Argmax epi{logits, -INFINITY, 0x7fffffff};
    stream_tasks<weight_t, K, WARPS, UNROLL, true>(W, SingleRows{}, V, x, norm_w, eps, x_s, scratch, epi);
    prefetch_l2(prefetch, prefetch_bytes);

    // This block's best, then a ticket: the last block to finish reduces every block's best (as
    // lm_head_argmax.cu does), writes the token and advances the state.
    float best = epi.best;
    int arg = epi.arg;
    block_argmax<WARPS>(best, arg, warp_best, warp_arg);
    if (threadIdx.x == 0) {
        block_max[blockIdx.x] = best;
        block_arg[blockIdx.x] = arg;
        __threadfence();  // the result is visible device-wide before the ticket is taken
        is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    best = -INFINITY;
    arg = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += THREADS) {
        const float v = __ldcg(block_max + b);  // from L2: other blocks wrote these
        const int a = __ldcg(block_arg + b);
        if (v > best || (v == best && a < arg)) {
            best = v;
            arg = a;
        }
    }
    block_argmax<WARPS>(best, arg, warp_best, warp_arg);
    if (threadIdx.x == 0) {
        const int token = (arg >= 0 && arg < V) ? arg : 0;  // every logit NaN: 0, not a row past the table
        const int pos = fresh(state + 1);
        history[pos + 1] = token;
        state[0] = token;
        state[1] = pos + 1;
        *counter = 0u;  // ready for the next step
    }
}
