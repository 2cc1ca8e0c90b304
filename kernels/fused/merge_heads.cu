/*
 * merge_heads - attention's (NH, T, HS) output back to (T, C) rows, the heads side by side.
 *
 * Replaces `y.transpose(0, 2, 1, 3).reshape(B, T, C)` of gpt2/model.py attention() (batch 1) for the
 * eager fast path; the input is read through its head and row strides (in elements), so any
 * attention's output layout works.
 * Template parameter: T, float or bfloat16 bits (unsigned short), the attention's dtype: copied as is.
 * Geometry: a grid-stride loop over the T * C outputs.
 */
template <typename T>
__global__ void __launch_bounds__(256)
merge_heads(const T* __restrict__ y, long long stride_h, long long stride_t, T* __restrict__ out, int n_rows,
            int n_head, int head_size)
{
    const int C = n_head * head_size;
    const long long total = (long long)n_rows * C;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < total; i += (long long)gridDim.x * 256) {
        const long long t = i / C;
        const int c = (int)(i % C), h = c / head_size, d = c % head_size;
        out[i] = y[h * stride_h + t * stride_t + d];
    }
}
