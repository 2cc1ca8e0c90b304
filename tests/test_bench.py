"""bench.py on a machine without a GPU: argument parsing, the FLOP convention, result files, the
README rewrite, tables and plots from synthetic results, resources through NVRTC, and the GPU gate.

Synthetic results are labelled "Fixture GPU": they exercise the code that renders real ones and are
never written under results/."""

import json
import math
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import bench
import kernels

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUNGS = kernels.names()


def run(argv, capsys):
    """bench.main(argv): (exit status, stdout, stderr); argparse's SystemExit becomes a status."""
    try:
        code = bench.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --- argument parsing ----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["kernels"], ["sweep"], ["e2e"], ["resources"], ["features"], ["readme"]])
def test_help_exits_zero_and_describes_options(argv, capsys):
    code, out, _ = run([*argv, "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: bench.py")
    expected = {(): "features", ("kernels",): "--shape", ("sweep",): "--t-max", ("e2e",): "--kv-cache",
                ("resources",): "--arch", ("features",): "--caches", ("readme",): "--readme"}[tuple(argv)]
    assert expected in out


def test_no_subcommand_is_an_error(capsys):
    code, _, err = run([], capsys)
    assert code == 2
    assert "required" in err


@pytest.mark.parametrize("text,expected", [("8x1024", (8, 1024)), ("1X512", (1, 512)), (" 16x2048 ", (16, 2048))])
def test_parse_shape(text, expected):
    assert bench.parse_shape(text) == expected


@pytest.mark.parametrize("bad", ["8x", "x1024", "0x512", "8x0", "8*1024", "8x1024x2", "abc", "-1x5", ""])
def test_bad_shape_strings_are_rejected(bad, capsys):
    with pytest.raises(Exception, match="BxT"):
        bench.parse_shape(bad)
    code, _, err = run(["kernels", f"--shape={bad}"], capsys)
    assert code == 2
    assert "shape must be BxT" in err


@pytest.mark.parametrize("argv,message", [
    (["kernels", "--kernels", "v99"], "unknown kernel 'v99'"),
    (["kernels", "--peers", "sdpa_fast"], "unknown peer(s) sdpa_fast"),
    (["kernels", "--dtype", "int8"], "invalid choice"),
    (["kernels", "--nh", "0"], "positive integer"),
    (["sweep", "--t-min", "100"], "power of two"),
    (["sweep", "--t-min", "4096", "--t-max", "1024"], "larger than --t-max"),
    (["e2e", "--kv-cache", "--no-cache"], "not allowed with"),
    (["resources", "--arch", "hopper"], "sm_90"),
    (["features", "--parts", "prefill"], "unknown part(s) prefill"),
    (["features", "--parts", ","], "unknown part(s)"),
    (["features", "--dtypes", "float32,int8"], "unknown dtype(s) int8"),
    (["features", "--caches", "0"], "positive integer"),
    (["features", "--reps", "-2"], "positive integer"),
    (["features", "--kernels", "v99"], "unknown kernel 'v99'"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err


def test_kernel_and_peer_lists_resolve():
    first = RUNGS[0]
    number = first.split("_")[0]  # v01
    short = "v" + str(int(number[1:]))  # v1
    assert [p.stem for p in bench.kernel_list(f"{short},{first}")] == [first, first]
    assert [p.stem for p in bench.kernel_list("all")] == RUNGS
    assert bench.peer_list("sdpa_efficient, reference") == ["sdpa_efficient", "reference"]
    assert bench.peer_list("none") == []


def test_default_kernels_are_every_whole_sequence_rung(monkeypatch):
    """Decode (split-KV) rungs are timed on whole sequences only when named; resources lists all."""
    seen = {}
    monkeypatch.setitem(bench.COMMANDS, "kernels", lambda args: seen.setdefault("args", args) and 0)
    monkeypatch.setitem(bench.COMMANDS, "resources", lambda args: seen.setdefault("res", args) and 0)
    assert bench.main(["kernels", "--shape", "2x64"]) == 0
    args = seen["args"]
    assert [p.stem for p in args.kernels] == [n for n in RUNGS if not kernels.load(n).split_kv
                                              and "float32" in kernels.load(n).dtypes]
    seen.clear()
    assert bench.main(["kernels", "--dtype", "bfloat16"]) == 0
    bf16 = [p.stem for p in seen["args"].kernels]
    assert bf16 and bf16 == [n for n in RUNGS if not kernels.load(n).split_kv and "bfloat16" in kernels.load(n).dtypes]
    assert bench.main(["resources"]) == 0
    assert [p.stem for p in seen["res"].kernels] == RUNGS
    assert args.shape == [(2, 64)] and args.dtype == "float32" and args.peers is None
    assert args.argv == ["kernels", "--shape", "2x64"]


# --- the FLOP convention --------------------------------------------------------------------


def test_attention_flops_causal_convention():
    # 4 * B * NH * T^2 * d / 2: two T x T x d products (2 T^2 d FLOPs each), half of them masked
    assert bench.attention_flops(1, 12, 512, 64) == 4 * 12 * 512**2 * 64 // 2 == 402_653_184
    assert bench.attention_flops(1, 12, 512, 64, causal=False) == 805_306_368
    base = bench.attention_flops(2, 3, 100, 16)
    assert bench.attention_flops(4, 3, 100, 16) == 2 * base  # linear in B
    assert bench.attention_flops(2, 3, 200, 16) == 4 * base  # quadratic in T
    assert bench.attention_flops(2, 3, 100, 32) == 2 * base  # linear in d
    assert "4 * B * NH * T^2 * d / 2" in bench.FLOP_CONVENTION


@pytest.mark.parametrize("B,T,ms,tflops", [(16, 2048, 3.16, 32.6), (6, 4096, 4.67, 33.1), (1, 8192, 0.27, 383)])
def test_flops_reproduce_the_published_peer_table(B, T, ms, tflops):
    """shared/DEVICE.md's peer table uses the same convention: its ms and TFLOP/s agree through it."""
    assert bench.attention_flops(B, 12, T, 64) / (ms * 1e-3) / 1e12 == pytest.approx(tflops, rel=0.01)


# --- synthetic results, as the subcommands write them ----------------------------------------


def fixture_setup(command="python3 bench.py kernels", date="2026-01-02T03:04:05Z"):
    return {"date": date, "command": command, "git": "0123456789ab", "host": "fixture", "python": "3.12.0",
            "numpy": "2.0", "cupy": "14.2.0", "torch": "2.11.0", "transformers": "5.17.0", "cupy_tf32": "0",
            "device": {"name": "Fixture GPU", "arch": "sm_90", "sm_count": 132, "l2_bytes": 50 * 2**20,
                       "memory_bytes": 80 * 2**30, "driver": "580.1", "driver_cuda": "13.0", "cuda_runtime": "13.0"}}


def timed_row(shape, name, kind, ms, err=1e-7):
    label = bench.PEERS[name].label if kind == "peer" else name
    flops = bench.attention_flops(shape.B, shape.NH, shape.T, shape.d)
    return {"shape": shape.as_dict(), "dtype": "float32", "name": name, "label": label, "kind": kind,
            "status": "ok", "flops": flops, "max_err": err, "bound": 2e-6, "config": "d_head=64, B_r=32, B_c=32",
            "timing": {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "min_ms": ms * 0.9,
                       "max_ms": ms * 1.1, "runs": 50},
            "tflops": flops / (ms * 1e-3) / 1e12, "pct_ffma": 100 * flops / (ms * 1e-3) / 1e12 / 50.0}


def shape_rows(shape, scale=1.0):
    """Three rungs (the middle one wrong), the CuPy reference, SDPA efficient."""
    rows = [timed_row(shape, "v01_naive", "rung", 4.0 * scale),
            {"shape": shape.as_dict(), "dtype": "float32", "name": "v02_broken", "label": "v02_broken",
             "kind": "rung", "status": "wrong", "flops": 0, "max_err": 0.5, "bound": 2e-6,
             "reason": "max error 5.00e-01 > bound 2.00e-06"},
            timed_row(shape, "v03_fast", "rung", 1.0 * scale),
            timed_row(shape, "reference", "peer", 2.0 * scale),
            timed_row(shape, "sdpa_efficient", "peer", 0.5 * scale)]
    bench.add_speedups(rows)
    return rows


def kernels_result(shapes=((1, 512), (8, 1024)), kind="kernels", date="2026-01-02T03:04:05Z"):
    shapes = [bench.Shape(B, T) for B, T in shapes]
    rows = [r for i, s in enumerate(shapes) for r in shape_rows(s, scale=i + 1)]
    return {"schema": bench.SCHEMA, "kind": kind, "setup": fixture_setup(f"python3 bench.py {kind}", date),
            "flop_convention": bench.FLOP_CONVENTION, "method": bench.Method().describe(100 * 2**20),
            "ceilings": {"ffma_tflops": 50.0, "ffma_what": "fixture", "copy_tbps": 3.0, "copy_what": "fixture"},
            "dtype": "float32", "shapes": [s.as_dict() for s in shapes],
            "kernels": ["v01_naive", "v02_broken", "v03_fast"], "peers": ["reference", "sdpa_efficient"],
            "compare_to": list(bench.COMPARE_TO["float32"]), "seed": 0, "rows": rows}


def e2e_result(modes=("no-cache", "kv-cache"), date="2026-01-02T03:04:05Z"):
    rows = []
    for mode in modes:
        for name, label, kind, seconds, tokens in [("reference", "CuPy reference", "peer", 8.0, [1, 2, 3, 4]),
                                                   ("v03_fast", "v03_fast", "rung", 4.0, [1, 2, 9, 4]),
                                                   ("hf", "HF transformers (sdpa)", "peer", 5.0, [1, 2, 3, 4])]:
            rows.append({"name": name, "label": label, "kind": kind, "mode": mode, "kv_cache": mode == "kv-cache",
                         "status": "ok", "seconds": seconds, "tokens": tokens, "peak_bytes": 600 * 2**20,
                         "elapsed": [seconds * (i + 1) / len(tokens) for i in range(len(tokens))]})
    bench.add_generation_comparisons(rows)
    return {"schema": bench.SCHEMA, "kind": "e2e", "setup": fixture_setup("python3 bench.py e2e", date),
            "model": "random gpt2 (seed 0)", "prompt": bench.PROMPT, "prompt_tokens": 8, "new_tokens": 4,
            "sampling": "greedy", "dtype": "float32", "modes": list(modes),
            "method": {"no-cache": "whole sequence", "kv-cache": "prefill then decode", "hf": "generate"},
            "rows": rows, "plot": None}


def resources_result():
    rows = [r.as_dict() for r in kernels.compile_report(RUNGS[0], "sm_90")]
    setup = fixture_setup("python3 bench.py resources --arch sm_90") | {"device": None}  # compiled, no device
    return {"schema": bench.SCHEMA, "kind": "resources", "setup": setup,
            "nvrtc": "12.9", "arch": "sm_90", "on_device": False, "kernels": RUNGS[:1], "rows": rows}


def test_speedups_against_previous_rung_and_peers():
    rows = shape_rows(bench.Shape(1, 512))
    by = {r["name"]: r for r in rows}
    assert "previous" not in by["v01_naive"]["speedup"]
    assert by["v02_broken"]["speedup"] == {}  # wrong: not timed, no ratios
    assert by["v03_fast"]["speedup"]["previous"] == pytest.approx(4.0)  # against v01: the wrong v02 is skipped
    assert by["v03_fast"]["speedup"]["reference"] == pytest.approx(2.0)
    assert by["v03_fast"]["speedup"]["sdpa_efficient"] == pytest.approx(0.5)
    assert by["v01_naive"]["speedup"]["sdpa_efficient"] == pytest.approx(0.125)
    assert "reference" not in by["reference"]["speedup"]


def test_generation_comparisons():
    rows = e2e_result()["rows"]
    fast = next(r for r in rows if r["name"] == "v03_fast" and r["mode"] == "kv-cache")
    hf = next(r for r in rows if r["name"] == "hf" and r["mode"] == "no-cache")
    assert fast["speedup_vs_reference"] == pytest.approx(2.0)
    assert fast["tokens_per_s"] == pytest.approx(1.0) and fast["ms_per_token"] == pytest.approx(1000.0)
    assert fast["same_tokens_as_reference"] == 2  # diverges at the third token
    assert hf["same_tokens_as_reference"] == 4


# --- result files ----------------------------------------------------------------------------


def test_setup_info_without_gpu_names_versions_date_and_command(monkeypatch):
    monkeypatch.setattr(bench, "gpu_problem", lambda: "no CUDA device visible")
    setup = bench.setup_info(["kernels", "--shape", "8x1024"])
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
    path = bench.result_path("kernels", result["setup"], tmp_path)
    assert path.name == "kernels-fixture-gpu-20260102T030405Z.json"
    bench.write_result(result, path)
    again = bench.result_path("kernels", result["setup"], tmp_path)
    assert again.name == "kernels-fixture-gpu-20260102T030405Z-1.json"  # never overwrites
    with pytest.raises(FileExistsError):
        bench.write_result(result, path)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["rows"][0]["max_err"] is None and data["rows"][1]["mean_err"] is None
    assert data["schema"] == bench.SCHEMA and data["kind"] == "kernels"
    assert data["setup"]["device"]["name"] == "Fixture GPU"
    assert data["setup"]["command"] == "python3 bench.py kernels"
    assert data["flop_convention"] == bench.FLOP_CONVENTION
    ok = data["rows"][2]
    assert ok["name"] == "v03_fast" and ok["status"] == "ok"
    assert ok["tflops"] == pytest.approx(ok["flops"] / (ok["timing"]["median_ms"] * 1e-3) / 1e12)
    assert {"median_ms", "p20_ms", "p80_ms", "min_ms", "max_ms", "runs"} <= set(ok["timing"])


def test_newest_results_orders_by_timestamp(tmp_path):
    names = ["kernels-a-20260102T000000Z.json", "kernels-b-20260103T000000Z.json",
             "kernels-b-20260103T000000Z-1.json", "kernels-a-20251231T235959Z.json",
             "sweep-a-20260101T000000Z.json", "notes.json", "kernels-a-20270101T000000Z.png"]
    for n in names:
        (tmp_path / n).write_text("{}")
    found = bench.newest_results(tmp_path)
    assert [p.name for p in found["kernels"]] == ["kernels-b-20260103T000000Z-1.json", "kernels-b-20260103T000000Z.json",
                                                  "kernels-a-20260102T000000Z.json", "kernels-a-20251231T235959Z.json"]
    assert [p.name for p in found["sweep"]] == ["sweep-a-20260101T000000Z.json"]
    assert found["e2e"] == [] and found["resources"] == []
    assert bench.newest_results(tmp_path / "missing") == {k: [] for k in bench.SECTIONS}


# --- tables ----------------------------------------------------------------------------------


def table_rows(text, first_cell):
    return [line for line in text.splitlines() if line.startswith(f"| {first_cell} ")]


def test_kernels_table_has_setup_convention_and_a_row_per_entry():
    text = bench.render_kernels(json.loads(json.dumps(bench._jsonable(kernels_result()))))
    assert "**Fixture GPU** (sm_90, 132 SMs, 80 GiB), driver 580.1 (CUDA 13.0), CUDA runtime 13.0" in text
    assert "CuPy 14.2.0, torch 2.11.0; 2026-01-02 03:04:05 UTC, commit 0123456789ab" in text
    assert "Command: `python3 bench.py kernels`" in text
    assert bench.FLOP_CONVENTION in text and "50.0 TFLOP/s" in text
    assert "**B=1, T=512** (NH=12, d=64, float32, 0.4 GFLOP)" in text
    assert "| kernel | ms | p20-p80 | TFLOP/s | % FFMA | vs previous | vs SDPA efficient | vs CuPy reference |" in text
    v03 = table_rows(text, "`v03_fast`")
    assert len(v03) == 2  # one per shape
    cells = [c.strip() for c in v03[0].split("|")[1:-1]]
    flops = bench.attention_flops(1, 12, 512, 64)
    assert cells[1] == "1.000" and cells[2] == "0.9800-1.020"
    assert cells[3] == f"{flops / 1e-3 / 1e12:.2f}"  # 0.40 TFLOP/s
    assert cells[5:8] == ["4.00x", "0.50x", "2.00x"]  # previous (v01), SDPA efficient, CuPy reference
    broken = [c.strip() for c in table_rows(text, "`v02_broken`")[0].split("|")[1:-1]]
    assert broken[1] == "**wrong**" and broken[-2] == "5.0e-01" and "bound" in broken[-1]
    assert len(table_rows(text, "SDPA efficient")) == 2


def test_sweep_table_and_image():
    result = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    result["tokens"] = 16384
    text = bench.render_sweep(result, "results/sweep.png")
    assert "![TFLOP/s against sequence length](results/sweep.png)" in text
    assert "| T | B | `v01_naive` | `v02_broken` | `v03_fast` | CuPy reference | SDPA efficient |" in text
    row = [c.strip() for c in table_rows(text, "1024")[0].split("|")[1:-1]]
    flops = bench.attention_flops(16, 12, 1024, 64)
    assert row[:2] == ["1024", "16"]
    assert row[2] == bench._tflops(flops / (8.0e-3) / 1e12) and row[3] == "wrong"


def test_e2e_table():
    result = e2e_result()
    text = bench.render_e2e([(Path("/r/e2e.json"), result, {"no-cache", "kv-cache"})], Path("/"))
    assert "transformers 5.17.0" in text
    rows = table_rows(text, "`v03_fast`")
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert cells == ["`v03_fast`", "kv-cache", "4.00", "1.0", "1000.00", "600 MiB", "2.00x", "2"]


def test_resources_table_from_nvrtc():
    text = bench.render_resources(resources_result())
    assert "compiled for sm_90 with NVRTC 12.9, no device" in text
    assert len(table_rows(text, f"`{RUNGS[0]}`")) == len(kernels.load(RUNGS[0]).configs)


class FakeAxes:
    def __init__(self):
        self.lines, self.hlines = [], []

    def plot(self, xs, ys, **kw):
        self.lines.append((list(xs), list(ys), kw.get("label")))

    def axhline(self, y, **kw):
        self.hlines.append(y)

    def __getattr__(self, name):  # labels, scales, grid, legend
        return lambda *a, **k: None


class FakeFigure:
    def __getattr__(self, name):  # suptitle
        return lambda *a, **k: None


class FakePyplot:
    def subplots(self, rows=1, cols=1, **kw):
        self.axes = [FakeAxes() for _ in range(rows * cols)]
        self.ax = self.axes[0]
        self.figure = FakeFigure()
        if kw.get("squeeze", True) and rows * cols == 1:
            return self.figure, self.ax
        return self.figure, [self.axes[r * cols:(r + 1) * cols] for r in range(rows)]

    def get_cmap(self, name):
        return lambda i: (name, i)


def test_sweep_plot_draws_each_timed_series_against_T():
    result = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    result["tokens"] = 16384
    plt = FakePyplot()
    assert bench.plot_sweep(plt, result) is plt.figure
    lines = {label: (xs, ys) for xs, ys, label in plt.ax.lines}
    assert set(lines) == {"v01_naive", "v03_fast", "CuPy reference", "SDPA efficient"}  # the wrong rung has no line
    xs, ys = lines["v03_fast"]
    assert xs == [256, 1024]
    assert ys == [pytest.approx(bench.attention_flops(64, 12, 256, 64) / 1e-3 / 1e12),
                  pytest.approx(bench.attention_flops(16, 12, 1024, 64) / 2e-3 / 1e12)]
    assert plt.ax.hlines == [50.0]


def test_e2e_plot_draws_elapsed_against_tokens():
    plt = FakePyplot()
    bench.plot_e2e(plt, e2e_result(modes=("no-cache",)))
    assert len(plt.axes) == 1  # one panel per mode present
    lines = {label: (xs, ys) for xs, ys, label in plt.ax.lines}
    assert lines["v03_fast"] == ([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])
    assert len(lines) == 3
    plt = FakePyplot()
    bench.plot_e2e(plt, e2e_result())
    assert len(plt.axes) == 2 and all(ax.lines for ax in plt.axes)


def test_plots_are_optional(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "_pyplot", lambda: None)
    assert bench.plot_or_none(bench.plot_e2e, e2e_result(), tmp_path / "x.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


# --- the README rewrite ----------------------------------------------------------------------


def outside_markers(text):
    """The README with everything between each start and end marker removed."""
    return re.sub(r"(<!-- bench:(\w+):start -->).*?(<!-- bench:\2:end -->)", r"\1\3", text, flags=re.S)


@pytest.fixture
def readme_and_results(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    results = tmp_path / "results"
    old = kernels_result(shapes=((1, 512),), date="2025-12-01T00:00:00Z")
    old["setup"]["device"]["name"] = "Older GPU"
    for result in (old, kernels_result()):
        bench.write_result(result, bench.result_path("kernels", result["setup"], results))
    sweep = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    sweep |= {"tokens": 16384, "plot": "sweep-fixture-gpu-20260102T030405Z.png"}
    bench.write_result(sweep, bench.result_path("sweep", sweep["setup"], results))
    both = e2e_result(date="2026-01-01T00:00:00Z")
    newer_kv = e2e_result(modes=("kv-cache",), date="2026-01-05T00:00:00Z")
    for result in (both, newer_kv):
        bench.write_result(result, bench.result_path("e2e", result["setup"], results))
    res = resources_result()
    bench.write_result(res, bench.result_path("resources", res["setup"], results, "sm_90-nvrtc"))
    return readme, results


def test_readme_rewrites_only_between_markers(readme_and_results, capsys):
    readme, results = readme_and_results
    before = readme.read_text()
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results)], capsys)
    assert code == 0
    after = readme.read_text()
    assert outside_markers(after) == outside_markers(before)  # not a byte changed outside the markers
    assert after.endswith("without a trailing newline.")
    assert "stale kernels table" not in after and "stale resources table" not in after
    sections = {m[0]: m[1] for m in re.findall(r"<!-- bench:(\w+):start -->(.*?)<!-- bench:\1:end -->", after, re.S)}
    assert "from `results/kernels-fixture-gpu-20260102T030405Z.json`" in sections["kernels"]  # the newest
    assert "Fixture GPU" in sections["kernels"] and "Older GPU" not in sections["kernels"]
    assert "**B=8, T=1024**" in sections["kernels"]
    assert "![TFLOP/s against sequence length](results/sweep-fixture-gpu-20260102T030405Z.png)" in sections["sweep"]
    # e2e: the newest file for each mode: kv-cache from 2026-01-05, no-cache from 2026-01-01
    assert "e2e-fixture-gpu-20260105T000000Z.json" in sections["e2e"]
    assert "e2e-fixture-gpu-20260101T000000Z.json" in sections["e2e"]
    assert sections["e2e"].count("| `v03_fast` | kv-cache |") == 1
    assert sections["e2e"].count("| `v03_fast` | no-cache |") == 1
    assert "registers" in sections["resources"]
    assert "rewrote" in out
    # Once more: nothing to change.
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results)], capsys)
    assert code == 0 and readme.read_text() == after and "already current" in out


def test_readme_without_markers_exits_2_and_changes_nothing(tmp_path, readme_and_results, capsys):
    _, results = readme_and_results
    readme = tmp_path / "PLAIN.md"
    readme.write_text("# No markers here\n\nbench:kernels:start is not a marker\n")
    before = readme.read_text()
    code, _, err = run(["readme", "--readme", str(readme), "--results", str(results)], capsys)
    assert code == 2
    assert "has no bench markers" in err and len(err.strip().splitlines()) == 1
    assert readme.read_text() == before


@pytest.mark.parametrize("text,message", [
    ("<!-- bench:kernels:start -->\n", "bench:kernels:end --> is missing"),
    ("<!-- bench:kernels:end -->\n<!-- bench:kernels:start -->\n", "comes before its start"),
    ("<!-- bench:kernels:start -->\n<!-- bench:kernels:start -->\n<!-- bench:kernels:end -->\n", "appears twice"),
    ("<!-- bench:speed:start -->\n<!-- bench:speed:end -->\n", "unknown section 'speed'"),
    ("<!-- bench:kernels:start -->\n<!-- bench:sweep:start -->\n<!-- bench:kernels:end -->\n"
     "<!-- bench:sweep:end -->\n", "starts inside section kernels"),
])
def test_readme_with_malformed_markers_exits_2_and_changes_nothing(tmp_path, text, message, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    code, _, err = run(["readme", "--readme", str(readme), "--results", str(tmp_path)], capsys)
    assert code == 2 and message in err
    assert readme.read_text() == text


def test_readme_keeps_sections_without_results(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    before = readme.read_text()
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(tmp_path / "empty")], capsys)
    assert code == 0 and readme.read_text() == before
    assert "no kernels results" in out


# --- subcommands on this machine --------------------------------------------------------------


def test_resources_for_sm90_through_nvrtc_without_a_gpu(tmp_path, capsys):
    code, out, _ = run(["resources", "--arch", "sm_90", "--results", str(tmp_path)], capsys)
    assert code == 0
    (path,) = tmp_path.glob("resources-sm-90-nvrtc-*.json")
    data = json.loads(path.read_text())
    assert data["arch"] == "sm_90" and data["on_device"] is False and data["setup"]["device"] is None
    expected = [(name, c) for name in RUNGS for c in kernels.load(name).configs]
    assert [(r["kernel"], tuple(r["config"].values())) for r in data["rows"]] == expected
    for r in data["rows"]:
        assert 0 < r["registers"] <= 255
        assert r["blocks_per_sm"] is None  # no device to ask
        assert r["dynamic_smem"] == kernels.load(r["kernel"]).shared_bytes(tuple(r["config"].values()))
    assert f"wrote {path}" in out and "| kernel | config | threads | registers |" in out


@pytest.mark.parametrize("command", [["kernels"], ["sweep", "--t-max", "256"], ["e2e", "--tokens", "4"],
                                     ["features", "--parts", "decode"]])
def test_gpu_subcommands_exit_2_with_one_line_without_a_gpu(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "gpu_problem", lambda: "no CUDA device visible")
    code, out, err = run([*command, "--results", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"bench.py: {command[0]}: needs a CUDA GPU, and none is usable here (no CUDA device visible); "
        "run it on the GPU machine"]
    assert out == "" and list(tmp_path.iterdir()) == []


def test_e2e_without_the_gpt2_package_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "gpt2", None)  # import gpt2 raises ImportError
    code, _, err = run(["e2e", "--results", str(tmp_path)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "needs the GPT-2 package gpt2/" in err


def test_gpt2_seam_offers_what_e2e_calls():
    gpt2 = bench.gpt2_seam()
    for name in ("random_weights", "load_tokenizer", "generate", "save"):
        assert callable(getattr(gpt2, name))


# --- the GPU paths' control flow, with NumPy standing in for CuPy -----------------------------
#
# No GPU here, so these run kernels/sweep/e2e end to end with a stand-in for CuPy made of NumPy
# and a host clock for its events, and stand-in rungs: one right, one slightly wrong, one that
# leaves rows unwritten, one that refuses the inputs. What they check is bench.py's own logic:
# poisoning, the gate, what gets timed, the rows, the result file and the tables.


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class FakeEvent:
    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class FakePool:
    def free_all_blocks(self):
        pass

    def free_bytes(self):
        return 0

    def total_bytes(self):
        return 123 * 2**20


def fake_cupy():
    stream = FakeStream()
    cuda = SimpleNamespace(Event=FakeEvent, get_elapsed_time=lambda s, e: (e.t - s.t) * 1e3,
                           get_current_stream=lambda: stream, Device=lambda: SimpleNamespace(synchronize=lambda: None),
                           runtime=SimpleNamespace(memGetInfo=lambda: (64 * 2**30, 80 * 2**30)))
    pool = FakePool()
    return SimpleNamespace(ndarray=np.ndarray, float16=np.float16, float32=np.float32, float64=np.float64,
                           uint8=np.uint8, uint32=np.uint32, abs=np.abs, isfinite=np.isfinite, empty=np.empty,
                           zeros=np.zeros, ones=np.ones, random=SimpleNamespace(default_rng=np.random.default_rng),
                           get_default_memory_pool=lambda: pool, cuda=cuda)


def fake_prepare(q, k, v, *, kernel, causal=True):
    """Stand-in rungs, chosen by file name: good, noisy (error 1e-3), lazy (second half unwritten), picky."""
    name = Path(kernel).stem
    if name.endswith("picky"):
        raise TypeError(f"kernel {name} supports float16 only")
    out = np.empty(q.shape, dtype=np.float32)

    def run():
        ref = kernels.reference_attention(q, k, v)
        if name.endswith("noisy"):
            ref = ref + np.float32(1e-3)
        if name.endswith("lazy"):
            out[:, :, : q.shape[2] // 2] = ref[:, :, : q.shape[2] // 2]
        else:
            out[...] = ref
        return out

    run.instance = SimpleNamespace(describe=lambda: "stand-in")
    return run


class StandInFlush:
    nbytes = 2**21

    def __call__(self):
        pass


FAKE_DEVICE = {"name": "Stand-in GPU", "arch": "sm_90", "sm_count": 132, "l2_bytes": 2**20,
               "memory_bytes": 80 * 2**30, "driver": "0", "driver_cuda": "13.0", "cuda_runtime": "13.0"}


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """bench.py with NumPy for CuPy, no torch, and four stand-in rung files."""
    monkeypatch.setattr(bench, "_cupy", fake_cupy)
    monkeypatch.setattr(bench, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench, "device_info", lambda: dict(FAKE_DEVICE))
    monkeypatch.setattr(bench, "measure_ceilings", lambda method: {
        "ffma_tflops": 50.0, "ffma_what": "stand-in", "copy_tbps": 3.0, "copy_what": "stand-in"})
    monkeypatch.setattr(bench, "L2Flush", StandInFlush)
    monkeypatch.setattr(bench, "_torch", lambda: (_ for _ in ()).throw(bench.Unavailable("torch is not importable")))
    monkeypatch.setattr(kernels, "prepare", fake_prepare)
    rung_dir = tmp_path / "rungs"
    rung_dir.mkdir()
    paths = []
    for name in ("v01_good", "v02_noisy", "v03_lazy", "v04_picky"):
        (rung_dir / f"{name}.cu").write_text("// stand-in\n")
        paths.append(str(rung_dir / f"{name}.cu"))
    return paths


def test_bench_shape_checks_before_timing(stand_in, capsys):
    shape = bench.Shape(2, 37, NH=3, d=16)
    method = bench.Method(budget_ms=1.0, min_runs=3, max_runs=3, warmup=1)
    rows = bench.bench_shape(shape, "float32", [Path(p) for p in stand_in], ["reference", "sdpa_efficient"],
                             flush=bench.no_flush, method=method, ffma_tflops=50.0, seed=0, counter=[0], total=6)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["v01_good", "v02_noisy", "v03_lazy", "v04_picky", "reference",
                                         "sdpa_efficient"]
    good = by["v01_good"]
    assert good["status"] == "ok" and good["timing"]["runs"] == 3 and good["config"] == "stand-in"
    assert good["max_err"] <= good["bound"] == pytest.approx(8 * max(good["plain32_err"], good["bound"] / 8))
    assert good["tflops"] == pytest.approx(good["flops"] / (good["timing"]["median_ms"] * 1e-3) / 1e12)
    assert good["flops"] == bench.attention_flops(2, 3, 37, 16)
    noisy = by["v02_noisy"]
    assert noisy["status"] == "wrong" and "timing" not in noisy
    assert noisy["max_err"] == pytest.approx(1e-3, rel=0.01) and "> bound" in noisy["reason"]
    lazy = by["v03_lazy"]
    assert lazy["status"] == "wrong" and lazy["nonfinite"] == 2 * 3 * (37 - 18) * 16  # the poison stayed
    assert "unwritten" in lazy["reason"] and "timing" not in lazy
    assert by["v04_picky"]["status"] == "unsupported" and "float16 only" in by["v04_picky"]["reason"]
    assert by["reference"]["status"] == "ok" and by["reference"]["kind"] == "peer"
    assert by["sdpa_efficient"]["status"] == "unavailable" and "torch" in by["sdpa_efficient"]["reason"]
    assert good["speedup"]["reference"] == pytest.approx(
        by["reference"]["timing"]["median_ms"] / good["timing"]["median_ms"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 6 and lines[0].startswith("[  1/6]") and "wrong" in lines[1]


def test_kernels_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, capsys):
    code, out, err = run(["kernels", "--kernels", ",".join(stand_in[:2]), "--shape", "1x40", "--shape", "2x17",
                          "--nh", "2", "--d", "8", "--budget-ms", "1", "--results", str(tmp_path / "out")], capsys)
    assert code == 0, err
    (path,) = (tmp_path / "out").glob("kernels-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "kernels" and data["setup"]["device"]["name"] == "Stand-in GPU"
    assert data["setup"]["command"].startswith("python3 bench.py kernels --kernels")
    assert data["shapes"] == [{"B": 1, "T": 40, "NH": 2, "d": 8}, {"B": 2, "T": 17, "NH": 2, "d": 8}]
    assert [(r["name"], r["status"]) for r in data["rows"]][:5] == [
        ("v01_good", "ok"), ("v02_noisy", "wrong"), ("reference", "ok"), ("sdpa_math", "unavailable"),
        ("sdpa_efficient", "unavailable")]
    assert "**B=2, T=17** (NH=2, d=8, float32" in out and f"wrote {path}" in out


def test_sweep_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_pyplot", FakePyplot)  # a stand-in matplotlib: no file, but the call is made
    saved = []
    monkeypatch.setattr(bench, "plot_or_none", lambda plot, result, path: saved.append(path) or path.name)
    code, out, err = run(["sweep", "--kernels", stand_in[0], "--peers", "reference", "--t-min", "16", "--t-max",
                          "64", "--tokens", "128", "--nh", "2", "--d", "8", "--budget-ms", "1", "--results",
                          str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("sweep-*.json")
    data = json.loads(path.read_text())
    assert [(s["B"], s["T"]) for s in data["shapes"]] == [(8, 16), (4, 32), (2, 64)]
    assert data["tokens"] == 128 and data["plot"] == path.with_suffix(".png").name == saved[0].name
    assert all(r["status"] == "ok" for r in data["rows"])
    assert "| T | B | `v01_good` | CuPy reference |" in out


def test_e2e_subcommand_end_to_end_with_stand_ins(stand_in, tmp_path, monkeypatch, capsys):
    import gpt2

    tiny = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=64)
    real_random = gpt2.random_weights
    monkeypatch.setattr(gpt2, "random_weights", lambda size, seed, xp: real_random(tiny, seed=seed, xp=np))
    monkeypatch.setattr(kernels, "Attend", lambda path: lambda q, k, v: kernels.reference_attention(q, k, v))
    monkeypatch.setattr(bench, "plot_or_none", lambda plot, result, path: None)
    code, out, err = run(["e2e", "--kernels", stand_in[0], "--tokens", "5", "--warmup", "2", "--no-hf",
                          "--no-decode", "--results", str(tmp_path)], capsys)  # the decode table needs the GPU
    assert code == 0, err
    (path,) = tmp_path.glob("e2e-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["modes"] == ["no-cache", "kv-cache"] and data["prompt"] == bench.PROMPT and data["decode"] is None
    assert data["prompt_tokens"] == 8  # "Hello, I'm a language model," in GPT-2's BPE
    rows = {(r["name"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {("reference", "no-cache"), ("v01_good", "no-cache"), ("reference", "kv-cache"),
                         ("v01_good", "kv-cache")}
    for r in rows.values():
        assert r["status"] == "ok" and len(r["tokens"]) == 5 and len(r["elapsed"]) == 5
        assert r["elapsed"] == sorted(r["elapsed"]) and r["elapsed"][-1] <= r["seconds"]
        assert r["same_tokens_as_reference"] == 5  # the stand-in rung is the reference
    assert "| `v01_good` | kv-cache |" in out


# --- features: decode, long context, non-causal, cross lengths, GQA, head sizes ---------------------


def test_features_arguments_and_defaults(monkeypatch):
    seen = {}
    monkeypatch.setitem(bench.COMMANDS, "features", lambda args: seen.setdefault("args", args) and 0)
    assert bench.main(["features"]) == 0
    args = seen.pop("args")
    assert args.parts == list(bench.FEATURE_PARTS) == ["decode", "long", "noncausal", "cross", "gqa", "heads"]
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.kernels is None  # features picks rungs per case, not the kernels subcommand's default
    assert (args.caches, args.reps, args.budget_ms, args.seed) == (24, 10, 100.0, 0)
    assert args.results == bench.RESULTS
    assert bench.main(["features", "--parts", "gqa,decode,gqa", "--dtypes", "bfloat16", "--kernels", "v13,v16",
                       "--caches", "3", "--reps", "2", "--budget-ms", "5"]) == 0
    args = seen.pop("args")
    assert args.parts == ["gqa", "decode"] and args.dtypes == ["bfloat16"]
    assert [p.stem for p in args.kernels] == [kernels.resolve("v13").stem, kernels.resolve("v16").stem]
    assert (args.caches, args.reps, args.budget_ms) == (3, 2, 5.0)
    assert bench.part_list("all") == list(bench.FEATURE_PARTS)


def brute_force_pairs(T_q, T_k, causal):
    """(query, key) pairs counted one by one, with the reference's own mask (bottom-right)."""
    from kernels.reference import causal_mask

    if not causal:
        return sum(1 for _ in range(T_q) for _ in range(T_k))
    mask = causal_mask(np, T_q, T_k)
    return sum(1 for i in range(T_q) for j in range(T_k) if mask[i, j])


@pytest.mark.parametrize("T_q,T_k", [(1, 1), (1, 7), (3, 3), (5, 17), (16, 16), (7, 2), (17, 5), (256, 300), (9, 1)])
def test_visible_pairs_by_brute_force(T_q, T_k):
    assert bench.visible_pairs(T_q, T_k, causal=False) == brute_force_pairs(T_q, T_k, False) == T_q * T_k
    assert bench.visible_pairs(T_q, T_k, causal=True) == brute_force_pairs(T_q, T_k, True)


def test_feature_flops_conventions():
    B, NH, d = 2, 3, 16
    # non-causal: every T_q x T_k pair, 4 * d FLOPs each (two products of 2 * d)
    assert bench.attention_flops_qk(B, NH, 5, 17, d, causal=False) == 4 * B * NH * 5 * 17 * d
    assert bench.attention_flops_qk(B, NH, 64, 64, d, causal=False) == bench.attention_flops(B, NH, 64, d, causal=False)
    # causal with T_q != T_k: the pairs the bottom-right mask lets through, exactly
    for T_q, T_k in [(5, 17), (17, 5), (1, 9), (256, 4096)]:
        assert bench.attention_flops_qk(B, NH, T_q, T_k, d) == 4 * B * NH * brute_force_pairs(T_q, T_k, True) * d
    assert bench.visible_pairs(256, 4096) == 256 * 4096 - 256 * 255 // 2 == 1_015_936
    # causal self-attention keeps the kernels table's T^2 / 2, not the exact T (T + 1) / 2
    assert bench.attention_flops_qk(B, NH, 64, 64, d) == bench.attention_flops(B, NH, 64, d) == 4 * B * NH * 64**2 * d // 2
    # grouped-query heads: every query head does the arithmetic, whatever NH_kv is
    gqa = bench.Case("gqa", 4, 32, 8, 2048, 2048, 128)
    assert bench.shape_flops(gqa) == bench.attention_flops(4, 32, 2048, 128)
    assert bench.shape_flops(bench.Shape(8, 1024)) == bench.attention_flops(8, 12, 1024, 64)
    for words in ("T_q * T_k", "T^2 / 2", "bottom-right", "4 * d"):
        assert words in bench.FEATURE_FLOP_CONVENTION


def test_cases_name_the_features_they_need():
    cases = {c.part: c for part in bench.FEATURE_CASES.values() for c in part}
    assert cases["noncausal"].needs() == {"noncausal"}
    assert cases["cross"].needs() == {"cross"} and (cases["cross"].T_q, cases["cross"].T_k) == (256, 4096)
    assert cases["gqa"].needs() == {"gqa"} and (cases["gqa"].NH, cases["gqa"].NH_kv) == (32, 8)
    assert cases["long"].needs() == {"cross"}
    assert [c.T_k for c in bench.FEATURE_CASES["decode"]] == [1, 128, 512, 1024]
    assert bench.FEATURE_CASES["decode"][0].needs() == set()  # T_q = T_k = 1
    assert [c.d for c in bench.FEATURE_CASES["heads"]] == [32, 64, 96, 128]
    assert cases["cross"].describe() == "B=4, NH=12, T_q=256, T_k=4096, d=64, causal, bottom-right"
    assert cases["gqa"].describe() == "B=4, NH=32, NH_kv=8, T=2048, d=128, causal"


def test_sdpa_mask_matches_the_rungs_mask():
    case = bench.FEATURE_CASES
    assert bench.sdpa_mask(case["noncausal"][0]) == "none"
    assert bench.sdpa_mask(case["gqa"][0]) == "is_causal"  # T_q == T_k: top-left and bottom-right agree
    assert bench.sdpa_mask(case["cross"][0]) == "lower_right"
    assert bench.sdpa_mask(case["decode"][0]) == "is_causal"  # 1 x 1
    assert bench.sdpa_mask(case["decode"][2]) == "none"  # one query row sees every key
    assert bench.sdpa_mask(bench.Shape(2, 64)) == "is_causal"
    assert bench.sdpa_mask(bench.Case("cross", 1, 2, 2, 9, 3, 32)) == "lower_right"


def test_feature_plan_follows_declarations():
    rungs = bench.default_feature_rungs()
    assert rungs and all(kernels.load(p).supports or kernels.load(p).split_kv for p in rungs)
    plan = bench.feature_plan(list(bench.FEATURE_PARTS), ["float32", "bfloat16"], rungs, named=False)
    assert [e["case"].part for e in plan] == sorted((e["case"].part for e in plan), key=bench.FEATURE_PARTS.index)
    assert len({e["id"] for e in plan}) == len(plan)
    for e in plan:
        case, dtype = e["case"], e["dtype"]
        assert e["peer"] == ("sdpa_efficient" if dtype == "float32" else "sdpa_flash")
        loaded = {p.stem: kernels.load(p) for p in e["rungs"]}
        assert all(bench.declares(r, case, dtype) for r in loaded.values())
        taking = [p.stem for p in rungs if bench.declares(kernels.load(p), case, dtype)]
        if case.part == "decode":  # every split-KV rung, and the newest other rung as context
            others = [n for n in taking if not kernels.load(n).split_kv]
            assert list(loaded) == [n for n in taking if kernels.load(n).split_kv or n == others[-1]]
            assert sum(not r.split_kv for r in loaded.values()) == 1
        elif case.part == "long":
            assert list(loaded) == [n for n in taking if kernels.load(n).split_kv]
        else:
            assert list(loaded) == taking
    long_dtypes = [e["dtype"] for e in plan if e["case"].part == "long"]
    assert long_dtypes[0] == "bfloat16" and set(long_dtypes) <= set(bench.LONG_DTYPES)
    declared = {t for p in rungs if kernels.load(p).split_kv for t in kernels.load(p).dtypes}
    assert set(long_dtypes) == {"bfloat16"} | (declared & set(bench.LONG_DTYPES))
    # named rungs run in every case, declared or not: those that do not take it are reported unsupported
    named = [kernels.resolve("v12"), kernels.resolve("v13")]
    plan = bench.feature_plan(["noncausal", "long"], ["float32"], named, named=True)
    assert all([p.stem for p in e["rungs"]] == [p.stem for p in named] for e in plan)
    assert {e["dtype"] for e in plan if e["case"].part == "long"} == {"bfloat16", "float32"}


def test_per_call_us_groups_kernels_into_calls():
    one = [(float(i), 2.0 + (i % 3), "attention_forward<64, 8, 64, 0>") for i in range(12)]
    t = bench.per_call_us(one[::-1], calls=12)  # any order: sorted by start
    assert t["kernels_per_call"] == 1 and t["statistic"] == "median" and t["us"] == pytest.approx(3.0)
    assert (t["min_us"], t["max_us"]) == (2.0, 4.0) and t["calls"] == 12
    two = [(10.0 * c + 0, 3.0, "flash_fwd_splitkv_kernel") for c in range(5)] + \
          [(10.0 * c + 5, 1.0, "flash_fwd_splitkv_combine_kernel") for c in range(5)]
    t = bench.per_call_us(two, calls=5)
    assert t["kernels_per_call"] == 2 and t["us"] == pytest.approx(4.0)
    assert t["kernels"] == ["flash_fwd_splitkv_combine_kernel", "flash_fwd_splitkv_kernel"]
    t = bench.per_call_us(two[:7], calls=5)  # uneven: the mean, labelled so
    assert t["us"] == pytest.approx((5 * 3.0 + 2 * 1.0) / 5) and t["statistic"].startswith("mean")
    assert bench.per_call_us([], calls=5) is None


def fake_prepare_declared(q, k, v, *, kernel, causal=True):
    """kernels.prepare for NumPy arrays: the real rung's declarations decide what it takes (check_layout
    raises what prepare raises), the reference computes the output."""
    kernels.runtime.check_layout(q, k, v, kernels.load(kernel), causal, None)
    out = np.empty(q.shape, dtype=q.dtype)

    def run():
        out[...] = kernels.reference_attention(q, k, v, causal=causal)
        return out

    run.instance = SimpleNamespace(describe=lambda: "stand-in")
    return run


TINY_CASES = {  # the same parts at shapes NumPy checks in a moment
    "decode": [bench.Case("decode", 1, 2, 2, 1, T_k, 32) for T_k in (1, 9)],
    "long": [bench.Case("long", 2, 2, 2, 1, 40, 32)],
    "noncausal": [bench.Case("noncausal", 1, 2, 2, 17, 17, 32, causal=False)],
    "cross": [bench.Case("cross", 1, 2, 2, 5, 23, 32)],
    "gqa": [bench.Case("gqa", 1, 4, 2, 13, 13, 32)],
    "heads": [bench.Case("heads", 1, 2, 2, 11, 11, d) for d in (32, 96)],
}


@pytest.fixture
def features_stand_in(stand_in, monkeypatch):
    """bench.py features with NumPy for CuPy, no torch, real rung declarations and tiny cases; CUPTI and
    the graph replaced by host clocks over the same calls."""
    monkeypatch.setattr(kernels, "prepare", fake_prepare_declared)
    monkeypatch.setattr(bench, "FEATURE_CASES", TINY_CASES)

    def kernel_timing(runs, reps=10, name=None):
        records = []
        for _ in range(reps):
            for run in runs:
                start = time.perf_counter()
                run()
                records.append((start * 1e6, (time.perf_counter() - start) * 1e6, "attention_forward"))
        return bench.per_call_us(records, reps * len(runs))

    def graph_us(runs, reps=10):
        start = time.perf_counter()
        for _ in range(reps):
            for run in runs:
                run()
        return (time.perf_counter() - start) * 1e6 / (reps * len(runs))

    monkeypatch.setattr(bench, "kernel_timing", kernel_timing)
    monkeypatch.setattr(bench, "graph_us", graph_us)
    monkeypatch.setattr(bench, "torch_graph_us", graph_us)


def test_features_end_to_end_with_stand_ins(features_stand_in, tmp_path, capsys):
    v12, v13, v16 = (kernels.resolve(n).stem for n in ("v12", "v13", "v16"))
    code, out, err = run(["features", "--kernels", "v12,v13,v16", "--dtypes", "float32", "--caches", "3", "--reps",
                          "2", "--budget-ms", "1", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("features-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    # the JSON: setup, method, ceilings, targets, the plan, and rows that name their case
    assert data["schema"] == bench.SCHEMA and data["kind"] == "features"
    assert data["setup"]["device"]["name"] == "Stand-in GPU"
    assert data["setup"]["command"].startswith("python3 bench.py features --kernels v12,v13,v16")
    assert data["flop_convention"] == bench.FEATURE_FLOP_CONVENTION
    assert {"tolerance", "decode", "caches", "reps", "l2_flush"} <= set(data["method"])
    assert data["method"]["caches"] == 3 and data["method"]["reps"] == 2
    assert data["ceilings"]["copy_tbps"] == 3.0
    assert data["targets"] == {"decode_kernel_us": 5.0, "long_pct_copy": 75.0}
    assert data["parts"] == list(bench.FEATURE_PARTS) and data["kernels"] == [v12, v13, v16]
    assert data["kernels_named"] is True and data["dtypes"] == ["float32"]
    cases = {c["id"]: c for c in data["cases"]}
    assert [c["part"] for c in data["cases"]] == ["decode", "decode", "long", "long", "long", "noncausal", "cross",
                                                 "gqa", "heads", "heads"]
    assert [c["dtype"] for c in data["cases"] if c["part"] == "long"] == ["bfloat16", "float32", "float16"]
    for c in data["cases"]:
        s = c["shape"]
        assert c["flops"] == bench.attention_flops_qk(s["B"], s["NH"], s["T_q"], s["T_k"], s["d"], s["causal"])
        assert c["peer"] == bench.FEATURE_PEER[c["dtype"]] and c["kernels"] == [v12, v13, v16]
    rows = {(cases[r["case"]]["part"], r["shape"]["T_k"], r["shape"]["d"], r["dtype"], r["name"]): r
            for r in data["rows"]}
    assert len(rows) == len(data["rows"]) == 4 * len(data["cases"])  # three rungs and the peer per case
    for r in data["rows"]:
        assert r["case"] in cases and r["shape"] == cases[r["case"]]["shape"]
        if r["kind"] == "peer":  # no torch here: reported, not fatal
            assert r["status"] == "unavailable" and "torch" in r["reason"]

    def row(part, name, dtype="float32", T_k=None, d=32):
        return next(r for k, r in rows.items() if k[0] == part and k[4] == name and k[3] == dtype
                    and (T_k is None or k[1] == T_k) and k[2] == d)

    # rungs not declaring a feature are reported unsupported, with the launcher's reason, and not timed
    assert row("noncausal", v12)["status"] == "unsupported" and "causal=False" in row("noncausal", v12)["reason"]
    assert row("cross", v12)["status"] == "unsupported" and "query length 5 != key length 23" in row("cross", v12)["reason"]
    assert row("gqa", v12)["status"] == "unsupported" and "key/value heads" in row("gqa", v12)["reason"]
    assert row("heads", v12, d=96)["status"] == "unsupported" and "head sizes" in row("heads", v12, d=96)["reason"]
    assert row("long", v13, "bfloat16")["status"] == "unsupported"
    assert all("timing" not in r and "kernel_us" not in r for r in data["rows"] if r["status"] == "unsupported")
    # those that declare it are checked, then timed
    for part in ("noncausal", "cross", "gqa", "heads"):
        for name in (v13, v16):
            r = row(part, name)
            assert r["status"] == "ok" and r["max_err"] <= r["bound"], r
            assert r["tflops"] == pytest.approx(r["flops"] / (r["timing"]["median_ms"] * 1e-3) / 1e12)
            assert r["flops"] == cases[r["case"]]["flops"] and r["vs_peer"] is None  # the peer could not run
    assert row("heads", v12, d=32)["status"] == "ok"
    # decode: CUPTI kernel time and graph time per call, the target computed from the kernel time
    first = row("decode", v12, T_k=1)
    assert first["status"] == "ok" and first["kernel_timing"]["calls"] == 2 * 3
    assert row("decode", v12, T_k=9)["status"] == "unsupported"
    for T_k in (1, 9):
        r = row("decode", v16, T_k=T_k)
        assert r["status"] == "ok" and r["kernel_us"] > 0 and r["graph_us"] > 0
        assert r["target_met"] == (r["kernel_us"] <= 5.0)
        assert r["kv_bytes"] == 2 * 1 * 2 * T_k * 32 * 4
    # long context: bandwidth of K + V against the copy ceiling of the same run
    for dtype, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        r = row("long", v16, dtype)
        assert r["status"] == "ok" and r["kv_bytes"] == 2 * 2 * 2 * 40 * 32 * size
        assert r["kv_tbps"] == pytest.approx(r["kv_bytes"] / (r["timing"]["median_ms"] * 1e-3) / 1e12)
        assert r["pct_copy"] == pytest.approx(100 * r["kv_tbps"] / 3.0)
        assert r["target_met"] == (r["pct_copy"] >= 75.0)
    # progress lines while running, the tables at the end
    assert "[  1/40] decode float32  T_k     1" in out
    assert "unsupported: ValueError: kernel" in out
    assert "| T_k | kernel | kernel us |" in out and f"wrote {path}" in out


def test_a_rung_not_declaring_a_feature_is_unsupported_not_fatal(features_stand_in, capsys):
    case = bench.Case("gqa", 1, 4, 2, 13, 13, 32)
    method = bench.Method(budget_ms=1.0, min_runs=3, max_runs=3, warmup=1)
    rows = bench.bench_shape(case, "float32", [kernels.resolve("v12"), kernels.resolve("v13")], ["sdpa_efficient"],
                             flush=bench.no_flush, method=method, ffma_tflops=50.0, seed=0, counter=[0], total=3)
    by = {r["kind"] + ":" + r["name"][:3]: r for r in rows}
    assert by["rung:v12"]["status"] == "unsupported" and "gqa" not in kernels.load("v12").supports
    assert "2 key/value heads for 4 query heads" in by["rung:v12"]["reason"]
    assert by["rung:v13"]["status"] == "ok" and by["rung:v13"]["flops"] == bench.attention_flops(1, 4, 13, 32)
    assert by["peer:sdp"]["status"] == "unavailable"


def features_result():
    """A small features result as cmd_features writes it: decode, long context, a cross case whose
    peer is n/a, a GQA case whose peer repeats K/V, and an unsupported rung."""
    def timing(ms):
        return {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "min_ms": ms * 0.9, "max_ms": ms * 1.1,
                "runs": 50}

    decode = bench.Case("decode", 1, 12, 12, 1, 1024, 64)
    long = bench.Case("long", 16, 32, 32, 1, 4096, 128)
    cross = bench.Case("cross", 4, 12, 12, 256, 4096, 64)
    gqa = bench.Case("gqa", 4, 32, 8, 2048, 2048, 128)
    cases = [("decode-a", decode, "float32"), ("long-a", long, "bfloat16"), ("cross-a", cross, "float32"),
             ("gqa-a", gqa, "float32")]
    base = lambda cid, case, dtype, name, kind, status="ok": {  # noqa: E731
        "case": cid, "shape": case.as_dict(), "dtype": dtype, "name": name,
        "label": bench.PEERS[name].label if kind == "peer" else name, "kind": kind, "status": status,
        "max_err": 1e-7, "bound": 2e-6}
    kv = bench.kv_bytes(decode, "float32")
    rows = [
        base("decode-a", decode, "float32", "v16_decode_split_kv", "rung") | {
            "kernel_us": 4.0, "graph_us": 5.5, "target_met": True, "vs_peer": 2.5, "kv_bytes": kv,
            "kv_tbps": kv / 4e-6 / 1e12, "config": "d_head=64, splits=6",
            "kernel_timing": {"us": 4.0, "p20_us": 3.9, "p80_us": 4.1, "statistic": "median", "calls": 240}},
        base("decode-a", decode, "float32", "v14_tf32_mma", "rung") | {
            "kernel_us": 12.0, "graph_us": 13.0, "target_met": False, "vs_peer": 10 / 12, "kv_bytes": kv,
            "kv_tbps": kv / 12e-6 / 1e12, "kernel_timing": {"us": 12.0, "statistic": "mean (records ...)"}},
        base("decode-a", decode, "float32", "sdpa_efficient", "peer") | {
            "kernel_us": 10.0, "graph_us": None, "graph_reason": "capture refused", "kv_bytes": kv,
            "kv_tbps": kv / 1e-5 / 1e12, "kernel_timing": {"us": 10.0, "p20_us": 9.0, "p80_us": 11.0}},
        base("long-a", long, "bfloat16", "v16_decode_split_kv", "rung") | {
            "timing": timing(0.3), "kv_bytes": bench.kv_bytes(long, "bfloat16"), "kv_tbps": 3.58, "pct_copy": 84.2,
            "target_met": True, "vs_peer": 1.2},
        base("long-a", long, "bfloat16", "sdpa_flash", "peer") | {"timing": timing(0.36), "kv_tbps": 2.98,
                                                                  "kv_bytes": bench.kv_bytes(long, "bfloat16"),
                                                                  "pct_copy": 70.1},
        base("cross-a", cross, "float32", "v13_fa2_partitioning", "rung") | {
            "timing": timing(2.0), "tflops": bench.shape_flops(cross) / 2e-3 / 1e12, "vs_peer": None},
        base("cross-a", cross, "float32", "v12_o_in_registers", "rung", "unsupported") | {
            "max_err": None, "reason": "ValueError: kernel v12_o_in_registers does not support query length 256 != "
                                       "key length 4096"},
        base("cross-a", cross, "float32", "sdpa_efficient", "peer", "n/a") | {
            "reason": "n/a: this torch has no torch.nn.attention.bias.causal_lower_right"},
        base("gqa-a", gqa, "float32", "v13_fa2_partitioning", "rung") | {
            "timing": timing(4.0), "tflops": bench.shape_flops(gqa) / 4e-3 / 1e12, "vs_peer": 0.5},
        base("gqa-a", gqa, "float32", "sdpa_efficient", "peer") | {
            "timing": timing(2.0), "tflops": bench.shape_flops(gqa) / 2e-3 / 1e12,
            "note": "K and V repeated to 32 heads for the peer only (enable_gqa=True: RuntimeError: No available kernel)"},
    ]
    return {"schema": bench.SCHEMA, "kind": "features", "setup": fixture_setup("python3 bench.py features"),
            "flop_convention": bench.FEATURE_FLOP_CONVENTION,
            "method": bench.Method(budget_ms=100).describe(100 * 2**20) | {"decode": "CUPTI (fixture)", "caches": 24,
                                                                             "reps": 10},
            "ceilings": {"ffma_tflops": 50.0, "ffma_what": "fixture", "copy_tbps": 4.25, "copy_what": "fixture copy"},
            "targets": {"decode_kernel_us": 5.0, "long_pct_copy": 75.0}, "parts": list(bench.FEATURE_PARTS),
            "dtypes": ["float32", "bfloat16"], "kernels": ["v13_fa2_partitioning", "v16_decode_split_kv"],
            "kernels_named": False, "peers": dict(bench.FEATURE_PEER),
            "cases": [{"id": cid, "part": case.part, "shape": case.as_dict(), "dtype": dtype,
                       "peer": bench.FEATURE_PEER[dtype], "kernels": [], "flops": bench.shape_flops(case)}
                      for cid, case, dtype in cases],
            "seed": 0, "rows": rows}


def cells_of(line):
    return [c.strip() for c in line.split("|")[1:-1]]


def test_features_tables_from_a_synthetic_result():
    text = bench.render_features(json.loads(json.dumps(bench._jsonable(features_result()))))
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
    assert bench.FEATURE_FLOP_CONVENTION in text
    assert f"**Cross lengths**: B=4, NH=12, T_q=256, T_k=4096, d=64, causal, bottom-right " \
           f"({bench.shape_flops(bench.FEATURE_CASES['cross'][0]) / 1e9:.1f} GFLOP)" in text
    v13 = cells_of(table_rows(text, "`v13_fa2_partitioning`")[0])
    assert v13[:6] == ["`v13_fa2_partitioning`", "float32", "2.000", "1.960-2.040", bench._tflops(
        bench.shape_flops(bench.FEATURE_CASES["cross"][0]) / 2e-3 / 1e12), "-"]
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
    text = bench.render_features(result)
    assert "GPT-2 decode" not in text and "Long-context" not in text and "**Grouped-query heads**" in text


def test_readme_fills_the_features_block(tmp_path, capsys):
    readme = tmp_path / "README.md"
    text = (FIXTURES / "bench_readme.md").read_text().replace(
        "## After", "Features, hand-written.\n\n<!-- bench:features:start -->\nstale\n<!-- bench:features:end -->\n\n"
                    "## After")
    readme.write_text(text)
    results = tmp_path / "results"
    older = features_result()
    older["setup"]["date"] = "2025-12-01T00:00:00Z"
    older["setup"]["device"]["name"] = "Older GPU"
    for result in (older, features_result()):
        bench.write_result(result, bench.result_path("features", result["setup"], results))
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results)], capsys)
    assert code == 0 and "features" in out
    after = readme.read_text()
    assert outside_markers(after) == outside_markers(text)
    block = re.search(r"<!-- bench:features:start -->(.*?)<!-- bench:features:end -->", after, re.S)[1]
    assert "from `results/features-fixture-gpu-20260102T030405Z.json`" in block  # the newest
    assert "stale" not in block and "Older GPU" not in block and "Target: kernel time <= 5 us per call." in block
    assert "no kernels results" in out  # the other sections are left as they are


class FakeTorchTensor:
    """The one tensor method sdpa_launch calls, on a NumPy array."""

    def __init__(self, a):
        self.a = a

    def repeat_interleave(self, n, dim):
        return FakeTorchTensor(np.repeat(self.a, n, axis=dim))


def fake_torch(takes_gqa: bool, calls: list):
    def sdpa(q, k, v, is_causal=False, attn_mask=None, **kw):
        if "enable_gqa" in kw and not takes_gqa:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        calls.append({"k_heads": k.a.shape[1], "is_causal": is_causal, "attn_mask": attn_mask, **kw})
        return kernels.reference_attention(q.a, k.a, v.a, causal=is_causal)

    return SimpleNamespace(nn=SimpleNamespace(functional=SimpleNamespace(scaled_dot_product_attention=sdpa)),
                           cuda=SimpleNamespace(synchronize=lambda: None))


@pytest.mark.parametrize("takes_gqa", [True, False])
def test_sdpa_peer_with_grouped_heads_uses_enable_gqa_or_repeats_kv(takes_gqa):
    case = bench.Case("gqa", 1, 4, 2, 7, 7, 8)
    rng = np.random.default_rng(0)
    q, k, v = (FakeTorchTensor(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 7, 8), (1, 2, 7, 8),
                                                                                   (1, 2, 7, 8)))
    calls = []
    launch = bench.sdpa_launch(fake_torch(takes_gqa, calls), bench.PEERS["sdpa_flash"], q, k, v, case)
    out = launch()
    np.testing.assert_allclose(out, kernels.reference_attention(q.a, k.a, v.a), rtol=1e-5, atol=1e-6)
    last = calls[-1]
    assert last["is_causal"] is True
    if takes_gqa:
        assert launch.note == "enable_gqa=True" and last["enable_gqa"] is True and last["k_heads"] == 2
    else:  # the peer alone gets K and V repeated to the query heads; the table note says so
        assert launch.note.startswith("K and V repeated to 4 heads for the peer only (enable_gqa=True: TypeError")
        assert "enable_gqa" not in last and last["k_heads"] == 4


def test_sdpa_peer_cross_lengths_without_a_bottom_right_mask_is_not_comparable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.bias", None)  # a torch without causal_lower_right
    case = bench.Case("cross", 1, 2, 2, 5, 23, 8)
    q, k, v = (FakeTorchTensor(np.zeros(s, dtype=np.float32)) for s in ((1, 2, 5, 8), (1, 2, 23, 8), (1, 2, 23, 8)))
    with pytest.raises(bench.NotComparable, match="n/a: this torch has no .*causal_lower_right"):
        bench.sdpa_launch(fake_torch(True, []), bench.PEERS["sdpa_efficient"], q, k, v, case)
    # one query row: the bottom-right mask hides nothing, so plain non-causal SDPA is the same mask
    calls = []
    q1 = FakeTorchTensor(np.ones((1, 2, 1, 8), dtype=np.float32))
    launch = bench.sdpa_launch(fake_torch(True, calls), bench.PEERS["sdpa_efficient"], q1, k, v,
                               bench.Case("decode", 1, 2, 2, 1, 23, 8))
    launch()
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"] is None
    assert "hides no key" in launch.note


def test_cupti_timing_needs_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.profiler", None)
    assert bench.kernel_timing([lambda: None]) is None and bench.kernel_us([lambda: None]) is None


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
        bench.decode_figures(r, 250_000_000, 4e12)
    fast_bf16, fast_fp32, hf = rows[:3]
    assert fast_bf16["ttft_ms"] == pytest.approx(10.0) and fast_bf16["decode_tokens_per_s"] == pytest.approx(8000)
    assert fast_bf16["weight_tbps"] == pytest.approx(2.0) and fast_bf16["pct_copy"] == pytest.approx(50.0)
    assert fast_bf16["target_met"] is True and fast_fp32["target_met"] is False  # 7000 and 4000 tokens/s
    assert "target_met" not in hf and hf["decode_tokens_per_s"] == pytest.approx(200)
    text = bench.render_decode({"copy_tbps": 4.0, "targets": bench.DECODE_TARGETS, "steps": bench.DECODE_STEPS,
                                "rows": rows, "method": "stamps."})
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in table_rows(text, "bfloat16") + table_rows(text, "float32")]
    assert cells[0] == ["bfloat16", "gpt2.fast, persistent", "10.0", "8,000", "125", "2.00 (50%)", "met", ""]
    assert cells[2][3:7] == ["3,000", "333", "0.75 (19%)", "missed"]  # bfloat16 rows first
    assert "**unavailable**" in text and "no bf16 here" in text and "float32 4,000 tokens/s" in text
