"""The fused kernels of GPT-2's fast path (`kernels/fused/*.cu`): compile, cache, launch, report.

    fn = fused.function("gemv", "gemv<float, 768, 8, 1, true, 0>")   compile once (CuPy, NVRTC)
    fused.launch(fn, grid, block, (W, b, x, ...), shared_mem=0)      on the current stream
    fused.compile_report("gemv", expr, "sm_90")                      registers and spills, no GPU

Each `.cu` is one small operation with its own header (what it replaces, why, geometry); they share
`common.cuh`. Unlike the attention rungs they have no common signature: gpt2/fast launches each
with its own arguments, and tests/test_fused_gpu.py checks each against the CuPy operation it
replaces. Text is assembled as ladder.assemble does (includes inlined, #line directives naming the
files), compiled through `cupy.RawModule(code=..., options=..., name_expressions=[...])`, and cached
per (text, options, expression); a failure is a KernelCompileError naming the file and line.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import ladder, nvrtc, reports, runtime
from .runtime import KernelCompileError

FUSED_DIR = Path(__file__).resolve().parent / "fused"
OPTIONS: tuple[str, ...] = ()  # CuPy adds the device's architecture; nothing else is needed


def path_of(name: str) -> Path:
    """`gemv` or `gemv.cu` -> kernels/fused/gemv.cu; a path to any other .cu file is taken as it is."""
    if "/" in name:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"kernel file {name!r} does not exist")
        return path
    path = FUSED_DIR / (name if name.endswith(".cu") else name + ".cu")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in FUSED_DIR.glob("*.cu"))) or "none"
        raise ValueError(f"unknown fused kernel {name!r}: known are {known}")
    return path


def names() -> list[str]:
    return sorted(p.stem for p in FUSED_DIR.glob("*.cu"))


_sources: dict[Path, tuple[tuple, str]] = {}


def source(name: str) -> str:
    """The text NVRTC compiles (reassembled whenever the file or a file it includes changes)."""
    path = path_of(name)
    cached = _sources.get(path)
    if cached is not None and all(p.exists() and _stamp(p) == stamp for p, stamp in cached[0]):
        return cached[1]
    files: list[Path] = []
    text = ladder.assemble(path, files=files)
    _sources[path] = (tuple((p, _stamp(p)) for p in files), text)
    return text


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


_functions: dict[tuple, object] = {}


def function(name: str, expression: str, options: tuple[str, ...] = OPTIONS):
    """The compiled kernel `expression` (a name expression: `gemv<float, 768, 8, 1, true, 0>`) of
    kernels/fused/<name>.cu for the current device, compiled once per (text, options, expression)."""
    import cupy

    text = source(name)
    key = (cupy.cuda.runtime.getDevice(), text, tuple(options), expression)
    fn = _functions.get(key)
    if fn is None:
        start = time.perf_counter()
        try:
            module = cupy.RawModule(code=text, options=tuple(options), name_expressions=[expression])
            fn = module.get_function(expression)
        except cupy.cuda.compiler.CompileException as exc:
            message = exc.get_message() if hasattr(exc, "get_message") else str(exc)
            raise KernelCompileError(f"{path_of(name)}: {expression} failed to compile:\n{message.strip()}") from None
        finally:
            runtime.compile_seconds += time.perf_counter() - start  # lab.py reports compilation apart
        _functions[key] = fn
    return fn


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on the current stream; grid and block are ints or tuples."""
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    fn(grid, block, args, shared_mem=shared_mem)


@dataclass
class Report:
    kernel: str
    expression: str
    arch: str
    registers: int
    static_smem: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    performance_warnings: tuple[str, ...] = ()  # ptxas's "Potential Performance Loss" lines (C7520: wgmma serialized)

    def as_dict(self) -> dict:
        return asdict(self)


_PTXAS = reports.PTXAS  # the same ptxas report lines as the rungs


def ptx(name: str, expression: str, arch: str = "sm_90", options: tuple[str, ...] = OPTIONS) -> str:
    """The PTX of one instantiation (NVRTC, no GPU): to check load widths and instructions."""
    import ctypes

    lib = nvrtc.library()
    prog = ctypes.c_void_p()
    text = source(name)
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), str(path_of(name)).encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        lib.nvrtcAddNameExpression(prog, expression.encode())
        opts = [f"-arch=compute_{arch.removeprefix('sm_')}", *runtime.COMMON_OPTIONS, *options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
        if status != 0:
            raise KernelCompileError(f"{path_of(name)}: {expression} failed to compile for {arch}")
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        return buf.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_report(name: str, expression: str, arch: str = "sm_90", options: tuple[str, ...] = OPTIONS) -> Report:
    """Compile one instantiation with NVRTC for `arch` (no GPU needed) and read ptxas's report."""
    opts = [f"-arch={arch}", "-Xptxas=-v", *runtime.COMMON_OPTIONS, *options]
    try:
        (result,) = nvrtc.compile_isolated(source(name), str(path_of(name)), opts, [expression])
        log = result["log"]
    except nvrtc.NvrtcError as exc:
        raise KernelCompileError(f"{path_of(name)}: {expression} failed to compile for {arch}:\n{exc.log}") from None
    if not _PTXAS["registers"].search(log):
        raise RuntimeError(f"{path_of(name)}: no register count in ptxas's report for {expression}:\n{log}")
    values = {k: int(m.group(1)) if (m := rx.search(log)) else 0 for k, rx in _PTXAS.items()}
    return Report(kernel=name, expression=expression, arch=arch, performance_warnings=reports.performance_warnings(log),
                  **values)
