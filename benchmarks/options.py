"""Flags more than one subcommand declares: a shape, a list of rungs, and where the result goes
(--save, --results). cli.py declares the rest; profile.py declares its own subcommand with these."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import kernels

from . import results


def parse_shape(text: str) -> tuple[int, int]:
    """'8x1024' -> (8, 1024): batch x sequence length."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"shape must be BxT with positive integers, e.g. 8x1024; got {text!r}")
    return int(m[1]), int(m[2])


def kernel_list(text: str) -> list[Path]:
    """'v01,v2,v03_x' or 'all' -> rung files (kernels.resolve: v8, v08, v08_name, or a .cu path)."""
    if text.strip() == "all":
        return [kernels.resolve(n) for n in kernels.names()]
    try:
        return [kernels.resolve(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def results_option(p: argparse.ArgumentParser) -> None:
    """--save (into results/) or --results DIR; by default results/scratch/, git-ignored."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--save", dest="results", action="store_const", const=results.RESULTS,
                       help="write the result into results/, beside the files the docs cite (default: "
                            "results/scratch/, git-ignored)")
    where.add_argument("--results", type=Path, metavar="DIR",
                       help="write the result into DIR instead (default: results/scratch/, git-ignored; "
                            "--save: results/)")
    p.set_defaults(results=results.SCRATCH)  # read when the parser is built, so a test can move it
