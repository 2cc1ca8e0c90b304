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


@pytest.mark.parametrize("argv", [[], ["kernels"], ["sweep"], ["e2e"], ["resources"], ["readme"]])
def test_help_exits_zero_and_describes_options(argv, capsys):
    code, out, _ = run([*argv, "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: bench.py")
    expected = {(): "kernels", ("kernels",): "--shape", ("sweep",): "--t-max", ("e2e",): "--kv-cache",
                ("resources",): "--arch", ("readme",): "--readme"}[tuple(argv)]
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


@pytest.mark.parametrize("command", [["kernels"], ["sweep", "--t-max", "256"], ["e2e", "--tokens", "4"]])
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
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, kernel, causal: kernels.reference_attention(q, k, v))
    monkeypatch.setattr(bench, "plot_or_none", lambda plot, result, path: None)
    code, out, err = run(["e2e", "--kernels", stand_in[0], "--tokens", "5", "--warmup", "2", "--no-hf",
                          "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("e2e-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["modes"] == ["no-cache", "kv-cache"] and data["prompt"] == bench.PROMPT
    assert data["prompt_tokens"] == 8  # "Hello, I'm a language model," in GPT-2's BPE
    rows = {(r["name"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {("reference", "no-cache"), ("v01_good", "no-cache"), ("reference", "kv-cache"),
                         ("v01_good", "kv-cache")}
    for r in rows.values():
        assert r["status"] == "ok" and len(r["tokens"]) == 5 and len(r["elapsed"]) == 5
        assert r["elapsed"] == sorted(r["elapsed"]) and r["elapsed"][-1] <= r["seconds"]
        assert r["same_tokens_as_reference"] == 5  # the stand-in rung is the reference
    assert "| `v01_good` | kv-cache |" in out
