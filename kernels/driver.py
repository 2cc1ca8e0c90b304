"""The CUDA driver API where CuPy has no binding: launches with launch attributes, through ctypes.

    launch = driver.PackedLaunch(fn, grid, block, args, stream=s.ptr, pdl=True)   pack once
    launch()                                                                       cuLaunchKernelEx
    driver.launch_cooperative(fn, grid, block, args, shared_mem=n, stream=s)      all blocks resident
    driver.blocks_per_sm(fn, threads, shared_mem)                                 occupancy
    driver.required_cluster_width(fn), driver.allow_non_portable_clusters(fn)      cluster attributes
    driver.max_active_clusters(fn, grid, block, cluster, shared_mem)              clusters resident at once
    driver.tensor_map(x, box, name="K")                                           TMA descriptor of x
    driver.swizzle_for(inner_bytes)                                               a lab.tma box's swizzle

CuPy launches a kernel with cuLaunchKernel (or cuLaunchCooperativeKernel): no launch attributes.
cuLaunchKernelEx takes a CUlaunchConfig with a list of CUlaunchAttribute, each an id and a 64-byte
union; the lab uses programmatic stream serialization (programmatic dependent launch: the kernel may
start while the previous one in the stream finishes, and waits in griddepcontrol.wait), and the
structures also carry cooperative launch and cluster dimensions. The layouts are cuda.h's (CUDA
12+), checked by tests/test_driver.py without a GPU. The decode step's cooperative launch and the
occupancy and function-attribute queries use CuPy's driver bindings, called from here only (the
clusters' occupancy, which CuPy does not bind, goes through ctypes).
Everything here that calls into libcuda.so.1 goes through library(), which declares each entry
point's argument types once.

A TMA descriptor (CUtensorMap, 128 opaque bytes) tells the tensor memory accelerator a global
array's address, extents and strides and the box one `cp.async.bulk.tensor` copies into shared
memory. tensor_map_arguments() turns an array and a box into cuTensorMapEncodeTiled's arguments and
checks what the hardware requires, without the driver; tensor_map() encodes them. A kernel takes the
descriptor by value (`const __grid_constant__ CUtensorMap`), so it travels as a kernel argument
through PackedLaunch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

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


class TensorMap(ctypes.Structure):
    """CUtensorMap: 16 opaque 64-bit words. Make one with TensorMap.aligned(): ctypes aligns a structure
    to at most 8 bytes, and cuTensorMapEncodeTiled writes only to a 64-byte aligned one."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]  # cuda.h: CU_TENSOR_MAP_NUM_QWORDS 16
    ALIGNMENT = 128  # the encode call needs 64 (its documentation); CUDA 13's cuda.h declares alignas(128)

    @classmethod
    def aligned(cls) -> TensorMap:
        """A zeroed TensorMap at an ALIGNMENT boundary inside a buffer it keeps alive."""
        buffer = (ctypes.c_char * (ctypes.sizeof(cls) + cls.ALIGNMENT - 1))()
        offset = -ctypes.addressof(buffer) % cls.ALIGNMENT
        return cls.from_buffer(buffer, offset)


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
        lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                     ctypes.POINTER(LaunchConfig)]
        lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        lib.cuTensorMapEncodeTiled.argtypes = [ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32,
                                               ctypes.c_void_p, u64p, u64p, u32p, u32p, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
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
    own type, a CuPy array (anything with .data.ptr) as its device pointer, a TensorMap as itself
    (a `const __grid_constant__ CUtensorMap` parameter). A Python int or float
    is refused: its width on the device would be a guess."""
    if isinstance(value, TensorMap):  # by value: the driver copies its 128 bytes into the parameter
        return value
    ctype = _SCALARS.get(type(value))
    if ctype is not None:
        return ctype(value.item())
    if hasattr(value, "data") and hasattr(value.data, "ptr"):
        return ctypes.c_void_p(value.data.ptr)
    known = ", ".join(t.__name__ for t in _SCALARS)
    raise TypeError(f"{kernel}: cannot pass {type(value).__name__} to a kernel (NumPy {known}, a CuPy array, "
                    "or a TensorMap)")


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


def max_active_clusters(fn, grid, block, cluster: int, shared_mem: int = 0) -> int:
    """How many clusters of `cluster` blocks (along x) of a compiled kernel the device holds at once in a
    launch of `grid` blocks of `block` threads (cuOccupancyMaxActiveClusters): fewer than the grid's
    clusters means that later clusters start where earlier ones of the same launch have finished."""
    attributes = launch_attributes(cluster=(cluster, 1, 1))
    config = LaunchConfig(*_dim3(grid), *_dim3(block), shared_mem, None,
                          ctypes.cast(attributes, ctypes.POINTER(LaunchAttribute)), len(attributes))
    count = ctypes.c_int()
    check(library().cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(function_handle(fn)),
                                                 ctypes.byref(config)), "cuOccupancyMaxActiveClusters")
    return count.value


# -- TMA descriptors -------------------------------------------------------------------------------

# cuda.h's CUtensorMapDataType, for the dtypes a NumPy or CuPy array can have
TENSOR_MAP_DTYPES = {"uint8": 0, "uint16": 1, "uint32": 2, "int32": 3, "uint64": 4, "int64": 5,
                     "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
CU_TENSOR_MAP_INTERLEAVE_NONE = 0  # CUtensorMapInterleave
CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_32B, CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_SWIZZLE_128B = 0, 1, 2, 3
SWIZZLE_SPAN = {CU_TENSOR_MAP_SWIZZLE_32B: 32, CU_TENSOR_MAP_SWIZZLE_64B: 64, CU_TENSOR_MAP_SWIZZLE_128B: 128}
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3  # CUtensorMapL2promotion
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # CUtensorMapFloatOOBfill: out-of-bounds elements read as zero


@dataclass(frozen=True)
class TensorMapArguments:
    """cuTensorMapEncodeTiled's arguments after the map, innermost dimension first (the driver's order,
    the reverse of a NumPy shape): strides in bytes for every dimension but the innermost."""

    dtype: int
    rank: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def tensor_map_arguments(x, box, *, name: str = "array", swizzle: int = CU_TENSOR_MAP_SWIZZLE_128B) -> TensorMapArguments:
    """The descriptor of `x` (anything with shape, strides in bytes, dtype and .data.ptr: a CuPy array
    or a view of one) copying boxes of `box` elements, given in x's own order, outermost first; a box
    shorter than x's rank covers one element of each leading dimension. Checks what
    cuTensorMapEncodeTiled requires (cuda.h's documentation of it) and says which rule a view breaks."""
    shape, strides, item = tuple(x.shape), tuple(x.strides), x.dtype.itemsize
    box = tuple(int(b) for b in box)
    where = f"{name} {x.dtype.name} {shape} strides {strides}"
    if x.dtype.name not in TENSOR_MAP_DTYPES:
        raise ValueError(f"{where}: a TMA descriptor has no {x.dtype.name} (it takes {', '.join(TENSOR_MAP_DTYPES)})")
    if not 1 <= len(shape) <= 5:
        raise ValueError(f"{where}: a TMA descriptor describes 1 to 5 dimensions, not {len(shape)}")
    if not 1 <= len(box) <= len(shape):
        raise ValueError(f"{where}: box {box} must have 1 to {len(shape)} dimensions, one per array dimension")
    box = (1,) * (len(shape) - len(box)) + box
    address = int(x.data.ptr)
    if address % 16:
        raise ValueError(f"{where}: address {address:#x} is not 16-byte aligned; copy it contiguous first")
    if strides[-1] != item and shape[-1] > 1:
        raise ValueError(f"{where}: the innermost dimension must be contiguous; copy it contiguous first")
    for s in strides[:-1]:
        if s <= 0 or s % 16 or s >= 2**40:
            raise ValueError(f"{where}: every stride but the innermost must be a positive multiple of 16 bytes "
                             f"below 2^40, not {s}; copy it contiguous first")
    if any(not 1 <= n <= 2**32 for n in shape):
        raise ValueError(f"{where}: every dimension must hold 1 to 2^32 elements")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"{name}: box {box} must be 1 to 256 elements in every dimension")
    inner = box[-1] * item
    if inner % 16:
        raise ValueError(f"{name}: the box's inner dimension is {inner} bytes ({box[-1]} x {item}); "
                         "it must be a multiple of 16")
    if swizzle not in (CU_TENSOR_MAP_SWIZZLE_NONE, *SWIZZLE_SPAN):
        raise ValueError(f"{name}: swizzle {swizzle} is not one of CU_TENSOR_MAP_SWIZZLE_NONE/32B/64B/128B (0 to 3)")
    if swizzle in SWIZZLE_SPAN and inner > SWIZZLE_SPAN[swizzle]:
        raise ValueError(f"{name}: the box's inner dimension is {inner} bytes ({box[-1]} x {item}), wider than "
                         f"the {SWIZZLE_SPAN[swizzle]}-byte swizzle span; split it into boxes of "
                         f"{SWIZZLE_SPAN[swizzle] // item} elements")
    return TensorMapArguments(
        dtype=TENSOR_MAP_DTYPES[x.dtype.name], rank=len(shape), address=address, dims=shape[::-1],
        strides=strides[-2::-1], box=box[::-1], element_strides=(1,) * len(shape),
        interleave=CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle=swizzle,
        l2_promotion=CU_TENSOR_MAP_L2_PROMOTION_L2_256B, oob_fill=CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def swizzle_for(inner_bytes: int) -> int:
    """The swizzle a lab.tma box gets: the one whose span its inner extent fills, 32 or 64 bytes (a
    row of 64 e4m3 values: 64), otherwise 128 bytes (every 16-bit rung's 64 columns, and the widest:
    a box wider than 128 bytes is refused by tensor_map_arguments)."""
    return {32: CU_TENSOR_MAP_SWIZZLE_32B, 64: CU_TENSOR_MAP_SWIZZLE_64B}.get(inner_bytes, CU_TENSOR_MAP_SWIZZLE_128B)


def encode_tensor_map(args: TensorMapArguments, name: str = "array") -> TensorMap:
    """cuTensorMapEncodeTiled on checked arguments: the descriptor, ready to pass to a kernel."""
    tensor_map = TensorMap.aligned()

    def u64(values):
        return (ctypes.c_uint64 * len(values))(*values)

    def u32(values):
        return (ctypes.c_uint32 * len(values))(*values)

    status = library().cuTensorMapEncodeTiled(
        ctypes.byref(tensor_map), args.dtype, args.rank, ctypes.c_void_p(args.address), u64(args.dims),
        u64(args.strides), u32(args.box), u32(args.element_strides), args.interleave, args.swizzle,
        args.l2_promotion, args.oob_fill)
    check(status, f"cuTensorMapEncodeTiled({name}: dims {args.dims}, box {args.box}, strides {args.strides})")
    return tensor_map


def tensor_map(x, box, *, name: str = "array", swizzle: int = CU_TENSOR_MAP_SWIZZLE_128B) -> TensorMap:
    """The TMA descriptor of a CuPy array (or view) for boxes of `box` elements (x's order)."""
    return encode_tensor_map(tensor_map_arguments(x, box, name=name, swizzle=swizzle), name)
