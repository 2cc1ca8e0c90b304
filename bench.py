#!/usr/bin/env python3
"""Benchmarks of the attention ladder, beside its peers, and of GPT-2 generation; the README's tables.

    python3 bench.py kernels                    every rung x the five GPT-2 shapes, beside CuPy and torch SDPA
    python3 bench.py kernels --kernels v01,v02 --shape 8x1024 --shape 1x8192
    python3 bench.py sweep                      TFLOP/s against T = 128 .. 16384, with a PNG plot
    python3 bench.py sweep --dtype bfloat16 --d 128 --nh 16 --kernels v24 --peers sdpa_flash,sdpa_cudnn
                                                the same in bfloat16 at d=128 beside FA2 and cuDNN (and at d=64:
                                                --d 64 --nh 12); `readme` shows the newest of each dtype and d
    python3 bench.py e2e                        seconds to generate 512 tokens, per rung, without and with a KV cache
    python3 bench.py e2e --sizes all            decode at scale: every GPT-2 and Llama size, tokens/s against the
                                                bandwidth floor, peak memory against its bound, the first token
                                                of a 1,000-token prompt, beside HF transformers
    python3 bench.py resources [--arch sm_90]   registers, shared memory, spills, resident blocks per SM
    python3 bench.py features                   decode, long-context decode, non-causal, cross lengths, GQA and
                                                head sizes on the rungs that declare them, beside torch SDPA
    python3 bench.py kernels --kernels v19,t01 --dtype bfloat16   CUDA and Triton rungs side by side
    python3 bench.py frontier                   bfloat16 at the frontier's shapes (GPT-2, d=128, GQA, non-causal):
                                                v19 and the TMA rungs beside SDPA flash and cuDNN, against the
                                                targets (>= 1.1x cuDNN; 620 and 650 TFLOP/s at d=128)
    python3 bench.py fp8                        the FP8 rungs (v25-v29) beside v22, v24, the newest bfloat16 rung,
                                                SDPA flash and cuDNN at d=128 (T = 4096 .. 16384) and d=64, against
                                                the target (>= 1.5x the best bfloat16 rung); its RMSE on the outlier
                                                distribution beside one scale per tensor (target <= 1.0e-2)
    python3 bench.py profile                    Nsight Compute's counters for every rung (one launch each, 8x1024)
                                                and the decode step, with a roofline plot
    python3 bench.py sass --kernels v27         where a rung's warps wait, by SASS instruction (Nsight Compute's
                                                source view) at a frontier case
    python3 bench.py levels                     seed 004's four levels: PyTorch, torch.compile, Triton, CUDA
                                                (and SDPA) at the GPT-2 and two d=128 shapes, with lines of code
    python3 bench.py backward --dtype bfloat16  every backward rung beside SDPA's backward (GPT-2 shapes, d=128,
                                                non-causal), gradients checked against float64 first
    python3 bench.py train                      GPT-2 small training steps per backward rung beside PyTorch eager
                                                and torch.compile (tokens/s, MFU, peak memory), and a loss curve
    python3 bench.py compare --of b07 --over b06 results/backward-a.json results/backward-b.json
                                                a before/after from result files: per case, every run's ratio and
                                                whether the ratios clear the runs' spread (no GPU)
    python3 bench.py readme                     rewrite README.md's summary and the tables of docs/results.md,
                                                docs/profile.md, docs/levels.md and docs/decode.md from the newest
                                                results/*.json

Where results go: every number it prints is also written to <folder>/<subcommand>-<device>-<UTC time>.json,
with the device, driver, CUDA, CuPy and torch versions, the date and the command. The folder is
results/scratch/ (git-ignored) by default; --save writes into results/, where the files the docs cite live;
--results DIR writes into DIR (--save and --results exclude each other). The code: benchmarks/.

How it measures:

- Time: CUDA events (cupy.cuda.Event) recorded on the stream the work runs on; warm-up first;
  the median of many runs, with the p20-p80 spread and min/max; L2 flushed before every run by
  writing a buffer twice the device's L2 size; compilation happens before any timing.
  torch runs on its current stream, which is CuPy's (the legacy default stream): one clock for all.
- Correct before timed: each rung's output, poisoned with NaN beforehand, is compared with a float64
  reference on the same inputs; its largest error may be at most 8 x that of the plain float32
  implementation (kernels.reference_attention in float32), floored at the dtype's epsilon x max|ref|.
  A rung over that bound is reported wrong, with its error, and not timed.
- FLOPs: causal forward counts 4 * B * NH * T^2 * d / 2 (attention_flops); TFLOP/s are also given as
  a percentage of the ceiling of the precision each row computes at, measured in the same run
  (benchmarks/ceilings.py): fp32 FFMA (cuBLAS SGEMM 8192^3, TF32 off) for float32 rungs without tensor
  cores and float32 peers; TF32 (torch.matmul 8192^3, TF32 allowed) over the TF32 products per product
  (lab.tf32_products: 3xTF32 against a third of it); bf16 and fp16 tensor GEMM for 16-bit inputs. `features`
  counts 4 * d per (query, key) pair the mask lets through (attention_flops_qk): all T_q x T_k without
  the mask, the same T^2 / 2 for causal self-attention, the exact bottom-right count otherwise. `backward`
  counts 2.5 x the forward's FLOPs (five T x T x d products to the forward's two) and holds each gradient
  to 3 x the plain implementation's error in the same dtype (FlashAttention's rule).
- Decode (`features`): kernel time per call from CUPTI's kernel records through torch.profiler, the
  median over calls that rotate through 24 independent caches so that L2 does not hold K and V,
  and the time per call of the same calls replayed as one CUDA graph.
"""

import sys

from benchmarks import cli  # benchmarks/__init__.py sets CUPY_TF32=0 before anything imports CuPy


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
