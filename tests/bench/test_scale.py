"""bench.py e2e --sizes (decode at scale) on this machine: its tables, plot and docs section from a
synthetic result, its command line, and the command end to end with NumPy standing in for CuPy on tiny
stand-ins for the sizes."""

import contextlib
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import gpt2
import kernels
import llama
from benchmarks import device, plots, scale, timing
from benchmarks.results import write_result
from tests.bench.helpers import (
    FIXTURES,
    FakePyplot,
    cells_of,
    install_stand_ins,
    run,
    scale_result,
    scale_row,
    table_rows,
)
from tests.bench.test_readme import docs_page


def test_the_sizes_are_the_packages_sizes():
    assert set(scale.SIZES) == set(gpt2.SIZES) | set(llama.SIZES)
    assert {scale.family(s) for s in gpt2.SIZES} == {"gpt2"} and {scale.family(s) for s in llama.SIZES} == {"llama"}


def test_scale_tables_render_every_row():
    text = scale.render_scale(scale_result(), "scale.png")
    assert "**Fixture GPU**" in text and "Command: `python3 bench.py e2e --sizes all`" in text
    assert "copy 4.00 TB/s (fixture copy), bf16 GEMM 600 TFLOP/s" in text
    assert "decode at least 80% of the copy ceiling in bfloat16, 70% of the copy ceiling in float32" in text
    assert "GPT-2 small 10,000 tokens/s in bfloat16, 6,000 tokens/s in float32" in text
    assert "![decode tokens/s per model against its bandwidth floor](scale.png)" in text
    decode, memory = text.split("**Memory and the first token**")
    small = [cells_of(line) for line in table_rows(decode, "GPT-2 small")]
    assert small[0][:9] == ["GPT-2 small", "bfloat16", "fast: persistent step", "11,000.0", "91", "0.25",
                            "2.75 (69%)", "16,000", "80%: missed; 10,000/s: met"]
    assert small[1][8] == "70%: missed; 6,000/s: missed"
    assert small[2][:4] == ["GPT-2 small", "bfloat16", "HF transformers 5.17 (sdpa, static cache)", "200.0"]
    assert small[2][8] == "-"
    (xl,) = [cells_of(line) for line in table_rows(decode, "GPT-2 XL")]
    assert xl[3] == "**error**" and xl[-1] == "OutOfMemoryError: out of memory"
    (big,) = [cells_of(line) for line in table_rows(decode, "Llama 3.1 8B")]
    assert big[6] == "3.45 (86%)" and big[8] == "80%: met"
    rows = [cells_of(line) for line in table_rows(memory, "GPT-2 small")]
    assert rows[0][:8] == ["GPT-2 small", "bfloat16", "0.25", "0.07", "0.32", "1.02x", "0.63", "within"]
    assert rows[1][7] == "**over**"
    assert rows[2][:2] == ["GPT-2 small", "bfloat16 (HF)"] and rows[2][4] == "0.54"
    assert rows[2][9:] == ["-", "-"]  # an HF row of a run before HF's first token was timed
    (big,) = [cells_of(line) for line in table_rows(memory, "Llama 3.1 8B")]
    assert big[7] == "within" and big[9] == "12.5" and big[10] == "250 (42%): missed"
    assert not table_rows(memory, "GPT-2 XL")  # an error row has no memory to show


def test_hf_rows_show_their_first_token_beside_the_labs():
    result = scale_result()
    result["rows"][1]["ttft_ms"] = 50.0  # GPT-2 small float32: not HF's dtype, so not its ratio
    result["rows"][2] = scale_row("gpt2", "bfloat16", 200.0, kind="hf", peak_gib=0.5, bpt=0.25e9, hf_ttft_ms=25.0)
    result["rows"].insert(4, scale_row("gpt2-xl", "bfloat16", 50.0, kind="hf", hf_ttft_ms=80.0))  # its lab row failed
    memory = scale.render_scale(result).split("**Memory and the first token**")[1]
    small = [cells_of(line) for line in table_rows(memory, "GPT-2 small")]
    assert [r[9:] for r in small] == [["12.5", "250 (42%)"], ["50.0", "250 (42%)"], ["25.0 (lab / HF 0.50)", "120 (20%)"]]
    (xl,) = [cells_of(line) for line in table_rows(memory, "GPT-2 XL")]
    assert xl[1] == "bfloat16 (HF)" and xl[9:] == ["80.0", "120 (20%)"]


def test_a_graphed_prefill_is_named_beside_its_first_token():
    """A row measured with LAB_PREFILL_GRAPHS=1 (its timed first tokens replay the bucket's graph) says so
    in the first-token cell; the ratio to HF's stays beside it."""
    result = scale_result()
    result["rows"][0] |= {"prefill_graphs": True, "prefill_first_ms": [30.0, 60.0]}
    result["rows"][2] = scale_row("gpt2", "bfloat16", 200.0, kind="hf", peak_gib=0.5, bpt=0.25e9, hf_ttft_ms=25.0)
    memory = scale.render_scale(result).split("**Memory and the first token**")[1]
    small = [cells_of(line) for line in table_rows(memory, "GPT-2 small")]
    assert small[0][9] == "12.5 graphed" and small[1][9] == "12.5" and small[2][9] == "25.0 (lab / HF 0.50)"


def test_progress_line_shows_the_first_token_of_lab_and_hf_rows():
    lab = scale.progress_line(scale_row("gpt2", "bfloat16", 11000.0))
    hf = scale.progress_line(scale_row("gpt2", "bfloat16", 200.0, kind="hf", hf_ttft_ms=25.0))
    assert lab.endswith("(bound 0.86), first token 12.5 ms")
    assert hf.startswith("GPT-2 small   bfloat16 HF ") and hf.endswith("peak   1.00 GiB, first token 25.0 ms")


def test_layer_matrices_count_the_labs_and_hfs_names_alike():
    """2 x these per token is the prefill's FLOP convention for lab and HF rows alike: the layers'
    matrices, under the lab's checkpoint names and HF's (GPT-2's under transformer.), nothing else."""
    params = gpt2.random_weights(TINY).params
    lab = scale.layer_matrices((name, a.shape) for name, a in params.items())
    C, F = TINY.n_embd, TINY.mlp_width
    assert lab == TINY.n_layer * (C * 3 * C + C * C + C * F + F * C)
    assert scale.layer_matrices((f"transformer.{name}", a.shape) for name, a in params.items()) == lab
    params = llama.random_weights(TINY_LLAMA).params
    C, F, kv = TINY_LLAMA.hidden_size, TINY_LLAMA.intermediate_size, TINY_LLAMA.kv_heads * TINY_LLAMA.head_size
    assert scale.layer_matrices((name, a.shape) for name, a in params.items()) == \
        TINY_LLAMA.n_layer * (2 * C * C + 2 * kv * C + 3 * C * F)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class FakeHF:
    """An HF model's generate() that takes the next of `seconds` on the clock and appends token 7, logging
    each call beside the synchronizations."""

    config = SimpleNamespace(eos_token_id=[50256])

    def __init__(self, seconds, clock, log, parameters=()):
        self.seconds, self.clock, self.log, self.parameters = list(seconds), clock, log, parameters

    def generate(self, ids, max_new_tokens, min_new_tokens, **options):
        self.log.append(("generate", ids.shape[1], max_new_tokens, options["cache_implementation"]))
        self.clock.now += self.seconds.pop(0)
        return np.concatenate([ids, [[7]]], axis=1)

    def eval(self):
        return self

    def named_parameters(self):
        return [(name, SimpleNamespace(shape=shape)) for name, shape in self.parameters]


def fake_torch(log, reserved=0):
    cuda = SimpleNamespace(synchronize=lambda: log.append("sync"), max_memory_reserved=lambda: reserved)
    return SimpleNamespace(tensor=lambda data, device: np.array(data), ones_like=np.ones_like, cuda=cuda,
                           inference_mode=contextlib.nullcontext, device=lambda name: contextlib.nullcontext(),
                           bfloat16="bfloat16", get_default_dtype=lambda: "float32", set_default_dtype=lambda dtype: None)


def test_hf_first_token_is_timed_after_a_warm_up_each_run_synchronized(monkeypatch):
    from benchmarks import e2e

    clock, log = FakeClock(), []
    monkeypatch.setattr(e2e, "time", clock)
    monkeypatch.setattr(device, "get_torch", lambda: fake_torch(log))
    model = FakeHF([5.0, 0.03, 0.01, 0.02], clock, log)
    assert e2e.time_hf_first_token(model, list(range(40))) == pytest.approx([0.03, 0.01, 0.02])
    assert log == ["sync", ("generate", 40, 1, "static"), "sync"] * 4  # the warm-up at the prompt's length first


def test_measure_hf_times_the_first_token_after_the_labs_long_prompt(monkeypatch):
    """measure_hf with a fake torch and model: the first token after prefill_ids' prompt, the median of
    the 3 timed runs, the products' rate from HF's layer matrices, the peak to the end of the runs."""
    from benchmarks import e2e

    clock, log = FakeClock(), []
    torch = fake_torch(log, reserved=7 * 2**30)
    parameters = [("transformer.wte.weight", (50257, 768)), ("transformer.h.0.attn.c_attn.weight", (768, 2304)),
                  ("transformer.h.0.attn.c_attn.bias", (2304,)), ("transformer.h.0.mlp.c_fc.weight", (768, 3072)),
                  ("lm_head.weight", (50257, 768))]
    model = FakeHF([5.0, 0.03, 0.01, 0.02], clock, log, parameters)
    transformers = SimpleNamespace(__version__="5.17.0", GPT2LMHeadModel=lambda config: model,
                                   GPT2Config=lambda **settings: SimpleNamespace(**settings))
    monkeypatch.setattr(e2e, "time", clock)
    monkeypatch.setattr(device, "get_torch", lambda: torch)
    monkeypatch.setattr(e2e, "hf_transformers", lambda: (torch, transformers))
    monkeypatch.setattr(e2e, "time_hf_model", lambda hf, prompt, n, kv, warmup: {
        "elapsed": [0.0, 0.5, 1.0], "peak_bytes": 5 * 2**30})  # decode: 2 tokens in a second
    args = SimpleNamespace(tokens=3, warmup=2, prefill_tokens=1000, hf_attn="sdpa")
    row = scale.measure_hf("gpt2", args, 4e12, 600.0)
    assert [entry[1] for entry in log if entry != "sync"] == [1000] * 4
    assert row["kind"] == "hf" and row["decode_tokens_per_s"] == pytest.approx(2.0)
    assert row["prefill_tokens"] == 1000 and row["ttft_ms"] == pytest.approx(20.0)
    flops = 2 * (768 * 2304 + 768 * 3072) * 1000
    assert row["prefill_tflops"] == pytest.approx(flops / 0.02 / 1e12)
    assert row["pct_bf16_gemm"] == pytest.approx(100 * row["prefill_tflops"] / 600.0)
    assert row["peak_bytes"] == 7 * 2**30
    model.seconds = [5.0, 0.03, 0.01, 0.02]
    assert scale.measure_hf("gpt2", args, 4e12, None)["pct_bf16_gemm"] is None  # no bf16 ceiling measured


def test_scale_plot_draws_each_dtype_against_its_floor():
    plt = FakePyplot()
    plots.plot_scale(plt, scale_result())
    lines = {label: (xs, ys) for xs, ys, label in plt.ax.lines}
    assert lines["lab, bfloat16"] == ([0, 2], [11000.0, 230.0])  # GPT-2 small, (XL failed), Llama 8B
    assert lines["bandwidth floor, bfloat16 (4.00 TB/s copy)"][1] == pytest.approx([16000.0, 4e12 / 15e9])
    assert lines["lab, float32"] == ([0], [5000.0])
    assert lines["HF transformers, bfloat16, static cache"] == ([0], [200.0])


def test_readme_writes_the_scale_section_into_the_decode_page(tmp_path, capsys):
    readme, results_doc = tmp_path / "README.md", docs_page(tmp_path)
    shutil.copy(FIXTURES / "bench_readme.md", readme)
    decode = tmp_path / "docs" / "decode.md"
    decode.write_text("# Decode\n\nbefore\n<!-- bench:scale:start -->\nold\n<!-- bench:scale:end -->\nafter\n")
    folder = tmp_path / "results"
    result = scale_result()
    write_result(result, folder / "scale-fixture-gpu-20260102T030405Z.json")
    code, out, err = run(["readme", "--readme", str(readme), "--results-doc", str(results_doc), "--decode-doc",
                          str(decode), "--results", str(folder)], capsys)
    text = decode.read_text()
    assert code == 0, err
    assert text.startswith("# Decode\n\nbefore\n<!-- bench:scale:start -->\n<!-- generated by `python3 bench.py readme`")
    assert "Results file: [scale-fixture-gpu-20260102T030405Z.json](../results/scale-fixture-gpu-20260102T030405Z.json)" in text
    assert "| GPT-2 small | bfloat16 | fast: persistent step | 11,000.0 |" in text and text.endswith("end -->\nafter\n")


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "gpt2", "--model", "llama-3.2-1b"], "--sizes runs each size with the newest rung"),
    (["--sizes", "gpt2", "--kv-cache"], "leave out --model, --kernels, --kv-cache"),
    (["--dtypes", "bfloat16"], "--dtypes and --prefill-tokens go with --sizes"),
    (["--sizes", "gpt5"], "unknown size(s) gpt5: choose from gpt2, gpt2-medium"),
    (["--sizes", "gpt2", "--dtypes", "float16"], "unknown dtype(s) float16: choose from bfloat16, float32"),
])
def test_sizes_flags_are_checked(argv, message, capsys):
    code, _, err = run(["e2e", *argv], capsys)
    assert code == 2 and message in err


TINY = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=64)
TINY_LLAMA = llama.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128256, max_position_embeddings=128)


def test_sizes_end_to_end_with_stand_ins(tmp_path, monkeypatch, capsys):
    """NumPy for CuPy, tiny configs under the sizes' names: the eager path runs every size, and the result
    has its rows, ceilings, memory figures and targets."""
    install_stand_ins(monkeypatch)
    monkeypatch.setitem(gpt2.SIZES, "gpt2", TINY)
    monkeypatch.setitem(llama.SIZES, "llama-3.2-1b", TINY_LLAMA)
    monkeypatch.setattr(kernels, "device_limits", lambda: SimpleNamespace(arch="sm_90", sm_count=132))
    monkeypatch.setattr(kernels, "Attend", lambda path, **kw: lambda q, k, v: kernels.reference_attention(q, k, v))
    monkeypatch.setattr(timing, "measure_copy", lambda method: {"copy_tbps": 4.0, "copy_what": "stand-in"})
    monkeypatch.setattr(timing, "measure_tensor_ceilings", lambda method: {"bf16_tflops": 600.0, "bf16_what": "x"})
    monkeypatch.setattr(plots, "plot_or_none", lambda plot, result, path: None)
    code, out, err = run(["e2e", "--sizes", "gpt2,llama-3.2-1b", "--tokens", "5", "--warmup", "2", "--no-hf",
                          "--prefill-tokens", "40", "--results", str(tmp_path)], capsys)
    assert code == 0, err
    (path,) = tmp_path.glob("scale-stand-in-gpu-*.json")
    data = json.loads(path.read_text())
    assert data["sizes"] == ["gpt2", "llama-3.2-1b"] and data["ceilings"]["copy_tbps"] == 4.0
    rows = {(r["size"], r["dtype"]): r for r in data["rows"]}
    assert list(rows) == [("gpt2", "bfloat16"), ("gpt2", "float32"), ("llama-3.2-1b", "bfloat16")]
    for (size, dtype), r in rows.items():
        assert r["status"] == "ok", r
        assert r["engine"] == "eager" and r["new_tokens"] == 5 and r["prefill_tokens"] == 40
        config = TINY if size == "gpt2" else TINY_LLAMA
        item = 2 if dtype == "bfloat16" else 4
        assert r["weight_bytes"] == r["n_params"] * item
        positions = max(len(scale.of_size(size).prompt_ids) + 5 - 1, 40)
        assert r["kv_cache_bytes"] == 2 * config.n_layer * config.kv_heads * config.head_size * positions * item
        assert r["pct_copy"] == pytest.approx(100 * r["weight_bytes_per_token"] * r["decode_tokens_per_s"] / 4e12)
        assert r["floor_tokens_per_s"] == pytest.approx(4e12 / r["weight_bytes_per_token"])
        assert r["copy_target_met"] is False and r["ttft_ms"] > 0
        assert r["peak_bytes"] == 123 * 2**20  # the stand-in pool's
    assert rows["gpt2", "float32"]["rate_target"] == 6000.0 and rows["llama-3.2-1b", "bfloat16"]["rate_target"] is None
    assert rows["llama-3.2-1b", "bfloat16"]["prefill_target_met"] is False
    assert "| GPT-2 small | float32 | eager |" in out and f"wrote {path}" in out
    assert np.isfinite([r["decode_tokens_per_s"] for r in data["rows"]]).all()


def test_release_memory_collects_cycles_before_emptying_the_pool(monkeypatch):
    """A fast engine and its parts (the whole-sequence pass, the persistent step) refer to each other: the
    next size's row must not count the last one's, so the cycle is collected before the pool is emptied."""
    import gc
    import weakref

    from benchmarks import device

    class Part:
        pass

    engine, part = Part(), Part()
    engine.part, part.engine = part, engine  # a cycle, as an engine and its parts make
    alive = weakref.ref(engine)
    del engine, part
    seen = []
    pool = SimpleNamespace(free_all_blocks=lambda: seen.append(alive() is None))
    monkeypatch.setattr(device, "get_cupy", lambda: SimpleNamespace(get_default_memory_pool=lambda: pool))
    gc.disable()  # only release_memory's collection may free it
    try:
        device.release_memory()
    finally:
        gc.enable()
    assert seen == [True]
