"""docs/ladder.md's sanitizer table (benchmarks/sanitize_report.py) from tools/sanitize.py --json files."""

import json

from benchmarks.sanitize_report import cell, group_of, newest_per_group, render_sanitize

TOOLS = ["memcheck", "racecheck", "initcheck", "synccheck"]


def result(group, cells, quick=False, **extra):
    return {"command": f"python3 tools/sanitize.py --group {group} --json x.json", "quick": quick, "tools": TOOLS,
            "targets": list(cells), "cells": cells, "setup": {"device": "H200", "git": "abc"},
            "tool_seconds": {t: 1.0 for t in TOOLS}, "notes": {}, "problems": [], **extra}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_the_group_comes_from_the_field_or_else_the_command():
    assert group_of({"group": "fused", "command": "--group step"}) == "fused"
    assert group_of({"command": "python3 tools/sanitize.py --group backward --timeout 420"}) == "backward"
    assert group_of({"command": "python3 tools/sanitize.py --only v0*,v1* --json f"}) == "v0*,v1*"
    assert group_of({"command": "python3 tools/sanitize.py --quick"}) == "everything"


def test_the_newest_full_run_of_each_group_is_kept_then_the_newest_quick_run(tmp_path):
    clean = {"b01": {t: 0 for t in TOOLS}}
    old = write(tmp_path, "sanitize-backward-nvidia-h200-20261101T000000Z.json", result("backward", clean))
    new = write(tmp_path, "sanitize-backward-nvidia-h200-20261102T000000Z.json", result("backward", clean))
    quick = write(tmp_path, "sanitize-quick-nvidia-h200-20261103T000000Z.json",
                  result("everything", clean, quick=True, parallel=True))
    older_quick = write(tmp_path, "sanitize-quick-nvidia-h200-20261102T000000Z.json",
                        result("everything", clean, quick=True))
    step = write(tmp_path, "sanitize-step-nvidia-h200-20261101T000000Z.json", result("step", clean))
    entries = newest_per_group([quick, older_quick, step, new, old])
    assert [p for p, _ in entries] == [new, step, quick]  # tools/sanitize.py's order of groups, the quick run last
    text = render_sanitize(entries, str)
    assert "| everything (--quick --parallel) | 1 |" in text and "| backward | 1 |" in text


def test_a_cell_names_the_targets_with_errors_and_the_skipped_ones():
    r = result("forward", {"v01": {"memcheck": 0, "racecheck": 3}, "v02": {"memcheck": 0, "racecheck": 2},
                           "v25": {"memcheck": "skipped: needs sm_90", "racecheck": 0}})
    assert cell(r, "racecheck") == "**5** (v01 3, v02 2)"
    assert cell(r, "memcheck") == "0; v25: skipped: needs sm_90"
    assert cell(dict(r, tools=["memcheck"]), "racecheck") == "not run"
    floors = result("fused", {"fused-float32": {"initcheck": "0+"}, "fused-float32 in cupy_add": {"initcheck": 100},
                              "fused/adamw": {"initcheck": "0 not launched"}})
    assert cell(floors, "initcheck") == "**100+** (fused-float32 in cupy_add 100)"
    # a child stopped before naming the files it launched: its file's reports still count
    stopped = result("train", {"train-bfloat16": {"initcheck": "0+ timed out"},
                               "fused/train": {"initcheck": "100 not launched"}})
    assert cell(stopped, "initcheck") == "**100** (fused/train 100); train-bfloat16: 0+ timed out"


def test_the_table_links_each_file_and_carries_the_notes(tmp_path):
    r = result("forward", {"v17": {t: 0 for t in TOOLS}}, notes={"v17": {"synccheck": "clusters of 16 only"}})
    path = write(tmp_path, "sanitize-forward-nvidia-h200-20261101T000000Z.json", r)
    text = render_sanitize([(path, r)], lambda p: "../results/" + p.name)
    assert f"| forward | 1 | 0 | 0 | 0 | 0 | 1 / 1 / 1 / 1 | [{path.name}](../results/{path.name}) |" in text
    assert "- v17 under synccheck: clusters of 16 only" in text
    twice = render_sanitize([(path, r), (path, dict(r, quick=True))], str)
    assert twice.count("- v17 under synccheck: clusters of 16 only") == 1  # a note two runs carry, told once
    assert "commit abc" in text
    checked = dict(r, initcheck_library="small-workspace")
    assert "| forward (initcheck: cuBLAS small-workspace) | 1 |" in render_sanitize([(path, checked)], str)
