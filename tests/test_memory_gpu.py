"""What a run holds on the GPU: 16-bit products without a float32 copy of the weight, the fast engine on
views of weights laid out once, and lab.py's peak within 1.15 x (weights + KV cache) + 256 MiB on
GPT-2 and Llama shapes, eager and fast, bfloat16 and float32."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpt2
import gpt2.fast as fast
from lm.arrays import held_bytes
from lm.products import matmul
from tests.tiers import tiered

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_products_accumulate_in_float32_without_a_float32_copy(cp, dtype):
    """A (4096, 4096) 16-bit weight (32 MiB; 64 MiB in float32): the pool grows by the output and the
    cast input alone, and the product is the float64 product of the rounded operands within the
    output's rounding (float32 accumulation over 4096 terms)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, and so with CuPy)

    dtype = np.dtype(dtype)
    rng = cp.random.default_rng(0)
    w = rng.standard_normal((4096, 4096), dtype=cp.float32).astype(dtype)  # (out, in)
    x = rng.standard_normal((3, 4096), dtype=cp.float32)
    small = cp.ascontiguousarray(w[:8, :64])
    matmul(x[:, :64], small.T)  # the cuBLAS handle and its workspace, before the count
    matmul(x[:, :64], small.T, np.float32)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    y = matmul(x, w.T)
    logits = matmul(x, w.T, np.float32)
    cp.cuda.Device().synchronize()
    assert pool.total_bytes() - before < w.nbytes // 4, "a copy of the weight was made"
    ref = x.astype(dtype).astype(cp.float64) @ w.astype(cp.float64).T
    scale = float(cp.abs(ref).max())
    assert y.dtype == dtype and logits.dtype == cp.float32
    assert float(cp.abs(y.astype(cp.float64) - ref).max()) <= 2.0**-7 * scale
    assert float(cp.abs(logits.astype(cp.float64) - ref).max()) <= 1e-5 * scale


@pytest.mark.parametrize("dtype", fast.DTYPES)
def test_the_engine_holds_views_of_weights_laid_out_once(cp, dtype):
    """GPT-2 small loaded in dtype and laid out by decode_layout: every matrix the engine reads is a
    view of the weights, and what it adds beside them is the KV cache, the persistent step's head-major
    attn.c_proj (where it runs) and at most 64 MiB more (activations, folds, handoff buffers)."""
    params = fast.decode_layout(gpt2.random_weights("gpt2", seed=0, xp=cp, dtype=dtype).params)
    engine = fast.Engine(params, gpt2.SIZES["gpt2"], dtype=dtype)
    engine.generate(PROMPT, 40, attend=gpt2.reference_attend, kv_cache=True)
    matrices = [a for a in engine.weights.arrays().values() if a.ndim == 2]
    assert held_bytes(matrices, besides=params.values()) == 0
    kv = engine.k_cache.nbytes + engine.v_cache.nbytes
    heads = sum(a.nbytes for a in engine.step.proj_heads) if engine.persistent else 0
    added = engine.added_bytes()
    assert kv + heads <= added <= kv + heads + (64 << 20), (added, kv, heads)


# quick: GPT-2 small's runs and Llama's KV-cache run; GPT-2 medium and Llama without the cache are the same bound, longer
@pytest.mark.parametrize("args", tiered([
    ["--kv-cache", "--dtype", "bfloat16"],
    ["--kv-cache"],
    ["--kv-cache", "--dtype", "bfloat16", "--size", "gpt2-medium"],
    ["--kv-cache", "--no-graph", "--dtype", "bfloat16"],
    ["--kv-cache", "--size", "llama-3.2-1b", "--prompt-ids", "128000,791,1888"],
    ["--size", "llama-3.2-1b", "--prompt-ids", "128000,791,1888"],
], quick=lambda args: "gpt2-medium" not in args and "--kv-cache" in args), ids=["gpt2-bf16", "gpt2-fp32", "medium-bf16", "gpt2-bf16-eager", "llama-1b-kv", "llama-1b-no-cache"])
def test_lab_runs_within_the_memory_bound(tmp_path, args):
    """Each run in a process of its own, as a user starts it: the pool's high-water mark is the run's,
    not that of whatever else the test process holds (other tests' arrays, engines, workspaces)."""
    out = tmp_path / "run.json"
    run = subprocess.run([sys.executable, str(ROOT / "lab.py"), "--random-weights", "--tokens", "64", "--json",
                          str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["weight_bytes"] == s["n_params"] * (2 if s["dtype"] == "bfloat16" else 4)
    assert s["peak_gpu_memory_bytes"] >= s["weight_bytes"] + s["kv_cache_bytes"]
    assert s["within_memory_bound"], (f"peak {s['peak_gpu_memory_bytes'] / 2**20:.0f} MiB > bound "
                                      f"{s['memory_bound_bytes'] / 2**20:.0f} MiB (engine adds "
                                      f"{(s['engine_added_bytes'] or 0) / 2**20:.0f} MiB)")
