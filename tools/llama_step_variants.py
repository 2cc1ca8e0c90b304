"""Llama's decode step time per token with its kernels' geometry varied: gqa_decode_attention's splits
launched, keys a split holds and warps a block has (llama.fast.attention_plan's overrides), and the
matrix streams' (rms_gemv.cu: blocks an SM, 16-byte loads a lane in an item); each variant a fresh
engine on the same random weights, timed as generate() replays its graphs (FastEngine.replay_ms) at a
few positions, the variants interleaved over --rounds rounds. What llama/fast/plan.py's figures come
from.

    python3 tools/llama_step_variants.py --sizes llama-3.2-1b --cache 512:40,128,260 --cache 2048:1000
    python3 tools/llama_step_variants.py --variants plan,gemv_bps=1,gemv_bps=1+item_loads=4 --out $OUT

A variant is `plan` (the engine's own choices) or `name=value` pairs joined by `+` (`keys=256+warps=8`):
splits (launched per key/value head), keys (split_keys: at least the cache's length over the splits),
warps (4, 8 or 16), staged (K and V rows a split copies before its wait), pad (that many empty
kernels, spin.cu's handoff, after each layer's attention: what a kernel boundary costs), cluster (1: a key/value head's splits combine in a thread-block cluster, 0: by a
ticket through L2); gemv_bps (at most this
many blocks of every stream an SM), qkv_bps, o_proj_bps, gate_up_bps, down_proj_bps, lm_head_bps (the
same for one stream), item_loads (1 to 8: more spills under rms_gemv.cu's register cap) and qkv_loads,
o_proj_loads, ... (one stream's); cap_mb
(MiB of the next matrix each stream asks L2 to prefetch at its end) and attn_mb (MiB of the layer's gate/up
the attention launch asks L2 for as it starts; 0: none). Writes llama_step_variants.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama.fast.plan import MATRIX_NAMES  # noqa: E402  (no CuPy needed)

# a variant's names: (the Engine argument, its key there, the unit of the value)
NAMES = {"splits": ("attention", "splits", 1), "keys": ("attention", "split_keys", 1),
         "warps": ("attention", "warps", 1), "cluster": ("attention", "cluster", 1),
         "staged": ("attention", "staged_rows", 1), "pad": ("pad", None, 1), "gemv_bps": ("gemv", "blocks_per_sm", 1),
         "item_loads": ("gemv", "item_loads", 1), "cap_mb": ("l2", "cap", 1 << 20), "attn_mb": ("l2", "attention", 1 << 20),
         **{f"{m}_bps": ("gemv", ("blocks_per_sm_of", m), 1) for m in MATRIX_NAMES},
         **{f"{m}_loads": ("gemv", ("item_loads_of", m), 1) for m in MATRIX_NAMES}}
DEFAULT_VARIANTS = "plan,keys=64,keys=256,warps=8,gemv_bps=1,item_loads=4"


def parse_variant(text: str) -> dict:
    """`plan` -> {"attention": {}, "gemv": {}, "l2": {}}; `keys=256+attn_mb=16` -> {"attention": {"split_keys":
    256}, "gemv": {}, "l2": {"attention": 16 MiB}}: the Engine's attention=, gemv= and l2= arguments."""
    out = {"attention": {}, "gemv": {}, "l2": {}}
    if text == "plan":
        return out
    for part in text.split("+"):
        name, _, value = part.partition("=")
        if name not in NAMES or not value.isdigit() or int(value) < (0 if name in ("attn_mb", "cluster", "staged", "pad") else 1):
            raise ValueError(f"variant {text!r}: {part!r} is not one of {', '.join(f'{n}=N' for n in NAMES)}")
        where, key, unit = NAMES[name]
        if where == "pad":  # not an Engine argument: measure() builds a padded engine
            out["pad"] = int(value)
        elif isinstance(key, tuple):  # one stream's: {"blocks_per_sm_of": {matrix: n}}
            out[where].setdefault(key[0], {})[key[1]] = int(value) * unit
        else:
            out[where][key] = bool(int(value)) if key == "cluster" else int(value) * unit
    return out


def parse_cache(text: str, first: int = 0, room: int = 65,
                why: str = "64 steps are timed from each") -> tuple[int, list[int]]:
    """`512:40,128,260` -> (512, [40, 128, 260]): a cache length and the positions timed in it, each from
    `first` on with `room` positions after it (tools/attention_trace.py asks for others)."""
    length, _, positions = text.partition(":")
    try:
        max_len, at = int(length), [int(p) for p in positions.split(",")]
    except ValueError:
        raise ValueError(f"--cache {text!r}: LENGTH:POSITION,POSITION,...") from None
    if not at or any(not first <= p < max_len - room for p in at):
        raise ValueError(f"--cache {text!r}: positions from {first} to {max_len - room - 1} ({why})")
    return max_len, at


def padded_engine(pad: int):
    """llama.fast.Engine with `pad` handoff launches (spin.cu) after each layer's attention: each adds one
    kernel boundary to the step's chain of programmatic dependent launches and nothing else, so what they
    add to the time a token is what that many boundaries a layer cost."""
    import llama.fast as fast
    from lm.engine import Launch

    class Padded(fast.Engine):
        def _decode_launches(self, prefetch: bool, pdl: bool) -> list:
            handoff = self.fn["handoff"]
            out = []
            for launch in super()._decode_launches(prefetch, pdl):
                out.append(launch)
                if launch.name.endswith(f".{fast.STEP_KINDS[1]}"):
                    out += [Launch(f"{launch.name}.pad{i}", handoff, (1,), (32,), ()) for i in range(pad)]
            return out

    return Padded


def measure(size: str, caches: list[tuple[int, list[int]]], variants: list[str], rounds: int, seed: int) -> list[dict]:
    import cupy

    import llama.fast as fast
    from benchmarks import scale
    from lm.errors import LabError

    fam = scale.of_size(size)
    ckpt = fam.random_weights(size, seed=seed, xp=cupy, dtype="bfloat16")
    config, params = ckpt.config, ckpt.params
    fam.decode_layout(params, config)
    rows = []
    for max_len, positions in caches:
        times: dict[tuple[str, int], list[float]] = {}
        plans = {}
        for _ in range(rounds):
            for variant in variants:
                kwargs = parse_variant(variant)
                pad = kwargs.pop("pad", 0)
                try:
                    engine = (padded_engine(pad) if pad else fast.Engine)(params, config, max_len=max_len, **kwargs)
                except LabError as exc:
                    plans[variant] = str(exc)
                    continue
                plans[variant] = {**vars(engine.attn), "clusters_held": engine.attn_clusters_held, "pad": pad,
                                  "gemv": engine.gemv_options, "l2": engine.l2_options,
                                  "grids": {key: grid for key, (_, grid, _) in engine.gemv.items()}}
                for position in positions:
                    times.setdefault((variant, position), []).append(engine.replay_ms(position, 64, repeats=5))
                del engine
        for variant in variants:
            plan = plans[variant]
            for position in positions:
                ms = times.get((variant, position))
                rows.append({"size": size, "max_len": max_len, "variant": variant, "position": position,
                             "plan": plan,
                             "us_per_token": None if ms is None else [1e3 * m for m in ms]})
    del ckpt, params
    scale.release()
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'size':14s} {'cache':>6s} {'position':>8s} {'variant':22s} {'splits':>6s} {'keys':>5s} {'warps':>5s} "
             f"{'cluster':>7s} {'qkv grid':>8s}  us a token"]
    for r in rows:
        p = r["plan"]
        if isinstance(p, str):
            lines.append(f"{r['size']:14s} {r['max_len']:6d} {r['position']:8d} {r['variant']:22s} {p}")
            continue
        us = " ".join(f"{u:8.1f}" for u in r["us_per_token"])
        lines.append(f"{r['size']:14s} {r['max_len']:6d} {r['position']:8d} {r['variant']:22s} {p['splits']:6d} "
                     f"{p['split_keys']:5d} {p['warps']:5d} {str(p['cluster']):>7s} {p['grids']['qkv']:8d}  {us}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="llama-3.2-1b,llama-3.2-3b", help="comma-separated Llama sizes")
    parser.add_argument("--cache", action="append", help="LENGTH:POSITIONS, the cache's length and the positions "
                        "timed (repeatable; default 512:40,128,260 and 2048:1000)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated (default {DEFAULT_VARIANTS})")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the variants, interleaved (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for llama_step_variants.json")
    args = parser.parse_args(argv)

    from benchmarks import device, scale

    try:
        caches = [parse_cache(c) for c in (args.cache or ["512:40,128,260", "2048:1000"])]
        variants = args.variants.split(",")
        for v in variants:
            parse_variant(v)
    except ValueError as exc:
        parser.error(str(exc))
    sizes = args.sizes.split(",")
    if bad := [s for s in sizes if s not in scale.SIZES or scale.family(s) != "llama"]:
        parser.error(f"not a Llama size: {', '.join(bad)}")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if problem := device.gpu_problem():
        parser.error(f"needs a CUDA GPU ({problem}): run it on the GPU machine")
    info = device.device_info()
    print(f"{info['name']}, driver {info['driver']}", flush=True)
    rows = []
    for size in sizes:
        rows += measure(size, caches, variants, args.rounds, args.seed)
        print(table([r for r in rows if r["size"] == size]), flush=True)
    if args.out:
        path = Path(args.out) / "llama_step_variants.json"
        path.write_text(json.dumps({"device": info, "command": ["python3", "tools/llama_step_variants.py",
                                    *(sys.argv[1:] if argv is None else argv)], "rows": rows}, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
