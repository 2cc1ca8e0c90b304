"""What tools/sanitize.py runs under compute-sanitizer: its targets, launched and checked one after another
in this process.

    python3 tools/sanitize_targets.py v17_decode_cluster fused-float32 [--quick]    (here, without the tool)

  forward rung     kernels.attention in every dtype it declares, at SHAPES, CROSS and GQA where it declares
                   them, a split-KV rung at a decode step (DECODE) and a persistent rung at MANY_TILES (its
                   blocks each walk several tiles); --quick: its first dtype, one QUICK launch (odd lengths,
                   T_q != T_k and GQA as far as it declares them), the decode step and MANY_TILES.
                   Inputs drawn on the host, output poisoned with NaN, checked against the host's float64
                   reference: the target launches the rung and its launcher's copies, nothing else
  backward rung    dq, dk and dv at the same shapes against the host's float64 formulas from the host's o
                   and lse, in each mode it declares (a rung with a deterministic configuration runs in both)
  Triton rung      as a forward rung, on its smallest declared tile shape (no autotuning under the tool)
  fused-float32, fused-bfloat16
                   the fast engine (gpt2/fast) through its own launch code, on GPT-2 small's widths and
                   vocabulary with two of its layers (the kernels are the same instantiations), random
                   weights, activations and KV cache poisoned with NaN: a prefill (embed, layernorm,
                   bias_act, kv_store, merge_heads, lm_head_argmax; products on cuBLAS) and NEW decode steps of
                   plain per-operation launches (embed, gemv x 4, decode_attention, lm_head_argmax), spin,
                   and in float32 on sm_90 the no-cache mode's passes (gemm.cu)
  step-float32, step-bfloat16, step-float32-ring3, step-bfloat16-ring2, step-float32-reduce,
  step-bfloat16-reduce
                   the persistent decode step (kernels/fused/decode_step.cu) on the same model: a prefill,
                   then NEW tokens in one launch, x (which its block 0 writes at every step) poisoned; each
                   dtype with its plan's ring (2 slots in float32, 3 in bfloat16 at these widths) and with
                   the other depth (step_plan's ring), so that a report seen at one depth alone says so;
                   and with the heads' terms of attn.c_proj summed per block (REDUCE_HEADS, gpt2-xl's)
  train-float32, train-bfloat16
                   GPT-2's training pass (gpt2/backward.py) with its fused kernels (kernels/fused/train.cu) on
                   GPT-2 small's widths, two layers, a vocabulary of 1,000 and B x T = 2 x 97, the reference
                   attention: loss and gradients finite and near the array code's; then two steps of the
                   multi-tensor AdamW (kernels/fused/adamw.cu) on those gradients, one clipped, bit for bit
                   the per-tensor path's
The fused kernels are compiled with -lineinfo (line tables, the same instructions), so that a report
names their source lines.

Under synccheck (--tool synccheck, as tools/sanitize.py runs it) a rung with clusters beyond the portable 8
(v17) runs where that tool is sound: each shape in its first configuration where the grid fits in one wave,
else in a configuration of portable clusters (synccheck_launches).

Protocol (read by tools/sanitize.py): `@@ sanitize begin NAME` before a target's output, `@@ sanitize end
NAME STATUS` after it (ok, wrong: what, skipped: why, failed: exception), from an engine target
`@@ sanitize covers NAME FILE ...`, the kernels/fused files it launched, and `@@ sanitize note NAME TEXT`,
what the target ran otherwise than under the other tools, and why. An exception ends the process
(the tool may have stopped a launch, and the CUDA context with it); tools/sanitize.py goes on from the
next target in a new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes  # noqa: F401  (NumPy's bfloat16, for the host's draws)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MARK = "@@ sanitize "
# (B, NH, NH_kv, T_q, T_k, d). Every case is awkward somewhere: T a multiple of no tile, T_q != T_k (a
# bottom-right causal mask over more keys than queries), grouped-query heads where the rung declares them.
SHAPES = [(1, 2, 2, 64, 64, 64), (2, 3, 3, 97, 97, 64)]  # a small shape, and T a multiple of no tile
CROSS = (1, 2, 2, 33, 161, 64)  # lab.supports cross: fewer queries than keys, neither a tile multiple
GQA = (1, 4, 2, 97, 97, 64)  # lab.supports gqa: two query heads a K/V head
QUICK = (2, 4, 2, 97, 161, 64)  # --quick, one launch: odd lengths, T_q != T_k and GQA where declared
# A persistent rung (lab.persistent, a backward `key tiles persistent` phase) also here, --quick too: hundreds
# of tiles (320 key tiles of 128, 480 query tiles of 192 and more) over the SMs, so that every block walks
# several of them, its scheduler and its ring across tiles under the tool; odd lengths, as QUICK otherwise.
MANY_TILES = (2, 40, 20, 997, 1000, 64)
DECODE = (1, 12, 12, 1, 1000, 64)  # a split-KV rung's decode step: one query row a head over 1,000 keys
SETUP = "setup"  # the child's first random draws, before any target (main)
ENGINE = ("fused-float32", "fused-bfloat16", "step-float32", "step-bfloat16", "step-float32-ring3", "step-bfloat16-ring2",
          "step-float32-reduce", "step-bfloat16-reduce",
          "llama-float32", "llama-bfloat16", "train-float32", "train-bfloat16")
PROMPT = [15496, 11, 314, 1101, 257]  # "Hello, I'm a"
NEW = 4  # tokens generated by an engine target
BF16_NAN = 0x7FC0  # a bfloat16 NaN, for the arrays of bfloat16 bits
PORTABLE_CLUSTER = 8  # blocks a cluster holds on every part (CUDA Programming Guide, "Thread Block Clusters")
SYNCCHECK_NOTE = ("clusters of 16 only where the grid fits in one wave, clusters of 8 elsewhere: synccheck "
                  "reports divergent warps at the cluster barriers of clusters of 16 in more than one wave, in v17's "
                  "barriers alone too (tools/synccheck_cluster.py)")


def groups() -> dict[str, list[str]]:
    """Every target, by group, in the order they run."""
    import kernels

    return {"forward": kernels.names(), "backward": kernels.backward_names(), "triton": kernels.triton_names(),
            "fused": [n for n in ENGINE if n.startswith("fused")], "step": [n for n in ENGINE if n.startswith("step")],
            "llama": [n for n in ENGINE if n.startswith("llama")], "train": [n for n in ENGINE if n.startswith("train")]}


def resolve(token: str) -> str:
    """A rung as named on the command line (v17, v8, b2, t01, or its whole name) -> its target name;
    ValueError naming the known rungs when it names none."""
    from kernels import backward, ladder, triton

    if token.endswith((".cu", ".py")):
        raise ValueError(f"{token}: the sanitizer runs the lab's own rungs; name one (v17, b02, t01)")
    family = backward if backward.owns(token) else triton if triton.owns(token) else ladder
    return family.resolve(token).stem


# -- the rungs -------------------------------------------------------------------------------------


def draw(rng, shape, dtype):
    """Normal draws made on the host (NumPy), in `dtype`: copied to the device they are written by a copy
    the tools see, where CuPy's generator kernels drew initcheck reports of their own in its callers."""
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def case_shapes(rung, quick: bool) -> list[tuple]:
    """(B, NH, NH_kv, T_q, T_k, d) for a rung (ladder, Triton or backward): --quick one launch as awkward as
    the rung allows; else SHAPES, and CROSS and GQA where it declares them; a persistent rung's MANY_TILES, a
    split-KV rung's decode step; then QUICK's shape at the rung's other head sizes (other_head_sizes), and in
    a full run a persistent rung's MANY_TILES at each of them too."""
    supports = getattr(rung, "supports", ())

    def declared(shape):  # T_q != T_k and grouped heads only where the rung declares them
        B, NH, NH_kv, T_q, T_k, d = shape
        return (B, NH, NH if "gqa" not in supports else NH_kv, T_q, T_k if "cross" in supports else T_q, d)

    if quick:
        cases = [declared(QUICK)]
    else:
        cases = list(SHAPES) + [CROSS] * ("cross" in supports) + [GQA] * ("gqa" in supports)
    cases += [declared(MANY_TILES)] * persistent(rung) + [DECODE] * bool(getattr(rung, "split_kv", False))
    first = base_head_size(rung)
    cases = [c[:5] + (first,) for c in cases]
    for d in other_head_sizes(rung, quick):  # a full run walks a persistent rung's tiles at each of them too
        cases += [declared(QUICK[:5] + (d,))] + [declared(MANY_TILES[:5] + (d,))] * (persistent(rung) and not quick)
    return cases


def base_head_size(rung) -> int:
    """The head size of the shapes above: 64, or a rung's smallest where it takes no d = 64 (b10: 128 alone)."""
    sizes = getattr(rung, "head_sizes", lambda: [])()
    return QUICK[5] if not sizes or QUICK[5] in sizes else min(sizes)


def other_head_sizes(rung, quick: bool) -> list[int]:
    """The head sizes besides the base one (base_head_size) that a rung declares configurations for, each
    launched at QUICK's shape in the configuration the launcher picks for it (at d = 128 the register and
    shared-memory budgets, and often the tiles, are not d = 64's): every one in a full run, the largest with
    --quick."""
    sizes = [d for d in getattr(rung, "head_sizes", lambda: [])() if d != base_head_size(rung)]
    return sizes[-1:] if quick else sizes


def persistent(rung) -> bool:
    """Whether a rung's grid is the resident blocks, each walking tiles (forward lab.persistent, or a backward
    rung's persistent phase)."""
    return bool(getattr(rung, "persistent", False) or getattr(rung, "has_persistent_phase", False))


def attend_case(cp, name: str, dtype: str, shape: tuple, config=None, fp8: bool = False, seed: int = 0) -> bool:
    """One forward launch of rung `name` at shape (B, NH, NH_kv, T_q, T_k, d), output poisoned, against the
    float64 reference computed on the host (an FP8 rung: its inputs quantized on the host and copied, the
    reference its float64 emulation on them), so that the only kernels the target launches are the rung's
    and its launcher's; prints the error and returns whether it is within tolerance."""
    import kernels

    B, NH, NH_kv, T_q, T_k, d = shape
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, (B, NH, T_q, d), dtype), draw(rng, (B, NH_kv, T_k, d), dtype), draw(rng, (B, NH_kv, T_k, d), dtype)
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)  # an element no block writes stays NaN, and fails
    if fp8:  # quantized on the host too, then copied: on the device the quantization's Hadamard products are
        # cuBLAS's, whose stores initcheck does not see with its kernels left out (the default), and the
        # kernels reading them drew reports that were no rung's
        quantized = kernels.quantize_for(name, q, k, v, config=config)
        arrays = ("q", "k", "v_t", "q_scale", "k_scale", "v_scale")
        on_device = dataclasses.replace(quantized, **{f: cp.asarray(getattr(quantized, f)) for f in arrays})
        run = kernels.prepare_fp8(on_device, kernel=name, out=out, config=config)
        ref = kernels.fp8.emulated_attention(quantized)
    else:
        run = kernels.prepare(*(cp.asarray(x) for x in (q, k, v)), kernel=name, out=out, config=config)
        ref = kernels.reference_attention(*(x.astype(np.float64) for x in (q, k, v)))
    run()
    err = float(np.abs(cp.asnumpy(out).astype(np.float64) - ref).max())
    ok = err < (1e-3 if dtype == "float32" else 5e-2)  # NaN fails
    print(f"  {name:28s} {dtype:8s} B={B} NH={NH}/{NH_kv} T_q={T_q:4d} T_k={T_k:4d} d={d}: max |out - ref| = "
          f"{err:.2e}{'' if ok else '  WRONG'}", flush=True)
    return ok


def verdict(results: list[bool], what: str) -> str:
    wrong = results.count(False)
    return "ok" if not wrong else f"wrong: {wrong} of {len(results)} {what} outside the tolerance"


def rung_dtypes(rung, quick: bool) -> tuple[str, ...]:
    """Every dtype the rung declares; --quick its first."""
    return rung.dtypes[:1] if quick else tuple(rung.dtypes)


def forward_rung(cp, name: str, quick: bool, tool: str | None = None) -> str:
    import kernels

    rung = kernels.load(name)
    if tool == "synccheck" and non_portable(rung):
        print(f"{MARK}note {name} {SYNCCHECK_NOTE}", flush=True)
        results = []
        for dtype in rung_dtypes(rung, quick):
            def waves(config, shape, dtype=dtype):
                return cluster_waves(kernels.instance(name, shape[-1], config, dtype=dtype), shape)

            for shape, config, why in synccheck_launches(rung, dtype, case_shapes(rung, quick), waves):
                print(f"  config {config}: {why}", flush=True)
                results.append(attend_case(cp, name, dtype, shape, config=config))
        return verdict(results, "launches")
    return verdict([attend_case(cp, name, dtype, s, fp8=rung.fp8) for dtype in rung_dtypes(rung, quick)
                    for s in case_shapes(rung, quick)], "launches")


def non_portable(rung) -> bool:
    """Whether a rung launches clusters of more than the portable 8 blocks."""
    return getattr(rung, "cluster", None) is not None and any(
        rung.cluster_size(c) > PORTABLE_CLUSTER for c in rung.configs)


def cluster_waves(inst, shape: tuple) -> tuple[int, int]:
    """(clusters in the grid of inst's launch at shape (B, NH, NH_kv, T_q, T_k, d), clusters the device holds
    at once): more clusters than resident means that later ones start where earlier ones have finished."""
    from kernels import driver

    B, NH, _, T_q, T_k, _ = shape
    grid = inst.grid(B, NH, T_q, T_k)
    resident = driver.max_active_clusters(inst.function, grid, inst.block, inst.cluster, inst.smem)
    return grid[0] // inst.cluster * grid[1] * grid[2], resident


def synccheck_launches(rung, dtype: str, shapes: list[tuple], waves) -> list[tuple[tuple, tuple, str]]:
    """(shape, config, why) for each of `shapes` where compute-sanitizer's synccheck is sound for a rung with
    clusters beyond the portable 8: the config the launcher takes (the first declared for the shape's d and
    dtype) where its grid fits in one wave, else the first declared config of portable clusters in the dtype,
    at the shape's d where one is declared, else at its own d in place of the shape's. waves(config, shape)
    -> (clusters in the grid, clusters resident): cluster_waves on the device."""
    portable = [c for c in rung.configs if rung.dtype_of(c) in (None, dtype) and rung.cluster_size(c) <= PORTABLE_CLUSTER]
    out = []
    for shape in shapes:
        first = rung.configs_for(shape[-1], dtype)[0]
        size = rung.cluster_size(first)
        if size <= PORTABLE_CLUSTER:
            out.append((shape, first, f"clusters of {size}"))
            continue
        clusters, resident = waves(first, shape)
        if clusters <= resident:
            out.append((shape, first, f"clusters of {size}, {clusters} of them, all resident at once ({resident})"))
            continue
        if not portable:
            raise ValueError(f"{rung.name} declares no {dtype} config of clusters of at most {PORTABLE_CLUSTER}")
        config = next((c for c in portable if c[0] == shape[-1]), portable[0])
        out.append((shape[:-1] + (config[0],), config,
                    f"clusters of {rung.cluster_size(config)} in place of {size} ({clusters} clusters of {size}, "
                    f"{resident} resident)"))
    return out


def triton_rung(cp, name: str, quick: bool) -> str:
    import kernels
    from kernels import triton

    why = kernels.triton_unavailable()
    if why is not None:
        return f"skipped: {why}"
    rung = triton.load(name)
    tiles = triton.module(rung).CONFIGS[-1]  # the smallest tile shape it declares
    return verdict([attend_case(cp, name, dtype, s, config=tiles) for dtype in rung_dtypes(rung, quick)
                    for s in case_shapes(rung, quick)], "launches")


def backward_rung(cp, name: str, quick: bool) -> str:
    """dq, dk, dv against the host's float64 formulas from the host's o and lse, in each mode the rung
    declares (a deterministic configuration: both)."""
    import kernels

    rung = kernels.backward.load(name)
    modes = [False] + ([True] if any(rung.is_deterministic(c) for c in rung.configs) else [])
    results = []
    for dtype in rung_dtypes(rung, quick):
        for deterministic in modes:
            for seed, (B, NH, NH_kv, T_q, T_k, d) in enumerate(case_shapes(rung, quick)):
                rng = np.random.default_rng(seed)
                q, do = draw(rng, (B, NH, T_q, d), dtype), draw(rng, (B, NH, T_q, d), dtype)
                k, v = draw(rng, (B, NH_kv, T_k, d), dtype), draw(rng, (B, NH_kv, T_k, d), dtype)
                q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
                o64, lse = kernels.reference_attention(q64, k64, v64, return_lse=True)
                o = o64.astype(dtype)
                got = kernels.attention_backward(*(cp.asarray(x) for x in (q, k, v, o, lse.astype(np.float32), do)),
                                                 kernel=name, deterministic=deterministic)
                want = kernels.reference_attention_backward(q64, k64, v64, o.astype(np.float64), lse, do64)
                err = max(float(np.abs(cp.asnumpy(g).astype(np.float64) - w).max()) for g, w in zip(got, want))
                results.append(err < (1e-3 if dtype == "float32" else 1e-1))
                print(f"  {name:28s} {dtype:8s} B={B} NH={NH}/{NH_kv} T_q={T_q:4d} T_k={T_k:4d} d={d}"
                      f"{' deterministic' if deterministic else ''}: max |grad - ref| = {err:.2e}"
                      f"{'' if results[-1] else '  WRONG'}", flush=True)
    return verdict(results, "launches")


# -- the engine ------------------------------------------------------------------------------------


def poison(cp, arrays) -> None:
    """NaN in arrays that every kernel writes before it reads them (float32, or bfloat16 as its bits or as
    CuPy's bfloat16): a read of an element nobody wrote then shows as NaN downstream."""
    for a in arrays:
        if a.itemsize == 2:
            a.view(cp.uint16).fill(BF16_NAN)
        else:
            a.fill(np.nan)


def not_finite(cp, **arrays) -> list[str]:
    return [f"{name} has {int((~cp.isfinite(a)).sum())} of {a.size} elements not finite"
            for name, a in arrays.items() if not bool(cp.isfinite(a).all())]


def out_of_range(tokens: list[int], vocab: int) -> list[str]:
    return [f"tokens {tokens} outside 0..{vocab - 1}"] if any(not 0 <= t < vocab for t in tokens) else []


def host_drawn(cp, params: dict, dtype: str = "float32") -> dict:
    """Weights drawn on the host (NumPy's generator, float32), copied to the device and cast there: as the
    rungs' inputs, nothing of CuPy's random generator under the tool (initcheck's reports in CuPy's
    element-wise kernels just after its draws: tools/initcheck_library.py's random-ints case)."""
    return {k: cp.asarray(v).astype(dtype, copy=False) for k, v in params.items()}


def engine_target(cp, name: str) -> str:
    import gpt2
    import gpt2.fast as fast

    kind, dtype, *more = name.split("-")  # step-DTYPE-ringN: the persistent step with N slots; -reduce: REDUCE_HEADS
    if kind in ("llama", "train"):
        problems = (llama_step if kind == "llama" else training_pass)(cp, name, dtype)
        return "ok" if not problems else "wrong: " + "; ".join(problems)
    config = gpt2.GPT2Config(n_layer=2)  # GPT-2 small's widths and vocabulary, two of its layers
    params = host_drawn(cp, gpt2.random_weights(config, seed=0).params)
    params = params if dtype == "float32" else fast.as_bfloat16(params)
    if kind == "fused":
        problems = fused_kernels(cp, name, fast, params, config, dtype)
    else:
        ring = [int(m[4:]) for m in more if m.startswith("ring")]
        problems = persistent_step(cp, name, fast, params, config, dtype, ring[0] if ring else None, "reduce" in more)
    if isinstance(problems, str):
        return problems
    return "ok" if not problems else "wrong: " + "; ".join(problems)


def fused_kernels(cp, name, fast, params, config, dtype) -> list[str]:
    """The per-operation decode step and the prefill (and no-cache passes) through the engine's launches."""
    import gpt2

    engine = fast.Engine(params, config, dtype=dtype, pdl=False, persistent=False)
    longest = len(PROMPT) + NEW - 1  # the no-cache mode's last pass
    engine.reserve(longest)
    poison(cp, [engine.x, engine.qkv, engine.y, engine.g, engine.attn_partial, engine.k_cache, engine.v_cache,
                *engine.work.values()])
    kv = engine.generate(PROMPT, NEW, attend=gpt2.reference_attend, kv_cache=True, graph=False)
    print(f"  {name}: KV-cache tokens {kv.tokens} (plain per-operation launches)", flush=True)
    problems = out_of_range(kv.tokens, config.vocab_size) + not_finite(cp, x=engine.x, qkv=engine.qkv, y=engine.y,
                                                                       g=engine.g)
    engine.fn["spin"]((1,), (1,), (np.int64(1000),))
    gemm = dtype == "float32" and engine.products == "3xtf32"
    if gemm:
        nocache = engine.generate(PROMPT, NEW, attend=gpt2.reference_attend, kv_cache=False)
        same = "the same" if nocache.tokens == kv.tokens else "not the KV-cache run's (a near tie?)"
        print(f"  {name}: no-cache tokens {nocache.tokens}, {same} (gemm.cu, 3xTF32)", flush=True)
        problems += out_of_range(nocache.tokens, config.vocab_size) + not_finite(cp, x=engine.work["x"][:longest])
    else:
        print(f"  {name}: no gemm.cu ({engine.products} products; the no-cache mode runs in float32)", flush=True)
    print(f"{MARK}covers {name} {' '.join(launched_files('fused', config, dtype, gemm))}", flush=True)
    return problems


def persistent_step(cp, name, fast, params, config, dtype, ring: int | None, reduce: bool = False
                    ) -> list[str] | str:
    """A prefill, then NEW tokens from one launch of decode_step.cu (with `ring` slots, where given; with the
    heads' terms summed per block where `reduce`)."""
    import gpt2

    engine = fast.Engine(params, config, dtype=dtype, pdl=False, step_ring=ring,  # persistent where it runs
                         step_reduce=reduce or None)
    if not engine.persistent:
        return f"skipped: the persistent step is {engine.persistent_note}"
    poison(cp, [engine.x])
    out = engine.generate(PROMPT, NEW, attend=gpt2.reference_attend, kv_cache=True)
    print(f"  {name}: tokens {out.tokens} (decode_step.cu, {engine.plan.blocks} blocks, {engine.plan.splits} "
          f"key splits a head, {engine.plan.slots} slots, REDUCE_HEADS {engine.step.reduce_heads})", flush=True)
    print(f"{MARK}covers {name} {' '.join(launched_files('step', config, dtype, gemm=False))}", flush=True)
    return out_of_range(out.tokens, config.vocab_size) + not_finite(cp, x=engine.x)


def llama_config():
    """Llama 3.2 1B's widths, heads and RoPE, two of its layers and a vocabulary of 8,192 (the head's
    kernel is the same at any length)."""
    from dataclasses import replace

    import llama

    return replace(llama.SIZES["llama-3.2-1b"], num_hidden_layers=2, vocab_size=8192)


def llama_step(cp, name: str, dtype: str) -> list[str]:
    """A prefill (the eager forward), then NEW tokens from llama.fast's decode step, plain launches."""
    import llama
    import llama.fast as fast
    from gpt2 import reference_attend

    config = llama_config()
    params = host_drawn(cp, llama.random_weights(config, seed=0).params, dtype)
    params = fast.decode_layout(params, config)
    engine = fast.Engine(params, config, dtype=dtype, max_len=256, pdl=False)
    poison(cp, [engine.x, engine.q, engine.y, engine.g, engine.attn_partial])
    out = engine.generate(PROMPT, NEW, attend=reference_attend, graph=False)
    print(f"  {name}: tokens {out.tokens} (llama.fast, plain launches)", flush=True)
    print(f"{MARK}covers {name} {' '.join(launched_files('llama', config, dtype, gemm=False))}", flush=True)
    return out_of_range(out.tokens, config.vocab_size) + not_finite(cp, x=engine.x)


def training_pass(cp, name: str, dtype: str) -> list[str]:
    """loss_and_grads with the fused kernels (train.cu's) against the array code, on one batch; then
    AdamW's multi-tensor steps on its gradients (adamw_steps)."""
    from dataclasses import replace

    import gpt2
    from gpt2.backward import Attention, loss_and_grads

    config = replace(gpt2.GPT2Config(n_layer=1), vocab_size=1000)  # one layer launches every kernel: half the time under racecheck
    params = host_drawn(cp, gpt2.random_weights(config, seed=0).params)
    idx, targets = cp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 2, 97)))
    want, want_grads = loss_and_grads(params, config, idx, targets, Attention.reference(), dtype)
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    loss, grads = loss_and_grads(params, config, idx, targets, Attention.reference(), dtype, fused=True)
    worst = max(float(cp.linalg.norm(grads[k] - want_grads[k]) / cp.linalg.norm(want_grads[k])) for k in grads)
    print(f"  {name}: train.cu loss {loss:.5f} (array code {want:.5f}), worst gradient |fused - array| / "
          f"|array| = {worst:.1e}", flush=True)
    problems = not_finite(cp, **grads)
    if not abs(loss - want) <= tolerance * abs(want) or not worst <= tolerance:
        problems.append(f"train.cu: loss {loss} or gradients (worst {worst:.1e}) off the array code's by more "
                        f"than {tolerance}")
    print(f"{MARK}covers {name} {' '.join(launched_files('train', config, dtype, gemm=False))}", flush=True)
    return problems + adamw_steps(cp, name, params, grads)


def adamw_steps(cp, name: str, params: dict, grads: dict) -> list[str]:
    """Two multi-tensor AdamW steps on the pass's gradients, clipped (max_norm far below their norm) and
    not, against the per-tensor path scaled by the multi-tensor norm's coefficient: the same bits."""
    from lm.adamw import AdamW

    got, want = ({k: p.copy() for k, p in params.items()} for _ in range(2))
    multi, per_tensor, problems = AdamW(got, multi_tensor=True), AdamW(want, multi_tensor=False), []
    for max_norm in (1e-3, 1e6):
        ref_grads = {k: g.copy() for k, g in grads.items()}
        norm = multi.step(got, grads, 6e-4, max_norm=max_norm)
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for g in ref_grads.values():
                g *= np.float32(coef)
        per_tensor.step(want, ref_grads, 6e-4)
        differ = [k for k in got if not bool((got[k].view(cp.uint32) == want[k].view(cp.uint32)).all())]
        print(f"  {name}: multi-tensor AdamW, max_norm {max_norm:g} (norm {norm:.5g}): {len(differ)} of {len(got)} "
              "tensors differ from the per-tensor path's", flush=True)
        if differ:
            problems.append(f"multi-tensor AdamW at max_norm {max_norm:g}: {', '.join(differ[:3])} differ")
    return problems


PREFILL = ("embed", "add_layernorm", "bias", "bias_gelu", "kv_store", "merge_heads", "lm_head")  # engine.sequence's


def launched_files(kind: str, config, dtype: str, gemm: bool) -> list[str]:
    """The kernels/fused files an engine target's workload launches (gpt2/fast/plan.py's expressions, by
    key): a fused target every kernel but decode_step (gemm.cu's too where it runs the no-cache mode), a
    step target the prefill's and decode_step, a train target train.cu and adamw.cu."""
    import gpt2.fast as fast

    if kind == "train":
        return ["adamw", "train"]
    if kind == "llama":
        import llama.fast

        return sorted({file for file, _ in llama.fast.kernel_expressions(config, dtype).values()})
    own = fast.kernel_expressions(config, dtype)
    expressions = {**own, **fast.gemm_expressions()}
    if kind == "step":
        keys = [*PREFILL, "decode_step"]
    else:
        keys = [key for key in own if key != "decode_step"] + (list(fast.gemm_expressions()) if gemm else [])
    return sorted({expressions[key][0] for key in keys})


# -- the process -----------------------------------------------------------------------------------


def with_line_info(function):
    """kernels.fused.function compiling with -lineinfo too."""
    def compile_with_lines(name, expression, options=()):
        return function(name, expression, options=(*options, "-lineinfo"))

    return compile_with_lines


def run(cp, name: str, quick: bool, tool: str | None = None) -> str:
    from kernels import backward, triton

    if name in ENGINE:
        return engine_target(cp, name)
    if backward.owns(name):
        return backward_rung(cp, name, quick)
    if triton.owns(name):
        return triton_rung(cp, name, quick)
    return forward_rung(cp, name, quick, tool)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="+", help="target names (tools/sanitize.py --list)")
    parser.add_argument("--quick", action="store_true", help="one shape a rung: the awkward one")
    parser.add_argument("--tool", help="the compute-sanitizer tool this process runs under (tools/sanitize.py "
                                       "passes it): under synccheck, where that tool is sound")
    args = parser.parse_args(argv)
    import cupy as cp

    from kernels import fused

    fused.function = with_line_info(fused.function)  # the engine compiles through this module attribute
    # The child's first random draws, before any target. On a fresh machine initcheck reported some
    # 10^5 reads of unwritten memory in CuPy's own elementwise multiply during a child's first target
    # (v20, v21 or fused-bfloat16, whichever came first) and none in the same targets later in the
    # process, nor on a second run: what CuPy does first in a process is not a rung's to answer for.
    print(f"{MARK}begin {SETUP}", flush=True)
    cp.random.standard_normal(4097, dtype=cp.float32)
    cp.random.default_rng(0).standard_normal(4097, dtype=cp.float32) * 0.02
    cp.cuda.Device().synchronize()
    time.sleep(0.1)
    print(f"{MARK}end {SETUP} ok", flush=True)
    failures = 0
    for name in args.targets:
        print(f"{MARK}begin {name}", flush=True)
        try:
            status = run(cp, name, args.quick, args.tool)
            cp.cuda.Device().synchronize()
        except Exception as exc:
            traceback.print_exc(file=sys.stdout)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"{MARK}end {name} failed: {type(exc).__name__}: {first}", flush=True)
            return 2
        time.sleep(0.1)  # the tool's reports of the target's last launches print before its end line
        print(f"{MARK}end {name} {status}", flush=True)
        failures += not (status == "ok" or status.startswith("skipped"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
