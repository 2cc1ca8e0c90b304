"""The CUDA driver API where CuPy has no binding: launches with launch attributes, through ctypes.

    launch = driver.PackedLaunch(fn, grid, block, args, stream=s.ptr, pdl=True)   pack once
    launch()                                                                       cuLaunchKernelEx
    driver.launch_cooperative(fn, grid, block, args, shared_mem=n, stream=s)      all blocks resident
    driver.blocks_per_sm(fn, threads, shared_mem)                                 occupancy
    driver.required_cluster_width(fn), driver.allow_non_portable_clusters(fn)      cluster attributes

CuPy launches a kernel with cuLaunchKernel (or cuLaunchCooperativeKernel): no launch attributes.
cuLaunchKernelEx takes a CUlaunchConfig with a list of CUlaunchAttribute, each an id and a 64-byte
union; the lab uses programmatic stream serialization (programmatic dependent launch: the kernel may
start while the previous one in the stream finishes, and waits in griddepcontrol.wait), and the
structures also carry cooperative launch and cluster dimensions. The layouts are cuda.h's (CUDA
12+), checked by tests/test_driver.py without a GPU. The decode step's cooperative launch and the
occupancy and function-attribute queries use CuPy's driver bindings, called from here only.
Everything here that calls into libcuda.so.1 goes through library(), which declares each entry
point's argument types once: tensor maps (cuTensorMapEncodeTiled, a 64-byte aligned 128-byte
CUtensorMap) belong here too when a rung needs TMA descriptors.
"""

from __future__ import annotations

import ctypes

import numpy as np

# cuda.h's CUlaunchAttributeID (the ones the structures below can carry)
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class DriverError(RuntimeError):
    """A driver call that returned an error: the message names the call and the CUresult."""


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, the members the lab sets
    _fields_ = [("pad", ctypes.c_char * 64), ("cooperative", ctypes.c_int), ("clusterDim", Dim3),
                ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, the union at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_library = None


def library() -> ctypes.CDLL:
    """libcuda.so.1 with the argument and result types of every entry point used here."""
    global _library
    if _library is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int
        _library = lib
    return _library


def error_string(status: int) -> str:
    """`CUresult 1 (invalid argument)`: the code and the driver's words for it."""
    text = ctypes.c_char_p()
    library().cuGetErrorString(status, ctypes.byref(text))
    return f"CUresult {status}" + (f" ({text.value.decode()})" if text.value else "")


def check(status: int, call: str) -> None:
    if status != 0:
        raise DriverError(f"{call} failed: {error_string(status)}")


# -- kernel arguments ------------------------------------------------------------------------------

_SCALARS = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
            np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def argument(value, kernel: str = "kernel"):
    """One kernel argument as the ctypes value the kernel's parameter holds: a NumPy scalar as its
    own type, a CuPy array (anything with .data.ptr) as its device pointer. A Python int or float
    is refused: its width on the device would be a guess."""
    ctype = _SCALARS.get(type(value))
    if ctype is not None:
        return ctype(value.item())
    if hasattr(value, "data") and hasattr(value.data, "ptr"):
        return ctypes.c_void_p(value.data.ptr)
    known = ", ".join(t.__name__ for t in _SCALARS)
    raise TypeError(f"{kernel}: cannot pass {type(value).__name__} to a kernel (NumPy {known}, or a CuPy array)")


def pack_arguments(args, kernel: str = "kernel"):
    """(kernelParams, values): the array of pointers cuLaunchKernelEx reads, one to each argument's
    value, and the values themselves, which must stay alive as long as the pointers are used."""
    values = [argument(a, kernel) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    return params, values


def function_handle(fn) -> int:
    """The CUfunction of a cupy.RawKernel (fn.kernel.ptr), a cupy.cuda.Function (fn.ptr) or an int."""
    if isinstance(fn, int):
        return fn
    inner = getattr(fn, "kernel", fn)
    return int(inner.ptr)


# -- launches --------------------------------------------------------------------------------------


def launch_attributes(*, pdl: bool = False, cooperative: bool = False, cluster: tuple | None = None):
    """The CUlaunchAttribute array for these options (empty when none is asked)."""
    chosen = []
    if pdl:
        a = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        a.value.programmaticStreamSerializationAllowed = 1
        chosen.append(a)
    if cooperative:
        a = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
        a.value.cooperative = 1
        chosen.append(a)
    if cluster is not None:
        a = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        a.value.clusterDim = Dim3(*_dim3(cluster))
        chosen.append(a)
    return (LaunchAttribute * len(chosen))(*chosen)


def _dim3(dims) -> tuple[int, int, int]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {dims}")
    return tuple(int(d) for d in dims + (1,) * (3 - len(dims)))


class PackedLaunch:
    """One kernel launch through cuLaunchKernelEx, packed once (configuration, attributes, argument
    values) and launched on each call with the same arguments: the unit a captured graph repeats.
    fn: a cupy.RawKernel (or Function, or CUfunction); stream: a CUstream handle (0: the legacy
    default stream); pdl, cooperative, cluster: launch attributes."""

    def __init__(self, fn, grid, block, args, *, shared_mem: int = 0, stream: int = 0, pdl: bool = False,
                 cooperative: bool = False, cluster: tuple | None = None, name: str = "kernel"):
        self.name = name
        self.params, self.values = pack_arguments(args, name)
        self.attributes = launch_attributes(pdl=pdl, cooperative=cooperative, cluster=cluster)
        self.function = ctypes.c_void_p(function_handle(fn))
        attrs = ctypes.cast(self.attributes, ctypes.POINTER(LaunchAttribute)) if len(self.attributes) else None
        self.config = LaunchConfig(*_dim3(grid), *_dim3(block), shared_mem, ctypes.c_void_p(stream), attrs,
                                   len(self.attributes))

    def __call__(self) -> None:
        status = library().cuLaunchKernelEx(ctypes.byref(self.config), self.function, self.params, None)
        check(status, f"cuLaunchKernelEx({self.name})")


def launch_cooperative(fn, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
    """Launch a cupy.RawKernel with every block resident at once (cuLaunchCooperativeKernel, through
    CuPy's binding: RawKernel itself takes cooperation from its module's options, not per launch), so
    that its blocks may wait for each other. The grid must fit the device at once (blocks_per_sm)."""
    fn.kernel(_dim3(grid), _dim3(block), args, shared_mem=shared_mem, stream=stream, enable_cooperative_groups=True)


def blocks_per_sm(fn, threads: int, shared_mem: int = 0) -> int:
    """How many blocks of `threads` threads and `shared_mem` dynamic bytes of a compiled kernel an SM
    holds at once (the occupancy calculator: cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    import cupy

    return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function_handle(fn), threads, shared_mem)


# -- function attributes ---------------------------------------------------------------------------

CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11  # cuda.h's CUfunction_attribute; CuPy names neither
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def required_cluster_width(fn) -> int:
    """The cluster width a kernel is compiled for (__cluster_dims__), 0 if none."""
    import cupy

    return cupy.cuda.driver.funcGetAttribute(CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH, function_handle(fn))


def allow_non_portable_clusters(fn) -> None:
    """Let a kernel launch clusters of more than the portable 8 blocks."""
    import cupy

    cupy.cuda.driver.funcSetAttribute(function_handle(fn), CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
