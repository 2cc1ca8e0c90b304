"""lab.py --dtype: the weights cast once, the rung chosen (or checked) by the dtype it declares.
CPU: argument handling, and 16-bit runs of the eager model with NumPy and the reference attention.
GPU: bfloat16 and float16 generation with v15 through lab.py's own code path."""

import json

import numpy as np
import pytest

import kernels
import lab
from gpt2 import reference_attend
from tests.test_lab import TINY, assert_one_line_error
from tests.test_lab import lab as run_lab


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from gpt2.load import random_weights, save

    return save(random_weights(TINY, seed=2), tmp_path_factory.mktemp("tiny-gpt2"))


def able(dtype):
    return [n for n in kernels.names() if dtype in kernels.load(n).dtypes]


def test_the_default_rung_is_the_newest_that_takes_the_dtype():
    assert able("bfloat16") and able("float16") and able("float32")
    for dtype in ("float32", "float16", "bfloat16"):
        # decode rungs are not defaults, nor FP8 rungs (they quantize their inputs: named only), nor rungs
        # not yet run on a GPU (lab.unverified)
        whole_sequence = [n for n in able(dtype) if not kernels.load(n).split_kv and not kernels.load(n).fp8
                          and not kernels.load(n).unverified]
        assert lab.pick_kernel(None, "gpu", dtype=dtype) == whole_sequence[-1]
        assert lab.pick_kernel(None, "cpu", dtype=dtype) == lab.REFERENCE
        assert lab.pick_kernel("reference", "gpu", dtype=dtype) == lab.REFERENCE
    assert "v15_bf16_mma" in able("bfloat16") and "v15_bf16_mma" not in able("float32")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_default_rung_runs_on_the_gpu_it_is_for(arch):
    """A rung declaring lab.min_arch newer than the GPU (wgmma on an sm_80 part) is never the default."""
    for dtype in ("float32", "bfloat16"):
        fit = [n for n in able(dtype) if not kernels.load(n).split_kv and not kernels.load(n).fp8
               and not kernels.load(n).unverified and kernels.load(n).runs_on(arch)]
        picked = lab.pick_kernel(None, "gpu", dtype=dtype, arch=arch)
        assert picked == fit[-1] and kernels.load(picked).runs_on(arch)
    assert lab.pick_kernel(None, "gpu", dtype="float32", arch="sm_80") == "v14_tf32_mma"
    assert lab.pick_kernel(None, "gpu", dtype="bfloat16", arch="sm_80") == "v15_bf16_mma"


def test_a_rung_without_the_dtype_is_refused_with_the_rungs_that_have_it():
    with pytest.raises(lab.LabError) as info:
        lab.pick_kernel("v13", "gpu", dtype="bfloat16")
    message = str(info.value)
    assert message.startswith("kernel v13_fa2_partitioning takes float32, not --dtype bfloat16; ")
    assert all(name in message for name in able("bfloat16")) and message.endswith("the reference do")
    with pytest.raises(lab.LabError, match="kernel v15_bf16_mma takes bfloat16, float16, not --dtype float32"):
        lab.pick_kernel("v15", "gpu", dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_make_attend_runs_the_attention_in_the_dtype(dtype):
    """Inputs of the run's dtype go straight through; float32 ones (the fast path's prefill) are
    cast to it and the output cast back."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(np.float32) for _ in range(3))
    attend = lab.make_attend(lab.REFERENCE, dtype)
    low = tuple(x.astype(dtype) for x in (q, k, v))
    same = attend(*low)
    assert same.dtype.name == dtype
    np.testing.assert_array_equal(same, reference_attend(*low))
    widened = attend(q, k, v)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, reference_attend(*low).astype(np.float32))
    assert lab.make_attend(lab.REFERENCE)(q, k, v).dtype == np.float32  # float32 runs: untouched


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_cache", [False, True], ids=["no-cache", "kv-cache"])
def test_16_bit_run_on_the_cpu(folder, tmp_path, dtype, kv_cache):
    out = tmp_path / "run.json"
    r = run_lab("--device", "cpu", "--model", folder, "--tokens", 4, "--dtype", dtype, "--json", out,
                *(["--kv-cache"] if kv_cache else []))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["dtype"] == dtype and s["kernel"] == "reference" and len(s["generated_tokens"]) == 4


DTYPE_ERRORS = {
    "unknown dtype": (["--dtype", "float64"], "invalid choice: 'float64'"),
    "rung without the dtype": (["--kernel", "v13", "--dtype", "bfloat16"],
                               "kernel v13_fa2_partitioning takes float32, not --dtype bfloat16; "),
    "16-bit rung on the cpu": (["--kernel", "v15", "--dtype", "float16"], "runs on the GPU"),
}


@pytest.mark.parametrize("case", list(DTYPE_ERRORS))
def test_dtype_errors_exit_2_with_one_line(folder, case):
    args, message = DTYPE_ERRORS[case]
    assert_one_line_error(run_lab("--model", folder, "--device", "cpu", *args), message)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv_cache", [False, True], ids=["no-cache", "kv-cache"])
def test_lab_runs_gpt2_small_in_16_bits_with_v15(tmp_path, capsys, dtype, kv_cache):
    """GPT-2 small shapes in 16 bits through lab.py's own code path: the eager model, or (bfloat16
    with the cache) the fast path with v15 as the prefill's attention. --check reruns the eager model
    with v15 and with the reference attention, both in the dtype: their logits may differ by the two
    attentions' roundings only (a few hundredths at most, for logits of standard deviation 0.55), so
    tokens may part at a near tie (exit 1) but not before the logits were compared. The exact
    agreement criterion against float32 is tests/test_gpt2_dtype.py's."""
    out = tmp_path / "run.json"
    rc = lab.main(["--random-weights", "--kernel", "v15", "--dtype", dtype, "--tokens", "32", "--check",
                   "--json", str(out), *(["--kv-cache"] if kv_cache else [])])
    printed = capsys.readouterr().out
    s = json.loads(out.read_text())
    assert rc in (0, 1), printed
    assert s["dtype"] == dtype and s["kernel"] == "v15_bf16_mma" and s["n_new_tokens"] == 32
    assert s["engine"] == ("fast" if kv_cache and dtype == "bfloat16" else "eager")
    c = s["check"]
    assert c["steps_compared"] >= 1 and c["max_logit_diff"] < 0.1, c
