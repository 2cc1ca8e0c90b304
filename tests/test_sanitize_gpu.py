"""The two rungs compute-sanitizer once reported, under the tool that reported them, and the tool itself.

v17 under synccheck: the tool reports "Divergent thread(s) in warp" at v17's cluster barriers whenever its
clusters of 16 come in more than one wave, and at the same barriers alone (tools/synccheck_cluster.cu, every
thread at every barrier, converged) in both barrier forms: the report is the tool's. So v17 is held to
  - a right result at the reported shape (B 2, NH 3, T 97: 78 clusters of 16), without the tool, and a
    clean memcheck there;
  - a clean synccheck where the tool is sound: the reported shape in clusters of 8, and one wave of 16;
and the tool to its report on the skeleton, so that a release which stops drawing it fails here and
tells us to hold v17 to a clean synccheck at the reported shape again.
v23 under initcheck at --quick's launch (odd lengths, T_q != T_k, grouped-query heads).
Each runs in a child process under compute-sanitizer; skipped where the tool is not installed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS_DIR))

import sanitize  # noqa: E402
import sanitize_targets as targets  # noqa: E402
import synccheck_cluster  # noqa: E402

pytestmark = pytest.mark.gpu
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
needs_tool = pytest.mark.skipif(not Path(SANITIZER).exists(), reason="compute-sanitizer not installed")
REPRODUCER = str(TOOLS_DIR / "synccheck_cluster.py")


def under(tool: str, *command: str) -> tuple[sanitize.Child, str]:
    cmd = [SANITIZER, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20", sys.executable, *command]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=540,
                          cwd=TOOLS_DIR.parent)
    return sanitize.parse(done.stdout.splitlines()), done.stdout[-4000:]


def ran_right(case: str, tail: str) -> bool:
    """Whether the reproducer's case ran to its end and found its result right (its `@@ case` line)."""
    return any(line.startswith(f"{synccheck_cluster.CASE_MARK}{case} ") and line.endswith(" right")
               for line in tail.splitlines())


def test_v17_is_right_at_the_reported_shape_in_clusters_of_16():
    """(a) The rung's result, no tool: the reported shape in the configuration kernels.attention takes."""
    assert synccheck_cluster.run_case("v17-97") == 0


@needs_tool
def test_v17_is_clean_under_memcheck_at_the_reported_shape():
    """(a) memcheck at the reported shape, clusters of 16 in more than one wave."""
    child, tail = under("memcheck", REPRODUCER, "--case", "v17-97")
    assert child.summary == 0 and not child.reports, tail
    assert ran_right("v17-97", tail), tail


@needs_tool
@pytest.mark.parametrize("case", ["v17-97-cluster8", "v17-97-1wave"])
def test_v17_is_clean_under_synccheck_where_the_tool_is_sound(case):
    """(b) synccheck where it is sound: the reported shape in clusters of 8 (config (64, 8, 64, 0, 8)), and
    clusters of 16 in one wave (B 1, NH 1, T 97: every cluster resident at once)."""
    child, tail = under("synccheck", REPRODUCER, "--case", case)
    assert child.summary == 0 and not child.reports, tail
    assert ran_right(case, tail), tail


@needs_tool
def test_synccheck_still_reports_the_skeleton_whose_barriers_are_right():
    """(c) The tool's behaviour, not the lab's: v17's barriers alone, .aligned (every lane of every warp at
    the same instruction, converged), clusters of 16 over several waves. If this fails, the tool no longer
    draws the report: hold v17 to a clean synccheck at the reported shape in clusters of 16 again (a test
    here, and sanitize_targets.synccheck_launches back to the configurations the other tools run)."""
    child, tail = under("synccheck", REPRODUCER, "--case", "skeleton-waves-mixed-aligned")
    assert child.summary and child.reports, tail
    first = child.reports[0]
    assert "Divergent thread(s) in warp" in first.text and first.kernel.startswith("cluster_skeleton<"), tail


@needs_tool
def test_v23_is_clean_under_initcheck():
    child, tail = under("initcheck", str(TOOLS_DIR / "sanitize_targets.py"), "--quick", "v23_pingpong")
    mine = [r for r in child.reports if r.target != targets.SETUP and r.error]
    assert not mine, tail
    assert child.status.get("v23_pingpong") == "ok", tail
