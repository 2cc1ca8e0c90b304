"""GPT-2's persistent decode step (kernels/fused/decode_step.cu): every block of one cooperative launch
runs n decode steps, handing its results to the blocks that need them through flagged words in global
memory (gpt2/fast's docstring). PersistentStep sets it up where the device runs it, launches it, and
profiles its stages."""

from __future__ import annotations

import math

import numpy as np

from kernels import driver, fused
from lm.arena import Arena, Buffer
from lm.errors import LabError
from lm.switch import ON, Switch

from .plan import (
    FOLDS,
    LAYER_POINTERS,
    NULL,
    STEP_BLOCK,
    STEP_STAGES,
    STEP_THREADS,
    kernel_expressions,
    step_options,
    step_plan,
    step_reduce_heads,
)
from .weights import layernorm_fold


class PersistentStep:
    """The persistent step of one engine: its plan (step_plan), the layer table of pointers it reads,
    the folds and copies it reads beside the engine's weights, and its handoff buffers and scratch (one
    arena, `buffers`)."""

    def __init__(self, engine, ring: int | None = None, reduce_heads: bool | None = None, splits: int | None = None):
        self.engine = engine
        self.ring = ring  # the step's slots, where given (step_plan's ring: for measuring)
        self.splits = splits  # the key splits a head it starts from, where given (step_plan's splits: the same)
        # decode_step.cu's REDUCE_HEADS, where given (for measuring), else step_reduce_heads's choice
        self.reduce_heads = step_reduce_heads(engine.config) if reduce_heads is None else reduce_heads
        self.options = step_options(engine.config, engine.dtype)  # its switches for this size (STEP_SWITCHES)
        self.plan = None

    def setup(self) -> Switch:
        """Compile decode_step.cu and lay out what it reads: on when it is ready, else off with why it
        cannot run here."""
        e = self.engine
        cp, c = e.cp, e.config
        device = cp.cuda.Device()
        if int(device.compute_capability) < 90:
            return Switch.off("needs compute capability 9.0 (cp.async.bulk)")
        if not device.attributes.get("CooperativeLaunch", 0):
            return Switch.off("the device has no cooperative launch")
        exprs = kernel_expressions(c, e.dtype, reduce_heads=self.reduce_heads)
        if "decode_step" not in exprs:
            return Switch.off(f"head size {c.head_size}: decode_step needs a multiple of 32 dividing {STEP_THREADS}")
        import kernels

        plan = step_plan(c, e.dtype, e.sm_count, e.max_len, kernels.device_limits().max_shared_per_block,
                         ring=self.ring, splits=self.splits)
        if isinstance(plan, str):
            return Switch.off(plan)
        fn = fused.function(*exprs["decode_step"], options=self.options)
        fn.max_dynamic_shared_size_bytes = plan.smem
        if driver.blocks_per_sm(fn, STEP_BLOCK, plan.smem) < 1:
            return Switch.off(f"decode_step does not fit an SM ({plan.smem} bytes of shared memory, {STEP_BLOCK} "
                              "threads)")
        with e.stream:
            self._lay_out(plan)
        e.stream.synchronize()
        self.plan, e.fn["decode_step"] = plan, fn
        return ON

    def _lay_out(self, plan) -> None:
        """The layer table (LAYER_POINTERS per layer, as decode_step.cu's struct Layer), the folds and
        head-major copies it points at, and the buffers through which blocks hand each other results."""
        e = self.engine
        cp, c, p = e.cp, e.config, e.vectors
        table, self.folds = [], []  # folds: kept alive while the table points at them
        # attn.c_proj head-major, (NH, C, HS): [h, n, d] = W[n, h * HS + d] of the (out, in) copy
        self.proj_heads = [cp.ascontiguousarray(layer["attn.c_proj"].reshape(c.n_embd, c.n_head, c.head_size)
                                                .transpose(1, 0, 2)) for layer in e.layers]
        for i, layer in enumerate(e.layers):
            arrays = {"k_cache": e.k_cache[i], "v_cache": e.v_cache[i]}
            for name in LAYER_POINTERS[:10]:  # (out, in) matrices in the decode dtype; float32 vectors
                if name in LAYER_POINTERS[:4]:
                    arrays[name] = layer[name.removesuffix(".weight")]
                elif name.endswith(".fold"):
                    linear = name.removesuffix(".fold")
                    ln = f"h.{i}.{FOLDS[linear]}"
                    arrays[name] = layernorm_fold(cp, layer[linear], p[f"h.{i}.{linear}.bias"],
                                                  p[ln + ".weight"], p[ln + ".bias"])
                else:
                    arrays[name] = p[f"h.{i}.{name}"]
            arrays["attn.c_proj.weight"] = self.proj_heads[i]
            self.folds.append([arrays[name] for name in arrays if name.endswith(".fold")])
            table.append([arrays[name].data.ptr for name in LAYER_POINTERS])
        self.layer_table = cp.asarray(np.asarray(table, dtype=np.uint64))
        # LN_f folded into the rows of wte (no bias), one pair more where V is odd (whole 16-byte copies)
        V = c.vocab_size
        fold = layernorm_fold(cp, e.wte, cp.zeros(V, dtype=cp.float32), p["ln_f.weight"], p["ln_f.bias"])
        self.lnf_fold = cp.concatenate([fold, cp.zeros((V % 2, 2), dtype=cp.float32)])
        # what blocks hand each other, per layer (decode_step.cu's handoffs): (value, epoch) words for
        # q, k, v and the key splits' partials, parity words for x, g and the heads' terms of attn.c_proj
        L = c.n_layer
        self.buffers = Arena(cp, [
            Buffer("x", (L, c.n_embd), np.uint32),
            Buffer("qkv", (L, 3 * c.n_embd), np.uint64),
            Buffer("partial", (L, c.n_head, plan.splits, c.head_size + 2), np.uint64),
            Buffer("g", (L, c.mlp_width), np.uint32),
            Buffer("proj", (L, c.n_head, c.n_embd), np.uint32),
            Buffer("xa", (L, c.n_embd), np.uint32),  # x after the attention, where the blocks sum the heads' terms
            Buffer("block_max", plan.blocks, np.float32),
            Buffer("block_arg", plan.blocks, np.int32),
            Buffer("barrier", 1, np.uint32),  # never reset: see decode_step.cu
            Buffer("epoch", 1, np.uint32),  # the last step's epoch: advanced by every launch
        ])

    def launch(self, n: int, trace=None) -> None:
        """Queue n decode steps as one launch of decode_step.cu (cooperative: all blocks resident).
        trace: (n, stages, blocks, 2) uint64 for the global timer at each block's end of a stage and its
        start of the next, inputs in hand (profile)."""
        e, plan, b = self.engine, self.plan, self.buffers
        c, p = e.config, e.vectors
        args = (self.layer_table, np.int32(c.n_layer), e.wte, e.wpe, p["ln_f.weight"], self.lnf_fold, e.eps,
                np.int32(c.vocab_size), np.int32(e.max_len), np.int32(plan.splits),
                np.float32(1.0 / math.sqrt(c.head_size)), e.x, b["x"], b["qkv"], b["partial"], b["g"], b["proj"],
                b["xa"], b["block_max"], b["block_arg"], e.logits if e.logits is not None else NULL, e.state,
                e.history, b["barrier"], b["epoch"], np.int32(n), np.int32(plan.slot_bytes),
                np.int32(plan.slots), *(np.int32(r) for r in plan.item_rows), np.int32(plan.lm_rows),
                np.int32(plan.lm_keep), NULL if trace is None else trace)
        driver.launch_cooperative(e.fn["decode_step"], plan.blocks, STEP_BLOCK, args, shared_mem=plan.smem,
                                  stream=e.stream)

    def profile(self, position: int, repeats: int = 5) -> list[tuple[str, float, float, float]]:
        """Where the step's time goes at `position`: per stage (STEP_STAGES per layer, then the lm_head),
        milliseconds from the previous stage's last start (the last block to have its inputs) to this
        one's (total), the slowest block's work from its start to its end of the stage (work), and the
        median block's wait from its end of the stage to its start of the next, for its inputs: a
        handoff's words or the barrier (wait); medians of `repeats` runs of the second of two steps, from
        the global timer that each block's thread 0 reads. Changes state, history and the cache at
        `position` and the next: run generate() again after."""
        stages = len(STEP_STAGES) * self.engine.config.n_layer + 1
        ms = np.median([stage_times(t, stages, self.plan.blocks) for t in self.traces(position, repeats)], axis=0)
        return [(name, *row) for name, row in zip(self.stage_names(), ms.tolist(), strict=True)]

    def stage_names(self) -> list[str]:
        """The trace's stages in order: STEP_STAGES per layer, then the lm_head."""
        n = self.engine.config.n_layer
        return [f"h.{i}.{kind}" for i in range(n) for kind in STEP_STAGES] + ["ln_f+lm_head+argmax"]

    def traces(self, position: int, repeats: int = 5, marks: int = 2) -> list[np.ndarray]:
        """`repeats` global-timer traces of two steps from `position` (after one run to warm up), each
        (2, stages, blocks, marks) int64 ns: each block's end of a stage (0) and its start of the next
        with its inputs in hand (1); marks 6 for a decode_step built with TRACE_MARKS 6 (stage B's
        inside, tools/step_trace.py --detail). Changes state, history and the cache at `position` and the next."""
        e = self.engine
        cp = e.cp
        if not 0 <= position < e.max_len - 2:
            raise LabError(f"position {position} outside the engine's 0..{e.max_len - 3}")
        trace = cp.zeros((2, len(self.stage_names()), self.plan.blocks, marks), dtype=cp.uint64)
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            with e.stream:
                e.state.set(np.asarray([0, position], dtype=np.int32), stream=e.stream)
                self.launch(2, trace)
            e.stream.synchronize()
            runs.append(cp.asnumpy(trace).astype(np.int64))
        return runs[1:]


def stage_times(t, stages: int, blocks: int):
    """(stages, 3) milliseconds of the second step from a trace t (step, stage, block, 2) in ns: each
    stage's total, the slowest block's work, the median block's wait (PersistentStep.profile)."""
    arrive, leave = t[..., 0], t[..., 1]  # (step, stage, block) in ns
    last_leave = leave.max(axis=2).reshape(-1)  # stage by stage over both steps
    prev = leave.reshape(-1, blocks)[stages - 1:-1]  # each block's departure before stage k
    step = slice(stages, 2 * stages)
    return np.stack([last_leave[step] - last_leave[stages - 1:-1],
                     (arrive[1] - prev).max(axis=1),
                     np.median(leave[1] - arrive[1], axis=1)], axis=1) / 1e6
