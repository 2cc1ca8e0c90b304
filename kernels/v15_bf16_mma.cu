/*
 * v15 - bf16 and fp16 on mma.sync m16n8k16: 16-bit Q, K, V and O, fp32 accumulation, P_ij
 * straight from the accumulators of S_ij into the A operand of P_ij V_j.
 *
 * The change: v14's tensor cores on 16-bit data. Q, K, V and O are bfloat16 or float16, and
 * S_ij = Q_i K_j^T and O_i += P_ij V_j run on mma.sync.m16n8k16 with fp32 accumulators, their
 * operands loaded by ldmatrix from XOR-swizzled shared memory; the work is partitioned as in v13
 * (FA2: one Q_i per block, whole rows per warp). It also takes non-causal, cross (T_q != T_k) and
 * grouped-query attention.
 *
 * Why it helps:
 *   - Half the bytes to move and to keep: a K_j or V_j row of d = 64 is 128 bytes, and the 16-bit
 *     tensor-core rate is twice TF32's, with a k of 16 per instruction instead of 8.
 *   - P_ij never leaves registers. The accumulator fragment of S_ij (lane l: rows g = l / 4 and
 *     g + 8, columns 2 t and 2 t + 1 of each 8-column n-tile, t = l % 4) is, two n-tiles at a time,
 *     exactly the A-operand fragment of a 16 x 16 tile (rows g, g + 8; k 2 t, 2 t + 1, 2 t + 8,
 *     2 t + 9): P_ij is rounded to 16 bits in place (cvt.rn.bf16x2) and multiplied by V_j at once.
 *   - ldmatrix.x4 gives a warp four 8 x 8 operand fragments per instruction, each lane pointing at
 *     one 16-byte row; .trans hands over V_j transposed, as the B operand of P_ij V_j wants it, so
 *     V_j is stored as it arrives. Shared memory is XOR-swizzled so that the 8 rows one ldmatrix
 *     phase reads, 8 consecutive rows (the first a multiple of 8) of one logical 16-byte chunk, land
 *     in 8 different 16-byte bank groups. Row r of d / 8 chunks starts at group (d / 8) r mod 8, and
 *     chunk c of row r is stored at chunk c ^ ((r / (8 / P)) mod P), P the largest power of two
 *     that divides d / 8, at most 8:
 *       d = 64, 128 (P = 8): every row starts at group 0; c ^ (r mod 8) spreads the 8 rows.
 *       d = 32 (P = 4): two rows per 128-byte line, the odd one at group 4; c ^ ((r / 2) mod 4).
 *       d = 96 (P = 4): 12 chunks, 192 bytes per row, so again the odd rows start at group 4, and
 *         c ^ ((r / 2) mod 4) flips only the low two bits of c: it permutes chunks within each
 *         aligned run of 4 (0-3, 4-7, 8-11), never out of the row. Over 8 rows, r mod 2 sets bit 2
 *         of the group and (r / 2) mod 4 bits 0-1: 8 groups, with no padding.
 *     The other accesses are conflict-free for d = 96 too: cp.async stores and the 16-byte reads of
 *     O_i take 8 consecutive chunks of the tile read row by row (the first a multiple of 8), which
 *     the swizzle maps onto the same 8 stored chunks; the 4-byte stores of O_i (8 rows, 4 lanes per
 *     row) fill 32 different banks.
 *   - Q_i is read into registers (A fragments) once and reused for every K_j. Each warp owns
 *     B_r / 4 rows as B_r / 64 m16 tiles, so every K_j or V_j fragment it loads feeds that many mma.
 *   - Two stages of K_j and V_j: the copies of tile j + 1 (cp.async, 16 bytes per thread) run while
 *     tile j is computed, with one barrier per tile.
 *   - Softmax on fragments, in exp2: the row max and row sum of a row live in the 4 lanes of a quad
 *     (two shuffles), scale * log2(e) is folded into one FFMA per score before ex2.approx, O_i is
 *     rescaled only in tiles where some row max of the warp moved, and divided by l_i once, at the
 *     end. As in the reference's recipe, l_i sums P_ij before it is rounded to 16 bits.
 *   - No work on fully masked tiles (per block and per warp); the mask is applied only to tiles that
 *     cross the diagonal or the end of the keys. Heavy tiles first, as in v13.
 *   - O_i is staged through the warp's own rows of Q_i's shared memory, so that it leaves in 16-byte
 *     coalesced stores.
 *
 * The log-sum-exp (lab.lse): given an lse array, lane t = 0 of each quad also writes its rows'
 * log-sum-exp, (m_i scale log2(e) + log2 l_i) ln 2 (m_i is a raw score here), or +inf for a row that
 * sees no key (m_i = -inf), from l_i summed before P_ij is rounded; last, once O_i's registers are
 * free (written beside O_i, ptxas spilled at d = 32 and 96).
 *
 * Geometry: grid (T_r = ceil(T_q / B_r), n_heads, batch), read heavy tiles first; block 128 threads =
 * 4 warps. Warp w owns query rows w * B_r / 4 .. (w + 1) * B_r / 4 - 1 of Q_i as M_TILES = B_r / 64
 * tiles of 16 rows. Per K_j tile a warp issues M_TILES * (d / 16) * (B_c / 8) mma for S_ij and as
 * many for P_ij V_j, and 2 * (d / 16) * (B_c / 16) ldmatrix.x4 (d = 96: 6 k16 steps over d for
 * S_ij, 12 n8 tiles of O_i in 6 pairs). Registers per thread: Q_i fragments 4 * M_TILES * d / 16,
 * O_i accumulators 4 * M_TILES * d / 8, S_ij 4 * M_TILES * B_c / 8 (d = 64, B_r = 128, B_c = 64:
 * 32 + 64 + 64; d = 96, B_r = 64, B_c = 64: 24 + 48 + 32). A tile copy is THREADS 16-byte copies
 * per pass: THREADS / (d / 8) rows per pass when d / 8 is a power of two; for d = 96 the thread ->
 * (row, chunk) map repeats every 32 rows, 3 passes (see load_tile). Shared memory, 2-byte elements:
 *   Q_i (B_r x d) + 2 stages x (K_j + V_j) (B_c x d each)
 *   d = 64,  B_r = 128, B_c = 64: 2 * (128 * 64 + 4 * 64 * 64) = 49,152 bytes
 *   d = 64,  B_r = 64,  B_c = 64: 2 * (64 * 64 + 4 * 64 * 64) = 40,960 bytes
 *   d = 96,  B_r = 64,  B_c = 64: 2 * (64 * 96 + 4 * 64 * 96) = 61,440 bytes
 *   d = 32,  B_r = 128, B_c = 64: 24,576 bytes;  d = 128, B_r = 64, B_c = 64: 81,920 bytes
 * Every tile is a multiple of 128 bytes (d = 96: 64 rows of 192 bytes = 12,288), so each starts at
 * bank group 0 and the swizzle argument holds in each.
 *
 * Limits: d a multiple of 16 (32, 64, 96 and 128 declared); B_r 64 or 128 (d = 128: 64, or O_i and
 * Q_i alone would take 192 registers; d = 96: 64, since B_r = 128 holds 48 + 96 + 64 fragment
 * registers at B_c = 64 and spills); B_c a multiple of 16, and B_r and B_c multiples of the copy
 * period, 128 / P rows (16 for d = 64, 32 for d = 32 and 96). A scale below zero is
 * taken as |scale| with Q negated (exact in 16 bits). Every row of Q, K and V must start on a
 * 16-byte boundary, for cp.async: the launcher copies views whose rows do not (the model's packed
 * views do). dtype_id 0 reads and writes bfloat16, 1 float16; the launcher picks the instantiation
 * of the inputs' dtype (lab.dtype_param).
 *
 * lab.template    d_head, B_r, B_c, dtype_id
 * lab.configs     (64, 128, 64, 0), (64, 128, 64, 1), (64, 64, 64, 0), (64, 64, 64, 1), (32, 128, 64, 0), (32, 128, 64, 1), (128, 64, 64, 0), (128, 64, 64, 1), (96, 64, 64, 0), (96, 64, 64, 1)
 * lab.threads     128
 * lab.smem        2 * (B_r * d_head + 4 * B_c * d_head)
 * lab.strided     true
 * lab.tolerance   2
 * lab.dtypes      bfloat16, float16
 * lab.dtype_param dtype_id
 * lab.supports    noncausal, cross, gqa
 * lab.lse         true
 */

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)  // NVRTC compiles without <math.h>
#endif

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;
constexpr float FLT_MIN_NORMAL = 1.17549435e-38f;
constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
constexpr unsigned FULL_WARP = 0xffffffffu;

// One bfloat16 or float16 value as raw bits: the mma and cvt instructions decide how they read.
using element = unsigned short;

// 2^x on the special-function unit; ex2.approx.ftz(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// D += A B for one m16n8k16 tile: A 16 x 16 (4 registers of 2 values), B 16 x 8 (2), D 16 x 8 fp32 (4).
template <int dtype_id>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1)
{
    if (dtype_id == 0)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to nearest into one register, lo in the low half (cvt puts its first source high).
template <int dtype_id>
__device__ __forceinline__ unsigned pack_rounded(float lo, float hi)
{
    unsigned r;
    if (dtype_id == 0)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four 8 x 8 matrices of 16-bit values: lanes 8 i .. 8 i + 7 give the row addresses of matrix i,
// register i receives it as an mma fragment (lane l: row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// The same, each matrix transposed: lane l receives rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// cp.async: copy 16 bytes from global to shared memory without passing through registers, or
// zero-fill the 16 bytes when valid is false (src_size = 0 reads nothing).
__device__ __forceinline__ void copy_async_16(unsigned dst, const element* src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// The largest power of two that divides n (n > 0): its lowest set bit.
__host__ __device__ constexpr int power_of_two_part(int n) { return n & -n; }

// Byte offset of 16-byte chunk c (8 values) of row r in a swizzled tile of d_head columns. Shared
// memory serves 128 bytes per cycle as 8 groups of 16; an ldmatrix phase reads chunk c of 8
// consecutive rows, the first a multiple of 8. Row r starts at group chunks * r mod 8, which tells
// apart rows that differ mod rows_per_line; XOR-ing the low log2(phases) bits of c with
// (r / rows_per_line) mod phases tells apart the rest, and keeps c inside its aligned run of phases
// chunks, so inside the row (phases divides chunks): d = 96 needs no padding. The header works
// through each declared d.
template <int d_head>
__device__ __forceinline__ unsigned swizzled(int r, int c)
{
    constexpr int chunks = d_head / 8;                        // 16-byte chunks per row
    constexpr int phases = power_of_two_part(chunks) >= 8 ? 8 : power_of_two_part(chunks);
    constexpr int rows_per_line = 8 / phases;
    return r * d_head * 2 + 16 * (c ^ ((r / rows_per_line) % phases));
}

// One thread's share of a tile copy: chunk c of rows r0, r0 + period, ... of the tile, 16 bytes per
// copy; rows at or past T become zeros, so that no garbage reaches S_ij or P_ij V_j.
template <int d_head, int rows, int period>
__device__ __forceinline__ void load_rows(unsigned tile, const element* head, long long row_stride, int row_start, int T,
                                          int r0, int c)
{
    const element* src = head + (long long)(row_start + r0) * row_stride + 8 * c;
    if (row_start + rows <= T) {  // every tile but the last: no row to check, one add per copy
        #pragma unroll
        for (int n = 0; n < rows / period; ++n)
            copy_async_16(tile + swizzled<d_head>(r0 + n * period, c), src + n * period * row_stride, true);
    } else {  // a row past T reads nothing (and points at row 0, which exists)
        #pragma unroll
        for (int n = 0; n < rows / period; ++n) {
            const bool valid = row_start + r0 + n * period < T;
            copy_async_16(tile + swizzled<d_head>(r0 + n * period, c),
                          valid ? src + n * period * row_stride : head, valid);
        }
    }
}

// Start copying rows row_start .. row_start + rows - 1 of one head into a swizzled tile. Thread i
// copies chunks i, i + THREADS, i + 2 THREADS, ... of the tile read row by row, so consecutive
// threads read consecutive 16 bytes of a row. Which chunk of which row that is repeats every period
// rows, the fewest whole rows that make whole passes of the block: one pass of THREADS / chunks rows
// when chunks is a power of two (the loop below then runs no pass), 3 passes of 32 rows for d = 96.
template <int d_head, int rows>
__device__ __forceinline__ void load_tile(unsigned tile, const element* head, long long row_stride, int row_start, int T)
{
    constexpr int chunks = d_head / 8;
    constexpr int period = THREADS / power_of_two_part(chunks);
    constexpr int passes = period * chunks / THREADS;
    static_assert(THREADS % power_of_two_part(chunks) == 0 && rows % period == 0,
                  "whole passes per period, whole periods per tile");
    load_rows<d_head, rows, period>(tile, head, row_stride, row_start, T, threadIdx.x / chunks, threadIdx.x % chunks);
    #pragma unroll
    for (int p = 1; p < passes; ++p) {
        const int i = threadIdx.x + p * THREADS;
        load_rows<d_head, rows, period>(tile, head, row_stride, row_start, T, i / chunks, i % chunks);
    }
}

template <int d_head, int B_r, int B_c, int dtype_id>
__global__ void __launch_bounds__(THREADS)
attention_forward(const element* __restrict__ Q, const element* __restrict__ K, const element* __restrict__ V,
                  element* __restrict__ O, float* __restrict__ /* workspace */, int T_q, int T_k, int kv_group,
                  int causal, float scale,
                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride,
                  float* __restrict__ lse)
{
    static_assert(dtype_id == 0 || dtype_id == 1, "dtype_id: 0 = bfloat16, 1 = float16");
    static_assert(B_r == 64 || B_r == 128, "4 warps of one or two m16 tiles each");
    static_assert(d_head % 16 == 0 && B_c % 16 == 0, "k16 steps over d (S_ij) and over the keys (P_ij V_j)");
    constexpr int M_TILES = B_r / (16 * WARPS);  // m16 tiles per warp
    constexpr int rows_per_warp = 16 * M_TILES;
    constexpr int D_STEPS = d_head / 16;         // k16 steps of Q_i K_j^T; pairs of n8 tiles of O_i
    constexpr int D_TILES = d_head / 8;          // n8 tiles of O_i
    constexpr int N_TILES = B_c / 8;             // n8 tiles of S_ij
    constexpr int KEY_STEPS = B_c / 16;          // k16 steps of P_ij V_j
    constexpr int chunks = d_head / 8;           // 16-byte chunks per row
    constexpr unsigned TILE_BYTES = B_c * d_head * 2;

    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned Q_smem = (unsigned)__cvta_generic_to_shared(smem);  // B_r x d; later O_i on its way out
    const unsigned KV_smem = Q_smem + B_r * d_head * 2;                 // stage s: K_j, then V_j, at 2 s TILE_BYTES

    // Heavy tiles first: the flat block index, read as (tile rank, head), counts tiles down.
    const long long n_heads = (long long)gridDim.y * gridDim.z;
    const long long flat = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    const int q_tile = gridDim.x - 1 - (int)(flat / n_heads);
    const long long bh = flat % n_heads;    // = batch * NH + head
    const long long batch = bh / gridDim.y;
    const long long head = bh % gridDim.y;
    const long long kv_head = head / kv_group;  // grouped-query attention: kv_group query heads per K/V head

    const element* Q_head = Q + batch * q_batch_stride + head * q_head_stride;
    const element* K_head = K + batch * kv_batch_stride + kv_head * kv_head_stride;
    const element* V_head = V + batch * kv_batch_stride + kv_head * kv_head_stride;
    element* O_head = O + bh * T_q * d_head;  // O is contiguous (B, NH, T_q, d)
    const bool o_vec = (reinterpret_cast<unsigned long long>(O_head) & 15) == 0;

    const int row_start = q_tile * B_r;
    const int rows = min(B_r, T_q - row_start);
    // Query row i sees keys j <= i + offset: the causal mask aligned bottom-right when T_q != T_k.
    const int offset = T_k - T_q;
    int T_c = (T_k + B_c - 1) / B_c;
    if (causal) {  // stop at the tile of the last key the last row sees; none if it sees none
        const int last_key = row_start + rows - 1 + offset;
        T_c = last_key < 0 ? 0 : min(T_c, last_key / B_c + 1);
    }

    // Q_i, K_0 and V_0 arrive together; nothing overlaps the first tile's copies.
    load_tile<d_head, B_r>(Q_smem, Q_head, q_row_stride, row_start, T_q);
    if (T_c > 0) {
        load_tile<d_head, B_c>(KV_smem, K_head, kv_row_stride, 0, T_k);
        load_tile<d_head, B_c>(KV_smem + TILE_BYTES, V_head, kv_row_stride, 0, T_k);
    }
    copy_async_commit();
    copy_async_wait_all();
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row = warp * rows_per_warp;         // first row of this warp in Q_i
    const int warp_first = row_start + warp_row;       // ... as a query index
    const int warp_last = warp_first + rows_per_warp - 1;

    // Q_i fragments, once: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    // (rows 8-15, k 8-15) of each 16 x 16 block are A registers 0, 1, 2, 3.
    unsigned Q_frag[M_TILES][D_STEPS][4];
    const unsigned q_sign = scale < 0.0f ? 0x80008000u : 0u;  // scale < 0: S with -Q_i and |scale|
    #pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        #pragma unroll
        for (int ks = 0; ks < D_STEPS; ++ks) {
            ldmatrix_x4(Q_frag[mt][ks], Q_smem + swizzled<d_head>(warp_row + 16 * mt + lane % 16, 2 * ks + lane / 16));
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                Q_frag[mt][ks][i] ^= q_sign;
        }
    // A zero scale would give -inf * 0 = NaN for masked scores; the smallest normal float gives the
    // same softmax (every finite score times it flushes to zero) and keeps -inf at -inf.
    const float scale_log2 = fmaxf(fabsf(scale) * LOG2_E, FLT_MIN_NORMAL);

    float O_acc[M_TILES][D_TILES][4];      // O_i rows g, g + 8 of each m16 tile; columns 8 n + 2 t, + 1
    float m_i[M_TILES][2], l_i[M_TILES][2];  // l_i: this lane's share of the row sum, reduced at the end
    #pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            m_i[mt][h] = -INFINITY, l_i[mt][h] = 0.0f;
        #pragma unroll
        for (int n = 0; n < D_TILES; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                O_acc[mt][n][e] = 0.0f;
    }

    for (int j = 0; j < T_c; ++j) {
        const int col_start = j * B_c;
        const unsigned K_j = KV_smem + (j % 2) * 2 * TILE_BYTES;
        const unsigned V_j = K_j + TILE_BYTES;
        // The other stage was last read in tile j - 1, which every warp finished before the barrier.
        if (j + 1 < T_c) {
            const unsigned K_next = KV_smem + ((j + 1) % 2) * 2 * TILE_BYTES;
            load_tile<d_head, B_c>(K_next, K_head, kv_row_stride, col_start + B_c, T_k);
            load_tile<d_head, B_c>(K_next + TILE_BYTES, V_head, kv_row_stride, col_start + B_c, T_k);
            copy_async_commit();
        }

        // A warp whose rows all lie past T_q, or none of whose rows sees a key of this tile, skips it.
        const bool warp_active = warp_first < T_q && !(causal && col_start > warp_last + offset);
        if (warp_active) {
            // S_ij = Q_i K_j^T. K_j rows are keys, so plain ldmatrix gives B fragments (k = d, n = key):
            // matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
            // are b0, b1 of n-tile 2 np and b0, b1 of n-tile 2 np + 1.
            float S[M_TILES][N_TILES][4];
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                #pragma unroll
                for (int n = 0; n < N_TILES; ++n)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e)
                        S[mt][n][e] = 0.0f;
            #pragma unroll
            for (int ks = 0; ks < D_STEPS; ++ks)
                #pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    unsigned K_frag[4];
                    ldmatrix_x4(K_frag, K_j + swizzled<d_head>(16 * np + lane % 8 + 8 * (lane / 16), 2 * ks + (lane / 8) % 2));
                    #pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_m16n8k16<dtype_id>(S[mt][2 * np], Q_frag[mt][ks], K_frag[0], K_frag[1]);
                        mma_m16n8k16<dtype_id>(S[mt][2 * np + 1], Q_frag[mt][ks], K_frag[2], K_frag[3]);
                    }
                }

            // Only a tile whose last key lies past what the warp's first row sees, or past T_k, holds
            // masked scores. Select, do not add: whatever sits in a masked score becomes -inf, then 0.
            if ((causal && col_start + B_c - 1 > warp_first + offset) || col_start + B_c > T_k) {
                #pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    #pragma unroll
                    for (int n = 0; n < N_TILES; ++n)
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int row = warp_first + 16 * mt + g + 8 * (e / 2);
                            const int key = col_start + 8 * n + 2 * t + e % 2;
                            if (key >= T_k || (causal && key > row + offset))
                                S[mt][n][e] = -INFINITY;
                        }
            }

            float alpha[M_TILES][2];
            bool max_moved = false;
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {  // row g (h = 0) or g + 8 (h = 1): accumulator entries 2 h, 2 h + 1
                    // m_new = max(m_i, rowmax(S_ij)), over this lane's columns and then its quad's.
                    float m_new = m_i[mt][h];
                    #pragma unroll
                    for (int n = 0; n < N_TILES; ++n)
                        m_new = fmaxf(m_new, fmaxf(S[mt][n][2 * h], S[mt][n][2 * h + 1]));
                    m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 1));
                    m_new = fmaxf(m_new, __shfl_xor_sync(FULL_WARP, m_new, 2));
                    // A row that has seen no key yet keeps m = -inf; subtract 0 then, not -inf.
                    const float m_scaled = m_new == -INFINITY ? 0.0f : m_new * scale_log2;
                    // P_ij = 2^(scale log2(e) S_ij - m_new'); l_i = 2^(m_i' - m_new') l_i + rowsum(P_ij), and
                    // O_i is scaled by the same alpha: 0 while m_i = -inf, exactly 1 while the max stays.
                    max_moved |= m_new != m_i[mt][h];
                    alpha[mt][h] = m_new == m_i[mt][h] ? 1.0f : exp2_approx(fmaf(m_i[mt][h], scale_log2, -m_scaled));
                    m_i[mt][h] = m_new;
                    float row_sum = 0.0f;
                    #pragma unroll
                    for (int n = 0; n < N_TILES; ++n)
                        #pragma unroll
                        for (int e = 2 * h; e < 2 * h + 2; ++e) {
                            S[mt][n][e] = exp2_approx(fmaf(S[mt][n][e], scale_log2, -m_scaled));
                            row_sum += S[mt][n][e];
                        }
                    l_i[mt][h] = l_i[mt][h] * alpha[mt][h] + row_sum;
                }
            // Once the row maxima of all the warp's rows have settled, most tiles skip rescaling O_i.
            if (__any_sync(FULL_WARP, max_moved)) {
                #pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    #pragma unroll
                    for (int n = 0; n < D_TILES; ++n)
                        #pragma unroll
                        for (int e = 0; e < 4; ++e)
                            O_acc[mt][n][e] *= alpha[mt][e / 2];
            }

            // O_i += P_ij V_j. n-tiles 2 kk and 2 kk + 1 of P_ij, rounded to 16 bits, are the A
            // fragment of key step kk. V_j rows are keys, so ldmatrix.trans gives B fragments (k = key,
            // n = d): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
            // (keys 8-15, d 8-15) are b0, b1 of d-tile 2 dp and b0, b1 of d-tile 2 dp + 1.
            #pragma unroll
            for (int kk = 0; kk < KEY_STEPS; ++kk) {
                unsigned P_frag[M_TILES][4];
                #pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    P_frag[mt][0] = pack_rounded<dtype_id>(S[mt][2 * kk][0], S[mt][2 * kk][1]);
                    P_frag[mt][1] = pack_rounded<dtype_id>(S[mt][2 * kk][2], S[mt][2 * kk][3]);
                    P_frag[mt][2] = pack_rounded<dtype_id>(S[mt][2 * kk + 1][0], S[mt][2 * kk + 1][1]);
                    P_frag[mt][3] = pack_rounded<dtype_id>(S[mt][2 * kk + 1][2], S[mt][2 * kk + 1][3]);
                }
                #pragma unroll
                for (int dp = 0; dp < D_STEPS; ++dp) {
                    unsigned V_frag[4];
                    ldmatrix_x4_trans(V_frag, V_j + swizzled<d_head>(16 * kk + lane % 8 + 8 * ((lane / 8) % 2), 2 * dp + lane / 16));
                    #pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_m16n8k16<dtype_id>(O_acc[mt][2 * dp], P_frag[mt], V_frag[0], V_frag[1]);
                        mma_m16n8k16<dtype_id>(O_acc[mt][2 * dp + 1], P_frag[mt], V_frag[2], V_frag[3]);
                    }
                }
            }
        }

        // Tile j + 1 has landed for every thread, and every warp is done with tile j's stage.
        copy_async_wait_all();
        __syncthreads();
    }

    // O_i = O_i / l_i, once, rounded to 16 bits into the warp's own rows of Q_i's shared memory
    // (only this warp ever read them); l_i is the sum of the quad's shares, 0 for a row that sees no
    // key, whose output is 0.
    #pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_i[mt][h];
            l += __shfl_xor_sync(FULL_WARP, l, 1);
            l += __shfl_xor_sync(FULL_WARP, l, 2);
            l_i[mt][h] = l;  // the row's, for its log-sum-exp
            const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
            const int r = warp_row + 16 * mt + g + 8 * h;
            #pragma unroll
            for (int n = 0; n < D_TILES; ++n) {
                const unsigned o = pack_rounded<dtype_id>(O_acc[mt][n][2 * h] * inv_l, O_acc[mt][n][2 * h + 1] * inv_l);
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(Q_smem + swizzled<d_head>(r, n) + 4 * t), "r"(o));
            }
        }
    __syncwarp();
    #pragma unroll
    for (int idx = lane; idx < rows_per_warp * chunks; idx += 32) {
        const int r = idx / chunks, c = idx % chunks;
        const int row = warp_first + r;
        if (row < T_q) {
            unsigned w[4];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(Q_smem + swizzled<d_head>(warp_row + r, c)));
            element* dst = O_head + (long long)row * d_head + 8 * c;
            if (o_vec) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
                #pragma unroll
                for (int e = 0; e < 8; ++e)
                    dst[e] = (element)(w[e / 2] >> (16 * (e % 2)));
            }
        }
    }

    // The log-sum-exp of the thread's rows, once O_i is out (its registers free), by lane t = 0.
    if (lse != nullptr && t == 0) {
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_first + 16 * mt + g + 8 * h;
                if (row < T_q)
                    lse[bh * T_q + row] = m_i[mt][h] == -INFINITY ? INFINITY : (m_i[mt][h] * scale_log2 + __log2f(l_i[mt][h])) * LN_2;
            }
    }
}
