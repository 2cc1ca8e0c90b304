#!/usr/bin/env python3
"""Train GPT-2 with the lab's attention rungs: the forward rung --kernel (one that writes the log-sum-exp)
and the backward rung --backward inside every step; NumPy and the reference attention on the CPU.

    python train.py --data input.txt --random-weights --size gpt2 --dtype bfloat16 --steps 100
    python train.py --data tiny.txt --steps 50 --lr 3e-5 --out finetuned     fine-tune GPT-2 small, save it
    python train.py --data train.bin --val-data val.bin --eval-every 25 --json run.json
    python train.py --device cpu --random-weights --size gpt2 --data input.txt --batch 2 --seq 64 --steps 5
    python train.py --data train.bin --random-weights --dtype bfloat16 --batch 16 --graph    one launch a step

Each step takes --accum micro-batches in llm.c's order (lm/token_data.py), averages their gradients,
clips their global norm, and updates float32 master weights with AdamW (lm/adamw.py; PyTorch's formula).
--dtype bfloat16 is mixed precision: the model's products, activations and attention in bfloat16, its
reductions, softmax and loss in float32, the master weights and the optimizer's state float32. The
model's forward and backward: the family's (lm.family.Family.backward, gpt2/backward.py's loss_and_grads;
a family without one is refused). Prints a line per step as llm.c does.
--graph (GPU): the first step runs eagerly (compiling every kernel), the second captures one whole step
(every micro-batch's pass, the accumulation, clipping and AdamW) as a CUDA graph (lm/step_graph.py),
and every step from there replays it with its batch copied into the graph's input buffers and its
learning rate and AdamW's step count into the optimizer's device scalars: the same arithmetic.
MFU: (6 x parameters + 6 x n_layer x n_embd x T) FLOPs per token (llm.c's count, the attention's causal
half) over the step's time, against a GEMM ceiling in the run's dtype measured at start-up (GPU only).
User errors print one line to stderr and exit 2; a loss that is not finite exits 1 at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import gpt2
import kernels
import lab
from kernels import backward as backward_ladder
from lm.adamw import AdamW, get_lr
from lm.arrays import array_module, cast_params
from lm.checkpoint import Checkpoint
from lm.cli import Parser, command
from lm.errors import LabError
from lm.family import Family
from lm.generate import reference_attend
from lm.step_graph import TrainingGraph
from lm.token_data import Batches, read_tokens

FLOP_CONVENTION = ("6 x parameters x tokens (the products, forward and backward; wte counted once) + 6 x n_layer x "
                   "n_embd x T x tokens (attention's two T x T products, the causal half, forward and backward): "
                   "llm.c's count")
PEAK_MEASURE = ("CuPy memory pool high-water mark (total_bytes: the pool never returns a block unasked), from the "
                "weights in place (the load's and the ceiling's transients returned first) to the end of training; "
                "with --graph, the larger of the eager first step's and the default pool's plus the graph's own")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="train.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--data", required=True, help="training tokens: a .txt (GPT-2's BPE), a .npy of ids, or an "
                                                 "llm.c .bin")
    p.add_argument("--val-data", help="validation tokens, in the same formats")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (and after the last "
                                                             "with --val-data; default 0: after the last only)")
    p.add_argument("--val-batches", type=int, default=10, help="batches of --val-data per evaluation (default 10)")
    p.add_argument("--model", help=f"hub id or local folder, either naming scheme (default {gpt2.DEFAULT_MODEL})")
    p.add_argument("--random-weights", action="store_true", help="nanoGPT's initialization from --seed, no download")
    p.add_argument("--size", choices=[size for family in lab.FAMILIES if family.backward is not None
                                      for size in family.sizes], help="size of --random-weights (default gpt2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CuPy and the rungs; cpu: NumPy and the reference attention; auto: gpu if there is one")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32 end to end, or bfloat16 mixed precision (float32 master weights) (default float32)")
    p.add_argument("--kernel", help="forward rung that writes the log-sum-exp (lab.lse); default: the newest that "
                                    "takes the dtype and runs here (float32: without TF32)")
    p.add_argument("--backward", help="backward rung (kernels/backward/); default: the newest that takes the dtype "
                                      "and runs here (float32: without TF32), not one yet to run on a GPU "
                                      "(lab.unverified)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--batch", type=int, default=4, help="B, rows per micro-batch (default 4)")
    p.add_argument("--seq", type=int, default=1024, help="T, tokens per row (default 1024)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step, gradients averaged (default 1)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4; fine-tuning: ~3e-5)")
    p.add_argument("--min-lr", type=float, help="the cosine's floor (default --lr / 10)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warmup (default 0)")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine", help="after warmup (default cosine)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on tensors of 2+ dimensions (default 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping; 0: none (default 1.0)")
    p.add_argument("--per-tensor", action="store_true",
                   help="AdamW and clipping a launch or two per tensor, the reference of the default multi-tensor "
                        "path (every tensor in two launches of kernels/fused/adamw.cu); the CPU's NumPy AdamW is "
                        "per tensor")
    p.add_argument("--deterministic", action="store_true",
                   help="the backward rung's deterministic configuration (dQ summed in a fixed order, "
                        "lab.deterministic): the same losses on every run, at some speed; the CPU's reference "
                        "backward always is")
    p.add_argument("--graph", action="store_true",
                   help="replay each step from the second as one CUDA graph of the whole step (lm/step_graph.py), "
                        "captured after an eager first step; GPU only, with the multi-tensor AdamW")
    p.add_argument("--sample-every", type=int, default=0, help="print a greedy sample every N steps (default 0: never)")
    p.add_argument("--sample-tokens", type=int, default=32, help="tokens of each sample (default 32)")
    p.add_argument("--out", metavar="DIR", help="save model.safetensors and config.json (Hugging Face's layout)")
    p.add_argument("--json", metavar="PATH", help="write losses, per-step lr, gradient norm, ms, tokens/s, MFU, "
                                                  "validation losses and peak GPU memory")
    return p.parse_args(argv)


def check_args(args) -> None:
    for name in ("steps", "batch", "seq", "accum", "val_batches", "sample_tokens"):
        if getattr(args, name) < 1:
            raise LabError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("eval_every", "sample_every", "warmup", "weight_decay", "grad_clip"):
        if getattr(args, name) < 0:
            raise LabError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.graph and args.per_tensor:
        raise LabError("--graph captures the multi-tensor AdamW, which reads each step's scalars from the device; "
                       "--per-tensor passes them by value")
    if args.model is not None and args.random_weights:
        raise LabError("--model and --random-weights exclude each other")
    if args.size is not None and not args.random_weights:
        raise LabError("--size chooses the size of --random-weights; with --model the checkpoint sets it")
    for flag in ("json", "out"):
        path = getattr(args, flag)
        if path and not Path(path).resolve().parent.is_dir():
            raise LabError(f"--{flag} {path}: folder {Path(path).parent} does not exist")


# ---------------------------------------------------------------------------------------------
# The rungs and the weights
# ---------------------------------------------------------------------------------------------

def takes(rung, config, dtype: str, arch: str) -> bool:
    """The rung declares the dtype (lab.dtypes) and the model's head size, and compiles for arch (lab.min_arch)."""
    return dtype in rung.dtypes and config.head_size in rung.head_sizes() and rung.runs_on(arch)


def trains_by_default(rung, config, dtype: str, arch: str) -> bool:
    """takes(), made for whole sequences (not lab.split_kv, not lab.fp8), run on a GPU (not lab.unverified),
    and in float32 exact float32 arithmetic: no configuration multiplies on the TF32 tensor cores
    (lab.tf32_products 0)."""
    return (takes(rung, config, dtype, arch) and not rung.split_kv and not rung.fp8
            and rung.unverified is None
            and (dtype != "float32" or all(rung.tf32_products_of(c) == 0 for c in rung.configs)))


def pick_rungs(args, config, arch: str) -> tuple[str, str]:
    """The forward rung (it must write the log-sum-exp) and the backward rung: those asked for, checked, or
    by default the newest whose declarations train here (lab.lse, trains_by_default), never a fixed list."""
    writers = [n for n in kernels.names() if kernels.load(n).lse]
    forward_rung = pick(kernels, writers, args.kernel, "kernel", config, args.dtype, arch)
    if not kernels.load(forward_rung).lse:
        raise LabError(f"kernel {forward_rung} does not write the log-sum-exp the backward needs (lab.lse); "
                       f"{', '.join(writers)} do")
    return forward_rung, pick(backward_ladder, backward_ladder.default_names(), args.backward, "backward", config,
                              args.dtype, arch)


def pick(ladder, names: list[str], asked: str | None, flag: str, config, dtype: str, arch: str) -> str:
    """The rung of `ladder` (kernels or kernels.backward) named by --flag, checked to take this model, or
    by default the newest of `names` that trains_by_default."""
    if asked is None:
        able = [n for n in names if trains_by_default(ladder.load(n), config, dtype, arch)]
        if not able:
            raise LabError(f"no {flag} rung takes {dtype}, head size {config.head_size} on {arch}"
                           + (" and writes the log-sum-exp" if ladder is kernels else ""))
        return able[-1]
    try:
        rung = ladder.resolve(asked).stem
    except ValueError as exc:
        raise LabError(str(exc)) from None
    if not takes(ladder.load(rung), config, dtype, arch):
        raise LabError(f"{flag} {rung} does not take {dtype} at head size {config.head_size} on {arch}")
    return rung


# ---------------------------------------------------------------------------------------------
# Evaluation, samples, the ceiling
# ---------------------------------------------------------------------------------------------

def cross_entropy(logits, targets) -> float:
    """Mean cross-entropy of float32 logits (B, T, V) against targets (B, T)."""
    xp = array_module(logits)
    top = logits.max(axis=-1, keepdims=True)  # (B, T, 1)
    lse = xp.log(xp.exp(logits - top).sum(axis=-1, keepdims=True)) + top  # (B, T, 1)
    picked = xp.take_along_axis(logits, xp.asarray(targets)[..., None], axis=-1)  # (B, T, 1)
    return float((lse - picked).mean())


def evaluate(forward, weights: dict, config, batches: Batches, n: int, attend) -> float:
    """The mean loss of the first n batches (llm.c's val loader restarts at 0), the family's forward only."""
    return sum(cross_entropy(forward(weights, config, x, attend), y) for x, y in (batches[i] for i in range(n))) / n


def sample(family: Family, weights: dict, config, encoding, n_new: int, attend) -> str:
    """Greedy tokens after <|endoftext|>, as llm.c samples, through the family's eager generation path."""
    result = family.generate(weights, config, [config.eos_token_id], n_new, attend=attend, kv_cache=False,
                             sampler=None, fast=False)
    return encoding.decode(result.tokens)


def gemm_ceiling(xp, dtype: str, n: int = 8192) -> tuple[float, str]:
    """TFLOP/s of an n^3 product in dtype through lm.products.matmul (cuBLAS: SGEMM without TF32, or
    gemmEx with float32 accumulation), the median of 10 after 3 warm-ups, CUDA events."""
    from lm.products import matmul

    rng = xp.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32).astype(dtype) for _ in range(2))
    for _ in range(3):
        matmul(a, b)
    times = []
    for _ in range(10):
        start, end = xp.cuda.Event(), xp.cuda.Event()
        start.record()
        matmul(a, b)
        end.record()
        end.synchronize()
        times.append(xp.cuda.get_elapsed_time(start, end))
    del a, b
    what = f"lm.products.matmul {dtype} {n}^3 (cuBLAS, float32 accumulate, no TF32), median of 10, at start-up"
    return 2 * n**3 / (float(np.median(times)) * 1e-3) / 1e12, what


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """What every step runs on, made once before the first."""

    args: argparse.Namespace
    family: Family
    device: str
    xp: object  # NumPy or CuPy
    ckpt: Checkpoint  # float32 master weights
    train_batches: Batches
    val_batches: Batches | None
    kernel: str  # the forward rung (lab.REFERENCE on the CPU)
    backward: str  # the backward rung
    attn: object  # the family's Attention: both rungs, inside every step
    attend: object  # the forward rung alone: evaluation and samples
    ceiling: float | None  # TFLOP/s of the GEMM ceiling (GPU), what MFU divides by
    ceiling_what: str
    pool: object  # CuPy's memory pool (GPU), whose high-water mark is the run's peak
    encoding: object  # the tokenizer for samples, None without --sample-every
    opt: AdamW
    min_lr: float
    tokens_per_step: int
    flops_per_step: int
    graph: TrainingGraph | None = None  # --graph's, captured at the second step
    eager_peak: int = 0  # the pool's high-water mark before --graph's capture (the eager step's)

    @property
    def config(self):
        return self.ckpt.config

    def sync(self) -> None:
        if self.device == "gpu":
            self.xp.cuda.Device().synchronize()

    def eval_weights(self) -> dict:
        """The master weights in --dtype, as the forward of evaluation and samples reads them."""
        params = self.ckpt.params
        return params if self.args.dtype == "float32" else cast_params(params, self.args.dtype)


def pick_xp(args) -> tuple[str, object]:
    """The device and its array module; the flags that only the GPU takes refused on the CPU."""
    device = lab.pick_device(args.device)
    if device == "gpu":
        import cupy

        return device, cupy
    if args.kernel or args.backward:
        raise LabError("--kernel and --backward run on the GPU; the CPU runs the reference attention and its backward")
    if args.graph:
        raise LabError("--graph captures a CUDA graph; on the CPU the steps run eagerly in NumPy")
    return device, np


def load_weights(args, xp) -> tuple[Family, Checkpoint]:
    """float32 master weights, of a family with a backward pass: the family's initialization from a seed
    (--random-weights), or a checkpoint (config.json's model_type chooses the family, as in lab.py)."""
    family, folder, file = lab.locate_model(args)
    if family.backward is None:
        trains = ", ".join(f.name for f in lab.FAMILIES if f.backward is not None)
        where = f"{folder / 'config.json'}: model_type" if folder is not None else "--size's family"
        raise LabError(f"{where} {family.name!r} has no backward pass; train.py trains {trains}")
    float32 = argparse.Namespace(**vars(args) | {"dtype": "float32"})  # master weights, whatever --dtype
    return family, lab.load_checkpoint(float32, family, folder, file, xp)


def rungs(args, family: Family, device: str, config) -> tuple[str, str, object, object]:
    """The forward rung, the backward rung, the family's Attention of both (every step) and the forward
    rung alone as an attend (evaluation and samples): on the CPU, the reference attention."""
    if device == "cpu":
        return lab.REFERENCE, lab.REFERENCE, family.backward.Attention.reference(), reference_attend
    kernel, backward = pick_rungs(args, config, kernels.device_limits().arch)
    # LabError where the pair cannot train (or, with --deterministic, the backward rung has no such configuration)
    attn = family.backward.Attention.make(kernel=kernel, backward=backward, deterministic=args.deterministic)
    return kernel, backward, attn, lab.make_attend(kernel, args.dtype)


def ceiling_and_pool(args, xp, device: str) -> tuple[float | None, str, object]:
    """The GEMM ceiling's TFLOP/s and how it was measured, and the memory pool emptied of the load's
    and the ceiling's transients (from here it only grows); none of them on the CPU."""
    if device == "cpu":
        return None, "none on the CPU: MFU not computed", None
    ceiling, ceiling_what = gemm_ceiling(xp, args.dtype)
    pool = xp.get_default_memory_pool()
    pool.free_all_blocks()
    return ceiling, ceiling_what, pool


def set_up(args) -> Setup:
    """Everything the steps need, each user error found before the first step."""
    check_args(args)
    device, xp = pick_xp(args)
    family, ckpt = load_weights(args, xp)
    config = ckpt.config
    if args.seq > config.n_positions:
        raise LabError(f"--seq {args.seq} is longer than the model's {config.n_positions} positions")
    train_batches = Batches(read_tokens(args.data, vocab_size=config.vocab_size), args.batch, args.seq,
                            name=args.data)
    val_batches = (Batches(read_tokens(args.val_data, vocab_size=config.vocab_size), args.batch, args.seq,
                           name=args.val_data) if args.val_data else None)
    kernel, backward, attn, attend = rungs(args, family, device, config)
    ceiling, ceiling_what, pool = ceiling_and_pool(args, xp, device)
    if args.sample_every and config.eos_token_id >= config.vocab_size:  # found now, not after training
        raise LabError(f"--sample-every: samples start at <|endoftext|> (id {config.eos_token_id}), outside the "
                       f"model's vocabulary of {config.vocab_size}")
    encoding = family.load_tokenizer(ckpt.folder) if args.sample_every else None
    opt = AdamW(ckpt.params, weight_decay=args.weight_decay, multi_tensor=False if args.per_tensor else None)
    tokens_per_step = args.batch * args.seq * args.accum
    flops_per_step = (6 * ckpt.n_params + 6 * config.n_layer * config.n_embd * args.seq) * tokens_per_step
    return Setup(args=args, family=family, device=device, xp=xp, ckpt=ckpt, train_batches=train_batches,
                 val_batches=val_batches, kernel=kernel, backward=backward, attn=attn, attend=attend, ceiling=ceiling,
                 ceiling_what=ceiling_what, pool=pool, encoding=encoding, opt=opt,
                 min_lr=args.lr / 10 if args.min_lr is None else args.min_lr, tokens_per_step=tokens_per_step,
                 flops_per_step=flops_per_step)


def micro_batches(s: Setup, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Step i's --accum micro-batches, host arrays: micro-batch j is batch i x accum + j."""
    return [s.train_batches[step * s.args.accum + micro] for micro in range(s.args.accum)]


def passes(s: Setup, inputs, **kwargs) -> tuple[list, dict]:
    """Each micro-batch's loss (loss_and_grads's; kwargs passed on) over `inputs` ((idx, targets) device
    arrays), and their gradients averaged."""
    args, params = s.args, s.ckpt.params
    losses, grads = [], None
    for x, y in inputs:
        micro_loss, micro_grads = s.family.backward.loss_and_grads(params, s.config, x, y, s.attn, dtype=args.dtype,
                                                                   **kwargs)
        losses.append(micro_loss)
        if grads is None:  # a copy where more micro-batches add to it: the backward may reuse its arrays
            grads = micro_grads if args.accum == 1 else {k: g.copy() for k, g in micro_grads.items()}
        else:
            for k, g in micro_grads.items():
                grads[k] += g
    if args.accum > 1:
        for g in grads.values():
            g *= np.float32(1 / args.accum)
    return losses, grads


def mean_loss(losses: list) -> float:
    """The micro-batches' mean loss, read on the host (float() of a device array waits for it)."""
    loss = 0.0
    for micro_loss in losses:
        loss += float(micro_loss) / len(losses)
    return loss


def train_step(s: Setup, step: int, lr: float) -> tuple[float, float, float]:
    """One optimizer step over --accum micro-batches, their gradients averaged, clipped and applied: (the
    mean loss, the gradient norm before clipping, seconds). With --graph, from the second step on, a
    replay of the captured step (the second captures it first)."""
    args, xp = s.args, s.xp
    s.sync()
    start = time.perf_counter()
    if args.graph and step > 0:
        loss, norm = graph_step(s, step, lr)
    else:
        losses, grads = passes(s, ((xp.asarray(x), xp.asarray(y)) for x, y in micro_batches(s, step)))
        norm = s.opt.step(s.ckpt.params, grads, lr, max_norm=args.grad_clip)  # clipped first
        loss = mean_loss(losses)
    s.sync()
    return loss, norm, time.perf_counter() - start


def graph_step(s: Setup, step: int, lr: float) -> tuple[float, float]:
    """Step `step` as a replay of the whole step captured (at the first call) into s.graph
    (lm/step_graph.TrainingGraph: every micro-batch's pass on its input buffers, the accumulation, the
    multi-tensor AdamW's clipping and update); (the mean loss, the norm), read back once it is done."""
    batches = [a for pair in micro_batches(s, step) for a in pair]  # idx, targets of each micro-batch
    if s.graph is None:
        s.sync()
        s.eager_peak = s.pool.total_bytes()
        s.pool.free_all_blocks()  # the eager step's cached blocks, before the graph's pool takes its own
        s.graph = TrainingGraph(s.xp, lambda inputs: passes(s, zip(inputs[0::2], inputs[1::2]), loss_on_host=False),
                                s.opt, s.ckpt.params, [a.shape for a in batches], s.args.grad_clip)
    s.graph.step(batches, lr)
    s.sync()
    return mean_loss(s.graph.losses), float(s.opt.multi.norm[0])


def peak_bytes(s: Setup) -> int | None:
    """The run's peak GPU memory (PEAK_MEASURE): with --graph, the eager step's high-water mark or the
    default pool's and the graph's together, whichever is higher."""
    if s.pool is None:
        return None
    return max(s.eager_peak, s.pool.total_bytes() + (s.graph.total_bytes() if s.graph is not None else 0))


def train(s: Setup) -> dict:
    """Every step with its progress line (llm.c's), then the validation loss and a sample where they are
    due: the log of every step's figures."""
    args = s.args
    log = {"losses": [], "lr": [], "grad_norm": [], "ms": [], "tokens_per_s": [], "mfu": [], "val_losses": []}
    for step in range(args.steps):
        lr = get_lr(step, lr=args.lr, min_lr=s.min_lr, warmup=args.warmup, steps=args.steps, schedule=args.lr_schedule)
        loss, norm, seconds = train_step(s, step, lr)
        mfu = s.flops_per_step / seconds / (s.ceiling * 1e12) if s.ceiling else None
        for key, value in (("losses", loss), ("lr", lr), ("grad_norm", norm), ("ms", 1e3 * seconds),
                           ("tokens_per_s", s.tokens_per_step / seconds), ("mfu", mfu)):
            log[key].append(value)
        print(f"step {step + 1:>{len(str(args.steps))}}/{args.steps} | loss {loss:.6f} | lr {lr:.2e} | norm {norm:.4f} "
              f"| {1e3 * seconds:.1f} ms | {s.tokens_per_step / seconds:,.0f} tok/s"
              + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""), flush=True)
        evaluate_and_sample(s, step + 1, log)
    return log


def evaluate_and_sample(s: Setup, done: int, log: dict) -> None:
    """After `done` steps: the validation loss every --eval-every steps and after the last (into log), a
    greedy sample every --sample-every steps and after the last."""
    args, last = s.args, done == s.args.steps
    if s.val_batches is not None and (last or (args.eval_every and done % args.eval_every == 0)):
        n = min(args.val_batches, len(s.val_batches))
        val = evaluate(s.family.forward, s.eval_weights(), s.config, s.val_batches, n, s.attend)
        log["val_losses"].append({"step": done, "loss": val})
        print(f"val loss {val:.6f} ({n} batches of {args.val_data})", flush=True)
    if args.sample_every and (done % args.sample_every == 0 or last):
        print(f"sample: {sample(s.family, s.eval_weights(), s.config, s.encoding, args.sample_tokens, s.attend)!r}",
              flush=True)


def finish(s: Setup, log: dict) -> int:
    """The mean step after the first (which compiles the rungs), --out's checkpoint and --json's summary;
    exit status 1 where a loss was not finite."""
    args, peak = s.args, peak_bytes(s)
    later = log["ms"][1:] or log["ms"]
    print(f"mean of step{f's 2-{args.steps}' if args.steps > 1 else ' 1'}: {np.mean(later):.1f} ms, "
          f"{s.tokens_per_step / np.mean(later) * 1e3:,.0f} tok/s"
          + (f", peak GPU memory {peak / 2**30:.2f} GiB" if peak is not None else ""))
    if args.out:
        s.family.save(s.ckpt, args.out)
        print(f"saved {args.out} (model.safetensors, config.json)")
    if args.json:
        summary = {"model": s.ckpt.name, "n_params": s.ckpt.n_params, "model_config": asdict(s.config),
                   "config": vars(args) | {"min_lr": s.min_lr}, "device": s.device,
                   "device_name": lab.device_name(s.device), "kernel": s.kernel, "backward": s.backward,
                   "dtype": args.dtype, "tokens_per_step": s.tokens_per_step, "flop_convention": FLOP_CONVENTION,
                   "flops_per_step": s.flops_per_step, "ceiling_tflops": s.ceiling, "ceiling_measure": s.ceiling_what,
                   "timing": "host clock around each step, the device synchronized before and after; step 1 includes "
                             "the rungs' compilation" + (", step 2 the graph's capture" if args.graph else ""),
                   **log, "peak_gpu_memory_bytes": peak, "peak_gpu_memory_measure": PEAK_MEASURE if peak is not None else None}
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(math.isfinite(v) for v in log["losses"]) else 1


def run(args) -> int:
    s = set_up(args)
    fixed = " (deterministic)" if args.deterministic else ""
    print(f"{s.ckpt.name}: {s.ckpt.n_params:,} parameters, {args.dtype}, {s.device} ({lab.device_name(s.device)}), "
          f"attention {s.kernel} / {s.backward}{fixed}, B x T = {args.batch} x {args.seq} x {args.accum} micro-batches, "
          f"{len(s.train_batches)} batches per pass over {args.data}")
    return finish(s, train(s))


def main(argv=None) -> int:
    return command("train.py", run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
