"""The FP8 scheme without a GPU (kernels/fp8.py): e4m3 rounding against ml_dtypes, the block scales and
the Hadamard rotation, V^T's key order, and the whole scheme emulated in float64 on FlashAttention-3's
outlier distribution, where block scales with the rotation must beat one scale per tensor and stay
within the issue's 1.0e-2 RMSE against float64."""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import kernels
from kernels import fp8, runtime

E4M3 = ml_dtypes.float8_e4m3fn
RMSE_TARGET = 1.0e-2  # the issue's, FlashAttention-3's 9.1e-3 beside its per-tensor baseline's 2.4e-2


def rmse(a, b) -> float:
    return math.sqrt(float(np.mean((np.asarray(a, np.float64) - b) ** 2)))


# -- e4m3 -----------------------------------------------------------------------------------------


def test_the_code_table_is_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    got = fp8.e4m3_values()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2  # 0x7f, 0xff
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.nanmax(got) == fp8.E4M3_MAX and got[1] == 2.0**-9  # largest finite; smallest subnormal


def awkward_values() -> np.ndarray:
    """Every e4m3 value, every midpoint between neighbours (the ties), a float32 step either side of
    each, and log-uniform magnitudes from 1e-11 to 448 of both signs."""
    values = fp8.e4m3_values()[: fp8.E4M3_NAN]
    mids = (values[:-1] + values[1:]) / 2
    rng = np.random.default_rng(0)
    spread = np.exp(rng.uniform(math.log(1e-11), math.log(448.0), 20_000)).astype(np.float32)
    x = np.concatenate([values, mids, spread])
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf))])
    x = np.concatenate([x, -x])
    return x[np.abs(x) <= fp8.E4M3_MAX]


def test_rounding_is_ml_dtypes_round_to_nearest_even():
    x = awkward_values()
    want = x.astype(E4M3)
    got = fp8.round_e4m3(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(fp8.to_e4m3(x), want.view(np.uint8))
    np.testing.assert_array_equal(fp8.from_e4m3(fp8.to_e4m3(x)), got)
    ties = np.array([2.0**-10, 3 * 2.0**-10, 17.0, 19.0, 248.0, 464.0 - 1e-3], np.float32)  # 0/2^-9, 2 2^-9, 16, 20, 256
    np.testing.assert_array_equal(fp8.round_e4m3(ties), [0.0, 2.0**-8, 16.0, 20.0, 256.0, 448.0])


def test_rounding_saturates_at_448_where_ml_dtypes_gives_nan_and_keeps_nan():
    x = np.array([448.0, 449.0, 480.0, 1e30, -1e30, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    got = fp8.round_e4m3(x)
    np.testing.assert_array_equal(got[:5], [448.0, 448.0, 448.0, 448.0, -448.0])
    assert np.isnan(got[5:8]).all()  # e4m3 has no infinity: a non-finite input stays non-finite
    assert np.isnan(x[2:4].astype(E4M3).astype(np.float32)).all()  # ml_dtypes overflows to NaN instead
    np.testing.assert_array_equal(fp8.to_e4m3(x), [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x7F, 0x00, 0x80])


# -- the rotation and the scales ------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
def test_the_rotation_is_orthogonal_and_keeps_the_scores(d):
    R = fp8.rotation(d, seed=3).astype(np.float64)
    np.testing.assert_allclose(R @ R.T, np.eye(d), atol=1e-6)
    assert np.allclose(np.abs(R), 1 / math.sqrt(d))  # +-1/sqrt(d): an outlier spreads over every column
    assert not np.array_equal(R, fp8.rotation(d, seed=4))  # the signs come from the seed
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 50, d))
    np.testing.assert_allclose((q @ R) @ (k @ R).T, q @ k.T, atol=1e-5)
    with pytest.raises(ValueError, match="power of two, got d=80"):
        fp8.rotation(80)


def test_block_scales_put_each_blocks_largest_finite_value_on_448():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 100, 16)).astype(np.float32)
    x[1, 2, 40, 5] = np.nan  # ignored by its block's scale
    x[0, 0, 64:96] = 0.0  # an all-zero block: scale 1
    scales = fp8.scales_of(x, 32)
    assert scales.shape == (2, 3, 4) and scales.dtype == np.float32
    for b, h, n in np.ndindex(2, 3, 4):
        block = x[b, h, 32 * n: 32 * n + 32]
        amax = np.abs(block[np.isfinite(block)]).max()
        assert scales[b, h, n] == (np.float32(amax) / np.float32(448) if amax > 0 else 1.0)
    per_tensor = fp8.scales_of(x, 32, per_tensor=True)
    assert (per_tensor == np.abs(np.nan_to_num(x)).max() / np.float32(448)).all()


@pytest.mark.parametrize("hadamard", [True, False])
def test_quantized_values_are_e4m3_roundings_of_the_input(hadamard):
    """Each value within e4m3's half step of the (rotated) input: 2^-4 of its magnitude, or 2^-10 of its
    block's scale among the subnormals."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 77, 64)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((2, 2, 45, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
    inputs = kernels.quantize_fp8(q, k, v, block_q=32, block_k=16, hadamard=hadamard, seed=5)
    assert inputs.q.dtype == inputs.k.dtype == inputs.v_t.dtype == np.uint8
    assert inputs.q.shape == (2, 4, 77, 64) and inputs.k.shape == (2, 2, 45, 64) and inputs.v_t.shape == (2, 2, 64, 48)
    assert kernels.quantize_fp8(q, k, v, block_q=32, block_k=128).v_t.shape == (2, 2, 64, 128)  # whole blocks of keys
    assert inputs.q_scale.shape == (2, 4, 3) and inputs.k_scale.shape == inputs.v_scale.shape == (2, 2, 3)
    assert inputs.shape == q.shape and inputs.T_k == 45 and inputs.v_t.flags.c_contiguous
    R = fp8.rotation(64, 5).astype(np.float64) if hadamard else np.eye(64)
    for got, want, scales, rows in zip(inputs.dequantized(), (q.astype(np.float64) @ R, k.astype(np.float64) @ R,
                                                              v.astype(np.float64)),
                                       (inputs.q_scale, inputs.k_scale, inputs.v_scale), (32, 16, 16)):
        scale = np.repeat(scales, rows, axis=-1)[..., : want.shape[2], None]
        assert (np.abs(got - want) <= (2.0**-4 + 1e-6) * np.abs(want) + 2.0**-10 * scale).all()
        assert np.abs(got - want).max() > 0  # it really rounded
        assert np.isclose(np.abs(got).max(), 448 * scales.max())  # the largest value lands on 448
    keys = 16 * (np.arange(48) // 16) + fp8.KEY_ORDER[np.arange(48) % 16]  # each column's key
    assert not inputs.v_t[..., keys >= 45].any() and inputs.v_t[..., keys < 45].any()  # zeros past T_k


def test_v_t_holds_each_16_keys_in_the_registers_order():
    """Column 16 G + c of V^T is key 16 G + KEY_ORDER[c]: the keys of a quad's packed probabilities."""
    assert sorted(fp8.KEY_ORDER) == list(range(16))
    assert list(fp8.KEY_ORDER[:8]) == [0, 1, 8, 9, 2, 3, 10, 11]  # thread 0 packs keys 0, 1, 8, 9; thread 1 ...
    v = np.random.default_rng(4).standard_normal((1, 2, 40, 64)).astype(np.float32)
    inputs = kernels.quantize_fp8(v, v, v, block_q=64, block_k=64, hadamard=False)
    codes = fp8.to_e4m3(v / inputs.v_scale[..., None])  # one block of 64 rows holds all 40
    assert inputs.v_t.shape == (1, 2, 64, 64)
    for column in range(64):
        key = 16 * (column // 16) + int(fp8.KEY_ORDER[column % 16])
        want = codes[..., key, :] if key < 40 else 0
        np.testing.assert_array_equal(inputs.v_t[..., column], want, err_msg=f"column {column}: key {key}")


def test_non_finite_values_stay_in_their_row():
    """NaN or Inf: NaN in the codes of its own row only (spread along the row by the rotation), the
    block's scale from its finite values."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, 64, 64)).astype(np.float32) for _ in range(3))
    q[0, 0, 10, 3], k[0, 0, 20, 4], v[0, 0, 30, 5] = np.nan, np.inf, -np.inf
    inputs = kernels.quantize_fp8(q, k, v, block_q=64, block_k=64)
    nan_q, nan_k = np.isnan(fp8.from_e4m3(inputs.q))[0, 0], np.isnan(fp8.from_e4m3(inputs.k))[0, 0]
    assert nan_q[10].all() and nan_q.sum() == 64 and nan_k[20].all() and nan_k.sum() == 64
    nan_v = np.isnan(inputs.dequantized()[2])[0, 0]
    assert nan_v[30, 5] and nan_v.sum() == 1
    assert np.isfinite(inputs.q_scale).all() and np.isfinite(inputs.k_scale).all() and np.isfinite(inputs.v_scale).all()


@pytest.mark.parametrize("make,error,message", [
    (lambda x: (x[0], x, x), ValueError, "4-d"),
    (lambda x: (x, x, x[:, :, :5]), ValueError, "shapes disagree"),
    (lambda x: (x.astype(np.int32), x, x), TypeError, "int32; quantize_fp8 takes floating-point"),
    (lambda x: (x[:, :, :0], x, x), ValueError, "empty input"),
])
def test_bad_input_is_a_clear_error(make, error, message):
    x = np.ones((1, 2, 8, 64), np.float32)
    with pytest.raises(error, match=message):
        kernels.quantize_fp8(*make(x), block_q=64, block_k=64)


def test_bad_blocks_and_head_sizes_are_clear_errors():
    x = np.ones((1, 2, 8, 48), np.float32)
    with pytest.raises(ValueError, match="block_k must be a positive number of rows, got 0"):
        kernels.quantize_fp8(x, x, x, block_q=64, block_k=0)
    with pytest.raises(ValueError, match="power of two, got d=48"):
        kernels.quantize_fp8(x, x, x, block_q=64, block_k=64)
    assert kernels.quantize_fp8(x, x, x, block_q=64, block_k=64, hadamard=False).q.shape == x.shape


# -- the scheme, emulated in float64 --------------------------------------------------------------


def test_the_emulation_without_rounding_is_attention(monkeypatch):
    """With P's rounding removed, the emulation is attention of the dequantized inputs (the tile loop
    and the online softmax add nothing), causal, cross and grouped-query heads alike."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 70, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 90, 64)).astype(np.float32) for _ in range(2))
    inputs = kernels.quantize_fp8(q, k, v, block_q=64, block_k=32)
    rounded = fp8.emulated_attention(inputs)
    monkeypatch.setattr(fp8, "round_e4m3", lambda x: x)
    for causal in (True, False):
        got = fp8.emulated_attention(inputs, causal=causal)
        want = kernels.reference_attention(*inputs.dequantized(), causal=causal)
        np.testing.assert_allclose(got, want, atol=1e-12)
    assert 0 < np.abs(rounded - kernels.reference_attention(*inputs.dequantized())).max() < 0.05


@pytest.mark.parametrize("causal", [True, False])
def test_block_scales_and_the_rotation_beat_one_scale_per_tensor_on_outliers(causal):
    """FlashAttention-3's accuracy test, emulated: N(0,1) + N(0,100) x Bernoulli(0.001) at d = 128. The
    FP8 scheme (block scales, Hadamard rotation, P in e4m3) within 1.0e-2 RMSE of float64 attention;
    one scale per tensor without the rotation clearly worse."""
    q, k, v = fp8.outlier_inputs(np, (1, 2, 1024, 128), seed=0)
    ref = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    block = rmse(fp8.emulated_attention(kernels.quantize_fp8(q, k, v, block_q=128, block_k=128), causal=causal), ref)
    tensor = rmse(fp8.emulated_attention(kernels.quantize_fp8(q, k, v, block_q=128, block_k=128, hadamard=False,
                                                              per_tensor=True), causal=causal), ref)
    assert block <= RMSE_TARGET, f"block scales + Hadamard: RMSE {block:.2e} > {RMSE_TARGET:.1e}"
    assert tensor > 1.3 * block, f"per tensor {tensor:.2e} is not clearly worse than block + Hadamard {block:.2e}"


# -- the rung's declarations and the launcher, without a GPU --------------------------------------

FP8_RUNGS = [name for name in kernels.names() if kernels.load(name).fp8]


def test_the_fp8_rung_declares_what_the_launcher_needs():
    e4m3 = [n for n in FP8_RUNGS if kernels.load(n).fp8_qk == "e4m3" and kernels.load(n).unverified is None]
    assert FP8_RUNGS and FP8_RUNGS[0] == "v25_fp8" and runtime.fp8_rung() == e4m3[-1]
    assert runtime.fp8_rung() == "v29_fp8_wide_keys"
    rung = kernels.load("v25")
    assert rung.dtypes == ("bfloat16",) and set(rung.supports) == {"noncausal", "cross", "gqa"}
    assert rung.head_sizes() == [64, 128] and not rung.lse and not rung.persistent
    assert rung.tma_boxes((128, 128, 128)) == {"Q": (128, 128), "K": (128, 128), "V": (128, 128)}
    assert rung.tma_boxes((64, 192, 128)) == {"Q": (192, 64), "K": (128, 64), "V": (64, 128)}


@pytest.mark.parametrize("d,wanted", [(64, (2, 2, 3)), (128, (3, 3, 3))])
def test_descriptors_of_the_fp8_arrays_swizzle_over_their_rows(d, wanted):
    """e4m3 rows of 64 bytes take the 64-byte swizzle, of 128 bytes the 128-byte one; V^T's rows are
    the 128 keys of a tile. The arrays are uint8 (CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0)."""
    from tests.test_tensor_map import OnDevice

    rung = kernels.load("v25")
    config = rung.configs_for(d)[0]
    B, NH, T = 2, 4, 300
    tensors = {"Q": OnDevice(np.empty((B, NH, T, d), np.uint8)), "K": OnDevice(np.empty((B, 2, T, d), np.uint8)),
               "V": OnDevice(np.empty((B, 2, d, 304), np.uint8))}
    maps = runtime.tensor_map_arguments(rung, config, tensors)
    assert [m.swizzle for m in maps] == list(wanted) and {m.dtype for m in maps} == {0}
    assert maps[2].dims == (304, d, 2, B) and maps[2].box == (128, d, 1, 1) and maps[2].strides == (304, 304 * d, 2 * 304 * d)
    assert maps[0].box == (d, rung.params(config)["B_r"], 1, 1)


def test_an_fp8_rung_takes_its_scales_after_the_strides(monkeypatch):
    from tests.test_kernels_cpu import stand_in_instance

    monkeypatch.setattr(runtime, "device_limits", lambda: runtime.DeviceLimits("stand-in", "sm_90", 132, 1024, 0))
    inst = stand_in_instance(kernels.load("v25"), (128, 128, 128), per_sm=1)
    q8, k8 = np.zeros((1, 4, 300, 128), np.uint8), np.zeros((1, 2, 300, 128), np.uint8)
    scales = tuple(np.full((1, n, 3), i, np.float32) for i, n in enumerate((4, 2, 2)))
    inst.launch(q8, k8, k8, q8, q8, 0.125, True, scales=scales)
    (grid, args), = inst.function.launches
    assert grid == (3, 4, 1)
    assert [int(a) for a in args[5:9]] == [300, 300, 2, 1] and [type(a) for a in args[10:16]] == [np.int64] * 6
    assert args[16:] == scales  # q_scale, k_scale, v_scale, then (with descriptors) the tensor maps


def numpy_inputs(B=1, NH=2, NH_kv=2, T_q=100, T_k=100, d=64, block_q=128, block_k=128):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, NH, T_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, NH_kv, T_k, d)).astype(np.float32) for _ in range(2))
    return kernels.quantize_fp8(q, k, v, block_q=block_q, block_k=block_k)


def test_the_configuration_is_the_one_whose_tiles_are_the_blocks():
    rung = kernels.load("v25")
    assert runtime.fp8_config(rung, numpy_inputs(block_q=192)) == (64, 192, 128)
    assert runtime.fp8_config(rung, numpy_inputs(block_q=128)) == (64, 128, 128)
    assert runtime.fp8_config(rung, numpy_inputs(d=128)) == (128, 128, 128)
    with pytest.raises(ValueError, match=r"blocks of 64 x 128 rows .* tiles 192 x 128, 128 x 128 \(B_r x B_c\) at d=64"):
        runtime.fp8_config(rung, numpy_inputs(block_q=64))
    with pytest.raises(ValueError, match=r"config \(64, 192, 128\) has tiles \(192, 128\)"):
        runtime.fp8_config(rung, numpy_inputs(block_q=128), config=(64, 192, 128))


def test_fp8_inputs_are_checked_before_the_gpu_is_asked():
    rung = kernels.load("v25")
    good = numpy_inputs(NH=4, NH_kv=2, T_q=90, T_k=120)
    runtime.check_fp8_inputs(good, rung, causal=False, scale=None)
    with pytest.raises(TypeError, match="must be kernels.Fp8Inputs"):
        runtime.check_fp8_inputs((good.q, good.k, good.v_t), rung, True, None)
    with pytest.raises(ValueError, match=f"v24_persistent does not compute in FP8 .*; {runtime.fp8_rung()} does"):
        runtime.check_fp8_inputs(good, kernels.load("v24"), True, None)
    with pytest.raises(TypeError, match=r"inputs.k_scale must be a 3-d float32 array, got float64"):
        runtime.check_fp8_inputs(dataclasses.replace(good, k_scale=good.k_scale.astype(np.float64)), rung, True, None)
    with pytest.raises(ValueError, match=r"inputs.v_scale has shape \(1, 2, 2\); .* it must be \(1, 2, 1\)"):
        runtime.check_fp8_inputs(dataclasses.replace(good, v_scale=np.ones((1, 2, 2), np.float32)), rung, True, None)
    with pytest.raises(ValueError, match="head sizes 64, 128; got d=32"):
        runtime.check_fp8_inputs(numpy_inputs(d=32), rung, True, None)
    with pytest.raises(ValueError, match="finite"):
        runtime.check_fp8_inputs(good, rung, True, float("inf"))
    with pytest.raises(TypeError, match=f"NumPy arrays; kernel {runtime.fp8_rung(good)} runs on the GPU"):
        kernels.attention_fp8(good, causal=False)


@pytest.mark.parametrize("name", FP8_RUNGS)
def test_the_packed_probabilities_meet_the_v_t_columns_of_their_keys(name):
    """A model of the FP8 rungs' round_P on the documented fragment layouts (PTX ISA, wgmma register fragments;
    CUTLASS's CLayout_64xN and ALayout_64x32), per lane of a warp: the accumulator of S holds, at entry
    4 n + e, row g + 8 (e // 2) and key 8 n + 2 t + e % 2; the e4m3 A operand of key step kk holds in byte
    b of register r row g + 8 (r % 2) and slot 4 t + b + 16 (r // 2), which the product pairs with column
    32 kk + slot of V^T_j, i.e. with key KEY_ORDER of that column. Every byte must carry its slot's key."""
    source = kernels.resolve(name).read_text()
    assert "const int n = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);" in source  # the model's mapping is the kernel's
    assert "pack_e4m3(S[4 * n + e], S[4 * n + e + 1], S[4 * n + 4 + e], S[4 * n + 4 + e + 1])" in source
    B_c = 128
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for kk in range(B_c // 32):
            for r in range(4):
                n, e = 4 * kk + 2 * (r // 2), 2 * (r % 2)
                for byte, entry in enumerate((4 * n + e, 4 * n + e + 1, 4 * n + 4 + e, 4 * n + 4 + e + 1)):
                    row, key = g + 8 * (entry % 4 // 2), 8 * (entry // 4) + 2 * t + entry % 2
                    slot = 4 * t + byte + 16 * (r // 2)
                    column = 32 * kk + slot
                    assert row == g + 8 * (r % 2), (lane, kk, r, byte)
                    assert key == 16 * (column // 16) + fp8.KEY_ORDER[column % 16], (lane, kk, r, byte)


def test_v_per_head_gives_every_tile_of_a_head_the_heads_scale():
    """quantize_fp8(..., v_per_head=True): V's scale per tile is the head's largest magnitude over 448 in
    every tile (the format unchanged), Q's and K's untouched; its values within e4m3's half step."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 300, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 300, 64)).astype(np.float32) for _ in range(2))
    v[1, 0, 250, 7] = 40.0  # one head's outlier, in its last tile
    tile, head = (kernels.quantize_fp8(q, k, v, block_q=128, block_k=128, v_per_head=p) for p in (False, True))
    assert head.v_per_head and not tile.v_per_head and "V per head" in head.describe()
    assert head.v_scale.shape == tile.v_scale.shape == (2, 2, 3)
    np.testing.assert_array_equal(head.v_scale, np.repeat(tile.v_scale.max(axis=-1, keepdims=True), 3, axis=-1))
    assert head.v_scale[1, 0, 0] == np.float32(40.0 / 448) and tile.v_scale[1, 0, 0] < head.v_scale[1, 0, 0]
    for a, b in ((head.q, tile.q), (head.k, tile.k), (head.q_scale, tile.q_scale), (head.k_scale, tile.k_scale)):
        np.testing.assert_array_equal(a, b)
    got = head.dequantized()[2]
    assert (np.abs(got - v) <= (2.0**-4 + 1e-6) * np.abs(v) + 2.0**-10 * head.v_scale[..., :1, None]).all()


def test_a_rung_that_needs_v_per_head_refuses_tile_scales_and_the_default_picks_one_that_takes_them():
    head_rungs = [n for n in FP8_RUNGS if kernels.load(n).fp8_v == "head"]
    assert head_rungs == ["v27_fp8_row_sums", "v28_fp8_bf16_scores", "v29_fp8_wide_keys"]
    rung = kernels.load("v27")
    tile = numpy_inputs()
    with pytest.raises(ValueError, match=r"v27_fp8_row_sums needs V with one scale per head .*v_per_head=True"):
        runtime.check_fp8_inputs(tile, rung, True, None)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 100, 64)).astype(np.float32) for _ in range(3))
    head = kernels.quantize_for("v27", q, k, v)
    assert head.v_per_head and (head.block_q, head.block_k) == (192, 128)
    runtime.check_fp8_inputs(head, rung, True, None)
    runtime.check_fp8_inputs(kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, per_tensor=True), rung, True, None)
    assert runtime.fp8_rung(tile) == "v26_fp8_persistent" and runtime.fp8_rung(head) == "v29_fp8_wide_keys"
    assert not kernels.quantize_for("v26", q, k, v).v_per_head
    with pytest.raises(ValueError, match="v24_persistent does not compute in FP8"):
        kernels.quantize_for("v24", q, k, v)


def test_the_fp8_default_passes_over_a_rung_not_yet_run_on_a_gpu(unverified_rung):
    """An FP8 rung declaring lab.unverified (as v33 did until its run) runs when named and is never the
    default, given inputs or not: here a copy of v29 that declares it, newer and taking the same inputs."""
    name = unverified_rung("v29", "v99_unverified_fp8")
    rung = kernels.load(name)
    assert rung.fp8 and rung.fp8_qk == "e4m3" and rung.fp8_v == "head" and rung.unverified == "not yet run on a GPU"
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 100, 64)).astype(np.float32) for _ in range(3))
    head = kernels.quantize_for(name, q, k, v)
    assert head.v_per_head and (head.block_q, head.block_k) == (192, 128)
    runtime.check_fp8_inputs(head, rung, True, None)
    assert runtime.fp8_rung() == runtime.fp8_rung(head) == "v29_fp8_wide_keys"


def test_row_sums_of_the_rounded_probabilities_change_the_error_little():
    """v27 sums the e4m3 codes of P on the tensor cores where v25 and v26 sum the unrounded p: on the
    outlier inputs, with V per head, the two emulations' RMSE against float64 within 2% of each other."""
    q, k, v = fp8.outlier_inputs(np, (1, 2, 512, 64), seed=1)
    ref = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)))
    inputs = kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, v_per_head=True)
    exact, rounded = (rmse(fp8.emulated_attention(inputs, rounded_row_sums=r), ref) for r in (False, True))
    assert exact != rounded and abs(rounded - exact) <= 0.02 * exact, (exact, rounded)


# -- Q and K in bfloat16 (lab.fp8_qk bf16: v28) ------------------------------------------------------


def test_q_and_k_in_bfloat16_keep_their_values_and_scales_of_one():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 300, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 300, 64)).astype(np.float32) for _ in range(2))
    both = kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, v_per_head=True, hadamard=False, qk="bf16")
    assert both.qk == "bf16" and both.q.dtype == ml_dtypes.bfloat16 and both.k.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(both.q, q.astype(ml_dtypes.bfloat16))
    assert (both.q_scale == 1).all() and (both.k_scale == 1).all() and both.q_scale.shape == (1, 4, 2)
    e4m3 = kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, v_per_head=True, hadamard=False)
    np.testing.assert_array_equal(both.v_t, e4m3.v_t)  # V as before
    got_q, got_k, got_v = both.dequantized()
    np.testing.assert_array_equal(got_q, q.astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_array_equal(got_v, e4m3.dequantized()[2])
    assert "Q and K in bfloat16" in both.describe()
    with pytest.raises(ValueError, match="qk 'fp16'"):
        kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, qk="fp16")


@pytest.mark.parametrize("causal", [True, False])
def test_scores_in_bfloat16_meet_the_rmse_target_at_d64_where_e4m3_misses(causal):
    """The emulation on FlashAttention-3's outlier inputs at d = 64 (as bench.py fp8's accuracy table):
    e4m3 Q and K miss 1.0e-2, bfloat16 Q and K meet it with room, and at under half the e4m3 error."""
    q, k, v = fp8.outlier_inputs(np, (1, 2, 1024, 64), seed=0)
    ref = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    err = {qk: rmse(fp8.emulated_attention(kernels.quantize_fp8(q, k, v, block_q=192, block_k=128, v_per_head=True,
                                                               qk=qk), causal=causal, rounded_row_sums=True), ref)
           for qk in ("e4m3", "bf16")}
    assert err["e4m3"] > 1.0e-2 and err["bf16"] < 0.8e-2 and err["bf16"] < 0.5 * err["e4m3"], err


def test_a_rung_with_bfloat16_scores_takes_only_inputs_quantized_so():
    rung = kernels.load("v28")
    assert rung.fp8 and rung.fp8_qk == "bf16" and rung.fp8_v == "head" and rung.head_sizes() == [64]
    assert rung.tma_boxes((64, 192, 128)) == {"Q": (192, 64), "K": (128, 64), "V": (64, 128)}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 100, 64)).astype(np.float32) for _ in range(3))
    inputs = kernels.quantize_for("v28", q, k, v)
    assert inputs.qk == "bf16" and inputs.v_per_head and (inputs.block_q, inputs.block_k) == (192, 128)
    runtime.check_fp8_inputs(inputs, rung, True, None)
    assert runtime.fp8_rung(inputs) == "v28_fp8_bf16_scores" and runtime.fp8_rung() != "v28_fp8_bf16_scores"
    with pytest.raises(ValueError, match=r"v28_fp8_bf16_scores takes Q and K as bf16 .*quantize_for\('v28_fp8_bf16_scores'"):
        runtime.check_fp8_inputs(kernels.quantize_for("v27", q, k, v), rung, True, None)
    with pytest.raises(ValueError, match=r"v27_fp8_row_sums takes Q and K as e4m3"):
        runtime.check_fp8_inputs(inputs, kernels.load("v27"), True, None)
    with pytest.raises(TypeError, match=r"inputs.q must be a 4-d bfloat16 array, got uint8"):
        runtime.check_fp8_inputs(dataclasses.replace(inputs, q=np.zeros(inputs.q.shape, np.uint8)), rung, True, None)
    with pytest.raises(ValueError, match="head sizes 64; got d=128"):
        kernels.quantize_for("v28", *(np.zeros((1, 1, 8, 128), np.float32) for _ in range(3)))


def test_bfloat16_q_and_k_take_the_128_byte_swizzle_in_two_byte_elements():
    """v28's Q and K rows are 64 bfloat16, 128 bytes: the 128-byte swizzle, element type bfloat16 (CU_TENSOR_MAP_DATA
    _TYPE_BFLOAT16 = 9); V^T stays uint8 with its 128-key rows."""
    from tests.test_tensor_map import OnDevice

    rung = kernels.load("v28")
    B, NH, T = 2, 4, 300
    tensors = {"Q": OnDevice(np.empty((B, NH, T, 64), ml_dtypes.bfloat16)),
               "K": OnDevice(np.empty((B, 2, T, 64), ml_dtypes.bfloat16)),
               "V": OnDevice(np.empty((B, 2, 64, 304), np.uint8))}
    maps = runtime.tensor_map_arguments(rung, (64, 192, 128), tensors)
    assert [m.swizzle for m in maps] == [3, 3, 3] and [m.dtype for m in maps] == [9, 9, 0]
    assert maps[0].box == (64, 192, 1, 1) and maps[1].box == (64, 128, 1, 1)



def test_key_tiles_of_224_read_v_t_as_two_boxes_of_128_keys():
    """v29 at d = 128: K_j is one box of 224 rows, V^T_j two boxes of 128 keys (a row of 224 bytes is wider than
    the 128-byte swizzle), the second reaching 32 keys past the tile, past the padded array at the last tile
    (the copy engine writes zeros there). Key step kk reads box kk / 4 at 32 (kk % 4) bytes: column 32 kk of
    the tile, the column the packing test above pairs with P's key step kk."""
    from tests.test_tensor_map import OnDevice

    rung = kernels.load("v29")
    assert rung.configs_for(128)[0] == (128, 128, 224) and rung.configs_for(64)[0] == (64, 192, 128)
    source = kernels.resolve("v29").read_text()
    assert "descriptor<128>(V_j + kk / 4 * V_BOX_BYTES + 32 * (kk % 4))" in source
    for kk in range(224 // 32):
        assert 128 * (kk // 4) + 32 * (kk % 4) == 32 * kk
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 300, 128)).astype(np.float32) for _ in range(3))
    inputs = kernels.quantize_for("v29", q, k, v)
    assert (inputs.block_q, inputs.block_k) == (128, 224) and inputs.v_per_head
    T_pad = inputs.v_t.shape[-1]
    assert T_pad == 448 and (T_pad - 224) + 2 * 128 - T_pad == 32
    assert runtime.fp8_config(rung, inputs) == (128, 128, 224)
    assert runtime.fp8_config(rung, kernels.quantize_for("v27", q, k, v)) == (128, 128, 128)
    tensors = {"Q": OnDevice(np.empty((1, 2, 300, 128), np.uint8)), "K": OnDevice(np.empty((1, 2, 300, 128), np.uint8)),
               "V": OnDevice(np.empty((1, 2, 128, T_pad), np.uint8))}
    maps = runtime.tensor_map_arguments(rung, (128, 128, 224), tensors)
    assert [m.box for m in maps] == [(128, 128, 1, 1), (128, 224, 1, 1), (128, 128, 1, 1)]
    assert [m.swizzle for m in maps] == [3, 3, 3]
    assert rung.shared_bytes((128, 128, 224)) == 3 * 128 * 128 + 2 * (224 + 256) * 128 + 2048 <= 227 * 1024
