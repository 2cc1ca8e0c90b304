"""One training pass of GPT-2 (gpt2/backward.py's loss_and_grads, no optimizer) timed with CUDA events,
the fused kernels (gpt2/train_kernels.py) against the array code, with a breakdown by phase.

    python3 tools/train_step_profile.py                       GPT-2 small, bfloat16, B x T = 16 x 1024
    python3 tools/train_step_profile.py --dtype float32 --batch 8 --kernel v13 --backward b02
    python3 tools/train_step_profile.py --classifier-mib 512 2048 4096   the classifier's chunk, swept
    python3 tools/train_step_profile.py --graph --kernels              the whole step eager against a CUDA graph

Random weights (nanoGPT's init), random tokens. Each mode: one warm-up call (compilation, cuBLAS's
heuristics, the memory pool), then --repeats timed calls; the median is reported. Phases, from events
recorded around the calls that make them (so each includes any gap in which the GPU waited for Python):
forward (embedding to ln_f), classifier (logits, softmax and loss, its two backward products), backward
(ln_f's backward to the embeddings'); and across the pass: attention (the forward and backward rungs),
products (every cuBLAS product outside the classifier), the rest (everything else: the non-GEMM work
the fused kernels take, and Python); pool_gib, the CuPy memory pool's high-water mark (emptied before each
mode; the weights included). Then the optimizer apart: clipping at 1.0 and AdamW on one pass's gradients
(a fresh copy each call, so that every call clips), lm/adamw.py per tensor and multi-tensor, events
around the call (which ends by reading the norm back) and the host's clock. --graph: the whole step
(the fused pass, clipping at 1.0 and the multi-tensor AdamW) eagerly and as a replay of its CUDA graph
(lm/step_graph.py, train.py --graph), events and the host's clock around each, the losses read back;
with --kernels, the replay's kernel table too. Writes train_step_profile.json to $OUT (or --out) when given;
committed as results/train_step_profile-DEVICE-STAMP.json (underscores: not a `bench.py train` result, which
bench.py readme finds by the name train-DEVICE-STAMP.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Phases:
    """Events around the calls of gpt2.backward's classifier, attention and products, by phase."""

    def __init__(self, cp, backward, attn):
        """Wraps backward's matmul and classifier_forward_backward (module attributes) and attn's two
        passes: self.attn is the attention to train with."""
        self.cp, self.marks = cp, []
        self.inside_classifier = False

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                if name == "products" and self.inside_classifier:
                    return fn(*args, **kwargs)
                start = cp.cuda.Event()
                start.record()
                self.inside_classifier |= name == "classifier"
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.inside_classifier &= name != "classifier"
                    end = cp.cuda.Event()
                    end.record()
                    self.marks.append((name, start, end))
            return wrapper

        backward.matmul = timed("products", backward.matmul)
        backward.classifier_forward_backward = timed("classifier", backward.classifier_forward_backward)
        self.attn = replace(attn, forward=timed("attention", attn.forward), backward=timed("attention", attn.backward))

    def call(self, fn):
        """Run fn() between two events; (total ms, {phase: ms})."""
        cp = self.cp
        self.marks = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = {"total": cp.cuda.get_elapsed_time(start, end)}
        for name, a, b in self.marks:
            ms[name] = ms.get(name, 0.0) + cp.cuda.get_elapsed_time(a, b)
        (_, c0, c1), = [m for m in self.marks if m[0] == "classifier"]
        ms["forward"] = cp.cuda.get_elapsed_time(start, c0)
        ms["backward"] = cp.cuda.get_elapsed_time(c1, end)
        ms["rest"] = ms["total"] - ms["classifier"] - ms.get("attention", 0.0) - ms.get("products", 0.0)
        return ms


def time_optimizer(cp, params, grads, repeats: int) -> dict:
    """{mode: {events_ms, host_ms}}: the median of `repeats` calls of AdamW.step(..., max_norm=1.0), per
    tensor and multi-tensor, each on a fresh copy of the weights (its own state) after one warm-up call."""
    from lm.adamw import AdamW

    times = {}
    for mode, multi_tensor in (("per-tensor", False), ("multi-tensor", True)):
        weights = {k: p.copy() for k, p in params.items()}
        opt, events, host = AdamW(weights, multi_tensor=multi_tensor), [], []
        for i in range(repeats + 1):
            fresh = {k: g.copy() for k, g in grads.items()}
            start, end = cp.cuda.Event(), cp.cuda.Event()
            cp.cuda.Device().synchronize()
            began = time.perf_counter()
            start.record()
            opt.step(weights, fresh, 6e-4, max_norm=1.0)
            end.record()
            end.synchronize()
            if i:  # the first call compiles
                host.append(1e3 * (time.perf_counter() - began))
                events.append(cp.cuda.get_elapsed_time(start, end))
        times[mode] = {"events_ms": statistics.median(events), "host_ms": statistics.median(host)}
        del weights, opt
        cp.get_default_memory_pool().free_all_blocks()
    return times


def time_graph(cp, backward, params, config, idx, targets, attn, dtype: str, repeats: int) -> tuple[dict, object]:
    """({mode: {events_ms, host_ms, losses}}, the replay as a function): the whole step on a copy of the
    weights, eagerly (after one warm-up step) and then replayed from its CUDA graph, the median of
    `repeats` steps each; the same batch every step (its copy into the graph's buffers included)."""
    from lm.adamw import AdamW
    from lm.step_graph import TrainingGraph

    weights = {k: p.copy() for k, p in params.items()}
    opt, host_batch = AdamW(weights), [idx.get(), targets.get()]

    def eager():
        loss, grads = backward.loss_and_grads(weights, config, idx, targets, attn, dtype)
        opt.step(weights, grads, 6e-4, max_norm=1.0)
        return loss

    def passes(inputs):
        return backward.loss_and_grads(weights, config, *inputs, attn, dtype, loss_on_host=False)

    def timed(run) -> tuple[float, float, float]:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        cp.cuda.Device().synchronize()
        began = time.perf_counter()
        start.record()
        loss = run()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end), 1e3 * (time.perf_counter() - began), float(loss)

    eager()  # compiles, chooses cuBLAS's heuristics
    results = {"eager": [timed(eager) for _ in range(repeats)]}
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    graph = TrainingGraph(cp, passes, opt, weights, [idx.shape, targets.shape], 1.0, idx.dtype)

    def replay():
        graph.step(host_batch, 6e-4)
        return graph.losses

    results["graph"] = [timed(replay) for _ in range(repeats)]
    times = {mode: {"events_ms": statistics.median(r[0] for r in runs), "host_ms": statistics.median(r[1] for r in runs),
                    "losses": [r[2] for r in runs]} for mode, runs in results.items()}
    times["graph"]["graph_pool_gib"] = graph.total_bytes() / 2**30
    return times, replay


def kernel_times(cp, run) -> dict:
    """One call of run() (after a warm-up) under torch.profiler, which traces every kernel of the process
    through CUPTI, CuPy's and cuBLAS's too: {wall_ms, busy_ms (the union of the kernels' intervals),
    kernels: [(name, calls, total ms)], most time first}; names lose their template arguments."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        run()
        cp.cuda.Device().synchronize()
        wall_ms = 1e3 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    spans, by_name = [], {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        name = e.name.split("<")[0].split("(")[0]
        spans.append((e.time_range.start, e.time_range.end))
        calls, us = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, us + e.time_range.elapsed_us())
    busy, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            busy, reach = busy + (end - start), end
        elif end > reach:
            busy, reach = busy + (end - reach), end
    table = sorted(((n, c, us / 1e3) for n, (c, us) in by_name.items()), key=lambda r: -r[2])
    return {"wall_ms": wall_ms, "busy_ms": busy / 1e3, "launches": len(spans), "kernels": table}


def print_kernel_table(t: dict, rows: int = 40) -> None:
    print(f"fused pass under the profiler: wall {t['wall_ms']:.1f} ms, GPU busy {t['busy_ms']:.1f} ms, "
          f"{t['launches']} kernels")
    print(f"{'kernel':60s} {'calls':>6s} {'ms':>8s} {'us/call':>8s}")
    for name, calls, ms in t["kernels"][:rows]:
        print(f"{name[:60]:60s} {calls:6d} {ms:8.2f} {1e3 * ms / calls:8.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="gpt2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--kernel", default=None, help="forward rung (default v15 for bfloat16, v13 for float32)")
    parser.add_argument("--backward", default=None, help="backward rung (default b04 for bfloat16, b02 for float32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--classifier-mib", type=int, nargs="*", default=[],
                        help="also time the fused pass with these chunk sizes of the classifier's logits (MiB)")
    parser.add_argument("--kernels", action="store_true",
                        help="also list the fused pass's GPU kernels by time (torch.profiler's CUPTI trace), and "
                             "how much of the pass the GPU spent in any kernel")
    parser.add_argument("--graph", action="store_true",
                        help="also time the whole step (pass, clipping, AdamW) eagerly against its CUDA graph's replay "
                             "(train.py --graph); with --kernels the replay's kernel table")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for train_step_profile.json")
    args = parser.parse_args(argv)

    import cupy as cp

    import gpt2
    from gpt2 import backward
    from gpt2.backward import Attention

    bf16 = args.dtype == "bfloat16"
    attn = Attention.make(args.kernel or ("v15" if bf16 else "v13"), args.backward or ("b04" if bf16 else "b02"))
    config = gpt2.SIZES[args.size]
    params = gpt2.random_weights(config, seed=0, xp=cp).params
    rng = cp.random.default_rng(0)
    idx, targets = (rng.integers(0, config.vocab_size, (args.batch, args.seq)) for _ in range(2))
    phases = Phases(cp, backward, attn)
    attn = phases.attn
    tokens = args.batch * args.seq
    results = {}
    default_bytes = backward.CLASSIFIER_BYTES
    modes = [("array", False, default_bytes), ("fused", True, default_bytes)]
    modes += [(f"fused {mib} MiB", True, mib * 2**20) for mib in args.classifier_mib]
    for mode, fused, chunk_bytes in modes:
        def run(fused=fused):
            backward.loss_and_grads(params, config, idx, targets, attn, args.dtype, fused=fused)

        backward.CLASSIFIER_BYTES = chunk_bytes
        phases.call(run)  # warm-up
        runs = [phases.call(run) for _ in range(args.repeats)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        median["tokens_per_s"] = tokens / (median["total"] / 1e3)
        median["pool_gib"] = cp.get_default_memory_pool().total_bytes() / 2**30  # its high-water mark, weights too
        results[mode] = median
        cp.get_default_memory_pool().free_all_blocks()
    backward.CLASSIFIER_BYTES = default_bytes
    kernel_table = kernel_times(cp, lambda: backward.loss_and_grads(params, config, idx, targets, attn, args.dtype)) \
        if args.kernels else None
    optimizer = time_optimizer(cp, params, backward.loss_and_grads(params, config, idx, targets, attn, args.dtype)[1],
                               args.repeats)
    graph_times = graph_table = None
    if args.graph:
        graph_times, replay = time_graph(cp, backward, params, config, idx, targets, attn, args.dtype, args.repeats)
        graph_table = kernel_times(cp, replay) if args.kernels else None
        del replay
        cp.get_default_memory_pool().free_all_blocks()
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"].decode()
    print(f"{device}, {args.size} {args.dtype}, B x T = {args.batch} x {args.seq}, attention {attn.name}, "
          f"median of {args.repeats} (ms)")
    keys = ["total", "forward", "classifier", "backward", "attention", "products", "rest", "tokens_per_s", "pool_gib"]
    print(f"{'':16s}" + "".join(f"{k:>14s}" for k in keys))
    for mode, ms in results.items():
        print(f"{mode:16s}" + "".join(f"{ms.get(k, 0.0):14.1f}" for k in keys))
    print("optimizer (clipping + AdamW), median ms: " + ", ".join(
        f"{mode} {t['events_ms']:.2f} (host {t['host_ms']:.2f})" for mode, t in optimizer.items()))
    if kernel_table is not None:
        print_kernel_table(kernel_table)
    if graph_times is not None:
        print("whole step (pass, clipping, AdamW), median ms: " + ", ".join(
            f"{mode} {t['events_ms']:.2f} (host {t['host_ms']:.2f})" for mode, t in graph_times.items())
              + f"; graph pool {graph_times['graph']['graph_pool_gib']:.2f} GiB")
    if graph_table is not None:
        print("the step's CUDA graph, replayed:")
        print_kernel_table(graph_table)
    if args.out:
        path = Path(args.out) / "train_step_profile.json"
        path.write_text(json.dumps({"device": device, "size": args.size, "dtype": args.dtype, "batch": args.batch,
                                    "seq": args.seq, "attention": attn.name, "repeats": args.repeats,
                                    "ms": results, "optimizer_ms": optimizer,
                                    "kernels": kernel_table,
                                    "step_ms": graph_times, "kernels_graph": graph_table}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
