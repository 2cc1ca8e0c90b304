"""exp2_fma, 2^x from a polynomial on the FMA pipe (v32: a cubic, bfloat16; v33: a quadratic, FP8),
emulated step for step in float32 with the coefficients read from each rung's source: its relative error,
the masked scores, and which tiles take it."""

import re

import numpy as np
import pytest

import kernels

# rung, the polynomial's degree, its relative error bound, and the rounding of P it must stay far inside
RUNGS = [("v32", 3, 7.6e-5, 2.0**-11), ("v33", 2, 1.8e-3, 2.0**-4)]


def coefficients(rung):
    """The hex-float literals of the rung's exp2_fma, highest power first (Horner's order in the source)."""
    source = kernels.resolve(rung).read_text()
    body = source[source.index("float exp2_fma(float x)"):]
    return [float.fromhex(c.rstrip("f")) for c in re.findall(r"0x1\.[0-9a-f]+p[-+]?\d+f", body[:body.index("return")])]


def f32(x):
    return np.asarray(x, dtype=np.float32)


def fma(a, b, c):
    """fmaf: the float64 product of two float32 values is exact; one rounding to float32 after the sum."""
    return f32(f32(a).astype(np.float64) * f32(b).astype(np.float64) + f32(c).astype(np.float64))


def exp2_fma(x, coeffs):
    """The device function's arithmetic, one float32 operation at a time."""
    x = np.maximum(f32(x), f32(-126.0))
    t = f32(x + f32(12582912.0))
    f = f32(x - f32(t - f32(12582912.0)))
    p = f32(coeffs[0])
    for c in coeffs[1:]:
        p = fma(p, f, c)
    bits = p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23)  # 32-bit wrap-around
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("rung,degree,bound,rounding", RUNGS)
def test_relative_error_far_inside_the_rounding_of_p(rung, degree, bound, rounding):
    coeffs = coefficients(rung)
    assert len(coeffs) == degree + 1 and abs(coeffs[-1] - 1) < 1e-3  # Horner form, 2^0 near 1
    x = np.concatenate([np.linspace(-125.0, 9.0, 2_000_001, dtype=np.float32),  # FP8's P reaches 2^8
                        np.float32(-1) * np.random.default_rng(0).exponential(4.0, 200_000).astype(np.float32)])
    x = x[x > -125.0]
    rel = np.abs(exp2_fma(x, coeffs).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < bound < rounding / 4  # P's rounding: up to 2^-8 in bfloat16, 2^-11 in float16, 2^-4 in e4m3


@pytest.mark.parametrize("rung", [r for r, *_ in RUNGS])
def test_a_masked_score_gives_at_most_two_to_the_minus_126_and_never_a_wrapped_exponent(rung):
    coeffs = coefficients(rung)
    for x in (-np.inf, -1e30, -126.6, -126.0, -125.7):
        y = float(exp2_fma(np.float32(x), coeffs))
        assert 0.0 <= y <= 2.0**-125 and np.isfinite(y), (x, y)
    assert float(exp2_fma(np.float32(0.0), coeffs)) == np.float32(coeffs[-1])  # 2^0: the constant term


def test_which_scores_take_it():
    v32, v33 = (kernels.resolve(r).read_text() for r in ("v32", "v33"))
    # v32: one n8 tile of sixteen, at d = 64 only (at d = 128 the products, not the MUFU, bound the step)
    assert "constexpr int EMULATE_EVERY = 16;" in v32
    assert "d_head == 64 && n % EMULATE_EVERY == EMULATE_EVERY - 1 ? exp2_fma(x) : exp2_approx(x)" in v32
    # a row with no key at all: zero by its running maximum, not its tiny sums over themselves
    assert "l > 0.0f && m_i[h] != -INFINITY ? 1.0f / l : 0.0f" in v32
    # v33: every 8th tile at d = 64, every 7th at d = 128; a masked score's 2^-126 rounds to an e4m3 zero
    assert "return d_head == 64 ? 8 : 7;" in v33 and "n % every == every - 1 ? exp2_fma(x) : exp2_approx(x)" in v33
