"""What ptxas reports of a rung's configurations, compiled through NVRTC for a named architecture (no GPU
needed) or for the device: registers, shared memory, stack and spill bytes, performance warnings (a
serialized wgmma pipeline), and with a GPU the resident blocks per SM. kernels.compile_report and
kernels.resources; the backward ladder and kernels/fused read ptxas's report the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from . import ladder, nvrtc
from .runtime import COMMON_OPTIONS, KernelCompileError, _as_config, device_limits, gpu_available, instance


@dataclass
class Resources:
    kernel: str
    config: dict
    arch: str
    threads: int
    registers: int
    static_smem: int
    dynamic_smem: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    blocks_per_sm: int | None = None  # needs the device; None when compiled for a named arch only
    # ptxas's "Potential Performance Loss" lines, e.g. C7520: wgmma serialized (see v19's header)
    performance_warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return asdict(self)


PTXAS = {
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


# "ptxas info    : (C7520) Potential Performance Loss: ... in the function '_Z17attention_...'" -> the message
_PERFORMANCE_WARNING = re.compile(r"^ptxas \w+\s*:\s*|\s*in the function '[^']*'")


def performance_warnings(log: str) -> tuple[str, ...]:
    """ptxas's "Potential Performance Loss" lines of a compile log, each reduced to its message."""
    return tuple(_PERFORMANCE_WARNING.sub("", line).strip() for line in log.splitlines()
                 if "Potential Performance Loss" in line)


def compile_report(kernel, arch: str, configs=None) -> list[Resources]:
    """Compile every declared configuration (or `configs`) with NVRTC for `arch`, no GPU needed,
    and read ptxas's report: registers, static shared memory, stack and spill bytes, performance
    warnings (a serialized wgmma pipeline, C7520)."""
    rung = ladder.load(kernel)
    configs = [_as_config(rung, c) for c in configs] if configs else list(rung.configs)
    reports = ptxas_reports(rung, arch, [rung.name_expression(c) for c in configs])
    return [Resources(kernel=rung.name, config=rung.params(c), arch=arch, threads=math.prod(rung.block(c)),
                      dynamic_smem=rung.shared_bytes(c), **values) for c, values in zip(configs, reports)]


def ptxas_reports(rung: ladder.Rung, arch: str, expressions: list[str]) -> list[dict]:
    """Each name expression of a rung compiled with NVRTC for `arch`, its own program (ptxas may
    interleave the reports of several entry points), and what ptxas reports of it: the fields of
    Resources from registers to performance_warnings."""
    if not rung.runs_on(arch):
        raise KernelCompileError(f"{rung.path}: needs {rung.arch_needed()}, not {arch}")
    options = [f"-arch={arch}", "-Xptxas=-v", *COMMON_OPTIONS, *rung.options]
    try:
        results = nvrtc.compile_isolated(rung.source, str(rung.path), options, expressions)
    except nvrtc.NvrtcError as exc:
        raise KernelCompileError(f"{rung.path}: failed to compile for {arch}:\n{exc.log}") from None
    reports = []
    for result in results:
        log = result["log"]
        if not PTXAS["registers"].search(log):
            raise RuntimeError(f"{rung.path}: no register count in ptxas's report for {arch}:\n{log}")
        values = {k: int(m.group(1)) if (m := rx.search(log)) else 0 for k, rx in PTXAS.items()}
        reports.append(values | {"performance_warnings": performance_warnings(log)})
    return reports


def resources(kernel, arch: str | None = None) -> list[Resources]:
    """The resource report of every declared configuration. With a GPU and no `arch`, compiled for
    the device and with resident blocks per SM; otherwise for `arch` (default sm_90) through NVRTC."""
    on_device = arch is None and gpu_available()
    arch = device_limits().arch if on_device else (arch or "sm_90")
    reports = compile_report(kernel, arch)
    if on_device:
        for r in reports:
            try:
                inst = instance(kernel, r.config["d_head"], tuple(r.config.values()))
                r.blocks_per_sm = inst.blocks_per_sm()
            except ValueError:
                r.blocks_per_sm = 0  # does not fit this device
    return reports
