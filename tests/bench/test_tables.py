"""The tables and plots, from synthetic results."""

import json
from pathlib import Path

import pytest

import kernels
from benchmarks import cases, e2e, features, plots, results, tables
from tests.bench.helpers import (
    RUNGS,
    FakePyplot,
    cells_of,
    e2e_result,
    features_result,
    kernels_result,
    resources_result,
    table_rows,
)


def test_kernels_table_has_setup_convention_and_a_row_per_entry():
    text = tables.render_kernels(json.loads(json.dumps(results.jsonable(kernels_result()))))
    assert "**Fixture GPU** (sm_90, 132 SMs, 80 GiB), driver 580.1 (CUDA 13.0), CUDA runtime 13.0" in text
    assert "CuPy 14.2.0, torch 2.11.0; 2026-01-02 03:04:05 UTC, commit 0123456789ab" in text
    assert "Command: `python3 bench.py kernels`" in text
    assert cases.FLOP_CONVENTION in text and "50.0 TFLOP/s" in text
    assert "**B=1, T=512** (NH=12, d=64, float32, 0.4 GFLOP)" in text
    assert "| kernel | ms | p20-p80 | TFLOP/s | % of ceiling | vs previous | vs SDPA efficient | vs CuPy reference |" in text
    v03 = table_rows(text, "`v03_fast`")
    assert len(v03) == 2  # one per shape
    cells = [c.strip() for c in v03[0].split("|")[1:-1]]
    flops = cases.attention_flops(1, 12, 512, 64)
    assert cells[1] == "1.000" and cells[2] == "0.9800-1.020"
    assert cells[3] == f"{flops / 1e-3 / 1e12:.2f}"  # 0.40 TFLOP/s
    assert cells[5:8] == ["4.00x", "0.50x", "2.00x"]  # previous (v01), SDPA efficient, CuPy reference
    broken = [c.strip() for c in table_rows(text, "`v02_broken`")[0].split("|")[1:-1]]
    assert broken[1] == "**wrong**" and broken[-2] == "5.0e-01" and "bound" in broken[-1]
    assert len(table_rows(text, "SDPA efficient")) == 2


def test_sweep_table_and_image():
    result = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    result["tokens"] = 16384
    text = tables.render_sweep(result, "results/sweep.png")
    assert "![TFLOP/s against sequence length](results/sweep.png)" in text
    assert "| T | B | `v01_naive` | `v02_broken` | `v03_fast` | CuPy reference | SDPA efficient |" in text
    row = [c.strip() for c in table_rows(text, "1024")[0].split("|")[1:-1]]
    flops = cases.attention_flops(16, 12, 1024, 64)
    assert row[:2] == ["1024", "16"]
    assert row[2] == tables.fmt_tflops(flops / (8.0e-3) / 1e12) and row[3] == "wrong"


def test_e2e_table():
    result = e2e_result()
    text = tables.render_e2e([(Path("/r/e2e.json"), result, {"no-cache", "kv-cache"})], Path("/"))
    assert "transformers 5.17.0" in text
    rows = table_rows(text, "`v03_fast`")
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert cells == ["`v03_fast`", "kv-cache", "4.00", "1.0", "1000.00", "600 MiB", "2.00x", "2"]


def test_resources_table_from_nvrtc():
    text = tables.render_resources(resources_result())
    assert "compiled for sm_90 with NVRTC 12.9, no device" in text
    assert len(table_rows(text, f"`{RUNGS[0]}`")) == len(kernels.load(RUNGS[0]).configs)


def test_sweep_plot_draws_each_timed_series_against_T():
    result = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    result["tokens"] = 16384
    plt = FakePyplot()
    assert plots.plot_sweep(plt, result) is plt.figure
    lines = {label: (xs, ys) for xs, ys, label in plt.ax.lines}
    assert set(lines) == {"v01_naive", "v03_fast", "CuPy reference", "SDPA efficient"}  # the wrong rung has no line
    assert plt.ax.title.startswith("causal attention forward, float32") and "/ 2" in plt.ax.ylabel
    for s in result["shapes"] + [r["shape"] for r in result["rows"]]:
        s["causal"] = False
    plots.plot_sweep(plt, result)
    assert plt.ax.title.startswith("non-causal attention forward") and plt.ax.ylabel == "TFLOP/s (non-causal: 4 B NH T^2 d)"
    xs, ys = lines["v03_fast"]
    assert xs == [256, 1024]
    assert ys == [pytest.approx(cases.attention_flops(64, 12, 256, 64) / 1e-3 / 1e12),
                  pytest.approx(cases.attention_flops(16, 12, 1024, 64) / 2e-3 / 1e12)]
    assert plt.ax.hlines == [50.0]


def test_e2e_plot_draws_elapsed_against_tokens():
    plt = FakePyplot()
    plots.plot_e2e(plt, e2e_result(modes=("no-cache",)))
    assert len(plt.axes) == 1  # one panel per mode present
    lines = {label: (xs, ys) for xs, ys, label in plt.ax.lines}
    assert lines["v03_fast"] == ([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])
    assert len(lines) == 3
    plt = FakePyplot()
    plots.plot_e2e(plt, e2e_result())
    assert len(plt.axes) == 2 and all(ax.lines for ax in plt.axes)


def test_plots_are_optional(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    assert plots.plot_or_none(plots.plot_e2e, e2e_result(), tmp_path / "x.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_features_tables_from_a_synthetic_result():
    text = tables.render_features(json.loads(json.dumps(results.jsonable(features_result()))))
    assert "**Fixture GPU** (sm_90, 132 SMs, 80 GiB)" in text and "Command: `python3 bench.py features`" in text
    assert "float32 against SDPA efficient, bfloat16 against SDPA flash, float16 against SDPA flash" in text
    # decode: the target in the header text, met/missed computed per row, graph time beside the kernel time
    assert "Target: kernel time <= 5 us per call." in text
    assert ("| T_k | kernel | kernel us | p20-p80 | us per call in a graph | target <= 5 us | K+V TB/s | vs SDPA "
            "| max error | note |") in text
    v16, v14 = (cells_of(table_rows(text, "1024")[i]) for i in (0, 1))
    assert v16[:7] == ["1024", "`v16_decode_split_kv`", "4.000", "3.900-4.100", "5.500", "met", "1.57"]
    assert v16[7] == "2.50x" and v16[-1] == "d_head=64, splits=6"
    assert v14[2:6] == ["12.00", "mean (records ...)", "13.00", "missed"]
    peer = cells_of(table_rows(text, "1024")[2])
    assert peer[1] == "SDPA efficient" and peer[4:6] == ["n/a", "-"] and peer[-1] == "capture refused"
    # long context: TB/s and % of the copy ceiling measured in the same run, target >= 75%
    assert "(4.25 TB/s, fixture copy)" in text and "Target: at least 75% of the copy ceiling." in text
    long = cells_of(table_rows(text, "bfloat16")[0])
    assert long == ["bfloat16", "`v16_decode_split_kv`", "300.0", "294.0-306.0", "1.00 GiB", "3.58", "84%", "met",
                    "1.20x", "1.0e-07", ""]
    assert cells_of(table_rows(text, "bfloat16")[1])[6:8] == ["70%", "-"]  # no target for the peer
    # the general features: FLOP convention, GFLOP, ratio to the peer, n/a and unsupported rows with reasons
    assert cases.FEATURE_FLOP_CONVENTION in text
    assert f"**Cross lengths**: B=4, NH=12, T_q=256, T_k=4096, d=64, causal, bottom-right " \
           f"({cases.shape_flops(features.FEATURE_CASES['cross'][0]) / 1e9:.1f} GFLOP)" in text
    v13 = cells_of(table_rows(text, "`v13_fa2_partitioning`")[0])
    assert v13[:6] == ["`v13_fa2_partitioning`", "float32", "2.000", "1.960-2.040", tables.fmt_tflops(
        cases.shape_flops(features.FEATURE_CASES["cross"][0]) / 2e-3 / 1e12), "-"]
    na = [cells_of(r) for r in table_rows(text, "SDPA efficient") if "**n/a**" in r][0]
    assert na[2] == "**n/a**" and "causal_lower_right" in na[-1]
    unsupported = cells_of(table_rows(text, "`v12_o_in_registers`")[0])
    assert unsupported[2] == "**unsupported**" and "does not support query length 256" in unsupported[-1]
    assert "**Grouped-query heads**: B=4, NH=32, NH_kv=8, T=2048, d=128, causal" in text
    assert cells_of(table_rows(text, "`v13_fa2_partitioning`")[1])[5] == "0.50x"
    assert "SDPA efficient (float32): K and V repeated to 32 heads for the peer only" in text


def test_features_tables_without_some_parts():
    result = features_result()
    result["cases"] = [c for c in result["cases"] if c["part"] == "gqa"]
    result["rows"] = [r for r in result["rows"] if r["case"] == "gqa-a"]
    text = tables.render_features(result)
    assert "GPT-2 decode" not in text and "Long-context" not in text and "**Grouped-query heads**" in text


def test_decode_figures_and_table():
    """The decode table: time to first token from the first stamp, decode tokens/s over the rest, the
    weights' bandwidth against the ceiling, the target judged for gpt2.fast rows only."""
    rows = [{"dtype": "bfloat16", "step": "persistent", "label": "gpt2.fast, persistent", "status": "ok",
             "elapsed": [0.010, 0.010 + 1 / 8000, 0.010 + 2 / 8000], "note": None},
            {"dtype": "float32", "step": "graphs", "label": "gpt2.fast, graphs", "status": "ok",
             "elapsed": [0.020, 0.020 + 1 / 3000], "note": "programmatic dependent launch on"},
            {"dtype": "float32", "step": "HF generate", "label": "HF transformers (sdpa)", "status": "ok",
             "elapsed": [0.050, 0.055, 0.060], "note": None},
            {"dtype": "bfloat16", "step": "HF generate", "label": "HF transformers (sdpa)", "status": "unavailable",
             "reason": "no bf16 here"}]
    for r in rows[:3]:
        e2e.decode_figures(r, 250_000_000, 4e12)
    fast_bf16, fast_fp32, hf = rows[:3]
    assert fast_bf16["ttft_ms"] == pytest.approx(10.0) and fast_bf16["decode_tokens_per_s"] == pytest.approx(8000)
    assert fast_bf16["weight_tbps"] == pytest.approx(2.0) and fast_bf16["pct_copy"] == pytest.approx(50.0)
    assert fast_bf16["target_met"] is True and fast_fp32["target_met"] is False  # 7000 and 4000 tokens/s
    assert "target_met" not in hf and hf["decode_tokens_per_s"] == pytest.approx(200)
    text = tables.render_decode({"copy_tbps": 4.0, "targets": e2e.DECODE_TARGETS, "steps": e2e.DECODE_STEPS,
                                "rows": rows, "method": "stamps."})
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in table_rows(text, "bfloat16") + table_rows(text, "float32")]
    assert cells[0] == ["bfloat16", "gpt2.fast, persistent", "10.0", "8,000", "125", "2.00 (50%)", "met", ""]
    assert cells[2][3:7] == ["3,000", "333", "0.75 (19%)", "missed"]  # bfloat16 rows first
    assert "**unavailable**" in text and "no bf16 here" in text and "float32 4,000 tokens/s" in text
