"""The fast engines' prefill as a CUDA graph a bucket of prompt lengths (PREFILL_GRAPHS, on by default).

The eager prefill is host-bound: some twenty launches a layer, each tens of microseconds of Python, take
longer than the GPU's work on a 1,000-token prompt (tools/prefill_profile.py: a 1-token prompt as slow
as a 1,000-token one). With PREFILL_GRAPHS, a prompt of T tokens runs over bucket_rows(T) rows (T
rounded up to PREFILL_BUCKET), and the pass over a bucket seen before is one graph launch:

    graphs = PrefillGraphs()
    graph = graphs.get((rows, attend), lambda: PassGraph(cp, stream, passes, prepare))
    if graph is None: passes(prepare())          a bucket's first prompt (or one that cannot be captured)
    else: graph.launch(stream)                   its second (captured first) and every later one

A bucket's first prompt runs eagerly (kernels compiled, the rung validated, cuBLAS's choices made, so
that the capture compiles and loads nothing), its second is captured and launched, every later one
replays. The rows past the prompt are padding that nothing real reads: the attention is causal, every
other kernel works row by row, the head reads the prompt's last row, and the cache positions they fill
are written again by the decode step before it reads them.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict

# On unless LAB_PREFILL_GRAPHS=0 in the environment (or this set False): the eager prefill, every pass
# launched from Python, is what tools/prefill_profile.py's other settings measure beside it.
PREFILL_GRAPHS = os.environ.get("LAB_PREFILL_GRAPHS", "1") != "0"
# Rows: at most 7 padding rows a pass, one graph for 8 prompt lengths. Buckets of 128 rows made GPT-2 XL's
# first token up to a tenth slower on an H200 (900 tokens over 1,024 rows), and at no length tried were
# fewer padding rows slower: cuBLAS's choice for the exact rows was never worse than for the padded ones.
PREFILL_BUCKET = 8
PREFILL_GRAPHS_KEPT = 16  # graphs an engine keeps, the most recently launched (each holds its own buffers)


def bucket_rows(T: int, max_len: int) -> int:
    """The rows a graphed prefill of T positions runs over: T rounded up to PREFILL_BUCKET, within the
    engine's positions (its cache's length)."""
    return min(-(-T // PREFILL_BUCKET) * PREFILL_BUCKET, max_len)


class PassGraph:
    """One pass captured as a CUDA graph on the engine's stream: prepare() (what may synchronize, which
    a capture refuses: a rung's validation and workspace) before the capture, then passes(prepared)
    (launches only, nothing read back to the host) captured; `out` is what passes returned, rewritten
    in place by every launch.

    Memory. Whatever prepare and passes allocate comes from a pool of the graph's own: the graph reads
    and writes those addresses at every replay, so no other array may ever get them (lm/step_graph.py's
    rule). Blocks freed during the capture are reused later in it, in stream order, as eager code reuses
    them. The pool takes its chunks from CuPy's default pool and keeps them for the graph's life, so
    that they count in the default pool's bytes, as every other array of the run."""

    def __init__(self, cp, stream, passes, prepare=lambda: None):
        self.pool = cp.cuda.MemoryPool(cp.get_default_memory_pool().malloc)
        with cp.cuda.using_allocator(self.pool.malloc), stream:
            self.prepared = prepare()
            stream.begin_capture()
            try:
                self.out = passes(self.prepared)
            finally:
                self.graph = stream.end_capture()
        self.graph.upload(stream)

    def launch(self, stream) -> None:
        self.graph.launch(stream)


class PrefillGraphs:
    """One engine's prefill graphs, by key ((rows, attend): a bucket and the attention under test), the
    PREFILL_GRAPHS_KEPT most recently launched, and the keys whose first pass ran eagerly."""

    def __init__(self):
        self.graphs, self.seen = OrderedDict(), set()

    def clear(self) -> None:
        """Drop every graph (the buffers they read were reallocated), in place."""
        self.graphs.clear()
        self.seen.clear()

    def get(self, key, capture):
        """The graph to launch for key, or None: run the pass eagerly. capture() -> PassGraph is called
        at the key's second pass; where it fails (an attention that reads back to the host as it runs:
        the FP8 rung checks its block maxima there) the key runs eagerly from then on, with a warning."""
        if key in self.seen and key not in self.graphs:
            try:
                self.graphs[key] = capture()
            except Exception as exc:  # CuPy refuses a synchronizing call while the stream captures
                warnings.warn(f"the prefill's pass could not be captured as a CUDA graph ({exc}); it runs "
                              "eagerly", stacklevel=3)
                self.graphs[key] = None
            while len(self.graphs) > PREFILL_GRAPHS_KEPT:  # the least recently launched goes, its buffers with it
                self.graphs.popitem(last=False)
        self.seen.add(key)
        if key in self.graphs:
            self.graphs.move_to_end(key)
        return self.graphs.get(key)
