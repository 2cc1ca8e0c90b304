"""The two rungs compute-sanitizer once reported, under the tool that reported them: v17 under synccheck at
the shape where it reported a divergent barrier (B 2, NH 3, T 97: clusters of 16 in more than one wave),
and v23 under initcheck at --quick's launch (odd lengths, T_q != T_k, grouped-query heads). Each runs in a
child process under compute-sanitizer; skipped where the tool is not installed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS_DIR))

import sanitize  # noqa: E402
import sanitize_targets as targets  # noqa: E402

pytestmark = pytest.mark.gpu
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
needs_tool = pytest.mark.skipif(not Path(SANITIZER).exists(), reason="compute-sanitizer not installed")


def under(tool: str, *command: str) -> tuple[sanitize.Child, str]:
    cmd = [SANITIZER, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20", sys.executable, *command]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=540,
                          cwd=TOOLS_DIR.parent)
    return sanitize.parse(done.stdout.splitlines()), done.stdout[-4000:]


@needs_tool
def test_v17_is_clean_under_synccheck_at_the_reported_shape():
    child, tail = under("synccheck", str(TOOLS_DIR / "synccheck_cluster.py"), "--case", "v17-97")
    assert child.summary == 0 and not child.reports, tail
    assert "v17-97" in tail and "right" in tail, tail  # the launch ran to the end, and its result is right


@needs_tool
def test_v23_is_clean_under_initcheck():
    child, tail = under("initcheck", str(TOOLS_DIR / "sanitize_targets.py"), "--quick", "v23_pingpong")
    mine = [r for r in child.reports if r.target != targets.SETUP and r.error]
    assert not mine, tail
    assert child.status.get("v23_pingpong") == "ok", tail
