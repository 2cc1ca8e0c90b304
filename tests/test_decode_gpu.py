"""The decode rung against the float64 reference, the general features (lab.supports) on every rung
that declares them, and GPT-2 decoding through the decode rung, on the GPU.

Tolerance as in test_kernels_gpu.py: a rung's largest error against float64 may be at most its
declared factor (lab.tolerance, default 8) times the largest error of the plain implementation in
the same dtype (kernels.reference_attention), floored at the dtype's epsilon times the output's
largest magnitude. Here for any query length T_q, key length T_k, K/V head count and mask.
Outputs are poisoned with NaN first, so that an element no block writes fails.
"""

import importlib
import json
import math

import numpy as np
import pytest

import gpt2
import kernels
import lab
from tests.tiers import first_of_each_rung, spread, tiered

pytestmark = pytest.mark.gpu

DECODE_RUNGS = [name for name in kernels.names() if kernels.load(name).split_kv]  # v16, v17, ...
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def rung_cases(name):
    rung = kernels.load(name)
    return [(name, d, dtype) for d in rung.head_sizes() for dtype in rung.dtypes]


def decode_cases():
    return [case for name in DECODE_RUNGS for case in rung_cases(name)]


def supporting(feature):
    """(rung, head size, dtype) for every rung that declares `feature` in lab.supports, held to the bound
    against float64 below (FP8 rungs, held to their emulation, take the features in tests/test_fp8_gpu.py)."""
    return [case for name in kernels.names() if feature in kernels.load(name).supports and not kernels.load(name).fp8
            for case in rung_cases(name)]


def random_qkv(cp, B, NH, NH_kv, T_q, T_k, d, *, dtype="float32", magnitude=1.0, seed=0):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, and so with CuPy)

    rng = cp.random.default_rng(seed)

    def draw(*shape):
        return (rng.standard_normal(shape, dtype=cp.float32) * magnitude).astype(dtype)

    return draw(B, NH, T_q, d), draw(B, NH_kv, T_k, d), draw(B, NH_kv, T_k, d)


def check_general(q, k, v, name, *, causal=True, scale=None, config=None):
    """The rung against float64 for q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d)."""
    import cupy as cp

    B, NH, T_q, d = q.shape
    out = cp.full((B, NH, T_q, d), cp.nan, dtype=q.dtype)  # poison: unwritten elements fail
    run = kernels.prepare(q, k, v, kernel=name, causal=causal, scale=scale, out=out, config=config)
    got, inst = run(), run.instance
    assert got is out
    ref64 = kernels.reference_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal, scale=scale)
    plain_same_dtype = kernels.reference_attention(q, k, v, causal=causal, scale=scale)
    got64 = got.astype(cp.float64)
    diff = cp.abs(got64 - ref64)
    err = float(diff.max())
    plain = float(cp.abs(plain_same_dtype.astype(cp.float64) - ref64).max())
    floor = EPS[q.dtype.name] * float(cp.abs(ref64).max())
    bound = inst.rung.tolerance_factor(inst.config) * max(plain, floor)
    what = f"{name} {q.dtype.name} q {q.shape} k {k.shape} causal={causal}"
    assert not math.isnan(err), f"{what}: NaN in output ({int(cp.isnan(got64).sum())} elements unwritten or NaN)"
    assert err <= bound, f"{what}: max error {err:.3e} (mean {float(diff.mean()):.3e}) > {bound:.3e} (plain {plain:.3e})"


# -- the decode rung ------------------------------------------------------------------------------


# quick: every case, grouped heads, causal, one awkward cache length each (T_k = 1, 257 or 4096) at T_q = 1 and 7
@pytest.mark.parametrize("T_k,NH,NH_kv,name,d,dtype", spread([(T_k, NH, NH_kv) for T_k in [1, 17, 257, 1000, 1024, 4096]
                                                               for NH, NH_kv in [(12, 12), (32, 8), (8, 1)]],
                                                              decode_cases(), quick=[(1, 32, 8), (257, 32, 8), (4096, 32, 8)]))
@pytest.mark.parametrize("T_q", tiered([1, 2, 7, 16], quick=[1, 7]))
@pytest.mark.parametrize("causal", tiered([True, False], quick=[True]), ids=["causal", "noncausal"])
def test_decode_matches_reference(name, d, dtype, NH, NH_kv, T_k, T_q, causal):
    import cupy as cp

    q, k, v = random_qkv(cp, 2, NH, NH_kv, T_q, T_k, d, dtype=dtype, seed=T_q * 10007 + T_k)
    check_general(q, k, v, name, causal=causal)


@pytest.mark.parametrize("name,d,dtype", tiered(decode_cases(), quick=first_of_each_rung(decode_cases())))
@pytest.mark.parametrize("T_q", [1, 2])
@pytest.mark.parametrize("T_k", [17, 300])
def test_decode_query_heads_sharing_kv_heads_in_one_block(name, d, dtype, T_q, T_k):
    """Enough blocks that one block serves a whole group of query heads (the other blocks of the
    group exit): 1024 query tiles in groups of 4, and (at T_k = 300) 128 in groups of 2 with the
    keys split in 3."""
    import cupy as cp

    check_general(*random_qkv(cp, 16, 64, 16, T_q, T_k, d, dtype=dtype), name)
    check_general(*random_qkv(cp, 1, 128, 64, T_q, T_k, d, dtype=dtype), name, causal=False)


@pytest.mark.parametrize("name,d,dtype", tiered(decode_cases(), quick=first_of_each_rung(decode_cases())))
@pytest.mark.parametrize("T_k", [1, 300, 1024])
def test_decode_over_kv_cache_views(name, d, dtype, T_k):
    """As the model calls it: q a view of the packed projection, k and v views of a preallocated
    (layer, batch, head, max_len, d) cache, read through their strides."""
    import cupy as cp
    import ml_dtypes  # noqa: F401

    B, NH, max_len = 2, 12, 1100
    rng = cp.random.default_rng(T_k)
    qkv = rng.standard_normal((B, 1, 3, NH, d), dtype=cp.float32).astype(dtype)
    q = qkv[:, :, 0].transpose(0, 2, 1, 3)  # (B, NH, 1, d)
    cache = rng.standard_normal((2, 3, B, NH, max_len, d), dtype=cp.float32).astype(dtype)  # (k/v, layer, ...)
    k, v = cache[0, 1, :, :, :T_k], cache[1, 1, :, :, :T_k]
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    check_general(q, k, v, name)


@pytest.mark.parametrize("wait", [False, True], ids=["synchronized", "waits_by_event"])  # runtime.WAIT_BY_EVENT
@pytest.mark.parametrize("name,dtype", [(n, t) for n in DECODE_RUNGS for t in kernels.load(n).dtypes])
def test_decode_workspace_reused_across_launches(name, dtype, wait, monkeypatch):
    """prepare() allocates the counters once: each launch must leave them at zero for the next, and
    give the same bits (the combine runs in split order whichever block finishes last); with the zeros
    waited for by the host at every prepare, or (WAIT_BY_EVENT) once, where they are made."""
    import cupy as cp

    from kernels import runtime

    monkeypatch.setattr(runtime, "WAIT_BY_EVENT", wait)

    for B, NH, NH_kv, T_q, T_k in [(1, 12, 12, 1, 1024), (1, 32, 8, 7, 4096), (3, 8, 1, 16, 1000)]:
        q, k, v = random_qkv(cp, B, NH, NH_kv, T_q, T_k, 64, dtype=dtype)
        out = cp.full(q.shape, cp.nan, dtype=q.dtype)
        run = kernels.prepare(q, k, v, kernel=name, out=out)
        assert run.instance.splits(B, NH, T_q, T_k) > 1
        first = run().astype(cp.float64)
        for _ in range(5):
            out.fill(cp.nan)
            again = run().astype(cp.float64)
            assert cp.array_equal(again, first), f"{(B, NH, NH_kv, T_q, T_k)}: a relaunch gave other values"
        check_general(q, k, v, name)


@pytest.mark.parametrize("name,d,dtype", tiered(decode_cases(), quick=first_of_each_rung(decode_cases())))
@pytest.mark.parametrize("magnitude", tiered([8.0, 30.0], quick=[30.0]))
def test_decode_large_scores(name, d, dtype, magnitude):
    """Scores in the hundreds: the splits' maxima differ wildly, and the combine must rescale."""
    import cupy as cp

    check_general(*random_qkv(cp, 1, 4, 4, 1, 3000, d, dtype=dtype, magnitude=magnitude), name)
    check_general(*random_qkv(cp, 1, 4, 2, 5, 700, d, dtype=dtype, magnitude=magnitude), name, causal=False)


@pytest.mark.parametrize("name", DECODE_RUNGS)
def test_decode_custom_scale(name):
    import cupy as cp

    for dtype in kernels.load(name).dtypes:
        check_general(*random_qkv(cp, 1, 6, 2, 3, 999, 64, dtype=dtype), name, scale=0.5)


@pytest.mark.exhaustive  # every configuration: the quick tier runs the ones the launcher picks
@pytest.mark.parametrize("name", DECODE_RUNGS)
def test_decode_every_declared_config(name):
    import cupy as cp

    rung = kernels.load(name)
    for config in rung.configs:
        dtype = rung.dtype_of(config)
        for T_q, T_k in [(1, 1000), (4, 257), (9, 33)]:
            check_general(*random_qkv(cp, 2, 8, 2, T_q, T_k, config[0], dtype=dtype), name, config=config)


# -- the general features, on every rung that declares them ----------------------------------------


@pytest.mark.parametrize("name,d,dtype", tiered(supporting("noncausal"), quick=first_of_each_rung(supporting("noncausal"))))
@pytest.mark.parametrize("T", tiered([1, 97, 1000], quick=[1, 97]))
def test_noncausal(name, d, dtype, T):
    import cupy as cp

    check_general(*random_qkv(cp, 2, 3, 3, T, T, d, dtype=dtype), name, causal=False)


@pytest.mark.parametrize("name,d,dtype", tiered(supporting("cross"), quick=first_of_each_rung(supporting("cross"))))
@pytest.mark.parametrize("T_q,T_k", tiered([(1, 1000), (17, 257), (97, 1024), (300, 97)], quick=[(1, 1000), (300, 97)]))
def test_cross_lengths(name, d, dtype, T_q, T_k):
    """Causal with the mask aligned bottom-right (with T_q > T_k the first rows see nothing: zeros),
    and non-causal where the rung declares it too."""
    import cupy as cp

    q, k, v = random_qkv(cp, 2, 3, 3, T_q, T_k, d, dtype=dtype)
    check_general(q, k, v, name)
    if "noncausal" in kernels.load(name).supports:
        check_general(q, k, v, name, causal=False)


@pytest.mark.parametrize("name,d,dtype", tiered(supporting("gqa"), quick=first_of_each_rung(supporting("gqa"))))
@pytest.mark.parametrize("NH,NH_kv", [(12, 3), (12, 1)])
def test_grouped_query_heads(name, d, dtype, NH, NH_kv):
    import cupy as cp

    check_general(*random_qkv(cp, 2, NH, NH_kv, 257, 257, d, dtype=dtype), name)
    if "cross" in kernels.load(name).supports:
        check_general(*random_qkv(cp, 2, NH, NH_kv, 1, 700, d, dtype=dtype), name)


# -- GPT-2 decoding through the decode rung --------------------------------------------------------


def test_kv_cache_generation_with_the_decode_rung_equals_no_cache():
    """Random GPT-2 small weights, greedy, eager path: prefill and the no-cache run with the
    reference, every decode step through the decode rung; the tokens must be the same."""
    import cupy as cp

    generate_module = importlib.import_module("gpt2.generate")
    ckpt = gpt2.random_weights("gpt2", seed=3, xp=cp)
    config = ckpt.config
    decode = generate_module.decode_rung(config, "float32")
    arch = kernels.device_limits().arch
    newest = [n for n in DECODE_RUNGS if kernels.load(n).runs_on(arch)][-1]
    assert decode == newest and generate_module.decode_attention_name(cp, config, "float32") == decode
    assert generate_module.decode_attention_name(np, config, "float32") == "reference"
    calls = []

    def spy(q, k, v):  # the default decode attention, counted
        calls.append((q.shape, k.shape))
        return kernels.attention(q, k, v, kernel=decode, causal=True)

    prompt, n_new = [464, 3290, 318, 257, 1332, 13], 24
    loop_module = importlib.import_module("lm.generate")  # the eager loop both models share looks it up here
    original = loop_module.decode_rung_attend
    loop_module.decode_rung_attend = lambda name: spy if name == decode else original(name)
    try:
        cached = gpt2.generate(ckpt.params, config, prompt, n_new, attend=gpt2.reference_attend, kv_cache=True,
                               fast=False)
    finally:
        loop_module.decode_rung_attend = original
    full = gpt2.generate(ckpt.params, config, prompt, n_new, attend=gpt2.reference_attend, kv_cache=False, fast=False)
    assert len(calls) == (n_new - 1) * config.n_layer
    assert all(qs[2] == 1 and ks[2] >= len(prompt) + 1 for qs, ks in calls)
    assert cached.tokens == full.tokens


def test_lab_kv_cache_no_graph_decodes_with_the_decode_rung(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = lab.main(["--random-weights", "--kernel", "v13", "--kv-cache", "--no-graph", "--tokens", "16", "--check",
                   "--json", str(out)])
    printed = capsys.readouterr().out
    s = json.loads(out.read_text())
    assert rc == 0, printed
    decode = importlib.import_module("gpt2.generate").decode_rung(gpt2.SIZES["gpt2"], "float32")
    assert s["engine"] == "eager" and s["decode_attention"] == decode
    assert f"decode attention: {decode}" in printed
    assert s["check"]["identical"], s["check"]


# -- timing of the two targets: python3 -m tests.test_decode_gpu ----------------------------------
#
# The timing helpers live in benchmarks/timing.py (graph_us, kernel_us, measure_copy); bench.py also measures
# these targets beside torch SDPA and writes them to docs/results.md: python3 bench.py features --parts decode,long


def main():
    import cupy as cp
    import ml_dtypes  # noqa: F401

    from benchmarks import timing

    limits = kernels.device_limits()
    print(f"{limits.name}, {limits.sm_count} SMs, CuPy {cp.__version__}, driver {cp.cuda.runtime.driverGetVersion()}")
    ceiling = 1e12 * timing.measure_copy(timing.Method())["copy_tbps"]
    print(f"copy ceiling: {ceiling / 1e12:.2f} TB/s")
    for name in [n for n in DECODE_RUNGS if kernels.load(n).runs_on(limits.arch)]:
        # GPT-2 decode: B=1, NH=12, d=64, one query, float32. 24 caches in turn (151 MB at T_k = 1024), so
        # that L2 does not hold the keys, as in a decode step where 11 other layers ran since.
        for T_k in (1, 128, 512, 1024):
            runs = []
            for _ in range(24):
                q, k, v = random_qkv(cp, 1, 12, 12, 1, T_k, 64, seed=None)
                runs.append(kernels.prepare(q, k, v, kernel=name))
            splits = runs[0].instance.splits(1, 12, 1, T_k)
            device = timing.kernel_us(runs, name="attention_forward")
            print(f"{name} GPT-2 decode, T_k {T_k:4d}, {splits:2d} splits: {timing.graph_us(runs):6.2f} us per call "
                  "in a graph, kernel " + (f"{device:6.2f} us (CUPTI)" if device else "n/a") + "; target <= 5 us")
        # Long context: B=16, NH=32, d=128, one query over 4096 keys; bandwidth = bytes of K and V / time,
        # against the device-to-device copy measured above (bytes read + written).
        for dtype in kernels.load(name).dtypes:
            q, k, v = random_qkv(cp, 16, 32, 32, 1, 4096, 128, dtype=dtype)
            run = kernels.prepare(q, k, v, kernel=name)
            seconds = 1e-6 * timing.graph_us([run])
            rate = (k.nbytes + v.nbytes) / seconds
            print(f"{name} long context, {dtype:8s}: {1e6 * seconds:7.1f} us, K+V {rate / 1e12:.2f} TB/s = "
                  f"{100 * rate / ceiling:.0f}% of the copy ceiling; target >= 75%")
            del q, k, v, run

if __name__ == "__main__":
    main()
