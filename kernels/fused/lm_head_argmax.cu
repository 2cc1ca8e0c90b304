/*
 * lm_head_argmax - the end of a greedy step in one kernel: ln_f, the logits over the whole vocabulary
 * (wte, tied), their argmax, and the step's bookkeeping on the device.
 *
 * The operation, and what it replaces (gpt2/model.py and gpt2/generate.py, last position only):
 *   h      = LN_f(x + y + y_bias)              y and y_bias may be null (the decode step adds its
 *                                              residuals in place; the eager path hands the last
 *                                              layer's MLP output here instead of writing x back)
 *   logits = wte @ h                           (V,); written only if `logits` is not null
 *   token  = argmax(logits)                    the first index of the largest value, as argmax
 *   history[pos + 1] = token; state = {token, pos + 1}
 * state = {token, pos} is the decode step's whole input: the token at position pos. The step reads it
 * from device memory, so a captured CUDA graph replays with no host arguments.
 *
 * The change against a grid of one block per WARPS * ROWS rows: one wave of blocks that stream wte.
 * The grid is as many blocks as the device holds at once (SMs x resident blocks per SM, chosen by the
 * host; any grid is correct). Each block stages h once, and each warp walks row groups of ROWS rows,
 * group g covering rows [g * ROWS, g * ROWS + ROWS), from g = its warp index in the grid in steps of
 * the grid's warp count, so at any moment the device reads one contiguous stretch of wte.
 *
 * Why it should help: wte is (V, K) row-major, the largest matrix of the step (V * K weights, a third
 * of GPT-2 small's bytes), so the kernel is a stream and its speed is the bytes it keeps in flight.
 * With a block per few rows (~3100 blocks, many waves) every block paid for LayerNorm (two block
 * reductions) and its loads started only when an earlier block left its SM. Here the loads are
 * software-pipelined in two register buffers, w0 and w1: both are filled before griddep_wait() (weights
 * only, as common.cuh's rule allows; griddep_launch_dependents() follows the wait, as in every decode
 * kernel), so under programmatic dependent launch they overlap the previous kernel and then the
 * LayerNorm; in the loop a buffer is refilled with the group two steps ahead as soon as it has been
 * reduced, so while a warp waits for one group the next is in flight too.
 * A lane holds ITERS = ceil(K / vector / 32) 16-byte vectors per row: 2 * ROWS * ITERS * 4 registers
 * of weights, 2 * ROWS * K * sizeof(weight) bytes per warp when both buffers are in flight. GPT-2
 * small with the engine's shapes (gpt2/fast/plan.py, lm_head_shape): float32 ROWS = 1, ITERS = 6;
 * bfloat16 ROWS = 2, ITERS = 3; both 48 registers and 6 KB per warp, a block of 8 warps 24 to 48 KB
 * (one or both buffers in flight). Little's law asks for bandwidth x latency, about 4 TB/s x 1 us
 * = 4 MB across the device or ~32 KB per SM: one resident block is about there, and the occupancy the
 * host fills (two blocks of 8 warps per SM while a thread needs at most 128 registers) doubles it.
 * The logits never reach memory unless asked for: each warp keeps its best (value, index), each block
 * reduces its warps' and writes it to block_max/block_arg, and the last block to finish (a ticket
 * from `counter`, which it resets to 0 for the next step) reduces those, the classic threadfence
 * reduction, so the argmax costs no extra launch. After its loop each block asks L2 to prefetch its
 * share of `prefetch` (the next kernel's weights): issued at the end rather than the start, so that
 * the rest of wte, larger than L2, does not stream through and evict it first.
 *
 * Template parameters: weight_t (float or bfloat16 bits), K (n_embd), WARPS, ROWS (vocabulary rows
 * per group). Geometry: any grid (the engine's: SMs x resident blocks per SM, capped at the groups
 * there are), block WARPS * 32; block_max and block_arg hold one entry per block. Shared memory: K
 * floats for h, plus per-warp scratch.
 * Each row's dot product is the same arithmetic wherever it runs (lane l sums vectors l, l + 32, ...,
 * then a fixed shuffle tree), so the logits do not depend on the grid; with WARPS fixed neither does
 * h. Ties go to the smaller index everywhere: a warp's rows ascend and it keeps the first of equal
 * values; warps and blocks compare (value, index). NaN logits are never chosen; if every logit is NaN
 * the token is 0 (a guard against indexing past wte next step).
 */
#include "common.cuh"

// A row of K weights as 16-byte vectors, and a lane's share of them.
template <typename weight_t, int K>
struct RowShape {
    static constexpr int VEC = Vec16<weight_t>::N;  // elements per 16-byte vector
    static_assert(K % VEC == 0, "a row must be whole 16-byte vectors");
    static constexpr int CHUNKS = K / VEC;  // vectors per row
    static constexpr int ITERS = (CHUNKS + 31) / 32;  // per lane
};

// Issue the loads of row group g into w: lane l takes vectors l, l + 32, ... of each row. Rows past
// V (and groups past the end) read nothing and hold zeros.
template <typename weight_t, int K, int ROWS>
__device__ __forceinline__ void load_group(uint4 (&w)[ROWS][RowShape<weight_t, K>::ITERS],
                                           const weight_t* __restrict__ wte, int g, int V, int lane)
{
    using S = RowShape<weight_t, K>;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = g * ROWS + r;
        const weight_t* row = wte + (long long)n * K;
#pragma unroll
        for (int i = 0; i < S::ITERS; ++i) {
            const int c = i * 32 + lane;
            w[r][i] = (n < V && c < S::CHUNKS) ? load16(row + c * S::VEC) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The logits of row group g from the weights in w and h in x_s; written out if asked, and folded
// into this warp's (best, arg).
template <typename weight_t, int K, int ROWS>
__device__ __forceinline__ void reduce_group(const uint4 (&w)[ROWS][RowShape<weight_t, K>::ITERS],
                                             const float* x_s, int g, int V, int lane,
                                             float* __restrict__ logits, float& best, int& arg)
{
    using S = RowShape<weight_t, K>;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < S::ITERS; ++i) {
            const int c = i * 32 + lane;
            if (c < S::CHUNKS) {
                float wv[S::VEC];
                unpack(w[r][i], wv);
                const float4* xv = reinterpret_cast<const float4*>(x_s + c * S::VEC);
#pragma unroll
                for (int e = 0; e < S::VEC / 4; ++e) {
                    const float4 xe = xv[e];
                    acc = fmaf(wv[4 * e + 0], xe.x, acc);
                    acc = fmaf(wv[4 * e + 1], xe.y, acc);
                    acc = fmaf(wv[4 * e + 2], xe.z, acc);
                    acc = fmaf(wv[4 * e + 3], xe.w, acc);
                }
            }
        }
        acc = warp_sum(acc);  // every lane holds the row's logit
        const int n = g * ROWS + r;
        if (n < V) {
            if (logits != nullptr && lane == 0) logits[n] = acc;
            if (acc > best) { best = acc; arg = n; }  // rows ascend: the first of equal values stays
        }
    }
}

template <typename weight_t, int K, int WARPS, int ROWS>
__global__ void __launch_bounds__(WARPS * 32)
lm_head_argmax(const weight_t* __restrict__ wte, const float* __restrict__ x, const float* __restrict__ y,
               const float* __restrict__ y_bias, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
               float eps, int V, float* __restrict__ logits, float* block_max, int* block_arg,
               unsigned int* counter, int* state, int* history, const char* prefetch,
               unsigned long long prefetch_bytes)
{
    constexpr int THREADS = WARPS * 32;
    constexpr int ITERS = RowShape<weight_t, K>::ITERS;
    __shared__ __align__(16) float x_s[K];
    __shared__ float scratch[WARPS];
    __shared__ float warp_best[WARPS];
    __shared__ int warp_arg[WARPS];
    __shared__ bool is_last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int groups = (V + ROWS - 1) / ROWS;
    const int stride = gridDim.x * WARPS;  // warps in the grid: the step from one of a warp's groups to the next
    int g = blockIdx.x * WARPS + warp;  // this warp's first group

    // The first two groups in flight before anything else: weights only, so before griddep_wait().
    uint4 w0[ROWS][ITERS], w1[ROWS][ITERS];
    load_group<weight_t, K, ROWS>(w0, wte, g, V, lane);
    load_group<weight_t, K, ROWS>(w1, wte, g + stride, V, lane);
    griddep_wait();  // x, the counter and state are the previous kernels' from here on
    griddep_launch_dependents();
    stage_input<K, THREADS, true>(x, y, y_bias, ln_w, ln_b, eps, x_s, scratch);

    // Reduce a buffer, then refill it with the group two steps ahead: while a warp waits for one
    // group, the next is already in flight.
    float best = -INFINITY;
    int arg = 0x7fffffff;
#pragma unroll 1
    for (; g < groups; g += 2 * stride) {
        reduce_group<weight_t, K, ROWS>(w0, x_s, g, V, lane, logits, best, arg);
        load_group<weight_t, K, ROWS>(w0, wte, g + 2 * stride, V, lane);
        if (g + stride >= groups) break;
        reduce_group<weight_t, K, ROWS>(w1, x_s, g + stride, V, lane, logits, best, arg);
        load_group<weight_t, K, ROWS>(w1, wte, g + 3 * stride, V, lane);
    }
    prefetch_l2(prefetch, prefetch_bytes);

    // This block's best, then a ticket: the last block to finish reduces every block's best.
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
        if (v > best || (v == best && a < arg)) { best = v; arg = a; }
    }
    block_argmax<WARPS>(best, arg, warp_best, warp_arg);
    if (threadIdx.x == 0) {
        const int token = (arg >= 0 && arg < V) ? arg : 0;
        const int pos = fresh(state + 1);
        history[pos + 1] = token;
        state[0] = token;
        state[1] = pos + 1;
        *counter = 0u;  // ready for the next step
    }
}
