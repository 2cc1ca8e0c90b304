"""tools/decode_breakdown.py's arithmetic on the CPU: a profile and a step's bytes by kind into rates
against the copy ceiling (the GPU run is the tool itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import decode_breakdown  # noqa: E402

COPY = 4e12  # bytes/s


def profile(persistent: bool) -> dict:
    """lab.profile_step's shape for two layers of GPT-2's step."""
    return {"position": 128, "kernel_ms_sum": 0.05, "graph_ms_per_token": 0.04,
            "persistent_ms_per_token": 0.03 if persistent else None,
            "by_kind": [{"kind": "embed", "launches": 1, "ms": 0.002},
                        {"kind": "ln_1+attn.c_attn", "launches": 2, "ms": 0.01},
                        {"kind": "attn", "launches": 2, "ms": 0.008},
                        {"kind": "ln_f+lm_head+argmax", "launches": 1, "ms": 0.03}],
            "graph_ms_per_token_without": {"embed": 0.039, "ln_1+attn.c_attn": 0.035, "attn": 0.036,
                                           "ln_f+lm_head+argmax": 0.025},
            "persistent_stages": [{"kind": "ln_1+attn.c_attn", "stages": 2, "ms": 0.01, "work_ms": 0.008,
                                   "wait_ms": 0.001},
                                  {"kind": "attn+attn.c_proj", "stages": 2, "ms": 0.02, "work_ms": 0.015,
                                   "wait_ms": 0.002}] if persistent else None}


STEP = [("embed", 0), ("h.0.ln_1+attn.c_attn", 10_000_000), ("h.0.attn", 500_000),
        ("h.0.attn.c_proj+residual", 3_000_000), ("h.1.ln_1+attn.c_attn", 10_000_000), ("h.1.attn", 500_000),
        ("h.1.attn.c_proj+residual", 3_000_000), ("ln_f+lm_head+argmax", 80_000_000)]


def test_each_kind_gets_its_launches_bytes_and_their_rate():
    out = decode_breakdown.breakdown(profile(False), STEP, COPY)
    kinds = {k["kind"]: k for k in out["kinds"]}
    assert kinds["ln_1+attn.c_attn"]["bytes"] == 20_000_000
    assert kinds["ln_1+attn.c_attn"]["gb_per_s"] == pytest.approx(20e6 / 0.01e-3 / 1e9)
    assert kinds["ln_1+attn.c_attn"]["pct_copy"] == pytest.approx(100 * 20e6 / 0.01e-3 / COPY)
    assert kinds["attn"]["bytes"] == 1_000_000
    assert kinds["embed"]["bytes"] == 0 and kinds["embed"]["pct_copy"] is None  # nothing counted: no rate
    assert out["step_bytes"] == 107_000_000 and out["runs_as"] == "graphs" and out["ms_per_token"] == 0.04
    assert out["step"]["pct_copy"] == pytest.approx(100 * 107e6 / 0.04e-3 / COPY)
    assert out["kernels_alone"]["pct_copy"] == pytest.approx(100 * 107e6 / 0.05e-3 / COPY)
    assert out["stages"] is None
    assert kinds["attn"]["in_graph_ms"] == pytest.approx(0.004)  # 0.04 with it, 0.036 without
    assert kinds["ln_f+lm_head+argmax"]["in_graph_ms"] == pytest.approx(0.015)
    text = decode_breakdown.table({"size": "gpt2", "dtype": "bfloat16", "status": "ok", **out})
    assert "in graph" in text and "    0.004" in text


def test_a_profile_without_the_graphs_ablation_leaves_in_graph_empty():
    p = profile(False)
    del p["graph_ms_per_token_without"]
    out = decode_breakdown.breakdown(p, STEP, COPY)
    assert all(k["in_graph_ms"] is None for k in out["kinds"])


def test_a_persistent_stage_counts_the_bytes_of_the_launches_it_fuses():
    out = decode_breakdown.breakdown(profile(True), STEP, COPY)
    assert out["runs_as"] == "persistent step" and out["ms_per_token"] == 0.03
    stages = {s["kind"]: s for s in out["stages"]}
    assert stages["ln_1+attn.c_attn"]["bytes"] == 20_000_000
    assert stages["attn+attn.c_proj"]["bytes"] == 1_000_000 + 6_000_000  # the attention and c_proj
    assert stages["attn+attn.c_proj"]["work_ms"] == 0.015
    text = decode_breakdown.table({"size": "gpt2", "dtype": "bfloat16", "status": "ok", **out})
    assert "persistent step" in text and "stage attn+attn.c_proj" in text and "(work 0.015, wait 0.002)" in text


def test_a_size_without_a_fast_engine_says_why():
    assert decode_breakdown.table({"size": "x", "dtype": "float32", "status": "no fast engine: why"}) == \
        "x float32: no fast engine: why"
