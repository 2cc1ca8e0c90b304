#!/usr/bin/env python3
"""Save-to-report time of `lab.py watch` on the GPU, measured: for a few rungs, a watcher on a copy, then
saves that change only a comment (the source differs, so the rung is compiled again), each report's
seconds read from the watcher's own lines. Writes OUT/watch_times.json and each watcher's log.

    python3 tools/watch_demo.py --out OUT [--saves 5] [--shape 8x1024]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from tests.test_watch import REPORT, Watcher, save  # noqa: E402  (the tests' driver of a watcher)

RUNGS = (("v05", "float32"), ("v15", "bfloat16"), ("v24", "bfloat16"))
TIMED = re.compile(r"^checked and timed ([\d.]+) s after the save")
TOTAL = re.compile(r"^report ([\d.]+) s after the save")


def measure(name: str, dtype: str, shape: str, saves: int, folder: Path, out: Path) -> dict:
    source = kernels.resolve(name)
    path = folder / source.name
    shutil.copy(source, path)
    text = path.read_text()
    watcher = Watcher(path, "--shape", shape, "--dtype", dtype)
    timed, total = [], []
    try:
        watcher.until(REPORT, 600.0)  # the first report: the GPU process's warm-up included, not counted
        for n in range(saves):
            save(path, text + f"// save {n}\n")
            lines = watcher.until(TIMED, 300.0)
            lines += watcher.until(REPORT, 300.0)
            timed.append(float(TIMED.match(next(x for x in lines if TIMED.match(x))).group(1)))
            total.append(float(TOTAL.match(lines[-1]).group(1)))
            print(f"{name} {dtype} {shape}: save {n}: checked and timed after {timed[-1]:.2f} s, "
                  f"whole report after {total[-1]:.2f} s", flush=True)
        watcher.interrupt()
    finally:
        watcher.close()
        (out / f"watch_demo_{name}_{dtype}.log").write_text("\n".join(watcher.seen) + "\n")
    return {"rung": source.stem, "dtype": dtype, "shape": shape, "saves": saves,
            "checked_and_timed_s": timed, "report_s": total,
            "median_checked_and_timed_s": statistics.median(timed), "median_report_s": statistics.median(total)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--shape", default="8x1024")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name, dtype in RUNGS:
            results.append(measure(name, dtype, args.shape, args.saves, Path(folder), args.out))
    device = kernels.device_limits().name
    (args.out / "watch_times.json").write_text(json.dumps({"device": device, "results": results}, indent=2) + "\n")
    for r in results:
        print(f"{device}: {r['rung']} {r['dtype']} {r['shape']}: median save-to-report {r['median_checked_and_timed_s']:.2f} s "
              f"checked and timed, {r['median_report_s']:.2f} s with resources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
