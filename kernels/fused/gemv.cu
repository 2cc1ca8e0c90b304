/*
 * gemv - one linear layer of a batch-1 decode step: out = epilogue(W x_in + bias), where x_in is the
 * input vector or, fused in front, LayerNorm of it.
 *
 * The operation, and what it replaces (gpt2/model.py, one token):
 *   EPI_BIAS      out = LN(x) @ W + b           ln_1 + attn.c_attn  (LN = true)
 *   EPI_GELU      out = gelu(LN(x) @ W + b)     ln_2 + mlp.c_fc + gelu
 *   EPI_RESIDUAL  out += x @ W + b              attn.c_proj or mlp.c_proj + the residual add (out is x)
 *
 * Why it is shaped this way: at batch 1 a linear layer reads each weight once and does one FMA with
 * it, so it runs at the speed of memory. W is the transposed copy the engine makes once at load,
 * (N, K) row-major: output n's K weights are contiguous, so a warp reads a whole row with 16-byte
 * loads, 512 contiguous bytes per instruction across the warp, and reduces it with shuffles: no
 * shared-memory reduction, no second pass, no atomics. Each lane issues all ROWS x ITERS of its loads
 * before the first use (they sit in registers while the block stages the input vector and computes
 * LayerNorm), so a warp has up to ROWS * K * sizeof(weight) bytes in flight.
 *
 * Template parameters: weight_t (float, or unsigned short holding bfloat16 bits), K (input width,
 * a multiple of the 16-byte vector: 4 floats or 8 bfloat16), WARPS per block, ROWS (outputs per
 * warp), LN (LayerNorm the input first), EPI (the epilogue above).
 * Geometry: grid ceil(N / (WARPS * ROWS)), block WARPS * 32 threads. Lane l of a warp reads 16-byte
 * vectors l, l + 32, ... of its rows (ITERS = ceil(K / vector / 32) per row), holding
 * ROWS * ITERS * 4 registers of weights. Shared memory: the input, K floats (3 KB at K = 768,
 * 12 KB at K = 3072), plus one float per warp for the LayerNorm sums.
 * After its loads, each block asks L2 to prefetch its share of `prefetch` (the next kernel's
 * weights), so that DRAM keeps streaming through the launch gap. Under programmatic dependent
 * launch the loads and the prefetch overlap the previous kernel; the input is read after
 * griddep_wait() (common.cuh).
 * Limits: K % vector == 0; the input and bias are float32; accumulation is float32.
 */
#include "common.cuh"

#define EPI_BIAS 0
#define EPI_GELU 1
#define EPI_RESIDUAL 2

template <typename weight_t, int K, int WARPS, int ROWS, bool LN, int EPI>
__global__ void __launch_bounds__(WARPS * 32)
gemv(const weight_t* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ x,
     const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps, float* __restrict__ out, int N,
     const char* prefetch, unsigned long long prefetch_bytes)
{
    constexpr int THREADS = WARPS * 32;
    constexpr int VEC = Vec16<weight_t>::N;
    static_assert(K % VEC == 0, "a row must be whole 16-byte vectors");
    constexpr int CHUNKS = K / VEC;  // 16-byte vectors per row
    constexpr int ITERS = (CHUNKS + 31) / 32;
    __shared__ __align__(16) float x_s[K];
    __shared__ float scratch[WARPS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * WARPS + warp) * ROWS;

    // Every weight this lane needs, in flight at once; rows past N read nothing.
    uint4 w[ROWS][ITERS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const weight_t* row = W + (long long)(n0 + r) * K;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = i * 32 + lane;
            w[r][i] = (n0 + r < N && c < CHUNKS) ? load16(row + c * VEC) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    prefetch_l2(prefetch, prefetch_bytes);
    griddep_wait();  // from here on, the previous kernel's outputs (x) are complete
    griddep_launch_dependents();

    // The input (LayerNorm'd if LN) into shared memory while the weights arrive.
    stage_input<K, THREADS, LN>(x, nullptr, nullptr, ln_w, ln_b, eps, x_s, scratch);

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
        acc = warp_sum(acc);  // every lane holds the row's dot product
        const int n = n0 + r;
        if (lane == 0 && n < N) {
            const float v = acc + bias[n];
            if (EPI == EPI_BIAS) out[n] = v;
            else if (EPI == EPI_GELU) out[n] = gelu_tanh(v);
            else out[n] = fresh(out + n) + v;  // EPI_RESIDUAL: x + (y @ W + b), as the eager model adds it
        }
    }
}
