"""What the fast path runs and with what geometry, computed without a GPU: when it runs at all
(unsupported_reason), the kernels it compiles (kernel_expressions), their launch shapes (gemv,
lm_head, decode_attention, gemm.cu's split K) and the persistent step's plan (step_plan)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import driver
from lm.engine import common_reason

from ..config import GPT2Config

STEPS_PER_GRAPH = 8  # decode steps per captured graph, and tokens per copy back to the host
# decode steps per decode_step.cu launch (and per copy back) where the engine is persistent: a launch
# boundary costs the launch, the copy back and the weight stream's first items (docs/decode.md#constants)
STEPS_PER_LAUNCH = 32
PREFETCH_CAP = 16 << 20  # bytes of the next kernel's weights a kernel asks L2 to fetch (L2: 50 MB on H100/H200)
DTYPES = ("float32", "bfloat16")
EPI_BIAS, EPI_GELU, EPI_RESIDUAL = 0, 1, 2  # gemv.cu's epilogues
NULL = np.uint64(0)  # a null pointer argument
GEMM_OPTIONS = ("-arch=sm_90a",)  # gemm.cu: TF32 wgmma
GEMM_TILE, GEMM_BK, GEMM_STAGES = 64, 32, 4  # gemm.cu's output tile (square), K tile and pipeline depth
GEMM_SMEM = 2048 + GEMM_STAGES * (2 * GEMM_TILE * GEMM_BK * 4 + GEMM_TILE * (GEMM_BK + 4) * 4)  # its shared memory
GEMM_NONE, GEMM_BIAS, GEMM_BIAS_GELU = 0, 1, 2  # gemm.cu's epilogues


# -- what the fast path runs -----------------------------------------------------------------------


def param_dtype(params: dict) -> str:
    return params["wte.weight"].dtype.name


def unsupported_reason(params: dict, config: GPT2Config, *, kv_cache: bool, sampler=None,
                       record_logits: bool = False, dtype: str | None = None) -> str | None:
    """None when fast.generate runs this generation; otherwise why generate() takes the eager path."""
    why = common_reason(params["wte.weight"], sampler=sampler, record_logits=record_logits)
    if why is not None:
        return why
    dtype = dtype or param_dtype(params)
    if dtype not in DTYPES:
        return f"dtype {dtype}: the fast path runs {' and '.join(DTYPES)}"
    if not kv_cache and dtype != "float32":
        return "no-cache mode in bfloat16: the fast no-cache path computes in float32"
    C, HS = config.n_embd, config.head_size
    if C % 8 or config.mlp_width % 8:
        return f"widths {C} and {config.mlp_width} must be multiples of 8 (whole 16-byte rows)"
    if HS % 8 or 32 % (HS // 8) or HS > 256:
        return f"head size {HS}: decode_attention needs a multiple of 8 with head_size / 8 dividing 32"
    return None


# -- launch shapes ---------------------------------------------------------------------------------


def gemv_shape(N: int, K: int, itemsize: int, *, most_rows: int = 2, loads: int = 8) -> tuple[int, int]:
    """(warps per block, rows per warp) for gemv.cu: about `loads` 16-byte loads in flight per lane,
    8 warps per block for wide outputs, 4 for narrow ones (more blocks to spread over the SMs)."""
    chunks = K // (16 // itemsize)  # 16-byte vectors per row
    iters = -(-chunks // 32)  # per lane
    rows = max(1, min(most_rows, loads // iters))
    warps = 8 if N > 1024 else 4
    return warps, rows


def lm_head_shape(config: GPT2Config, dtype: str) -> tuple[int, int]:
    """(warps, rows per group) of lm_head_argmax.cu: 8 warps, groups of about 8 16-byte loads per lane
    (two groups in flight, so about 16 loads per lane), at least one row."""
    iters = -(-config.n_embd // (16 // (2 if dtype == "bfloat16" else 4)) // 32)  # 16-byte loads per row, per lane
    return 8, max(1, 8 // iters)


def lm_head_blocks(fn, warps: int, rows: int, V: int, sm_count: int) -> int:
    """lm_head_argmax.cu's grid: one wave, as many blocks as the SMs hold at once (the kernel's
    occupancy), no more than there are row groups for their warps."""
    per_sm = driver.blocks_per_sm(fn, warps * 32)
    groups = -(-V // rows)
    return max(1, min(sm_count * per_sm, -(-groups // warps)))


def kernel_expressions(config: GPT2Config, dtype: str, *, reduce_heads: bool | None = None
                       ) -> dict[str, tuple[str, str]]:
    """Every kernel the engine compiles for this model and dtype: key -> (kernels/fused file, name
    expression). No device needed: the CPU tests compile exactly these. reduce_heads: decode_step's
    REDUCE_HEADS where given, else step_reduce_heads's choice."""
    C, F, HS = config.n_embd, config.mlp_width, config.head_size
    item = 2 if dtype == "bfloat16" else 4
    wt = "unsigned short" if dtype == "bfloat16" else "float"

    def gemv(N, K, ln, epi):
        warps, rows = gemv_shape(N, K, item)
        return "gemv", f"gemv<{wt}, {K}, {warps}, {rows}, {'true' if ln else 'false'}, {epi}>"

    lm_warps, lm_rows = lm_head_shape(config, dtype)
    reduce = step_reduce_heads(config) if reduce_heads is None else reduce_heads
    return {
        "c_attn": gemv(3 * C, C, True, EPI_BIAS),
        "c_proj": gemv(C, C, False, EPI_RESIDUAL),
        "c_fc": gemv(F, C, True, EPI_GELU),
        "mlp_proj": gemv(C, F, False, EPI_RESIDUAL),
        "attention": ("decode_attention", f"decode_attention<{wt}, {HS}, {attention_warps(config)}>"),
        "embed": ("embed", f"embed<{wt}>"),
        "lm_head": ("lm_head_argmax", f"lm_head_argmax<{wt}, {C}, {lm_warps}, {lm_rows}>"),
        # the whole-sequence pass (engine.sequence): its activations in the run's dtype, the residual float32
        "add_layernorm": ("layernorm", f"add_layernorm<256, {wt}>"),
        "bias": ("bias_act", f"bias_act<false, {wt}>"),
        "bias_gelu": ("bias_act", f"bias_act<true, {wt}>"),
        "kv_store": ("kv_store", f"kv_store<{wt}>"),
        "merge_heads": ("merge_heads", f"merge_heads<{wt}>"),
        "spin": ("spin", "spin"),
        **({"decode_step": ("decode_step", f"decode_step<{wt}, {C}, {config.n_head}, {HS}, {F}, {STEP_THREADS}, "
                                           f"{'true' if reduce else 'false'}>")}
           if HS % 32 == 0 and STEP_THREADS % HS == 0 else {}),
    }


def gemm_splits(M: int, N: int, K: int, sm_count: int) -> int:
    """gemm.cu's splits of K (grid z): where the output tiles are fewer than the SMs, enough splits to
    give every SM a block, each split keeping at least two K tiles."""
    blocks = (N // GEMM_TILE) * -(-M // GEMM_TILE)
    return max(1, min(-(-sm_count // blocks), K // GEMM_BK // 2))


def gemm_expressions() -> dict[str, tuple[str, str]]:
    """gemm.cu's instantiations, one per epilogue (compiled with GEMM_OPTIONS, for sm_90a)."""
    return {f"gemm_{epi}": ("gemm", f"gemm_tf32x3<{epi}>") for epi in (GEMM_NONE, GEMM_BIAS, GEMM_BIAS_GELU)}


def attention_warps(config: GPT2Config) -> int:
    return max(4, config.head_size // 32)  # a block holds at least one thread per element of a head


STAGE_BYTES = 64 << 10  # shared memory for the K and V rows a decode_attention block copies before its wait


def attention_staging(max_len: int, splits: int, head_size: int, itemsize: int) -> tuple[int, int]:
    """(rows staged per block, dynamic shared memory bytes) of decode_attention.cu: the scores of the
    longest chunk, ceil(max_len / splits) floats, then K and V rows, up to STAGE_BYTES."""
    cap = -(-max_len // splits)
    rows = min(cap, STAGE_BYTES // (2 * head_size * itemsize))
    return rows, 4 * (-(-cap // 4) * 4) + 2 * rows * head_size * itemsize


STEP_THREADS = 320  # decode_step.cu's compute threads (a multiple of 64); one more warp issues the weight stream
STEP_BLOCK = STEP_THREADS + 32  # 11 warps, at most 3 on an SM sub-partition: up to 168 registers a thread
STEP_SLOTS = 8  # at most this many weight slots in decode_step.cu's ring
STEP_MAX_SPLITS = 12  # decode_step.cu's MAX_SPLITS
# Key splits per head that stage B starts from (step_plan takes more where these do not fit): fewer
# than one per block, since a head's splits wait for each other (docs/decode.md#constants)
STEP_SPLITS = {"float32": 8, "bfloat16": 6}
STEP_STAGES = ("ln_1+attn.c_attn", "attn+attn.c_proj", "residual+ln_2+mlp.c_fc+gelu",
               "mlp.c_proj+residual")  # decode_step.cu's stages A-D of a layer (E, the lm_head, ends the step)
STEP_STATIC_SMEM = 4 << 10  # headroom for decode_step.cu's static shared memory (about 2 KB)


LAYER_POINTERS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight",
                  "attn.c_attn.fold", "attn.c_proj.bias", "mlp.c_fc.fold", "mlp.c_proj.bias",
                  "ln_1.weight", "ln_2.weight", "k_cache", "v_cache")  # decode_step.cu's Layer
FOLDS = {"attn.c_attn": "ln_1", "mlp.c_fc": "ln_2"}  # the linear layers decode_step.cu folds a LayerNorm into


def step_proj_rounds(config: GPT2Config) -> int:
    """Round trips through L2 one after another in decode_step.cu's proj_input (every block gathering every
    head's term of attn.c_proj for every column of x): C / 4 columns over STEP_THREADS threads, each column
    12 heads' loads at once where NH <= 12, else groups of 10."""
    group = config.n_head if config.n_head <= 12 else 10
    return -(-config.n_embd // 4 // STEP_THREADS) * -(-config.n_head // group)


# decode_step.cu's REDUCE_HEADS: where proj_input would take more round trips than this, each block sums
# the heads' terms for its own columns of x and hands them on (reduce_heads), one handoff more
STEP_REDUCE_ROUNDS = 2


def step_reduce_heads(config: GPT2Config) -> bool:
    return step_proj_rounds(config) > STEP_REDUCE_ROUNDS


# decode_step.cu's switches by model and dtype, where a GPT-2 size measured faster with other values than
# the file's defaults (GPT-2 small's): the producer's pause (ISSUE_DELAY_NS, and whether it pauses where a
# slot frees mid-stage, DELAY_MID_STAGE, and before an empty item, DELAY_EMPTY) and PROJ_GROUP. Keyed by
# (n_layer, n_embd, dtype). H200, tools/step_variants.py at positions 64, 200 and 600: the best of the
# settings tried, faster than the defaults at all three (decode_step.cu's header has the figures).
STEP_SWITCHES = {
    (24, 1024, "float32"): {"DELAY_MID_STAGE": 0},
    (24, 1024, "bfloat16"): {"DELAY_MID_STAGE": 0, "DELAY_EMPTY": 0, "ISSUE_DELAY_NS": 150},
    (36, 1280, "float32"): {"DELAY_EMPTY": 0, "ISSUE_DELAY_NS": 700},
    (36, 1280, "bfloat16"): {"DELAY_MID_STAGE": 0, "PROJ_GROUP": 20},
    (48, 1600, "float32"): {"DELAY_MID_STAGE": 0, "DELAY_EMPTY": 0, "ISSUE_DELAY_NS": 1200},
    (48, 1600, "bfloat16"): {"DELAY_MID_STAGE": 0, "ISSUE_DELAY_NS": 400},
}


def step_options(config: GPT2Config, dtype: str) -> tuple[str, ...]:
    """The NVRTC options decode_step.cu is compiled with for this model and dtype: STEP_SWITCHES' defines."""
    return tuple(f"-D{name}={value}" for name, value in STEP_SWITCHES.get((config.n_layer, config.n_embd, dtype),
                                                                          {}).items())


def with_options(base: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    """base's NVRTC options, then extra's: a define in extra replaces base's define of the same macro."""
    def macro(option: str) -> str | None:
        return option[2:].split("=")[0] if option.startswith("-D") else None

    given = {macro(o) for o in extra} - {None}
    return tuple(o for o in base if macro(o) not in given) + tuple(extra)


STEP_RING = 3  # slots the ring aims for where items as large as the shares allow do not fit two (2 and 4 slower
# at gpt2-xl: decode_step.cu's header)


@dataclass(frozen=True)
class StepPlan:
    """decode_step.cu's geometry for one model, dtype and device: G blocks (one per SM), `splits` key
    splits per head in stage B, a ring of `slots` shared-memory slots of `slot_bytes` each (the largest
    item of the weight stream), wte streamed `lm_rows` rows per item past the first `lm_keep` of a
    block's rows, which it keeps in shared memory, `smem` dynamic bytes in all. A block's share of
    stages A-D is streamed as `stage_items` items each (every block the same count), of at most
    `item_rows` rows: rows of the matrix in stages A, C and D; in stage B rows of HS weights of a
    split's sequence (its staged keys, their values, its rows of W_proj[h])."""

    blocks: int
    splits: int
    slot_bytes: int
    slots: int
    lm_rows: int
    lm_keep: int
    smem: int
    item_rows: tuple[int, int, int, int]
    stage_items: tuple[int, int, int, int]


def step_plan(config: GPT2Config, dtype: str, sm_count: int, max_len: int, smem_limit: int,
              ring: int | None = None, splits: int | None = None) -> StepPlan | str:
    """The persistent step's geometry (kernels/fused/decode_step.cu), or why it cannot run these shapes.
    First items as large as the shares allow (one item per stage where a share fits a slot, the slot
    the largest, as many as fit, at least two), from STEP_SPLITS key splits up; where none fits two,
    shares split into items small enough for STEP_RING slots, else for two. ring: items sized for that
    many slots; splits: from this many key splits up (both for measuring)."""
    NH, HS = config.n_head, config.head_size
    item = 2 if dtype == "bfloat16" else 4
    if HS % 32 or STEP_THREADS % HS:
        return f"head size {HS}: decode_step needs a multiple of 32 dividing {STEP_THREADS}"
    G = sm_count
    most = min(G // NH, STEP_MAX_SPLITS)
    if most < 1:
        return f"{NH} heads on {G} SMs: decode_step needs a block per head"
    if ring is not None and not 2 <= ring <= STEP_SLOTS:
        raise ValueError(f"ring must be 2..{STEP_SLOTS} slots, got {ring}")
    if splits is not None and not 1 <= splits <= most:
        raise ValueError(f"splits must be 1..{most} key splits a head ({NH} heads on {G} SMs), got {splits}")
    first = min(STEP_SPLITS[dtype], most) if splits is None else splits
    why = ""
    for slots in (None, *sorted({STEP_RING, 2}, reverse=True)) if ring is None else (ring,):
        for n in range(first, most + 1):  # the fewest from the first that fit
            plan = _step_plan(config, item, G, n, max_len, smem_limit, slots)
            if isinstance(plan, StepPlan):
                return plan
            why = plan
    return why


def step_rows_dot_parts(K: int) -> int:
    """decode_step.cu's rows_dot: a row of K weights in this many parts of at most 768 (a thread's sum each)."""
    return -(-K // 768)


def step_fixed_smem(config: GPT2Config) -> int:
    """decode_step.cu's dynamic shared memory beside the ring and the kept rows, with the static's headroom:
    the mbarriers, the input vector (F floats) and x (C floats), the layer table."""
    table = config.n_layer * 8 * len(LAYER_POINTERS)
    return 128 + 4 * (config.mlp_width + config.n_embd) + table + STEP_STATIC_SMEM


def step_linear_item_bytes(rows: int, K: int, item: int, ln: bool) -> int:
    """The most bytes of a linear stage's item of `rows` rows of K weights (decode_step.cu's linear_item):
    LayerNorm's weight (item 0), the rows, then the rows' folds from the 16-byte boundary at or below the
    first, or with no LayerNorm the rows' biases from theirs."""
    return rows * K * item + (4 * K + 8 * (rows + 2) if ln else 4 * (rows + 8))


def step_sequence_rows(config: GPT2Config, splits: int, max_len: int) -> int:
    """Stage B's rows of HS weights a split streams at most: its keys and values below the position
    (ceil(max_len / splits) of each), then its rows of the head's W_proj[h]."""
    return 2 * -(-max_len // splits) + -(-config.n_embd // splits)


def _step_plan(config: GPT2Config, item: int, G: int, splits: int, max_len: int, smem_limit: int,
               ring: int | None) -> StepPlan | str:
    """step_plan with `splits` key splits per head, items as large as the shares allow (ring None) or
    small enough for `ring` slots."""
    C, HS, F = config.n_embd, config.head_size, config.mlp_width
    cap = -(-max_len // splits)  # keys per split, at most
    if cap > F:
        return f"{cap} keys per split: decode_step keeps the scores in {F} floats"
    fixed = step_fixed_smem(config)
    room = smem_limit - fixed - 4 * C - 16  # for the ring: the kept rows' LN_f weight and folds' alignment stay
    budget = None if ring is None else room // ring // 128 * 128  # bytes an item may take

    def rows(N):
        return -(-N // G)

    def pieces(total, most):  # (rows per item, items): as few items as hold `most` rows, the rows spread evenly
        items = -(-total // max(1, most))
        return -(-total // items), items

    # stages A, C, D: items of at most the rows that fit the budget, and at most one row part per thread
    # (rows_dot's partial sums, one per thread); stage B: rows of HS weights
    shapes = ((3 * C, C, True), (F, C, True), (C, F, False))
    linear = []
    for N, K, ln in shapes:
        most = min(rows(N), STEP_THREADS // step_rows_dot_parts(K))
        if budget is not None:
            most = min(most, (budget - step_linear_item_bytes(0, K, item, ln)) // (K * item + (8 if ln else 4)))
            if most < 1:
                row = -(-step_linear_item_bytes(1, K, item, ln) // 128) * 128
                return (f"decode_step needs {'two' if ring == 2 else ring} slots of {row} bytes (one row of {K} weights with its vectors) and "
                        f"{smem_limit - room} more of shared memory; the device has {smem_limit}")
        linear.append(pieces(rows(N), most))
    sequence = step_sequence_rows(config, splits, max_len)
    attention = pieces(sequence, sequence if budget is None else budget // (HS * item))
    (rows_a, items_a), (rows_c, items_c), (rows_d, items_d) = linear
    biggest = max(step_linear_item_bytes(r, K, item, ln) for (r, _), (_, K, ln) in zip(linear, shapes, strict=True))
    slot = -(-max(biggest, attention[0] * HS * item, 8 * C + C * item) // 128) * 128
    slots = min(STEP_SLOTS, room // slot)
    if slots < 2:
        return (f"decode_step needs two slots of {slot} bytes and {smem_limit - room} more of shared memory; the device "
                f"has {smem_limit}")
    # stage E: chunks of lm_rows rows of wte with their folds (decode_step.cu's wte_rows), as large as the
    # slot (docs/decode.md#constants), and the rows a block keeps in the shared memory left over (KeptRows:
    # the rows, LN_f's weight, the folds), at least one row less than its share, so that every block
    # streams at least one chunk.
    parts = step_rows_dot_parts(C)
    lm_rows = max(1, min(STEP_THREADS // parts, (slot - 16) // (C * item + 8)))
    left = smem_limit - fixed - slots * slot - 4 * C - 16
    lm_keep = max(0, min(STEP_THREADS // parts, rows(config.vocab_size) - 1, left // (C * item + 8)))
    kept = lm_keep * C * item + 4 * C + 8 * (lm_keep + 2)
    return StepPlan(blocks=G, splits=splits, slot_bytes=slot, slots=slots, lm_rows=lm_rows, lm_keep=lm_keep,
                    smem=fixed - STEP_STATIC_SMEM + slots * slot + kept,
                    item_rows=(rows_a, attention[0], rows_c, rows_d), stage_items=(items_a, attention[1], items_c, items_d))
