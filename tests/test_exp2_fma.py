"""v32's exp2_fma, 2^x from a cubic on the FMA pipe, emulated step for step in float32 with the coefficients
read from the rung's source: its relative error, the masked scores, and which tiles take it."""

import re

import numpy as np

import kernels

SOURCE = kernels.resolve("v32").read_text()
BODY = SOURCE[SOURCE.index("float exp2_fma(float x)"):]
COEFFS = [float.fromhex(c.rstrip("f")) for c in re.findall(r"0x1\.[0-9a-f]+p-?\d+f", BODY[:BODY.index("return")])]


def f32(x):
    return np.asarray(x, dtype=np.float32)


def fma(a, b, c):
    """fmaf: the float64 product of two float32 values is exact; one rounding to float32 after the sum."""
    return f32(f32(a).astype(np.float64) * f32(b).astype(np.float64) + f32(c).astype(np.float64))


def exp2_fma(x):
    """The device function's arithmetic, one float32 operation at a time."""
    x = np.maximum(f32(x), f32(-126.0))
    t = f32(x + f32(12582912.0))
    f = f32(x - f32(t - f32(12582912.0)))
    c3, c2, c1, c0 = map(f32, COEFFS)
    p = fma(fma(fma(c3, f, c2), f, c1), f, c0)
    bits = p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23)  # 32-bit wrap-around
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def test_the_source_holds_a_cubic_in_horner_form():
    assert len(COEFFS) == 4 and COEFFS[0] < 0.06 < 0.24 < COEFFS[1] < 0.25 and abs(COEFFS[3] - 1) < 1e-4


def test_relative_error_below_bfloat16_and_float16_rounding_over_the_softmax_range():
    x = np.concatenate([np.linspace(-125.0, 0.0, 2_000_001, dtype=np.float32),
                        np.float32(-1) * np.random.default_rng(0).exponential(4.0, 200_000).astype(np.float32)])
    x = x[x > -125.0]
    got = exp2_fma(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 7.6e-5  # bfloat16 rounds P by up to 2^-9 = 2.0e-3, float16 by 2^-11 = 4.9e-4


def test_a_masked_score_gives_at_most_two_to_the_minus_126_and_never_a_wrapped_exponent():
    for x in (-np.inf, -1e30, -126.6, -126.0, -125.7):
        y = float(exp2_fma(np.float32(x)))
        assert 0.0 <= y <= 2.0**-125 and np.isfinite(y), (x, y)
    assert float(exp2_fma(np.float32(0.0))) == np.float32(COEFFS[3])  # 2^0 = the cubic's constant term


def test_only_a_quarter_of_the_scores_at_d64_take_it_and_none_at_d128():
    assert "constexpr int EMULATE_EVERY = 4;" in SOURCE
    assert "d_head == 64 && n % EMULATE_EVERY == EMULATE_EVERY - 1 ? exp2_fma(x) : exp2_approx(x)" in SOURCE
    # the rows with no key at all: zero by their running maximum, not the tiny sums over themselves
    assert "l > 0.0f && m_i[h] != -INFINITY ? 1.0f / l : 0.0f" in SOURCE
