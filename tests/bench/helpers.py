"""Synthetic results as the subcommands write them, and stand-ins for CuPy, matplotlib and the rungs,
shared by the benchmark tests. Synthetic results are labelled "Fixture GPU": they exercise the code that
renders real ones and are never written under results/."""

import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import bench
import kernels
from benchmarks import device, e2e, features, peers, results, rungs, timing
from benchmarks.cases import FEATURE_FLOP_CONVENTION, FLOP_CONVENTION, Case, Shape, attention_flops, shape_flops
from benchmarks.timing import Method

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RUNGS = kernels.names()


def run(argv, capsys):
    """bench.main(argv): (exit status, stdout, stderr); argparse's SystemExit becomes a status."""
    try:
        code = bench.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def fixture_setup(command="python3 bench.py kernels", date="2026-01-02T03:04:05Z"):
    return {"date": date, "command": command, "git": "0123456789ab", "host": "fixture", "python": "3.12.0",
            "numpy": "2.0", "cupy": "14.2.0", "torch": "2.11.0", "transformers": "5.17.0", "cupy_tf32": "0",
            "device": {"name": "Fixture GPU", "arch": "sm_90", "sm_count": 132, "l2_bytes": 50 * 2**20,
                       "memory_bytes": 80 * 2**30, "driver": "580.1", "driver_cuda": "13.0", "cuda_runtime": "13.0"}}


def timed_row(shape, name, kind, ms, err=1e-7):
    label = peers.PEERS[name].label if kind == "peer" else name
    flops = attention_flops(shape.B, shape.NH, shape.T, shape.d)
    return {"shape": shape.as_dict(), "dtype": "float32", "name": name, "label": label, "kind": kind,
            "status": "ok", "flops": flops, "max_err": err, "bound": 2e-6, "config": "d_head=64, B_r=32, B_c=32",
            "timing": {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "min_ms": ms * 0.9,
                       "max_ms": ms * 1.1, "runs": 50},
            "tflops": flops / (ms * 1e-3) / 1e12, "pct_ffma": 100 * flops / (ms * 1e-3) / 1e12 / 50.0}


def shape_rows(shape, scale=1.0):
    """Three rungs (the middle one wrong), the CuPy reference, SDPA efficient."""
    rows = [timed_row(shape, "v01_naive", "rung", 4.0 * scale),
            {"shape": shape.as_dict(), "dtype": "float32", "name": "v02_broken", "label": "v02_broken",
             "kind": "rung", "status": "wrong", "flops": 0, "max_err": 0.5, "bound": 2e-6,
             "reason": "max error 5.00e-01 > bound 2.00e-06"},
            timed_row(shape, "v03_fast", "rung", 1.0 * scale),
            timed_row(shape, "reference", "peer", 2.0 * scale),
            timed_row(shape, "sdpa_efficient", "peer", 0.5 * scale)]
    rungs.add_speedups(rows)
    return rows


def kernels_result(shapes=((1, 512), (8, 1024)), kind="kernels", date="2026-01-02T03:04:05Z"):
    shapes = [Shape(B, T) for B, T in shapes]
    rows = [r for i, s in enumerate(shapes) for r in shape_rows(s, scale=i + 1)]
    return {"schema": results.SCHEMA, "kind": kind, "setup": fixture_setup(f"python3 bench.py {kind}", date),
            "flop_convention": FLOP_CONVENTION, "method": Method().describe(100 * 2**20),
            "ceilings": {"ffma_tflops": 50.0, "ffma_what": "fixture", "copy_tbps": 3.0, "copy_what": "fixture"},
            "dtype": "float32", "shapes": [s.as_dict() for s in shapes],
            "kernels": ["v01_naive", "v02_broken", "v03_fast"], "peers": ["reference", "sdpa_efficient"],
            "compare_to": list(peers.COMPARE_TO["float32"]), "seed": 0, "rows": rows}


def e2e_result(modes=("no-cache", "kv-cache"), date="2026-01-02T03:04:05Z"):
    rows = []
    for mode in modes:
        for name, label, kind, seconds, tokens in [("reference", "CuPy reference", "peer", 8.0, [1, 2, 3, 4]),
                                                   ("v03_fast", "v03_fast", "rung", 4.0, [1, 2, 9, 4]),
                                                   ("hf", "HF transformers (sdpa)", "peer", 5.0, [1, 2, 3, 4])]:
            rows.append({"name": name, "label": label, "kind": kind, "mode": mode, "kv_cache": mode == "kv-cache",
                         "status": "ok", "seconds": seconds, "tokens": tokens, "peak_bytes": 600 * 2**20,
                         "elapsed": [seconds * (i + 1) / len(tokens) for i in range(len(tokens))]})
    e2e.add_generation_comparisons(rows)
    return {"schema": results.SCHEMA, "kind": "e2e", "setup": fixture_setup("python3 bench.py e2e", date),
            "model": "random gpt2 (seed 0)", "prompt": e2e.PROMPT, "prompt_tokens": 8, "new_tokens": 4,
            "sampling": "greedy", "dtype": "float32", "modes": list(modes),
            "method": {"no-cache": "whole sequence", "kv-cache": "prefill then decode", "hf": "generate"},
            "rows": rows, "plot": None}


def scale_row(size, dtype, rate, kind="lab", peak_gib=1.0, bpt=0.5e9, hf_ttft_ms=None):
    """A row of `bench.py e2e --sizes` as scale.measure (kind lab) or measure_hf (kind hf) writes it; an HF
    row without hf_ttft_ms as runs before HF's first token was timed wrote it."""
    from benchmarks import scale
    from lm.summary import memory_figures

    row = {"size": size, "model": scale.SIZES[size], "family": scale.family(size), "dtype": dtype, "kind": kind,
           "status": "ok", "engine": "fast: persistent step" if kind == "lab" else "HF transformers 5.17 (sdpa, static cache)",
           "decode_tokens_per_s": rate, "us_per_token": 1e6 / rate, "weight_bytes_per_token": bpt,
           "weight_tbps": bpt * rate / 1e12, "pct_copy": 100 * bpt * rate / 4e12, "floor_tokens_per_s": 4e12 / bpt,
           "peak_bytes": int(peak_gib * 2**30)}
    if kind == "hf":
        if hf_ttft_ms is None:
            return row
        return row | {"prefill_tokens": 1000, "ttft_ms": hf_ttft_ms, "prefill_tflops": 120.0, "pct_bf16_gemm": 20.0}
    row |= {"attention": "v18_wgmma", "n_params": int(bpt / 2), "new_tokens": 512, "prefill_tokens": 1000,
            "ttft_ms": 12.5, "prefill_tflops": 250.0, "pct_bf16_gemm": 250.0 / 6.0,
            **memory_figures(row["peak_bytes"], row["peak_bytes"] + 2**28, int(bpt), 2**26, 2**25)}
    return row | scale.targets(row)


def scale_result(date="2026-01-02T03:04:05Z"):
    from benchmarks import scale

    rows = [scale_row("gpt2", "bfloat16", 11000.0, peak_gib=0.3, bpt=0.25e9),
            scale_row("gpt2", "float32", 5000.0, peak_gib=2.5, bpt=0.5e9),  # over its bound
            scale_row("gpt2", "bfloat16", 200.0, kind="hf", peak_gib=0.5, bpt=0.25e9),
            {"size": "gpt2-xl", "model": "GPT-2 XL", "family": "gpt2", "dtype": "bfloat16", "kind": "lab",
             "status": "error", "reason": "OutOfMemoryError: out of memory"},
            scale_row("llama-3.1-8b", "bfloat16", 230.0, peak_gib=16.0, bpt=15e9)]
    return {"schema": results.SCHEMA, "kind": "scale", "setup": fixture_setup("python3 bench.py e2e --sizes all", date),
            "sizes": ["gpt2", "gpt2-xl", "llama-3.1-8b"], "new_tokens": 512, "prefill_tokens": 1000,
            "warmup_tokens": 64, "seed": 0,
            "ceilings": {"copy_tbps": 4.0, "copy_what": "fixture copy", "bf16_tflops": 600.0, "bf16_what": "fixture"},
            "targets": {"copy_pct": scale.COPY_TARGETS,
                        "tokens_per_s": {f"{s} {d}": v for (s, d), v in scale.RATE_TARGETS.items()},
                        "prefill_pct_bf16_gemm": scale.PREFILL_TARGET, "prefill_sizes": list(scale.PREFILL_TARGET_SIZES),
                        "memory": "peak <= 1.15 x (weights + KV cache) + 256 MiB"},
            "method": scale.METHOD, "rows": rows, "plot": None}


def resources_result():
    rows = [r.as_dict() for r in kernels.compile_report(RUNGS[0], "sm_90")]
    setup = fixture_setup("python3 bench.py resources --arch sm_90") | {"device": None}  # compiled, no device
    return {"schema": results.SCHEMA, "kind": "resources", "setup": setup,
            "nvrtc": "12.9", "arch": "sm_90", "on_device": False, "kernels": RUNGS[:1], "rows": rows}


def table_rows(text, first_cell):
    return [line for line in text.splitlines() if line.startswith(f"| {first_cell} ")]


class FakeAxes:
    def __init__(self):
        self.lines, self.hlines = [], []

    def plot(self, xs, ys, **kw):
        self.lines.append((list(xs), list(ys), kw.get("label")))

    def axhline(self, y, **kw):
        self.hlines.append(y)

    def set_title(self, title, **kw):
        self.title = title

    def set_ylabel(self, label, **kw):
        self.ylabel = label

    def __getattr__(self, name):  # labels, scales, grid, legend
        return lambda *a, **k: None


class FakeFigure:
    def __getattr__(self, name):  # suptitle
        return lambda *a, **k: None


class FakePyplot:
    def subplots(self, rows=1, cols=1, **kw):
        self.axes = [FakeAxes() for _ in range(rows * cols)]
        self.ax = self.axes[0]
        self.figure = FakeFigure()
        if kw.get("squeeze", True) and rows * cols == 1:
            return self.figure, self.ax
        return self.figure, [self.axes[r * cols:(r + 1) * cols] for r in range(rows)]

    def get_cmap(self, name):
        return lambda i: (name, i)


def outside_markers(text):
    """The README with everything between each start and end marker removed."""
    return re.sub(r"(<!-- bench:([\w-]+):start -->).*?(<!-- bench:\2:end -->)", r"\1\3", text, flags=re.S)


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class FakeEvent:
    done = True  # the stand-in runs its work at once

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class FakePool:
    def free_all_blocks(self):
        pass

    def free_bytes(self):
        return 0

    def total_bytes(self):
        return 123 * 2**20


def fake_cupy():
    stream = FakeStream()
    cuda = SimpleNamespace(Event=FakeEvent, get_elapsed_time=lambda s, e: (e.t - s.t) * 1e3,
                           get_current_stream=lambda: stream, Device=lambda: SimpleNamespace(synchronize=lambda: None),
                           runtime=SimpleNamespace(memGetInfo=lambda: (64 * 2**30, 80 * 2**30)))
    pool = FakePool()
    return SimpleNamespace(ndarray=np.ndarray, float16=np.float16, float32=np.float32, float64=np.float64,
                           uint8=np.uint8, uint32=np.uint32, abs=np.abs, isfinite=np.isfinite, empty=np.empty,
                           zeros=np.zeros, ones=np.ones, random=SimpleNamespace(default_rng=np.random.default_rng),
                           get_default_memory_pool=lambda: pool, cuda=cuda)


def fake_prepare(q, k, v, *, kernel, causal=True):
    """Stand-in rungs, chosen by file name: good, noisy (error 1e-3), lazy (second half unwritten), picky."""
    name = Path(kernel).stem
    if name.endswith("picky"):
        raise TypeError(f"kernel {name} supports float16 only")
    out = np.empty(q.shape, dtype=np.float32)

    def run():
        ref = kernels.reference_attention(q, k, v, causal=causal)
        if name.endswith("noisy"):
            ref = ref + np.float32(1e-3)
        if name.endswith("lazy"):
            out[:, :, : q.shape[2] // 2] = ref[:, :, : q.shape[2] // 2]
        else:
            out[...] = ref
        return out

    run.instance = SimpleNamespace(describe=lambda: "stand-in")
    return run


class StandInFlush:
    nbytes = 2**21

    def __call__(self):
        pass


FAKE_DEVICE = {"name": "Stand-in GPU", "arch": "sm_90", "sm_count": 132, "l2_bytes": 2**20,
               "memory_bytes": 80 * 2**30, "driver": "0", "driver_cuda": "13.0", "cuda_runtime": "13.0"}


def features_result():
    """A small features result as cmd_features writes it: decode, long context, a cross case whose
    peer is n/a, a GQA case whose peer repeats K/V, and an unsupported rung."""
    def timing(ms):
        return {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.02, "min_ms": ms * 0.9, "max_ms": ms * 1.1,
                "runs": 50}

    decode = Case("decode", 1, 12, 12, 1, 1024, 64)
    long = Case("long", 16, 32, 32, 1, 4096, 128)
    cross = Case("cross", 4, 12, 12, 256, 4096, 64)
    gqa = Case("gqa", 4, 32, 8, 2048, 2048, 128)
    cases = [("decode-a", decode, "float32"), ("long-a", long, "bfloat16"), ("cross-a", cross, "float32"),
             ("gqa-a", gqa, "float32")]
    base = lambda cid, case, dtype, name, kind, status="ok": {  # noqa: E731
        "case": cid, "shape": case.as_dict(), "dtype": dtype, "name": name,
        "label": peers.PEERS[name].label if kind == "peer" else name, "kind": kind, "status": status,
        "max_err": 1e-7, "bound": 2e-6}
    kv = features.kv_bytes(decode, "float32")
    rows = [
        base("decode-a", decode, "float32", "v16_decode_split_kv", "rung") | {
            "kernel_us": 4.0, "graph_us": 5.5, "target_met": True, "vs_peer": 2.5, "kv_bytes": kv,
            "kv_tbps": kv / 4e-6 / 1e12, "config": "d_head=64, splits=6",
            "kernel_timing": {"us": 4.0, "p20_us": 3.9, "p80_us": 4.1, "statistic": "median", "calls": 240}},
        base("decode-a", decode, "float32", "v14_tf32_mma", "rung") | {
            "kernel_us": 12.0, "graph_us": 13.0, "target_met": False, "vs_peer": 10 / 12, "kv_bytes": kv,
            "kv_tbps": kv / 12e-6 / 1e12, "kernel_timing": {"us": 12.0, "statistic": "mean (records ...)"}},
        base("decode-a", decode, "float32", "sdpa_efficient", "peer") | {
            "kernel_us": 10.0, "graph_us": None, "graph_reason": "capture refused", "kv_bytes": kv,
            "kv_tbps": kv / 1e-5 / 1e12, "kernel_timing": {"us": 10.0, "p20_us": 9.0, "p80_us": 11.0}},
        base("long-a", long, "bfloat16", "v16_decode_split_kv", "rung") | {
            "timing": timing(0.3), "kv_bytes": features.kv_bytes(long, "bfloat16"), "kv_tbps": 3.58, "pct_copy": 84.2,
            "target_met": True, "vs_peer": 1.2},
        base("long-a", long, "bfloat16", "sdpa_flash", "peer") | {"timing": timing(0.36), "kv_tbps": 2.98,
                                                                  "kv_bytes": features.kv_bytes(long, "bfloat16"),
                                                                  "pct_copy": 70.1},
        base("cross-a", cross, "float32", "v13_fa2_partitioning", "rung") | {
            "timing": timing(2.0), "tflops": shape_flops(cross) / 2e-3 / 1e12, "vs_peer": None},
        base("cross-a", cross, "float32", "v12_o_in_registers", "rung", "unsupported") | {
            "max_err": None, "reason": "ValueError: kernel v12_o_in_registers does not support query length 256 != "
                                       "key length 4096"},
        base("cross-a", cross, "float32", "sdpa_efficient", "peer", "n/a") | {
            "reason": "n/a: this torch has no torch.nn.attention.bias.causal_lower_right"},
        base("gqa-a", gqa, "float32", "v13_fa2_partitioning", "rung") | {
            "timing": timing(4.0), "tflops": shape_flops(gqa) / 4e-3 / 1e12, "vs_peer": 0.5},
        base("gqa-a", gqa, "float32", "sdpa_efficient", "peer") | {
            "timing": timing(2.0), "tflops": shape_flops(gqa) / 2e-3 / 1e12,
            "note": "K and V repeated to 32 heads for the peer only (enable_gqa=True: RuntimeError: No available kernel)"},
    ]
    return {"schema": results.SCHEMA, "kind": "features", "setup": fixture_setup("python3 bench.py features"),
            "flop_convention": FEATURE_FLOP_CONVENTION,
            "method": Method(budget_ms=100).describe(100 * 2**20) | {"decode": "CUPTI (fixture)", "caches": 24,
                                                                             "reps": 10},
            "ceilings": {"ffma_tflops": 50.0, "ffma_what": "fixture", "copy_tbps": 4.25, "copy_what": "fixture copy"},
            "targets": {"decode_kernel_us": 5.0, "long_pct_copy": 75.0}, "parts": list(features.FEATURE_PARTS),
            "dtypes": ["float32", "bfloat16"], "kernels": ["v13_fa2_partitioning", "v16_decode_split_kv"],
            "kernels_named": False, "peers": dict(peers.FEATURE_PEER),
            "cases": [{"id": cid, "part": case.part, "shape": case.as_dict(), "dtype": dtype,
                       "peer": peers.FEATURE_PEER[dtype], "kernels": [], "flops": shape_flops(case)}
                      for cid, case, dtype in cases],
            "seed": 0, "rows": rows}


def cells_of(line):
    return [c.strip() for c in line.split("|")[1:-1]]


def install_stand_ins(monkeypatch):
    """bench.py with NumPy for CuPy, a stand-in device and ceilings, no torch, and fake_prepare for the rungs."""
    monkeypatch.setattr(device, "get_cupy", fake_cupy)
    monkeypatch.setattr(device, "gpu_problem", lambda: None)
    monkeypatch.setattr(device, "device_info", lambda: dict(FAKE_DEVICE))
    monkeypatch.setattr(timing, "measure_ceilings", lambda method: {
        "ffma_tflops": 50.0, "ffma_what": "stand-in", "copy_tbps": 3.0, "copy_what": "stand-in"})
    monkeypatch.setattr(timing, "L2Flush", StandInFlush)
    monkeypatch.setattr(device, "get_torch", lambda: (_ for _ in ()).throw(device.Unavailable("torch is not importable")))
    monkeypatch.setattr(kernels, "prepare", fake_prepare)
