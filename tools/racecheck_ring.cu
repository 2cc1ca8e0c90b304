/*
 * racecheck_ring - the weight stream of kernels/fused/decode_step.cu and nothing else: the kernel that
 * tools/racecheck_ring.py runs under compute-sanitizer's racecheck beside decode_step itself, to tell a
 * race in the stream's protocol from a report of the tool's.
 *
 * decode_step's ring, as it is: a producer lane (warp THREADS / 32) copies item i (one slot of floats,
 * in two cp.async.bulk ranges, as an item comes in ranges) into slot i % nslot once the compute threads
 * have released item i - nslot, issue_ns after the release; it expects the item's bytes on the slot's
 * "full" mbarrier first. Every compute thread waits for the item itself (try_wait.parity on full), reads
 * the slot with plain shared-memory loads (each thread every THREADS-th 16-byte vector, summed), then
 * releases it: the compute threads' named barrier, and thread 0 arrives on the slot's "empty" mbarrier
 * (arrival count 1). What the cases vary, one property at a time:
 *   all_arrive  every compute thread arrives on empty after the named barrier (arrival count THREADS),
 *               as kernels/backward/b05_wgmma.cu's consumers do since racecheck flagged one lane's arrival
 *               for its warp
 *   issue_ns    the producer's pause after a release (decode_step's 550 ns in float32)
 *   wait_first  the producer issues item i only once thread 0 has begun its wait for it (a flag in global
 *               memory, which racecheck does not watch) and issue_ns have passed: with issue_ns long (200 us),
 *               every compute thread's wait begins before its copy is issued
 *   take_ns     the compute threads' pause before each wait: long (200 us), so that every copy has landed
 *               before its wait begins, or none
 *   recheck     after the wait's loop returns, one mbarrier.test_wait.parity more, which finds the phase
 *               complete at once
 * Under the PTX memory model every case is race-free: the phase's completion (the producer's arrival and
 * every byte's complete_tx) makes the copy's writes visible to each thread whose wait observes it (the
 * read after it), and the named barrier orders every thread's reads before thread 0's release-arrive,
 * which the producer's acquire-wait observes before it issues the next copy into the slot.
 *
 * Geometry: `blocks` blocks of THREADS + 32 threads, dynamic shared memory 128 bytes of mbarriers (full,
 * then empty, MAX_SLOTS each) + nslot * slot_floats floats. src: items x slot_floats floats, the same
 * items for every block. waiting: a word per block (zero at launch). Output: out[b * THREADS + t] = the
 * sum over items of thread t's vectors.
 */

#define MAX_SLOTS 8
constexpr int THREADS = 320;  // decode_step's compute threads; one warp more issues the copies

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// decode_step's wait; with recheck, a test_wait of the same parity after it (true at once).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity, bool recheck)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    if (recheck)
        asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void spin_ns(unsigned ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }

extern "C" __global__ void __launch_bounds__(THREADS + 32, 1)
ring(const float* __restrict__ src, int items, int nslot, int slot_floats, int all_arrive, int recheck,
     unsigned issue_ns, int wait_first, unsigned take_ns, int* __restrict__ waiting, float* __restrict__ out)
{
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
    unsigned long long* empty = full + MAX_SLOTS;
    float* slots = reinterpret_cast<float*>(smem + 16 * MAX_SLOTS);
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < nslot; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, all_arrive ? THREADS : 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (tid >= THREADS) {  // the producer warp: lane 0 issues, as decode_step's
        if (tid == THREADS)
            for (int i = 0; i < items; ++i) {
                if (i >= nslot) mbar_wait(empty + i % nslot, (unsigned)((i / nslot - 1) & 1), false);
                if (wait_first) {
                    int seen;
                    do asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(waiting + blockIdx.x));
                    while (seen <= i);
                }
                if (i >= nslot || wait_first) spin_ns(issue_ns);
                const unsigned bytes = slot_floats * 4u, first = bytes / 32 * 16;  // two ranges, 16-byte multiples
                float* dst = slots + (i % nslot) * slot_floats;
                const float* from = src + (long long)i * slot_floats;
                mbar_expect(full + i % nslot, bytes);
                bulk_copy(dst, from, first, full + i % nslot);
                bulk_copy(dst + first / 4, from + first / 4, bytes - first, full + i % nslot);
            }
        return;
    }
    float acc = 0.0f;
    for (int i = 0; i < items; ++i) {
        if (take_ns > 0) spin_ns(take_ns);
        if (wait_first && tid == 0)
            asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(waiting + blockIdx.x), "r"(i + 1) : "memory");
        mbar_wait(full + i % nslot, (unsigned)((i / nslot) & 1), recheck != 0);
        const float4* slot = reinterpret_cast<const float4*>(slots + (i % nslot) * slot_floats);
        for (int v = tid; v < slot_floats / 4; v += THREADS) {
            const float4 a = slot[v];
            acc += (a.x + a.y) + (a.z + a.w);
        }
        compute_sync();  // every thread's reads of the slot done
        if (all_arrive || tid == 0) mbar_arrive(empty + i % nslot);
    }
    out[blockIdx.x * THREADS + tid] = acc;
}
