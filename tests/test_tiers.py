"""The quick GPU tier (tests/tiers.py) keeps what it promises, read from pytest's own collection (no
GPU needed): every forward rung (CUDA and Triton), every backward rung, every kernels/fused kernel and
both engines, each GPU test file, and nothing the whole suite lacks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parent.parent
QUICK, WHOLE = "gpu and not exhaustive", "gpu"

# each kernels/fused file, and the quick test that runs it (by its node id, or a part of one)
FUSED_TESTS = {
    "adamw": "tests/test_adamw_gpu.py::",
    "bias_act": "::test_bias_act_matches_bias_and_gelu[",
    "decode_attention": "::test_decode_attention_matches_softmax_attention_over_the_cache[",
    "decode_step": "::test_persistent_step_follows_the_per_operation_step[",  # gpt2.fast's persistent step
    "embed": "::test_embed_adds_token_and_position_rows[",
    "gemm": "::test_gemm_matches_the_float64_product_and_epilogue[",
    "gemv": "::test_gemv_matches_layernorm_linear_and_epilogue[",
    "gqa_decode_attention": "::test_gqa_decode_attention_matches_softmax_attention_over_the_cache[",
    "kv_store": "::test_kv_store_fills_the_static_cache[",
    "layernorm": "::test_add_layernorm_matches_residual_add_and_layer_norm[",
    "lm_head_argmax": "::test_lm_head_argmax_picks_the_largest_logit_and_advances_the_state[",
    "merge_heads": "::test_merge_heads_reads_any_strides",
    "rms_gemv": "::test_rms_gemv_rope_rotates_q_and_k_and_stores_k_and_v_at_pos[",
    "spin": "::test_profile_step_times_every_kernel",  # the per-kernel profile queues behind it
    "train": "tests/test_train_kernels_gpu.py::",
}
# both engines (gpt2.fast's persistent step and CUDA graphs, llama.fast) and lab.py on the GPU
ENGINE_TESTS = [
    "tests/test_fused_gpu.py::test_graph_replay_equals_eager_launches_and_the_eager_model[",
    "tests/test_fused_gpu.py::test_persistent_step_windows_are_single_steps[",
    "tests/test_llama_fast_gpu.py::test_graph_replay_equals_plain_launches_and_programmatic_dependent_launch",
    "tests/test_llama_fast_gpu.py::test_float32_greedy_tokens_equal_the_eager_path_s_over_512_tokens",
    "tests/test_gpt2_gpu.py::test_lab_runs_gpt2_small_on_the_newest_float32_rung[",
    "tests/test_llama_fast_gpu.py::test_lab_runs_llama_on_the_fast_path_and_profiles_its_step",
]


@pytest.fixture(scope="module")
def tiers():
    """{marker expression: the node ids it collects}, both collections run side by side."""
    runs = {expr: subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                    "-m", expr, "tests"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for expr in (QUICK, WHOLE)}
    ids = {}
    for expr, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"collecting -m {expr!r} failed:\n{out[-2000:]}{err[-2000:]}"
        ids[expr] = [line for line in out.splitlines() if "::" in line]
    return ids


def named(ids, name):
    return any(re.search(rf"\b{re.escape(name)}\b", i) for i in ids)


def test_the_quick_tier_is_a_small_strict_subset_of_the_whole(tiers):
    quick, whole = set(tiers[QUICK]), set(tiers[WHOLE])
    assert len(quick) == len(tiers[QUICK]) and quick, "the quick tier collects no test, or one twice"
    assert quick < whole, f"quick tests outside the whole suite: {sorted(quick - whole)[:5]}"
    assert len(quick) <= len(whole) // 5, f"the quick tier has {len(quick)} of {len(whole)} tests: more than a fifth"


def test_the_quick_tier_runs_every_rung(tiers):
    quick = tiers[QUICK]
    rungs = kernels.names() + kernels.triton_names() + kernels.backward_names()
    assert not [name for name in rungs if not named(quick, name)], "rungs the quick tier never runs"


def test_the_quick_tier_runs_every_fused_kernel_and_both_engines(tiers):
    assert sorted(FUSED_TESTS) == sorted(p.stem for p in (ROOT / "kernels" / "fused").glob("*.cu")), \
        "FUSED_TESTS names a test for each kernels/fused/*.cu"
    missing = [f"{stem}.cu ({test})" for stem, test in FUSED_TESTS.items() if not any(test in i for i in tiers[QUICK])]
    missing += [test for test in ENGINE_TESTS if not any(i.startswith(test) or i == test for i in tiers[QUICK])]
    assert not missing, f"not in the quick tier: {missing}"


def test_the_quick_tier_touches_every_gpu_test_file(tiers):
    files = {i.split("::")[0] for i in tiers[QUICK]}
    assert not sorted({i.split("::")[0] for i in tiers[WHOLE]} - files), "GPU test files the quick tier skips"
