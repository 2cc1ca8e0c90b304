"""kernels.default_rung and rungs_for: the one rule for the rung a run gets when none is named."""

import pytest

import kernels
from kernels import runtime


def declared(dtype, head_size=None, gqa=False, arch=None, decode=False):
    """The rule spelled out from each rung's declarations, for the function to match."""
    out = []
    for name in kernels.names():
        r = kernels.load(name)
        if r.fp8 or r.unverified or r.split_kv != decode or dtype not in r.dtypes:
            continue
        if head_size is not None and head_size not in r.head_sizes():
            continue
        if (gqa and "gqa" not in r.supports) or (arch is not None and not r.runs_on(arch)):
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("arch", [None, "sm_80", "sm_90"])
@pytest.mark.parametrize("head_size, gqa", [(None, False), (64, False), (64, True), (128, True)])
@pytest.mark.parametrize("decode", [False, True])
def test_the_rungs_that_fit_are_those_whose_declarations_take_the_run(dtype, arch, head_size, gqa, decode):
    able = kernels.rungs_for(dtype, head_size, gqa, arch, decode=decode)
    assert able == declared(dtype, head_size, gqa, arch, decode)
    assert kernels.default_rung(dtype, head_size, gqa, arch, decode=decode) == (able[-1] if able else None)


def test_known_defaults():
    assert kernels.default_rung("float32", arch="sm_80") == "v14_tf32_mma"
    assert kernels.default_rung("bfloat16", arch="sm_80") == "v15_bf16_mma"
    assert kernels.default_rung("bfloat16", 128, True, "sm_90") == "v40_wide_o_stores"
    assert kernels.default_rung("float32", 128, True, "sm_90") == "v14_tf32_mma"  # v20 takes no head size 128
    assert kernels.default_rung("float32", 64, arch="sm_80", decode=True) == "v16_decode_split_kv"
    assert kernels.default_rung("float32", 63) is None  # no rung takes an odd head size


def test_fp8_and_decode_rungs_are_never_whole_sequence_defaults():
    for dtype in ("float32", "bfloat16"):
        for name in kernels.rungs_for(dtype):
            assert not kernels.load(name).fp8 and not kernels.load(name).split_kv
    assert all(kernels.load(n).split_kv for n in kernels.rungs_for("float32", decode=True))


def test_a_rung_not_yet_run_on_a_gpu_is_named_but_never_a_default(unverified_rung):
    """lab.unverified (a rung written after a session's device time was spent, as v32 and v33 were): it
    loads and is found by name, but no run that names no rung gets it, even as the newest that fits, and
    an FP8 default passes over such a rung too. The ladder holds none now: copies of v31 and v29 declare it."""
    default = kernels.default_rung("bfloat16", 64, False, "sm_90")
    fp8_default = runtime.fp8_rung()
    bf16, fp8 = unverified_rung("v31", "v98_unverified"), unverified_rung("v29", "v99_unverified_fp8")
    assert kernels.names()[-2:] == [bf16, fp8]
    assert kernels.load("v98").unverified == "not yet run on a GPU" and kernels.load("v31").unverified is None
    unverified = [n for n in kernels.names() if kernels.load(n).unverified]
    assert unverified[-2:] == [bf16, fp8]
    for dtype in ("float32", "bfloat16", "float16"):
        assert not set(kernels.rungs_for(dtype)) & set(unverified)
    # without its lab.unverified line the copy would be the default (bench.py measures it: unverified=True)
    assert kernels.rungs_for("bfloat16", 64, False, "sm_90", unverified=True)[-1] == bf16
    assert kernels.default_rung("bfloat16", 64, False, "sm_90") == default
    assert kernels.load(default).unverified is None
    assert [n for n in kernels.names() if kernels.load(n).fp8 and kernels.load(n).fp8_qk == "e4m3"][-1] == fp8
    assert runtime.fp8_rung() == fp8_default == "v29_fp8_wide_keys"
