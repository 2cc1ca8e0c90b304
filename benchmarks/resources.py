"""`bench.py resources`: registers, shared memory, stack, spills (ptxas through NVRTC) and resident blocks
per SM of every rung and configuration; without a GPU, or with --arch, compiled for that architecture."""

from __future__ import annotations

import kernels

from . import device
from .device import CannotRun, progress
from .results import SCHEMA, result_path, write_result, wrote
from .tables import render_resources


def cmd_resources(args) -> int:
    on_device = args.arch is None and device.gpu_problem() is None
    arch = None if on_device else (args.arch or "sm_90")
    try:
        nvrtc_version = "{}.{}".format(*kernels.nvrtc.version())
    except RuntimeError as exc:  # libnvrtc not found
        raise CannotRun(str(exc).splitlines()[0]) from None
    setup = device.setup_info(args.argv)
    if not on_device:
        setup["device"] = None  # compiled for a named architecture: no device was involved
    rows = []
    for path in args.kernels:
        try:
            reports = kernels.resources(path, arch=arch)
        except kernels.KernelCompileError as exc:
            rows.append({"kernel": path.stem, "error": str(exc).splitlines()[0]})
            progress(f"{path.stem}: does not compile: {str(exc).splitlines()[0]}")
            continue
        for r in reports:
            rows.append(r.as_dict())
            progress(f"{r.kernel:<24} {str(r.config):<40} {r.registers:>4} registers, smem {r.static_smem} + "
                     f"{r.dynamic_smem}, stack {r.stack_bytes}, spills {r.spill_stores}/{r.spill_loads}, "
                     f"blocks/SM {r.blocks_per_sm if r.blocks_per_sm is not None else '-'}")
    result = {"schema": SCHEMA, "kind": "resources", "setup": setup, "nvrtc": nvrtc_version,
              "arch": setup["device"]["arch"] if on_device else arch, "on_device": on_device,
              "kernels": [p.stem for p in args.kernels], "rows": rows}
    slug_fallback = f"{arch}-nvrtc" if arch else "nogpu"
    path = write_result(result, result_path("resources", setup, args.results, slug_fallback))
    print("\n" + render_resources(result))
    progress(wrote(path))
    return 0
