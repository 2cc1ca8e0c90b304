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
 * Why it is shaped this way: wte is (V, K) row-major, already the layout gemv.cu wants (a warp per
 * vocabulary row, 16-byte loads, shuffles), and it is the largest matrix of the step (V * K weights,
 * a third of GPT-2 small's bytes), so it must stream at full bandwidth. The logits never reach memory
 * unless asked for: each block keeps its best (value, index), writes it to block_max/block_arg, and
 * the last block to finish (a ticket from `counter`, which it resets to 0 for the next step) reduces
 * those, the classic threadfence reduction, so the argmax costs no extra launch.
 *
 * Template parameters: weight_t (float or bfloat16 bits), K (n_embd), WARPS, ROWS (vocabulary rows
 * per warp). Geometry: grid ceil(V / (WARPS * ROWS)), block WARPS * 32; block_max and block_arg hold
 * one entry per block. Shared memory: K floats for h, plus per-warp scratch.
 * Ties go to the smaller index everywhere (warps and blocks cover increasing rows). NaN logits are
 * never chosen; if every logit is NaN the token is 0 (a guard against indexing past wte next step).
 */
#include "common.cuh"

template <int WARPS>
__device__ __forceinline__ void block_argmax(float& best, int& arg, float* warp_best, int* warp_arg)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int a = __shfl_xor_sync(0xffffffffu, arg, o);
        if (v > best || (v == best && a < arg)) { best = v; arg = a; }
    }
    if (lane == 0) { warp_best[warp] = best; warp_arg[warp] = arg; }
    __syncthreads();
    best = -INFINITY;
    arg = 0x7fffffff;
#pragma unroll
    for (int w = 0; w < WARPS; ++w)
        if (warp_best[w] > best || (warp_best[w] == best && warp_arg[w] < arg)) { best = warp_best[w]; arg = warp_arg[w]; }
    __syncthreads();
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
    constexpr int VEC = Vec16<weight_t>::N;
    static_assert(K % VEC == 0, "a row must be whole 16-byte vectors");
    constexpr int CHUNKS = K / VEC;
    constexpr int ITERS = (CHUNKS + 31) / 32;
    __shared__ __align__(16) float x_s[K];
    __shared__ float scratch[WARPS];
    __shared__ float warp_best[WARPS];
    __shared__ int warp_arg[WARPS];
    __shared__ bool is_last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * WARPS + warp) * ROWS;

    uint4 w[ROWS][ITERS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const weight_t* row = wte + (long long)(n0 + r) * K;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = i * 32 + lane;
            w[r][i] = (n0 + r < V && c < CHUNKS) ? load16(row + c * VEC) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    prefetch_l2(prefetch, prefetch_bytes);
    griddep_launch_dependents();
    griddep_wait();  // x, the counter and state are the previous kernels' from here on
    stage_input<K, THREADS, true>(x, y, y_bias, ln_w, ln_b, eps, x_s, scratch);

    float best = -INFINITY;
    int arg = 0x7fffffff;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = i * 32 + lane;
            if (c < CHUNKS) {
                float wv[VEC];
                unpack(w[r][i], wv);
                const float4* xv = reinterpret_cast<const float4*>(x_s + c * VEC);
#pragma unroll
                for (int e = 0; e < VEC / 4; ++e) {
                    const float4 xe = xv[e];
                    acc = fmaf(wv[4 * e + 0], xe.x, acc);
                    acc = fmaf(wv[4 * e + 1], xe.y, acc);
                    acc = fmaf(wv[4 * e + 2], xe.z, acc);
                    acc = fmaf(wv[4 * e + 3], xe.w, acc);
                }
            }
        }
        acc = warp_sum(acc);
        const int n = n0 + r;
        if (n < V) {
            if (logits != nullptr && lane == 0) logits[n] = acc;
            if (acc > best) { best = acc; arg = n; }  // rows ascend: the first of equal values stays
        }
    }

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
