"""`bench.py sweep`: TFLOP/s against sequence length T (powers of two) with B = tokens // T, for chosen
rungs and peers, with a PNG plot beside the result file."""

from __future__ import annotations

import math

from . import device, plots
from .cases import Shape
from .device import progress
from .results import result_path, write_result, wrote
from .rungs import run_shapes
from .tables import render_sweep


def cmd_sweep(args) -> int:
    device.require_gpu()
    lengths = [2**i for i in range(int(math.log2(args.t_min)), int(math.log2(args.t_max)) + 1)]
    shapes = [Shape(max(1, args.tokens // T), T, args.nh, args.d, causal=not args.noncausal) for T in lengths]
    result = run_shapes("sweep", args, shapes)
    result["tokens"] = args.tokens
    path = result_path("sweep", result["setup"], args.results)
    result["plot"] = plots.plot_or_none(plots.plot_sweep, result, path.with_suffix(".png"))
    write_result(result, path)
    print("\n" + render_sweep(result, result["plot"]))
    progress(wrote(path, result["plot"]))
    return 0
