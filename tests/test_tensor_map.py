"""TMA descriptors (kernels/driver.py) and their declaration (lab.tma) without a GPU: the CUtensorMap
structure, cuda.h's enum values, cuTensorMapEncodeTiled's arguments for contiguous and strided
views, each rule a view or box can break, and lab.tma's parsing. The last test loads boxes on the
GPU through the descriptors with cp.async.bulk.tensor; its kernel is compiled for sm_90 here."""

import ctypes
import glob
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kernels
from kernels import driver, ladder, nvrtc, runtime

BF16 = np.dtype(ml_dtypes.bfloat16)


class OnDevice:
    """A NumPy array as the builder sees a CuPy one: shape, strides, dtype and a device pointer."""

    def __init__(self, array, ptr=0x7F0000000000):
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype

        class data:  # noqa: N801
            pass

        data.ptr = ptr
        self.data = data


def test_tensor_map_is_128_bytes_and_aligned():
    assert ctypes.sizeof(driver.TensorMap) == 128 and len(driver.TensorMap().opaque) == 16
    for _ in range(8):  # wherever the buffer lands, the map sits on the boundary the encode call needs
        m = driver.TensorMap.aligned()
        assert ctypes.addressof(m) % 64 == 0 and ctypes.addressof(m) % driver.TensorMap.ALIGNMENT == 0
        assert bytes(m) == bytes(128)


def cuda_enums() -> dict[str, int]:
    """Every enumerator of cuda.h's CUtensorMap* enums, by name."""
    headers = sorted(glob.glob("/usr/local/cuda*/include/cuda.h"))
    if not headers:
        pytest.skip("no CUDA toolkit header (/usr/local/cuda*/include/cuda.h) to check the enums against")
    text = Path(headers[0]).read_text()
    values, seen = {}, set()
    for enum, body in re.findall(r"typedef enum (CUtensorMap\w*_enum) \{(.*?)\}", text, re.S):
        if enum in seen:  # the documentation repeats some of them
            continue
        seen.add(enum)
        value = -1
        for entry in re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S).split(","):
            if entry.strip():
                name, _, given = (s.strip() for s in entry.partition("="))
                value = int(given, 0) if given else value + 1
                values[name] = value
    return values


def test_enum_values_match_cuda_h():
    enums = cuda_enums()
    for name, code in driver.TENSOR_MAP_DTYPES.items():
        assert enums[f"CU_TENSOR_MAP_DATA_TYPE_{name.upper()}"] == code, name
    assert driver.TENSOR_MAP_DTYPES["bfloat16"] == 9 and driver.TENSOR_MAP_DTYPES["float16"] == 6
    for name in ("CU_TENSOR_MAP_INTERLEAVE_NONE", "CU_TENSOR_MAP_SWIZZLE_NONE", "CU_TENSOR_MAP_SWIZZLE_32B",
                 "CU_TENSOR_MAP_SWIZZLE_64B", "CU_TENSOR_MAP_SWIZZLE_128B", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B",
                 "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"):
        assert enums[name] == getattr(driver, name), name
    assert enums["CU_TENSOR_MAP_SWIZZLE_128B"] == 3


def test_arguments_of_a_contiguous_array():
    """(B, NH, T, d) bf16: the driver's dimensions innermost first, strides in bytes without the innermost."""
    B, NH, T, d = 2, 12, 1000, 64
    args = driver.tensor_map_arguments(OnDevice(np.empty((B, NH, T, d), BF16)), (64, 64), name="Q")
    assert args == driver.TensorMapArguments(
        dtype=9, rank=4, address=0x7F0000000000, dims=(d, T, NH, B), strides=(d * 2, T * d * 2, NH * T * d * 2),
        box=(64, 64, 1, 1), element_strides=(1, 1, 1, 1), interleave=0, swizzle=3, l2_promotion=3, oob_fill=0)


def test_arguments_of_a_view_of_packed_qkv():
    """K as the model makes it: (B, T, 3, NH, d)[:, :, 1] seen as (B, NH, T, d); one row of T steps
    over all of q, k and v; the view starts NH * d elements into the buffer."""
    B, T, NH, d = 2, 97, 12, 64
    qkv = np.empty((B, T, 3, NH, d), np.float16)
    k = qkv[:, :, 1].transpose(0, 2, 1, 3)
    base = 0x7F0000000000
    view = OnDevice(k, ptr=base + NH * d * 2)
    args = driver.tensor_map_arguments(view, (1, 32, 64), name="K", swizzle=driver.CU_TENSOR_MAP_SWIZZLE_128B)
    assert (args.dtype, args.rank, args.address) == (6, 4, base + NH * d * 2)
    assert args.dims == (d, T, NH, B)
    assert args.strides == (3 * NH * d * 2, d * 2, T * 3 * NH * d * 2)
    assert args.box == (64, 32, 1, 1)


def rejected(x, box=(64, 64), match="", **kw):
    with pytest.raises(ValueError, match=match):
        driver.tensor_map_arguments(x, box, name="K", **kw)


def test_views_a_descriptor_cannot_describe_are_refused_by_rule():
    a = np.empty((2, 4, 128, 64), BF16)
    rejected(OnDevice(a, ptr=0x7F0000000008), match=r"K .*address 0x7f0000000008 is not 16-byte aligned; copy it contiguous")
    odd = np.empty((2, 4, 128, 12), np.float16)  # rows of 24 bytes
    rejected(OnDevice(odd), (8, 8), match=r"K .*multiple of 16 bytes below 2\^40, not 24; copy it contiguous")
    rejected(OnDevice(np.empty((2, 4, 128, 128), BF16)[..., ::2]), match="innermost dimension must be contiguous")
    rejected(OnDevice(np.empty((1,) * 6, np.float32)), (1,), match="1 to 5 dimensions, not 6")
    rejected(OnDevice(np.empty((2, 4), np.complex64)), (4,), match="no complex64")


def test_boxes_the_hardware_cannot_copy_are_refused():
    a = OnDevice(np.empty((2, 4, 128, 128), BF16))
    rejected(a, (64, 128), match=r"inner dimension is 256 bytes \(128 x 2\), wider than the 128-byte swizzle span; "
                                 "split it into boxes of 64 elements")
    rejected(a, (64, 64), match="wider than the 64-byte swizzle span", swizzle=driver.CU_TENSOR_MAP_SWIZZLE_64B)
    driver.tensor_map_arguments(a, (64, 128), swizzle=driver.CU_TENSOR_MAP_SWIZZLE_NONE)  # no span without swizzle
    rejected(a, (64, 4), match=r"inner dimension is 8 bytes .* multiple of 16")
    rejected(a, (512, 64), match=r"box \(1, 1, 512, 64\) must be 1 to 256")
    rejected(a, (0, 64), match="must be 1 to 256")
    rejected(a, (1, 1, 1, 64, 64), match="box .* must have 1 to 4 dimensions")
    rejected(a, (64, 64), match="swizzle 5 is not one of", swizzle=5)


def test_a_box_gets_the_swizzle_its_rows_fill():
    """The launcher's choice per lab.tma box (driver.swizzle_for): 64 e4m3 values (64 bytes) the 64-byte
    swizzle, 32 bytes the 32-byte one, and 128 bytes (64 bf16 values, 128 e4m3) or anything else 128."""
    assert driver.swizzle_for(64) == driver.CU_TENSOR_MAP_SWIZZLE_64B
    assert driver.swizzle_for(32) == driver.CU_TENSOR_MAP_SWIZZLE_32B
    assert driver.swizzle_for(128) == driver.swizzle_for(96) == driver.swizzle_for(256) == driver.CU_TENSOR_MAP_SWIZZLE_128B
    q8 = OnDevice(np.empty((1, 2, 100, 64), np.uint8))
    args = driver.tensor_map_arguments(q8, (128, 64), name="Q", swizzle=driver.swizzle_for(64))
    assert (args.dtype, args.swizzle, args.box) == (0, driver.CU_TENSOR_MAP_SWIZZLE_64B, (64, 128, 1, 1))


def test_a_tensor_map_is_passed_by_value():
    """PackedLaunch hands the driver a pointer to the map's own 128 bytes."""

    class Kernel:
        class kernel:  # noqa: N801
            ptr = 0xDEAD

    m = driver.TensorMap.aligned()
    m.opaque[0], m.opaque[15] = 0x1234, 0x5678
    launch = driver.PackedLaunch(Kernel, 1, 128, (np.int32(3), m))
    assert launch.params[1] == ctypes.addressof(m)
    assert ctypes.cast(launch.params[1], ctypes.POINTER(driver.TensorMap)).contents.opaque[15] == 0x5678


# -- the declaration -------------------------------------------------------------------------------

TMA_RUNG = """\
/*
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 128, 64), (128, 64, 64)
 * lab.threads    128
 * lab.smem       2 * (B_r + 2 * B_c) * d_head
 * lab.dtypes     bfloat16
 * lab.tma        Q: (B_r, min(d_head, 64)), K: (B_c, 64), V: (B_c, 64), O: (1, 1, B_r, 64)
 */
template <int d_head, int B_r, int B_c>
__global__ void attention_forward() {}
"""


def test_tma_declaration_is_parsed_and_evaluated(tmp_path):
    path = tmp_path / "tma.cu"
    path.write_text(TMA_RUNG)
    rung = kernels.load(path)
    assert rung.tma == (("Q", ("B_r", "min(d_head, 64)")), ("K", ("B_c", "64")), ("V", ("B_c", "64")),
                        ("O", ("1", "1", "B_r", "64")))
    assert rung.tma_boxes((64, 128, 64)) == {"Q": (128, 64), "K": (64, 64), "V": (64, 64), "O": (1, 1, 128, 64)}
    assert list(rung.tma_boxes((128, 64, 64))) == ["Q", "K", "V", "O"]
    plain = tmp_path / "plain.cu"
    plain.write_text(TMA_RUNG.replace(" * lab.tma", " * no tma"))
    assert kernels.load(plain).tma == () and kernels.load(plain).tma_boxes((64, 128, 64)) == {}


def test_the_launcher_builds_the_declared_descriptors_in_order(tmp_path):
    path = tmp_path / "tma.cu"
    path.write_text(TMA_RUNG.replace("O: (1, 1, B_r, 64)", "O: (B_r, 64)").replace("Q: (B_r, min(d_head, 64)), ", ""))
    rung = kernels.load(path)
    B, NH, T, d = 1, 2, 256, 64
    qkv = np.empty((B, T, 3, NH, d), BF16)
    views = {name: OnDevice(qkv[:, :, i].transpose(0, 2, 1, 3), ptr=0x10000 + i * NH * d * 2)
             for i, name in enumerate("QKV")}
    views["O"] = OnDevice(np.empty((B, NH, T, d), BF16), ptr=0x90000)
    maps = runtime.tensor_map_arguments(rung, (64, 128, 64), views)
    assert [m.address for m in maps] == [0x10000 + NH * d * 2, 0x10000 + 2 * NH * d * 2, 0x90000]
    assert [m.box for m in maps] == [(64, 64, 1, 1), (64, 64, 1, 1), (64, 128, 1, 1)]
    assert maps[0].strides == (3 * NH * d * 2, d * 2, T * 3 * NH * d * 2) and maps[2].strides == (128, T * 128, NH * T * 128)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("K: (B_c, 64)", "K: B_c, 64"), "lab.tma must read like"),
    (lambda s: s.replace("K: (B_c, 64)", "X: (B_c, 64)"), "lab.tma must read like"),
    (lambda s: s.replace("K: (B_c, 64)", "K: (B_c, 64"), "lab.tma must read like"),
    (lambda s: s.replace("V: (B_c, 64)", "K: (B_c, 64)"), "lab.tma declares K twice"),
    (lambda s: s.replace("K: (B_c, 64)", "K: (1, 1, 1, B_c, 64)"), "K's box has 5 extents"),
    (lambda s: s.replace("K: (B_c, 64)", "K: (8 * B_c, 64)"), r"lab.tma K box is \(512, 64\) for config \(64, 128, 64\)"),
    (lambda s: s.replace("K: (B_c, 64)", "K: (B_c - 64, 64)"), r"lab.tma K box is \(0, 64\)"),
    (lambda s: s.replace("K: (B_c, 64)", "K: (B_c, n_tiles)"), "cannot evaluate 'n_tiles'"),
])
def test_bad_tma_declarations_are_clear_errors(tmp_path, edit, message):
    path = tmp_path / "bad.cu"
    path.write_text(edit(TMA_RUNG))
    with pytest.raises(ValueError, match=message):
        kernels.load(path)


# -- on the GPU: one box through the descriptor ----------------------------------------------------

LOAD_BOX = r"""
struct __align__(64) TensorMap { unsigned long long opaque[16]; };  // CUtensorMap

// Copy the (1, 1, 64, 64) box at (b, h, t, 0) of a (B, NH, T, 64) 16-bit array into shared memory
// with cp.async.bulk.tensor, then to `out` as it lies there (swizzled, if the map says so).
__global__ void load_box(const __grid_constant__ TensorMap map, int b, int h, int t, unsigned short* out)
{
    __shared__ __align__(1024) unsigned short box[64 * 64];  // 128-byte swizzle repeats every 1024 bytes
    __shared__ __align__(8) unsigned long long barrier;
    unsigned box_smem = (unsigned)__cvta_generic_to_shared(box);
    unsigned barrier_smem = (unsigned)__cvta_generic_to_shared(&barrier);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(barrier_smem));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the copy engine sees the init
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(barrier_smem), "r"(64 * 64 * 2));
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                     :: "r"(box_smem), "l"(&map), "r"(0), "r"(t), "r"(h), "r"(b), "r"(barrier_smem) : "memory");
    }
    __syncthreads();
    unsigned done = 0;
    while (!done)  // phase 0 completes when the box's bytes have landed
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(barrier_smem) : "memory");
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) out[i] = box[i];
}
"""


def test_the_load_box_kernel_compiles_for_sm_90():
    """The GPU test's PTX (cp.async.bulk.tensor, mbarrier expect-tx and parity wait) passes ptxas."""
    [result] = nvrtc.compile_isolated(LOAD_BOX, "load_box.cu", ["-arch=sm_90", "-Xptxas=-v"], ["load_box"])
    assert "Used" in result["log"]


def unswizzle_128b(box: np.ndarray) -> np.ndarray:
    """Undo CU_TENSOR_MAP_SWIZZLE_128B on a box of 128-byte rows: in row r, the 16-byte chunk c was
    stored at chunk c ^ (r % 8)."""
    rows = box.reshape(-1, 8, 8)  # (row, 16-byte chunk, element)
    r = np.arange(rows.shape[0])[:, None]
    return rows[r, np.arange(8)[None, :] ^ (r % 8)].reshape(box.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("swizzle", [driver.CU_TENSOR_MAP_SWIZZLE_NONE, driver.CU_TENSOR_MAP_SWIZZLE_128B])
def test_a_box_loads_through_its_descriptor(packed, swizzle):
    """One (64, 64) box of a bf16 (B, NH, T, 64) array, contiguous or K of a packed qkv, lands in shared
    memory as the array holds it (after undoing the swizzle); rows past T read as zero."""
    import cupy as cp

    if ladder.arch_number(runtime.device_limits().arch) < 90:
        pytest.skip("TMA needs sm_90 or newer")
    B, NH, T, d = 2, 3, 100, 64
    n = B * T * 3 * NH * d  # varied nonzero bit patterns, so a misplaced or zero-filled element shows
    bits = (cp.arange(n, dtype=cp.uint32) * 40503 % 65521 + 1).astype(cp.uint16).reshape(B, T, 3, NH, d)
    x = bits[:, :, 1].transpose(0, 2, 1, 3) if packed else cp.ascontiguousarray(bits[:, :, 1].transpose(0, 2, 1, 3))
    x = x.view(BF16)
    tensor_map = driver.tensor_map(x, (64, 64), name="K", swizzle=swizzle)
    fn = cp.RawModule(code=LOAD_BOX, name_expressions=["load_box"]).get_function("load_box")
    expected_all = x.view(cp.uint16).get()
    for b, h, t in [(0, 0, 0), (1, 2, 64)]:
        out = cp.zeros(64 * 64, dtype=cp.uint16)
        driver.PackedLaunch(fn, 1, 128, (tensor_map, np.int32(b), np.int32(h), np.int32(t), out),
                            stream=cp.cuda.get_current_stream().ptr, name="load_box")()
        got = out.get().reshape(64, 64)
        if swizzle == driver.CU_TENSOR_MAP_SWIZZLE_128B:
            got = unswizzle_128b(got)
        expected = np.zeros((64, 64), np.uint16)
        rows = expected_all[b, h, t:t + 64]
        expected[:len(rows)] = rows
        np.testing.assert_array_equal(got, expected, err_msg=f"box at b={b}, h={h}, t={t}")
