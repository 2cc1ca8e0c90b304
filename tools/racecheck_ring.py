"""decode_step's racecheck report at float32's default ring, "Race reported between Write access at
bulk_copy ... and Read access at rows_dot ..." (kernels/fused/decode_step.cu, 2 slots; 3 slots clean): a
race in the weight stream, or a report of the tool's? Each case runs in a process of its own under
compute-sanitizer; the table gives the errors the tool counted, its first report, and whether the sums
were right.

    python3 tools/racecheck_ring.py                  every case under racecheck (about two minutes)
    python3 tools/racecheck_ring.py --case ring2     one case, here, without the tool

The skeleton (tools/racecheck_ring.cu) is decode_step's weight stream and nothing else: a producer lane's
cp.async.bulk copies into a ring of slots, full and empty mbarriers, compute threads that read each slot
with plain loads and release it by a named barrier and thread 0's arrival. The cases vary what the report
could follow, one property at a time:
  slots    2 (float32's default ring at GPT-2 small's widths) or 3 (bfloat16's, and float32's ring 3)
  arrival  thread 0 arrives on the empty barrier for the compute threads (decode_step's), or every one of
           them arrives itself (kernels/backward/b05_wgmma.cu's fix of a racecheck report)
  timing   decode_step's (the producer 550 ns after a release, the compute threads at once), every wait
           begun before its copy is issued (the producer issues 200 us after thread 0 begins to wait), or
           every copy landed before its wait (the compute threads 200 us before each wait)
  recheck  one mbarrier.test_wait more after the wait's loop, which finds the phase complete at once
and decode_step itself, at 2 and 3 slots (tools/sanitize_targets.py's step targets).
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

CASE_MARK = "@@ case "
THREADS = 320  # the skeleton's compute threads (decode_step's), then the producer warp
ITEMS, BLOCKS, SLOT_FLOATS = 24, 2, 16384  # items of 64 KB, each block the same items
LONG_NS = 200_000  # a pause far longer than a 64 KB copy takes, under the tool too


@dataclass(frozen=True)
class Ring:
    what: str
    slots: int
    all_arrive: bool = False
    issue_ns: int = 550  # the producer's pause after a release (decode_step's ISSUE_DELAY_NS in float32)
    wait_first: bool = False  # each copy issued issue_ns after thread 0 began its wait for it
    take_ns: int = 0  # the compute threads' pause before each wait
    recheck: bool = False


@dataclass(frozen=True)
class Step:
    what: str
    target: str  # tools/sanitize_targets.py's engine target


CASES = {
    "ring2": Ring("2 slots, decode_step's arrival and timing", 2),
    "ring3": Ring("3 slots, decode_step's arrival and timing", 3),
    "ring2-all": Ring("2 slots, every compute thread arrives", 2, all_arrive=True),
    "ring2-waits": Ring("2 slots, every wait begun before its copy is issued", 2, issue_ns=LONG_NS, wait_first=True),
    "ring2-landed": Ring("2 slots, every copy landed before its wait", 2, take_ns=LONG_NS),
    "ring2-all-waits": Ring("2 slots, every compute thread arrives, every wait before its copy", 2, True, LONG_NS,
                            wait_first=True),
    "ring2-all-landed": Ring("2 slots, every compute thread arrives, every copy before its wait", 2, True,
                             take_ns=LONG_NS),
    "ring3-waits": Ring("3 slots, every wait begun before its copy is issued", 3, issue_ns=LONG_NS, wait_first=True),
    "ring2-waits-recheck": Ring("as ring2-waits, a test_wait after each wait", 2, issue_ns=LONG_NS, wait_first=True,
                                recheck=True),
    "step-float32": Step("decode_step, float32, its default ring (2 slots)", "step-float32"),
    "step-float32-ring3": Step("decode_step, float32, 3 slots", "step-float32-ring3"),
}


def ring_source() -> np.ndarray:
    """The items the skeleton streams, (ITEMS, SLOT_FLOATS): small integers, so that every sum is exact, and
    a slot read holding another item's values (a copy landed too late or too early) changes the sum."""
    i, k = np.arange(ITEMS)[:, None], np.arange(SLOT_FLOATS)[None, :]
    return (i % 5 + k % 3).astype(np.float32)


def ring_expected(src: np.ndarray) -> np.ndarray:
    """out as the skeleton leaves it, (BLOCKS, THREADS): thread t's sum of every THREADS-th 16-byte vector
    from vector t, over the items."""
    vectors = src.reshape(ITEMS, -1, 4).sum(axis=(0, 2))  # per vector, over items
    per_thread = np.zeros(THREADS, dtype=np.float64)
    np.add.at(per_thread, np.arange(vectors.size) % THREADS, vectors)
    return np.tile(per_thread.astype(np.float32), (BLOCKS, 1))


def run_ring(cp, case: Ring) -> bool:
    fn = cp.RawModule(code=(HERE / "racecheck_ring.cu").read_text(), options=("-lineinfo",)).get_function("ring")
    smem = 128 + case.slots * SLOT_FLOATS * 4
    fn.max_dynamic_shared_size_bytes = smem
    src = ring_source()
    out = cp.full((BLOCKS, THREADS), cp.nan, dtype=cp.float32)
    fn((BLOCKS,), (THREADS + 32,), (cp.asarray(src), np.int32(ITEMS), np.int32(case.slots), np.int32(SLOT_FLOATS),
                                   np.int32(case.all_arrive), np.int32(case.recheck), np.uint32(case.issue_ns),
                                   np.int32(case.wait_first), np.uint32(case.take_ns),
                                   cp.zeros(BLOCKS, dtype=cp.int32), out), shared_mem=smem)
    return bool(np.array_equal(cp.asnumpy(out), ring_expected(src)))


def run_case(name: str) -> int:
    import cupy as cp

    case = CASES[name]
    if isinstance(case, Ring):
        ok = run_ring(cp, case)
    else:
        import sanitize_targets

        from kernels import fused

        fused.function = sanitize_targets.with_line_info(fused.function)  # reports name decode_step's lines
        ok = sanitize_targets.engine_target(cp, case.target) == "ok"
    cp.cuda.Device().synchronize()
    print(f"{CASE_MARK}{name} {'right' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def under_tool(sanitizer: str, tool: str, name: str, timeout: float) -> dict:
    """One case in a child process under the tool: its errors, first report and result."""
    child, fields = sanitize.case_under_tool(sanitizer, tool, __file__, name, timeout, CASE_MARK)
    result = " ".join(fields[1:]) if isinstance(fields, list) else fields
    first = child.reports[0] if child.reports else None
    return {"case": name, "errors": child.summary, "result": result, "report": first.text if first else "-"}


def verdict(rows: list[dict]) -> str:
    drew = {r["case"] for r in rows if (r["errors"] or 0) > 0}
    rings = {n: c for n, c in CASES.items() if isinstance(c, Ring) and n in {r["case"] for r in rows}}
    skeleton = sorted(drew & set(rings))
    step = "decode_step draws it at 2 slots" if "step-float32" in drew else "decode_step is clean at 2 slots"
    if not skeleton:
        if "step-float32" in drew:
            return ("The skeleton is clean and decode_step draws the report: it follows something decode_step does "
                    "beyond the stream's protocol, and stands until that is found.")
        return f"No skeleton case draws the report; {step}."
    one = [n for n in skeleton if not rings[n].all_arrive]
    every = [n for n in skeleton if rings[n].all_arrive]
    waits = [n for n in skeleton if rings[n].wait_first]
    landed = [n for n, c in rings.items() if c.take_ns >= LONG_NS]
    if one and not every and any(rings[n].all_arrive for n in rings):
        return (f"Thread 0's arrival for the compute threads draws the report ({', '.join(one)}) and every thread's "
                f"own arrival clears it (b05's case): decode_step's empty barriers want THREADS arrivals; {step}.")
    if waits and not set(landed) & drew:
        recheck = [n for n in rings if rings[n].recheck]
        cleared = (" A test_wait after the wait clears it." if recheck and not set(recheck) & drew
                   else " A test_wait after the wait does not clear it." if recheck else "")
        return (f"The report follows the timing, whichever threads arrive: waits begun before their copy draw it "
                f"({', '.join(waits)}), copies landed before their wait are clean ({', '.join(landed)}). The phase "
                f"a thread's wait observes completes with the copy's bytes, so the report is the tool's; "
                f"{step}.{cleared}")
    return f"The report follows no one property of the skeleton's: {', '.join(skeleton)} draw it; {step}."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), help="run one case here, without the tool")
    parser.add_argument("--tool", choices=sanitize.TOOLS, default="racecheck")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a case may run under the tool")
    args = parser.parse_args(argv)
    if args.case:
        return run_case(args.case)
    rows = sanitize.cases_under_tool(
        CASES, lambda sanitizer, name: under_tool(sanitizer, args.tool, name, args.timeout),
        lambda name, r: f"{name:22s} {args.tool} errors {r['errors']}, result {r['result']}: {r['report']}")
    return sanitize.told(rows, CASES, verdict)


if __name__ == "__main__":
    sys.exit(main())
