"""bench.py levels and what it adds to the others: the plan (shapes x levels x dtypes), lines of code
counted from sources, the table and docs/levels.md, the torch.compile peers' registration, Triton rungs
in `kernels` (--kernels v19,t01; unavailable without Triton), all without a GPU (stand-ins)."""

import json
import re
import shutil

import pytest

import kernels
from benchmarks import cli, levels, peers, plots, rungs, timing
from benchmarks.cases import Inputs, Shape
from tests.bench.helpers import FIXTURES, FakePyplot, install_stand_ins, run

# -- the plan ------------------------------------------------------------------------------------


def test_plan_is_every_dtype_x_shape_with_every_level():
    shapes = [s for key in levels.SHAPE_SETS for s in levels.SHAPE_SETS[key]]
    assert [(s.B, s.T) for s in shapes[:5]] == [(1, 512), (8, 1024), (16, 2048), (6, 4096), (1, 8192)]
    assert all(s.NH == 12 and s.d == 64 for s in shapes[:5]) and [s.d for s in shapes[5:]] == [128, 128]
    cases = levels.plan(shapes, ["float32", "bfloat16"], list(levels.LEVELS), "sm_90")
    assert len(cases) == 2 * 7
    by = {(dtype, shape.d): [(e["level"], e["name"]) for e in entries] for dtype, shape, entries in cases}
    assert by["float32", 64] == [("PyTorch", "torch_naive"), ("torch.compile", "torch_compile"),
                                 ("torch.compile", "torch_compile_max"), ("Triton", "t01_fa2"),
                                 ("CUDA", "v20_tf32_wgmma"), ("SDPA", "sdpa_efficient")]
    assert ("CUDA", "v14_tf32_mma") in by["float32", 128]  # v20 declares d=64 only
    assert by["bfloat16", 64][-3:] == [("CUDA", "v19_wgmma_overlap"), ("SDPA", "sdpa_flash"), ("SDPA", "sdpa_cudnn")]


def test_cuda_level_follows_declarations_and_the_device():
    assert levels.cuda_rung("float32", 64, "sm_80") == "v14_tf32_mma"  # v20 is wgmma: sm_90 only
    assert levels.cuda_rung("bfloat16", 128, "sm_80") == "v15_bf16_mma"
    assert levels.cuda_rung("bfloat16", 96, "sm_90") == "v15_bf16_mma"  # v18, v19 declare 64 and 128
    assert levels.cuda_rung("float32", 48, "sm_90") is None
    only = levels.plan([Shape(1, 64)], ["float32"], ["triton", "sdpa"], None)
    assert [e["name"] for e in only[0][2]] == ["t01_fa2", "sdpa_efficient"]


# -- lines of code ---------------------------------------------------------------------------------

PYTHON = '''"""A module docstring
over two lines."""

import math  # a trailing comment: the line counts


def f(x):
    """A docstring."""
    # a comment

    y = x + 1
    s = "# not a comment"
    return math.sqrt(y)
'''

CUDA = """/* a header
   over lines */
#include <cuda.h>

// a comment
__global__ void k(float *x) {  // trailing: counts
    x[0] = 1.0f; /* inline */
    /* one line */
}
"""


def test_code_lines_drop_blanks_comments_and_docstrings():
    assert levels.code_lines(PYTHON, "python") == 5  # import, def, y, s, return
    assert levels.code_lines(CUDA, "cuda") == 4  # include, signature, body, brace


def test_function_source_and_the_lines_of_each_level(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(PYTHON)
    assert levels.code_lines(levels.function_source(path, "f"), "python") == 4
    with pytest.raises(ValueError, match="has no function g"):
        levels.function_source(path, "g")
    naive = levels.lines_of_code("torch_naive")
    assert 5 <= naive["lines"] <= 12 and "plain_attention" in naive["what"]
    assert levels.lines_of_code("torch_compile")["lines"] == levels.lines_of_code("torch_compile_max")["lines"] \
        == naive["lines"] + 1
    assert levels.lines_of_code("sdpa_flash") == {"lines": None, "what": "library: 1 call"}
    t01 = levels.lines_of_code("t01_fa2")
    assert t01["lines"] == levels.code_lines(kernels.triton.resolve("t01").read_text(), "python") > 40
    v20 = levels.lines_of_code("v20_tf32_wgmma")
    assert v20["lines"] > t01["lines"] and v20["what"] == "kernels/v20_tf32_wgmma.cu"


# -- the peers and the Triton rungs in `kernels` ---------------------------------------------------


def test_torch_peers_are_registered_opt_in():
    assert [peers.PEERS[n].plain for n in ("torch_naive", "torch_compile", "torch_compile_max")] == [
        "eager", "default", "max-autotune-no-cudagraphs"]
    assert not {"torch_naive", *peers.COMPILED} & {p for d in peers.DEFAULT_PEERS.values() for p in d}
    assert cli.peer_list("torch_compile,torch_compile_max") == ["torch_compile", "torch_compile_max"]
    assert levels.function_source(levels.PLAIN, "plain_attention").startswith("def plain_attention(q, k, v")


def test_without_torch_a_compiled_peer_is_unavailable_not_fatal(monkeypatch):
    install_stand_ins(monkeypatch)
    inputs = Inputs(Shape(1, 16, NH=2, d=8), "float32", 0)
    for name in ("torch_naive", "torch_compile_max"):
        r = {"name": name}
        assert not peers.run_peer_once(r, peers.PEERS[name], inputs, {})
        assert r["status"] == "unavailable" and "torch is not importable" in r["reason"]


def test_kernels_list_takes_triton_rungs():
    assert [p.stem for p in cli.rung_list("v19,t01")] == ["v19_wgmma_overlap", "t01_fa2"]
    assert [p.stem for p in cli.rung_list("all,triton")] == kernels.names() + kernels.triton_names()
    assert [p.stem for p in cli.rung_list("t1, v1")] == ["t01_fa2", "v01_naive"]


@pytest.mark.parametrize("argv,message", [
    (["kernels", "--kernels", "v19,t99"], "unknown Triton kernel 't99'"),
    (["sweep", "--kernels", "t01_nope"], "unknown Triton kernel"),
    (["levels", "--levels", "cuda,fortran"], "unknown level(s) fortran"),
    (["levels", "--shapes", "gpt3"], "unknown shape set(s) gpt3"),
])
def test_bad_levels_and_triton_arguments(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


def test_a_triton_rung_without_triton_is_listed_unavailable(monkeypatch, capsys):
    install_stand_ins(monkeypatch)
    why = "the Triton rungs need triton, not installed here: pip install -e '.[triton]' (and PyTorch with CUDA)"
    monkeypatch.setattr(kernels, "triton_unavailable", lambda: why)
    method = timing.Method(budget_ms=1.0, min_runs=3, max_runs=3, warmup=1)
    rows = rungs.bench_shape(Shape(1, 20, NH=2, d=64), "float32", cli.rung_list("v13,t01"), [], flush=timing.no_flush,
                             method=method, ffma_tflops=50.0, seed=0, counter=[0], total=2)
    v13, t01 = rows
    assert v13["status"] == "ok" and t01["status"] == "unavailable" and t01["reason"] == why
    assert t01["family"] == "triton" and "previous" not in t01["speedup"]
    assert why in capsys.readouterr().out


# -- the subcommand, end to end with stand-ins, and what it writes ---------------------------------

TINY = {"gpt2": (Shape(1, 40, 12, 64), Shape(2, 17, 12, 64)), "d128": (Shape(1, 24, 2, 128),)}


@pytest.fixture
def levels_run(monkeypatch, tmp_path, capsys):
    """`bench.py levels` on tiny shapes with stand-ins (no torch, no Triton): its result file."""
    install_stand_ins(monkeypatch)
    for key, shapes in TINY.items():
        monkeypatch.setitem(levels.SHAPE_SETS, key, shapes)
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: plot(FakePyplot(), result) and path.name)
    code, out, err = run(["levels", "--budget-ms", "1", "--results", str(tmp_path / "out")], capsys)
    assert code == 0, err
    (path,) = (tmp_path / "out").glob("levels-stand-in-gpu-*.json")
    return path, out


def test_levels_end_to_end_with_stand_ins(levels_run):
    path, out = levels_run
    data = json.loads(path.read_text())
    assert data["kind"] == "levels" and data["dtypes"] == ["float32", "bfloat16"] and len(data["shapes"]) == 3
    assert data["plot"] == path.with_suffix(".png").name
    rows = {(r["dtype"], r["name"], r["shape"]["T"]): r for r in data["rows"]}
    assert rows["float32", "v20_tf32_wgmma", 40]["status"] == "ok"  # the stand-in rungs compute the reference
    assert rows["float32", "v14_tf32_mma", 24]["level"] == "CUDA"  # d=128
    assert rows["bfloat16", "v19_wgmma_overlap", 17]["status"] == "ok"
    assert rows["float32", "torch_compile", 40]["status"] == "unavailable"  # no torch here: a row, not a crash
    assert rows["float32", "t01_fa2", 40]["status"] == ("unavailable" if kernels.triton_unavailable() else "ok")
    assert all(r["loc"]["what"] for r in data["rows"])
    assert re.search(r"--- float32, 1x40 \(NH=12, d=64\): PyTorch torch_naive, torch.compile torch_compile", out)
    assert out.count("/39]") == 3 * 6 + 3 * 7  # progress: a line per (dtype, shape, implementation)
    assert "| PyTorch | PyTorch (plain) |" in out


def test_levels_table_and_docs_page(levels_run, tmp_path, capsys):
    path, _ = levels_run
    result = json.loads(path.read_text())
    text = levels.render_levels(result, "levels.png")
    assert "![TFLOP/s per shape and level](levels.png)" in text and "**bfloat16**" in text
    (header,) = [line for line in text.splitlines() if line.startswith("| level |")][:1]
    assert "| 1x40 | 2x17 | 1x2x24 d128 |" in header
    v20 = next(line for line in text.splitlines() if line.startswith("| CUDA | `v20_tf32_wgmma` |"))
    cells = [c.strip() for c in v20.split("|")[1:-1]]
    assert cells[2] == str(levels.lines_of_code("v20_tf32_wgmma")["lines"]) and cells[6] == "-"  # no d128 run
    assert re.search(r"torch.compile max-autotune at 1x40, 2x17, 1x2x24 d128: unavailable: .*torch", text)
    # bench.py readme writes it between docs/levels.md's markers, the other pages untouched
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(path, results / path.name)
    page = tmp_path / "levels.md"
    page.write_text("# Levels\n\nintro\n\n<!-- bench:levels:start -->\nold\n<!-- bench:levels:end -->\n\nend\n")
    readme, doc = tmp_path / "README.md", tmp_path / "results.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    shutil.copy(FIXTURES / "bench_results_doc.md", doc)
    before = readme.read_text(), doc.read_text()
    code, out, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results),
                          "--levels-doc", str(page)], capsys)
    assert code == 0, err
    after = page.read_text()
    assert after.startswith("# Levels\n\nintro\n\n<!-- bench:levels:start -->") and after.endswith("end\n")
    assert "old" not in after and f"Results file: [{path.name}]({results.name}/{path.name})" in after
    assert "| Triton | `t01_fa2` |" in after and (readme.read_text(), doc.read_text()) == before


def test_each_dtype_comes_from_the_newest_file_that_has_it():
    files = {"c": {"dtypes": ["bfloat16"]}, "b": {"dtypes": ["float32"]}, "a": {"dtypes": ["float32", "bfloat16"]}}
    chosen = levels.newest_per_dtype(["c", "b", "a"], files.get)  # newest first
    assert [(p, dtypes) for p, _, dtypes in chosen] == [("b", ["float32"]), ("c", ["bfloat16"])]
