"""The persistent step's plan (gpt2/fast/plan.py, step_plan) for every GPT-2 size and dtype, checked
against a model of what kernels/fused/decode_step.cu does with it, without a GPU: the producer's
item sequence (Stream::ranges: which bytes of which array land where in a slot) and the compute
warps' reads of it (linear_items, ItemRows, stage E's chunks). Per block, step position and item:
every item fits its slot in whole 16-byte copies, every value the compute warps read sits where the
producer put it, and across blocks and items every row of every stage is read exactly once (every
key below the position once per head, the key at the position from stage A's handoff).

The model follows decode_step.cu's Stream, linear_item, LinearSlot, ItemRows and stage E: an edit to
how the kernel cuts a share into items belongs here too."""

from collections import Counter

import pytest

import gpt2
import gpt2.fast as fast
from gpt2.fast.plan import STEP_MAX_SPLITS, STEP_SLOTS, STEP_THREADS, step_rows_dot_parts

# SMs and opt-in shared memory a block: H100 SXM and H200 alike (132, 227 KB), H100 PCIe 114
DEVICES = {"H100-H200": (132, 232_448), "H100-PCIe": (114, 232_448)}
SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MAX_LEN = 1024


PLANS = [pytest.param(size, dtype, sms, smem, id=f"{size}-{dtype}-{device}")
         for device, (sms, smem) in DEVICES.items() for size in SIZES for dtype in fast.DTYPES]


def share(N, b, G):  # decode_step.cu's share: ceil(N / G) rows a block
    per = -(-N // G)
    first = min(N, b * per)
    return first, min(N, first + per) - first


def piece(s, j, rows):  # decode_step.cu's piece: item j of a share, `rows` rows an item
    first, count = s
    a, e = min(count, j * rows), min(count, (j + 1) * rows)
    return first + a, e - a


class Model:
    """decode_step.cu for one plan: what the producer copies into each item (segments: array, first
    element, elements, bytes an element) and where the compute warps read each value."""

    def __init__(self, config, dtype, plan, max_len):
        self.c, self.plan, self.max_len = config, plan, max_len
        self.item = 2 if dtype == "bfloat16" else 4
        C, F, G, splits = config.n_embd, config.mlp_width, plan.blocks, plan.splits
        # Stream::count_items, as the kernel computes it from the plan's rows per item
        most = (-(-3 * C // G), 2 * -(-max_len // splits) + -(-C // splits), -(-F // G), -(-C // G))
        self.items = tuple(-(-m // r) for m, r in zip(most, plan.item_rows, strict=True))
        self.lm_chunks = (-(-config.vocab_size // G) - plan.lm_keep + plan.lm_rows - 1) // plan.lm_rows
        self.linear = {0: ("attn.c_attn", 3 * C, C, True), 2: ("mlp.c_fc", F, C, True), 3: ("mlp.c_proj", C, F, False)}

    # -- the producer (Stream::ranges) ----------------------------------------------------------------

    def linear_item(self, stage, b, j):
        name, N, K, ln = self.linear[stage]
        first, count = piece(share(N, b, self.plan.blocks), j, self.plan.item_rows[stage])
        out = [(name + ".ln_w", 0, K, 4)] if ln and j == 0 else []
        out.append((name + ".W", first * K, count * K, self.item))
        if ln:
            a0, a1 = first & ~1, min(N, (first + count + 1) & ~1)
            out.append((name + ".fold", a0, a1 - a0 if count else 0, 8))
        else:
            a0, a1 = first & ~3, min(N, (first + count + 3) & ~3)
            out.append((name + ".bias", a0, a1 - a0 if count else 0, 4))
        return out

    def split_rows(self, b, pos):
        """(head, split, k0, staged, proj first, proj count) as the producer computes them."""
        splits, HS = self.plan.splits, self.c.head_size
        head, split = divmod(b, splits)
        chunk = -(-(pos + 1) // splits)
        k0 = min(pos, split * chunk)
        staged = min(pos, k0 + chunk) - k0
        proj = share(self.c.n_embd, split, splits)
        return head, split, k0, staged, proj, HS

    def attention_item(self, b, pos, j):
        head, _, k0, staged, (p0, pn), HS = self.split_rows(b, pos)
        if head >= self.c.n_head:
            return []
        R = self.plan.item_rows[1]
        lo, hi = j * R, (j + 1) * R
        out = []
        at = (head * self.max_len + k0) * HS
        for name, src, first, count in (("k_cache", at, 0, staged), ("v_cache", at, staged, staged),
                                        ("w_proj", (head * self.c.n_embd + p0) * HS, 2 * staged, pn)):
            a, e = max(lo, first), min(hi, first + count)
            if a < e:
                out.append((name, src + (a - first) * HS, (e - a) * HS, self.item))
        return out

    def lm_item(self, b, k):
        s0, sn = share(self.c.vocab_size, b, self.plan.blocks)
        rows, keep = self.plan.lm_rows, self.plan.lm_keep
        n = max(0, min(rows, sn - keep - k * rows))
        first = s0 + keep + k * rows
        folds = ((first + n + 1) // 2 * 2 - (first & ~1)) if n else 0
        return [("wte", first * self.c.n_embd, n * self.c.n_embd, self.item), ("lnf_fold", first & ~1, folds, 8)]

    def items_of_layer(self, b, pos):
        """The producer's items of one layer, in order: (stage, index in the stage, segments)."""
        for stage in range(4):
            for j in range(self.items[stage]):
                yield stage, j, self.attention_item(b, pos, j) if stage == 1 else self.linear_item(stage, b, j)

    # -- the compute warps' reads --------------------------------------------------------------------

    def linear_reads(self, stage, b, j):
        """(byte offset in the slot, array, element) of every value linear_items reads from item j
        (LinearSlot, linear_ln_w): LayerNorm's weight (item 0), the rows' weights, their folds or biases."""
        name, N, K, ln = self.linear[stage]
        first, count = piece(share(N, b, self.plan.blocks), j, self.plan.item_rows[stage])
        at = 4 * K if ln and j == 0 else 0  # the rows' start
        reads = [(4 * k, name + ".ln_w", k) for k in (0, K - 1)] if at else []
        reads += [(at + (r * K + k) * self.item, name + ".W", (first + r) * K + k) for r in range(count) for k in (0, K - 1)]
        after = at + count * K * self.item
        vec, size = (".fold", 8) if ln else (".bias", 4)
        reads += [(after + ((first & (1 if ln else 3)) + r) * size, name + vec, first + r)
                  for r in range(count)]
        return reads, (first, count)

    def attention_reads(self, b, pos):
        """(item index, byte offset, array, element) of every value stage B reads (ItemRows over the
        consumer's staged rows), and the keys it takes: (head, key) pairs, the one at pos from qkv."""
        splits, HS, C = self.plan.splits, self.c.head_size, self.c.n_embd
        head, split = divmod(b, splits)
        chunk = -(-(pos + 1) // splits)
        k0 = min(pos + 1, split * chunk)  # the compute warps' k0, n and staged (decode_step.cu's stage B)
        n = min(pos + 1, k0 + chunk) - k0 if head < self.c.n_head else 0
        staged = max(0, min(n, pos - k0))
        keys = [(head, k0 + j) for j in range(n)]
        if head >= self.c.n_head:
            return [], keys, None
        p0, pn = share(C, split, splits)
        R = self.plan.item_rows[1]
        reads = []
        for q in range(2 * staged + pn):
            t, off = divmod(q, R)
            if q < staged:
                want = ("k_cache", (head * self.max_len + k0 + q) * HS)
            elif q < 2 * staged:
                want = ("v_cache", (head * self.max_len + k0 + q - staged) * HS)
            else:
                want = ("w_proj", (head * C + p0 + q - 2 * staged) * HS)
            reads += [(t, off * HS * self.item, *want), (t, (off * HS + HS - 1) * self.item, want[0], want[1] + HS - 1)]
        return reads, keys, (head, p0, pn)


def layout(segments):
    """The slot's bytes as the producer lays them: [(start, end, array, first element, bytes each)]."""
    out, at = [], 0
    for name, first, n, size in segments:
        if n:
            out.append((at, at + n * size, name, first, size))
            at += n * size
    return out, at


def lands(segments, offset):
    """(array, element) the producer put at byte `offset` of the slot."""
    for start, end, name, first, size in layout(segments)[0]:
        if start <= offset < end:
            return name, first + (offset - start) // size
    return None


def check_copies(segments, slot_bytes, what):
    placed, total = layout(segments)
    assert total <= slot_bytes, f"{what}: {total} bytes in a slot of {slot_bytes}"
    for start, end, name, first, size in placed:  # cp.async.bulk: 16-byte addresses and sizes
        assert start % 16 == 0 and (end - start) % 16 == 0 and first * size % 16 == 0, (what, name, first, end - start)


POSITIONS = (0, 1, 97, 511, MAX_LEN - 2)


@pytest.mark.parametrize("size,dtype,sms,smem", PLANS)
def test_every_size_plans_a_ring_of_at_least_two_slots_that_fits(size, dtype, sms, smem):
    config = gpt2.SIZES[size]
    plan = fast.step_plan(config, dtype, sms, MAX_LEN, smem)
    assert isinstance(plan, fast.StepPlan), f"{size} {dtype} on {sms} SMs: {plan}"
    m = Model(config, dtype, plan, MAX_LEN)
    assert plan.stage_items == m.items, "the plan's items per stage are the kernel's count"
    assert 2 <= plan.slots <= STEP_SLOTS and plan.slot_bytes % 128 == 0
    assert plan.smem + fast.STEP_STATIC_SMEM <= smem
    assert 1 <= plan.splits <= min(STEP_MAX_SPLITS, sms // config.n_head)
    assert -(-MAX_LEN // plan.splits) <= config.mlp_width  # the scores fit in_s
    for stage, (_, _, K, _) in m.linear.items():  # rows_dot's partial sums: one per thread
        assert plan.item_rows[stage] * step_rows_dot_parts(K) <= STEP_THREADS
    assert plan.lm_rows * step_rows_dot_parts(config.n_embd) <= STEP_THREADS
    assert 0 <= plan.lm_keep < -(-config.vocab_size // sms) and m.lm_chunks >= 1
    if size == "gpt2":  # GPT-2 small's whole shares fit a slot: one item a stage, as before items were split
        assert plan.stage_items == (1, 1, 1, 1)


@pytest.mark.parametrize("size,dtype,sms,smem", PLANS)
def test_every_item_fits_its_slot_and_holds_what_the_compute_warps_read(size, dtype, sms, smem):
    config = gpt2.SIZES[size]
    plan = fast.step_plan(config, dtype, sms, MAX_LEN, smem)
    m = Model(config, dtype, plan, MAX_LEN)
    for b in range(plan.blocks):
        for pos in POSITIONS:
            items = list(m.items_of_layer(b, pos))
            assert len(items) == sum(plan.stage_items)
            for stage, j, segments in items:
                check_copies(segments, plan.slot_bytes, f"block {b} pos {pos} stage {'ABCD'[stage]} item {j}")
                if stage != 1:
                    reads, _ = m.linear_reads(stage, b, j)
                    for offset, name, element in reads:
                        assert lands(segments, offset) == (name, element), (b, pos, stage, j, offset, name, element)
            reads, _, _ = m.attention_reads(b, pos)
            attention = [segments for stage, _, segments in items if stage == 1]
            for t, offset, name, element in reads:
                assert t < plan.stage_items[1], f"block {b} pos {pos}: stage B reads item {t} of {plan.stage_items[1]}"
                assert lands(attention[t], offset) == (name, element), (b, pos, t, offset, name, element)
        for k in range(m.lm_chunks):
            check_copies(m.lm_item(b, k), plan.slot_bytes, f"block {b} chunk {k} of wte")


@pytest.mark.parametrize("size,dtype,sms,smem", PLANS)
def test_every_row_of_every_stage_is_read_exactly_once(size, dtype, sms, smem):
    """Across blocks and items: every row of c_attn, c_fc and mlp.c_proj once; per head every key at or
    below the position once and every row of W_proj[h] once; every row of wte once (kept or streamed)."""
    config = gpt2.SIZES[size]
    plan = fast.step_plan(config, dtype, sms, MAX_LEN, smem)
    m = Model(config, dtype, plan, MAX_LEN)
    C, NH, V = config.n_embd, config.n_head, config.vocab_size
    for stage, (name, N, _, _) in m.linear.items():
        rows = Counter()
        for b in range(plan.blocks):
            for j in range(plan.stage_items[stage]):
                first, count = m.linear_reads(stage, b, j)[1]
                rows.update(range(first, first + count))
        assert sorted(rows) == list(range(N)) and set(rows.values()) == {1}, name
    for pos in POSITIONS:
        keys, proj = Counter(), Counter()
        for b in range(plan.blocks):
            _, taken, rows = m.attention_reads(b, pos)
            keys.update(taken)
            if rows is not None:
                head, p0, pn = rows
                proj.update((head, n) for n in range(p0, p0 + pn))
        assert sorted(keys) == [(h, k) for h in range(NH) for k in range(pos + 1)] and set(keys.values()) == {1}, pos
        assert sorted(proj) == [(h, n) for h in range(NH) for n in range(C)] and set(proj.values()) == {1}, pos
    wte = Counter()
    for b in range(plan.blocks):
        s0, sn = share(V, b, plan.blocks)
        wte.update(range(s0, s0 + min(plan.lm_keep, sn)))
        for k in range(m.lm_chunks):
            _, first, n, _ = m.lm_item(b, k)[0]
            wte.update(range(first // C, (first + n) // C))
    assert sorted(wte) == list(range(V)) and set(wte.values()) == {1}


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_a_ring_of_more_slots_splits_the_shares_further(ring):
    """step_plan(ring=n): items small enough for n slots (a knob for measuring), GPT-2 small included."""
    for size in SIZES:
        for dtype in fast.DTYPES:
            plan = fast.step_plan(gpt2.SIZES[size], dtype, 132, MAX_LEN, 232_448, ring=ring)
            assert isinstance(plan, fast.StepPlan) and plan.slots >= ring, (size, dtype, plan)
    with pytest.raises(ValueError, match="ring must be 2..8 slots"):
        fast.step_plan(gpt2.SIZES["gpt2"], "float32", 132, MAX_LEN, 232_448, ring=1)


def test_splits_start_where_asked():
    """step_plan(splits=n): from n key splits a head up (a knob for measuring); more than the SMs hold per
    head, or none, is refused; the items it plans pass the same checks as the default plan's."""
    config = gpt2.SIZES["gpt2-medium"]
    assert fast.step_plan(config, "bfloat16", 132, MAX_LEN, 232_448).splits == fast.STEP_SPLITS["bfloat16"]
    plan = fast.step_plan(config, "bfloat16", 132, MAX_LEN, 232_448, splits=8)
    assert isinstance(plan, fast.StepPlan) and plan.splits == 8
    m = Model(config, "bfloat16", plan, MAX_LEN)
    for b in (0, 7, 8, 127, 131):
        for pos in POSITIONS:
            reads, _, _ = m.attention_reads(b, pos)
            attention = [segments for stage, _, segments in m.items_of_layer(b, pos) if stage == 1]
            for t, offset, name, element in reads:
                assert lands(attention[t], offset) == (name, element), (b, pos, t, offset, name, element)
    for bad in (0, 9):  # 16 heads on 132 SMs: at most 8 splits a head
        with pytest.raises(ValueError, match="splits must be 1..8"):
            fast.step_plan(config, "bfloat16", 132, MAX_LEN, 232_448, splits=bad)
