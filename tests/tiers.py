"""The two GPU tiers. The whole suite, `-m gpu` (every length x head size x dtype x configuration), runs
once per session; the quick tier, `-m "gpu and not exhaustive"`, runs every forward and backward rung,
every fused kernel and both engines at a few awkward shapes (each head size and dtype of a rung at one
of T = 1, 97 or 257, a cross length and grouped-query heads where declared, one strided view), the
models' greedy runs with the KV cache, and is held to that by tests/test_tiers.py.

A parametrization value that only the whole suite needs is marked `exhaustive`. In a stack of
parametrize decorators a test is in the quick tier only when every one of its values is, so each list
says its quick values beside it: `tiered(LENGTHS, quick=[1, 97, 257])`. Where every case of a matrix
compiles and runs at each quick length, `spread` gives each case one of them in turn instead.
"""

import pytest


def tiered(values, quick, *, unpack=True):
    """`values` for pytest.mark.parametrize, each one not in `quick` (a list of values, or a predicate on
    one) marked exhaustive. A tuple value fills several argument names unless `unpack` is False (one
    argument that is itself a tuple); ids are pytest's own either way."""
    keep = quick if callable(quick) else quick.__contains__
    return [value if keep(value) else
            pytest.param(*(value if unpack and isinstance(value, tuple) else (value,)), marks=pytest.mark.exhaustive)
            for value in values]


def spread(values, cases, quick, *, unpack=True):
    """(*value, *case) for every value x case, for one parametrize over both (the value's names first,
    as stacked decorators name the test), the quick tier running each case at one of the `quick` values:
    case i at quick[(i + i // n) % n], n = len(quick), the turn shifted every n cases so that a period of
    n in the cases (three dtypes of a head size, three head sizes of a rung) does not pin a value to one
    dtype or head size. Every case and every quick value runs there; not every pairing of them. A tuple
    value fills several argument names unless `unpack` is False, as in `tiered`."""
    n = len(quick)

    def flat(value):
        return value if unpack and isinstance(value, tuple) else (value,)

    return [pytest.param(*flat(value), *case, marks=() if value == quick[(i + i // n) % n] else pytest.mark.exhaustive)
            for value in values for i, case in enumerate(cases)]


def first_of_each_rung(cases):
    """The quick (rung, head size, dtype) cases of a list of them: each rung's first (its first head size
    and dtype), so that every rung runs in the quick tier and every other case in the whole suite."""
    firsts = {}
    for case in cases:
        firsts.setdefault(case[0], case)
    return list(firsts.values())
