"""v17's synccheck report, "Barrier error detected. Divergent thread(s) in warp" (kernels/
v17_decode_cluster.cu): a divergent barrier in v17, or a report of the tool's? Each case runs in a process
of its own under compute-sanitizer; the table gives its clusters, how many of them the device holds at
once, the errors the tool counted and its first report, and whether the results were right.

    python3 tools/synccheck_cluster.py                     every case under synccheck (about a minute)
    python3 tools/synccheck_cluster.py --tool racecheck    under another tool
    python3 tools/synccheck_cluster.py --case v17-97       one case, here, without the tool

The skeleton (tools/synccheck_cluster.cu) is v17's barriers and nothing else: every thread of every block
reaches every barrier, in v17's order, so a divergent-barrier report on it is the tool's. The cases vary
what the report could follow, one property at a time:
  waves    the grid's clusters against those the device holds at once: with more, later clusters start on
           SMs where earlier clusters of the same launch have finished (v17 at B 2, NH 3, T 97: 78 clusters
           of 16; at the shapes where it was clean, 16 or fewer)
  pushes   16 of 128 threads push before the last cluster barrier (v17's one-row tiles: T 97's last tile,
           every decode tile) or all 128 (tiles of 8 rows)
  size     clusters of 16 (non-portable, v17's at d = 64) or of 8
  timing   rank 0 reaching its block barrier late (v17's split 0 works through the keys while the splits
           past the last key tile have none)
  form     the cluster barrier's instructions without .aligned (cg::this_cluster().sync()'s, v17's) or with
           it (CUTLASS's)
The verdict on an H200 (driver 580): the skeleton draws the report whenever its clusters of 16 come in more
than one wave, in both forms, and never in clusters of 8 nor in one wave; v17 draws it at exactly those
shapes and is right there without the tool. tests/test_sanitize_gpu.py keeps both facts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import sanitize  # noqa: E402  (beside this file)
from sanitize_targets import attend_case, cluster_waves  # noqa: E402

CASE_MARK = "@@ case "
THREADS = 128  # v17's block
V17_SMEM = 44_288  # v17's shared memory at d = 64, B_r = 8, clusters of 16: as many skeleton blocks share an SM


@dataclass(frozen=True)
class Skeleton:
    what: str
    cluster: int  # blocks a cluster
    clusters: int  # clusters in the grid
    small_every: int  # every small_every-th cluster pushes 16 items, the others 128 (0: none does)
    late_ns: int = 0  # rank 0 reaches its block barrier this much later than the other ranks
    aligned: bool = False  # the barriers' .aligned forms (CUTLASS's), else the forms without (cg's, v17's)


@dataclass(frozen=True)
class V17:
    what: str
    shape: tuple[int, int, int, int]  # (B, NH, T_q, T_k); d = 64, float32, causal
    config: tuple | None = None  # None: the first declared, clusters of 16


CASES = {
    "skeleton-1wave": Skeleton("4 clusters of 16, every thread pushes", 16, 4, 0),
    "skeleton-1wave-16": Skeleton("4 clusters of 16, 16 threads push", 16, 4, 1),
    "skeleton-waves": Skeleton("1,024 clusters of 16, every thread pushes", 16, 1024, 0),
    "skeleton-waves-mixed": Skeleton("1,024 clusters of 16, 16 threads push in every 13th (v17 at T 97)", 16, 1024, 13),
    "skeleton-waves-late": Skeleton("1,024 clusters of 16, every thread pushes, rank 0 20 us late (v17's split 0 "
                                    "has the keys)", 16, 1024, 0, 20_000),
    "skeleton-waves-mixed-aligned": Skeleton("as skeleton-waves-mixed, the barriers' .aligned forms", 16, 1024,
                                             13, aligned=True),
    "skeleton-waves-late-aligned": Skeleton("as skeleton-waves-late, the barriers' .aligned forms", 16, 1024, 0,
                                            20_000, aligned=True),
    "skeleton8-waves-mixed": Skeleton("2,048 clusters of 8, 16 threads push in every 13th", 8, 2048, 13),
    "v17-97": V17("the reported shape: B 2, NH 3, T 97 (its last tile one row)", (2, 3, 97, 97)),
    "v17-97-1wave": V17("B 1, NH 1, T 97", (1, 1, 97, 97)),
    "v17-64-waves": V17("B 4, NH 8, T 64: every tile 8 rows", (4, 8, 64, 64)),
    "v17-decode": V17("a decode step: B 1, NH 12, 1 query x 1,000 keys", (1, 12, 1, 1000)),
    "v17-decode-waves": V17("a decode step: B 16, NH 16, 1 query x 1,000 keys", (16, 16, 1, 1000)),
    "v17-97-cluster8": V17("the reported shape, clusters of 8 (config 64, 8, 64, 0, 8)", (2, 3, 97, 97),
                           (64, 8, 64, 0, 8)),
}


def skeleton_expected(case: Skeleton) -> np.ndarray:
    """out as the skeleton leaves it: sum over ranks s of (s + i) below a cluster's items, NaN above."""
    C = case.cluster
    c, i = np.arange(case.clusters)[:, None], np.arange(THREADS)[None, :]
    small = (case.small_every > 0) & (c % max(case.small_every, 1) == case.small_every - 1)
    items = np.where(small, 16, THREADS)
    return np.where(i < items, C * i + C * (C - 1) // 2, np.nan).astype(np.float32)


def run_skeleton(cp, driver, case: Skeleton) -> tuple[bool, int, int]:
    expression = f"cluster_skeleton<{case.cluster}, {'true' if case.aligned else 'false'}>"
    fn = cp.RawModule(code=(HERE / "synccheck_cluster.cu").read_text(), name_expressions=[expression]).get_function(expression)
    if case.cluster > 8:
        driver.allow_non_portable_clusters(fn)
    smem = max(V17_SMEM, 4 * case.cluster * THREADS)
    grid = case.clusters * case.cluster
    resident = driver.max_active_clusters(fn, grid, THREADS, case.cluster, smem)
    out = cp.full(case.clusters * THREADS, cp.nan, dtype=cp.float32)
    fn((grid,), (THREADS,), (out, np.int32(case.small_every), np.int64(case.late_ns)), shared_mem=smem)
    got = cp.asnumpy(out).reshape(case.clusters, THREADS)
    return bool(np.array_equal(got, skeleton_expected(case), equal_nan=True)), resident, case.clusters


def run_v17(cp, driver, case: V17) -> tuple[bool, int, int]:
    import kernels

    B, NH, T_q, T_k = case.shape
    inst = kernels.instance("v17", 64, case.config, dtype="float32")  # what kernels.attention launches
    clusters, resident = cluster_waves(inst, (B, NH, NH, T_q, T_k, 64))
    ok = attend_case(cp, "v17_decode_cluster", "float32", (B, NH, NH, T_q, T_k, 64), config=case.config)
    return ok, resident, clusters


def run_case(name: str) -> int:
    import cupy as cp

    from kernels import driver

    case = CASES[name]
    ok, resident, clusters = (run_skeleton if isinstance(case, Skeleton) else run_v17)(cp, driver, case)
    cp.cuda.Device().synchronize()
    print(f"{CASE_MARK}{name} {clusters} {resident} {'right' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def under_tool(sanitizer: str, tool: str, name: str, timeout: float) -> dict:
    """One case in a child process under the tool: its clusters, resident clusters, errors, first report, result."""
    child, fields = sanitize.case_under_tool(sanitizer, tool, __file__, name, timeout, CASE_MARK)
    clusters, resident, result = fields[1:4] if isinstance(fields, list) else ("?", "?", fields)
    first = child.reports[0] if child.reports else None
    report = f"{first.text} ({first.kernel or 'no kernel named'})" if first else "-"
    return {"case": name, "clusters": clusters, "resident": resident, "errors": child.summary, "result": result,
            "report": report}


def verdict(rows: list[dict]) -> str:
    def drew(cases):
        return [r["case"] for r in rows if r["case"] in cases and (r["errors"] or 0) > 0]

    plain = drew([n for n, c in CASES.items() if isinstance(c, Skeleton) and not c.aligned])
    aligned = drew([n for n, c in CASES.items() if isinstance(c, Skeleton) and c.aligned])
    v17 = drew([n for n, c in CASES.items() if isinstance(c, V17)])
    if aligned:
        return (f"The skeleton draws the report with the .aligned barriers too ({', '.join(aligned)}): every thread "
                f"of it reaches every barrier converged, so the report is the tool's; v17: {', '.join(v17) or 'clean'}.")
    if plain:
        return (f"The skeleton draws the report with the barriers without .aligned (v17's: {', '.join(plain)}) and "
                f"not with the .aligned forms: v17 {'draws it (' + ', '.join(v17) + ')' if v17 else 'is clean'}; the "
                f".aligned forms would clear it.")
    if v17:
        return (f"Only v17 draws the report ({', '.join(v17)}); the skeleton is clean: v17's report stands, and the "
                f"cases that draw it say what it follows.")
    return "No case draws the report."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), help="run one case here, without the tool")
    parser.add_argument("--tool", choices=sanitize.TOOLS, default="synccheck")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a case may run under the tool")
    args = parser.parse_args(argv)
    if args.case:
        return run_case(args.case)
    rows = sanitize.cases_under_tool(
        CASES, lambda sanitizer, name: under_tool(sanitizer, args.tool, name, args.timeout),
        lambda name, r: f"{name:22s} clusters {r['clusters']:>5}, resident {r['resident']:>4}, {args.tool} errors "
                        f"{r['errors']}, result {r['result']}: {r['report']}")
    return sanitize.told(rows, CASES, verdict)


if __name__ == "__main__":
    sys.exit(main())
