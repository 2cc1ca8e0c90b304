"""Result files: <folder>/<subcommand>-<device>-<UTC timestamp>.json, strict JSON, never overwritten.
They go into results/scratch/ (git-ignored) unless asked: --save writes into results/, the files the
docs cite; --results DIR into DIR."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from .device import ROOT, device_slug

RESULTS = ROOT / "results"  # the results the docs cite: written only with --save
SCRATCH = RESULTS / "scratch"  # every other run's (git-ignored)
SCHEMA = 1
SECTIONS = ("kernels", "sweep", "e2e", "resources", "features", "frontier", "fp8", "profile", "levels", "scale",
            "backward", "train", "envelope")  # result kinds, and the docs' sections

# what `bench.py e2e --model` runs: a name -> what the tables call it (random weights, shaped as named)
E2E_MODELS = {"gpt2": "GPT-2 small", "llama-3.2-1b": "Llama 3.2 1B", "llama-3.2-3b": "Llama 3.2 3B",
              "llama-3.1-8b": "Llama 3.1 8B"}
E2E_MODEL = "gpt2"  # without --model


def e2e_model(result: dict) -> str:
    """The model an e2e result ran (its setup's "model"); results written before Llama name none: GPT-2 small."""
    return result["setup"].get("model", E2E_MODEL)


# kind-device-stamp[-n].json; a before/after run (kind-before-after-WHAT-device-stamp.json, bench.py compare's
# input) is not a result of its kind: the tables show the newest full run, not a comparison's cases.
_RESULT_NAME = re.compile(r"^(?P<kind>[a-z0-9]+)-(?!before-after-)(?P<device>[a-z0-9-]+)-(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<n>\d+))?\.json$")


def jsonable(x):
    """NumPy scalars to Python, NaN and infinity to None: result files are strict JSON."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def result_path(kind: str, setup: dict, folder: Path, fallback_slug: str = "nogpu") -> Path:
    """A new file name: the kind, the device, the setup's UTC date; -1, -2 ... on a clash."""
    stamp = setup["date"].replace("-", "").replace(":", "")  # 2026-11-21T21:30:00Z -> 20261121T213000Z
    base = f"{kind}-{device_slug(setup, fallback_slug)}-{stamp}"
    path, n = folder / f"{base}.json", 0
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}.json"
    return path


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(jsonable(result), indent=1, allow_nan=False)
    with open(path, "x") as f:  # never overwrite a result
        f.write(text + "\n")
    return path


def write_tool_result(kind: str, tool: str, argv: list[str], payload: dict, folder: Path) -> Path:
    """A tool's measurement (tools/wgmma_rate.py, rung_trace.py, step_trace.py) as a result file the docs can
    cite: `kind`-<device>-<UTC time>.json in folder, with the header bench.py's results carry (device, driver,
    versions, date, git) and the tool's own command line."""
    import shlex

    from .device import setup_info

    setup = setup_info([])
    setup["command"] = shlex.join(["python3", tool, *argv])
    return write_result({"schema": SCHEMA, "kind": kind, "setup": setup, **payload}, result_path(kind, setup, folder))


def wrote(path: Path, *others: str | None) -> str:
    """The line a subcommand ends with: where its files went, and for scratch how to keep them."""
    text = f"wrote {path}" + "".join(f" and {other}" for other in others if other)
    if SCRATCH.resolve() in path.resolve().parents:
        text += " (scratch, git-ignored: --save writes into results/)"
    return text


def newest_results(folder: Path) -> dict[str, list[Path]]:
    """Result files of each kind, newest first (by the UTC stamp in the name)."""
    found: dict[str, list[tuple]] = {k: [] for k in SECTIONS}
    for p in folder.glob("*.json") if folder.is_dir() else []:
        m = _RESULT_NAME.match(p.name)
        if m and m["kind"] in found:
            found[m["kind"]].append((m["stamp"], int(m["n"] or 0), p))
    return {k: [p for *_, p in sorted(v, reverse=True)] for k, v in found.items()}


def load_result(path: Path) -> dict:
    return json.loads(path.read_text())
