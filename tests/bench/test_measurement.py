"""What the benchmarks measure and against what: the FLOP conventions, the speed-ups, the feature cases and
their plan, the SDPA peers' masks and grouped heads, CUPTI's per-call time."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
from benchmarks import cases, device, features, peers, timing
from tests.bench.helpers import e2e_result, shape_rows


def test_attention_flops_causal_convention():
    # 4 * B * NH * T^2 * d / 2: two T x T x d products (2 T^2 d FLOPs each), half of them masked
    assert cases.attention_flops(1, 12, 512, 64) == 4 * 12 * 512**2 * 64 // 2 == 402_653_184
    assert cases.attention_flops(1, 12, 512, 64, causal=False) == 805_306_368
    base = cases.attention_flops(2, 3, 100, 16)
    assert cases.attention_flops(4, 3, 100, 16) == 2 * base  # linear in B
    assert cases.attention_flops(2, 3, 200, 16) == 4 * base  # quadratic in T
    assert cases.attention_flops(2, 3, 100, 32) == 2 * base  # linear in d
    assert "4 * B * NH * T^2 * d / 2" in cases.FLOP_CONVENTION


@pytest.mark.parametrize("B,T,ms,tflops", [(16, 2048, 3.16, 32.6), (6, 4096, 4.67, 33.1), (1, 8192, 0.27, 383)])
def test_flops_reproduce_the_published_peer_table(B, T, ms, tflops):
    """shared/DEVICE.md's peer table uses the same convention: its ms and TFLOP/s agree through it."""
    assert cases.attention_flops(B, 12, T, 64) / (ms * 1e-3) / 1e12 == pytest.approx(tflops, rel=0.01)


def test_speedups_against_previous_rung_and_peers():
    rows = shape_rows(cases.Shape(1, 512))
    by = {r["name"]: r for r in rows}
    assert "previous" not in by["v01_naive"]["speedup"]
    assert by["v02_broken"]["speedup"] == {}  # wrong: not timed, no ratios
    assert by["v03_fast"]["speedup"]["previous"] == pytest.approx(4.0)  # against v01: the wrong v02 is skipped
    assert by["v03_fast"]["speedup"]["reference"] == pytest.approx(2.0)
    assert by["v03_fast"]["speedup"]["sdpa_efficient"] == pytest.approx(0.5)
    assert by["v01_naive"]["speedup"]["sdpa_efficient"] == pytest.approx(0.125)
    assert "reference" not in by["reference"]["speedup"]


def test_generation_comparisons():
    rows = e2e_result()["rows"]
    fast = next(r for r in rows if r["name"] == "v03_fast" and r["mode"] == "kv-cache")
    hf = next(r for r in rows if r["name"] == "hf" and r["mode"] == "no-cache")
    assert fast["speedup_vs_reference"] == pytest.approx(2.0)
    assert fast["tokens_per_s"] == pytest.approx(1.0) and fast["ms_per_token"] == pytest.approx(1000.0)
    assert fast["same_tokens_as_reference"] == 2  # diverges at the third token
    assert hf["same_tokens_as_reference"] == 4


def brute_force_pairs(T_q, T_k, causal):
    """(query, key) pairs counted one by one, with the reference's own mask (bottom-right)."""
    from kernels.reference import causal_mask

    if not causal:
        return sum(1 for _ in range(T_q) for _ in range(T_k))
    mask = causal_mask(np, T_q, T_k)
    return sum(1 for i in range(T_q) for j in range(T_k) if mask[i, j])


@pytest.mark.parametrize("T_q,T_k", [(1, 1), (1, 7), (3, 3), (5, 17), (16, 16), (7, 2), (17, 5), (256, 300), (9, 1)])
def test_visible_pairs_by_brute_force(T_q, T_k):
    assert cases.visible_pairs(T_q, T_k, causal=False) == brute_force_pairs(T_q, T_k, False) == T_q * T_k
    assert cases.visible_pairs(T_q, T_k, causal=True) == brute_force_pairs(T_q, T_k, True)


def test_feature_flops_conventions():
    B, NH, d = 2, 3, 16
    # non-causal: every T_q x T_k pair, 4 * d FLOPs each (two products of 2 * d)
    assert cases.attention_flops_qk(B, NH, 5, 17, d, causal=False) == 4 * B * NH * 5 * 17 * d
    assert cases.attention_flops_qk(B, NH, 64, 64, d, causal=False) == cases.attention_flops(B, NH, 64, d, causal=False)
    # causal with T_q != T_k: the pairs the bottom-right mask lets through, exactly
    for T_q, T_k in [(5, 17), (17, 5), (1, 9), (256, 4096)]:
        assert cases.attention_flops_qk(B, NH, T_q, T_k, d) == 4 * B * NH * brute_force_pairs(T_q, T_k, True) * d
    assert cases.visible_pairs(256, 4096) == 256 * 4096 - 256 * 255 // 2 == 1_015_936
    # causal self-attention keeps the kernels table's T^2 / 2, not the exact T (T + 1) / 2
    assert cases.attention_flops_qk(B, NH, 64, 64, d) == cases.attention_flops(B, NH, 64, d) == 4 * B * NH * 64**2 * d // 2
    # grouped-query heads: every query head does the arithmetic, whatever NH_kv is
    gqa = cases.Case("gqa", 4, 32, 8, 2048, 2048, 128)
    assert cases.shape_flops(gqa) == cases.attention_flops(4, 32, 2048, 128)
    assert cases.shape_flops(cases.Shape(8, 1024)) == cases.attention_flops(8, 12, 1024, 64)
    for words in ("T_q * T_k", "T^2 / 2", "bottom-right", "4 * d"):
        assert words in cases.FEATURE_FLOP_CONVENTION


def test_cases_name_the_features_they_need():
    cases = {c.part: c for part in features.FEATURE_CASES.values() for c in part}
    assert cases["noncausal"].needs() == {"noncausal"}
    assert cases["cross"].needs() == {"cross"} and (cases["cross"].T_q, cases["cross"].T_k) == (256, 4096)
    assert cases["gqa"].needs() == {"gqa"} and (cases["gqa"].NH, cases["gqa"].NH_kv) == (32, 8)
    assert cases["long"].needs() == {"cross"}
    assert [c.T_k for c in features.FEATURE_CASES["decode"]] == [1, 128, 512, 1024]
    assert features.FEATURE_CASES["decode"][0].needs() == set()  # T_q = T_k = 1
    assert [c.d for c in features.FEATURE_CASES["heads"]] == [32, 64, 96, 128]
    assert cases["cross"].describe() == "B=4, NH=12, T_q=256, T_k=4096, d=64, causal, bottom-right"
    assert cases["gqa"].describe() == "B=4, NH=32, NH_kv=8, T=2048, d=128, causal"


def test_sdpa_mask_matches_the_rungs_mask():
    case = features.FEATURE_CASES
    assert peers.sdpa_mask(case["noncausal"][0]) == "none"
    assert peers.sdpa_mask(case["gqa"][0]) == "is_causal"  # T_q == T_k: top-left and bottom-right agree
    assert peers.sdpa_mask(case["cross"][0]) == "lower_right"
    assert peers.sdpa_mask(case["decode"][0]) == "is_causal"  # 1 x 1
    assert peers.sdpa_mask(case["decode"][2]) == "none"  # one query row sees every key
    assert peers.sdpa_mask(cases.Shape(2, 64)) == "is_causal"
    assert peers.sdpa_mask(cases.Case("cross", 1, 2, 2, 9, 3, 32)) == "lower_right"


def test_feature_plan_follows_declarations():
    rungs = features.default_feature_rungs()
    assert rungs and all(kernels.load(p).supports or kernels.load(p).split_kv for p in rungs)
    plan = features.feature_plan(list(features.FEATURE_PARTS), ["float32", "bfloat16"], rungs, named=False)
    assert [e["case"].part for e in plan] == sorted((e["case"].part for e in plan), key=features.FEATURE_PARTS.index)
    assert len({e["id"] for e in plan}) == len(plan)
    for e in plan:
        case, dtype = e["case"], e["dtype"]
        assert e["peer"] == ("sdpa_efficient" if dtype == "float32" else "sdpa_flash")
        loaded = {p.stem: kernels.load(p) for p in e["rungs"]}
        assert all(features.declares(r, case, dtype) for r in loaded.values())
        taking = [p.stem for p in rungs if features.declares(kernels.load(p), case, dtype)]
        if case.part == "decode":  # every split-KV rung, and the newest other rung as context
            others = [n for n in taking if not kernels.load(n).split_kv]
            assert list(loaded) == [n for n in taking if kernels.load(n).split_kv or n == others[-1]]
            assert sum(not r.split_kv for r in loaded.values()) == 1
        elif case.part == "long":
            assert list(loaded) == [n for n in taking if kernels.load(n).split_kv]
        else:
            assert list(loaded) == taking
    long_dtypes = [e["dtype"] for e in plan if e["case"].part == "long"]
    assert long_dtypes[0] == "bfloat16" and set(long_dtypes) <= set(features.LONG_DTYPES)
    declared = {t for p in rungs if kernels.load(p).split_kv for t in kernels.load(p).dtypes}
    assert set(long_dtypes) == {"bfloat16"} | (declared & set(features.LONG_DTYPES))
    # named rungs run in every case, declared or not: those that do not take it are reported unsupported
    named = [kernels.resolve("v12"), kernels.resolve("v13")]
    plan = features.feature_plan(["noncausal", "long"], ["float32"], named, named=True)
    assert all([p.stem for p in e["rungs"]] == [p.stem for p in named] for e in plan)
    assert {e["dtype"] for e in plan if e["case"].part == "long"} == {"bfloat16", "float32"}


def test_per_call_us_groups_kernels_into_calls():
    one = [(float(i), 2.0 + (i % 3), "attention_forward<64, 8, 64, 0>") for i in range(12)]
    t = timing.per_call_us(one[::-1], calls=12)  # any order: sorted by start
    assert t["kernels_per_call"] == 1 and t["statistic"] == "median" and t["us"] == pytest.approx(3.0)
    assert (t["min_us"], t["max_us"]) == (2.0, 4.0) and t["calls"] == 12
    two = [(10.0 * c + 0, 3.0, "flash_fwd_splitkv_kernel") for c in range(5)] + \
          [(10.0 * c + 5, 1.0, "flash_fwd_splitkv_combine_kernel") for c in range(5)]
    t = timing.per_call_us(two, calls=5)
    assert t["kernels_per_call"] == 2 and t["us"] == pytest.approx(4.0)
    assert t["kernels"] == ["flash_fwd_splitkv_combine_kernel", "flash_fwd_splitkv_kernel"]
    t = timing.per_call_us(two[:7], calls=5)  # uneven: the mean, labelled so
    assert t["us"] == pytest.approx((5 * 3.0 + 2 * 1.0) / 5) and t["statistic"].startswith("mean")
    assert timing.per_call_us([], calls=5) is None


class FakeTorchTensor:
    """The one tensor method sdpa_launch calls, on a NumPy array."""

    def __init__(self, a):
        self.a = a

    def repeat_interleave(self, n, dim):
        return FakeTorchTensor(np.repeat(self.a, n, axis=dim))


def fake_torch(takes_gqa: bool, calls: list):
    def sdpa(q, k, v, is_causal=False, attn_mask=None, **kw):
        if "enable_gqa" in kw and not takes_gqa:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        calls.append({"k_heads": k.a.shape[1], "is_causal": is_causal, "attn_mask": attn_mask, **kw})
        return kernels.reference_attention(q.a, k.a, v.a, causal=is_causal)

    return SimpleNamespace(nn=SimpleNamespace(functional=SimpleNamespace(scaled_dot_product_attention=sdpa)),
                           cuda=SimpleNamespace(synchronize=lambda: None))


@pytest.mark.parametrize("takes_gqa", [True, False])
def test_sdpa_peer_with_grouped_heads_uses_enable_gqa_or_repeats_kv(takes_gqa):
    case = cases.Case("gqa", 1, 4, 2, 7, 7, 8)
    rng = np.random.default_rng(0)
    q, k, v = (FakeTorchTensor(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 7, 8), (1, 2, 7, 8),
                                                                                   (1, 2, 7, 8)))
    calls = []
    launch = peers.sdpa_launch(fake_torch(takes_gqa, calls), peers.PEERS["sdpa_flash"], q, k, v, case)
    out = launch()
    np.testing.assert_allclose(out, kernels.reference_attention(q.a, k.a, v.a), rtol=1e-5, atol=1e-6)
    last = calls[-1]
    assert last["is_causal"] is True
    if takes_gqa:
        assert launch.note == "enable_gqa=True" and last["enable_gqa"] is True and last["k_heads"] == 2
    else:  # the peer alone gets K and V repeated to the query heads; the table note says so
        assert launch.note.startswith("K and V repeated to 4 heads for the peer only (enable_gqa=True: TypeError")
        assert "enable_gqa" not in last and last["k_heads"] == 4


def test_sdpa_peer_cross_lengths_without_a_bottom_right_mask_is_not_comparable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.bias", None)  # a torch without causal_lower_right
    case = cases.Case("cross", 1, 2, 2, 5, 23, 8)
    q, k, v = (FakeTorchTensor(np.zeros(s, dtype=np.float32)) for s in ((1, 2, 5, 8), (1, 2, 23, 8), (1, 2, 23, 8)))
    with pytest.raises(device.NotComparable, match="n/a: this torch has no .*causal_lower_right"):
        peers.sdpa_launch(fake_torch(True, []), peers.PEERS["sdpa_efficient"], q, k, v, case)
    # one query row: the bottom-right mask hides nothing, so plain non-causal SDPA is the same mask
    calls = []
    q1 = FakeTorchTensor(np.ones((1, 2, 1, 8), dtype=np.float32))
    launch = peers.sdpa_launch(fake_torch(True, calls), peers.PEERS["sdpa_efficient"], q1, k, v,
                               cases.Case("decode", 1, 2, 2, 1, 23, 8))
    launch()
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"] is None
    assert "hides no key" in launch.note


def test_cupti_timing_needs_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.profiler", None)
    assert timing.kernel_timing([lambda: None]) is None and timing.kernel_us([lambda: None]) is None


class _Clock:
    """A stand-in device: every launch takes its entry's time on one clock, events read that clock."""

    def __init__(self):
        self.now, self.log, self.waits = 0.0, [], []

    def cupy(self):
        clock = self

        class Event:
            done = True

            def record(self, stream=None):
                self.t = clock.now

            def synchronize(self):
                pass

        return SimpleNamespace(cuda=SimpleNamespace(
            Event=Event, get_elapsed_time=lambda s, e: e.t - s.t,
            Device=lambda: SimpleNamespace(synchronize=lambda: None)))

    def stream(self, name):
        clock = self

        class Stream:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def wait_event(self, event):
                clock.waits.append((name, event.t))

        return Stream()

    def launch(self, name, ms):
        def fn():
            self.log.append(name)
            self.now += ms
        return fn


def test_time_interleaved_runs_every_entry_each_round_in_a_rotated_order(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(device, "get_cupy", clock.cupy)
    a, b = clock.stream("a"), clock.stream("b")
    entries = [(clock.launch("A", 2.0), a), (clock.launch("B", 1.0), a), (clock.launch("C", 0.5), b)]
    method = timing.Method(budget_ms=8.0, min_runs=1, max_runs=100, warmup=1)
    got = timing.time_interleaved(entries, flush=lambda: None, method=method)
    # warm-up and one estimate each, then budget / the slowest entry's estimate = 4 rounds, rotated by one a round
    assert clock.log[:6] == ["A", "A", "B", "B", "C", "C"]
    assert clock.log[6:] == ["A", "B", "C", "B", "C", "A", "C", "A", "B", "A", "B", "C"]
    assert [g["runs"] for g in got] == [4, 4, 4] and [g["median_ms"] for g in got] == [2.0, 1.0, 0.5]
    assert got[1]["round_ms"] == [1.0] * 4 and all(g["interleaved"] == 3 for g in got)
    # C runs on another stream: it waits for the entry before it, and the entry after it waits for C
    assert len(clock.waits) == 7 and {name for name, _ in clock.waits} == {"a", "b"}


def test_time_gpu_and_time_interleaved_summarize_alike(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(device, "get_cupy", clock.cupy)
    s = clock.stream("s")
    method = timing.Method(budget_ms=5.0, min_runs=1, max_runs=100, warmup=0)
    alone = timing.time_gpu(clock.launch("A", 1.0), stream=s, flush=lambda: None, method=method)
    together = timing.time_interleaved([(clock.launch("A", 1.0), s)], flush=lambda: None, method=method)[0]
    assert {k: together[k] for k in alone} == alone and together["round_ms"] == [1.0] * 5
