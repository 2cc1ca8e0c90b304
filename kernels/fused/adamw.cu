/*
 * adamw - the optimizer step of every parameter tensor in two launches (lm/adamw.py's multi-tensor path),
 * where the per-tensor path takes a cupy reduction per tensor for the global norm and an
 * ElementwiseKernel per tensor for the update: GPT-2 small's 148 tensors cost some 600 launches of
 * about 20 us each from Python, while the bytes (p, g, m, v read, p, m, v written) take about 1 ms.
 *
 *   adamw_sum_squares<THREADS>     the gradients' global 2-norm and the clipping scale it gives: each
 *                                  block sums the squares of one chunk (float32) into partial[block];
 *                                  the last block to finish (a ticket counter, reset by that block for
 *                                  the next launch) adds the partials in double in a fixed order and
 *                                  writes out[0] = total (the norm, double) and scale[0] =
 *                                  max_norm / (total + 1e-6) rounded to float where max_norm > 0 and
 *                                  that is below 1, else 1 (clip_grad_norm_'s semantics, on the device
 *                                  so that the step needs no host round trip).
 *   adamw_step<THREADS>            g = g * scale, then lm/adamw.py's update of p, m and v in its order
 *                                  of operations. Compiled with -fmad=false as the per-tensor
 *                                  ElementwiseKernel is, so that the two round alike, bit for bit.
 *   adamw_step_graph<THREADS>      the same update, its step's scalars (the learning rate's, the bias
 *                                  corrections') read from device memory, hyper[0..6], not passed by
 *                                  value: a CUDA graph that captured the launch (train.py --graph)
 *                                  replays it with the scalars copied there before each replay. The
 *                                  same float32 values, whichever way they arrive, round alike.
 *
 * Template parameter THREADS, the block (256); CHUNK = 32 THREADS.
 *
 * Pointer tables: table[0..3][tensor] are the addresses of p, g, m, v (float32, contiguous), sizes[tensor]
 * their elements. A tensor is cut into chunks of CHUNK elements; block b takes chunk b - first_block[t]
 * of tensor t = block_tensor[b] (both tables built once on the host, the shapes being fixed), elements
 * [chunk * CHUNK, min(size, (chunk + 1) * CHUNK)), thread i the elements start + i, start + i + THREADS,
 * ... Geometry: grid (sum over tensors of ceil(size / CHUNK)), block THREADS; scalar loads, coalesced
 * across a warp (a tensor of 17 elements needs no tail case, and chunk starts need no alignment).
 */
#include "common.cuh"

// The elements [start, end) of this block's chunk, and its tensor.
template <int THREADS>
__device__ __forceinline__ int chunk_of(const int* block_tensor, const int* first_block, const long long* sizes,
                                        long long& start, long long& end)
{
    constexpr long long CHUNK = THREADS * 32;  // elements a block takes: 32 a thread
    const int t = block_tensor[blockIdx.x];
    start = (long long)(blockIdx.x - first_block[t]) * CHUNK;
    end = min(sizes[t], start + CHUNK);
    return t;
}

__device__ __forceinline__ double warp_sum_double(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) adamw_sum_squares(
    const unsigned long long* table, const long long* sizes, const int* block_tensor, const int* first_block,
    int n_tensors, double max_norm, float* partial, unsigned int* ticket, double* out, float* scale)
{
    __shared__ float warp_partial[THREADS / 32];
    __shared__ double warp_total[THREADS / 32];
    __shared__ bool last;
    long long start, end;
    const int t = chunk_of<THREADS>(block_tensor, first_block, sizes, start, end);
    const float* g = reinterpret_cast<const float*>(table[n_tensors + t]);  // row 1: the gradients
    float s = 0.0f;
#pragma unroll 8
    for (long long i = start + threadIdx.x; i < end; i += THREADS) {
        const float x = __ldg(g + i);
        s += x * x;
    }
    s = block_sum<THREADS>(s, warp_partial);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = s;
        __threadfence();  // the partial is visible to every block before this block's ticket is
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    // The last block: every partial is written. Each thread adds a strided set in double, then the warps'.
    double total = 0.0;
    for (unsigned int b = threadIdx.x; b < gridDim.x; b += THREADS) total += (double)__ldcg(partial + b);
    total = warp_sum_double(total);
    if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        total = 0.0;
        for (int w = 0; w < THREADS / 32; ++w) total += warp_total[w];
        const double norm = sqrt(total);
        const double coef = max_norm / (norm + 1e-6);
        out[0] = norm;
        scale[0] = (max_norm > 0.0 && coef < 1.0) ? (float)coef : 1.0f;
        *ticket = 0u;  // ready for the next launch
    }
}

template <int THREADS>
__device__ __forceinline__ void update(
    const unsigned long long* table, const long long* sizes, const int* block_tensor, const int* first_block,
    const int* decays, int n_tensors, const float* scale, float keep_decay, float one_minus_beta1, float beta2,
    float one_minus_beta2, float step_size, float bc2_sqrt, float eps)
{
    long long start, end;
    const int t = chunk_of<THREADS>(block_tensor, first_block, sizes, start, end);
    float* p = reinterpret_cast<float*>(table[t]);
    const float* g = reinterpret_cast<const float*>(table[n_tensors + t]);
    float* m = reinterpret_cast<float*>(table[2 * n_tensors + t]);
    float* v = reinterpret_cast<float*>(table[3 * n_tensors + t]);
    const float keep = decays[t] ? keep_decay : 1.0f;  // the per-tensor path's 1 - lr * 0 is 1 exactly
    const float s = *scale;
    for (long long i = start + threadIdx.x; i < end; i += THREADS) {
        const float gi = g[i] * s;  // clip_grad_norm's g *= scale (1: g unchanged)
        float pi = p[i] * keep;
        const float mi = m[i] + one_minus_beta1 * (gi - m[i]);
        const float vi = beta2 * v[i] + one_minus_beta2 * (gi * gi);
        pi = pi - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) adamw_step(
    const unsigned long long* table, const long long* sizes, const int* block_tensor, const int* first_block,
    const int* decays, int n_tensors, const float* scale, float keep_decay, float one_minus_beta1, float beta2,
    float one_minus_beta2, float step_size, float bc2_sqrt, float eps)
{
    update<THREADS>(table, sizes, block_tensor, first_block, decays, n_tensors, scale, keep_decay, one_minus_beta1,
                    beta2, one_minus_beta2, step_size, bc2_sqrt, eps);
}

// hyper: 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t), sqrt(1 - beta2^t), eps
template <int THREADS>
__global__ void __launch_bounds__(THREADS) adamw_step_graph(
    const unsigned long long* table, const long long* sizes, const int* block_tensor, const int* first_block,
    const int* decays, int n_tensors, const float* scale, const float* hyper)
{
    update<THREADS>(table, sizes, block_tensor, first_block, decays, n_tensors, scale, hyper[0], hyper[1], hyper[2],
                    hyper[3], hyper[4], hyper[5], hyper[6]);
}
