/*
 * merge_heads - attention's (NH, T, HS) output back to (T, C) rows, the heads side by side.
 *
 * Replaces `y.transpose(0, 2, 1, 3).reshape(B, T, C)` of gpt2/model.py attention() (batch 1) for the
 * eager fast path; the input is read through its head and row strides (in elements), so any
 * attention's output layout works.
 * Template parameter: T, float or bfloat16 bits (unsigned short), the attention's dtype: copied as is.
 * Geometry: a block an output row (a grid-stride loop over the rows), its threads over the row's C
 * columns: 16 bytes a thread at a time (Vec16) where a head's HS elements are whole vectors and the
 * strides and addresses keep them on 16-byte boundaries (every GPT-2 size, with the attention's own
 * output), else one element (as kv_store.cu, for the bandwidth).
 */
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(256)
merge_heads(const T* __restrict__ y, long long stride_h, long long stride_t, T* __restrict__ out, int n_rows,
            int n_head, int head_size)
{
    constexpr int V = Vec16<T>::N;
    const int C = n_head * head_size;
    const bool wide = head_size % V == 0 && stride_h % V == 0 && stride_t % V == 0 && aligned16(y) && aligned16(out);
    const int step = wide ? V : 1;
    for (int t = blockIdx.x; t < n_rows; t += gridDim.x) {
        for (int c = threadIdx.x * step; c < C; c += blockDim.x * step) {
            const int h = c / head_size, d = c % head_size;
            const T* from = y + h * stride_h + t * stride_t + d;
            T* to = out + (long long)t * C + c;
            if (wide)
                move16(to, from);
            else
                *to = *from;
        }
    }
}
