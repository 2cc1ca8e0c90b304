"""What the models ask of the attention function they are handed: whether it takes fewer query rows
than keys, so that a forward that needs only the last position's logits can attend with the last
query alone (the causal mask aligned bottom-right: that query sees every key)."""

from __future__ import annotations


def takes_short_queries(attend) -> bool:
    """Whether attend(q, k, v) takes q (B, NH, T_q, hs) over k, v of T_k > T_q positions: a rung
    (kernels.Attend, known by its path) only if it declares lab.supports cross; any other function
    (the reference attention, a caller's wrapper) is taken to, as the KV cache's decode steps ask."""
    path = getattr(attend, "path", None)
    if path is None:
        return True
    from kernels import ladder
    from kernels import triton as triton_rungs

    rung = triton_rungs.load(path) if triton_rungs.owns(path) else ladder.load(path)
    return "cross" in rung.supports
