/*
 * v16 - decode: a few query rows per block, the keys split across blocks (flash-decoding) and the
 * splits combined by the block that starts last.
 *
 * The change (against v13): a block takes a short tile of B_r query rows (one new token, or a few)
 * and only one split of the keys; the launcher starts `splits` blocks per tile, each writes an
 * unnormalised partial O_i with its (m_i, l_i) to the workspace, and the last of them to start
 * combines the partials into O. Inside a block the 4 warps split the keys again and meet in shared
 * memory. K and V go straight from global memory to registers: no tiles in shared memory.
 *
 * Why it helps:
 *   - A decode step is one query row against T_k keys: 2 flops per element of K and V read (half a
 *     flop per byte in float32), so it is bound by memory bandwidth, and v13 gives it one block per
 *     head (12 blocks for GPT-2 on 132 SMs). With the keys split, the grid has about two blocks per
 *     SM whatever B and NH are (runtime.Instance.splits), and every SM streams its share of K and V.
 *   - Many bytes in flight per thread: a key row is spread over G lanes that load F 16-byte chunks
 *     each (G * F chunks = one row), a warp covers 32 / G keys per load, and each lane holds U steps
 *     of keys, K and V, in registers. The next step's K is requested as soon as the scores are taken
 *     from the K registers, its V as soon as P V has used the V registers: no barrier in the key
 *     loop, and each warp keeps U * 32 / G rows of K and of V on their way (8 KB at d = 128).
 *   - 16-bit inputs (dtype_id 1 = bfloat16, 2 = float16) halve the bytes: the same 16-byte loads
 *     carry 8 elements, widened to float in registers; softmax, P and every sum stay float32, and
 *     only O is rounded, once.
 *   - The G lanes of a row add up the dot product with log2(G) shuffles; each group of G lanes keeps
 *     its own (m_i, l_i, O_i) over its keys, and the groups, then the warps, merge once at the end.
 *   - Grouped-query attention: when the query heads of a group fit into a block's rows
 *     (heads * rows <= B_r) and the blocks left busy still cover the SMs (%nsmid), the block of the
 *     group's first head serves all of them and the other blocks exit at once: K and V of a KV head
 *     are read once instead of once per query head. Otherwise each query head reads its own.
 *   - The combine needs no second launch and no fence. At a decode step most of the time is a chain
 *     of round trips, not bytes, so the combine is built to add as few as it can:
 *     - Each block draws a ticket on its tile's counter (atomicAdd) before its keys arrive, so the
 *       atomic's round trip passes under the loads. The block that draws splits - 1 started last
 *       and combines; every block it waits for has drawn before it, so is already running, and
 *       waits for nothing: no deadlock, however many blocks the grid has.
 *     - The other blocks publish their partial (O_i unnormalised, m_i, l_i) word by word, each word
 *       stored as ~bits (a NaN first made the canonical 0x7fffffff), never 0, and relaxed at GPU
 *       scope, straight to L2. The combining block polls the words until none is 0: the data is
 *       its own flag, so no __threadfence (a round trip for the stores' acknowledgement) and no
 *       second round trip for the counter after it. It keeps its own partial in shared memory.
 *     - The combining block merges in split order, its own in its place (the same bits whichever
 *       block combines), writes O, and puts 0 back in every word it read and in the counter: the
 *       workspace is all zeros between launches.
 *     With splits = 1 the block writes O at once and touches neither partials nor counter.
 *   - The decode case (one query tile, one query head per K/V head) computes its indices without an
 *     integer division: each costs a chain of ~15 dependent instructions before the first load.
 *
 * Geometry: grid (T_r * splits, NH, B) with T_r = ceil(T_q / B_r), so splits = gridDim.x / T_r;
 * blockIdx.x = tile rank * splits + split, the tiles counted down (with T_q = T_k the tiles that see
 * the most keys start first). Block 128 threads = 4 warps. Query rows of a block: heads x rows of
 * its tile, at most B_r; the key loop is compiled for R = 1, 2, 4 or B_r rows, the smallest that
 * holds them.
 * Lane l of warp w: key slot l / G, chunks l % G + G f (f < F) of the row. Per step a warp takes
 * U * 32 / G consecutive keys, U = B_c / (4 * 32 / G) / R (at least 1): fewer keys in flight as more
 * rows hold registers. Keys are split across blocks in whole tiles of B_c: with key_tiles tiles, each
 * split takes key_tiles / splits of them and the first key_tiles % splits one more. With one tile
 * per split (GPT-2 decode up to 1024 keys at B_c = 64), every load of a block is in flight at once.
 *   float32: d = 32: G = 8, F = 1; d = 64: G = 16, F = 1; d = 96: G = 8, F = 3; d = 128: G = 32, F = 1.
 *   16-bit:  d = 32: G = 4, F = 1; d = 64: G = 8, F = 1;  d = 96: G = 4, F = 3; d = 128: G = 16, F = 1.
 *   float32 d = 64, B_c = 64, R = 1: U = 8, 16 keys per warp per step, a block's 64 keys in one step;
 *   bfloat16 d = 128, B_c = 64, R = 1: U = 8, 16 keys (4 KB of K and 4 KB of V) per warp per step.
 * Shared memory, in floats: Q_i (B_r x d, used when a lane's share of Q_i passes 8 floats; then the
 *   combining block's own O_i) + the merge area max(4 warps x B_r x (d + 2), 6 x 128): each warp's
 *   (O_i, m_i, l_i), reused by the combining block for its per-thread partial merges; statically,
 *   the combining block's own (m_i, l_i) (B_r x 2) and its flag.
 *   d = 64, B_r = 8: 4 * (512 + 2112) = 10,496 bytes; d = 128, B_r = 8: 20,736 bytes;
 *   d = 32, B_r = 8: 5,376 bytes; d = 96, B_r = 2: 3,904 bytes; 16-bit d = 128, B_r = 4: 10,368 bytes.
 *   B_r is 8 in float32 and 4 in 16 bits (2 at d = 96): the rows' O_i stay in registers, at most 128
 *   per thread (__launch_bounds__(128, 4)): four blocks, 16 warps, per SM. A decode row (T_q = 1)
 *   runs the R = 1 loop whatever B_r is. (64, 8, 32, 0) is declared to be compared with
 *   config=...: half the keys per block, up to twice the splits (runtime.Instance.splits).
 * Workspace (runtime.Instance.workspace_floats), in floats: O partials (B * NH * T_q * splits * d),
 *   then (m, l) pairs (B * NH * T_q * splits * 2), then one counter per (batch, head, tile); all
 *   zero between launches (runtime.prepare zeroes it once; every launch leaves it so). GPT-2 decode
 *   at T_k = 1024 (12 heads, 16 splits): 12,672 floats + 12 counters.
 *
 * Limits: d_head a multiple of 8 (declared: 32, 64, 96, 128). Every row of Q, K and V must start
 * on a 16-byte boundary: the launcher copies views whose rows do not (runtime.prepare). A tile of
 * many rows (T_q = T_k) is correct but slow: every tile reads its keys again, B_r rows at a time.
 * GQA's shared reads need the blocks of a group to be few enough that one in `heads` still covers the
 * SMs; with the launcher's splits counted per query head that holds for large batches only.
 * One launch at a time per workspace (runtime.prepare keeps one per instance and size): two launches
 * in flight on one workspace would mix their tickets and partials.
 *
 * lab.template    d_head, B_r, B_c, dtype_id
 * lab.configs     (64, 8, 64, 0), (64, 8, 32, 0), (32, 8, 128, 0), (96, 2, 32, 0), (128, 8, 32, 0), (64, 4, 64, 1), (32, 4, 128, 1), (96, 2, 64, 1), (128, 4, 64, 1), (64, 4, 64, 2), (32, 4, 128, 2), (96, 2, 64, 2), (128, 4, 64, 2)
 * lab.threads     128
 * lab.smem        4 * (B_r * d_head + max(4 * B_r * (d_head + 2), 768))
 * lab.strided     true
 * lab.dtypes      float32, bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.split_kv    true
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr unsigned FULL_WARP = 0xffffffffu;

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// -- elements: dtype_id indexes lab.dtypes (0 float32, 1 bfloat16, 2 float16) ----------------------

template <int dtype_id> struct Element { using type = unsigned short; };  // 16-bit: the raw bits
template <> struct Element<0> { using type = float; };
template <int dtype_id> using element_t = typename Element<dtype_id>::type;

// Elements in one 16-byte chunk: the unit of every load of Q, K and V.
__host__ __device__ constexpr int per_chunk(int dtype_id) { return dtype_id == 0 ? 4 : 8; }

// Lanes that share one key row: the largest power of two, at most 32, dividing its number of
// chunks, so that every lane of the row holds the same number of chunks.
__host__ __device__ constexpr int lanes_per_row(int chunks)
{
    return chunks % 32 == 0 ? 32 : chunks % 16 == 0 ? 16 : chunks % 8 == 0 ? 8 : chunks % 4 == 0 ? 4 : chunks % 2 == 0 ? 2 : 1;
}

// Widen a chunk to floats: float32 as it is, bfloat16 by a shift (it is the top half of a float),
// float16 by cvt.
template <int dtype_id>
__device__ __forceinline__ void unpack(const uint4& raw, float (&x)[per_chunk(dtype_id)])
{
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (dtype_id == 0) {
            x[i] = __uint_as_float(w[i]);
        } else if constexpr (dtype_id == 1) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
                : "=f"(x[2 * i]), "=f"(x[2 * i + 1]) : "r"(w[i]));
        }
    }
}

// Four floats stored as four elements (16 or 8 bytes), rounded to nearest even; element by element
// when the address is not aligned for one vector store.
template <int dtype_id>
__device__ __forceinline__ void store4(element_t<dtype_id>* p, float4 x, bool vec)
{
    if constexpr (dtype_id == 0) {
        if (vec)
            *reinterpret_cast<float4*>(p) = x;
        else
            p[0] = x.x, p[1] = x.y, p[2] = x.z, p[3] = x.w;
    } else {
        unsigned lo, hi;  // cvt puts its first source in the upper half
        if constexpr (dtype_id == 1) {
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(x.y), "f"(x.x));
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x.w), "f"(x.z));
        } else {
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(x.y), "f"(x.x));
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x.w), "f"(x.z));
        }
        if (vec) {
            *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
        } else {
            p[0] = (unsigned short)(lo & 0xffff), p[1] = (unsigned short)(lo >> 16);
            p[2] = (unsigned short)(hi & 0xffff), p[3] = (unsigned short)(hi >> 16);
        }
    }
}

// -- arithmetic -------------------------------------------------------------------------------------

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The weights that merge two online-softmax states (m, l, O) and (m2, l2, O2), both in log2
// units: m_new = max(m, m2), a = 2^(m - m_new), b = 2^(m2 - m_new). A state with no key yet has
// m = -inf and gets weight 0; when both are empty, m_new = -inf and 0 stands in for it, so that
// no -inf - -inf = NaN appears.
__device__ __forceinline__ void merge_weights(float m, float m2, float& m_new, float& a, float& b)
{
    m_new = fmaxf(m, m2);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    a = exp2_approx(m - m_use);
    b = exp2_approx(m2 - m_use);
}

__device__ __forceinline__ float4 scaled(float4 x, float s) { return make_float4(x.x * s, x.y * s, x.z * s, x.w * s); }

// x * a + y * b, per component
__device__ __forceinline__ float4 blend(float4 x, float a, float4 y, float b)
{
    return make_float4(fmaf(x.x, a, y.x * b), fmaf(x.y, a, y.y * b), fmaf(x.z, a, y.z * b), fmaf(x.w, a, y.w * b));
}

// -- memory -----------------------------------------------------------------------------------------

// Read Q_i from shared memory at every step: hoisted out of the key loop, R rows of it would hold
// R * d / G registers for the whole loop.
__device__ __forceinline__ float4 load_shared(const float* p)
{
    float4 x;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
    return x;
}

// The partials travel without fences: every word is published on its own, encoded so that it is
// never 0 (~bits, a NaN first made the canonical 0x7fffffff: 0xffffffff is a NaN), and the workspace
// holds 0 wherever nothing is published. The combining block polls each word until it is not 0,
// decodes it and puts the 0 back. Relaxed at GPU scope: read and written in L2, never a stale line
// of an SM's L1, and no ordering between words is needed, so no fence and no second round trip.
__device__ __forceinline__ unsigned encode(float x)
{
    const unsigned bits = __float_as_uint(x);
    return ~((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fffffffu : bits);
}

__device__ __forceinline__ float decode(unsigned word) { return __uint_as_float(~word); }

__device__ __forceinline__ void publish4(float* p, float4 x)
{
    asm volatile("st.relaxed.gpu.global.v4.b32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(encode(x.x)), "r"(encode(x.y)), "r"(encode(x.z)), "r"(encode(x.w)) : "memory");
}

__device__ __forceinline__ void publish2(float* p, float x, float y)
{
    asm volatile("st.relaxed.gpu.global.v2.b32 [%0], {%1, %2};" :: "l"(p), "r"(encode(x)), "r"(encode(y)) : "memory");
}

__device__ __forceinline__ uint4 poll4(const float* p)
{
    uint4 x;
    asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p) : "memory");
    return x;
}

__device__ __forceinline__ uint2 poll2(const float* p)
{
    uint2 x;
    asm volatile("ld.relaxed.gpu.global.v2.b32 {%0, %1}, [%2];" : "=r"(x.x), "=r"(x.y) : "l"(p) : "memory");
    return x;
}

__device__ __forceinline__ void clear4(float* p)
{
    asm volatile("st.relaxed.gpu.global.v4.b32 [%0], {%1, %1, %1, %1};" :: "l"(p), "r"(0u) : "memory");
}

__device__ __forceinline__ void clear2(float* p)
{
    asm volatile("st.relaxed.gpu.global.v2.b32 [%0], {%1, %1};" :: "l"(p), "r"(0u) : "memory");
}

// Request U keys of one lane: rows row0, row0 + KPW rows, ... (F chunks, G chunks apart, in each).
// Keys from `keys_left` on are past the split: not read, zeros.
template <int U, int F, int G, int KPW, int E, typename T>
__device__ __forceinline__ void load_keys(uint4 (&buf)[U][F], const T* __restrict__ row0, long long row_stride, int keys_left)
{
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        const T* row = row0 + u * KPW * row_stride;
        #pragma unroll
        for (int f = 0; f < F; ++f)
            buf[u][f] = u * KPW < keys_left ? __ldg(reinterpret_cast<const uint4*>(row + E * G * f)) : make_uint4(0, 0, 0, 0);
    }
}

// -- the key loop -----------------------------------------------------------------------------------

// What one block computes: `rows` query rows (heads x rows_per_head) over keys k_begin .. k_end - 1
// of one K/V head.
template <typename T>
struct Split {
    const T* Q_first;          // row row_start of the block's first query head
    long long q_head_stride, q_row_stride;
    const T* K_head;
    const T* V_head;
    long long kv_row_stride;
    int k_begin, k_end;
    int rows, rows_per_head, row_start;
    int key_offset;            // T_k - T_q: causal query row i sees keys j <= i + key_offset
    int T_k, causal;
    float scale_log2;          // scale * log2(e): scores in log2 units, exp(x) becomes one exp2
};

// The key loop for R query rows: each warp leaves its (O_i, m_i, l_i) over its keys, one row per
// r < R, in the merge area (merge_O: warp x B_r x d, merge_ml: warp x B_r x 2).
template <int d_head, int B_r, int B_c, int dtype_id, int R>
__device__ __forceinline__ void attend_keys(const Split<element_t<dtype_id>>& sp, float* Q_smem, float* merge_O,
                                            float* merge_ml)
{
    constexpr int E = per_chunk(dtype_id);              // elements per 16-byte chunk
    constexpr int CHUNKS = d_head / E;                  // chunks in a row
    constexpr int G = lanes_per_row(CHUNKS);            // lanes per key row
    constexpr int F = CHUNKS / G;                       // chunks per lane
    constexpr int FE = F * E;                           // elements of a row per lane
    constexpr int KPW = 32 / G;                         // keys per warp per load
    constexpr int U_FULL = B_c / (WARPS * KPW);
    constexpr int U = cmax(1, U_FULL / R);              // fewer keys in flight as rows take registers
    constexpr int STEP = WARPS * U * KPW;               // keys per block step
    constexpr bool Q_IN_REGISTERS = R * FE <= 8;       // else Q_i is read from shared memory
    static_assert(d_head % E == 0, "rows are read in 16-byte chunks");
    static_assert(U_FULL * WARPS * KPW == B_c, "B_c must be a multiple of 4 warps x keys per warp load");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = lane / G, part = lane % G;
    const int lane_key = sp.k_begin + warp * (U * KPW) + slot;  // this lane's first key
    const int n_steps = (sp.k_end - sp.k_begin + STEP - 1) / STEP;
    const long long step_stride = STEP * sp.kv_row_stride;
    const element_t<dtype_id>* K_row = sp.K_head + lane_key * sp.kv_row_stride + E * part;  // this lane's chunks
    const element_t<dtype_id>* V_row = sp.V_head + lane_key * sp.kv_row_stride + E * part;

    // The first keys and values are requested before anything else: Q_i is small and arrives meanwhile.
    uint4 k_reg[U][F], v_reg[U][F];
    load_keys<U, F, G, KPW, E>(k_reg, K_row, sp.kv_row_stride, sp.k_end - lane_key);
    load_keys<U, F, G, KPW, E>(v_reg, V_row, sp.kv_row_stride, sp.k_end - lane_key);

    // Q_i, widened to float and pre-scaled by scale * log2(e); rows past sp.rows are zeros
    // (finite scores, never stored).
    float q_reg[Q_IN_REGISTERS ? R : 1][FE];
    if constexpr (Q_IN_REGISTERS) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const element_t<dtype_id>* src = sp.Q_first + (r / sp.rows_per_head) * sp.q_head_stride
                                             + (r % sp.rows_per_head) * sp.q_row_stride;
            #pragma unroll
            for (int f = 0; f < F; ++f) {
                float x[E];
                unpack<dtype_id>(r < sp.rows ? *reinterpret_cast<const uint4*>(src + E * (part + G * f)) : make_uint4(0, 0, 0, 0), x);
                #pragma unroll
                for (int e = 0; e < E; ++e)
                    q_reg[r][f * E + e] = x[e] * sp.scale_log2;
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < R * CHUNKS; idx += THREADS) {
            const int r = idx / CHUNKS, c = idx % CHUNKS;
            float x[E];
            unpack<dtype_id>(r < sp.rows ? *reinterpret_cast<const uint4*>(sp.Q_first + (r / sp.rows_per_head) * sp.q_head_stride
                                                                          + (r % sp.rows_per_head) * sp.q_row_stride + E * c)
                                         : make_uint4(0, 0, 0, 0), x);
            #pragma unroll
            for (int e = 0; e < E; e += 4)
                *reinterpret_cast<float4*>(&Q_smem[r * d_head + E * c + e]) =
                    make_float4(x[e] * sp.scale_log2, x[e + 1] * sp.scale_log2, x[e + 2] * sp.scale_log2, x[e + 3] * sp.scale_log2);
        }
        __syncthreads();
    }

    // Keys row r may see in this split: below lim[r] (0 for rows not in use: all masked).
    int lim[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = sp.row_start + r % sp.rows_per_head;
        const int visible = sp.causal ? min(max(i + sp.key_offset + 1, 0), sp.T_k) : sp.T_k;
        lim[r] = r < sp.rows ? min(visible, sp.k_end) : 0;
    }

    float O_acc[R][FE];  // this lane's elements E (part + G f) + e of O_i
    float m_i[R], l_i[R];  // each slot of G lanes has its own, over its own keys
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        m_i[r] = -INFINITY;
        l_i[r] = 0.0f;
        #pragma unroll
        for (int j = 0; j < FE; ++j)
            O_acc[r][j] = 0.0f;
    }

    for (int step = 0; step < n_steps; ++step) {
        const int key0 = lane_key + step * STEP;

        // S_ij = Q_i K_j^T: this lane's F chunks of each key, then a sum over the G lanes of the row
        float S[R][U];
        #pragma unroll
        for (int r = 0; r < R; ++r)
            #pragma unroll
            for (int u = 0; u < U; ++u)
                S[r][u] = 0.0f;
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int f = 0; f < F; ++f) {
                float k[E];
                unpack<dtype_id>(k_reg[u][f], k);
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    #pragma unroll
                    for (int e = 0; e < E; e += 4) {
                        float4 q;
                        if constexpr (Q_IN_REGISTERS)
                            q = make_float4(q_reg[r][f * E + e], q_reg[r][f * E + e + 1], q_reg[r][f * E + e + 2], q_reg[r][f * E + e + 3]);
                        else
                            q = load_shared(&Q_smem[r * d_head + E * (part + G * f) + e]);
                        S[r][u] = fmaf(q.x, k[e], S[r][u]);
                        S[r][u] = fmaf(q.y, k[e + 1], S[r][u]);
                        S[r][u] = fmaf(q.z, k[e + 2], S[r][u]);
                        S[r][u] = fmaf(q.w, k[e + 3], S[r][u]);
                    }
                }
            }
        }
        #pragma unroll
        for (int mask = 1; mask < G; mask <<= 1)
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    S[r][u] += __shfl_xor_sync(FULL_WARP, S[r][u], mask);

        // The K registers are free: the next step's keys start arriving during the softmax and P V.
        K_row += step_stride;
        if (step + 1 < n_steps)
            load_keys<U, F, G, KPW, E>(k_reg, K_row, sp.kv_row_stride, sp.k_end - (key0 + STEP));

        #pragma unroll
        for (int r = 0; r < R; ++r) {
            // Mask by selection: keys past the split, past the row's causal limit, or never loaded
            // become -inf and then exactly 0.
            float m_new = m_i[r];
            const int visible = lim[r] - key0;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                S[r][u] = u * KPW < visible ? S[r][u] : -INFINITY;
                m_new = fmaxf(m_new, S[r][u]);  // m_new = max(m_i, rowmax(S_ij))
            }
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: keep -inf - -inf out
            const float alpha = exp2_approx(m_i[r] - m_use);       // 2^(m_i - m_new); 0 while m_i = -inf
            m_i[r] = m_new;
            // P_ij = 2^(S_ij - m_new), kept in S; l_i = alpha l_i + rowsum(P_ij); O_i = alpha O_i
            float row_sum = 0.0f;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                S[r][u] = exp2_approx(S[r][u] - m_use);
                row_sum += S[r][u];
            }
            l_i[r] = l_i[r] * alpha + row_sum;
            #pragma unroll
            for (int j = 0; j < FE; ++j)
                O_acc[r][j] *= alpha;
        }
        // O_i += P_ij V_j, each value chunk widened once for all rows
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            #pragma unroll
            for (int f = 0; f < F; ++f) {
                float v[E];
                unpack<dtype_id>(v_reg[u][f], v);
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    #pragma unroll
                    for (int e = 0; e < E; ++e)
                        O_acc[r][f * E + e] = fmaf(S[r][u], v[e], O_acc[r][f * E + e]);
            }
        }

        // The V registers are free too.
        V_row += step_stride;
        if (step + 1 < n_steps)
            load_keys<U, F, G, KPW, E>(v_reg, V_row, sp.kv_row_stride, sp.k_end - (key0 + STEP));
    }

    // The KPW slots of a warp merge their states: lanes G, 2G, ..., 16 apart hold the same columns.
    #pragma unroll
    for (int mask = G; mask < 32; mask <<= 1) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float m_new, a, b;
            merge_weights(m_i[r], __shfl_xor_sync(FULL_WARP, m_i[r], mask), m_new, a, b);
            l_i[r] = l_i[r] * a + __shfl_xor_sync(FULL_WARP, l_i[r], mask) * b;
            #pragma unroll
            for (int j = 0; j < FE; ++j)
                O_acc[r][j] = fmaf(O_acc[r][j], a, __shfl_xor_sync(FULL_WARP, O_acc[r][j], mask) * b);
            m_i[r] = m_new;
        }
    }
    if (slot == 0) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int e = 0; e < E; e += 4)
                    *reinterpret_cast<float4*>(&merge_O[(warp * B_r + r) * d_head + E * (part + G * f) + e]) =
                        make_float4(O_acc[r][f * E + e], O_acc[r][f * E + e + 1], O_acc[r][f * E + e + 2], O_acc[r][f * E + e + 3]);
            if (part == 0)
                *reinterpret_cast<float2*>(&merge_ml[(warp * B_r + r) * 2]) = make_float2(m_i[r], l_i[r]);
        }
    }
}

// -- the kernel -------------------------------------------------------------------------------------

template <int d_head, int B_r, int B_c, int dtype_id>
__global__ void __launch_bounds__(THREADS, 4)
attention_forward(const element_t<dtype_id>* __restrict__ Q, const element_t<dtype_id>* __restrict__ K,
                  const element_t<dtype_id>* __restrict__ V, element_t<dtype_id>* __restrict__ O,
                  float* __restrict__ workspace, int T_q, int T_k, int kv_group, int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
    static_assert(d_head % 8 == 0, "rows are read in 16-byte chunks, O in chunks of 4 floats");
    constexpr int CHUNKS = d_head / 4;  // O_i in chunks of 4 floats from here on
    constexpr int MERGE_FLOATS = cmax(WARPS * B_r * (d_head + 2), 6 * THREADS);

    extern __shared__ __align__(16) float smem[];
    float* Q_smem = smem;                              // B_r x d, when Q_i does not stay in registers
    float* merge_O = smem + B_r * d_head;              // WARPS x B_r x d
    float* merge_ml = merge_O + WARPS * B_r * d_head;  // WARPS x B_r x 2
    __shared__ int is_last;
    __shared__ float2 own_ml[B_r];  // the combining block's own (m_i, l_i) per row
    static_assert(WARPS * B_r * (d_head + 2) <= MERGE_FLOATS, "merge area");

    // blockIdx.x = tile rank * splits + split, tiles counted down: the longest causal tiles start first.
    // Integer division costs a chain of ~15 dependent instructions and the loads wait for it: the
    // decode case (one tile, one head per K/V head) takes none.
    const int T_r = (T_q + B_r - 1) / B_r;
    int splits = gridDim.x, split = blockIdx.x, tile = 0;
    if (T_r > 1) {
        splits = gridDim.x / T_r;
        split = blockIdx.x % splits;
        tile = T_r - 1 - (int)(blockIdx.x / splits);
    }
    const int NH = gridDim.y, head = blockIdx.y, batch = blockIdx.z;

    // Query heads per block: the largest divisor of kv_group whose rows fit in B_r, if the blocks
    // left busy (one in `heads`) still cover the SMs; then one block reads its K/V head for all.
    int heads = 1;
    if (kv_group > 1) {
        const int rows_max = min(B_r, T_q);
        for (int c = min(kv_group, B_r / rows_max); c > 1; --c)
            if (kv_group % c == 0) {
                heads = c;
                break;
            }
        unsigned n_sm;
        asm("mov.u32 %0, %%nsmid;" : "=r"(n_sm));
        const long long n_blocks = (long long)gridDim.x * gridDim.y * gridDim.z;
        if (heads > 1 && n_blocks / heads < n_sm)
            heads = 1;
        if (heads > 1 && head % heads != 0)
            return;  // a block of the group's first head serves this one
    }

    Split<element_t<dtype_id>> sp;
    sp.row_start = tile * B_r;
    sp.rows_per_head = min(B_r, T_q - sp.row_start);
    sp.rows = heads * sp.rows_per_head;
    sp.key_offset = T_k - T_q;
    sp.T_k = T_k;
    sp.causal = causal;
    sp.scale_log2 = scale * LOG2_E;
    sp.Q_first = Q + batch * q_batch_stride + head * q_head_stride + sp.row_start * q_row_stride;
    sp.q_head_stride = q_head_stride;
    sp.q_row_stride = q_row_stride;
    const int kv_head = kv_group == 1 ? head : head / kv_group;
    sp.K_head = K + batch * kv_batch_stride + kv_head * kv_head_stride;
    sp.V_head = V + batch * kv_batch_stride + kv_head * kv_head_stride;
    sp.kv_row_stride = kv_row_stride;
    // This split's keys: whole tiles of B_c of the keys the tile's last row may see, `per` tiles to
    // a split and one more to each of the first `extra`.
    const int n_keys = causal ? min(max(sp.row_start + sp.rows_per_head + sp.key_offset, 0), T_k) : T_k;
    sp.k_begin = 0;
    sp.k_end = n_keys;
    if (splits > 1) {
        const int key_tiles = (n_keys + B_c - 1) / B_c;
        const int per = key_tiles / splits, extra = key_tiles - per * splits;
        const int first_tile = split * per + min(split, extra);
        sp.k_begin = min(first_tile * B_c, n_keys);
        sp.k_end = min((first_tile + per + (split < extra ? 1 : 0)) * B_c, n_keys);
    }

    // Row r of the block is query row row_start + r % rows_per_head of head head + r / rows_per_head.
    const long long bh0 = (long long)batch * NH + head;
    const bool o_vec = (reinterpret_cast<unsigned long long>(O) & 15) == 0;
    auto row_index = [&](int r) {  // (batch, head, query row) of block row r, as an index over B x NH x T_q
        if (heads == 1)            // rows < rows_per_head: no division
            return bh0 * T_q + sp.row_start + r;
        return (bh0 + r / sp.rows_per_head) * T_q + sp.row_start + r % sp.rows_per_head;
    };
    const long long n_slots = (long long)gridDim.z * NH * T_q * splits;
    float* part_O = workspace;                      // n_slots x d: row index * splits + split
    float* part_ml = workspace + n_slots * d_head;  // n_slots x 2
    unsigned* counter = reinterpret_cast<unsigned*>(part_ml + n_slots * 2) + bh0 * T_r + tile;

    // Draw a ticket now, so that the atomic's round trip passes while the keys load: the block that
    // draws splits - 1 started last and combines. Every block it waits for has drawn before it, so is
    // running, and waits for nothing: no deadlock, whatever the grid.
    unsigned ticket = 0;
    if (splits > 1 && threadIdx.x == 0)
        ticket = atomicAdd(counter, 1u);

    if (sp.rows == 1)
        attend_keys<d_head, B_r, B_c, dtype_id, 1>(sp, Q_smem, merge_O, merge_ml);
    else if (sp.rows <= 2)
        attend_keys<d_head, B_r, B_c, dtype_id, cmin(2, B_r)>(sp, Q_smem, merge_O, merge_ml);
    else if (sp.rows <= 4)
        attend_keys<d_head, B_r, B_c, dtype_id, cmin(4, B_r)>(sp, Q_smem, merge_O, merge_ml);
    else
        attend_keys<d_head, B_r, B_c, dtype_id, B_r>(sp, Q_smem, merge_O, merge_ml);
    if (threadIdx.x == 0)
        is_last = ticket == (unsigned)splits - 1;
    __syncthreads();  // every warp's state is in the merge area
    const bool last = splits > 1 && is_last;

    // The block's state: merge the 4 warps' (O_i, m_i, l_i), then write O_i / l_i, or publish the
    // partial; the combining block keeps its own in shared memory (Q_i's area, free now).
    float4* own_O = reinterpret_cast<float4*>(Q_smem);  // rows x d
    for (int idx = threadIdx.x; idx < sp.rows * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        float m = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w)
            m = fmaxf(m, merge_ml[(w * B_r + r) * 2]);
        const float m_use = m == -INFINITY ? 0.0f : m;
        float l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float2 ml = *reinterpret_cast<const float2*>(&merge_ml[(w * B_r + r) * 2]);
            const float a = exp2_approx(ml.x - m_use);
            l = fmaf(a, ml.y, l);
            acc = blend(*reinterpret_cast<const float4*>(&merge_O[(w * B_r + r) * d_head + 4 * c]), a, acc, 1.0f);
        }
        if (splits == 1) {
            store4<dtype_id>(O + row_index(r) * d_head + 4 * c, scaled(acc, l > 0.0f ? 1.0f / l : 0.0f), o_vec);  // no key: 0
        } else if (last) {
            own_O[idx] = acc;
            if (c == 0)
                own_ml[r] = make_float2(m, l);
        } else {
            const long long s = row_index(r) * splits + split;
            publish4(&part_O[s * d_head + 4 * c], acc);
            if (c == 0)
                publish2(&part_ml[s * 2], m, l);
        }
    }
    if (!last)
        return;
    if (threadIdx.x == 0)
        atomicExch(counter, 0u);  // every split has drawn: ready for the next launch
    __syncthreads();              // own state in place, the merge area free

    // The last block merges the splits: item (row, chunk) over splits p, p + parts, ..., with
    // `parts` threads per item when there are few items, so that all partials are requested at once.
    // Always in split order, its own in its place: the same bits whichever block combines.
    const int items = sp.rows * CHUNKS;
    const int parts = max(1, min(splits, THREADS / items));
    float* thread_O = merge_O;                  // THREADS float4, reused: the merge area is free
    float* thread_ml = merge_O + 4 * THREADS;   // THREADS x 2
    for (int idx = threadIdx.x; idx < items * parts; idx += THREADS) {
        const int item = idx % items, p = idx / items;
        const int r = item / CHUNKS, c = item % CHUNKS;
        const long long first = row_index(r) * splits;
        float m = -INFINITY, l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = p; s0 < splits; s0 += 4 * parts) {
            // Four partials requested together, again until every word of them has been published.
            uint4 o[4];
            uint2 ml[4];
            bool ready;
            int polls = 0;
            do {
                if (++polls > (1 << 22))
                    __trap();  // seconds without a word arriving: a bug, an error rather than a hang
                ready = true;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int s = s0 + j * parts;
                    if (s < splits && s != split) {
                        o[j] = poll4(&part_O[(first + s) * d_head + 4 * c]);
                        ml[j] = poll2(&part_ml[(first + s) * 2]);
                    }
                }
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int s = s0 + j * parts;
                    if (s < splits && s != split)
                        ready = ready && o[j].x && o[j].y && o[j].z && o[j].w && ml[j].x && ml[j].y;
                }
            } while (!ready);
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int s = s0 + j * parts;
                float2 ml_j = make_float2(-INFINITY, 0.0f);  // past splits: empty
                float4 o_j = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (s == split) {
                    ml_j = own_ml[r];
                    o_j = own_O[item];
                } else if (s < splits) {
                    ml_j = make_float2(decode(ml[j].x), decode(ml[j].y));
                    o_j = make_float4(decode(o[j].x), decode(o[j].y), decode(o[j].z), decode(o[j].w));
                    clear4(&part_O[(first + s) * d_head + 4 * c]);  // this thread is its only reader
                }
                float m_new, a, b;
                merge_weights(m, ml_j.x, m_new, a, b);
                l = l * a + ml_j.y * b;
                acc = blend(acc, a, o_j, b);
                m = m_new;
            }
        }
        if (parts == 1) {
            store4<dtype_id>(O + row_index(r) * d_head + 4 * c, scaled(acc, l > 0.0f ? 1.0f / l : 0.0f), o_vec);
        } else {
            *reinterpret_cast<float4*>(&thread_O[4 * idx]) = acc;
            *reinterpret_cast<float2*>(&thread_ml[2 * idx]) = make_float2(m, l);
        }
    }
    __syncthreads();  // every thread of a row has read its (m, l): clear them for the next launch
    for (int i = threadIdx.x; i < sp.rows * splits; i += THREADS) {
        const int r = i / splits, s = i % splits;
        if (s != split)
            clear2(&part_ml[(row_index(r) * splits + s) * 2]);
    }
    if (parts == 1)
        return;
    for (int item = threadIdx.x; item < items; item += THREADS) {
        const int r = item / CHUNKS, c = item % CHUNKS;
        float m = -INFINITY, l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int p = 0; p < parts; ++p) {
            const float2 ml = *reinterpret_cast<const float2*>(&thread_ml[2 * (p * items + item)]);
            float m_new, a, b;
            merge_weights(m, ml.x, m_new, a, b);
            l = l * a + ml.y * b;
            acc = blend(acc, a, *reinterpret_cast<const float4*>(&thread_O[4 * (p * items + item)]), b);
            m = m_new;
        }
        store4<dtype_id>(O + row_index(r) * d_head + 4 * c, scaled(acc, l > 0.0f ? 1.0f / l : 0.0f), o_vec);
    }
}
