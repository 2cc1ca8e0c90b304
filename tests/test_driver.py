"""kernels/driver.py without a GPU: the launch structures have cuda.h's layout, the launch attributes
carry what they are asked, arguments are packed by type, and what cannot be packed is refused by name."""

import ctypes

import numpy as np
import pytest

from gpt2.fast import Launch
from kernels import driver


def test_launch_structs_match_cuda_h():
    """CUlaunchAttribute is {id, 4 bytes of padding, a 64-byte union}; CUlaunchConfig has the stream
    pointer after seven unsigned ints (padded to 8 bytes), then the attribute pointer and count."""
    assert driver.LaunchAttribute.id.offset == 0 and driver.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(driver.LaunchAttributeValue) == 64 and ctypes.sizeof(driver.LaunchAttribute) == 72
    assert driver.LaunchAttributeValue.clusterDim.offset == 0 and ctypes.sizeof(driver.Dim3) == 12
    assert driver.LaunchConfig.sharedMemBytes.offset == 24 and driver.LaunchConfig.hStream.offset == 32
    assert driver.LaunchConfig.attrs.offset == 40 and driver.LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(driver.LaunchConfig) == 56


def test_attribute_ids_match_cuda_h():
    assert driver.CU_LAUNCH_ATTRIBUTE_COOPERATIVE == 2
    assert driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION == 4
    assert driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert driver.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH == 11
    assert driver.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED == 14


class FakeKernel:
    class kernel:  # noqa: N801  (CuPy's RawKernel.kernel.ptr: the CUfunction)
        ptr = 0xDEAD


class FakeArray:
    class data:  # noqa: N801
        ptr = 0x7000


def test_pdl_launch_arguments_are_packed_by_type():
    """What cuLaunchKernelEx receives: one pointer per argument, each to a value of the kernel's type."""
    launch = driver.PackedLaunch(FakeKernel, (3, 2), (128,), (FakeArray(), np.int32(-5), np.float32(0.5),
                                                              np.uint64(7), np.int64(-9), np.uint32(4), np.float64(2.5)),
                                 shared_mem=96, stream=0x1234, pdl=True)
    config = launch.config
    assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.blockDimY) == (3, 2, 1, 128, 1)
    assert config.blockDimZ == 1 and config.sharedMemBytes == 96 and config.hStream == 0x1234 and config.numAttrs == 1
    assert config.attrs.contents.id == 6 and config.attrs.contents.value.programmaticStreamSerializationAllowed == 1
    assert launch.function.value == 0xDEAD
    types = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint32,
             ctypes.c_double)
    got = [ctypes.cast(launch.params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
    assert got == [0x7000, -5, 0.5, 7, -9, 4, 2.5]


@pytest.mark.parametrize("value,name", [(3, "int"), (0.5, "float"), ("x", "str"), (np.int8(1), "int8")])
def test_an_argument_of_no_kernel_type_is_refused_by_name(value, name):
    with pytest.raises(TypeError, match=f"k: cannot pass {name} to a kernel"):
        driver.PackedLaunch(FakeKernel, 1, 1, (np.int32(1), value), name="k")


def test_a_pdl_launch_of_the_engine_packs_through_the_driver():
    """gpt2.fast's Launch hands a pdl launch to driver.PackedLaunch: a bad argument fails there, by
    the launch's name, before anything reaches the driver."""
    with pytest.raises(TypeError, match="cannot pass int"):
        Launch("k", FakeKernel, (1,), (1,), (3,), pdl=True)()


def test_cooperative_and_cluster_attributes():
    attrs = driver.launch_attributes(pdl=True, cooperative=True, cluster=(2,))
    assert [a.id for a in attrs] == [6, 2, 4]
    assert attrs[1].value.cooperative == 1
    assert (attrs[2].value.clusterDim.x, attrs[2].value.clusterDim.y, attrs[2].value.clusterDim.z) == (2, 1, 1)
    launch = driver.PackedLaunch(FakeKernel, (8, 4), 256, (), cooperative=True, cluster=(2, 2))
    assert launch.config.numAttrs == 2 and launch.config.attrs[1].value.clusterDim.y == 2
    plain = driver.PackedLaunch(0xBEEF, 1, 32, ())
    assert plain.config.numAttrs == 0 and not plain.config.attrs and plain.function.value == 0xBEEF


@pytest.mark.parametrize("dims", [(0,), (1, 2, 3, 4), ()])
def test_bad_launch_dimensions_are_refused(dims):
    with pytest.raises(ValueError, match="launch dimensions must be 1 to 3 positive ints"):
        driver.PackedLaunch(FakeKernel, dims, 1, ())
