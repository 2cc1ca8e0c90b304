/*
 * spin - hold the stream for `ns` nanoseconds (the global timer), doing nothing else.
 *
 * The per-kernel profile of a decode step launches one of these first, so that the host can queue the
 * whole step, with an event around each kernel, before the GPU starts it: the events then time the
 * kernels back to back, not the host's launch latency.
 * Geometry: one thread.
 *
 * handoff - nothing but one more kernel boundary in a chain of programmatic dependent launches (common.cuh):
 * it lets the next kernel launch at once, as the kernel before it did, and completes when that kernel has,
 * so the next kernel's griddep_wait() waits for one more grid to complete and nothing else changes. What
 * N of them a layer add to a decode step is what N boundaries cost there (tools/llama_step_variants.py's
 * pad=N). Under an ordinary launch it returns at once.
 * Geometry: one warp.
 */
#include "common.cuh"

__global__ void spin(long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}

__global__ void handoff()
{
    griddep_launch_dependents();  // the next kernel may start: it reads nothing of this one's
    griddep_wait();               // complete only once the kernel before has
}
