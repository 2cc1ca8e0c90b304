"""`bench.py train`: GPT-2 small training steps (random weights) with each backward rung, beside a
nanoGPT-style PyTorch GPT-2 (benchmarks/torch_gpt2.py) eager and under torch.compile, in one run.

Per dtype (bfloat16: mixed precision; float32: TF32 off everywhere) and per batch (B = 16 and the largest
power of two up to --max-batch at which a lab step fits, T = 1024): one row per backward rung that takes
the dtype and runs here (the forward rung: train.py's default), the default backward rung again with
train.py --graph's step (GRAPH: the whole step replayed from one CUDA graph, variant_of that rung's row) and
with train.py --per-tensor's AdamW (PER_TENSOR, variant_of it too: the optimizer's share of a step), then
`torch_eager` and `torch_compile`. A step is train.py's: forward and backward (gpt2.backward.loss_and_grads), global-norm
clipping and AdamW on float32 master weights. Each row: the step's median time (CUDA events, warm-up first, no L2 flush: a
step is far larger than L2), tokens/s, MFU against the run's measured GEMM ceiling of the dtype, and
peak memory. Then a short run's losses, lab and torch_eager on the same batches of the lab's own docs,
for the loss-curve plot. --quick: B = 16 alone, fewer steps, no loss curve (bfloat16 unless --dtypes);
its result is marked and never the docs' table (newest_per_dtype).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import kernels
from kernels import backward as backward_ladder
from lm.adamw import AdamW, get_lr
from lm.arrays import held_bytes
from lm.token_data import Batches

from . import ceilings, device, plots, timing
from .device import first_line, progress
from .results import SCHEMA, result_path, write_result, wrote
from .rungs import add_speedups
from .tables import fmt_ms, fmt_x, setup_header, table

PEERS = {"torch_eager": "PyTorch eager", "torch_compile": "torch.compile"}
T = 1024
MEMORY_MEASURE = ("lab: CuPy memory pool high-water mark (total_bytes; the pool emptied before the row), less the "
                  "weights every row copies from (the run's own float32 master weights are counted); torch: "
                  "torch.cuda.max_memory_reserved (its caching allocator's high-water mark, reset before the row)")
PER_TENSOR = "per-tensor AdamW"  # the optimizer of an extra row (lm/adamw.py's multi_tensor=False)
GRAPH = "CUDA graph"  # the step of an extra row: the whole step replayed from its graph (train.py --graph)
CURVE_DOCS = ("README.md", "docs")  # the text of the loss curve: the lab's own Markdown, tokenized


def driver():
    """train.py, imported when a run needs it (it imports gpt2.backward, which needs nothing here to list the
    subcommand)."""
    import train

    return train


def trainer():
    """What train.py steps with, GPT-2's family.backward (gpt2/backward.py: loss_and_grads, Attention),
    imported when a run needs it."""
    from gpt2 import backward

    return backward


def step_flops(config, n_params: int, B: int, T: int) -> float:
    """train.FLOP_CONVENTION for one step of B x T tokens."""
    return (6 * n_params + 6 * config.n_layer * config.n_embd * T) * B * T


def finish_row(r: dict, ceiling_tflops: float | None) -> dict:
    """tokens/s and MFU of a timed row, from its median step time."""
    if r["status"] == "ok":
        seconds = r["timing"]["median_ms"] * 1e-3
        r["tokens_per_s"] = r["B"] * r["T"] / seconds
        r["tflops"] = r["flops"] / seconds / 1e12
        r["mfu"] = r["tflops"] / ceiling_tflops if ceiling_tflops else None
    return r


def rungs_for(dtype: str, arch: str, d_head: int = 64) -> list[str]:
    """Every backward rung that takes the dtype and GPT-2's head size and runs on arch (not one declared
    lab.unverified: not yet run on a GPU)."""
    return [n for n in backward_ladder.default_names()
            if dtype in (r := backward_ladder.load(n)).dtypes and d_head in r.head_sizes() and r.runs_on(arch)]


def batches_for(B: int, seed: int = 0):
    """Random token ids (B, T) and targets on the device; the same for every row of a case."""
    cupy = device.get_cupy()
    ids = np.random.default_rng(seed).integers(0, 50257, (B, T + 1))
    return cupy.asarray(ids[:, :-1].astype(np.int32)), cupy.asarray(ids[:, 1:].astype(np.int32))


def lab_step(params, config, attn, dtype: str, idx, targets, opt, lr: float = 6e-4):
    """One step as train.py takes it; returns the loss."""
    loss, grads = trainer().loss_and_grads(params, config, idx, targets, attn, dtype=dtype)
    opt.step(params, grads, lr, max_norm=1.0)
    return loss


def graph_step(params, config, attn, dtype: str, idx, targets, opt):
    """(the step as a replay of its CUDA graph, the graph): one eager step first (compiling every kernel,
    choosing cuBLAS's heuristics), then the whole step captured (lm/step_graph.TrainingGraph); each replay
    copies the batch in from the host, as train.py --graph does."""
    from lm.step_graph import TrainingGraph

    cupy = device.get_cupy()
    lab_step(params, config, attn, dtype, idx, targets, opt)
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    graph = TrainingGraph(cupy, lambda inputs: trainer().loss_and_grads(params, config, *inputs, attn, dtype=dtype,
                                                                         loss_on_host=False),
                          opt, params, [idx.shape, targets.shape], 1.0)
    host = [idx.get(), targets.get()]
    return (lambda: graph.step(host, 6e-4)), graph


def oom(exc: BaseException) -> bool:
    return "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"


def lab_row(ckpt, dtype: str, forward: str, backward: str, B: int, method, variant: str | None = None) -> dict:
    """A lab row: train.py's eager step, or a variant of it (PER_TENSOR's optimizer, or GRAPH: the whole
    step replayed from its CUDA graph, train.py --graph)."""
    cupy = device.get_cupy()
    r = {"name": backward, "kind": "rung", "label": backward, "forward": forward, "dtype": dtype, "B": B, "T": T,
         "status": None}
    if variant is not None:
        r |= {"name": f"{backward} + {variant}", "label": f"{backward} + {variant}", "variant_of": backward,
              "optimizer" if variant == PER_TENSOR else "step": variant}
    device.release_memory()
    pool = cupy.get_default_memory_pool()
    params = {k: v.copy() for k, v in ckpt.params.items()}
    try:
        attn = trainer().Attention.make(kernel=forward, backward=backward)
        opt = AdamW(params, multi_tensor=variant != PER_TENSOR)
        idx, targets = batches_for(B)
        step, graph = (lambda: lab_step(params, ckpt.config, attn, dtype, idx, targets, opt)), None
        if variant == GRAPH:
            step, graph = graph_step(params, ckpt.config, attn, dtype, idx, targets, opt)
        r["timing"] = timing.time_gpu(step, stream=cupy.cuda.get_current_stream(), flush=timing.no_flush, method=method)
        graph_bytes = graph.total_bytes() if graph is not None else 0
        r["status"], r["peak_bytes"] = "ok", pool.total_bytes() + graph_bytes - held_bytes(ckpt.params.values())
    except Exception as exc:  # a rung that refuses, out of memory
        r["status"], r["reason"] = ("out of memory" if oom(exc) else "error"), first_line(exc)
    return r  # its weights, state and batch are freed with it: the next row starts by releasing them


def torch_row(name: str, ckpt, dtype: str, B: int, method) -> dict:
    cupy, torch = device.get_cupy(), device.get_torch()
    from .torch_gpt2 import TorchGPT2

    r = {"name": name, "kind": "peer", "label": PEERS[name], "dtype": dtype, "B": B, "T": T, "status": None}
    device.release_memory()
    torch.cuda.reset_peak_memory_stats()
    try:
        model = TorchGPT2(ckpt.params, ckpt.config, dtype=dtype, compile=name == "torch_compile")
        idx, targets = (torch.from_dlpack(x).long() for x in batches_for(B))
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        r["timing"] = timing.time_gpu(lambda: model.step(idx, targets, 6e-4), stream=stream, flush=timing.no_flush,
                                      method=method)
        r["status"], r["peak_bytes"] = "ok", torch.cuda.max_memory_reserved()
        r["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    except device.Unavailable as exc:
        r["status"], r["reason"] = "unavailable", str(exc)
    except Exception as exc:
        r["status"], r["reason"] = ("out of memory" if oom(exc) else "unavailable"), first_line(exc)
    return r


def largest_batch(ckpt, dtype: str, forward: str, backward: str, most: int) -> int:
    """The largest power of two from 16 up to `most` at which one lab step runs (16 if none larger does)."""
    attn = trainer().Attention.make(kernel=forward, backward=backward)
    fits, B = 16, 32
    while B <= most:
        params = {k: v.copy() for k, v in ckpt.params.items()}
        try:
            idx, targets = batches_for(B)
            lab_step(params, ckpt.config, attn, dtype, idx, targets, AdamW(params))
            device.get_cupy().cuda.Device().synchronize()
        except Exception as exc:
            if not oom(exc):
                raise
            break
        finally:
            del params
            device.release_memory()
        fits, B = B, 2 * B
    return fits


def curve_tokens(config) -> np.ndarray:
    """The lab's own Markdown (README.md, docs/*.md) tokenized with GPT-2's BPE: the loss curve's text."""
    from gpt2.tokenizer import gpt2_encoding

    root = device.ROOT
    files = [root / CURVE_DOCS[0], *sorted((root / CURVE_DOCS[1]).glob("*.md"))]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    return np.array(gpt2_encoding().encode(text, allowed_special="all"), dtype=np.int64)


def loss_curve(ckpt, dtype: str, forward: str, backward: str, steps: int, B: int) -> dict:
    """Losses of `steps` steps in llm.c's batch order over the docs' tokens: the lab, then torch_eager
    from the same weights on the same batches (cosine schedule from 6e-4, no warmup)."""
    torch = device.get_torch()
    from .torch_gpt2 import TorchGPT2

    batches = Batches(curve_tokens(ckpt.config), B, T, name="the docs")
    lrs = [get_lr(s, lr=6e-4, min_lr=6e-5, warmup=0, steps=steps) for s in range(steps)]
    params = {k: v.copy() for k, v in ckpt.params.items()}
    attn, opt, cupy = trainer().Attention.make(kernel=forward, backward=backward), AdamW(params), device.get_cupy()
    lab = [float(lab_step(params, ckpt.config, attn, dtype, *(cupy.asarray(a) for a in batches[s]), opt, lrs[s]))
           for s in range(steps)]
    del params
    device.release_memory()
    model = TorchGPT2(ckpt.params, ckpt.config, dtype=dtype)
    peer = [float(model.step(*(torch.from_numpy(a.astype(np.int64)).cuda() for a in batches[s]), lrs[s]))
            for s in range(steps)]
    del model
    torch.cuda.empty_cache()
    return {"B": B, "T": T, "steps": steps, "tokens": len(batches.tokens), "text": "README.md and docs/*.md",
            "forward": forward, "backward": backward, "lab": lab, "torch_eager": peer}


def cmd_train(args) -> int:
    device.require_gpu()
    import gpt2

    setup = device.setup_info(args.argv)
    dtypes = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float32"])
    if args.quick:  # B = 16 only (no search for the largest B), fewer steps, no loss curve
        method = timing.Method(budget_ms=min(args.budget_ms, 1000.0), min_runs=5, max_runs=10, warmup=2)
    else:
        method = timing.Method(budget_ms=args.budget_ms, min_runs=5, max_runs=50, warmup=3)
    dev = setup["device"]
    progress(f"{dev['name']} ({dev['arch']}, {dev['sm_count']} SMs), driver {dev['driver']}, CUDA "
             f"{dev['cuda_runtime']}, CuPy {setup['cupy']}, torch {setup['torch']}")
    progress("measuring the ceilings (fp32 SGEMM 8192^3 without TF32; TF32, bf16, fp16 GEMM 8192^3; device copy) ...")
    measured = timing.measure_ceilings(method)
    torch = device.get_torch()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 rows: no TF32
    ckpt = gpt2.random_weights("gpt2", seed=args.seed, xp=device.get_cupy())
    started, compile_before = time.perf_counter(), kernels.runtime.compile_seconds
    rows, curve = [], None
    for dtype in dtypes:
        forward, default_backward = driver().pick_rungs(
            driver().parse_args(["--data", "-", "--dtype", dtype]), ckpt.config, dev["arch"])
        biggest = 16 if args.quick else largest_batch(ckpt, dtype, forward, default_backward, args.max_batch)
        progress(f"{dtype}: forward {forward}; B = 16" + ("" if args.quick else
                 f" and {biggest} (the largest that fits, up to {args.max_batch})"))
        for B in dict.fromkeys((16, biggest)):
            case = [lab_row(ckpt, dtype, forward, name, B, method) for name in rungs_for(dtype, dev["arch"])]
            case += [lab_row(ckpt, dtype, forward, default_backward, B, method, variant) for variant in (GRAPH, PER_TENSOR)]
            case += [torch_row(name, ckpt, dtype, B, method) for name in PEERS]
            for r in case:
                r["flops"] = step_flops(ckpt.config, ckpt.n_params, B, T)
                finish_row(r, ceilings.ceiling(ceilings.DTYPE_MATH[dtype], measured)[0])
                progress(f"  {dtype} B={B:>3} {r['label']:<16} " + (
                    f"{r['timing']['median_ms']:9.1f} ms {r['tokens_per_s']:>10,.0f} tok/s "
                    f"{r['peak_bytes'] / 2**30:6.2f} GiB" if r["status"] == "ok" else f"{r['status']}: {r.get('reason')}"))
            add_speedups(case)
            rows += case
        if dtype == "bfloat16" and args.curve_steps and not args.quick:
            progress(f"loss curve: {args.curve_steps} steps at B=8 over the docs, lab ({default_backward}) and "
                     "torch_eager ...")
            curve = loss_curve(ckpt, dtype, forward, default_backward, args.curve_steps, 8)
    result = {
        "schema": SCHEMA, "kind": "train", "setup": setup, "model": "GPT-2 small (124M), random weights",
        "n_params": ckpt.n_params, "flop_convention": driver().FLOP_CONVENTION, "ceilings": measured,
        "method": method.describe(0) | {"l2_flush": "none: a step is far larger than L2", "timed": (
            "one training step: forward, backward, global-norm clipping (1.0) and AdamW (lr 6e-4, weight decay 0.1); "
            "lab: gpt2.backward.loss_and_grads + lm.adamw on float32 master weights (every tensor in two "
            f"launches; the {PER_TENSOR} row: a launch or two per tensor; the {GRAPH} row: the whole step captured "
            "once and replayed, the batch copied in from the host each step); torch: nanoGPT's step "
            "(benchmarks/torch_gpt2.py: SDPA, bf16 autocast, fused AdamW)"), "memory": MEMORY_MEASURE},
        "dtypes": dtypes, "quick": args.quick, "T": T, "seed": args.seed, "rows": rows, "loss_curve": curve,
        "compile_seconds": kernels.runtime.compile_seconds - compile_before,
        "wall_seconds": time.perf_counter() - started,
    }
    path = result_path("train", setup, args.results)
    image = plots.plot_or_none(plot_loss_curve, result, path.with_suffix(".png")) if curve else None
    result["plot"] = image
    write_result(result, path)
    print("\n" + render_train(result, image))
    progress(wrote(path, image))
    return 0


# ---------------------------------------------------------------------------------------------
# The table and the plot
# ---------------------------------------------------------------------------------------------

def newest_per_dtype(paths: list[Path], load) -> list[tuple[Path, dict]]:
    """The newest full (not --quick) train results covering each dtype (paths newest first), each cut to the
    dtypes no newer result covers: one run per dtype (tools/train_device.sh's) or one run of both; a dtype
    that no full run measured takes its newest quick run (which says so above its table)."""
    chosen, covered = [], set()
    for quick in (False, True):
        for p in paths:
            result = load(p)
            new = [d for d in result["dtypes"] if d not in covered]
            if bool(result.get("quick")) != quick or not new:
                continue
            covered.update(new)
            chosen.append((p, result | {"dtypes": new, "rows": [r for r in result["rows"] if r["dtype"] in new],
                                        "loss_curve": result.get("loss_curve") if "bfloat16" in new else None}))
    return chosen


def ceiling_text(dtype: str, measured: dict) -> str:
    """"bfloat16: bf16 tensor 812.3 TFLOP/s", from the run's ceilings (benchmarks/ceilings.py's names)."""
    value, label = ceilings.ceiling(ceilings.DTYPE_MATH[dtype], measured)
    return f"{dtype}: {label} " + (f"{value:.1f} TFLOP/s" if value else "not measured (MFU left out)")


def render_train(result: dict, image: str | None = None) -> str:
    m = result["method"]
    lines = setup_header(result) + [
        "", f"{result['model']}, T = {result['T']}. {m['timed']}."
            + (" Quick run (`--quick`): B = 16 only, few steps, no loss curve." if result.get("quick") else ""),
        "", f"FLOPs per step: {result['flop_convention']}. MFU against the run's GEMM ceiling of the dtype: "
            + "; ".join(ceiling_text(d, result["ceilings"]) for d in result["dtypes"])
            + f". Peak memory: {m['memory']}.",
        "", f"Times: median of {m['min_runs']}-{m['max_runs']} steps after {m['warmup_runs']} warm-up steps, CUDA "
            "events. Speed-ups are the other's median over this one's (above 1x: this one is faster).",
    ]
    header = ["dtype", "B", "step", "ms", "tokens/s", "MFU", "peak GiB", *[f"vs {label}" for label in PEERS.values()],
              "note"]
    body = []
    for r in result["rows"]:
        name = f"`{r['name']}`" if r["kind"] == "rung" else r["label"]
        if r["status"] == "ok":
            body.append([r["dtype"], r["B"], name, fmt_ms(r["timing"]["median_ms"]), f"{r['tokens_per_s']:,.0f}",
                         f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-", f"{r['peak_bytes'] / 2**30:.2f}",
                         *[fmt_x(r["speedup"].get(p)) for p in PEERS], note(r)])
        else:
            body.append([r["dtype"], r["B"], name, f"**{r['status']}**", "-", "-", "-", *["-" for _ in PEERS],
                         r.get("reason", "")])
    lines += [""] + table(header, body, "lrlrrrr" + "r" * len(PEERS) + "l")
    if result.get("loss_curve"):
        c = result["loss_curve"]
        lines += ["", f"Loss curve: {c['steps']} steps of B x T = {c['B']} x {c['T']} over {c['text']} ({c['tokens']:,} "
                      f"tokens, repeated), lab ({c['backward']}) and PyTorch eager from the same weights on the same "
                      f"batches: final loss {c['lab'][-1]:.3f} and {c['torch_eager'][-1]:.3f}."]
        if image:
            lines += ["", f"![loss curve]({image})"]
    return "\n".join(lines)


def note(r: dict) -> str:
    """A lab row's note: its forward rung, and the optimizer where not the per-tensor default."""
    return ", ".join(x for x in (f"forward {r['forward']}" if r.get("forward") else "", r.get("optimizer", "")) if x)


def plot_loss_curve(plt, result: dict):
    c = result["loss_curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, c["steps"] + 1)
    ax.plot(steps, c["lab"], label=f"lab ({c['forward']} + {c['backward']})")
    ax.plot(steps, c["torch_eager"], label="PyTorch eager", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT-2 small, bfloat16, B x T = {c['B']} x {c['T']}: {plots._device_title(result)}")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig
