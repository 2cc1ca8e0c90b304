"""bench.py readme: the README's summary and docs/results.md's tables, rewritten between their markers."""

import re
import shutil

import pytest

from benchmarks.cases import GPT2_SHAPES, Shape, attention_flops
from benchmarks.e2e import DECODE_STEPS, DECODE_TARGETS, decode_figures
from benchmarks.results import result_path, write_result
from benchmarks.rungs import add_speedups
from benchmarks.summary import best_rung, has_gpt2_shapes
from benchmarks.tables import fmt_tflops, fmt_x
from tests.bench.helpers import (
    FIXTURES,
    cells_of,
    e2e_result,
    features_result,
    kernels_result,
    outside_markers,
    resources_result,
    run,
    table_rows,
    timed_row,
)


def docs_page(tmp_path):
    """docs/results.md beside the README: the page of the full tables, its markers from the fixture."""
    page = tmp_path / "docs" / "results.md"
    if not page.exists():
        page.parent.mkdir(exist_ok=True)
        shutil.copy(FIXTURES / "bench_results_doc.md", page)
    return page


@pytest.fixture
def readme_and_results(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    results = tmp_path / "results"
    old = kernels_result(shapes=((1, 512),), date="2025-12-01T00:00:00Z")
    old["setup"]["device"]["name"] = "Older GPU"
    for result in (old, kernels_result()):
        write_result(result, result_path("kernels", result["setup"], results))
    sweep = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    sweep |= {"tokens": 16384, "plot": "sweep-fixture-gpu-20260102T030405Z.png"}
    write_result(sweep, result_path("sweep", sweep["setup"], results))
    both = e2e_result(date="2026-01-01T00:00:00Z")
    newer_kv = e2e_result(modes=("kv-cache",), date="2026-01-05T00:00:00Z")
    for result in (both, newer_kv):
        write_result(result, result_path("e2e", result["setup"], results))
    res = resources_result()
    write_result(res, result_path("resources", res["setup"], results, "sm_90-nvrtc"))
    return readme, results


def test_readme_rewrites_only_between_markers(tmp_path, readme_and_results, capsys):
    readme, results = readme_and_results
    before = readme.read_text()
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc", str(docs_page(tmp_path))], capsys)
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
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc", str(docs_page(tmp_path))], capsys)
    assert code == 0 and readme.read_text() == after and "already current" in out


def test_readme_without_markers_exits_2_and_changes_nothing(tmp_path, readme_and_results, capsys):
    _, results = readme_and_results
    readme = tmp_path / "PLAIN.md"
    readme.write_text("# No markers here\n\nbench:kernels:start is not a marker\n")
    before = readme.read_text()
    code, _, err = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc", str(docs_page(tmp_path))], capsys)
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
    code, _, err = run(["readme", "--readme", str(readme), "--results", str(tmp_path), "--results-doc", str(docs_page(tmp_path))], capsys)
    assert code == 2 and message in err
    assert readme.read_text() == text


def test_readme_keeps_sections_without_results(tmp_path, capsys):
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    before = readme.read_text()
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(tmp_path / "empty"), "--results-doc", str(docs_page(tmp_path))], capsys)
    assert code == 0 and readme.read_text() == before
    assert "no kernels results" in out


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
        write_result(result, result_path("features", result["setup"], results))
    code, out, _ = run(["readme", "--readme", str(readme), "--results", str(results), "--results-doc", str(docs_page(tmp_path))], capsys)
    assert code == 0 and "features" in out
    after = readme.read_text()
    assert outside_markers(after) == outside_markers(text)
    block = re.search(r"<!-- bench:features:start -->(.*?)<!-- bench:features:end -->", after, re.S)[1]
    assert "from `results/features-fixture-gpu-20260102T030405Z.json`" in block  # the newest
    assert "stale" not in block and "Older GPU" not in block and "Target: kernel time <= 5 us per call." in block
    assert "no kernels results" in out  # the other sections are left as they are


# --- the README's summary and docs/results.md: the contract between the generator and the pages -------


def five_shape_result(dtype="float32", date="2026-01-02T03:04:05Z"):
    """Four rungs at the five GPT-2 shapes: v01 slow; v03 steady; v04 fast at four shapes and slow at one,
    so fastest by geometric mean but not by arithmetic mean; v05 fastest, but wrong at one shape."""
    result = kernels_result(shapes=GPT2_SHAPES, date=date)
    times = {"v01_naive": [8, 9, 10, 11, 12], "v03_fast": [1, 2, 3, 4, 5], "v04_spiky": [0.1, 0.1, 0.1, 0.1, 100],
             "v05_once_wrong": [0.05] * 5}
    rows = []
    for i, (B, T) in enumerate(GPT2_SHAPES):
        shape = Shape(B, T)
        rows += [timed_row(shape, name, "rung", ms[i]) for name, ms in times.items()]
        rows += [timed_row(shape, "reference", "peer", 2.0), timed_row(shape, "sdpa_efficient", "peer", 0.5)]
    wrong = next(r for r in rows if r["name"] == "v05_once_wrong" and r["shape"]["T"] == 4096)
    wrong |= {"status": "wrong", "reason": "max error 5.00e-01 > bound 2.00e-06"}
    del wrong["timing"]
    add_speedups(rows)
    for r in rows:
        r["dtype"] = dtype
    result |= {"dtype": dtype, "rows": rows, "kernels": list(times)}
    return result


def test_best_rung_is_the_fastest_correct_one_by_geometric_mean():
    result = five_shape_result()
    name, mean = best_rung(result)
    assert name == "v04_spiky"  # v03_fast by the arithmetic mean; v05_once_wrong is wrong at 6x4096
    assert mean == pytest.approx((0.1**4 * 100) ** 0.2)
    assert has_gpt2_shapes(result) and not has_gpt2_shapes(kernels_result())
    assert best_rung(kernels_result()) == ("v03_fast", pytest.approx(2**0.5))  # at the two GPT-2 shapes it has
    assert best_rung(kernels_result(shapes=((2, 64),))) is None  # at none


def decode_table():
    """The decode table of an e2e result, as measure_decode leaves it."""
    rows = [{"dtype": "float32", "step": "persistent", "label": "gpt2.fast, persistent", "status": "ok",
             "elapsed": [0.01, 0.01 + 1 / 4500, 0.01 + 2 / 4500]},
            {"dtype": "float32", "step": "graphs", "label": "gpt2.fast, graphs", "status": "ok",
             "elapsed": [0.01, 0.01 + 1 / 3000]},
            {"dtype": "float32", "step": "HF generate", "label": "HF transformers (sdpa)", "status": "ok",
             "elapsed": [0.05, 0.055, 0.06]},
            {"dtype": "bfloat16", "step": "persistent", "label": "gpt2.fast, persistent", "status": "ok",
             "elapsed": [0.01, 0.01 + 1 / 6500]},
            {"dtype": "bfloat16", "step": "graphs", "label": "gpt2.fast, graphs", "status": "error", "reason": "x"}]
    for r in rows:
        if r["status"] == "ok":
            decode_figures(r, 250_000_000, 4e12)
    return {"copy_tbps": 4.0, "targets": DECODE_TARGETS, "steps": DECODE_STEPS, "rows": rows, "method": "stamps."}


@pytest.fixture
def pages(tmp_path):
    """README.md and docs/results.md with their markers, and results/ with kernels in two dtypes at the five
    GPT-2 shapes (and a newer float32 file at other shapes), a sweep with its plot, e2e files of each mode."""
    readme = tmp_path / "README.md"
    shutil.copy(FIXTURES / "bench_front.md", readme)
    doc = docs_page(tmp_path)
    results = tmp_path / "results"
    newer_other_shapes = kernels_result(date="2026-01-03T00:00:00Z")
    for result in (five_shape_result(), five_shape_result("bfloat16"), newer_other_shapes):
        write_result(result, result_path("kernels", result["setup"], results))
    sweep = kernels_result(shapes=((64, 256), (16, 1024)), kind="sweep")
    sweep |= {"tokens": 16384, "plot": "sweep-fixture-gpu-20260102T030405Z.png"}
    path = write_result(sweep, result_path("sweep", sweep["setup"], results))
    path.with_suffix(".png").write_bytes(b"")  # the plot the result names
    no_cache = e2e_result(modes=("no-cache",), date="2026-01-01T00:00:00Z")
    kv = e2e_result(modes=("kv-cache",), date="2026-01-05T00:00:00Z") | {"decode": decode_table()}
    for result in (no_cache, kv):
        write_result(result, result_path("e2e", result["setup"], results))
    return readme, doc, results


def blocks_of(text):
    return {m[0]: m[1] for m in re.findall(r"<!-- bench:([\w-]+):start -->(.*?)<!-- bench:\1:end -->", text, re.S)}


def test_readme_writes_the_summary_and_the_full_tables_with_links_to_their_files(pages, capsys):
    readme, doc, results = pages
    before = {page: page.read_text() for page in (readme, doc)}
    argv = ["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    after = {page: page.read_text() for page in (readme, doc)}
    for page in (readme, doc):  # both rewritten, nothing outside the markers
        assert after[page] != before[page] and outside_markers(after[page]) == outside_markers(before[page])
    front, full = blocks_of(after[readme]), blocks_of(after[doc])
    assert set(front) == {"summary", "e2e-summary"} and "stale" not in after[readme]
    assert set(full) == {"kernels", "sweep", "features", "resources", "e2e"}
    # one table per precision class, float32 first, each naming its best rung and linking its file
    summary = front["summary"]
    f32 = "kernels-fixture-gpu-20260102T030405Z.json"
    bf16 = "kernels-fixture-gpu-20260102T030405Z-1.json"
    assert summary.index("**float32**: `v04_spiky`") < summary.index("**bfloat16**: `v04_spiky`")
    assert f"Results file: [{f32}](results/{f32})." in summary and f"[{bf16}](results/{bf16})" in summary
    assert "kernels-fixture-gpu-20260103T000000Z.json" not in summary  # newer, but not at the five shapes
    assert ("| B x T | `v04_spiky` ms | TFLOP/s | CuPy reference ms | vs CuPy reference | SDPA efficient ms "
            "| vs SDPA efficient |") in summary
    assert [c[:1] for c in map(cells_of, table_rows(summary, "1x512"))] == [["1x512"], ["1x512"]]
    assert cells_of(table_rows(summary, "1x8192")[0])[1:] == [  # v04's slow shape: 100 ms
        "100.0", fmt_tflops(attention_flops(1, 12, 8192, 64) / 0.1 / 1e12), "2.000", "0.02x", "0.5000", fmt_x(0.005)]
    image = "results/sweep-fixture-gpu-20260102T030405Z.png"
    assert f"![TFLOP/s against sequence length, float32]({image})" in summary
    # the e2e summary: best rung without a cache against HF, decode tokens/s per dtype against HF, targets
    e2e = front["e2e-summary"]
    rows = [cells_of(line) for line in e2e.splitlines() if line.startswith("| no cache") or line.startswith("| KV")]
    no_cache, fp32, bf16_row = rows
    assert no_cache[:5] == ["no cache, float32: seconds for 4 tokens, `v03_fast`", "4.00", "5.00", "1.25x", "-"]
    assert no_cache[5] == "[e2e-fixture-gpu-20260101T000000Z.json](results/e2e-fixture-gpu-20260101T000000Z.json)"
    assert fp32[:5] == ["KV cache, float32: decode tokens/s, gpt2.fast, persistent", "4,500", "200", "22.50x",
                        ">= 4,000: met"]
    assert bf16_row[:5] == ["KV cache, bfloat16: decode tokens/s, gpt2.fast, persistent", "6,500", "-", "-",
                            ">= 7,000: missed"]
    assert "(results/e2e-fixture-gpu-20260105T000000Z.json)" in bf16_row[5]
    # docs/results.md: the full tables, each linking its file from docs/, images likewise
    newest = "kernels-fixture-gpu-20260103T000000Z.json"  # the full tables: the newest file of each dtype
    assert f"Results file: [{newest}](../results/{newest})." in full["kernels"] and f32 not in full["kernels"]
    assert f"Results file: [{bf16}](../results/{bf16})." in full["kernels"]
    assert "![TFLOP/s against sequence length](../results/sweep-fixture-gpu-20260102T030405Z.png)" in full["sweep"]
    assert f"from `../results/{newest}`, `../results/{bf16}`" in full["kernels"]
    # every block keeps its comment; every link leads to a file that exists, relative to its page
    for page, blocks in ((readme, front), (doc, full)):
        for name, block in blocks.items():
            if name in ("features", "resources"):
                continue  # no such results in this fixture: left as they were
            assert "rerun bench.py rather than editing -->" in block
            targets = re.findall(r"\]\(([^)]+)\)", block)
            assert targets and all((page.parent / t).is_file() for t in targets), (name, targets)
    assert "no features results" in out and "no resources results" in out
    code, out, _ = run(argv, capsys)  # once more: nothing to change
    assert code == 0 and out.count("already current") == 2
    assert {page: page.read_text() for page in (readme, doc)} == after


@pytest.mark.parametrize("broken", ["missing", "no markers", "malformed"])
@pytest.mark.parametrize("which", ["readme", "doc"])
def test_readme_rewrites_neither_page_if_one_is_missing_or_malformed(pages, which, broken, capsys):
    readme, doc, results = pages
    page = readme if which == "readme" else doc
    if broken == "missing":
        page.unlink()
    else:
        page.write_text("# Plain\n" if broken == "no markers" else "<!-- bench:summary:start -->\n")
    before = {p: p.read_text() for p in (readme, doc) if p.exists()}
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results)],
                       capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert {"missing": "does not exist", "no markers": "has no bench markers",
            "malformed": "bench:summary:end --> is missing"}[broken] in err and str(page) in err
    assert {p: p.read_text() for p in (readme, doc) if p.exists()} == before


def test_readme_names_sections_no_page_carries(pages, capsys):
    readme, doc, results = pages
    doc.write_text(doc.read_text().replace("<!-- bench:sweep:start -->\n<!-- bench:sweep:end -->\n", ""))
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results)],
                       capsys)
    assert code == 0
    assert "neither README.md nor results.md has bench:sweep markers; the sweep table is not shown" in err


def test_a_class_without_all_five_shapes_is_summarised_at_those_it_has(pages, capsys):
    """A low-precision run without 1x512 (the only bfloat16 result here) still gets its table, which says so."""
    readme, doc, results = pages
    (results / "kernels-fixture-gpu-20260102T030405Z-1.json").unlink()  # the bfloat16 run at all five
    partial = five_shape_result("bfloat16", date="2026-01-04T00:00:00Z")
    partial["shapes"] = partial["shapes"][1:]
    partial["rows"] = [r for r in partial["rows"] if r["shape"]["T"] != 512]
    write_result(partial, result_path("kernels", partial["setup"], results))
    code, _, err = run(["readme", "--readme", str(readme), "--results-doc", str(doc), "--results", str(results)],
                       capsys)
    assert code == 0, err
    summary = blocks_of(readme.read_text())["summary"]
    caption = ("**bfloat16**: `v04_spiky`, the fastest rung correct at the 4 GPT-2 shapes this run measured, "
               "without 1x512 (")
    assert caption in summary and "(results/kernels-fixture-gpu-20260104T000000Z.json)" in summary
    assert len(table_rows(summary, "1x512")) == 1  # float32's table only
    assert "**float32**: `v04_spiky`, the fastest rung correct at all five GPT-2 shapes" in summary
