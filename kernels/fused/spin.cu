/*
 * spin - hold the stream for `ns` nanoseconds (the global timer), doing nothing else.
 *
 * The per-kernel profile of a decode step launches one of these first, so that the host can queue the
 * whole step, with an event around each kernel, before the GPU starts it: the events then time the
 * kernels back to back, not the host's launch latency.
 * Geometry: one thread.
 */
__global__ void spin(long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((long long)(now - start) < ns);
}
