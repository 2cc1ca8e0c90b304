"""The ceiling each row is held against (benchmarks/ceilings.py): the precision it computes at, from the
rung's declarations and config; the kernels table's "% of ceiling"; older results with only FFMA; the
tensor GEMM ceilings without torch."""

import json
from types import SimpleNamespace

import pytest

import kernels
from benchmarks import ceilings, device, results, rungs, tables, timing
from benchmarks.cases import Shape
from kernels import ladder
from tests.bench.helpers import kernels_result, table_rows, timed_row

NEW = {"ffma_tflops": 50.0, "ffma_what": "sgemm", "tf32_tflops": 300.0, "tf32_what": "tf32 gemm",
       "bf16_tflops": 600.0, "bf16_what": "bf16 gemm", "fp16_tflops": 640.0, "fp16_what": "fp16 gemm",
       "copy_tbps": 4.0, "copy_what": "copy"}


def row(name, kind="rung", dtype="float32", config=None, ms=1.0):
    r = timed_row(Shape(8, 1024), name, kind, ms) if kind == "peer" else timed_row(Shape(8, 1024), name, "rung", ms)
    r["dtype"] = dtype
    if config is not None:
        r["config"] = config
    return r


@pytest.mark.parametrize("name, dtype, config, math", [
    ("v01_naive", "float32", "d_head=64, B_r=48, B_c=48", "ffma"),
    ("v13_fa2_partitioning", "float32", "d_head=64, B_r=64, B_c=64", "ffma"),
    ("v14_tf32_mma", "float32", "d_head=64, B_r=64, B_c=64, split=1", "tf32x3"),
    ("v14_tf32_mma", "float32", "d_head=64, B_r=64, B_c=64, split=0", "tf32"),
    ("v20_tf32_wgmma", "float32", "d_head=64, B_r=192, B_c=32", "tf32x3"),
    ("v16_decode_split_kv", "float32", "d_head=64, B_r=8, B_c=64, dtype_id=0, splits=1", "ffma"),
    ("v15_bf16_mma", "bfloat16", "d_head=64, B_r=128, B_c=64, dtype_id=0", "bf16"),
    ("v18_wgmma", "float16", "d_head=64, B_r=64, B_c=128, dtype_id=1", "fp16"),
])
def test_each_rung_computes_at_its_precision(name, dtype, config, math):
    assert ceilings.row_math(row(name, dtype=dtype, config=config)) == math


def test_a_row_without_its_config_needs_configs_that_agree():
    assert ceilings.row_math(row("v20_tf32_wgmma", config="")) == "tf32x3"  # every config is 3xTF32
    assert ceilings.row_math(row("v14_tf32_mma", config="")) is None  # split 0 or 1: cannot tell
    assert ceilings.row_math(row("v14_tf32_mma", config="d_head=96, B_r=64, B_c=16, split=1")) == "tf32x3"


def test_peers_and_unknown_rungs():
    assert ceilings.row_math(row("sdpa_efficient", kind="peer")) == "ffma"  # float32 peers: FFMA, said so
    assert ceilings.row_math(row("sdpa_flash", kind="peer", dtype="bfloat16")) == "bf16"
    assert ceilings.row_math(row("v03_fast")) is None  # no such rung any more: no ceiling
    assert ceilings.row_math({**row("v03_fast"), "math": "tf32"}) == "tf32"  # recorded by the run


def test_every_float32_rung_declares_or_defaults_its_tf32_products():
    for name in kernels.names():
        rung = kernels.load(name)
        uses_tf32 = {rung.tf32_products_of(c) for c in rung.configs} - {0}
        assert bool(uses_tf32) == (name.startswith(("v14_", "v20_"))), name


def test_tf32_products_is_checked_at_load(tmp_path):
    src = kernels.resolve("v13").read_text().replace(" * lab.strided    true", " * lab.tf32_products split\n"
                                                                               " * lab.strided    true")
    (tmp_path / "v99_bad.cu").write_text(src)
    with pytest.raises(ValueError, match="split"):
        ladder.parse(tmp_path / "v99_bad.cu")


def test_ceiling_values_and_names():
    assert ceilings.ceiling("ffma", NEW) == (50.0, "fp32 FFMA")
    assert ceilings.ceiling("tf32", NEW) == (300.0, "TF32 tensor")
    assert ceilings.ceiling("tf32x3", NEW) == (100.0, "TF32 tensor / 3")
    assert ceilings.ceiling("bf16", NEW) == (600.0, "bf16 tensor")
    assert ceilings.ceiling("fp16", NEW) == (640.0, "fp16 tensor")
    assert ceilings.ceiling("bf16", {"ffma_tflops": 50.0}) == (None, "bf16 tensor")  # an older result
    assert ceilings.ceiling(None, NEW) == (None, "unknown")


def test_pct_of_ceiling():
    r = row("v14_tf32_mma", config="d_head=64, B_r=64, B_c=64, split=1")
    r["tflops"] = 50.0
    assert ceilings.pct_of_ceiling(r, NEW) == pytest.approx(50.0)  # of 300 / 3
    r["tflops"] = 25.0
    assert ceilings.pct_of_ceiling(row("v01_naive") | {"tflops": 25.0}, NEW) == pytest.approx(50.0)
    assert ceilings.pct_of_ceiling(row("v15_bf16_mma", dtype="bfloat16") | {"tflops": 300.0}, NEW) == pytest.approx(50.0)
    assert ceilings.pct_of_ceiling(row("v15_bf16_mma", dtype="bfloat16") | {"tflops": 300.0},
                                   {"ffma_tflops": 50.0}) is None  # never 600% of FFMA


def new_kernels_result():
    result = kernels_result(shapes=((8, 1024),))
    shape = Shape(8, 1024)
    v14 = timed_row(shape, "v14_tf32_mma", "rung", 0.5) | {"config": "d_head=64, B_r=64, B_c=64, split=1"}
    result["rows"].insert(3, v14)
    rungs.add_speedups(result["rows"])
    result["ceilings"] = dict(NEW)
    return json.loads(json.dumps(results.jsonable(result)))


def test_kernels_table_names_each_ceiling():
    result = new_kernels_result()
    text = tables.render_kernels(result)
    assert "| TFLOP/s | % of ceiling |" in text
    assert "fp32 FFMA 50.0 TFLOP/s (sgemm); TF32 tensor 300.0 TFLOP/s (tf32 gemm); bf16 tensor 600.0" in text
    assert "3xTF32 (`v14_tf32_mma`): TF32 tensor / 3 (3 TF32 products per product counted), 100.0 TFLOP/s" in text
    assert "FFMA (`v01_naive`, CuPy reference, SDPA efficient): fp32 FFMA, 50.0 TFLOP/s" in text
    v14 = [c.strip() for c in table_rows(text, "`v14_tf32_mma`")[0].split("|")[1:-1]]
    v01 = [c.strip() for c in table_rows(text, "`v01_naive`")[0].split("|")[1:-1]]
    tflops = float(v14[3])
    assert v14[4] == f"{tflops:.1f}%"  # of 100 TFLOP/s: the number itself
    assert v01[4] == f"{100 * float(v01[3]) / 50.0:.1f}%"
    fake = [c.strip() for c in table_rows(text, "`v03_fast`")[0].split("|")[1:-1]]
    assert fake[4] == "-"  # a rung this checkout does not have: no ceiling to name


def test_an_older_result_with_only_ffma_still_renders():
    result = new_kernels_result()
    result["ceilings"] = {"ffma_tflops": 50.0, "ffma_what": "sgemm", "copy_tbps": 4.0, "copy_what": "copy"}
    text = tables.render_kernels(result)
    assert "Ceilings measured in the same run: fp32 FFMA 50.0 TFLOP/s (sgemm); device copy 4.00 TB/s" in text
    assert "TF32 tensor / 3 (3 TF32 products per product counted), not measured in this run (-)" in text
    v14 = [c.strip() for c in table_rows(text, "`v14_tf32_mma`")[0].split("|")[1:-1]]
    v01 = [c.strip() for c in table_rows(text, "`v01_naive`")[0].split("|")[1:-1]]
    assert v14[4] == "-" and v01[4].endswith("%")
    sweep = dict(result, kind="sweep", tokens=8192)
    assert "Ceilings measured in the same run: fp32 FFMA 50.0 TFLOP/s (sgemm)." in tables.render_sweep(sweep)


def test_annotate_records_math_and_pct():
    result = new_kernels_result()
    ceilings.annotate(result["rows"], NEW, [kernels.resolve("v14")])
    by_name = {r["name"]: r for r in result["rows"]}
    assert by_name["v14_tf32_mma"]["math"] == "tf32x3"
    assert by_name["v14_tf32_mma"]["pct_ceiling"] == pytest.approx(by_name["v14_tf32_mma"]["tflops"])
    assert by_name["v02_broken"]["pct_ceiling"] is None
    assert by_name["sdpa_efficient"]["math"] == "ffma"


def test_measured_says_which_were_unavailable():
    text = ceilings.measured({"ffma_tflops": 50.0, "ffma_what": "sgemm", "bf16_tflops": None,
                              "bf16_what": "unavailable: torch is not importable"})
    assert text == "fp32 FFMA 50.0 TFLOP/s (sgemm); bf16 tensor unavailable: torch is not importable"


def test_tensor_ceilings_without_torch(monkeypatch):
    def no_torch():
        raise device.Unavailable("torch is not importable (ImportError: none here)")

    monkeypatch.setattr(device, "get_torch", no_torch)
    got = timing.measure_tensor_ceilings(timing.Method())
    assert set(got) == {"tf32_tflops", "tf32_what", "bf16_tflops", "bf16_what", "fp16_tflops", "fp16_what",
                        "fp8_tflops", "fp8_what"}
    assert got["fp8_tflops"] is None and got["fp8_what"].startswith("unavailable: torch is not importable")
    assert got["bf16_tflops"] is None and got["bf16_what"].startswith("unavailable: torch is not importable")


def test_cublas_math_restores_torch_settings():
    matmul = SimpleNamespace(allow_tf32=False, allow_fp16_reduced_precision_reduction=True,
                             allow_bf16_reduced_precision_reduction=True)
    torch = SimpleNamespace(backends=SimpleNamespace(cuda=SimpleNamespace(matmul=matmul)))
    with timing.cublas_math(torch, tf32=True):
        assert matmul.allow_tf32 is True
        assert not matmul.allow_fp16_reduced_precision_reduction and not matmul.allow_bf16_reduced_precision_reduction
    assert matmul.allow_tf32 is False and matmul.allow_fp16_reduced_precision_reduction
    with pytest.raises(RuntimeError), timing.cublas_math(torch, tf32=True):
        raise RuntimeError("out of memory")
    assert matmul.allow_tf32 is False


def test_an_fp8_rung_is_held_to_the_e4m3_ceiling():
    v25 = {"name": "v25_fp8", "kind": "rung", "dtype": "bfloat16", "status": "ok", "tflops": 700.0}
    assert ceilings.rung_math(kernels.load("v25_fp8"), "bfloat16", {}) == "fp8"
    assert ceilings.row_math(v25) == "fp8" and ceilings.row_math({**v25, "math": "bf16"}) == "bf16"  # as recorded
    assert ceilings.ceiling("fp8", {"bf16_tflops": 740.0, "fp8_tflops": 1400.0}) == (1400.0, "fp8 tensor (e4m3)")
    assert ceilings.pct_of_ceiling(v25, {"bf16_tflops": 740.0, "fp8_tflops": 1400.0}) == pytest.approx(50.0)
    assert ceilings.pct_of_ceiling(v25, {"bf16_tflops": 740.0}) is None  # a run that measured no e4m3 GEMM
    assert ceilings.math_name("fp8") == "FP8 (e4m3)"
    gone = {"name": "v99_gone", "kind": "rung", "dtype": "bfloat16"}
    assert ceilings.row_math(gone) == "bf16" and ceilings.row_math({**gone, "dtype": "float32"}) is None
