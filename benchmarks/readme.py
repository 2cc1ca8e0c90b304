"""`bench.py readme`: rewrite what lies between <!-- bench:<section>:start --> and <!-- bench:<section>:end -->
in README.md (summary, e2e-summary: the short tables), docs/results.md (kernels, sweep, e2e, resources,
features, frontier, fp8, backward: the full tables), docs/profile.md (profile: the counters and the roofline),
docs/ladder.md (counters: a short row of them per rung) and docs/decode.md (scale: decode at scale,
bench.py e2e --sizes), each section from the newest result file of its kind. Any page may carry any section; every block links the result files
behind it, relative to the page."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from . import plots, profile_render
from .backward import newest_per_dtype as newest_backward
from .backward import render_backward
from .compare import rewrite_compare_sections
from .device import ROOT, CannotRun, progress
from .fp8 import render_fp8
from .fp8_envelope import render_envelope_doc
from .frontier import render_frontier
from .levels import newest_per_dtype as newest_levels
from .levels import render_levels
from .results import SECTIONS, e2e_model, load_result, newest_results
from .sanitize_report import newest_per_group, render_sanitize
from .scale import render_scale
from .summary import gpt2_shapes_in, has_gpt2_shapes, link, render_e2e_summary, render_models_summary, render_summary
from .tables import render_e2e, render_features, render_kernels, render_resources, render_sweep
from .train import newest_per_dtype as newest_train
from .train import render_train
from .watch_report import render_demo

README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
LEVELS_DOC = ROOT / "docs" / "levels.md"  # seed 004's four levels: rewritten when there are levels results
SUMMARIES = ("summary", "e2e-summary")  # the README's short tables
PROFILE = ("profile",)  # docs/profile.md's section
COUNTERS = ("counters",)  # docs/ladder.md's: the profile's counters, one short row per rung
FRONTIER_COUNTERS = ("frontier-counters",)  # docs/results.md's: the counters at the frontier's shapes
DECODE_DOC = ROOT / "docs" / "decode.md"  # decode at scale (bench.py e2e --sizes): rewritten when there are results
TRAINING_DOC = ROOT / "docs" / "training.md"  # bench.py train's table and loss curve: rewritten when there are results
WATCH_DOC = ROOT / "docs" / "watch.md"  # watch mode's save-to-report times (tools/watch_demo.py's output files)
BACKWARD_PROFILE = ("backward-profile",)  # docs/backward.md's: bench.py profile --backward's table, phase by phase
FULL_TABLES = tuple(s for s in SECTIONS if s not in PROFILE + ("levels", "scale", "train"))  # docs/results.md's
SANITIZE = ("sanitize",)  # docs/ladder.md's: the sanitizer's full run (tools/sanitize.py --json files)
KNOWN = SUMMARIES + SECTIONS + COUNTERS + FRONTIER_COUNTERS + ("watch",) + SANITIZE + BACKWARD_PROFILE

_MARKER = re.compile(r"<!--\s*bench:([A-Za-z0-9_-]+):(start|end)\s*-->")


def find_sections(text: str) -> dict[str, tuple[int, int]]:
    """{section: (end of its start marker, start of its end marker)}; ValueError on a malformed pair."""
    starts, ends = {}, {}
    for m in _MARKER.finditer(text):
        name, edge = m.groups()
        if name not in KNOWN and not name.startswith("compare-"):  # compare-NAME: bench.py compare's, any NAME
            raise ValueError(f"unknown section {name!r} in {m.group(0)} (known: {', '.join(KNOWN)})")
        marks = starts if edge == "start" else ends
        if name in marks:
            raise ValueError(f"{m.group(0)} appears twice")
        marks[name] = m
    spans = {}
    for name in sorted(set(starts) | set(ends), key=lambda n: (starts.get(n) or ends[n]).start()):
        if name not in starts or name not in ends:
            missing = "start" if name not in starts else "end"
            raise ValueError(f"<!-- bench:{name}:{missing} --> is missing")
        if ends[name].start() < starts[name].end():
            raise ValueError(f"<!-- bench:{name}:end --> comes before its start marker")
        spans[name] = (starts[name].end(), ends[name].start())
    ordered = sorted(spans.items(), key=lambda kv: kv[1])
    for (a, (_, a_end)), (b, (b_start, _)) in zip(ordered, ordered[1:], strict=False):
        if b_start < a_end:
            raise ValueError(f"section {b} starts inside section {a}")
    return spans


def replace_sections(text: str, spans: dict[str, tuple[int, int]], blocks: dict[str, str]) -> str:
    for name, (a, b) in sorted(spans.items(), key=lambda kv: kv[1], reverse=True):
        if name in blocks:
            text = text[:a] + "\n" + blocks[name].strip("\n") + "\n" + text[b:]
    return text


def newest_per_dtype(paths: list[Path], keep=lambda result: True) -> list[tuple[Path, dict]]:
    """The newest result of each dtype among `paths` (newest first) that `keep` accepts; float32 first."""
    newest: dict[str, tuple[Path, dict]] = {}
    for p in paths:
        result = load_result(p)
        if keep(result):
            newest.setdefault(result["dtype"], (p, result))
    return [newest[t] for t in sorted(newest, key=lambda t: (t != "float32", t))]


def at_frontier(result: dict) -> bool:
    """Whether a forward profile ran at bench.py frontier's shapes (--cases) rather than GPT-2's B x T."""
    return forward(result) and any("case" in shape for shape in result["shapes"])


def forward(result: dict) -> bool:
    """Whether a profile ran the forward rungs (every profile before bench.py profile --backward did)."""
    return result.get("direction", "forward") == "forward"


def newest_sweeps(paths: list[Path]) -> list[tuple[Path, dict]]:
    """The newest sweep of each dtype, head size and mask among `paths` (newest first): float32 first, then by
    dtype, head size and causal before non-causal (a bfloat16 sweep at d=64, one at d=128 and one at d=128
    without the mask are all shown)."""
    newest: dict[tuple[str, int, bool], tuple[Path, dict]] = {}
    for p in paths:
        result = load_result(p)
        newest.setdefault((result["dtype"], result["shapes"][0]["d"], not plots.sweep_causal(result)), (p, result))
    return [newest[k] for k in sorted(newest, key=lambda k: (k[0] != "float32", k))]


def summary_sweeps(paths: list[Path]) -> list[tuple[Path, dict]]:
    """The README's plots: per dtype, the newest causal sweep with a plot at GPT-2's head size (d=64, that of
    the summary's tables), else the newest with a plot; float32 first."""
    newest: dict[str, tuple[Path, dict]] = {}
    gpt2_like = lambda r: r["shapes"][0]["d"] == 64 and plots.sweep_causal(r)  # noqa: E731
    for p in paths:
        result = load_result(p)
        held = newest.get(result["dtype"])
        if result.get("plot") and (held is None or (gpt2_like(result) and not gpt2_like(held[1]))):
            newest[result["dtype"]] = (p, result)  # the newest, unless it is not GPT-2's kind and this one is
    return [newest[t] for t in sorted(newest, key=lambda t: (t != "float32", t))]


def e2e_entries(paths: list[Path]) -> list[tuple[Path, dict, set]]:
    """The newest e2e result of each model and mode (one file may serve both modes), with the modes it
    serves; GPT-2's first."""
    entries, wanted = [], {}
    for p in paths:
        result = load_result(p)
        left = wanted.setdefault(e2e_model(result), ["no-cache", "kv-cache"])
        modes = {m for m in result["modes"] if m in left}
        if modes:
            entries.append((p, result, modes))
            wanted[e2e_model(result)] = [m for m in left if m not in modes]
    return sorted(entries, key=lambda entry: e2e_model(entry[1]) != "gpt2")  # stable: newest first within a model


def readme_blocks(found: dict[str, list[Path]], base: Path) -> dict[str, str]:
    """The generated text of each section that has results, for a page in the folder `base`: the full
    tables from the newest file of their kind (kernels: of each dtype; e2e: of each mode), the summaries
    from the newest kernels result of each dtype at the five GPT-2 shapes (failing that, at some of them), a
    sweep plot per dtype (summary_sweeps) and the newest frontier result's verdict; the sweeps: the newest of
    each dtype and head size; the newest e2e result of each mode and the newest with a decode table. Each names its files twice: in an
    HTML comment, and as links a reader can follow."""
    blocks = {}

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, base)).as_posix()

    def source(*paths: Path) -> str:
        names = ", ".join(f"`{rel(p)}`" for p in paths)
        return f"<!-- generated by `python3 bench.py readme` from {names}; rerun bench.py rather than editing -->"

    def from_file(path: Path, text: str) -> str:
        return f"Results file: {link(path, base)}.\n\n{text}"

    if found["kernels"]:
        per_dtype = newest_per_dtype(found["kernels"])
        blocks["kernels"] = source(*[p for p, _ in per_dtype]) + "\n" + "\n\n".join(
            from_file(p, render_kernels(result)) for p, result in per_dtype)
        all_five = {r["dtype"]: (p, r) for p, r in newest_per_dtype(found["kernels"], has_gpt2_shapes)}
        at_gpt2 = [all_five.get(r["dtype"], (p, r)) for p, r in newest_per_dtype(found["kernels"], gpt2_shapes_in)]
        sweeps = summary_sweeps(found["sweep"])
        frontier = [(p, load_result(p)) for p in found["frontier"][:1]]
        summary = render_summary(at_gpt2, sweeps, base, frontier[0] if frontier else None)
        if summary:
            blocks["summary"] = source(*[p for p, _ in at_gpt2 + sweeps + frontier]) + "\n" + summary
    if found["sweep"]:  # the newest of each dtype and head size, each with its plot
        sweeps = newest_sweeps(found["sweep"])
        blocks["sweep"] = source(*[p for p, _ in sweeps]) + "\n" + "\n\n".join(
            f"**{result['dtype']}, d={result['shapes'][0]['d']}{'' if plots.sweep_causal(result) else ', non-causal'}**\n\n"
            + from_file(p, render_sweep(
                result, rel(p.parent / result["plot"]) if result.get("plot") else None)) for p, result in sweeps)
    if found["frontier"]:
        p = found["frontier"][0]
        blocks["frontier"] = source(p) + "\n" + from_file(p, render_frontier(load_result(p)))
    if found["fp8"]:
        p = found["fp8"][0]
        blocks["fp8"] = source(p) + "\n" + from_file(p, render_fp8(load_result(p)))
    if found["envelope"]:  # the newest FP8 accuracy envelope, with its plot
        p = found["envelope"][0]
        png = p.with_suffix(".png")
        blocks["envelope"] = source(p) + "\n" + from_file(p, render_envelope_doc(
            load_result(p), rel(png) if png.exists() else None))
    if found["e2e"]:
        entries = e2e_entries(found["e2e"])
        blocks["e2e"] = source(*[p for p, *_ in entries]) + "\n" + "\n\n".join(
            from_file(p, render_e2e([(p, result, modes)], base)) for p, result, modes in entries)
        gpt2 = [(p, r, modes) for p, r, modes in entries if e2e_model(r) == "gpt2"]
        no_cache = next(((p, r) for p, r, modes in gpt2 if "no-cache" in modes), None)
        decode = next(((p, r) for p in found["e2e"] if (r := load_result(p)).get("decode")), None)
        others = [entry for entry in entries if e2e_model(entry[1]) != "gpt2"]
        summary = "\n\n".join(text for text in (render_e2e_summary(no_cache, decode, base),
                                                 render_models_summary(others, base)) if text)
        if summary:
            used = [entry[0] for entry in (no_cache, decode) if entry is not None] + [p for p, *_ in others]
            blocks["e2e-summary"] = source(*dict.fromkeys(used)) + "\n" + summary
    if found["resources"]:
        p = found["resources"][0]
        blocks["resources"] = source(p) + "\n" + from_file(p, render_resources(load_result(p)))
    if found["features"]:
        p = found["features"][0]
        blocks["features"] = source(p) + "\n" + from_file(p, render_features(load_result(p)))
    per_dtype = newest_per_dtype(found["profile"], lambda r: forward(r) and not at_frontier(r))
    if per_dtype:  # the newest profile of each dtype at GPT-2's shapes, each with its roofline
        blocks["profile"] = "\n\n".join(
            from_file(p, profile_render.render_profile_doc(result, rel(p), rel(p.parent / result["plot"])
                                                           if result.get("plot") else None))
            for p, result in per_dtype)
        blocks["counters"] = source(*[p for p, _ in per_dtype]) + "\n" + "\n\n".join(  # a short row per rung
            from_file(p, profile_render.render_counters(result)) for p, result in per_dtype)
    if at_cases := newest_per_dtype(found["profile"], at_frontier):  # the counters at the frontier's shapes
        blocks["frontier-counters"] = source(*[p for p, _ in at_cases]) + "\n" + "\n\n".join(
            from_file(p, profile_render.render_counters(result, ladder="ladder.md")
                      + (f"\n\n![roofline of the rungs at the frontier's shapes, under the ceilings of the same run]"
                         f"({rel(p.parent / result['plot'])})" if result.get("plot") else ""))
            for p, result in at_cases)
    if backward := newest_per_dtype(found["profile"], lambda r: not forward(r)):  # the backward rungs, phase by phase
        blocks["backward-profile"] = source(*[p for p, _ in backward]) + "\n" + "\n\n".join(
            from_file(p, profile_render.render_profile(result)) for p, result in backward)
    if found["scale"]:  # the newest decode-at-scale run, with its plot
        p = found["scale"][0]
        result = load_result(p)
        image = rel(p.parent / result["plot"]) if result.get("plot") else None
        blocks["scale"] = source(p) + "\n" + from_file(p, render_scale(result, image))
    if found["backward"]:  # the newest backward result of each dtype
        per_dtype = newest_backward(found["backward"], load_result)
        blocks["backward"] = source(*[p for p, _ in per_dtype]) + "\n" + "\n\n".join(
            from_file(p, render_backward(result)) for p, result in per_dtype)
    if per_dtype := newest_train(found["train"], load_result):  # the newest full run of each dtype, its loss curve
        blocks["train"] = source(*[p for p, _ in per_dtype]) + "\n" + "\n\n".join(
            from_file(p, render_train(result, rel(p.parent / result["plot"]) if result.get("plot") and
                                      result["loss_curve"] else None)) for p, result in per_dtype)
    if found.get("watch"):  # the newest save-to-report times of tools/watch_demo.py
        p = found["watch"][0]
        blocks["watch"] = source(p) + "\n" + render_demo(p.read_text(), rel(p))
    if found.get("sanitize"):  # the newest full-run file of each sanitizer group
        entries = newest_per_group(found["sanitize"])
        if entries:
            blocks["sanitize"] = source(*[p for p, _ in entries]) + "\n" + render_sanitize(entries, rel)
    if found["levels"]:  # each dtype from the newest levels file that measured it
        chosen = newest_levels(found["levels"], load_result)
        blocks["levels"] = source(*[p for p, *_ in chosen]) + "\n" + "\n\n".join(
            from_file(p, render_levels(result, rel(p.parent / result["plot"]) if result.get("plot") else None, dtypes))
            for p, result, dtypes in chosen)
    return blocks


def read_page(path: Path, expected: tuple[str, ...]) -> tuple[str, dict[str, tuple[int, int]]]:
    """A page's text and its sections; CannotRun if it is missing, malformed or has no markers."""
    if not path.is_file():
        raise CannotRun(f"{path} does not exist")
    text = path.read_text()
    try:
        spans = find_sections(text)
    except ValueError as exc:
        raise CannotRun(f"{path}: {exc}; nothing rewritten") from None
    if not spans:
        raise CannotRun(f"{path} has no bench markers (a line <!-- bench:{expected[0]}:start --> and a line "
                        f"<!-- bench:{expected[0]}:end -->, likewise for {', '.join(expected[1:])}); nothing "
                        "rewritten")
    return text, spans


def cmd_readme(args) -> int:
    results = args.results
    found = newest_results(results)
    # each page, and the sections it should carry; docs/profile.md, docs/ladder.md and docs/levels.md where there
    # are such results
    pages = {args.readme: SUMMARIES, args.results_doc: FULL_TABLES}
    profile_doc = args.profile_doc or args.results_doc.parent / "profile.md"
    if profile_doc.exists() or found["profile"]:  # a checkout without profile results needs no such page
        pages[profile_doc] = PROFILE
    ladder_doc = getattr(args, "ladder_doc", None) or args.results_doc.parent / "ladder.md"
    found["sanitize"] = sorted(Path(results).glob("sanitize-*.json"))
    if ladder_doc.exists():  # a hand-written page: never created here
        pages[ladder_doc] = COUNTERS * bool(found["profile"]) + SANITIZE * bool(found["sanitize"])
        if not pages[ladder_doc]:
            del pages[ladder_doc]
    if found["levels"]:
        pages[getattr(args, "levels_doc", LEVELS_DOC)] = ("levels",)
    if found["scale"]:
        pages[getattr(args, "decode_doc", None) or DECODE_DOC] = ("scale",)
    if found["train"]:
        pages[getattr(args, "training_doc", None) or TRAINING_DOC] = ("train",)
    if any(not forward(load_result(p)) for p in found["profile"]):
        pages[args.results_doc.parent / "backward.md"] = BACKWARD_PROFILE
    found["watch"] = sorted(Path(results).glob("watch-*.txt"), key=lambda p: p.name.rsplit("-", 1)[-1], reverse=True)
    if found["watch"]:
        pages[getattr(args, "watch_doc", None) or WATCH_DOC] = ("watch",)
    for page in [args.readme, *sorted(args.results_doc.parent.glob("*.md"))]:  # bench.py compare's tables, any page
        if page.is_file() and "<!-- bench:compare-" in page.read_text():
            pages.setdefault(page, ())
    read = {path: read_page(path, expected) for path, expected in pages.items()}  # all checked before one is written
    compared = {path: rewrite_compare_sections(text, spans, path.parent) for path, (text, spans) in read.items()}
    if getattr(args, "replot", False):
        for kind, plot in (("sweep", plots.plot_sweep), ("e2e", plots.plot_e2e), ("scale", plots.plot_scale)):
            shown = [p for p, _ in newest_sweeps(found[kind])] if kind == "sweep" else found[kind][:1]
            for p in shown:
                plots.plot_or_none(plot, load_result(p), p.with_suffix(".png"))  # the JSON already names this PNG
        for p, result in [*newest_per_dtype(found["profile"], lambda r: forward(r) and not at_frontier(r)),  # shown
                          *newest_per_dtype(found["profile"], at_frontier)]:
            if result.get("plot"):
                plots.plot_or_none(profile_render.plot_result, result, p.with_suffix(".png"))
    written, available = {}, set()
    for path, (text, spans) in read.items():
        blocks = readme_blocks(found, path.parent) | compared[path]
        available |= set(blocks)
        for name in spans:
            if name not in blocks:
                progress(f"no {name} results in {results}: that section is left as it is")
        new = replace_sections(text, spans, blocks)
        if new != text:
            path.write_text(new)
        done = [k for k in spans if k in blocks]
        written |= dict.fromkeys(done)
        progress(f"{path}: {'rewrote' if new != text else 'already current:'} {', '.join(done) or 'nothing'}")
    for name in (n for n in KNOWN if n in available and n not in written):
        names = [p.name for p in pages]
        where = f"neither {names[0]} nor {names[1]}" if len(names) == 2 else f"none of {', '.join(names)}"
        print(f"bench.py readme: {where} has bench:{name} markers; the {name} table is not shown", file=sys.stderr)
    return 0
