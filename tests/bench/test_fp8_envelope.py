"""bench.py fp8 --envelope without a GPU: the inputs hit the scores' standard deviation they are drawn for,
the table's rows, and the FP8 score-scale estimate and its warning."""

import math
import warnings

import numpy as np
import pytest

from benchmarks import fp8_envelope as envelope
from kernels import fp8


@pytest.mark.parametrize("family", envelope.FAMILIES)
@pytest.mark.parametrize("std", [1.0, 4.0, 50.0])
def test_the_inputs_hit_the_score_std_they_are_drawn_for(family, std):
    q, k, v = envelope.envelope_inputs(np, family, std, shape=(1, 2, 256, 128), seed=1)
    got = envelope.score_std(q, k)
    assert abs(got - std) < 0.1 * std, (family, std, got)
    assert abs(float(v.std()) - 1.0) < 0.05


def test_magnitudes_refuse_what_they_cannot_draw():
    assert envelope.magnitudes("scaled", 1.0) == (1.0, 0.0) and envelope.magnitudes("offset", 1.0) == (1.0, 0.0)
    with pytest.raises(ValueError, match="at least 1"):
        envelope.magnitudes("scaled", 0.5)
    with pytest.raises(ValueError, match="family"):
        envelope.magnitudes("shifted", 2.0)


def row(std, kernel, emulated):
    r = {"family": "scaled", "score_std": std, "measured_std": std * 1.01, "estimate": 20 * std, "bfloat16": 2e-3}
    for name in envelope.VARIANTS:
        r[name], r[name + " emulated"] = kernel, emulated
    return r


def test_the_table_shows_each_variant_and_its_ratio_to_the_emulation():
    lines = envelope.render_envelope([row(1.0, 4e-2, 4e-2), row(32.0, 0.3, 0.1)])
    assert len(lines) == 4 and "per tensor (/ emulated)" in lines[0] and "v24 bfloat16" in lines[0]
    assert lines[2].count("(x1.00)") == len(envelope.VARIANTS)
    assert lines[3].count("(x3.00)") == len(envelope.VARIANTS)  # a kernel above its emulation shows
    assert envelope.ratio({"block": 1.0, "block emulated": 0.0}, "block") == math.inf


def test_the_relative_error_is_frobenius():
    ref = np.ones((2, 3))
    assert envelope.relative_error(ref * 1.1, ref) == pytest.approx(0.1)


def test_the_score_scale_estimate_comes_from_the_block_maxima():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 256, 64)).astype(np.float32) for _ in range(3))
    inputs = fp8.quantize_fp8(q * 3, k * 2, v, block_q=128, block_k=128, hadamard=False)
    want = (1 / 8) * 8 * float(np.abs(q * 3).max()) * float(np.abs(k * 2).max())
    assert fp8.score_scale_estimate(inputs) == pytest.approx(want, rel=1e-6)
    assert fp8.score_scale_estimate(inputs, scale=0.25) == pytest.approx(2 * want, rel=1e-6)
    assert fp8.score_scale_estimate(inputs) > envelope.score_std(q * 3, k * 2)  # Gaussian rows: above the std


def test_the_warning_fires_past_the_threshold_and_can_be_silenced(monkeypatch):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 128, 64)).astype(np.float32) for _ in range(3))
    inputs = fp8.quantize_fp8(q, k, v, block_q=128, block_k=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.warn_if_peaked(inputs)  # N(0, 1) inputs: under the threshold, silent
        monkeypatch.setattr(fp8, "PEAKED_SCORE_ESTIMATE", fp8.score_scale_estimate(inputs) / 2)
        with pytest.raises(UserWarning, match="FP8 attention"):
            fp8.warn_if_peaked(inputs)
        warnings.filterwarnings("ignore", message="FP8 attention")
        fp8.warn_if_peaked(inputs)
