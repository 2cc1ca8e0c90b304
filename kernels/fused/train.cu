/*
 * train - the non-GEMM work of GPT-2's training pass (gpt2/backward.py, launched by gpt2/train_kernels.py),
 * each kernel one pass over its arrays where the array code takes several CuPy launches. The math and
 * the precision are the array code's: float32 statistics, softmax, loss and sums; 16-bit (bfloat16 bits)
 * only where the array code stores 16 bits (the products' operands).
 *
 *   softmax_xent<OUT, THREADS>      the fused classifier's per-row softmax and cross-entropy: reads a
 *                                   row of float32 logits twice (an online max and sum of exp, then the
 *                                   gradient), writes dlogits = (softmax - onehot) / n in OUT (in
 *                                   place over the logits when OUT is float) and the row's loss. Rows
 *                                   of `ld` >= V elements: columns V.. are the padded vocabulary's,
 *                                   excluded from the softmax, their dlogits written zero.
 *                                   Grid (rows), block THREADS. Any V; a target outside [0, V) gives a
 *                                   NaN loss.
 *   layernorm_fwd<W, OUT, COLS, RESIDUAL>
 *                                   out = LN(x) * w + b in OUT, with mean and rstd (float32): one block
 *                                   of LN_THREADS a row, its COLS = ceil(C / LN_THREADS) columns a thread
 *                                   held in registers; two-pass statistics as the array code's (the mean,
 *                                   then the centred sum of squares; biased variance, eps inside).
 *                                   RESIDUAL: x is first x + (y + y_bias), a product's output and its
 *                                   bias (in W, their sum rounded to W as the array code's) added into
 *                                   the residual stream, written to x_out (float32): the residual add
 *                                   and the LayerNorm after it in one pass (the decode path's
 *                                   add_layernorm). Grid (rows), block LN_THREADS.
 *   layernorm_bwd<W, COLS>          dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = dout w,
 *                                   written to dx or added to it (the residual's gradient: ACCUMULATE);
 *                                   and each block's partial sums over its rows of dout norm and dout
 *                                   (partial (gridDim.x, 2, C)), which column_sums adds up. A thread
 *                                   owns the same columns in every row, so the partial sums stay in
 *                                   registers and come out in a fixed order (no atomics).
 *                                   Grid (G <= rows; block b takes rows b, b + G, ...), block LN_THREADS.
 *   gelu_fwd<T>                     g = GELU(h) in T (the tanh form of gpt2/model.py's gelu), float32 math.
 *                                   A grid-stride loop over the n elements, block 256.
 *   column_sums<IN, OUT, GELU>      one row group's column sums: sums[group, c] = sum over its rows of
 *                                   v[r, c], v = in (GELU: in * GELU'(h), h in OUT), summed in float32;
 *                                   where `out` is given it also writes v in OUT (the products' operand:
 *                                   a bias gradient and the cast its two products take, one pass). A
 *                                   thread a column: a warp reads a row's 32 consecutive elements.
 *                                   Grid (ceil(C / 256), ceil(rows / rows_per_group)), block 256.
 *   heads_to_rows<T>                gridDim.y arrays (B, NH, T, hs), contiguous, into columns
 *                                   [y C, (y + 1) C) of (B * T) rows of `row_stride` elements: the
 *                                   heads side by side (y = 0 only), or dq, dk, dv into dqkv (B * T, 3C)
 *                                   in one launch. A grid-stride loop over B * T * C, block 256.
 */
#include "common.cuh"

#define LN_THREADS 256
#define COLUMN_THREADS 256

// -- reductions over a block of THREADS ------------------------------------------------------------

// The sums over the block of a and b, in every thread, with one pair of barriers. scratch holds 2
// floats per warp.
template <int THREADS>
__device__ __forceinline__ float2 block_sum2(float a, float b, float* scratch)
{
    constexpr int WARPS = THREADS / 32;
    a = warp_sum(a);
    b = warp_sum(b);
    if (threadIdx.x % 32 == 0) {
        scratch[threadIdx.x / 32] = a;
        scratch[WARPS + threadIdx.x / 32] = b;
    }
    __syncthreads();
    float2 total = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {  // the same order in every thread
        total.x += scratch[w];
        total.y += scratch[WARPS + w];
    }
    __syncthreads();
    return total;
}

// Combine two (max, sum of exp(v - max)) pairs of an online softmax.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2)
{
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return;  // both empty
    s = s * expf(m - m_new) + s2 * expf(m2 - m_new);
    m = m_new;
}

template <int THREADS>
__device__ __forceinline__ void block_softmax_stats(float& m, float& s, float* scratch)
{
    constexpr int WARPS = THREADS / 32;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) softmax_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o),
                                                  __shfl_xor_sync(0xffffffffu, s, o));
    if (threadIdx.x % 32 == 0) {
        scratch[threadIdx.x / 32] = m;
        scratch[WARPS + threadIdx.x / 32] = s;
    }
    __syncthreads();
    m = -INFINITY;
    s = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) softmax_merge(m, s, scratch[w], scratch[WARPS + w]);
    __syncthreads();
}

// -- the classifier --------------------------------------------------------------------------------

template <typename OUT, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_xent(float* __restrict__ logits, const int* __restrict__ targets, int V, int ld, float n,
             OUT* __restrict__ dlogits, float* __restrict__ losses)
{
    __shared__ float scratch[2 * (THREADS / 32)];
    const long long r = blockIdx.x;
    float* row = logits + r * ld;
    OUT* drow = dlogits + r * ld;  // the same row as `row` when OUT is float and dlogits is logits
    const int target = targets[r];
    const bool valid = target >= 0 && target < V;
    const float target_logit = valid ? row[target] : 0.0f;  // read before any thread overwrites the row
    // M = max_c l_c, S = sum_c exp(l_c - M): one pass, each thread's pair rescaled as its max grows
    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x; c < V; c += THREADS) {
        const float l = row[c];
        if (l > m) {
            s = s * expf(m - l) + 1.0f;
            m = l;
        } else {
            s += expf(l - m);
        }
    }
    block_softmax_stats<THREADS>(m, s, scratch);  // its barriers also order the read of target_logit
    const float scale = 1.0f / (s * n);  // 1 / (S N), as the array code's 1 / (total * N)
    for (int c = threadIdx.x; c < ld; c += THREADS) {
        float d = c < V ? expf(row[c] - m) * scale : 0.0f;  // the padding: no probability, no gradient
        if (c == target) d -= 1.0f / n;
        store_as(drow + c, d);
    }
    if (threadIdx.x == 0) losses[r] = valid ? logf(s) - (target_logit - m) : __int_as_float(0x7fc00000);
}

// -- LayerNorm -------------------------------------------------------------------------------------

template <typename W, typename OUT, int COLS, bool RESIDUAL>
__global__ void __launch_bounds__(LN_THREADS)
layernorm_fwd(const float* __restrict__ x, const W* __restrict__ y, const W* __restrict__ y_bias,
              float* __restrict__ x_out, const W* __restrict__ weight, const W* __restrict__ bias, float eps,
              OUT* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd, int C)
{
    __shared__ float scratch[2 * (LN_THREADS / 32)];
    const long long r = blockIdx.x;
    float v[COLS];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        v[k] = c < C ? x[r * C + c] : 0.0f;
        if (RESIDUAL && c < C) {  // x + (y + y_bias), the bias added in W as linear_forward adds it
            v[k] += round_as<W>(to_float(y[r * C + c]) + to_float(y_bias[c]));
            x_out[r * C + c] = v[k];
        }
        sum += v[k];
    }
    const float mu = block_sum2<LN_THREADS>(sum, 0.0f, scratch).x / C;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const float d = threadIdx.x + k * LN_THREADS < C ? v[k] - mu : 0.0f;
        ss += d * d;
    }
    const float rs = 1.0f / sqrtf(block_sum2<LN_THREADS>(ss, 0.0f, scratch).x / C + eps);
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        if (c < C) store_as(out + r * C + c, (v[k] - mu) * rs * to_float(weight[c]) + to_float(bias[c]));
    }
    if (threadIdx.x == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

template <typename W, int COLS, bool ACCUMULATE>
__global__ void __launch_bounds__(LN_THREADS)
layernorm_bwd(const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ mean,
              const float* __restrict__ rstd, const W* __restrict__ weight, float* __restrict__ dx,
              float* __restrict__ partial, int rows, int C)
{
    __shared__ float scratch[2 * (LN_THREADS / 32)];
    float w[COLS], dweight[COLS], dbias[COLS];
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        w[k] = c < C ? to_float(weight[c]) : 0.0f;
        dweight[k] = dbias[k] = 0.0f;
    }
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float mu = mean[r], rs = rstd[r];
        float dy[COLS], norm[COLS];
        float sum_dnorm = 0.0f, sum_dnorm_norm = 0.0f;
#pragma unroll
        for (int k = 0; k < COLS; ++k) {
            const int c = threadIdx.x + k * LN_THREADS;
            dy[k] = c < C ? dout[r * C + c] : 0.0f;
            norm[k] = c < C ? (x[r * C + c] - mu) * rs : 0.0f;  // recomputed, as the array code does
            const float dnorm = dy[k] * w[k];
            sum_dnorm += dnorm;
            sum_dnorm_norm += dnorm * norm[k];
            dweight[k] += dy[k] * norm[k];
            dbias[k] += dy[k];
        }
        const float2 sums = block_sum2<LN_THREADS>(sum_dnorm, sum_dnorm_norm, scratch);
        const float mean_dnorm = sums.x / C, mean_dnorm_norm = sums.y / C;
#pragma unroll
        for (int k = 0; k < COLS; ++k) {
            const int c = threadIdx.x + k * LN_THREADS;
            if (c >= C) continue;
            const float g = rs * (dy[k] * w[k] - mean_dnorm - norm[k] * mean_dnorm_norm);
            dx[r * C + c] = ACCUMULATE ? dx[r * C + c] + g : g;
        }
    }
    float* mine = partial + (long long)blockIdx.x * 2 * C;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        if (c < C) {
            mine[c] = dweight[k];
            mine[C + c] = dbias[k];
        }
    }
}

// -- GELU and column sums --------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(256)
gelu_fwd(const T* __restrict__ h, T* __restrict__ g, long long n)
{
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
        store_as(g + i, gelu_tanh(to_float(h[i])));
}

// GELU'(h) of the tanh form, as gpt2/backward.py's gelu_backward writes it.
__device__ __forceinline__ float gelu_tanh_grad(float h)
{
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    const float u = h * h;
    const float t = tanhf(c * h * (1.0f + 0.044715f * u));
    return 0.5f * (1.0f + t) + 0.5f * h * (1.0f - t * t) * c * (1.0f + 3 * 0.044715f * u);
}

template <typename IN, typename OUT, bool GELU>
__global__ void __launch_bounds__(COLUMN_THREADS)
column_sums(const IN* __restrict__ in, const OUT* __restrict__ h, OUT* __restrict__ out, float* __restrict__ sums,
            int rows, int C, int rows_per_group)
{
    const int c = blockIdx.x * COLUMN_THREADS + threadIdx.x;
    if (c >= C) return;
    const long long first = (long long)blockIdx.y * rows_per_group;
    const long long last = first + rows_per_group < rows ? first + rows_per_group : rows;
    float total = 0.0f;
#pragma unroll 4
    for (long long r = first; r < last; ++r) {
        float v = to_float(in[r * C + c]);
        if (GELU) v *= gelu_tanh_grad(to_float(h[r * C + c]));
        if (out != nullptr) store_as(out + r * C + c, v);
        total += v;
    }
    sums[(long long)blockIdx.y * C + c] = total;
}

// -- layouts ---------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(256)
heads_to_rows(const T* __restrict__ a0, const T* __restrict__ a1, const T* __restrict__ a2, T* __restrict__ out,
              int B, int NH, int T_len, int hs, long long row_stride)
{
    const T* src = blockIdx.y == 0 ? a0 : blockIdx.y == 1 ? a1 : a2;
    const int C = NH * hs;
    const long long total = (long long)B * T_len * C;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
        const long long row = i / C;  // b T + t
        const int c = (int)(i % C), head = c / hs, d = c % hs;
        const long long b = row / T_len, t = row % T_len;
        out[row * row_stride + (long long)blockIdx.y * C + c] = src[((b * NH + head) * T_len + t) * hs + d];
    }
}
