/*
 * b02 - FlashAttention-2's backward: one block per tile K_j, V_j looping over the query tiles, dK_j
 * and dV_j in registers, dQ added into a float32 buffer with atomics and converted after.
 *
 * The change: b01 computed each score three times, once per gradient. Here one block owns a tile of
 * B_c keys and values (FlashAttention-2, Algorithm 2): it loads K_j and V_j once, and for every query
 * tile Q_i that sees one of its keys (and every query head of its K/V head's group) computes
 *   S_ij^T = K_j Q_i^T,  P_ij^T = exp(scale S_ij^T - lse_i)       (masked: 0)
 *   dP_ij^T = V_j dO_i^T,  dS_ij^T = P_ij^T o (dP_ij^T - D_i)
 *   dV_j += P_ij^T dO_i,  dK_j += dS_ij^T Q_i                     (registers, the whole loop)
 *   dQ_i += dS_ij K_j                                              (atomics into dQ_accum)
 * five products per pair of tiles where b01 had seven, each score computed once. Three kernels:
 *   backward_preprocess (query tiles): D_i = rowsum(dO_i o O_i), a thread a row in the order of dP's
 *     sums (below), from O_i and dO_i staged in shared memory; dQ_accum and the tile's turn cleared;
 *   backward_dk_dv (key tiles): the loop above;
 *   backward_dq (query tiles): dQ = scale dQ_accum, in the inputs' dtype.
 *
 * Why it helps: K_j and V_j are read from global memory once, Q_i and dO_i once per key tile, as
 * in the forward; every score, probability and dS is computed once; the block's dK_j and dV_j never
 * leave registers until the end. The price is dQ: every key tile adds its B_r x d share into each
 * query tile it sees, in float32 atomics (red.global.add.f32, performed in L2), in an order that
 * changes from run to run, and so do the last bits of dQ.
 *
 * Float32 accuracy, where the order of the sums decides it (FlashAttention's rule holds each gradient
 * to 3x the error of a plain float32 implementation, down to T = 1, where that error is a rounding):
 *   - S and dP over d: blocks of 8 columns, each a chain of 8 fma, added into the sum compensated
 *     (Kahan: the error of each add goes into the next block's chain). One chain over d rounds d times
 *     at the sum's magnitude; P = exp(scale S - lse) turns scale S's error into P's relative error
 *     against an lse that is the exact one rounded, and where a row sees few keys P is near 1 and
 *     dV = P^T dO carries it whole. Three adds per 8 fma.
 *   - D_i in the same operations and order as dP_ij: where O_i = V_j (a row that sees one key, as
 *     every causal row 0 does) D_i is dP_ij to the bit and dS_ij = P_ij (dP_ij - D_i) is exactly 0.
 *   - dV_j and dK_j in two levels: each query tile's share summed from zero (B_r terms), then added
 *     into the total. One register per element summing every query row in sequence rounds T times at
 *     the total's magnitude, an error that grows with T.
 *
 * Deterministic (template parameter deterministic = 1, lab.deterministic): the key tiles of a query
 * tile take turns, in the order of j. dQ_turns holds, per query head and query tile, the key tile
 * whose turn it is; block j's thread 0 waits (ld.acquire.gpu) until it reads j, the block adds its
 * share, fences, and passes the turn to j + 1 (st.release.gpu). The key tiles that see a query tile
 * are 0 .. J_i, consecutive (a row that sees a key sees key 0), and every block visits its query tiles
 * in one order, so each dQ element is the same sum in the same order on every run. Waiting cannot
 * deadlock as long as blocks are started in the order of their index, which the grid's heavy-first
 * order (below) makes j-major: block j - 1 of a head always started before block j.
 *
 * Geometry: grid (T_c = ceil(T_k / B_c), NH_kv, B) for backward_dk_dv, read heavy first: the flat
 * block index counts key tiles up, every head's tile 0 (which every query row sees when causal) first.
 * Block 256 threads as 16 x 16 (ty, tx). Products over d (S^T and dP^T, B_c x B_r): thread (ty, tx)
 * owns keys ty + 16 a and queries tx + 16 b, reading float4 of K_j / V_j (one row per quarter-warp: a
 * broadcast) and of Q_i / dO_i (8 rows per quarter-warp, pitch d + 4: 8 different bank groups).
 * Products over the queries (dV_j, dK_j, B_c x d): keys ty + 16 a, columns 4 (tx + 16 b) .. + 3;
 * over the keys (dQ_i's share, B_r x d): queries ty + 16 a, the same columns, dS read one key at a
 * time from dS^T (a broadcast). P^T and dS^T go through shared memory with a pitch of B_r + 16 floats,
 * so that the two rows a warp stores fall 16 banks apart. Shared memory, in floats:
 *   K_j, V_j (B_c x (d + 4) each) + Q_i, dO_i (B_r x (d + 4) each) + P^T, dS^T (B_c x (B_r + 16) each)
 *   + lse_i, D_i (B_r each): d = 64, B_r = B_c = 64: 111,104 bytes;
 *   d = 128, B_r = 32, B_c = 64: 4 * (2 * 64 * 132 + 2 * 32 * 132 + 2 * 64 * 48 + 64) = 126,208 bytes.
 * Registers per thread: dK_j and dV_j B_c d / 256 each (16 at d = 64, 32 at d = 128, B_c = 64), twice
 * over (the totals and a query tile's shares), and the score tiles with their compensations: 189 at
 * d = 64, 251 at d = 128 (sm_90, as compiled), one block of 8 warps per SM. (Held to 128 registers for
 * two blocks, ptxas spilled.)
 *
 * Limits: float32; d a multiple of 64 (64 and 128 declared); B_r and B_c multiples of 16. The
 * preprocessing and conversion kernels take one tile of B_r query rows per block.
 *
 * lab.template   d_head, B_r, B_c, deterministic
 * lab.configs    (64, 64, 64, 0), (128, 32, 64, 0), (64, 64, 64, 1), (128, 32, 64, 1)
 * lab.threads    256
 * lab.smem       0
 * lab.phase      backward_preprocess: query tiles, smem 8 * B_r * (d_head + 4)
 * lab.phase      backward_dk_dv: key tiles, smem 4 * (2 * (B_c + B_r) * (d_head + 4) + 2 * B_c * (B_r + 16) + 2 * B_r)
 * lab.phase      backward_dq: query tiles
 * lab.dq_accum   true
 * lab.deterministic deterministic
 * lab.supports   noncausal, cross, gqa
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr int THREADS = 256;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The deterministic order: wait until the turn of query tile `turn` is `mine`, then (after adding)
// hand it to the next key tile. Both are block-wide: every thread calls them.
__device__ __forceinline__ void wait_turn(const int* turn, int mine)
{
    if (threadIdx.x == 0) {
        int now;
        do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(turn) : "memory");
        } while (now != mine);
    }
    __syncthreads();  // the whole block adds after the previous key tile's adds
}

__device__ __forceinline__ void pass_turn(int* turn, int next)
{
    __threadfence();  // this thread's adds are performed before the turn moves
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(turn), "r"(next) : "memory");
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc)
{
    return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc))));
}

__device__ __forceinline__ void axpy4(float a, float4 x, float (&y)[4])
{
    y[0] = fmaf(a, x.x, y[0]), y[1] = fmaf(a, x.y, y[1]), y[2] = fmaf(a, x.z, y[2]), y[3] = fmaf(a, x.w, y[3]);
}

// sum += block, compensated (Kahan): the block's chain starts from -comp, the error of the last add, and
// comp becomes this add's error, so that what an add at the sum's magnitude rounds away is not lost.
__device__ __forceinline__ void add_compensated(float& sum, float& comp, float block)
{
    const float t = sum + block;
    comp = (t - sum) - block;
    sum = t;
}

// C += A B^T for a thread's TA x TB tile: rows ra + 16 a of A, rows rb + 16 b of B (both with the given
// pitch); over d in blocks of 8 columns, two float4 into a chain of 8 fma, each block added into C
// compensated (the header's float32 accuracy). C starts at zero.
template <int TA, int TB, int pitch, int d_head>
__device__ __forceinline__ void product_over_d(float (&C)[TA][TB], const float* A, const float* B, int ra, int rb)
{
    float comp[TA][TB];
    #pragma unroll
    for (int a = 0; a < TA; ++a)
        #pragma unroll
        for (int b = 0; b < TB; ++b)
            comp[a][b] = 0.0f;
    #pragma unroll 1
    for (int k = 0; k < d_head; k += 8) {
        float block[TA][TB];
        #pragma unroll
        for (int a = 0; a < TA; ++a)
            #pragma unroll
            for (int b = 0; b < TB; ++b)
                block[a][b] = -comp[a][b];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float4 a4[TA];
            #pragma unroll
            for (int a = 0; a < TA; ++a)
                a4[a] = *(const float4*)&A[(ra + 16 * a) * pitch + k + 4 * h];
            #pragma unroll
            for (int b = 0; b < TB; ++b) {
                const float4 b4 = *(const float4*)&B[(rb + 16 * b) * pitch + k + 4 * h];
                #pragma unroll
                for (int a = 0; a < TA; ++a)
                    block[a][b] = dot4(a4[a], b4, block[a][b]);
            }
        }
        #pragma unroll
        for (int a = 0; a < TA; ++a)
            #pragma unroll
            for (int b = 0; b < TB; ++b)
                add_compensated(C[a][b], comp[a][b], block[a][b]);
    }
}

// One element of product_over_d, x . y over d, the same operations in the same order (x and y 16-byte
// aligned): D_i = dO_i . O_i comes out as dP_ij = dO_i . V_j does, to the bit where O_i = V_j (a row
// that sees one key), and dS_ij = P_ij (dP_ij - D_i) is then exactly 0, as it is in exact arithmetic.
template <int d_head>
__device__ __forceinline__ float dot_over_d(const float* x, const float* y)
{
    float sum = 0.0f, comp = 0.0f;
    #pragma unroll 1
    for (int k = 0; k < d_head; k += 8) {
        float block = -comp;
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            block = dot4(*(const float4*)&x[k + 4 * h], *(const float4*)&y[k + 4 * h], block);
        add_compensated(sum, comp, block);
    }
    return sum;
}

// Rows row_start .. row_start + rows - 1 (d_head floats each, contiguous) into a tile of the given
// pitch, float4 at a time; rows past `limit` zeros.
template <int d_head, int rows, int pitch>
__device__ __forceinline__ void load_rows(float* tile, const float* src, int row_start, int limit)
{
    for (int idx = threadIdx.x; idx < rows * d_head / 4; idx += THREADS) {
        const int r = idx / (d_head / 4), c = 4 * (idx % (d_head / 4));
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row_start + r < limit)
            x = *(const float4*)&src[(long long)(row_start + r) * d_head + c];
        *(float4*)&tile[r * pitch + c] = x;
    }
}

// D_i = rowsum(dO_i o O_i), a thread a row in product_over_d's order, from O_i and dO_i staged in shared
// memory (pitch d + 4: a quarter-warp's 8 rows in 8 bank groups); dQ_accum's rows and the tile's turn
// zeroed (lab.dq_accum).
template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(THREADS)
backward_preprocess(const float* __restrict__ /* Q */, const float* __restrict__ /* K */, const float* __restrict__ /* V */,
                    const float* __restrict__ O, const float* __restrict__ dO, const float* __restrict__ /* lse */,
                    float* __restrict__ /* dQ */, float* __restrict__ /* dK */, float* __restrict__ /* dV */,
                    float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
                    int T_q, int T_k, int kv_group, int causal, float scale)
{
    constexpr int PITCH = d_head + 4;
    extern __shared__ __align__(16) float smem[];
    float* O_i = smem;                   // B_r x PITCH
    float* dO_i = O_i + B_r * PITCH;     // B_r x PITCH
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // = batch * NH + head
    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T_q - row_start);
    load_rows<d_head, B_r, PITCH>(O_i, O + bh * T_q * d_head, row_start, T_q);
    load_rows<d_head, B_r, PITCH>(dO_i, dO + bh * T_q * d_head, row_start, T_q);
    const long long at = (bh * T_q + row_start) * d_head;
    for (int idx = threadIdx.x; idx < rows * d_head / 4; idx += THREADS)
        *(float4*)&dQ_accum[at + 4 * idx] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (threadIdx.x == 0)
        dQ_turns[bh * gridDim.x + blockIdx.x] = 0;  // key tile 0 adds first
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += THREADS)
        D[bh * T_q + row_start + r] = dot_over_d<d_head>(&dO_i[r * PITCH], &O_i[r * PITCH]);
}

// dQ = scale dQ_accum, float4 at a time.
template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(THREADS)
backward_dq(const float* __restrict__ /* Q */, const float* __restrict__ /* K */, const float* __restrict__ /* V */,
            const float* __restrict__ /* O */, const float* __restrict__ /* dO */, const float* __restrict__ /* lse */,
            float* __restrict__ dQ, float* __restrict__ /* dK */, float* __restrict__ /* dV */,
            float* __restrict__ /* D */, float* __restrict__ dQ_accum, int* __restrict__ /* dQ_turns */,
            int T_q, int T_k, int kv_group, int causal, float scale)
{
    const long long bh = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const int row_start = blockIdx.x * B_r;
    const int rows = min(B_r, T_q - row_start);
    const long long at = (bh * T_q + row_start) * d_head;
    for (int idx = threadIdx.x; idx < rows * d_head / 4; idx += THREADS) {
        const float4 a = *(const float4*)&dQ_accum[at + 4 * idx];
        *(float4*)&dQ[at + 4 * idx] = make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale);
    }
}

template <int d_head, int B_r, int B_c, int deterministic>
__global__ void __launch_bounds__(THREADS, 1)
backward_dk_dv(const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
               const float* __restrict__ /* O */, const float* __restrict__ dO, const float* __restrict__ lse,
               float* __restrict__ /* dQ */, float* __restrict__ dK, float* __restrict__ dV,
               float* __restrict__ D, float* __restrict__ dQ_accum, int* __restrict__ dQ_turns,
               int T_q, int T_k, int kv_group, int causal, float scale)
{
    static_assert(d_head % 64 == 0 && B_r % 16 == 0 && B_c % 16 == 0, "tile shapes");
    constexpr int PITCH = d_head + 4;    // K_j, V_j, Q_i, dO_i: 8 rows of a quarter-warp, 8 bank groups
    constexpr int S_PITCH = B_r + 16;    // P^T, dS^T: a warp's two rows 16 banks apart
    constexpr int TK = B_c / 16;         // keys per thread (ty + 16 a)
    constexpr int TQ = B_r / 16;         // queries per thread (tx + 16 b in S^T; ty + 16 a in dQ_i)
    constexpr int TD = d_head / 64;      // float4 column groups per thread (tx + 16 b)

    extern __shared__ __align__(16) float smem[];
    float* K_j = smem;                   // B_c x PITCH
    float* V_j = K_j + B_c * PITCH;      // B_c x PITCH
    float* Q_i = V_j + B_c * PITCH;      // B_r x PITCH
    float* dO_i = Q_i + B_r * PITCH;     // B_r x PITCH
    float* P_T = dO_i + B_r * PITCH;     // B_c x S_PITCH: P_ij^T
    float* dS_T = P_T + B_c * S_PITCH;   // B_c x S_PITCH: dS_ij^T
    float* lse_i = dS_T + B_c * S_PITCH; // B_r: lse_i, +inf past T_q
    float* D_i = lse_i + B_r;            // B_r

    // Heavy tiles first: the flat block index, read as (key tile, K/V head), counts key tiles up.
    const long long n_heads = (long long)gridDim.y * gridDim.z;  // = B * NH_kv
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int j = (int)(flat / n_heads);
    const long long kv_bh = flat % n_heads;  // = batch * NH_kv + K/V head
    const int col_start = j * B_c;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int offset = T_k - T_q;        // query row i sees keys <= i + offset (causal, bottom-right)
    const int T_r = (T_q + B_r - 1) / B_r;
    const int first_row = causal ? max(0, col_start - offset) : 0;  // the first row that sees key col_start

    load_rows<d_head, B_c, PITCH>(K_j, K + kv_bh * T_k * d_head, col_start, T_k);
    load_rows<d_head, B_c, PITCH>(V_j, V + kv_bh * T_k * d_head, col_start, T_k);

    float dK_acc[TK][TD][4], dV_acc[TK][TD][4];  // keys ty + 16 a, columns 4 (tx + 16 b) + e
    #pragma unroll
    for (int a = 0; a < TK; ++a)
        #pragma unroll
        for (int b = 0; b < TD; ++b)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                dK_acc[a][b][e] = 0.0f, dV_acc[a][b][e] = 0.0f;

    for (int h = 0; h < kv_group; ++h) {
        const long long bh = kv_bh * kv_group + h;  // = batch * NH + query head
        for (int i = first_row / B_r; i < T_r; ++i) {
            const int row_start = i * B_r;
            // Every thread is done with the last query tile (and K_j, V_j have landed).
            __syncthreads();
            load_rows<d_head, B_r, PITCH>(Q_i, Q + bh * T_q * d_head, row_start, T_q);
            load_rows<d_head, B_r, PITCH>(dO_i, dO + bh * T_q * d_head, row_start, T_q);
            for (int r = threadIdx.x; r < B_r; r += THREADS) {
                const bool valid = row_start + r < T_q;
                lse_i[r] = valid ? lse[bh * T_q + row_start + r] : INFINITY;
                D_i[r] = valid ? D[bh * T_q + row_start + r] : 0.0f;
            }
            __syncthreads();

            // S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T: keys ty + 16 a, queries tx + 16 b
            float S[TK][TQ], dP[TK][TQ];
            #pragma unroll
            for (int a = 0; a < TK; ++a)
                #pragma unroll
                for (int b = 0; b < TQ; ++b)
                    S[a][b] = 0.0f, dP[a][b] = 0.0f;
            product_over_d<TK, TQ, PITCH, d_head>(S, K_j, Q_i, ty, tx);
            product_over_d<TK, TQ, PITCH, d_head>(dP, V_j, dO_i, ty, tx);
            // P_ij^T = exp(scale S - lse_i), 0 where the key is masked or past T_k (rows past T_q have lse =
            // +inf: 0 too); dS_ij^T = P_ij^T (dP_ij^T - D_i); both into shared memory. The exponent is
            // rounded once (fma) before it goes to log2 units: where P matters it is near 0, and its error
            // stays a few units of its own last place, not of scale S's or lse's.
            #pragma unroll
            for (int a = 0; a < TK; ++a)
                #pragma unroll
                for (int b = 0; b < TQ; ++b) {
                    const int key = col_start + ty + 16 * a, r = tx + 16 * b;
                    const bool visible = key < T_k && (!causal || key <= row_start + r + offset);
                    const float p = visible ? exp2_approx(fmaf(S[a][b], scale, -lse_i[r]) * LOG2_E) : 0.0f;
                    P_T[(ty + 16 * a) * S_PITCH + r] = p;
                    dS_T[(ty + 16 * a) * S_PITCH + r] = p * (dP[a][b] - D_i[r]);
                }
            __syncthreads();

            // dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i: keys ty + 16 a, columns 4 (tx + 16 b) + e, the query
            // tile's share summed from zero and then added into the sum over all query tiles
            float dK_tile[TK][TD][4], dV_tile[TK][TD][4];
            #pragma unroll
            for (int a = 0; a < TK; ++a)
                #pragma unroll
                for (int b = 0; b < TD; ++b)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dK_tile[a][b][e] = 0.0f, dV_tile[a][b][e] = 0.0f;
            #pragma unroll 2
            for (int r = 0; r < B_r; r += 4) {
                float4 p4[TK], s4[TK];
                #pragma unroll
                for (int a = 0; a < TK; ++a) {
                    p4[a] = *(const float4*)&P_T[(ty + 16 * a) * S_PITCH + r];
                    s4[a] = *(const float4*)&dS_T[(ty + 16 * a) * S_PITCH + r];
                }
                #pragma unroll
                for (int s = 0; s < 4; ++s)
                    #pragma unroll
                    for (int b = 0; b < TD; ++b) {
                        const float4 o4 = *(const float4*)&dO_i[(r + s) * PITCH + 4 * (tx + 16 * b)];
                        const float4 q4 = *(const float4*)&Q_i[(r + s) * PITCH + 4 * (tx + 16 * b)];
                        #pragma unroll
                        for (int a = 0; a < TK; ++a) {
                            const float pv = s == 0 ? p4[a].x : s == 1 ? p4[a].y : s == 2 ? p4[a].z : p4[a].w;
                            const float sv = s == 0 ? s4[a].x : s == 1 ? s4[a].y : s == 2 ? s4[a].z : s4[a].w;
                            axpy4(pv, o4, dV_tile[a][b]);
                            axpy4(sv, q4, dK_tile[a][b]);
                        }
                    }
            }
            #pragma unroll
            for (int a = 0; a < TK; ++a)
                #pragma unroll
                for (int b = 0; b < TD; ++b)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dK_acc[a][b][e] += dK_tile[a][b][e], dV_acc[a][b][e] += dV_tile[a][b][e];

            // dQ_i's share, dS_ij K_j: queries ty + 16 a, columns 4 (tx + 16 b) + e, one key at a time
            float dQ_part[TQ][TD][4];
            #pragma unroll
            for (int a = 0; a < TQ; ++a)
                #pragma unroll
                for (int b = 0; b < TD; ++b)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dQ_part[a][b][e] = 0.0f;
            #pragma unroll 4
            for (int c = 0; c < B_c; ++c) {
                float4 k4[TD];
                #pragma unroll
                for (int b = 0; b < TD; ++b)
                    k4[b] = *(const float4*)&K_j[c * PITCH + 4 * (tx + 16 * b)];
                #pragma unroll
                for (int a = 0; a < TQ; ++a) {
                    const float ds = dS_T[c * S_PITCH + ty + 16 * a];
                    #pragma unroll
                    for (int b = 0; b < TD; ++b)
                        axpy4(ds, k4[b], dQ_part[a][b]);
                }
            }
            int* turn = dQ_turns + bh * T_r + i;
            if (deterministic)
                wait_turn(turn, j);
            float* acc = dQ_accum + bh * T_q * d_head;
            #pragma unroll
            for (int a = 0; a < TQ; ++a) {
                const int row = row_start + ty + 16 * a;
                if (row < T_q)
                    #pragma unroll
                    for (int b = 0; b < TD; ++b)
                        #pragma unroll
                        for (int e = 0; e < 4; ++e)
                            atomicAdd(&acc[(long long)row * d_head + 4 * (tx + 16 * b) + e], dQ_part[a][b][e]);
            }
            if (deterministic)
                pass_turn(turn, j + 1);
        }
    }

    // dK_j = scale sum dS^T Q, dV_j; keys past T_k are not stored.
    #pragma unroll
    for (int a = 0; a < TK; ++a) {
        const int key = col_start + ty + 16 * a;
        if (key < T_k)
            #pragma unroll
            for (int b = 0; b < TD; ++b) {
                const long long at = (kv_bh * T_k + key) * d_head + 4 * (tx + 16 * b);
                *(float4*)&dK[at] = make_float4(dK_acc[a][b][0] * scale, dK_acc[a][b][1] * scale,
                                                dK_acc[a][b][2] * scale, dK_acc[a][b][3] * scale);
                *(float4*)&dV[at] = make_float4(dV_acc[a][b][0], dV_acc[a][b][1], dV_acc[a][b][2], dV_acc[a][b][3]);
            }
    }
}
