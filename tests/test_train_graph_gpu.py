"""train.py --graph on the GPU: the whole step captured as a CUDA graph (lm/step_graph.py) and replayed gives
the eager path's losses and gradient norms over ten steps of a warmup and cosine schedule, float32 and
bfloat16, one micro-batch and two. GPT-2 small's shapes at a small batch, random weights.

Bit for bit: the graph runs the same kernels on the same arrays' values, and with --deterministic the backward
rung sums dQ in a fixed order (the embeddings' gradient always adds in row order), so two eager runs give the
same bits and the graph gives them too. (Without it the rung's atomics make two eager runs differ, and a bound
from one pair's spread failed now and then.)"""

import json

import numpy as np
import pytest

from lm.token_data import write_bin

pytestmark = pytest.mark.gpu
STEPS = 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Ids from the first 64 of the vocabulary: losses that fall within ten steps (see test_train_gpu.py)."""
    path = tmp_path_factory.mktemp("graph") / "train.bin"
    return write_bin(path, np.random.default_rng(0).integers(0, 64, 40_000))


def run(tmp_path, data, dtype: str, accum: int, *extra) -> dict:
    """train.py's --json of ten steps from seeded GPT-2 small weights."""
    import train

    log = tmp_path / f"run-{dtype}-{accum}-{len(list(tmp_path.iterdir()))}.json"
    argv = ["--device", "gpu", "--random-weights", "--size", "gpt2", "--seed", "0", "--data", str(data),
            "--dtype", dtype, "--steps", str(STEPS), "--batch", "4", "--seq", "256", "--accum", str(accum),
            "--lr", "6e-4", "--warmup", "3", "--lr-schedule", "cosine", "--json", str(log), *extra]
    assert train.main(argv) == 0
    return json.loads(log.read_text())


@pytest.mark.parametrize("dtype, accum", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2)])
def test_graph_replays_give_the_eager_losses(tmp_path, data, dtype, accum):
    eager, again, graph = (run(tmp_path, data, dtype, accum, "--deterministic", *extra) for extra in ([], [], ["--graph"]))
    for key in ("losses", "grad_norm"):
        a, b, g = (np.array(r[key]) for r in (eager, again, graph))
        print(f"{dtype} accum {accum} {key}: bit-identical steps, eager again {int((b == a).sum())}/{STEPS}, "
              f"graph {int((g == a).sum())}/{STEPS}; graph vs eager max relative {(np.abs(g - a) / np.abs(a)).max():.3g}")
        assert np.array_equal(b, a), (key, a, b)  # --deterministic: the same bits run to run
        assert np.array_equal(g, a), (key, a, g)
    assert graph["lr"] == eager["lr"] and len(set(graph["lr"])) > 5  # warmup, then the cosine
    assert graph["losses"][-1] < graph["losses"][0]
    print(f"peak GPU memory: eager {eager['peak_gpu_memory_bytes'] / 2**30:.2f} GiB, "
          f"graph {graph['peak_gpu_memory_bytes'] / 2**30:.2f} GiB; ms after step 2: eager "
          f"{np.mean(eager['ms'][2:]):.1f}, graph {np.mean(graph['ms'][2:]):.1f}")
    assert graph["peak_gpu_memory_bytes"] > 0

