"""What Llama's fast path runs and with what geometry, computed without a GPU: when it runs at all
(unsupported_reason), the matrices of a step and the kernels it compiles (MATRICES, kernel_expressions),
the streams' items and grids (gemv_unroll, gemv_grid), the attention's key splits and staging
(attention_plan), and the static cache's length (cache_positions)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lm.engine import common_reason

from ..config import LlamaConfig

DTYPES = ("float32", "bfloat16")
STEPS_PER_GRAPH = 8  # decode steps per captured graph, and tokens per copy back to the host
PREFETCH_CAP = 8 << 20  # bytes of the next matrix a kernel asks L2 to fetch at its end (L2: 50 MB on H100/H200)
# bytes of its layer's gate/up matrix the attention launch asks L2 to fetch as it starts: none. The memory
# idles under the latency-bound attention, but filling it made every size slower, the more the slower (H200,
# tools/llama_step_variants.py, us a token at positions 40 / 128 / 260, two rounds; none, 8, 16, 32 MiB):
# 3.2 1B 922 / 929 / 939, 928 / 936 / 947, 931 / 938 / 948, 952 / 958 / 968; 3.2 3B 2,224 / 2,242 / 2,261,
# 2,268 / 2,287 / 2,305, 2,302 / 2,321 / 2,341, 2,371 / 2,394 / 2,418; 3.1 8B 4,283 / 4,294 / 4,309, 4,332 /
# 4,345 / 4,361, 4,358 / 4,373 / 4,391, 4,402 / 4,420 / 4,442: the attention's own reads of the cache wait
# behind the prefetch, and it is the step's critical path (Engine(l2=) measures other amounts)
ATTENTION_PREFETCH = 0
GEMV_WARPS = 8  # rms_gemv.cu's warps per block
# at most this many blocks of a stream an SM, by matrix (the rest: as many as fit): none. A small stream at
# one block an SM leaves half the register file to the next kernel's blocks, which under programmatic
# dependent launch could then issue their first items under its tail; every such cap measured slower
# (H200, tools/llama_step_variants.py, two rounds, time a token against the plan's, positions 40 / 260 in
# a 512-position cache, 1000 in 2,048; Engine(gemv={"blocks_per_sm_of": ...}) measures others):
# o_proj 1.011-1.018x at 1B and 3B, 1.025x at 3.1 8B (position 128); qkv 0.998-1.016x; down_proj
# 1.050-1.064x; qkv and o_proj 1.011-1.029x (8B 1.049x); all three 1.063-1.079x (8B 1.119x). Halving a
# stream's loads in flight costs more than the next kernel's head start buys.
STREAM_BLOCKS_PER_SM: dict[str, int] = {}
# A stream's ITEM_LOADS where a size measured faster with another, by (hidden_size, intermediate_size,
# dtype): Llama 3.2 1B in bfloat16 with 4 for qkv, gate/up and down_proj (o_proj's and the head's items
# are the same with 4 or 8 there). H200, tools/llama_step_variants.py after the streams' reads ahead, the
# time a token against the plan's (8), the mean of two rounds, at positions 40 and 260 (a 512-position
# cache) and 1000 (2,048): every stream 4: 1B 0.964-0.969x, 3.2 3B 1.024-1.033x, 3.1 8B (position 128)
# 0.998x; one stream at a time, 1B qkv 0.986-0.993x, down_proj 0.981-0.984x, gate/up 0.997-1.003x; 3B
# qkv 0.988-1.000x, o_proj 1.011-1.019x, down_proj 1.021-1.023x; 8B o_proj 0.992x, down_proj 0.995x,
# gate/up 1.007x. Only the clear one is taken (the trees before and after at 1B: 1.035x the tokens/s).
STREAM_ITEM_LOADS: dict[tuple[int, int, str], dict[str, int]] = {
    (2048, 8192, "bfloat16"): {"qkv": 4, "gate_up": 4, "down_proj": 4},
}
MATRIX_NAMES = ("qkv", "o_proj", "gate_up", "down_proj", "lm_head")  # matrices()' keys, in step order
ITEM_LOADS = 8  # rms_gemv.cu: 16-byte loads per lane in one item (rows x UNROLL); two items in flight
ATTENTION_WARPS = (4, 8, 16)  # gqa_decode_attention.cu's warps per block: the engine's plan picks one
# gqa_decode_attention.cu's combine: a key/value head's splits launched as one thread-block cluster that
# combines in rank 0's shared memory (True), or the last block by a ticket through L2 (False). The ticket:
# the cluster was no faster (H200, tools/llama_step_variants.py, two rounds, the time a token against the
# ticket's, positions 40 / 260 in a 512-position cache, 1000 in 2,048; 16 splits a cluster of 16): 3.2 1B
# 0.999 / 1.007 / 0.995x (0.982-0.984x in a run before), 3.2 3B 1.038 / 1.032 / 1.064x, 3.1 8B 1.053 / 1.040 /
# 1.050x (at 2,048 the device holds 7 of the 8 clusters at once); 8 splits in clusters of 8 against the
# ticket at 8 splits, 0.996-1.006x at 512. Engine(attention={"cluster": True}) measures it.
ATTENTION_CLUSTER = False
CLUSTER_SPLITS = 16  # the most blocks a cluster holds on H100 and H200 (8 portable, 16 by opting in)
ATTENTION_TRACE_MARKS = 8  # gqa_decode_attention.cu's TRACE_MARKS: global-timer marks a block in its trace
MAX_GROUP = 8  # query heads per key/value head that gqa_decode_attention.cu keeps in registers
# at least this many keys a split where the cache is short: with a 512-position cache, 8 splits of 64 keys
# (the warps of attention_warps: one pass) against the 16 of 32 that 16 keys a split gave, the time a token
# (H200, tools/llama_step_variants.py, two rounds, positions 40 / 260): 3.2 1B 0.992 / 0.999x, 3.2 3B
# 0.987 / 0.992x, 3.1 8B 0.992 / 0.995x; caches of 1,024 positions and more keep 16 splits (at 2,048, 8
# splits of 256 keys were 1.02-1.06x at position 1000). Fewer splits in use at a position: at 40, one
# (no combine) against two.
MIN_SPLIT_KEYS = 64
MAX_SPLIT_KEYS = 2048  # at most this many keys a split: a longer cache takes more splits
STAGE_BYTES = 64 << 10  # shared memory for the K and V rows an attention block copies before its wait
BLOCK_SMEM = 227 << 10  # shared memory a block may have on H100 and H200 (dynamic and static)
CACHE_QUANTUM = 256  # the static cache's length is the run's positions rounded up to this
DEFAULT_POSITIONS = 2048  # an engine's positions when nobody says how many the run needs
NULL = np.uint64(0)  # a null pointer argument


@dataclass(frozen=True)
class Matrix:
    """One matrix of the decode step as rms_gemv.cu streams it: N rows of K, in tasks of `rows` rows."""

    kernel: str  # rms_gemv.cu's kernel: rms_gemv_{rope, residual, silu, argmax}
    N: int
    K: int
    rows: int  # rows per task: 2 for the stacked pairs (RoPE's, gate and up), else 1

    @property
    def tasks(self) -> int:
        return self.N // self.rows


def matrices(config: LlamaConfig) -> dict[str, Matrix]:
    """A layer's four matrices and the head, in step order; the names are engine keys."""
    C, F, HS = config.hidden_size, config.intermediate_size, config.head_size
    NH, NKV, V = config.num_attention_heads, config.num_key_value_heads, config.vocab_size
    return {
        "qkv": Matrix("rms_gemv_rope", (NH + 2 * NKV) * HS, C, 2),  # [q; k; v] stacked
        "o_proj": Matrix("rms_gemv_residual", C, NH * HS, 1),
        "gate_up": Matrix("rms_gemv_silu", 2 * F, C, 2),  # [gate; up] stacked
        "down_proj": Matrix("rms_gemv_residual", C, F, 1),
        "lm_head": Matrix("rms_gemv_argmax", V, C, 1),
    }


def param_dtype(params: dict) -> str:
    return params["model.layers.0.self_attn.q_proj.weight"].dtype.name


def unsupported_reason(params: dict, config: LlamaConfig, *, kv_cache: bool, sampler=None,
                       record_logits: bool = False, dtype: str | None = None) -> str | None:
    """None when llama.fast.generate runs this generation; otherwise why llama.generate takes the eager path."""
    why = common_reason(params["model.layers.0.self_attn.q_proj.weight"], sampler=sampler, record_logits=record_logits)
    if why is not None:
        return why
    if not kv_cache:
        return "no KV cache: the fast path decodes over a static cache (the no-cache mode is the eager model's)"
    dtype = dtype or param_dtype(params)
    if dtype not in DTYPES:
        return f"dtype {dtype}: the fast path runs {' and '.join(DTYPES)}"
    C, F, HS = config.hidden_size, config.intermediate_size, config.head_size
    if C % 8 or F % 8:
        return f"widths {C} and {F} must be multiples of 8 (whole 16-byte rows)"
    if HS % 8 or 32 % (HS // 8) or HS > 256:
        return f"head size {HS}: gqa_decode_attention needs a multiple of 8 with head_size / 8 dividing 32"
    group = config.num_attention_heads // config.num_key_value_heads
    if group > MAX_GROUP:
        return f"{group} query heads per key/value head: gqa_decode_attention keeps at most {MAX_GROUP}"
    return None


# -- launch shapes ---------------------------------------------------------------------------------


def gemv_unroll(K: int, itemsize: int, rows: int, item_loads: int = ITEM_LOADS) -> int:
    """rms_gemv.cu's UNROLL for rows of K elements: about ITEM_LOADS 16-byte loads per lane and item
    (rows x UNROLL), in items of equal size, and at least two items per task unless a task is a few
    loads. With one item per task the compiler hoists the next task's loads above the current one's
    sums: at K = 2048 in bfloat16 a thread then needs ~170 registers (one block per SM, or spills under
    rms_gemv.cu's cap of 128); with two items, 63 to 106."""
    per_lane = -(-(K // (16 // itemsize)) // 32)  # 16-byte vectors of a row, per lane
    groups = -(-per_lane // max(1, item_loads // rows))
    if per_lane * rows > item_loads // 2:
        groups = max(2, groups)
    return max(1, -(-per_lane // groups))


def gemv_grid(tasks: int, blocks_per_sm: int, sm_count: int) -> int:
    """rms_gemv.cu's grid: one wave, as many blocks as the SMs hold at once, no more than the tasks fill
    (GEMV_WARPS tasks a block). Where the tasks outnumber its warps the kernel deals them out block by
    block. Measured on an H200 against dealing them warp by warp, as a template flag beside the plan
    (`tools/llama_step_variants.py`, one run, two rounds, positions 40-1,000): Llama 3.2 3B
    1.023-1.034x, 3.1 8B 1.013-1.020x, every stream of theirs a whole wave; dealing 1B's streams that
    fit one round (qkv, o_proj, down) one task a block over a whole wave too was 0.984-0.995x, so
    those keep a warp a task. A block an SM (half the register file free, so that the next kernel's
    blocks could be resident early under this one's tail) was 0.71-0.88x in the same run."""
    return max(1, min(sm_count * max(1, blocks_per_sm), -(-tasks // GEMV_WARPS)))


def stream_item_loads(config: LlamaConfig, dtype: str, key: str, item_loads: int | None = None,
                      item_loads_of: dict | None = None) -> int:
    """gemv_unroll's item_loads for matrix `key`: item_loads_of's, else item_loads (every stream's),
    else the plan's (STREAM_ITEM_LOADS for this size and dtype, else ITEM_LOADS)."""
    if item_loads_of and key in item_loads_of:
        return item_loads_of[key]
    if item_loads is not None:
        return item_loads
    return STREAM_ITEM_LOADS.get((config.hidden_size, config.intermediate_size, dtype), {}).get(key, ITEM_LOADS)


def kernel_expressions(config: LlamaConfig, dtype: str, *, item_loads: int | None = None,
                       item_loads_of: dict | None = None) -> dict[str, tuple[str, str]]:
    """Every kernel the engine compiles for this model and dtype: key -> (kernels/fused file, name
    expression). No device needed: the CPU tests compile exactly these. item_loads (every stream's)
    and item_loads_of ({matrix: n}): the streams' variants for measuring (Engine's gemv overrides;
    stream_item_loads)."""
    item = 2 if dtype == "bfloat16" else 4
    wt = "unsigned short" if dtype == "bfloat16" else "float"
    out = {}
    for key, m in matrices(config).items():
        unroll = gemv_unroll(m.K, item, m.rows, stream_item_loads(config, dtype, key, item_loads, item_loads_of))
        head = f", {config.head_size}" if m.kernel == "rms_gemv_rope" else ""
        out[key] = ("rms_gemv", f"{m.kernel}<{wt}, {m.K}{head}, {GEMV_WARPS}, {unroll}>")
    return out | {
        **{f"attention/{w}{'/cluster' * c}": attention_kernel(config, dtype, w, c)  # the plan picks one
           for w in ATTENTION_WARPS for c in (False, True)},
        "embed": ("embed", f"embed<{wt}>"),
        "spin": ("spin", "spin"),
        "handoff": ("spin", "handoff"),  # an empty kernel boundary, for measuring (tools/llama_step_variants.py)
    }


def attention_kernel(config: LlamaConfig, dtype: str, warps: int, cluster: bool = False,
                     trace: bool = False) -> tuple[str, str]:
    """gqa_decode_attention.cu's (file, name expression) for this model and dtype, `warps` a block, its
    splits combining in a cluster or by a ticket; with trace, the diagnostic build that records its marks."""
    wt = "unsigned short" if dtype == "bfloat16" else "float"
    group = config.num_attention_heads // config.num_key_value_heads
    flags = ", ".join("true" if f else "false" for f in (cluster, trace))
    return "gqa_decode_attention", f"gqa_decode_attention<{wt}, {config.head_size}, {group}, {warps}, {flags}>"


@dataclass(frozen=True)
class AttentionPlan:
    """gqa_decode_attention.cu's geometry: `splits` key splits per key/value head launched, `split_keys`
    the most keys a split holds (a position uses ceil(T_k / split_keys) splits), `warps` a block's,
    `staged_rows` K and V rows a block copies to shared memory before its wait, `smem` dynamic bytes
    (the rows, then with `cluster` the splits' partials that rank 0 combines), `cluster`: the splits of
    a key/value head are one cluster (else a ticket combines)."""

    splits: int
    split_keys: int
    warps: int
    staged_rows: int
    smem: int
    cluster: bool = False


def attention_warps(split_keys: int, head_size: int) -> int:
    """The fewest of ATTENTION_WARPS whose block takes a split's keys in one step of its warps' pass
    (512 / head_size keys a warp: head_size / 8 lanes a key, UNROLL = 2 keys a lane), else the most: a
    warp's pass is a chain of dependent steps, and fewer keys a warp make it shorter. Measured (H200,
    tools/llama_step_variants.py, the mean of two rounds, us a token; llama-step-variants-online in
    results/), 64 keys a split (a 512-position cache) at positions 40 / 260: 3.2 1B 4 / 8 / 16 warps
    819.3 / 812.0 / 830.0 and 842.4 / 833.7 / 848.4; 3.2 3B 8 / 16 warps 1970.7 / 1941.3 and 2004.4 /
    1987.5; 3.1 8B 4054.8 / 4042.4 and 4087.8 / 4080.7. 128 keys (2,048 positions) at 1000: 1B 8 / 16
    warps 863.3 / 864.4, 3B 2096.1 / 2046.0, 8B 4236.2 / 4161.4. Two blocks an SM (33 splits a key/value
    head) were no faster with the loops before the one pass (1B at 1000 with 8 warps: 1001 against 975)."""
    need = -(-split_keys * head_size // 512)
    return next((w for w in ATTENTION_WARPS if w >= need), ATTENTION_WARPS[-1])


def attention_plan(config: LlamaConfig, max_len: int, sm_count: int, itemsize: int, *, splits: int | None = None,
                   split_keys: int | None = None, warps: int | None = None, staged_rows: int | None = None,
                   cluster: bool | None = None) -> AttentionPlan:
    """Enough splits to give every SM a block where the cache holds MIN_SPLIT_KEYS keys for each (a
    shorter cache takes fewer splits of that many), more where a split would hold more than
    MAX_SPLIT_KEYS; a position takes the keys in as few of them as hold them (ceil(T_k / split_keys));
    warps by attention_warps; as many rows staged as a split holds, up to STAGE_BYTES. Splits holding
    more keys than that, fewer of them in use, measured slower but once (H200, bfloat16, 4 warps, us a
    token, with the loops before the one pass). With a 512-position cache (32 keys a split), 32 / 64
    / 128 / 256 / 512 keys a split: 3B at position 400 2358 / 2508 / 2604 / 2972 / 3459; 1B at 400, the
    exception, 990 / 970 / 1003 / 1175 / 1184. With 2,048 (128 keys a split), 1B at 1000: 128 / 256 /
    512 keys 1040 / 1186 / 1213. (64 keys with the warps that take them in one pass came out faster
    since: MIN_SPLIT_KEYS.)
    The splits combine in a cluster (ATTENTION_CLUSTER) where there are at most CLUSTER_SPLITS of them.
    splits, split_keys (at least the cache's length over the splits), warps, staged_rows (at most the
    split's keys) and cluster override the choices, for measuring (tools/llama_step_variants.py); a
    geometry the kernel cannot take is a ValueError."""
    NKV, HS = config.num_key_value_heads, config.head_size
    group = config.num_attention_heads // NKV
    if splits is not None and not 1 <= splits <= max_len:
        raise ValueError(f"splits {splits}: 1 to the cache's {max_len} positions")
    fill = min(sm_count // NKV, -(-max_len // MIN_SPLIT_KEYS))  # a block an SM, MIN_SPLIT_KEYS keys each
    splits = splits or max(1, fill, -(-max_len // MAX_SPLIT_KEYS))
    keys = max(-(-max_len // splits), split_keys or 0)  # keys in the longest split
    warps = warps or attention_warps(keys, HS)
    if warps not in ATTENTION_WARPS:
        raise ValueError(f"warps {warps}: gqa_decode_attention is compiled for {ATTENTION_WARPS}")
    if cluster and splits > CLUSTER_SPLITS:
        raise ValueError(f"cluster: {splits} splits, past the {CLUSTER_SPLITS} blocks a cluster holds")
    cluster = ATTENTION_CLUSTER and splits <= CLUSTER_SPLITS if cluster is None else bool(cluster)
    if staged_rows is not None and staged_rows < 0:
        raise ValueError(f"staged_rows {staged_rows}: at least 0")
    rows = min(keys, STAGE_BYTES // (2 * HS * itemsize) if staged_rows is None else staged_rows)
    smem = 2 * rows * HS * itemsize + 4 * splits * group * (HS + 2) * cluster
    if smem + 4 * warps * group * HS > BLOCK_SMEM:  # with the static per-warp outputs
        raise ValueError(f"{keys} keys a split and {warps} warps: {smem + 4 * warps * group * HS} bytes of "
                         f"shared memory, past a block's {BLOCK_SMEM}")
    return AttentionPlan(splits=splits, split_keys=keys, warps=warps, staged_rows=rows, smem=smem, cluster=cluster)


def cache_positions(positions: int, config: LlamaConfig) -> int:
    """The static cache's length for a run of `positions` positions (prompt + new tokens): rounded up
    to CACHE_QUANTUM, so that runs of about the same length share an engine, and no more than the model
    has. The KV cache is sized to the run, not to the model's 131,072 positions."""
    if positions < 2:
        raise ValueError(f"a run needs at least 2 positions (a prompt token and a new one), got {positions}")
    return min(config.max_position_embeddings, math.ceil(positions / CACHE_QUANTUM) * CACHE_QUANTUM)
