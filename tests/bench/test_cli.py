"""bench.py's command line: help, argument parsing and its errors, defaults, where results are written."""


import ast
from pathlib import Path

import pytest

import bench
import kernels
from benchmarks import cli, features, results
from tests.bench.helpers import RUNGS, run


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
    assert cli.parse_shape(text) == expected


@pytest.mark.parametrize("bad", ["8x", "x1024", "0x512", "8x0", "8*1024", "8x1024x2", "abc", "-1x5", ""])
def test_bad_shape_strings_are_rejected(bad, capsys):
    with pytest.raises(Exception, match="BxT"):
        cli.parse_shape(bad)
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
    assert [p.stem for p in cli.kernel_list(f"{short},{first}")] == [first, first]
    assert [p.stem for p in cli.kernel_list("all")] == RUNGS
    assert cli.peer_list("sdpa_efficient, reference") == ["sdpa_efficient", "reference"]
    assert cli.peer_list("none") == []


def test_default_kernels_are_every_whole_sequence_rung(monkeypatch):
    """Decode (split-KV) rungs are timed on whole sequences only when named, and so are FP8 rungs (they
    quantize their inputs: bench.py fp8 measures them); resources lists all."""
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "kernels", lambda args: seen.setdefault("args", args) and 0)
    monkeypatch.setitem(cli.COMMANDS, "resources", lambda args: seen.setdefault("res", args) and 0)
    assert bench.main(["kernels", "--shape", "2x64"]) == 0
    args = seen["args"]
    assert [p.stem for p in args.kernels] == [n for n in RUNGS if not kernels.load(n).split_kv
                                              and not kernels.load(n).fp8 and "float32" in kernels.load(n).dtypes]
    seen.clear()
    assert bench.main(["kernels", "--dtype", "bfloat16"]) == 0
    bf16 = [p.stem for p in seen["args"].kernels]
    assert bf16 and bf16 == [n for n in RUNGS if not kernels.load(n).split_kv and not kernels.load(n).fp8
                             and "bfloat16" in kernels.load(n).dtypes]
    assert any(kernels.load(n).fp8 and "bfloat16" in kernels.load(n).dtypes for n in RUNGS)  # one was left out
    assert bench.main(["resources"]) == 0
    assert [p.stem for p in seen["res"].kernels] == RUNGS
    assert args.shape == [(2, 64)] and args.dtype == "float32" and args.peers is None
    assert args.argv == ["kernels", "--shape", "2x64"]


def test_features_arguments_and_defaults(monkeypatch):
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "features", lambda args: seen.setdefault("args", args) and 0)
    assert bench.main(["features"]) == 0
    args = seen.pop("args")
    assert args.parts == list(features.FEATURE_PARTS) == ["decode", "long", "noncausal", "cross", "gqa", "heads"]
    assert args.dtypes == ["float32", "bfloat16"]
    assert args.kernels is None  # features picks rungs per case, not the kernels subcommand's default
    assert (args.caches, args.reps, args.budget_ms, args.seed) == (24, 10, 100.0, 0)
    assert args.results == results.SCRATCH  # results/ only with --save
    assert bench.main(["features", "--parts", "gqa,decode,gqa", "--dtypes", "bfloat16", "--kernels", "v13,v16",
                       "--caches", "3", "--reps", "2", "--budget-ms", "5"]) == 0
    args = seen.pop("args")
    assert args.parts == ["gqa", "decode"] and args.dtypes == ["bfloat16"]
    assert [p.stem for p in args.kernels] == [kernels.resolve("v13").stem, kernels.resolve("v16").stem]
    assert (args.caches, args.reps, args.budget_ms) == (3, 2, 5.0)
    assert cli.part_list("all") == list(features.FEATURE_PARTS)


@pytest.mark.parametrize("command", [["kernels"], ["sweep"], ["e2e"], ["resources"], ["features"]])
def test_results_go_to_scratch_unless_saved_or_named(command, monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setitem(cli.COMMANDS, command[0], lambda args: seen.append(args.results) or 0)
    for extra in ([], ["--save"], ["--results", str(tmp_path)]):
        assert bench.main([*command, *extra]) == 0
    assert seen == [results.SCRATCH, results.RESULTS, tmp_path]
    assert results.SCRATCH == results.RESULTS / "scratch"
    code, _, err = run([*command, "--save", "--results", str(tmp_path)], capsys)
    assert code == 2 and "not allowed with" in err
    code, out, _ = run([*command, "--help"], capsys)
    assert "--save" in out and "results/scratch/, git-ignored" in out


def test_the_wrote_line_says_how_to_keep_a_scratch_result(tmp_path):
    scratch = results.SCRATCH / "kernels-x-20260102T030405Z.json"
    assert results.wrote(scratch) == f"wrote {scratch} (scratch, git-ignored: --save writes into results/)"
    saved = results.RESULTS / "sweep-x-20260102T030405Z.json"
    assert results.wrote(saved, "sweep-x-20260102T030405Z.png", None) == f"wrote {saved} and sweep-x-20260102T030405Z.png"
    assert results.wrote(tmp_path / "a.json") == f"wrote {tmp_path / 'a.json'}"


def test_bench_chooses_a_model_family_once_and_never_branches_on_its_name():
    """No comparison of a value with a family's or a size's name (`model == "gpt2"`, `family.name in (...)`)
    where bench.py runs a model (e2e, e2e --sizes, their command line): what differs between the families
    is lm.family.Family's to supply. (readme.py orders the results files, GPT-2 small's first.)"""
    import gpt2
    import llama
    from benchmarks.results import E2E_MODEL

    names = {E2E_MODEL, gpt2.FAMILY.name, llama.FAMILY.name, *gpt2.SIZES, *llama.SIZES}
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in [root / "bench.py", *(root / "benchmarks" / name for name in ("cli.py", "e2e.py", "scale.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                consts = {c.value for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)}
                if consts & names:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
