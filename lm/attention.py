"""What the models ask of the attention function they are handed: whether it takes fewer query rows
than keys, so that a forward that needs only the last position's logits can attend with the last
query alone (the causal mask aligned bottom-right: that query sees every key)."""

from __future__ import annotations

# Whether a rung that declares lab.supports cross gets the last layer's one query in a last_only forward.
# Off until the GPU tests of the eager paths (tests/test_gpt2_gpu.py, tests/test_llama_gpu.py,
# tests/test_lab_llama.py on the device) have run with it: until then a rung attends over every row of
# the last layer, as before, and only its output projection and MLP are trimmed.
RUNGS_TAKE_ONE_QUERY = False


def takes_short_queries(attend) -> bool:
    """Whether attend(q, k, v) takes q (B, NH, T_q, hs) over k, v of T_k > T_q positions: a rung
    (kernels.Attend, known by its path) only if it declares lab.supports cross (and RUNGS_TAKE_ONE_QUERY);
    any other function (the reference attention, a caller's wrapper) is taken to, as the KV cache's
    decode steps ask."""
    path = getattr(attend, "path", None)
    if path is None:
        return True
    if not RUNGS_TAKE_ONE_QUERY:
        return False
    from kernels import ladder
    from kernels import triton as triton_rungs

    rung = triton_rungs.load(path) if triton_rungs.owns(path) else ladder.load(path)
    return "cross" in rung.supports


def attention_bytes(B: int, NH: int, NKV: int, T_q: int, T_k: int, hs: int, itemsize: int, *, reference: bool) -> int:
    """The most bytes one call of the attention allocates at once (its inputs aside), for q (B, NH, T_q,
    hs) over k, v (B, NKV, T_k, hs) of `itemsize` bytes. The reference (kernels/reference.py): NH_kv
    heads repeated to NH, then three (B, NH, T_q, T_k) score arrays at once (S, S - max and its exp;
    float32 for 16-bit inputs, whose float32 copies it makes first) beside the boolean mask. A rung:
    contiguous copies of q, k, v (the models hand it views) and its output, its workspace not counted."""
    q, kv, out = B * NH * T_q * hs * itemsize, B * NH * T_k * hs * itemsize, B * NH * T_q * hs * itemsize
    if not reference:
        return q + 2 * B * NKV * T_k * hs * itemsize + out
    wide = max(itemsize, 4)
    repeated = 2 * kv if NKV != NH else 0
    copies = (q + 2 * kv) * wide // itemsize if itemsize < 4 else 0
    return repeated + copies + 3 * B * NH * T_q * T_k * wide + T_q * T_k + 2 * out * wide // itemsize
