"""lab.py --kernel t01: Triton rungs resolve through the same path as the .cu rungs, with the same
refusals (dtype, head size, grouped-query heads, the CPU) and one clear line where Triton is missing."""

from types import SimpleNamespace

import pytest

import kernels
import lab

WHY = "the Triton rungs need triton, not installed here: pip install -e '.[triton]' (and PyTorch with CUDA)"


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton_unavailable", lambda: None)


@pytest.mark.parametrize("name", ["t1", "t01", "t01_fa2"])
def test_triton_names_resolve_to_the_rung(with_triton, name):
    assert lab.pick_kernel(name, "gpu", dtype="float32") == "t01_fa2"
    assert lab.pick_kernel(name, "gpu", dtype="bfloat16") == "t01_fa2"


def test_without_triton_the_refusal_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(kernels, "triton_unavailable", lambda: WHY)
    with pytest.raises(lab.LabError) as info:
        lab.pick_kernel("t01", "gpu", dtype="float32")
    assert str(info.value) == f"--kernel t01: {WHY}"


def test_triton_refusals_are_the_rungs(with_triton):
    with pytest.raises(lab.LabError, match=r"unknown Triton kernel 't9'.*t01_fa2.*or 'reference'"):
        lab.pick_kernel("t9", "gpu")
    with pytest.raises(lab.LabError, match="--kernel t01 runs on the GPU; --device cpu runs the reference"):
        lab.pick_kernel("t01", "cpu", asked="cpu")
    config = SimpleNamespace(head_size=80, n_head=12, kv_heads=12)
    with pytest.raises(lab.LabError, match="kernel t01_fa2 supports head sizes 32, 64, 128; this model's is 80"):
        lab.fit_kernel("t01_fa2", "t01", config, "float32", "gpu", "sm_90")
    gqa = SimpleNamespace(head_size=64, n_head=32, kv_heads=8)  # t01 declares gqa: taken
    assert lab.fit_kernel("t01_fa2", "t01", gqa, "bfloat16", "gpu", "sm_90") == "t01_fa2"


def test_a_user_triton_file_by_path(with_triton, tmp_path):
    path = tmp_path / "t_mine.py"
    path.write_text('"""Mine.\n\nlab.dtypes      float32\nlab.head_sizes  64\nlab.precisions  ieee\n'
                    'lab.tolerance   ieee 8\n"""\n')
    assert lab.pick_kernel(str(path), "gpu") == str(path)
    with pytest.raises(lab.LabError, match="kernel t_mine takes float32, not --dtype bfloat16"):
        lab.pick_kernel(str(path), "gpu", dtype="bfloat16")
