"""initcheck's reports in CuPy's element-wise kernels (the fused, step and llama groups of tools/sanitize.py:
"Uninitialized __global__ memory read" in cupy_multiply, cupy_true_divide, cupy_add, no row of a lab
kernel, each launched right after a cuBLAS product): uninitialized memory in the lab's reference path, or
stores of cuBLAS's kernels that the tool does not see? The full run leaves cuBLAS's kernels out of
initcheck (--kernel-name-exclude), and a kernel the tool leaves out is not instrumented: are its stores
then unseen? Each case runs in a process of its own under compute-sanitizer's initcheck, once for each way
tools/sanitize.py --initcheck-library treats cuBLAS's kernels (excluded, as the full run; checked;
small-workspace: checked, with cuBLAS's workspace pool too small for split K); the table gives the
errors the tool counted, the kernel its first report names, and whether the result was right.

    python3 tools/initcheck_library.py                     every case in every mode (two or three minutes)
    python3 tools/initcheck_library.py --modes excluded    every case, one mode
    python3 tools/initcheck_library.py --case matmul-new   one case, here, without the tool

Every case writes every element of `c` before an element-wise kernel reads all of it (c * 2), and checks
the product against NumPy's. What differs is who writes c, and into what memory:
  matmul-new     c = a @ b: CuPy allocates c (uninitialized) and cuBLAS writes it, as the reference
                 attention's S = q @ k^T before S * scale
  matmul-empty   cp.matmul(a, b, out=c) into c = cp.empty(...)
  matmul-zeros   the same into c = cp.zeros(...): the bytes were set by a memset before cuBLAS's kernel
  batched-new    c = q @ k^T on (1, 12, 5, 64) float32 operands, the reference attention's first product
  dgemm-new      c = a @ b in float64 (DGEMM): the step group's float32 reports are in cupy_add__float64
  bf16-prefill   c (float32) = a @ W^T on bfloat16 operands through lm.products.Blas (gemmEx), the
                 prefill's product, whose split-K workspace made the full run leave cuBLAS out
  bf16-out       c (bfloat16) = a @ W^T on bfloat16 operands, the output in the operands' dtype, read by a cast
                 to float32: the llama group's report in cupy_copy__bfloat16_float32 after a product
  bf16-rows      the same on 256 rows by GPT-2 small's c_attn, as training's QKV product, which the
                 train group's heads_rows reads with its bias
  bf16-zeros     bf16-out into c = cp.zeros(...): the control, c's bytes set by a memset first
  bulk-store     c written by a kernel of this file through the async proxy: its block's values staged in
                 shared memory, then one cp.async.bulk copy to global memory (sm_90), as Hopper's GEMM
                 epilogues store their tiles (TMA): does the tool see such stores?
  plain-store    the same kernel's values written with plain st.global: its control
  random-ints    c = CuPy's Generator.integers(...) cast to int32, read by a kernel (c * 2)
  kernel-empty   c = cp.empty(...), written by a CuPy element-wise kernel (cp.add(a, 1, out=c)): the control
If, with cuBLAS's kernels excluded, the cases whose c cuBLAS alone wrote draw reports and the controls
(matmul-zeros, kernel-empty) do not, while checked they draw none, the full run's rows after a product
are the exclusion's; the mode that is clean here is the one to run the groups in.
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
CASES = ("matmul-new", "matmul-empty", "matmul-zeros", "batched-new", "dgemm-new", "bf16-prefill", "bf16-out",
         "bf16-rows", "bf16-zeros", "bulk-store", "plain-store", "random-ints", "kernel-empty")
CUBLAS = ("matmul-new", "matmul-empty", "batched-new", "dgemm-new", "bf16-prefill", "bf16-out", "bf16-rows")  # cuBLAS alone writes c
CONTROLS = ("matmul-zeros", "bf16-zeros", "plain-store", "kernel-empty")  # c's bytes set by a kernel the tool sees
ASYNC = ("bulk-store",)  # c written through the async proxy: the tool's reach, whatever the mode

STORES = r"""
extern "C" __global__ void store(float* out, int n, int bulk)  // one block; n <= 1024, n % 4 == 0
{
    __shared__ __align__(16) float tile[1024];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (bulk) tile[i] = (float)i;
        else out[i] = (float)i;
    }
    if (!bulk) return;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the block's stores, seen by the async proxy
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned src = (unsigned)__cvta_generic_to_shared(tile);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(out), "r"(src), "r"(4 * n) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
}
"""
STORE_N = 1024


def operands(cp, name: str):
    """(a, b) float32 on the device and what c should be (NumPy, float64 arithmetic)."""
    rng = np.random.default_rng(0)
    if name == "random-ints":
        return cp.random.default_rng(0).integers(0, 1000, (2, 97)), None, None
    if name in ("bulk-store", "plain-store"):  # no operands: the kernel writes 0, 1, 2, ...
        return None, None, np.arange(STORE_N, dtype=np.float64)
    if name.startswith("bf16"):
        rows = 256 if name == "bf16-rows" else 5
        a = rng.standard_normal((rows, 768)).astype(np.float32)
        w = rng.standard_normal((2304, 768)).astype(np.float32)  # (out, in), as the engine holds c_attn
        return cp.asarray(a), cp.asarray(w), None
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
    if name.startswith("bf16"):
        from lm.bf16 import bf16_bits, to_float32
        from lm.products import Blas

        a16, w16 = bf16_bits(cp, a), bf16_bits(cp, b)
        out_dtype = cp.float32 if name == "bf16-prefill" else cp.uint16  # uint16: bfloat16 bits, as the engines hold them
        c = (cp.zeros if name == "bf16-zeros" else cp.empty)((a.shape[0], b.shape[0]), dtype=out_dtype)
        Blas(cp).gemm(a16, w16.T, c, dtype="bfloat16")
        c = c if name == "bf16-prefill" else to_float32(cp, c)  # the cast reads the product: the read checked
        want = cp.asnumpy(to_float32(cp, a16)).astype(np.float64) @ cp.asnumpy(to_float32(cp, w16)).astype(np.float64).T
    elif name in ("bulk-store", "plain-store"):
        store = cp.RawModule(code=STORES).get_function("store")  # for the device: sm_90 on an H100 or H200
        c = cp.empty(STORE_N, dtype=cp.float32)
        store((1,), (256,), (c, np.int32(STORE_N), np.int32(name == "bulk-store")))
    elif name == "random-ints":
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


def under_tool(sanitizer: str, name: str, mode: str, timeout: float) -> dict:
    """One case in a child process under initcheck, cuBLAS's kernels treated as `mode`: errors, the first
    report and the kernel it names, whether that is cuBLAS's, the result."""
    child, fields = sanitize.case_under_tool(sanitizer, "initcheck", __file__, name, timeout, CASE_MARK, mode)
    first = child.reports[0] if child.reports else None
    library = bool(first and first.kernel and any(k in first.kernel for k in sanitize.LIBRARY_KERNELS))
    return {"case": name, "mode": mode, "errors": child.summary, "library": library,
            "result": fields[1] if isinstance(fields, list) else fields,
            "report": f"{first.text} ({first.kernel or 'no kernel named'})" if first else "-"}


def verdict(rows: list[dict]) -> str:
    """What the table says, mode by mode, and the mode a full run should use."""
    drew_all = {mode: {r["case"] for r in rows if r["mode"] == mode and (r["errors"] or 0) > 0}
                for mode in dict.fromkeys(r["mode"] for r in rows)}
    drew = {mode: cases - set(ASYNC) for mode, cases in drew_all.items()}  # the modes judged without them
    in_library = {mode: {r["case"] for r in rows if r["mode"] == mode and r["library"]} for mode in drew}
    lines = []
    for mode, cases in drew.items():
        if set(CONTROLS) & cases:
            lines.append(f"{mode}: the controls draw reports ({', '.join(sorted(set(CONTROLS) & cases))}): the tool "
                         "reports memory that was written; look at the reports before trusting any row.")
        elif not cases:
            lines.append(f"{mode}: no case draws a report.")
        elif cases <= set(CUBLAS) and not in_library[mode]:
            lines.append(f"{mode}: only reads of what cuBLAS alone wrote draw reports ({', '.join(sorted(cases))}), "
                         "in the kernel that reads it: the tool does not see cuBLAS's stores in this mode.")
        else:
            named = sorted(in_library[mode])
            lines.append(f"{mode}: reports in {', '.join(sorted(cases))}"
                         + (f"; inside cuBLAS's own kernels in {', '.join(named)}" if named else "") + ".")
    ran = {r["case"] for r in rows}
    if set(ASYNC) <= ran and "plain-store" in ran:
        unseen = all(set(ASYNC) <= cases and "plain-store" not in cases for cases in drew_all.values())
        seen = not any(set(ASYNC) & cases for cases in drew_all.values())
        lines.append("The tool does not see stores through the async proxy (cp.async.bulk, as TMA stores a "
                     "tile): reads of memory written so draw reports, plain stores' none." if unseen else
                     "The tool sees stores through the async proxy (cp.async.bulk) as it sees plain ones."
                     if seen else "Stores through the async proxy: the modes disagree; read the rows.")
    clean = [mode for mode, cases in drew.items() if not cases]
    lines.append(f"A full run's initcheck is sound here with --initcheck-library {clean[0]}." if clean else
                 "No mode is clean: the lab's initcheck rows after a product stay open.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, help="run one case here, without the tool")
    parser.add_argument("--modes", default=",".join(sanitize.LIBRARY_MODES),
                        help=f"comma-separated, of {', '.join(sanitize.LIBRARY_MODES)} (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may run under the tool")
    args = parser.parse_args(argv)
    if args.case:
        return run_case(args.case)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in sanitize.LIBRARY_MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(sanitize.LIBRARY_MODES)}")
    pairs = [f"{name} {mode}" for mode in modes for name in CASES]
    rows = sanitize.cases_under_tool(
        pairs, lambda sanitizer, pair: under_tool(sanitizer, *pair.split(), args.timeout),
        lambda pair, r: f"{r['case']:14s} {r['mode']:15s} initcheck errors {r['errors']}, result {r['result']}: "
                        f"{r['report']}")
    if rows is None:
        return 2
    print(f"\n{verdict(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
