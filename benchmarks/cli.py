"""The command line: bench.py's subcommands, their flags, and main()."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import kernels
from kernels import backward as backward_rungs
from kernels import triton as triton_rungs

from . import compare, frontier, results
from .backward import CASE_SETS as BACKWARD_CASES
from .backward import DEFAULT_CASES as BACKWARD_DEFAULT
from .backward import cmd_backward
from .cases import DTYPES
from .device import CannotRun
from .e2e import PROMPT, cmd_e2e
from .features import FEATURE_PARTS, cmd_features
from .fp8 import add_fp8_parser, cmd_fp8
from .levels import LEVELS, SHAPE_SETS, cmd_levels
from .options import kernel_list, parse_shape, results_option
from .peers import DEFAULT_PEERS, PEERS
from .profile import add_profile_parser, cmd_profile
from .readme import DECODE_DOC, LEVELS_DOC, README, RESULTS_DOC, TRAINING_DOC, cmd_readme
from .resources import cmd_resources
from .results import E2E_MODEL, E2E_MODELS
from .rungs import cmd_kernels
from .sass import add_sass_parser, cmd_sass
from .scale import PREFILL_TOKENS, cmd_scale
from .scale import SIZES as SCALE_SIZES
from .sweep import cmd_sweep
from .train import cmd_train


def fail(message: str) -> int:
    """One line on stderr; exit status 2 (the user's to fix: a missing GPU, a bad file)."""
    print(f"bench.py: {message}", file=sys.stderr, flush=True)
    return 2


def rung_list(text: str) -> list[Path]:
    """kernel_list's names, items of a comma-separated list, plus the Triton rungs: t01 (kernels.triton.resolve:
    t1, t01, t01_fa2, or a .py path); 'all' is the .cu ladder, 'triton' the Triton family: 'v18,v19,t01', 'all,triton'."""
    paths = []
    try:
        for item in (s.strip() for s in text.split(",") if s.strip()):
            if item == "all":
                paths += [kernels.resolve(n) for n in kernels.names()]
            elif item == "triton":
                paths += [triton_rungs.resolve(n) for n in kernels.triton_names()]
            else:
                paths.append(triton_rungs.resolve(item) if triton_rungs.owns(item) else kernels.resolve(item))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return paths


def backward_list(text: str) -> list[str]:
    """'b01,b3' -> backward rungs (kernels.backward.resolve: b1, b01, b01_naive, or a .cu path): the ladder's
    by name, others by path."""
    try:
        paths = [backward_rungs.resolve(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return [p.stem if p.parent == backward_rungs.BACKWARD_DIR else str(p) for p in paths]


def peer_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(unknown)}: choose from {', '.join(PEERS)} "
                                         "(or none)")
    return names


def sdpa_peer_list(text: str) -> list[str]:
    """'sdpa_flash,sdpa_cudnn' -> SDPA's backends, each once (`backward` times their backward); 'none'."""
    if text.strip() == "none":
        return []
    return _choices(text, [p for p in PEERS if PEERS[p].backend], "SDPA peer", " (or none)")


def _choices(text: str, allowed, what: str, extra: str = "") -> list[str]:
    """'a,b' -> the names given, each once, in order; an argparse error names the unknown ones."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown) or repr(text)}: choose from "
                                         f"{', '.join(allowed)}{extra}")
    return list(dict.fromkeys(names))


def part_list(text: str) -> list[str]:
    """'decode,gqa' -> the features parts, in the order given; 'all' for every part."""
    return list(FEATURE_PARTS) if text.strip() == "all" else _choices(text, FEATURE_PARTS, "part", " (or all)")


def dtype_list(text: str) -> list[str]:
    return _choices(text, DTYPES, "dtype")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {text!r}")
    return value


def arch_name(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}[a-z]?", text):
        raise argparse.ArgumentTypeError(f"architecture must look like sm_90 (or sm_80, sm_90a), got {text!r}")
    return text


def build_parser(doc: str) -> argparse.ArgumentParser:
    """The parser; `doc` (bench.py's docstring) gives its description and epilog."""
    parser = argparse.ArgumentParser(prog="bench.py", description=doc.split("\n\n")[0],
                                     epilog="\n\n".join(doc.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{kernels,sweep,e2e,resources,features,frontier,fp8,profile,levels,backward,train,readme}")

    def shape_options(p, budget_ms):
        p.add_argument("--kernels", type=rung_list, default=None, metavar="LIST",
                       help="rungs, comma-separated (v05,v12 or a .cu path; Triton rungs: t01, or 'triton' for all "
                            "of them; 'all': the .cu ladder); default: every .cu rung")
        p.add_argument("--peers", type=peer_list, default=None, metavar="LIST",
                       help=f"peers from {', '.join(PEERS)} or none; default float32: "
                            f"{','.join(DEFAULT_PEERS['float32'])}; bfloat16/float16: {','.join(DEFAULT_PEERS['bfloat16'])}")
        p.add_argument("--nh", type=positive_int, default=12, help="heads (default 12)")
        p.add_argument("--d", type=positive_int, default=64, help="head size (default 64)")
        p.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="input dtype; rungs that do not take it are reported unsupported (default float32)")
        p.add_argument("--budget-ms", type=float, default=budget_ms,
                       help=f"GPU time to spend on the timed runs of each entry (default {budget_ms:g}; 10-200 runs)")
        p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
        results_option(p)

    k = sub.add_parser("kernels", help="every rung x shapes beside the peers: ms, TFLOP/s, %% of ceiling, speed-ups",
                       description="Every rung x shapes (default the five GPT-2 shapes, NH=12, d=64), each checked "
                                   "against a float64 reference, then timed beside the CuPy reference and torch SDPA.")
    k.add_argument("--shape", type=parse_shape, action="append", metavar="BxT",
                   help="batch x sequence length, repeatable (default: 1x512 8x1024 16x2048 6x4096 1x8192)")
    shape_options(k, 300.0)

    s = sub.add_parser("sweep", help="TFLOP/s against sequence length, with a PNG plot",
                       description="TFLOP/s against T (powers of two from --t-min to --t-max) with B = --tokens // T, "
                                   "for chosen rungs and peers; a PNG plot (matplotlib) beside the JSON.")
    s.add_argument("--t-min", type=power_of_two, default=128, help="shortest T, a power of two (default 128)")
    s.add_argument("--t-max", type=power_of_two, default=16384, help="longest T, a power of two (default 16384)")
    s.add_argument("--tokens", type=positive_int, default=16384, help="B x T per point: B = tokens // T (default 16384)")
    s.add_argument("--noncausal", action="store_true", help="attention without the mask (default: causal)")
    shape_options(s, 150.0)

    e = sub.add_parser("e2e", help="seconds for GPT-2 small (or Llama) to generate 512 tokens, per rung, beside HF "
                                   "transformers",
                       description="Seconds to generate --tokens tokens greedily from the prompt with --model (random "
                                   "weights in its family's dtype: GPT-2 float32, Llama bfloat16), with the CuPy "
                                   "reference and each rung that takes the model as the attention, without and with "
                                   "a KV cache; HF transformers generate() on the same weights, with a static cache.")
    e.add_argument("--model", choices=list(E2E_MODELS), default=None,
                   help=f"gpt2 (GPT-2 small, float32) or a Llama size (random weights, bfloat16); default {E2E_MODEL}")
    e.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs, comma-separated; default: every rung that takes the model (the CuPy reference "
                        "always runs)")
    e.add_argument("--tokens", type=positive_int, default=512, help="new tokens (default 512)")
    e.add_argument("--prompt", default=None, help=f"text through the model's tokenizer, default {PROMPT!r} (random "
                                                  "Llama weights have none: their prompt is fixed token ids)")
    mode = e.add_mutually_exclusive_group()
    mode.add_argument("--kv-cache", dest="mode", action="store_const", const="kv-cache",
                      help="only the KV-cache mode (default: both modes)")
    mode.add_argument("--no-cache", dest="mode", action="store_const", const="no-cache",
                      help="only the no-cache mode, the seed's setup (default: both modes)")
    e.set_defaults(mode="both")
    e.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    e.add_argument("--no-decode", action="store_true",
                   help="leave out the decode table (gpt2.fast in float32 and bfloat16 with each decode step; "
                        "GPT-2 only)")
    e.add_argument("--hf-attn", choices=("sdpa", "eager"), default="sdpa",
                   help="the HF model's attn_implementation (default sdpa)")
    e.add_argument("--warmup", type=positive_int, default=64,
                   help="tokens of the warm-up generation (default 64: two of the persistent step's windows)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    e.add_argument("--sizes", type=size_list, default=None, metavar="LIST",
                   help=f"decode at scale: these model sizes ({', '.join(SCALE_SIZES)}, or all), each loaded as "
                        "lab.py --random-weights loads it, one KV-cache generation per size and dtype (decode "
                        "tokens/s against the bandwidth floor, peak memory against its bound, time to first token "
                        "of a --prefill-tokens prompt) beside HF transformers (bf16, static cache); writes a scale "
                        "result (docs/decode.md)")
    e.add_argument("--dtypes", type=lambda t: _choices(t, ("bfloat16", "float32"), "dtype"), default=None,
                   metavar="LIST", help="with --sizes: the dtypes of every size (default: bfloat16,float32 for "
                                        "GPT-2, bfloat16 for Llama)")
    e.add_argument("--prefill-tokens", type=positive_int, default=PREFILL_TOKENS,
                   help=f"with --sizes: the prompt whose first token is timed (default {PREFILL_TOKENS})")
    results_option(e)

    r = sub.add_parser("resources", help="registers, shared memory, spills, blocks per SM of every rung and config",
                       description="Every rung and configuration: registers, shared memory, stack, spills (ptxas "
                                   "through NVRTC), and resident blocks per SM on a device. Without a GPU, or with "
                                   "--arch, compiles for that architecture (default sm_90) with no device.")
    r.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST", help="default: every rung")
    r.add_argument("--arch", type=arch_name, default=None, help="compile for this architecture (sm_90) with NVRTC")
    results_option(r)

    f = sub.add_parser("features", help="decode, long-context decode, non-causal, cross lengths, GQA and head "
                                        "sizes on the rungs that declare them, beside torch SDPA",
                       description="The attention features past causal self-attention, each case checked against "
                                   "a float64 reference, then timed beside torch SDPA (float32 against SDPA "
                                   "efficient, bfloat16/float16 against SDPA flash): GPT-2 decode (B=1, NH=12, d=64, "
                                   "one query over T_k = 1, 128, 512, 1024 keys; CUPTI kernel time per call with "
                                   "independent caches in rotation, and per call in a CUDA graph; target <= 5 us), "
                                   "long-context decode (B=16, NH=32, d=128, T_k=4096; TB/s of K+V against the copy "
                                   "ceiling; target >= 75%), non-causal (B=4, NH=12, T=2048, d=64), cross lengths "
                                   "(T_q=256 over T_k=4096, causal bottom-right), grouped-query heads (B=4, NH=32, "
                                   "NH_kv=8, T=2048, d=128) and head sizes 32/64/96/128 (B=8, NH=12, T=1024). "
                                   "The defaults are sized for about 3 minutes of GPU time, compilation aside; "
                                   "--parts, --dtypes and --budget-ms trim it.")
    f.add_argument("--parts", type=part_list, default=list(FEATURE_PARTS), metavar="LIST",
                   help=f"parts to run, comma-separated, from {', '.join(FEATURE_PARTS)} (default: all)")
    f.add_argument("--kernels", type=kernel_list, default=None, metavar="LIST",
                   help="rungs to try in every case (those that do not take a case are reported unsupported); "
                        "default: the rungs declaring lab.supports or lab.split_kv, each in the cases it declares "
                        "(decode: the split-KV rungs and the newest other rung; long context: the split-KV rungs)")
    f.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"], metavar="LIST",
                   help="dtypes of decode and of the general features (default float32,bfloat16); long context "
                        "runs bfloat16 and whichever of float32, float16 its rungs declare")
    f.add_argument("--budget-ms", type=float, default=100.0,
                   help="GPU time for the timed runs of each event-timed entry (default 100; 10-200 runs)")
    f.add_argument("--caches", type=positive_int, default=24,
                   help="decode: independent caches the calls rotate through, so that L2 does not hold K/V "
                        "(default 24)")
    f.add_argument("--reps", type=positive_int, default=10,
                   help="decode: passes through the caches, profiled and captured as one graph (default 10)")
    f.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    results_option(f)

    ids, t = frontier.case_ids(), frontier
    fr = sub.add_parser("frontier", help="bfloat16 at the frontier's shapes: the newest rungs beside SDPA flash and "
                                         "SDPA cuDNN, against the targets",
                        description="The Hopper frontier in bfloat16: the GPT-2 shapes, d=128 (with grouped-query "
                                    "heads) and non-causal, each checked against float64 then timed as `kernels` "
                                    "times, the chosen rungs beside SDPA flash (FlashAttention-2) and SDPA cuDNN in "
                                    "the same run; per shape the best rung's speed-up over cuDNN, marked met or "
                                    f"missed against the targets (>= {t.VS_CUDNN:g}x cuDNN at T >= {t.VS_CUDNN_FROM_T}"
                                    + "".join(f"; >= {v:g} TFLOP/s at {k}" for k, v in t.TFLOPS_TARGETS.items())
                                    + f"). Shapes (B x NH x T, d): {', '.join(ids)}.")
    fr.add_argument("--kernels", type=rung_list, default=None, metavar="LIST",
                    help="rungs, comma-separated, each tried at every shape (those that do not take one are "
                         "reported unsupported); default: the rungs on TMA (lab.tma) and the newest bfloat16 rung "
                         "before them, each at the shapes it declares")
    fr.add_argument("--shapes", type=lambda text: ids if text.strip() == "all" else _choices(text, ids, "shape",
                                                                                              " (or all)"),
                    default=None, metavar="LIST", help="shapes to run, comma-separated, by name (default: all)")
    fr.add_argument("--budget-ms", type=float, default=300.0,
                    help="GPU time to spend on the timed runs of each entry (default 300; 10-200 runs)")
    fr.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    fr.add_argument("--interleave", action="store_true",
                    help="time a shape's rungs together, a run of each per round, the order rotated (the peers one "
                         "after another as usual): a clock the GPU holds for some milliseconds then falls on every "
                         "rung alike, and bench.py compare pairs the rungs' times round by round")
    results_option(fr)

    add_fp8_parser(sub)
    add_profile_parser(sub)
    add_sass_parser(sub)

    lv = sub.add_parser("levels", help="seed 004's four levels on one problem: plain PyTorch, torch.compile, "
                                       "Triton, CUDA, beside SDPA; TFLOP/s and lines of code",
                        description="The plain PyTorch attention (eager; torch.compile default and "
                                    "max-autotune-no-cudagraphs), the newest Triton rung, the fastest CUDA rung "
                                    "that takes the case, and SDPA's kernels, at the five GPT-2 shapes and two d=128 "
                                    "shapes, each checked against float64 then timed as `kernels` times; lines of "
                                    "code per level counted from the sources; a table per dtype and a PNG plot. "
                                    "torch.compile's max-autotune compiles for minutes: --dtypes, --shapes and "
                                    "--levels split or trim the run.")
    lv.add_argument("--dtypes", type=dtype_list, default=["float32", "bfloat16"], metavar="LIST",
                    help="default float32,bfloat16")
    lv.add_argument("--shapes", type=lambda t: _choices(t, SHAPE_SETS, "shape set"), default=list(SHAPE_SETS),
                    metavar="LIST", help=f"from {', '.join(SHAPE_SETS)} (default: both)")
    lv.add_argument("--levels", type=lambda t: _choices(t, LEVELS, "level"), default=list(LEVELS), metavar="LIST",
                    help=f"from {', '.join(LEVELS)} (default: all)")
    lv.add_argument("--budget-ms", type=float, default=100.0,
                    help="GPU time for the timed runs of each entry (default 100; 10-200 runs)")
    lv.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    results_option(lv)

    bw = sub.add_parser("backward", help="every backward rung beside SDPA's backward: ms, TFLOP/s (2.5 x the "
                                         "forward's FLOPs), speed-ups, errors",
                        description="Every backward rung (kernels/backward/) beside SDPA's backward (float32: "
                                    "efficient; bfloat16/float16: flash and cuDNN) in the same run, at the five GPT-2 "
                                    "shapes (causal, NH=12, d=64), at d=128 and without the mask. Each case runs the "
                                    "newest forward rung that writes the log-sum-exp, checks every backward's "
                                    "gradients against float64 (FlashAttention's rule), then times what is right. "
                                    "FLOPs: 2.5 x the forward's.")
    bw.add_argument("--kernels", type=backward_list, default=None, metavar="LIST",
                    help="backward rungs, comma-separated (b01,b03 or a .cu path); default: every backward rung "
                         "that declares --dtype")
    bw.add_argument("--peers", type=sdpa_peer_list, default=None, metavar="LIST",
                    help="SDPA backends from sdpa_math, sdpa_efficient, sdpa_flash, sdpa_cudnn or none; default "
                         "float32: sdpa_efficient; bfloat16/float16: sdpa_flash,sdpa_cudnn")
    bw.add_argument("--dtype", choices=DTYPES, default="float32", help="input dtype (default float32)")
    bw.add_argument("--cases", type=lambda t: _choices(t, BACKWARD_CASES, "case set"), default=list(BACKWARD_DEFAULT),
                    metavar="LIST", help=f"case sets from {', '.join(BACKWARD_CASES)} (default: "
                                         f"{','.join(BACKWARD_DEFAULT)}; gqa and long at d=128 asked for)")
    bw.add_argument("--budget-ms", type=float, default=200.0,
                    help="GPU time to spend on the timed runs of each entry (default 200; 10-200 runs)")
    bw.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    bw.add_argument("--interleave", action="store_true",
                    help="time a case's rungs together, a run of each per round, the order rotated (the peers one "
                         "after another as usual), as bench.py frontier --interleave: bench.py compare then pairs "
                         "the rungs' times round by round")
    results_option(bw)

    tr = sub.add_parser("train", help="GPT-2 small training steps per backward rung beside PyTorch eager and "
                                      "torch.compile: tokens/s, MFU, peak memory; a loss-curve plot",
                        description="GPT-2 small (random weights) training steps, train.py's (forward, backward, "
                                    "clipping, AdamW), at B x T = 16 x 1024 and the largest B that fits, one row "
                                    "per backward rung that takes the dtype, beside a nanoGPT-style PyTorch GPT-2 "
                                    "(SDPA, bf16 autocast, fused AdamW) eager and under torch.compile; tokens/s, "
                                    "MFU against the run's GEMM ceiling, peak memory; float32 with TF32 off. Then "
                                    "a short run's losses (lab and PyTorch on the same batches) for a plot.")
    tr.add_argument("--dtypes", type=lambda t: _choices(t, ("bfloat16", "float32"), "dtype"),
                    metavar="LIST", help="default bfloat16,float32 (--quick: bfloat16)")
    tr.add_argument("--quick", action="store_true",
                    help="B = 16 only, 5 timed steps a row, no loss curve: a check of every row in a few minutes "
                         "(docs keep the newest full run)")
    tr.add_argument("--max-batch", type=power_of_two, default=64,
                    help="the largest B tried for the second batch size, a power of two (default 64)")
    tr.add_argument("--curve-steps", type=int, default=100,
                    help="steps of the loss curve (bfloat16; default 100; 0: none)")
    tr.add_argument("--budget-ms", type=float, default=3000.0,
                    help="GPU time for the timed steps of each row (default 3000; 5-50 steps)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    results_option(tr)

    c = sub.add_parser("compare", help="a before/after from result files: rungs' times over a baseline's, case by "
                                        "case, in each run, and whether they clear the runs' spread",
                       description="Read two or more result files of one benchmark (runs of a before/after, the "
                                   "rungs' order rotated between them) and print a Markdown table: per case, the "
                                   "baseline's median time over each rung's in every run, and 'faster' or "
                                   "'slower' only where every run's ratio is off 1x by more than the largest p20-p80 "
                                   "spread of the two rungs' rows. A page carries it between <!-- "
                                   "bench:compare-NAME:start/end --> markers; bench.py readme reruns the command its "
                                   "first line names. Needs no GPU.")
    c.add_argument("files", nargs="+", help="result files (results/backward-*.json, results/kernels-*.json, ...)")
    c.add_argument("--of", required=True, type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   metavar="LABELS", help="the rungs compared, as their rows are labelled (b07_persistent, or "
                                          "'b06_wide_query_tiles deterministic'), comma-separated")
    c.add_argument("--over", required=True, metavar="LABEL", help="the baseline rung, as its rows are labelled")

    m = sub.add_parser("readme", help="rewrite the tables of README.md and docs/results.md between their markers",
                       description="Rewrite what lies between <!-- bench:<section>:start --> and "
                                   "<!-- bench:<section>:end --> in README.md (sections summary, e2e-summary: the "
                                   "best rung per precision against its peers, the frontier's verdict, the sweep "
                                   "plots, the end-to-end summary) and in docs/results.md (sections kernels, sweep: "
                                   "the newest of each dtype and head size, e2e, resources, features, frontier, fp8: the "
                                   "full tables) and in docs/profile.md (section profile: the newest profile of each "
                                   "dtype, with its roofline) and in docs/ladder.md (section counters: a short row of "
                                   "the profile's counters per rung), each from the newest result file of its kind in "
                                   "--results; nothing outside the markers changes. Exits 2, rewriting none, if a "
                                   "file is missing or has no markers.")
    m.add_argument("--readme", type=Path, default=README, help="default: README.md beside bench.py")
    m.add_argument("--results-doc", type=Path, default=RESULTS_DOC,
                   help="the full tables' page (default: docs/results.md beside bench.py)")
    m.add_argument("--profile-doc", type=Path, default=None,
                   help="the profile page (default: profile.md beside --results-doc, docs/profile.md)")
    m.add_argument("--ladder-doc", type=Path, default=None,
                   help="the ladder's page, whose counters section the profile results fill when it exists "
                        "(default: ladder.md beside --results-doc, docs/ladder.md)")
    m.add_argument("--results", type=Path, default=results.RESULTS, metavar="DIR",
                   help="where to read the result files (default: results/ beside bench.py)")
    m.add_argument("--levels-doc", type=Path, default=LEVELS_DOC,
                   help="the four levels' page, rewritten when there are levels results (default: docs/levels.md)")
    m.add_argument("--decode-doc", type=Path, default=DECODE_DOC,
                   help="the decode page, whose scale section is rewritten when there are scale results (bench.py "
                        "e2e --sizes; default: docs/decode.md)")
    m.add_argument("--training-doc", type=Path, default=TRAINING_DOC,
                   help="the training page, whose train section is rewritten when there are train results (bench.py "
                        "train; default: docs/training.md)")
    m.add_argument("--replot", action="store_true",
                   help="also redraw the newest sweep, e2e and scale plots and the rooflines shown from their JSON (after a "
                        "change to the plotting)")
    return parser


def size_list(text: str) -> list[str]:
    """'gpt2,llama-3.2-1b' -> the sizes, in the order given; 'all' for every size."""
    return list(SCALE_SIZES) if text.strip() == "all" else _choices(text, SCALE_SIZES, "size", " (or all)")


def cmd_e2e_model(args) -> int:
    if args.sizes:
        return cmd_scale(args)
    args.model = args.model or E2E_MODEL
    return cmd_e2e(args)


COMMANDS = {"kernels": cmd_kernels, "sweep": cmd_sweep, "e2e": cmd_e2e_model, "resources": cmd_resources,
            "features": cmd_features, "frontier": frontier.cmd_frontier, "fp8": cmd_fp8, "profile": cmd_profile,
            "sass": cmd_sass, "levels": cmd_levels,
            "backward": cmd_backward, "compare": compare.cmd_compare,
            "train": cmd_train,
            "readme": cmd_readme}


def main(argv: list[str] | None, doc: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(doc)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command == "e2e" and args.sizes and (args.model is not None or args.kernels is not None
                                                 or args.mode != "both" or args.prompt is not None):
        parser.error("--sizes runs each size with the newest rung that takes it, a KV cache and fixed prompts: "
                     "leave out --model, --kernels, --kv-cache, --no-cache and --prompt")
    if args.command == "e2e" and not args.sizes and (args.dtypes or args.prefill_tokens != PREFILL_TOKENS):
        parser.error("--dtypes and --prefill-tokens go with --sizes")
    if getattr(args, "kernels", False) is None and args.command not in ("e2e", "features", "frontier", "fp8",
                                                                          "profile", "sass", "backward"):
        # e2e takes the rungs that take its model; features and frontier pick per case, fp8 takes the FP8 rungs;
        # profile takes every rung and reports those it cannot run as skipped;
        # backward runs the backward ladder (benchmarks/backward.py picks those that take the dtype)
        # decode rungs (split-KV) are made for a few query rows over a long cache, not whole sequences:
        # they are timed only when named (and by tests/test_decode_gpu.py's timing on decode shapes);
        # FP8 rungs quantize their inputs, and bench.py fp8 holds them to their own accuracy
        whole = args.command == "resources"
        dtype = getattr(args, "dtype", "float32")
        args.kernels = [kernels.resolve(n) for n in (kernels.names() if whole else kernels.rungs_for(dtype, unverified=True))]
    if args.command == "sweep" and args.t_min > args.t_max:
        parser.error(f"--t-min {args.t_min} is larger than --t-max {args.t_max}")
    try:
        return COMMANDS[args.command](args)
    except CannotRun as exc:
        return fail(f"{args.command}: {exc}")
