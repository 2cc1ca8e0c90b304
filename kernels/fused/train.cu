/*
 * train - the non-GEMM work of GPT-2's training pass (gpt2/backward.py, launched by
 * gpt2/train_kernels.py), written to move each byte once, 16 bytes at a time. The math and the
 * precision are the array code's: float32 statistics, softmax, loss and sums; 16-bit (bfloat16 bits)
 * only where the array code stores 16 bits.
 *
 * Every row is read and written as vectors of 8 elements (one 16-byte load of bfloat16, two of float32),
 * so widths must be multiples of 8 (GPT-2's C, 3C, 4C, head size and padded vocabulary all are;
 * train_kernels.applies() sends anything else to the array code). A kernel's bound is its bytes over
 * ~4.8 TB/s (H200); each header says what it moves. N rows of C columns below.
 *
 *   softmax_xent<OUT, THREADS>      the fused classifier's per-row softmax and cross-entropy: reads a
 *                                   row of float32 logits twice (the second read hits L2: a wave of
 *                                   rows is ~30 MB), an online max and sum of exp over each vector of
 *                                   8, then dlogits = (softmax - onehot) / n in OUT (in place when OUT
 *                                   is float) and the row's loss. Rows of `ld` (a multiple of 8) >= V
 *                                   elements: columns V.. are padding, excluded, their dlogits zero.
 *                                   Grid (rows), block THREADS. Moves 4 + sizeof(OUT) bytes an element.
 *   layernorm_fwd<W, OUT, RESIDUAL> out = LN(x) * w + b in OUT, with mean and rstd: a block a row, a
 *                                   thread 8 columns held in registers (block = C / 8 rounded up to a
 *                                   warp, <= 256); two-pass statistics as the array code's. RESIDUAL: x
 *                                   is first x + (y + y_bias) (the product's output and its bias, their
 *                                   sum rounded to W), written to x_out. Grid (N). Moves 4 + sizeof(OUT)
 *                                   bytes an element (RESIDUAL: + sizeof(W) + 4).
 *   layernorm_bwd<W, ACCUMULATE>    dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm =
 *                                   dout w, written to dx or added to it; LN_ROWS rows at once (threadIdx.y),
 *                                   a thread 8 columns in every row, so each thread's sums of dout norm
 *                                   and dout stay in registers; the block's LN_ROWS partials are added
 *                                   in shared memory in a fixed order and written as one row of partial
 *                                   (gridDim.x, 2C), which column_total adds up. Block (C / 8 rounded
 *                                   up to a warp, LN_ROWS). Moves 8 (+ 8 ACCUMULATE) bytes an element.
 *   bias_gelu<T>                    linear_forward's bias add and GELU in one pass over the MLP's first
 *                                   product y (N, 4C): h = y + bias rounded to T (kept for the
 *                                   backward) and g = GELU(h) in T (float32 math). A block a row at a
 *                                   time (rows strided by the grid), a thread a vector. Moves 3 sizeof(T).
 *   column_sums<IN, OUT, GELU>      one row group's column sums, 8 columns a thread: sums[group, c] =
 *                                   sum over its rows of v[r, c], v = in (GELU: in * GELU'(h), h in OUT),
 *                                   in float32; where `out` is given it also writes v in OUT (a bias's
 *                                   gradient and its products' operand, one pass). Groups of >= 16 rows,
 *                                   enough of them to fill the device (train_kernels.py picks);
 *                                   grid (ceil(C / 8 / block), groups). Moves sizeof(IN) (+ 2 sizeof(OUT)).
 *   column_total                    sums (C,) = the column sums of partial (G, C) float32: a block 32
 *                                   columns by 32 slices of rows, the slices added in a fixed order
 *                                   in shared memory. Grid (ceil(C / 32)), block (32, 32).
 *   heads_rows<T, TO_ROWS, BIAS>    the heads' layout (B, NH, T, hs) <-> rows (B * T, C): gridDim.y
 *                                   arrays, array y at columns [y C, (y + 1) C) of rows of `row_stride`.
 *                                   TO_ROWS: o into o's rows, or dq, dk, dv into dqkv (N, 3C); else
 *                                   rows into heads: dy into do, or (BIAS) the QKV product's (N, 3C)
 *                                   plus its bias into contiguous q, k, v (linear_forward's add, and
 *                                   the backward rung's copies of q, k, v, gone). A block a row at a
 *                                   time, a thread 8 elements of one head (hs % 8 == 0: one 16-byte
 *                                   vector in bfloat16), 8 threads a head's 16-byte-aligned run, the
 *                                   division by T once a row, by hs once a vector. Moves 2 sizeof(T).
 *   embed_bwd                       dwte[v] += the rows of dx (N, C) float32 whose token is v, one after
 *                                   another in row order, as NumPy's add.at adds them (the same bits):
 *                                   the rows sorted by token, ties in row order (order, tokens), a block
 *                                   a run of one token (the block of its first row; the others return),
 *                                   a thread 8 columns. No atomics, so every run adds in the same order.
 *                                   Grid (N), block C / 8 rounded up to a warp (<= 256). Moves 4 bytes an
 *                                   element of dx, 8 of each token's row of dwte.
 */
#include "common.cuh"

#define LN_ROWS 2          // rows a layernorm_bwd block takes at once (<= 512 threads: 128 registers)
#define MAX_WARPS 8        // of a row's block: C <= 8 * 32 * 8 = 2,048
#define MAX_C (MAX_WARPS * 32 * 8)

// -- 8 elements as floats ---------------------------------------------------------------------------

__device__ __forceinline__ void load8(const float* p, float (&v)[8])
{
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_bits* p, float (&v)[8]) { unpack(*reinterpret_cast<const uint4*>(p), v); }

__device__ __forceinline__ void store8(float* p, const float (&v)[8])
{
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(bf16_bits* p, const float (&v)[8])
{
    uint4 u;
    u.x = float_to_bf16(v[0]) | ((unsigned)float_to_bf16(v[1]) << 16);
    u.y = float_to_bf16(v[2]) | ((unsigned)float_to_bf16(v[3]) << 16);
    u.z = float_to_bf16(v[4]) | ((unsigned)float_to_bf16(v[5]) << 16);
    u.w = float_to_bf16(v[6]) | ((unsigned)float_to_bf16(v[7]) << 16);
    *reinterpret_cast<uint4*>(p) = u;
}

// -- reductions over a block --------------------------------------------------------------------------

// The sums of a and b over the blockDim.x threads of this threadIdx.y, in each of them; scratch holds
// 2 MAX_WARPS floats per threadIdx.y. Every thread of the block must call it (two barriers).
__device__ __forceinline__ float2 row_sum2(float a, float b, float* scratch)
{
    const int warps = blockDim.x / 32;
    float* mine = scratch + threadIdx.y * 2 * MAX_WARPS;
    a = warp_sum(a);
    b = warp_sum(b);
    if (threadIdx.x % 32 == 0) {
        mine[threadIdx.x / 32] = a;
        mine[MAX_WARPS + threadIdx.x / 32] = b;
    }
    __syncthreads();
    float2 total = make_float2(0.0f, 0.0f);
    for (int w = 0; w < warps; ++w) {  // the same order in every thread
        total.x += mine[w];
        total.y += mine[MAX_WARPS + w];
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
    // M = max_c l_c, S = sum_c exp(l_c - M): each thread's pair rescaled once a vector when its max grows
    float m = -INFINITY, s = 0.0f;
    for (int c = 8 * threadIdx.x; c < ld; c += 8 * THREADS) {
        float l[8];
        load8(row + c, l);
        float vmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) vmax = c + j < V ? fmaxf(vmax, l[j]) : vmax;
        if (vmax == -INFINITY) continue;  // all padding (or all -inf)
        if (vmax > m) {
            s *= expf(m - vmax);
            m = vmax;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) s += c + j < V ? expf(l[j] - m) : 0.0f;
    }
    block_softmax_stats<THREADS>(m, s, scratch);  // its barriers also order the read of target_logit
    const float scale = 1.0f / (s * n);  // 1 / (S N), as the array code's 1 / (total * N)
    for (int c = 8 * threadIdx.x; c < ld; c += 8 * THREADS) {
        float d[8];
        load8(row + c, d);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            d[j] = c + j < V ? expf(d[j] - m) * scale : 0.0f;  // the padding: no probability, no gradient
            if (c + j == target) d[j] -= 1.0f / n;
        }
        store8(drow + c, d);
    }
    if (threadIdx.x == 0) losses[r] = valid ? logf(s) - (target_logit - m) : __int_as_float(0x7fc00000);
}

// -- LayerNorm -------------------------------------------------------------------------------------

template <typename W, typename OUT, bool RESIDUAL>
__global__ void __launch_bounds__(MAX_WARPS * 32)
layernorm_fwd(const float* __restrict__ x, const W* __restrict__ y, const W* __restrict__ y_bias,
              float* __restrict__ x_out, const W* __restrict__ weight, const W* __restrict__ bias, float eps,
              OUT* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd, int C)
{
    __shared__ float scratch[2 * MAX_WARPS];
    const long long at = (long long)blockIdx.x * C + 8 * threadIdx.x;  // this thread's 8 columns
    const bool live = 8 * (int)threadIdx.x < C;
    float v[8] = {}, sum = 0.0f;
    if (live) {
        load8(x + at, v);
        if (RESIDUAL) {  // x + (y + y_bias), the bias added in W as linear_forward adds it
            float a[8], b[8];
            load8(y + at, a);
            load8(y_bias + 8 * threadIdx.x, b);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] += round_as<W>(a[j] + b[j]);
            store8(x_out + at, v);
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += v[j];
    const float mu = row_sum2(sum, 0.0f, scratch).x / C;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += live ? (v[j] - mu) * (v[j] - mu) : 0.0f;
    const float rs = 1.0f / sqrtf(row_sum2(ss, 0.0f, scratch).x / C + eps);
    if (live) {
        float w[8], b[8];
        load8(weight + 8 * threadIdx.x, w);
        load8(bias + 8 * threadIdx.x, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = (v[j] - mu) * rs * w[j] + b[j];
        store8(out + at, v);
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu;
        rstd[blockIdx.x] = rs;
    }
}

template <typename W, bool ACCUMULATE>
__global__ void __launch_bounds__(MAX_WARPS * 32 * LN_ROWS)
layernorm_bwd(const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ mean,
              const float* __restrict__ rstd, const W* __restrict__ weight, float* __restrict__ dx,
              float* __restrict__ partial, int rows, int C)
{
    __shared__ float scratch[2 * MAX_WARPS * LN_ROWS];
    __shared__ float sums[LN_ROWS * MAX_C];
    const int c = 8 * threadIdx.x;
    const bool live = c < C;
    float w[8] = {}, dweight[8] = {}, dbias[8] = {};
    if (live) load8(weight + c, w);
    // every thread runs every turn (the barriers); a turn's rows past the end are no thread's work
    for (long long first = (long long)blockIdx.x * LN_ROWS; first < rows; first += (long long)gridDim.x * LN_ROWS) {
        const long long r = first + threadIdx.y;
        const bool mine = live && r < rows;
        float dy[8] = {}, norm[8] = {};
        float sum_dnorm = 0.0f, sum_dnorm_norm = 0.0f;
        float mu = 0.0f, rs = 0.0f;
        if (mine) {
            mu = mean[r];
            rs = rstd[r];
            load8(dout + r * C + c, dy);
            load8(x + r * C + c, norm);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                norm[j] = (norm[j] - mu) * rs;  // recomputed, as the array code does
                const float dnorm = dy[j] * w[j];
                sum_dnorm += dnorm;
                sum_dnorm_norm += dnorm * norm[j];
                dweight[j] += dy[j] * norm[j];
                dbias[j] += dy[j];
            }
        }
        const float2 s = row_sum2(sum_dnorm, sum_dnorm_norm, scratch);
        if (mine) {
            const float mean_dnorm = s.x / C, mean_dnorm_norm = s.y / C;
            float g[8];
            if (ACCUMULATE) load8(dx + r * C + c, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float d = rs * (dy[j] * w[j] - mean_dnorm - norm[j] * mean_dnorm_norm);
                g[j] = ACCUMULATE ? g[j] + d : d;
            }
            store8(dx + r * C + c, g);
        }
    }
    // the LN_ROWS rows' partial sums added in a fixed order: dweight's, then dbias's
    float* row = partial + (long long)blockIdx.x * 2 * C;
    for (int half = 0; half < 2; ++half) {
        if (live) store8(sums + threadIdx.y * MAX_C + c, half == 0 ? dweight : dbias);
        __syncthreads();
        if (live && threadIdx.y == 0) {
            float total[8];
            load8(sums + c, total);
            for (int y = 1; y < LN_ROWS; ++y) {
                float more[8];
                load8(sums + y * MAX_C + c, more);
#pragma unroll
                for (int j = 0; j < 8; ++j) total[j] += more[j];
            }
            store8(row + half * C + c, total);
        }
        __syncthreads();
    }
}

// -- GELU, bias gradients --------------------------------------------------------------------------

// GELU'(h) of the tanh form, as gpt2/backward.py's gelu_backward writes it.
__device__ __forceinline__ float gelu_tanh_grad(float h)
{
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    const float u = h * h;
    const float t = tanhf(c * h * (1.0f + 0.044715f * u));
    return 0.5f * (1.0f + t) + 0.5f * h * (1.0f - t * t) * c * (1.0f + 3 * 0.044715f * u);
}

template <typename T>
__global__ void __launch_bounds__(256)
bias_gelu(const T* __restrict__ y, const T* __restrict__ bias, T* __restrict__ h, T* __restrict__ g, int rows,
          int C)
{
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int c = 8 * threadIdx.x; c < C; c += 8 * blockDim.x) {
            float v[8], b[8];
            load8(y + r * C + c, v);
            load8(bias + c, b);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = round_as<T>(v[j] + b[j]);  // h as linear_forward rounds it
            store8(h + r * C + c, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = gelu_tanh(v[j]);
            store8(g + r * C + c, v);
        }
    }
}

template <typename IN, typename OUT, bool GELU>
__global__ void __launch_bounds__(256)
column_sums(const IN* __restrict__ in, const OUT* __restrict__ h, OUT* __restrict__ out, float* __restrict__ sums,
            int rows, int C, int rows_per_group)
{
    const int c = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= C) return;
    const long long first = (long long)blockIdx.y * rows_per_group;
    const long long last = first + rows_per_group < rows ? first + rows_per_group : rows;
    float total[8] = {};
#pragma unroll 4
    for (long long r = first; r < last; ++r) {
        float v[8];
        load8(in + r * C + c, v);
        if (GELU) {
            float hv[8];
            load8(h + r * C + c, hv);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] *= gelu_tanh_grad(hv[j]);
        }
        if (out != nullptr) store8(out + r * C + c, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) total[j] += v[j];
    }
    store8(sums + (long long)blockIdx.y * C + c, total);
}

__global__ void __launch_bounds__(1024)
column_total(const float* __restrict__ partial, float* __restrict__ sums, int groups, int C)
{
    __shared__ float slices[32][33];  // [slice][column], padded against bank conflicts
    const int c = blockIdx.x * 32 + threadIdx.x;
    float total = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (int g = threadIdx.y; g < groups; g += 32) total += partial[(long long)g * C + c];
    }
    slices[threadIdx.y][threadIdx.x] = total;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        total = 0.0f;
        for (int y = 0; y < 32; ++y) total += slices[y][threadIdx.x];
        sums[c] = total;
    }
}

// -- layouts ---------------------------------------------------------------------------------------

// 8 elements from src to dst, as they are (one or two 16-byte vectors).
template <typename T>
__device__ __forceinline__ void copy8(T* __restrict__ dst, const T* __restrict__ src)
{
#pragma unroll
    for (int i = 0; i < (int)sizeof(T) / 2; ++i)
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
}

template <typename T, bool TO_ROWS, bool BIAS>
__global__ void __launch_bounds__(256)
heads_rows(T* __restrict__ a0, T* __restrict__ a1, T* __restrict__ a2, T* __restrict__ rows_of,
           const T* __restrict__ bias, int rows, int T_len, int NH, int hs, long long row_stride)
{
    static_assert(!(TO_ROWS && BIAS), "the bias is added on the way into the heads");
    T* heads = blockIdx.y == 0 ? a0 : blockIdx.y == 1 ? a1 : a2;
    const int C = NH * hs;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long b = r / T_len, t = r - b * T_len;  // once a row
        T* row = rows_of + r * row_stride + (long long)blockIdx.y * C;
        for (int c = 8 * threadIdx.x; c < C; c += 8 * blockDim.x) {
            const int head = c / hs, d = c - head * hs;  // 8 elements of one head: hs % 8 == 0
            T* in_heads = heads + ((b * NH + head) * T_len + t) * hs + d;
            if (TO_ROWS) {
                copy8(row + c, in_heads);
            } else if (BIAS) {  // q, k, v = the product + its bias, rounded to T as linear_forward's add
                float v[8], bv[8];
                load8(row + c, v);
                load8(bias + blockIdx.y * C + c, bv);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] += bv[j];
                store8(in_heads, v);
            } else {
                copy8(in_heads, row + c);
            }
        }
    }
}

__global__ void __launch_bounds__(256)
embed_bwd(const float* __restrict__ dx, const int* __restrict__ order, const int* __restrict__ tokens,
          float* __restrict__ dwte, int N, int C)
{
    const int first = blockIdx.x, v = tokens[first];
    if (first > 0 && tokens[first - 1] == v) return;  // not the first row of its token's run
    for (int c = 8 * threadIdx.x; c < C; c += 8 * blockDim.x) {
        float total[8];
        load8(dwte + (long long)v * C + c, total);
        for (int j = first; j < N && tokens[j] == v; ++j) {
            float row[8];
            load8(dx + (long long)order[j] * C + c, row);
#pragma unroll
            for (int e = 0; e < 8; ++e) total[e] += row[e];
        }
        store8(dwte + (long long)v * C + c, total);
    }
}
