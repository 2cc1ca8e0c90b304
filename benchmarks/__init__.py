"""Benchmarks of the attention ladder, beside its peers, and of GPT-2 generation; the README's tables.
bench.py is the command line; this package is what it runs.

    device.py     what ran where (device, driver, versions); CuPy and torch, imported lazily; GPU memory
    results.py    result files: results/<subcommand>-<device>-<UTC time>.json, where they go, which is newest
    timing.py     CUDA-event timing, L2 flush, CUPTI kernel time, CUDA graphs; the FFMA and copy ceilings
    cases.py      shapes, FLOP conventions, random inputs, the correctness gate against float64
    peers.py      the CuPy reference, torch SDPA backends, plain PyTorch (eager, torch.compile) on the rungs' inputs
    rungs.py      `kernels`: every rung x shapes, checked then timed beside the peers (also sweep's, features')
    sweep.py      `sweep`: TFLOP/s against sequence length, with a plot
    features.py   `features`: decode, long-context decode, non-causal, cross lengths, GQA, head sizes
    frontier.py   `frontier`: bfloat16 at the frontier's shapes beside SDPA flash and cuDNN, against the targets
    fp8.py        `fp8`: the FP8 rung beside the best bfloat16 rungs and SDPA, and its RMSE on outliers
    levels.py     `levels`: seed 004's four levels (PyTorch, torch.compile, Triton, CUDA) beside SDPA, lines of code
    backward.py   `backward`: every backward rung beside SDPA's backward, gradients checked against float64; its table
    torch_attention.py  the plain PyTorch attention: the eager and torch.compile peers' function
    train.py      `train`: GPT-2 small training steps per backward rung beside PyTorch (torch_gpt2.py: nanoGPT's
                  step, eager and torch.compile), tokens/s, MFU, peak memory; the loss curve
    e2e.py        `e2e`: a model's generation (GPT-2 or a Llama size) per rung, without and with a KV cache,
                  beside HF transformers (scale.py: `e2e --sizes`, decode at scale, every model size)
    resources.py  `resources`: registers, shared memory, spills per rung and config (NVRTC, no GPU needed)
    profile.py    `profile`: Nsight Compute's counters per rung, one launch each (profile_target.py is what
                  ncu runs; profile_render.py the table, the roofline plot and docs/profile.md's section)
    tables.py     the Markdown tables (terminal and docs alike); plots.py: the PNG plots
    summary.py    the README's short tables: the best rung per precision, the end-to-end summary
    readme.py     `readme`: rewrite what lies between the bench markers of README.md and docs/*.md
    watch.py      `lab.py watch`: a rung compiled, checked and timed on every save (watch_worker.py: the warm
                  GPU process; watch_report.py: what a save's report says, and what changed since the last)
    options.py    flags several subcommands share: a shape, a list of rungs, --save / --results
    cli.py        the argument parser and main()

Modules reach device, timing and plots through the module (device.get_cupy(), timing.time_gpu), so a
test stands in for the GPU, the clock or matplotlib in one place.

How it measures: bench.py's docstring (python3 bench.py --help).
"""

import os

CUPY_TF32_GIVEN = os.environ.get("CUPY_TF32")
os.environ["CUPY_TF32"] = "0"  # CuPy reads this at its first float32 matmul: plain fp32 FFMA, no TF32
