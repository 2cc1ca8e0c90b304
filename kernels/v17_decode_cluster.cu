/*
 * v17 - decode: the splits of a query tile are the blocks of one thread-block cluster, and they
 * combine through distributed shared memory instead of global memory.
 *
 * The change (against v16): the CLUSTER blocks that split the keys of one query tile are launched
 * as a cluster (sm_90, `__cluster_dims__`), so the number of splits is CLUSTER, fixed at compile
 * time (lab.cluster; runtime.Instance.splits returns it). Each block merges its warps as v16 does
 * and stores its unnormalised partial (O_i, m_i, l_i) straight into the shared memory of the
 * cluster's first block (mapa + st.shared::cluster); after one cluster barrier that block merges
 * the CLUSTER partials from its own shared memory and writes O. No ticket, no workspace, no polling.
 *
 * Why it helps:
 *   - At a decode step v16's combine is a chain of L2 round trips after the keys: the ticket's
 *     atomic, then the combining block polls every word of every partial in L2 until the other
 *     blocks' relaxed stores land there, then puts the zeros back. Within a cluster the blocks sit
 *     in one GPC: a store into a peer's shared memory travels the SM-to-SM network, never L2, and
 *     the hardware cluster barrier (arrive.release / wait.acquire) replaces ticket and polling.
 *     The combining block is known in advance (rank 0), so nothing is drawn.
 *   - The first half of the barrier costs nothing: every thread arrives (relaxed) at the start and
 *     waits just before its first remote store, by when every block of the cluster has long been
 *     running (a peer's shared memory must exist before it is written). The second barrier is the
 *     only one on the critical path; the other blocks exit after it, since nobody reads theirs.
 *   - Rank 0 holds all partials locally, so it takes the maximum m first and then adds the splits
 *     with weights 2^(m_s - m) that depend on nothing else, in split order: no chain of rescales,
 *     and the same bits at every launch.
 *   - Everything else is v16: a short tile of B_r query rows, K and V straight from global memory
 *     into registers with all of a split's loads in flight at once, 16-bit inputs widened in
 *     registers, grouped-query heads served by one block when the grid is large enough.
 *
 * Geometry: grid (T_r * CLUSTER, NH, B) with T_r = ceil(T_q / B_r), clusters of (CLUSTER, 1, 1);
 * blockIdx.x = tile rank * CLUSTER + split, so split = the block's rank in its cluster, the tiles
 * counted down. Block 128 threads = 4 warps; the key loop is v16's (G lanes per key row, F chunks
 * per lane, U steps of keys in registers, R = 1, 2, 4 or B_r rows). Keys are split across the
 * CLUSTER blocks in whole tiles of B_c as in v16: a split past the last tile has no key and adds
 * m = -inf, l = 0 (weight 0); a row that sees no key at all (causal, T_q > T_k) gets zeros.
 *   GPT-2 decode (d = 64, float32, B_c = 64, CLUSTER = 16) at T_k = 1024: 16 splits of 64 keys,
 *   one step each with every load in flight, as v16; at T_k = 128 two splits have keys and 14
 *   none; at T_k = 4096 each split takes 256 keys in 4 steps.
 * Shared memory, in floats: Q_i (B_r x d) + the warps' merge area (4 x B_r x (d + 2)) + rank 0's
 *   split area (CLUSTER x B_r x (d + 2)), allocated in every block of the cluster (one kernel):
 *   4 * (B_r * d + (4 + CLUSTER) * B_r * (d + 2)) bytes.
 *   float32: d = 64, B_r = 8, CLUSTER = 16: 44,288 bytes; d = 32, B_r = 8, CLUSTER = 8: 14,080;
 *   d = 96, B_r = 2, CLUSTER = 16: 16,448; d = 128, B_r = 8, CLUSTER = 8: 54,016 (past 48 KiB:
 *   the launcher opts in). 16-bit: d = 64, B_r = 4, CLUSTER = 16: 22,144; d = 128, B_r = 4,
 *   CLUSTER = 8: 27,008. At most four blocks per SM (__launch_bounds__(128, 4)) either way.
 *   Clusters of 16 are beyond the portable 8 (CUDA Programming Guide, "Thread Block Clusters";
 *   Hopper Tuning Guide: 16 by opting in): runtime.Instance sets
 *   CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED for them. (64, 8, 64, 0, 8) is declared to
 *   be compared with config=...: half the splits, two steps of keys each at T_k = 1024.
 * Workspace: none (runtime.Instance.workspace_floats is 0 for a rung with lab.cluster).
 *
 * Limits: sm_90 or newer (lab.min_arch; the launcher refuses older devices, the CPU test compiles
 * this rung for sm_90 only). d_head a multiple of 8 (declared: 32, 64, 96, 128); rows of Q, K and
 * V on 16-byte boundaries (runtime.prepare copies views whose rows are not). The splits per tile
 * are CLUSTER whatever the shape: with few keys most blocks of a cluster have none and only wait
 * at the barrier, and with many tiles (large B * NH, or T_q = T_k) the grid is CLUSTER times
 * larger than the SMs need; the split area grows with CLUSTER x B_r x d. A non-portable cluster of
 * 16 must fit in one GPC: it may fail to launch on a part whose GPCs are smaller.
 * Barriers: every thread of a block reaches each of its barriers, and no thread has exited before
 * the last cluster barrier. The branches before them are uniform over the block: the early return
 * of a grouped-query head (taken by whole clusters, whose blocks share a head), the dispatch on
 * sp.rows, n_steps; the loops that stage Q_i and push the partials end before their barriers, and
 * the key loop's shuffles run in all 32 lanes. The cluster barriers are the forms without .aligned,
 * which PTX allows under divergence: every barrier.cluster waits for the non-exited threads of its
 * warp, and .aligned only promises that all of them execute the same instruction (PTX ISA,
 * "barrier.cluster": docs.nvidia.com/cuda/parallel-thread-execution/#parallel-synchronization-and-
 * communication-instructions-barrier-cluster).
 * compute-sanitizer's synccheck reports "Barrier error detected. Divergent thread(s) in warp" (for "a
 * barrier that does not support this on the current architecture", Compute Sanitizer, "Synccheck
 * Tool", which documents __syncthreads() and __syncwarp() and says nothing of cluster barriers) and
 * ends the launch whenever a grid of clusters of 16 comes in more than one wave, and is clean on
 * clusters of 8 and on one wave of 16; memcheck, racecheck and initcheck are clean. That report is
 * the tool's: `python3 tools/synccheck_cluster.py` runs v17's barriers alone (tools/
 * synccheck_cluster.cu, every thread at every barrier, converged) beside v17, and on an H200 the
 * skeleton draws the report at exactly v17's conditions, in the .aligned forms as in these; v17's
 * result is right there without the tool. tests/test_sanitize_gpu.py holds v17 to a right
 * result and a clean memcheck at the reported shape, to a clean synccheck where the tool is sound,
 * and the tool to its report on the skeleton (so that a release that drops it restores the full
 * check); tools/sanitize.py runs v17 under synccheck where the tool is sound and says so.
 *
 * lab.template    d_head, B_r, B_c, dtype_id, CLUSTER
 * lab.configs     (64, 8, 64, 0, 16), (64, 8, 64, 0, 8), (32, 8, 128, 0, 8), (96, 2, 32, 0, 16), (128, 8, 32, 0, 8), (64, 4, 64, 1, 16), (32, 4, 128, 1, 8), (96, 2, 64, 1, 16), (128, 4, 64, 1, 8), (64, 4, 64, 2, 16), (32, 4, 128, 2, 8), (96, 2, 64, 2, 16), (128, 4, 64, 2, 8)
 * lab.threads     128
 * lab.smem        4 * (B_r * d_head + (4 + CLUSTER) * B_r * (d_head + 2))
 * lab.strided     true
 * lab.dtypes      float32, bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.split_kv    true
 * lab.cluster     CLUSTER
 * lab.min_arch    sm_90
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

// The splits of a tile are the blocks of one cluster, and each pushes its partial into the shared
// memory of the cluster's first block (distributed shared memory): the address of a variable of
// block `rank`, as seen from this block, then a store to it, which never leaves the GPC.
__device__ __forceinline__ unsigned cluster_address(const void* p, unsigned rank)
{
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return a;
}

__device__ __forceinline__ void store_cluster4(unsigned a, float4 x)
{
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(a), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w) : "memory");
}

__device__ __forceinline__ void store_cluster2(unsigned a, float x, float y)
{
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" :: "r"(a), "f"(x), "f"(y) : "memory");
}

// The cluster barrier, split in two: every thread of every block arrives, then waits until all
// have arrived. arrive.relaxed orders nothing (used to say "this block is running");
// arrive (release) and wait (acquire) make every store before the arrive visible after the wait.
// The forms without .aligned (cg::this_cluster().sync()'s): PTX makes every barrier.cluster wait for the
// non-exited threads of its warp, so they are right under divergence too; .aligned would only add a
// promise (every lane executes the same instruction) that each call site keeps anyway.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

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

template <int d_head, int B_r, int B_c, int dtype_id, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 4)
attention_forward(const element_t<dtype_id>* __restrict__ Q, const element_t<dtype_id>* __restrict__ K,
                  const element_t<dtype_id>* __restrict__ V, element_t<dtype_id>* __restrict__ O,
                  float* __restrict__ workspace, int T_q, int T_k, int kv_group, int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
    static_assert(d_head % 8 == 0, "rows are read in 16-byte chunks, O in chunks of 4 floats");
    static_assert(CLUSTER >= 1 && CLUSTER <= 16, "a cluster holds at most 16 blocks (8 portably)");
    constexpr int CHUNKS = d_head / 4;  // O_i in chunks of 4 floats from here on
    constexpr int splits = CLUSTER;     // the blocks of a cluster are the splits of one tile

    extern __shared__ __align__(16) float smem[];
    float* Q_smem = smem;                                     // B_r x d, when Q_i does not stay in registers
    float* merge_O = smem + B_r * d_head;                     // WARPS x B_r x d
    float* merge_ml = merge_O + WARPS * B_r * d_head;         // WARPS x B_r x 2
    float* split_O = merge_ml + WARPS * B_r * 2;              // CLUSTER x B_r x d: the splits' O_i (rank 0's)
    float* split_ml = split_O + CLUSTER * B_r * d_head;       // CLUSTER x B_r x 2: their (m_i, l_i)

    // blockIdx.x = tile rank * CLUSTER + split, tiles counted down: the longest causal tiles start
    // first. The cluster is CLUSTER consecutive blocks along x, so split = the block's rank in it.
    const int T_r = (T_q + B_r - 1) / B_r;
    const int split = blockIdx.x % CLUSTER;
    const int tile = T_r - 1 - (int)(blockIdx.x / CLUSTER);
    const int NH = gridDim.y, head = blockIdx.y, batch = blockIdx.z;

    // Query heads per block: the largest divisor of kv_group whose rows fit in B_r, if the blocks
    // left busy (one in `heads`) still cover the SMs; then one block reads its K/V head for all.
    // Every block of a cluster has the same head: a cluster leaves whole.
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
            return;  // a cluster of the group's first head serves this one
    }

    // Say "running" now and wait for the others only before the first store into rank 0's shared
    // memory, which must exist by then: long before that, every block of the cluster has arrived.
    cluster_arrive_relaxed();

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
    // a split and one more to each of the first `extra`; a split past them has none (m_i = -inf,
    // l_i = 0, O_i = 0: weight 0 in the combine).
    const int n_keys = causal ? min(max(sp.row_start + sp.rows_per_head + sp.key_offset, 0), T_k) : T_k;
    const int key_tiles = (n_keys + B_c - 1) / B_c;
    const int per = key_tiles / splits, extra = key_tiles - per * splits;
    const int first_tile = split * per + min(split, extra);
    sp.k_begin = min(first_tile * B_c, n_keys);
    sp.k_end = min((first_tile + per + (split < extra ? 1 : 0)) * B_c, n_keys);

    // Row r of the block is query row row_start + r % rows_per_head of head head + r / rows_per_head.
    const long long bh0 = (long long)batch * NH + head;
    auto row_index = [&](int r) {  // (batch, head, query row) of block row r, as an index over B x NH x T_q
        if (heads == 1)            // rows < rows_per_head: no division
            return bh0 * T_q + sp.row_start + r;
        return (bh0 + r / sp.rows_per_head) * T_q + sp.row_start + r % sp.rows_per_head;
    };

    if (sp.rows == 1)
        attend_keys<d_head, B_r, B_c, dtype_id, 1>(sp, Q_smem, merge_O, merge_ml);
    else if (sp.rows <= 2)
        attend_keys<d_head, B_r, B_c, dtype_id, cmin(2, B_r)>(sp, Q_smem, merge_O, merge_ml);
    else if (sp.rows <= 4)
        attend_keys<d_head, B_r, B_c, dtype_id, cmin(4, B_r)>(sp, Q_smem, merge_O, merge_ml);
    else
        attend_keys<d_head, B_r, B_c, dtype_id, B_r>(sp, Q_smem, merge_O, merge_ml);
    __syncthreads();  // every warp's state is in the merge area
    cluster_wait();   // every block of the cluster is running: rank 0's shared memory exists

    // The block's state: merge the 4 warps' (O_i, m_i, l_i) and push it, unnormalised, into slot
    // `split` of rank 0's split_O and split_ml (rank 0 into its own).
    const unsigned to_O = cluster_address(split_O + split * B_r * d_head, 0);
    const unsigned to_ml = cluster_address(split_ml + split * B_r * 2, 0);
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
        store_cluster4(to_O + 4 * (r * d_head + 4 * c), acc);  // byte offsets
        if (c == 0)
            store_cluster2(to_ml + 4 * (r * 2), m, l);
    }
    // Every block's pushes are in rank 0's shared memory after this; the other blocks may leave:
    // nobody reads their shared memory.
    cluster_arrive();
    cluster_wait();
    if (split != 0)
        return;

    // Rank 0 merges the splits: one thread per (row, chunk), every partial in its own shared
    // memory. The maximum first, then weights 2^(m_s - m) that depend on nothing but it, summed in
    // split order: no chain of rescales, and the same bits at every launch.
    const bool o_vec = (reinterpret_cast<unsigned long long>(O) & 15) == 0;
    for (int item = threadIdx.x; item < sp.rows * CHUNKS; item += THREADS) {
        const int r = item / CHUNKS, c = item % CHUNKS;
        float m = -INFINITY;
        #pragma unroll
        for (int s = 0; s < CLUSTER; ++s)
            m = fmaxf(m, split_ml[(s * B_r + r) * 2]);
        const float m_use = m == -INFINITY ? 0.0f : m;  // no split saw a key: every weight is 0
        float l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        #pragma unroll
        for (int s = 0; s < CLUSTER; ++s) {
            const float2 ml = *reinterpret_cast<const float2*>(&split_ml[(s * B_r + r) * 2]);
            const float a = exp2_approx(ml.x - m_use);  // 0 for a split with no key (m_s = -inf)
            l = fmaf(a, ml.y, l);
            acc = blend(*reinterpret_cast<const float4*>(&split_O[(s * B_r + r) * d_head + 4 * c]), a, acc, 1.0f);
        }
        store4<dtype_id>(O + row_index(r) * d_head + 4 * c, scaled(acc, l > 0.0f ? 1.0f / l : 0.0f), o_vec);  // no key: 0
    }
}
