/*
 * synccheck_cluster - v17's barriers and nothing else (kernels/v17_decode_cluster.cu): the kernel that
 * tools/synccheck_cluster.py runs under compute-sanitizer's synccheck beside v17 itself, to tell a
 * divergent barrier in v17 from a report of the tool's.
 *
 * Every thread of every block executes every barrier, in v17's order:
 *   barrier.cluster.arrive.relaxed          "this block is running", at the start
 *   (rank 0 only: a wait of late_ns nanoseconds, as v17's split 0 works through the keys while splits
 *   past the last key tile have none)
 *   __syncthreads()                         inside the open cluster phase (v17: after staging Q_i, and
 *                                           after the warps' merge)
 *   barrier.cluster.wait.acquire            every block of the cluster runs: rank 0's shared memory exists
 *   a loop over `items` pushes (threads below `items` busy, the others idle: v17's push of a tile's
 *   rows x d / 4 chunks), each a store into rank 0's shared memory (mapa + st.shared::cluster)
 *   barrier.cluster.arrive.release, barrier.cluster.wait.acquire   every push has landed in rank 0
 *   the other ranks exit; rank 0 sums the CLUSTER pushes of each item and writes them (its idle threads
 *   exit too)
 * No barrier is inside a branch or after an exit: a divergent-barrier report on this kernel is the tool's.
 *
 * Geometry: grid (clusters x CLUSTER), clusters of (CLUSTER, 1, 1), 128 threads as v17's blocks, dynamic
 * shared memory at least CLUSTER x 128 floats (the launcher gives v17's 44,288 bytes, so that as many
 * blocks share an SM). Cluster c pushes 16 items (v17's one-row tile at d = 64: 16 chunks) where
 * small_every > 0 and c % small_every == small_every - 1, else 128 (a tile of 8 rows: one item a thread).
 * Output: out[c * 128 + i] = sum over ranks s of (s + i) for i below cluster c's items; the rest untouched.
 */

constexpr int THREADS = 128;

// The cluster barrier's instructions, without .aligned (cg::this_cluster().sync()'s, and v17's) or with it
// (CUTLASS's): ALIGNED promises that the whole warp executes each one converged.
template <bool ALIGNED> __device__ __forceinline__ void arrive_relaxed()
{
    if constexpr (ALIGNED) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    else asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
template <bool ALIGNED> __device__ __forceinline__ void arrive_release()
{
    if constexpr (ALIGNED) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
template <bool ALIGNED> __device__ __forceinline__ void wait_acquire()
{
    if constexpr (ALIGNED) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    else asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

template <int CLUSTER, bool ALIGNED>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 4)
cluster_skeleton(float* __restrict__ out, int small_every, long long late_ns)
{
    extern __shared__ __align__(16) float pushed[];  // CLUSTER x THREADS: the ranks' pushes, in rank 0
    const int rank = blockIdx.x % CLUSTER, cluster = blockIdx.x / CLUSTER;
    const int items = small_every > 0 && cluster % small_every == small_every - 1 ? 16 : THREADS;

    arrive_relaxed<ALIGNED>();
    if (rank == 0 && late_ns > 0) {  // uniform over the block
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        while ((long long)(now - start) < late_ns);
    }
    __syncthreads();
    wait_acquire<ALIGNED>();

    // this rank's row of rank 0's `pushed`, as an address in the cluster's shared window
    unsigned row;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(row)
                 : "r"((unsigned)__cvta_generic_to_shared(pushed + rank * THREADS)), "r"(0u));
    for (int i = threadIdx.x; i < items; i += THREADS)
        asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(row + 4 * i), "f"((float)(rank + i)) : "memory");

    __syncwarp();  // the push loop's trip count differs across lanes: converged for the .aligned forms
    arrive_release<ALIGNED>();
    wait_acquire<ALIGNED>();
    if (rank != 0)
        return;  // nobody reads this block's shared memory
    for (int i = threadIdx.x; i < items; i += THREADS) {
        float sum = 0.0f;
        for (int s = 0; s < CLUSTER; ++s)
            sum += pushed[s * THREADS + i];
        out[cluster * THREADS + i] = sum;
    }
}
