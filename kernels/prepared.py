"""Prepared: a rung validated and compiled for one set of inputs, launched by calling it; what
kernels.prepare, prepare_fp8 and the Triton rungs' prepare return."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Prepared:
    """run() launches the rung and returns its output (with return_lse, (out, lse)). instance: the
    configuration chosen for these inputs (runtime.Instance, or a Triton rung's). reads_inputs: whether
    a launch reads the caller's arrays themselves, with whatever they hold then (else copies made once,
    when it was prepared)."""

    run: Callable[[], object]
    instance: object
    reads_inputs: bool

    def __call__(self):
        return self.run()
