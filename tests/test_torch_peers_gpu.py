"""The plain PyTorch attention and its torch.compile peers on the GPU: the same numbers as the float64
reference (within the rungs' tolerance rule), eager and compiled, causal and not; then a levels
run on the smallest shape, end to end. Skipped without torch (the peers' rows say unavailable)."""

import importlib.util
import math

import numpy as np
import pytest

import kernels
from tests.tiers import tiered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")]


# quick: eager and the default compile; max-autotune times many candidate kernels first
@pytest.mark.parametrize("mode", tiered(["eager", "default", "max-autotune-no-cudagraphs"], quick=["eager", "default"]))
@pytest.mark.parametrize("causal", [True, False])
def test_plain_attention_matches_the_reference(mode, causal):
    import torch

    from benchmarks import torch_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    fn = torch_attention.plain_attention if mode == "eager" else torch_attention.compiled(mode)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 3, 97, 64, device="cuda", generator=g) for _ in range(3))
    got = fn(q, k, v, causal).double().cpu().numpy()
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    ref = kernels.reference_attention(q64, k64, v64, causal=causal)
    plain = kernels.reference_attention(*(x.astype(np.float32) for x in (q64, k64, v64)), causal=causal)
    bound = 8 * max(float(np.abs(plain - ref).max()), 2.0**-23 * float(np.abs(ref).max()))
    err = float(np.abs(got - ref).max())
    assert not math.isnan(err) and err <= bound, f"{mode}: max error {err:.2e} > {bound:.2e}"


@pytest.mark.exhaustive  # bench.py's harness over five levels, torch.compile's included; the quick tier checks the peers above
def test_levels_runs_end_to_end(tmp_path, capsys):
    import json

    import bench
    from benchmarks import levels
    from benchmarks.cases import Shape

    saved = dict(levels.SHAPE_SETS)
    levels.SHAPE_SETS.update({"gpt2": (Shape(1, 512),), "d128": ()})
    try:
        assert bench.main(["levels", "--levels", "pytorch,compile,triton,cuda,sdpa", "--shapes", "gpt2",
                           "--budget-ms", "20", "--results", str(tmp_path)]) == 0
    finally:
        levels.SHAPE_SETS.update(saved)
    (path,) = tmp_path.glob("levels-*.json")
    rows = {(r["dtype"], r["name"]): r for r in json.loads(path.read_text())["rows"]}
    for dtype in ("float32", "bfloat16"):
        for name in ("torch_naive", "torch_compile", levels.cuda_rung(dtype, 64, None)):
            r = rows[dtype, name]  # a rung over the bound would be "wrong"; a peer's error is recorded as it is
            assert r["status"] == "ok" and math.isfinite(r["max_err"]), (dtype, name, r.get("reason"))
        assert rows[dtype, "torch_compile"]["compile_seconds"] > 0
    assert "kernels per call" in rows["float32", "torch_compile"]["note"]
