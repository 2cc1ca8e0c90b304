"""How fast one SM's tensor cores take wgmma, by shape and operand source: FLOPs a clock an SM for
m64nNk16 bfloat16 products with both operands in shared memory (SS) or A in registers (RS), B K-major or
MN-major (read transposed), from one, two or three warpgroups issuing at once, nothing else in the loop.

    python3 tools/wgmma_rate.py                         the default variants (about 20 s on an H200)
    python3 tools/wgmma_rate.py --variants ss64,ss80,rs128 --warpgroups 2
    python3 tools/wgmma_rate.py --traffic --pause-ns 900 --variants ss64,ss80,rs64 --warpgroups 2
                                                        beside a warpgroup storing to shared memory
    python3 tools/wgmma_rate.py --source ss80           the generated CUDA source of one variant
    python3 tools/wgmma_rate.py --traffic --results results    also a result file the docs can cite

A variant is `ss` or `rs`, N, and `t` for an MN-major B (ss64t: B 16 x 64, its rows the k index, as b08's
dV = P^T dO reads dO). The question it answers: the backward rungs' S^T and dP^T products at d = 128 are
SS m64n64k16 (b08's B_r = 64), and each reads A (2 KB) and B (2 KB) from shared memory for 131,072 FLOPs;
at 4,096 FLOPs a clock (an H100's or H200's dense bfloat16 peak, 989 TFLOP/s at 1,830 MHz on 132 SMs) that
is 32 clocks for 4 KB, 128 bytes a clock, shared memory's whole bandwidth. Does SS at N = 64 reach the
peak, and does N = 80 (FlashAttention-3's query tile at d = 128) or RS get closer? Each block is one SM's
(grid = SM count, one block an SM); each warpgroup issues batches of 4 products (k = 64) into its own
accumulators, one batch in flight behind the next (wgmma.wait_group 1), `--iters` batches; the SM clock is
read around the loop (clock64, block 0's warpgroups), so the figure is FLOPs a clock, independent of the
clock the card holds. Operands are pseudo-random bfloat16 in [-1, 1) (zeros draw less power), written to
shared memory before the loop and fenced for the async proxy.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEAK = 4096  # dense bfloat16 FLOPs a clock an SM (H100, H200): 4 tensor cores x 1,024
K_STEPS = 4  # products a batch (k = 64: one 128-byte row of A and B)
SMEM = 64 * 1024  # A (8 KB), B (up to 32 KB at N = 256) and the traffic's 16 KB from 48 KB, 1024-aligned
DEFAULT = "ss64,ss64t,ss80,ss128,ss256,rs64,rs64t,rs80,rs128,rs128t,rs256"
# The storing warpgroup (--traffic), threads FIRST and up, until warpgroup 0's loop ends, 16 KB then a pause of
# PAUSE_NS; `stored` gets its bytes.
TRAFFIC = """    if (threadIdx.x >= FIRST) {  // the traffic: 2 KB a round into 16 KB past the operands
        const unsigned at = base + 49152 + (threadIdx.x % 128) * 16;
        unsigned long long rounds = 0;
        while (!done) {
#pragma unroll
            for (int r = 0; r < 8; ++r)
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at + r * 2048), "r"(r), "r"(at),
                             "r"(iters), "r"((unsigned)rounds) : "memory");
            rounds += 8;
            if (PAUSE_NS > 0) __nanosleep(PAUSE_NS);
        }
        if (blockIdx.x == 0 && threadIdx.x % 128 == 0) stored[0] = rounds * 2048;
        return;
    }
"""


@dataclass(frozen=True)
class Variant:
    source: str  # "ss" or "rs"
    n: int
    trans_b: bool

    @classmethod
    def parse(cls, text: str) -> Variant:
        m = re.fullmatch(r"(ss|rs)(\d+)(t?)", text.strip())
        if not m:
            raise ValueError(f"a variant is ss or rs, N and an optional t (ss64, rs128t), not {text!r}")
        v = cls(m.group(1), int(m.group(2)), m.group(3) == "t")
        if not (8 <= v.n <= 256 and v.n % 8 == 0):
            raise ValueError(f"{text}: N must be a multiple of 8 from 8 to 256")
        if v.trans_b and v.n % 64:
            raise ValueError(f"{text}: an MN-major B in the 128-byte swizzle takes N in whole 64-column atoms")
        return v

    @property
    def name(self) -> str:
        return f"{self.source}{self.n}{'t' if self.trans_b else ''}"


def source(v: Variant, warpgroups: int, traffic: bool = False, pause_ns: int = 0) -> str:
    """The CUDA source of one variant: kernel `rate(out, cycles, stored, iters)`; traffic: one more warpgroup
    storing 16 bytes a thread to shared memory until warpgroup 0's loop ends, pause_ns after each 16 KB
    (`stored`: its bytes)."""
    regs = v.n // 2
    d_list = ", ".join(f"%{i}" for i in range(regs))
    constraints = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    instr = f"wgmma.mma_async.sync.aligned.m64n{v.n}k16.f32.bf16.bf16"
    tb = int(v.trans_b)
    if v.source == "ss":
        mma = (f'asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n{instr} {{{d_list}}}, '
               f'%{regs}, %{regs + 1}, p, 1, 1, 0, {tb};\\n}}" : {constraints} : "l"(a_desc + 2 * s), '
               f'"l"(b_desc + b_step * s), "r"(1));')
    else:
        mma = (f'asm volatile("{instr} {{{d_list}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, '
               f'%{regs + 4}, 1, 1, 1, {tb};" : {constraints} : "r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), '
               f'"r"(a[s][3]), "l"(b_desc + b_step * s));')
    # B: K-major, N rows of 128 bytes (k contiguous), 8-row groups 1024 bytes apart, a k step 32 bytes on;
    # MN-major, 64 k rows of 128 bytes for each 64-column atom, atoms 64 * 128 bytes apart, a k step 16 rows
    b_lbo, b_sbo, b_step = (64 * 128, 1024, 2048 >> 4) if v.trans_b else (16, 1024, 32 >> 4)
    traffic_loop = TRAFFIC.replace("FIRST", str(warpgroups * 128)).replace("PAUSE_NS", str(pause_ns)) if traffic else ""
    return f"""
// tools/wgmma_rate.py, variant {v.name}, {warpgroups} warpgroup(s){", and one storing to shared memory" if traffic else ""}
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned lbo, unsigned sbo)
{{
    return (unsigned long long)((address & 0x3ffff) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(sbo >> 4) << 32 | 1ull << 62;
}}

__device__ __forceinline__ unsigned bits(unsigned i)  // two pseudo-random bfloat16, magnitudes in [0.5, 1)
{{
    i = i * 2654435761u ^ (i >> 13);
    i = i * 2246822519u ^ (i >> 16);
    const unsigned lo = 0x3f00u | (i & 0x7fu) | (i & 0x80u) << 8, hi = 0x3f00u | (i >> 8 & 0x7fu) | (i >> 8 & 0x80u) << 8;
    return hi << 16 | lo;
}}

extern "C" __global__ void __launch_bounds__({(warpgroups + traffic) * 128}, 1)
rate(float* out, long long* cycles, unsigned long long* stored, int iters)
{{
    __shared__ volatile int done;
    extern __shared__ unsigned char raw[];
    const unsigned raw_at = (unsigned)__cvta_generic_to_shared(raw), base = (raw_at + 1023u) & ~1023u;
    unsigned* words = reinterpret_cast<unsigned*>(raw + (base - raw_at));
    for (int i = threadIdx.x; i < {SMEM // 4}; i += blockDim.x) words[i] = bits(i + 977u * blockIdx.x);
    if (threadIdx.x == 0) done = 0;
    __syncthreads();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
{traffic_loop}    const unsigned long long a_desc = descriptor(base, 16, 1024);
    const unsigned long long b_desc = descriptor(base + 8192, {b_lbo}, {b_sbo});
    const unsigned long long b_step = {b_step};
    unsigned a[{K_STEPS}][4];
#pragma unroll
    for (int s = 0; s < {K_STEPS}; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[s][r] = bits(threadIdx.x * 16 + s * 4 + r);
    float d[{regs}];
#pragma unroll
    for (int i = 0; i < {regs}; ++i) d[i] = 0.0f;
    long long began;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(began)::"memory");
    for (int i = 0; i < iters; ++i) {{
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int s = 0; s < {K_STEPS}; ++s)
            {mma}
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    }}
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    long long ended;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(ended)::"memory");
    if (threadIdx.x == 0) done = 1;
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < {regs}; ++i) total += d[i];
    out[blockIdx.x * {warpgroups * 128} + threadIdx.x] = total;
    if (blockIdx.x == 0 && threadIdx.x % 128 == 0) cycles[threadIdx.x / 128] = ended - began;
}}
"""


OPTIONS = ("-arch=sm_90a", "-std=c++17")


def flops_per_batch(v: Variant) -> int:
    return 2 * 64 * v.n * 16 * K_STEPS


def measure(v: Variant, warpgroups: int, iters: int, traffic: bool = False, pause_ns: int = 0) -> dict:
    """The variant on every SM: its FLOPs a clock an SM (block 0's slowest warpgroup), TFLOP/s (events), and
    with traffic the bytes a clock the storing warpgroup wrote to shared memory meanwhile."""
    import cupy as cp

    from kernels.runtime import device_limits

    sms = device_limits().sm_count
    fn = cp.RawModule(code=source(v, warpgroups, traffic, pause_ns), options=OPTIONS).get_function("rate")
    fn.max_dynamic_shared_size_bytes = SMEM + 1024
    out = cp.empty(sms * warpgroups * 128, dtype=cp.float32)
    cycles = cp.zeros(warpgroups, dtype=cp.int64)
    stored = cp.zeros(1, dtype=cp.uint64)
    args = (out, cycles, stored, cp.int32(iters))
    launch = lambda: fn((sms,), ((warpgroups + traffic) * 128,), args, shared_mem=SMEM + 1024)  # noqa: E731
    launch()  # compiled and warm
    times = []
    for _ in range(5):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    flops = flops_per_batch(v) * iters * warpgroups
    clocks = int(cycles.get().max())
    seconds = sorted(times)[len(times) // 2]
    return {"variant": v.name, "warpgroups": warpgroups, "flops_per_clock": flops / clocks,
            "of_peak": flops / clocks / PEAK, "tflops": flops * sms / seconds / 1e12,
            "mhz": clocks / seconds / 1e6, "finite": bool(cp.isfinite(out).all()),
            "traffic_bytes_per_clock": int(stored.get()[0]) / clocks if traffic else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=DEFAULT, help=f"comma-separated (default {DEFAULT})")
    parser.add_argument("--warpgroups", default="1,2", help="warpgroups a block, comma-separated (default 1,2)")
    parser.add_argument("--iters", type=int, default=20000, help="batches of 4 products a warpgroup (default 20000)")
    parser.add_argument("--traffic", action="store_true",
                        help="one more warpgroup storing to shared memory, as a rung's other work does")
    parser.add_argument("--pause-ns", type=int, default=0,
                        help="with --traffic, the storing warpgroup's pause after each 16 KB (default 0: none; "
                             "b08's dK/dV kernel stores about 10 bytes a clock an SM, Nsight Compute)")
    parser.add_argument("--source", metavar="VARIANT", help="print the generated source of one variant and exit")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="also write the rows into DIR/wgmmarate-<device>-<UTC time>.json")
    args = parser.parse_args(argv)
    try:
        if args.source:
            print(source(Variant.parse(args.source), int(args.warpgroups.split(",")[0]), args.traffic, args.pause_ns))
            return 0
        variants = [Variant.parse(t) for t in args.variants.split(",") if t.strip()]
        groups = [int(w) for w in args.warpgroups.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if any(w not in (1, 2, 3) for w in groups) or (args.traffic and 3 in groups):
        parser.error("--warpgroups: 1, 2 or 3 a block (1 or 2 with --traffic)")
    if args.pause_ns < 0 or (args.pause_ns and not args.traffic):
        parser.error("--pause-ns: a pause of 0 ns or more, with --traffic")
    if args.traffic and any(v.n > 128 for v in variants):
        parser.error("--traffic: N up to 128 (beside the storing warpgroup ptxas serializes N = 256's products, C7520)")
    print(f"{'variant':<9} {'wg':>3} {'FLOP/clk/SM':>12} {'of peak':>8} {'TFLOP/s':>9} {'MHz':>6}"
          + (f" {'stores B/clk':>13}" if args.traffic else ""))
    rows = []
    for w in groups:
        for v in variants:
            r = measure(v, w, args.iters, args.traffic, args.pause_ns)
            rows.append(r)
            print(f"{r['variant']:<9} {w:>3} {r['flops_per_clock']:>12,.0f} {r['of_peak']:>8.1%} "
                  f"{r['tflops']:>9.1f} {r['mhz']:>6.0f}"
                  + (f" {r['traffic_bytes_per_clock']:>13.1f}" if args.traffic else "")
                  + ("" if r["finite"] else "  (non-finite sums)"))
    if args.results:
        print(f"wrote {save(rows, vars(args), sys.argv[1:] if argv is None else argv, args.results)}")
    return 0


def save(rows: list[dict], options: dict, argv: list[str], folder: Path) -> Path:
    """The rows as a result file (benchmarks.results' naming and header: device, versions, date, command)."""
    from benchmarks.results import write_tool_result

    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in options.items() if k != "source"}
    return write_tool_result("wgmmarate", "tools/wgmma_rate.py", argv,
                             {"peak_flops_per_clock": PEAK, "options": options, "rows": rows}, folder)


if __name__ == "__main__":
    sys.exit(main())
