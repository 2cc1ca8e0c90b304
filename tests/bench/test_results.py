"""Result files: the setup they carry, their names, strict JSON, which is newest."""

import json
import math
import re

import pytest

from benchmarks import cases, device, results
from tests.bench.helpers import kernels_result


def test_setup_info_without_gpu_names_versions_date_and_command(monkeypatch):
    monkeypatch.setattr(device, "gpu_problem", lambda: "no CUDA device visible")
    setup = device.setup_info(["kernels", "--shape", "8x1024"])
    assert setup["command"] == "python3 bench.py kernels --shape 8x1024"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", setup["date"])
    assert setup["device"] is None
    assert setup["cupy"] and setup["numpy"] and setup["python"]
    assert {"torch", "transformers", "git", "cupy_tf32"} <= set(setup)
    assert setup["cupy_tf32"].startswith("0")


def test_write_result_names_and_strict_json(tmp_path):
    result = kernels_result()
    result["rows"][0]["max_err"] = float("nan")  # strict JSON: NaN and infinity become null
    result["rows"][1]["mean_err"] = math.inf
    path = results.result_path("kernels", result["setup"], tmp_path)
    assert path.name == "kernels-fixture-gpu-20260102T030405Z.json"
    results.write_result(result, path)
    again = results.result_path("kernels", result["setup"], tmp_path)
    assert again.name == "kernels-fixture-gpu-20260102T030405Z-1.json"  # never overwrites
    with pytest.raises(FileExistsError):
        results.write_result(result, path)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["rows"][0]["max_err"] is None and data["rows"][1]["mean_err"] is None
    assert data["schema"] == results.SCHEMA and data["kind"] == "kernels"
    assert data["setup"]["device"]["name"] == "Fixture GPU"
    assert data["setup"]["command"] == "python3 bench.py kernels"
    assert data["flop_convention"] == cases.FLOP_CONVENTION
    ok = data["rows"][2]
    assert ok["name"] == "v03_fast" and ok["status"] == "ok"
    assert ok["tflops"] == pytest.approx(ok["flops"] / (ok["timing"]["median_ms"] * 1e-3) / 1e12)
    assert {"median_ms", "p20_ms", "p80_ms", "min_ms", "max_ms", "runs"} <= set(ok["timing"])


def test_newest_results_orders_by_timestamp(tmp_path):
    names = ["kernels-a-20260102T000000Z.json", "kernels-b-20260103T000000Z.json",
             "kernels-b-20260103T000000Z-1.json", "kernels-a-20251231T235959Z.json",
             "sweep-a-20260101T000000Z.json", "notes.json", "kernels-a-20270101T000000Z.png",
             "kernels-before-after-v99-a-20280101T000000Z.json"]  # a comparison's input, never the newest run
    for n in names:
        (tmp_path / n).write_text("{}")
    found = results.newest_results(tmp_path)
    assert [p.name for p in found["kernels"]] == ["kernels-b-20260103T000000Z-1.json", "kernels-b-20260103T000000Z.json",
                                                  "kernels-a-20260102T000000Z.json", "kernels-a-20251231T235959Z.json"]
    assert [p.name for p in found["sweep"]] == ["sweep-a-20260101T000000Z.json"]
    assert found["e2e"] == [] and found["resources"] == []
    assert results.newest_results(tmp_path / "missing") == {k: [] for k in results.SECTIONS}
