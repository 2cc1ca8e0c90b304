"""initcheck's reports in CuPy's element-wise kernels (the fused, step and llama groups of tools/sanitize.py:
"Uninitialized __global__ memory read" in cupy_multiply, cupy_true_divide, cupy_add, no row of a lab
kernel): uninitialized memory in the lab's reference path, or stores of cuBLAS's kernels that the tool
does not see? Each case runs in a process of its own under compute-sanitizer's initcheck; the table gives
the errors the tool counted, its first report, and whether the result was right.

    python3 tools/initcheck_library.py                     every case under initcheck (under a minute)
    python3 tools/initcheck_library.py --case matmul-new   one case, here, without the tool

Every case writes every element of `c` before an element-wise kernel reads all of it (c * 2), and checks
the product against NumPy's. What differs is who writes c, and into what memory:
  matmul-new     c = a @ b: CuPy allocates c (uninitialized) and cuBLAS writes it, as the reference
                 attention's S = q @ k^T before S * scale
  matmul-empty   cp.matmul(a, b, out=c) into c = cp.empty(...)
  matmul-zeros   the same into c = cp.zeros(...): the bytes were set by a memset before cuBLAS's kernel
  batched-new    c = q @ k^T on (1, 12, 5, 64) float32 operands, the reference attention's first product
  dgemm-new      c = a @ b in float64 (DGEMM): the step group's float32 reports are in cupy_add__float64
  random-ints    c = CuPy's Generator.integers(...) cast to int32, as the train targets' batch is drawn, read
                 by a kernel (c * 2): the train group's reports read such a batch (softmax_xent's targets)
  kernel-empty   c = cp.empty(...), written by a CuPy element-wise kernel (cp.add(a, 1, out=c)): the control
If the matmul cases other than matmul-zeros draw reports and kernel-empty does not, initcheck does not see
the stores of cuBLAS's kernels here, and a CuPy kernel's report after a product is the tool's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import sanitize  # noqa: E402  (beside this file)

CASE_MARK = "@@ case "
CASES = ("matmul-new", "matmul-empty", "matmul-zeros", "batched-new", "dgemm-new", "random-ints", "kernel-empty")
LIBRARY = ("matmul-new", "matmul-empty", "batched-new", "dgemm-new", "random-ints")  # a library writes c, unset before


def operands(cp, name: str):
    """(a, b) float32 on the device and what c should be (NumPy, float64 arithmetic)."""
    rng = np.random.default_rng(0)
    if name == "random-ints":
        return cp.random.default_rng(0).integers(0, 1000, (2, 97)), None, None
    if name == "batched-new":
        q, k = (rng.standard_normal((1, 12, 5, 64)).astype(np.float32) for _ in range(2))
        return cp.asarray(q), cp.asarray(k).swapaxes(-1, -2), q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)
    a = rng.standard_normal((5, 768)).astype(np.float32)  # a prompt's rows by GPT-2 small's width
    b = rng.standard_normal((768, 2304)).astype(np.float32)  # c_attn's weight
    if name == "dgemm-new":
        a, b = a.astype(np.float64), b.astype(np.float64)
    want = a.astype(np.float64) + 1 if name == "kernel-empty" else a.astype(np.float64) @ b.astype(np.float64)
    return cp.asarray(a), cp.asarray(b), want


def run_case(name: str) -> int:
    import cupy as cp

    a, b, want = operands(cp, name)
    if name == "random-ints":
        c = a.astype(cp.int32)
        want = cp.asnumpy(a).astype(np.float64)  # the draw read back by a copy: then the kernel's read below
    elif name in ("matmul-new", "batched-new", "dgemm-new"):
        c = a @ b
    elif name == "kernel-empty":
        c = cp.empty(a.shape, dtype=cp.float32)
        cp.add(a, 1, out=c)
    else:
        c = (cp.empty if name == "matmul-empty" else cp.zeros)((a.shape[0], b.shape[1]), dtype=cp.float32)
        cp.matmul(a, b, out=c)
    doubled = cp.asnumpy(c * 2)  # the element-wise read the tool checks
    ok = np.allclose(doubled, 2 * want, rtol=1e-2, atol=1e-2)  # TF32 may be on: a loose bound, a wrong c fails it
    print(f"{CASE_MARK}{name} {'right' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def under_tool(sanitizer: str, name: str, timeout: float) -> dict:
    """One case in a child process under initcheck: errors, first report, result."""
    child, fields = sanitize.case_under_tool(sanitizer, "initcheck", __file__, name, timeout, CASE_MARK)
    first = child.reports[0] if child.reports else None
    return {"case": name, "errors": child.summary, "result": fields[1] if isinstance(fields, list) else fields,
            "report": f"{first.text} ({first.kernel or 'no kernel named'})" if first else "-"}


def verdict(rows: list[dict]) -> str:
    drew = {r["case"] for r in rows if (r["errors"] or 0) > 0}
    if "kernel-empty" in drew or "matmul-zeros" in drew:
        return (f"The controls draw reports ({', '.join(sorted(drew & {'kernel-empty', 'matmul-zeros'}))}): the tool "
                "reports memory that was written; look at the reports before trusting any row.")
    if drew and drew <= set(LIBRARY):
        return (f"Only memory that a library alone wrote (cuBLAS, CuPy's random generator) draws reports ({', '.join(sorted(drew))}): initcheck does not "
                "see those stores here, so a CuPy or lab kernel's report on such output is the tool's.")
    return "No case draws a report: the lab's initcheck rows in CuPy's kernels need another explanation."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, help="run one case here, without the tool")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may run under the tool")
    args = parser.parse_args(argv)
    if args.case:
        return run_case(args.case)
    rows = sanitize.cases_under_tool(
        CASES, lambda sanitizer, name: under_tool(sanitizer, name, args.timeout),
        lambda name, r: f"{name:14s} initcheck errors {r['errors']}, result {r['result']}: {r['report']}")
    if rows is None:
        return 2
    print(f"\n{verdict(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
