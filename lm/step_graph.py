"""A training step captured once as a CUDA graph and replayed every step (train.py --graph): the ~800
launches of a GPT-2 step from Python leave the GPU idle between kernels; a graph queues them in one
launch.

    graph = StepGraph(cupy, [x.shape, y.shape], np.int32)     static input buffers, a pool of its own
    outputs = graph.capture(step)                              step(inputs) queued into the graph, not run
    graph.replay([x, y], before=load)                          x, y copied in, load() queued, the graph launched

step(inputs) must queue its work on the current stream and read nothing back to the host (no float()
of a device array, no .get(), no host-to-device copy: CuPy refuses those while a stream captures); the
graph replays the kernels with the arguments they had at capture, so whatever changes between steps
(the learning rate, AdamW's step count) must reach the kernels through device memory, written before
each replay by `before` (on the graph's stream, outside the graph).

Memory. Every array step allocates during the capture comes from this graph's own cupy.cuda.MemoryPool
(cupy.cuda.using_allocator), on the graph's stream: the graph reads and writes those addresses at every
replay, so no other allocation may ever get them. The pool lives as long as the graph and nothing else
allocates from it; the arrays step returns (the loss, the gradients) stay at their addresses, rewritten
by each replay. Blocks freed during the capture are reused later in the same capture, in stream order,
as eager code reuses them. The caller runs one eager step first (the rungs and CuPy's kernels compiled,
cuBLAS's heuristics chosen) so that the capture compiles and loads nothing.
"""

from __future__ import annotations

import numpy as np


class StepGraph:
    def __init__(self, cp, shapes: list[tuple[int, ...]], dtype=np.int32):
        """cp: CuPy; shapes: the input buffers' (each batch's idx and targets), of `dtype`."""
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)  # capture refuses the legacy default stream
        self.pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(self.pool.malloc):
            self.inputs = [cp.zeros(shape, dtype=dtype) for shape in shapes]
        self.graph = None

    def capture(self, step):
        """Queue step(self.inputs) into the graph (nothing runs) after the caller's queued work; its
        outputs, whose arrays every replay rewrites in place."""
        cp = self.cp
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                outputs = step(self.inputs)
            finally:
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        self.graph = graph
        return outputs

    def replay(self, arrays: list, before=None) -> None:
        """The host arrays copied into the input buffers, before() (more host-to-device copies: the step's
        scalars), then the graph, all on the graph's stream after the caller's queued work; the caller's
        stream waits for the step. Read the outputs after synchronizing."""
        cp = self.cp
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:
            for buffer, a in zip(self.inputs, arrays, strict=True):
                buffer.set(np.ascontiguousarray(a, dtype=buffer.dtype))  # stream-ordered: after the last replay
            if before is not None:
                before()
            self.graph.launch(self.stream)
        caller.wait_event(self.stream.record())

    def total_bytes(self) -> int:
        """The pool's bytes: the graph's arrays, inputs, outputs and temporaries."""
        return self.pool.total_bytes()


class TrainingGraph:
    """A whole training step as one graph: `passes(inputs)` (the forward and backward passes on the input
    buffers: (losses, grads), no read back to the host), then the multi-tensor AdamW's clipping and update
    (opt.multi), captured once; step() replays it on a batch at a learning rate. What train.py --graph,
    bench.py train's graph row and tools/train_step_profile.py --graph run.

        tg = TrainingGraph(cp, passes, opt, params, shapes, max_norm=1.0)
        tg.step([idx, targets], lr)        host arrays in; tg.losses, tg.grads, opt.multi.norm rewritten
    """

    def __init__(self, cp, passes, opt, params: dict, shapes: list[tuple[int, ...]], max_norm: float,
                 dtype=np.int32):
        if opt.multi is None:
            raise ValueError("a captured step needs the multi-tensor AdamW (its scalars live on the device)")
        self.opt, self.params = opt, params
        self.graph = StepGraph(cp, shapes, dtype)

        def captured(inputs):
            losses, grads = passes(inputs)
            opt.multi.launch(max_norm)
            return losses, grads

        self.losses, self.grads = self.graph.capture(captured)

    def step(self, arrays: list, lr: float) -> None:
        """The batch (host arrays, in the order of `shapes`) into the input buffers, this step's learning
        rate and AdamW's step count into the optimizer's device scalars, the graph launched."""
        self.graph.replay(arrays, before=lambda: self.opt.multi.load(self.params, self.grads, self.opt.advance(lr)))

    def total_bytes(self) -> int:
        return self.graph.total_bytes()
