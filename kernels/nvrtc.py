"""NVRTC through ctypes: compile a rung for a named architecture on a machine with no GPU.

CuPy compiles for the device it finds; this module compiles for an architecture you name
(sm_80, sm_90) and returns ptxas's resource report, so registers and spills can be read in CI.
`compile_isolated` does it in a child process: in a process where CuPy has loaded its own NVRTC,
a second copy's ptxas report comes back empty.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import subprocess
import sys
import time

_lib = None
_path = None


def _candidates() -> list[str]:
    found = []
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cu13", "lib", "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    return [f for f in found if "builtins" not in f and ".alt." not in f]


def library() -> ctypes.CDLL:
    """Load libnvrtc: the pip wheel (nvidia-cuda-nvrtc-cu12) first, then a CUDA toolkit."""
    global _lib, _path
    if _lib is None:
        errors = []
        for path in _candidates():
            try:
                # libnvrtc dlopens its builtins by name; load them from beside it first
                for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                _lib, _path = ctypes.CDLL(path), path
                break
            except OSError as exc:
                errors.append(f"{path}: {exc}")
        else:
            raise RuntimeError(
                "libnvrtc not found: install the test extra (pip install -e '.[test]', which brings "
                "nvidia-cuda-nvrtc-cu12) or set CUDA_PATH to a CUDA toolkit"
                + ("".join("\n  " + e for e in errors))
            )
        _lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return _lib


def describe() -> str:
    """Which NVRTC this process compiles with: version and library file (a resource report is only
    as reproducible as the compiler that made it)."""
    major, minor = version()
    return f"NVRTC {major}.{minor} ({_path})"


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


class NvrtcError(RuntimeError):
    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (("\n" + log) if log else ""))
        self.log = log


def compile_cubin(source: str, name: str, options: list[str], name_expressions: list[str]):
    """Compile `source` to a cubin; return (cubin bytes, program log, {expression: lowered name})."""
    lib = library()
    prog = ctypes.c_void_p()

    def check(status, what):
        if status != 0:
            raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}", _log(lib, prog))

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        log = _log(lib, prog)
        if status != 0:
            raise NvrtcError(f"{name}: compilation failed", log)
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[expr] = out.value.decode()
        return cubin.raw, log, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib, prog) -> str:
    if not prog.value:
        return ""
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace").strip()


def compile_isolated(source: str, name: str, options: list[str], name_expressions: list[str]) -> list[dict]:
    """compile_cubin for each name expression as its own program, in a child process that loads
    no other NVRTC; returns [{"log": ..., "lowered": ...}] in order, or raises NvrtcError."""
    # A compilation cache (seen on the GPU machine) can hand back a cubin without running ptxas, and
    # so without its report: a unique global variable makes the PTX new, and the cache is turned off.
    nonce = f"\n__device__ int lab_resource_report_{os.getpid()}_{time.perf_counter_ns()};\n"
    request = {"source": source + nonce, "name": name, "options": options, "expressions": name_expressions}
    env = dict(os.environ, CUDA_CACHE_DISABLE="1")
    proc = subprocess.run([sys.executable, "-m", "kernels.nvrtc"], input=json.dumps(request), env=env,
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if proc.returncode != 0:
        raise NvrtcError(f"NVRTC child process failed (exit {proc.returncode})", proc.stderr.strip())
    reply = json.loads(proc.stdout)
    if "error" in reply:
        raise NvrtcError(reply["error"], reply["log"])
    return reply["results"]


def _serve() -> None:
    request = json.load(sys.stdin)
    results = []
    try:
        for expr in request["expressions"]:
            _, log, lowered = compile_cubin(request["source"], request["name"], request["options"], [expr])
            results.append({"log": log, "lowered": lowered[expr]})
    except NvrtcError as exc:
        json.dump({"error": str(exc).splitlines()[0], "log": exc.log}, sys.stdout)
        return
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    _serve()
