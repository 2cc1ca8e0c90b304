"""Model checks of four persistent kernels' protocols (the kernels themselves run only on the GPU): v24_persistent's
below, kernels/fused/decode_step.cu's weight stream after it (its plans' slot counts and items; a release
before the reads end fails it), and b07_persistent's backward and b08_pingpong's turns on it at the end.

v24_persistent across tiles: random interleavings of the producer thread, the consumer
warpgroups (one agent each) and the copy engine, for several blocks sharing the tile counter.
Checks: no deadlock; every parity wait returns for the phase it means (never two phases behind);
no wgmma reads a buffer before its copy landed or after it was refilled; no copy is issued into a
buffer a product still reads; each tile slot read holds the tile it should; turns alternate; every
named barrier generation is one wait and one pass, none left half arrived; the counter ends at
zero and every tile is done once; the producer leaves with no copy in flight.

v26_fp8_persistent and v27_fp8_row_sums run the same protocol without the turns (the model with them
switched off). The model follows kernels/v24_persistent.cu step by step: an edit to its barriers, turns, ring
counter, tile slots or draws belongs here too. Breaking any one of them here (no Q empty barrier,
Q released a step early, one tile slot, the ring restarting per tile, no first or last turn pass,
the counter reset one draw early, the producer leaving without waiting) fails this test."""
import heapq
import random

import pytest


class Fail(Exception):
    pass


class MBarrier:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.tx, self.phase = name, count, count, 0, 0

    def arrive(self, tx=0):
        self.pending -= 1
        self.tx += tx
        if self.pending < 0:
            raise Fail(f"{self.name}: more arrivals than its count")
        self._complete()

    def expect(self, tx):
        """expect_tx: bytes still to come, announced without an arrival."""
        self.tx += tx

    def complete_tx(self, tx):
        self.tx -= tx
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def ready(self, parity, meant):
        """try_wait.parity: true once the phase of this parity has completed; `meant` is the phase
        the code means: completed phases beyond meant + 1 mean the waiter fell two phases behind."""
        done = (self.phase & 1) != parity
        if self.phase >= meant + 2:
            raise Fail(f"{self.name}: waiter for phase {meant} is two phases behind (phase {self.phase})")
        if done and self.phase != meant + 1:
            raise Fail(f"{self.name}: wait for phase {meant} returned at phase {self.phase}")
        return done


class Named:
    """bar.sync / bar.arrive of 256 threads: two warpgroup arrivals complete a generation."""

    def __init__(self, name):
        self.name, self.arrivals, self.waiters, self.generation = name, [], [], 0

    def arrive(self, who, waits):
        self.arrivals.append((who, waits))
        if len(self.arrivals) == 2:
            kinds = sorted(w for _, w in self.arrivals)
            if kinds != [False, True]:
                raise Fail(f"named barrier {self.name}: a generation of {self.arrivals}, not one wait and one pass")
            self.arrivals = []
            self.generation += 1
        return self.generation


def interleave(rnd, agents, copies, land, copy_per_pending=False, limit=100_000):
    """Run the agents (generators that yield None, or the condition they wait on) and land the pending
    copies (land(copy), popped from `copies`, which the agents append to) in a random order until every
    agent is done and every copy has landed: Fail on a deadlock or past `limit` picks. A pending copy is
    one choice beside the ready agents, or one per copy with copy_per_pending."""
    blocked = {i: None for i in range(len(agents))}  # agent -> condition it waits on
    alive = set(blocked)
    for _ in range(limit):
        if not (alive or copies):
            return
        ready = [i for i in alive if blocked[i] is None or blocked[i]()]
        choices = ready + ["copy"] * (len(copies) if copy_per_pending else min(len(copies), 1))
        if not choices:
            raise Fail(f"deadlock: {len(alive)} agents blocked")
        pick = rnd.choice(choices)
        if pick == "copy":
            land(copies.pop(rnd.randrange(len(copies))))
            continue
        try:
            blocked[pick] = next(agents[pick])
        except StopIteration:
            alive.discard(pick)
            blocked[pick] = None
    raise Fail(f"no end after {limit} picks: the agents keep working")


def run(tiles_Tc, G, C, S, seed, turns_on=True):
    rnd = random.Random(seed)
    N = len(tiles_Tc)
    counter = [0]
    done_tiles = []
    copies = []  # (block, buffer key, tag, barrier, tx)
    agents = []

    def block(b):
        Q_full, Q_empty = MBarrier(f"b{b} Q_full", 1), MBarrier(f"b{b} Q_empty", C)
        K_full = [MBarrier(f"b{b} K_full{s}", 1) for s in range(S)]
        V_full = [MBarrier(f"b{b} V_full{s}", 1) for s in range(S)]
        K_empty = [MBarrier(f"b{b} K_empty{s}", C) for s in range(S)]
        V_empty = [MBarrier(f"b{b} V_empty{s}", C) for s in range(S)]
        turns = [Named(f"b{b} turn{c}") for c in range(C)]
        content = {}  # buffer -> (tag, landed)
        readers = {}  # buffer -> set of consumers reading it
        slot = [None, None]
        issues = []

        def copy(key, tag, bar):
            if readers.get(key):
                raise Fail(f"block {b}: copy of {tag} into {key} while {readers[key]} read it")
            content[key] = (tag, False)
            bar.arrive(tx=1)

            def land():
                if content[key] != (tag, False):
                    raise Fail(f"block {b}: {key} changed under copy {tag}")
                content[key] = (tag, True)
                bar.complete_tx(1)
            copies.append((b, land))

        def issue(c, *buffers):  # consumer c's products, reading (buffer, tag) pairs, in its turn
            issues.append(c)
            for key, tag in buffers:
                if content.get(key) != (tag, True):
                    raise Fail(f"block {b} consumer {c}: reads {key} for {tag}, holds {content.get(key)}")
                readers.setdefault(key, set()).add(c)

        def landed(c, *buffers):  # wgmma.wait_group: these products are done reading
            for key, tag in buffers:
                if content.get(key) != (tag, True):
                    raise Fail(f"block {b} consumer {c}: {key} refilled while {tag} was read: {content.get(key)}")
                readers[key].discard(c)

        def producer():
            n, k, u = 0, b, 0
            while True:
                if n > 0:
                    yield lambda n=n: Q_empty.ready((n - 1) & 1, n - 1)
                tile = (k, tiles_Tc[k]) if k < N else (k, -1)
                slot[n % 2] = (n, tile)
                yield None
                if tile[1] < 0:
                    Q_full.arrive()
                    break
                copy("Q", n, Q_full)
                for _ in range(tile[1]):
                    if u >= S:
                        yield lambda u=u: K_empty[u % S].ready(((u // S) & 1) ^ 1, u // S - 1)
                    copy(f"K{u % S}", u, K_full[u % S])
                    yield None
                    if u >= S:
                        yield lambda u=u: V_empty[u % S].ready(((u // S) & 1) ^ 1, u // S - 1)
                    copy(f"V{u % S}", u, V_full[u % S])
                    yield None
                    u += 1
                ticket = counter[0]
                counter[0] += 1
                yield None
                if ticket == N - 1:
                    counter[0] = 0
                    yield None
                k = G + ticket
                n += 1
            for v in range(max(0, u - S), u):
                yield lambda v=v: K_full[v % S].ready((v // S) & 1, v // S)
                yield lambda v=v: V_full[v % S].ready((v // S) & 1, v // S)
            if any(cb == b for cb, _ in copies):
                raise Fail(f"block {b}: producer leaves with copies in flight")

        def consumer(c):
            def sync_turn():
                if not turns_on:  # v26, v27: each consumer issues when its operands have landed
                    return None
                g = turns[c].generation
                turns[c].arrive(("c", c), True)
                return lambda: turns[c].generation > g

            def pass_turn():
                if turns_on:
                    turns[(c + 1) % C].arrive(("c", c), False)

            if c == C - 1:
                pass_turn()
            u0, n = 0, 0
            while True:
                yield lambda n=n: Q_full.ready(n & 1, n)
                tag, tile = slot[n % 2]
                if tag != n:
                    raise Fail(f"block {b} consumer {c}: slot {n % 2} holds tile #{tag}, wants #{n}")
                if tile[1] < 0:
                    break
                T_c = tile[1]
                if T_c == 0:
                    Q_empty.arrive()
                else:
                    yield lambda u=u0: K_full[u % S].ready((u // S) & 1, u // S)
                    yield sync_turn()
                    issue(c, ("Q", n), (f"K{u0 % S}", u0))
                    pass_turn()
                    yield None
                    landed(c, ("Q", n), (f"K{u0 % S}", u0))
                    K_empty[u0 % S].arrive()
                    if T_c == 1:
                        Q_empty.arrive()
                    yield None
                    for j in range(1, T_c):
                        u = u0 + j
                        yield lambda u=u: K_full[u % S].ready((u // S) & 1, u // S)
                        yield lambda u=u: V_full[(u - 1) % S].ready(((u - 1) // S) & 1, (u - 1) // S)
                        yield sync_turn()
                        issue(c, ("Q", n), (f"K{u % S}", u), (f"V{(u - 1) % S}", u - 1))
                        pass_turn()
                        yield None
                        landed(c, ("Q", n), (f"K{u % S}", u))
                        K_empty[u % S].arrive()
                        if j == T_c - 1:
                            Q_empty.arrive()
                        yield None
                        landed(c, (f"V{(u - 1) % S}", u - 1))
                        V_empty[(u - 1) % S].arrive()
                        yield None
                    last = u0 + T_c - 1
                    yield lambda u=last: V_full[u % S].ready((u // S) & 1, u // S)
                    yield sync_turn()
                    issue(c, (f"V{last % S}", last))
                    pass_turn()
                    yield None
                    landed(c, (f"V{last % S}", last))
                    V_empty[last % S].arrive()
                u0 += T_c
                yield None
                if slot[n % 2] != (n, tile):  # the epilogue reads the tile again
                    raise Fail(f"block {b} consumer {c}: slot {n % 2} rewritten before tile #{n}'s epilogue")
                if c == 0:
                    done_tiles.append(tile[0])
                n += 1
            if c == 0:
                yield sync_turn()

        def check_end():
            for t in turns:
                if t.arrivals:
                    raise Fail(f"{t.name} left half arrived: {t.arrivals}")
            if turns_on and issues != [i % C for i in range(len(issues))]:
                raise Fail(f"block {b}: turns out of order {issues}")

        return [producer()] + [consumer(c) for c in range(C)], check_end

    checks = []
    for b in range(G):
        gens, check = block(b)
        agents.extend(gens)
        checks.append(check)
    interleave(rnd, agents, copies, land=lambda copy: copy[1]())
    for check in checks:
        check()
    if counter[0] != 0:
        raise Fail(f"counter ends at {counter[0]}")
    if sorted(done_tiles) != list(range(N)):
        raise Fail(f"tiles done {sorted(done_tiles)}")



CASES = [(C, S, G) for C in (2, 3) for S in (2, 3) for G in (1, 2, 3)]


@pytest.mark.parametrize("turns_on", [True, False], ids=["v24", "v26_v27"])  # the FP8 rungs: v24's protocol, no turns
@pytest.mark.parametrize("C,S,G", CASES)
def test_random_interleavings_keep_the_protocol(C, S, G, turns_on):
    rnd = random.Random(C * 100 + S * 10 + G)
    for i in range(150):
        tiles = [rnd.choice([0, 1, 1, 2, 3, 4, 5]) for _ in range(rnd.randint(G, 9))]
        try:
            run(tiles, G, C, S, seed=i, turns_on=turns_on)
        except Fail as exc:
            pytest.fail(f"run {i}: {C} consumers, {S} stages, {G} blocks, tiles with T_c {tiles}: {exc}")


# -- kernels/fused/decode_step.cu's weight stream --------------------------------------------------
# The producer lane copies item i into slot i % nslot once item i - nslot is released (an item of stage B,
# which reads the cache, also once the compute warps have passed the previous step's last barrier: the
# `stepped` mbarrier); the compute warps (WARPS agents) each wait for an item themselves, read it, meet at
# the named barrier, and thread 0 (warp 0) arrives on the slot's empty barrier; the step's last item goes
# back in `finish`, then thread 0 arrives on `stepped`. An empty item (an idle block's stage B) completes
# its phase on the producer's arrival.

WARPS = 3


def step_stream(kinds, steps, nslot, seed, release_early=False):
    """One block's stream over `steps` steps of items `kinds` (a step's stages in order: "A", "B", ...).
    release_early: thread 0 arrives on empty before the named barrier (the others may still read)."""
    rnd = random.Random(seed)
    per_step, total = len(kinds), steps * len(kinds)
    full = [MBarrier(f"full{s}", 1) for s in range(nslot)]
    empty = [MBarrier(f"empty{s}", 1) for s in range(nslot)]
    stepped = MBarrier("stepped", 1)
    content = [None] * nslot  # slot -> (item, landed)
    readers = [set() for _ in range(nslot)]
    copies = []
    sync = {"count": 0, "generation": 0}
    empty_items = {i for i in range(total) if kinds[i % per_step] == "B" and rnd.random() < 0.3}

    def producer():
        passed = 0
        for i in range(total):
            step, r = divmod(i, per_step)
            while kinds[r] == "B" and passed < step:
                yield lambda p=passed: stepped.ready(p & 1, p)
                passed += 1
            s = i % nslot
            if i >= nslot:
                yield lambda i=i, s=s: empty[s].ready((i // nslot - 1) & 1, i // nslot - 1)
            if readers[s]:
                raise Fail(f"item {i} copied into slot {s} while warps {sorted(readers[s])} read item {content[s][0]}")
            if i in empty_items:
                content[s] = (i, True)
                full[s].arrive()
            else:
                content[s] = (i, False)
                full[s].arrive(tx=1)

                def land(s=s, i=i):
                    content[s] = (i, True)
                    full[s].complete_tx(1)
                copies.append(land)
            yield None

    def compute_sync():
        g = sync["generation"]
        sync["count"] += 1
        if sync["count"] == WARPS:
            sync["count"], sync["generation"] = 0, g + 1
        return lambda: sync["generation"] > g

    def compute(w):
        for i in range(total):
            s = i % nslot
            yield lambda i=i, s=s: full[s].ready((i // nslot) & 1, i // nslot)  # take
            if content[s] != (i, True):
                raise Fail(f"warp {w} takes item {i} from slot {s}, which holds {content[s]}")
            readers[s].add(w)
            yield None
            if content[s] != (i, True):
                raise Fail(f"slot {s} refilled while warp {w} read item {i}: {content[s]}")
            if release_early and w == 0:
                empty[s].arrive()
            yield None
            readers[s].discard(w)
            yield compute_sync()  # release(), or finish()'s first sync
            if w == 0 and not release_early:
                empty[s].arrive()
            if i % per_step == per_step - 1:  # finish(): its second sync, then `stepped`
                yield compute_sync()
                if w == 0:
                    stepped.arrive()

    interleave(rnd, [producer()] + [compute(w) for w in range(WARPS)], copies, land=lambda copy: copy(),
               copy_per_pending=True)


def step_kinds(dtype, ring):
    """A step's items in stream order under step_plan for GPT-2 small's widths, 2 layers, on 132 SMs (the
    sanitizer's step targets), and the plan's slots."""
    import gpt2
    from gpt2.fast.plan import step_plan

    config = gpt2.GPT2Config(n_layer=2)
    plan = step_plan(config, dtype, 132, config.n_positions, 232_448, ring=ring)
    lm_chunks = (-(-config.vocab_size // plan.blocks) - plan.lm_keep + plan.lm_rows - 1) // plan.lm_rows
    layer = [kind for kind, n in zip("ABCD", plan.stage_items, strict=True) for _ in range(n)]
    return layer * config.n_layer + ["E"] * lm_chunks, plan.slots


@pytest.mark.parametrize("dtype,ring,slots", [("float32", None, 2), ("float32", 3, 3), ("bfloat16", None, 3)])
def test_decode_step_stream_keeps_every_slot_until_its_readers_are_done(dtype, ring, slots):
    kinds, nslot = step_kinds(dtype, ring)
    assert nslot == slots  # the sanitizer's reports were at 2 slots (float32's default) and not at 3
    for seed in range(40):
        try:
            step_stream(kinds, steps=3, nslot=nslot, seed=seed)
        except Fail as exc:
            pytest.fail(f"{dtype}, {nslot} slots, run {seed}: {exc}")


def test_decode_step_stream_model_catches_a_release_before_the_reads_end():
    kinds, nslot = step_kinds("float32", None)
    caught = 0
    for seed in range(40):
        try:
            step_stream(kinds, steps=3, nslot=nslot, seed=seed, release_early=True)
        except Fail as exc:
            caught += "while warps" in str(exc) or "refilled while" in str(exc)
    assert caught > 0


# -- kernels/backward/b07_persistent.cu -------------------------------------------------------------
# Block b takes tile b, then whichever the tile counter hands out: its producer lane 0 draws tile t's
# number and writes it into slot t % 2 once the consumers have read tile t - 2's there (the slot's empty
# barrier), then arrives on the slot's full barrier; past the last tile it hands out a number past the
# end, and everyone leaves. The other 31 lanes take the number from lane 0 (a shuffle: they wait for the
# draw). Lane 0 and the lanes (two agents) fill the ring of Q_i and dO_i, step n of the block (whatever
# its tile) in stage n % 2, use n // 2; lane 0 issues each tile's K_j and V_j after its first step's
# copies, once the consumers have released the previous tile's (K_j/V_j's empty barrier, use u - 1). The
# consumers (one agent: every thread does the same) wait for the slot, read it, release it, wait for K_j
# and V_j (use u), take the tile's steps, release each stage, then K_j and V_j, and write dK_j and dV_j.
# Breaking it (no wait on an empty barrier, a wrong parity, a release left out) fails the test below.


def b07_tiles(T_q, T_k, n_heads, kv_group, causal, deterministic, grid, B_r=128, B_c=128, d=64, l2_chunk=16 << 20,
              causal_rounds=16):
    """b07's item_at for every tile of the flat order: (j, kv_bh, steps)."""
    T_c, T_r, offset = -(-T_k // B_c), -(-T_q // B_r), T_k - T_q
    chunk = n_heads
    if not deterministic and (not causal or T_c * n_heads >= causal_rounds * grid):
        least = -(-2 * grid // T_c) if causal else 1
        chunk = min(n_heads, max(l2_chunk // (8 * kv_group * T_q * d), least))
    out = []
    for k in range(T_c * n_heads):
        first_head = k // (chunk * T_c) * chunk
        heads_here = min(chunk, n_heads - first_head)
        j, kv_bh = k % (chunk * T_c) // heads_here, first_head + k % (chunk * T_c) % heads_here
        first_tile = (max(0, j * B_c - offset) if causal else 0) // B_r
        out.append((j, kv_bh, kv_group * max(0, T_r - first_tile)))
    return out


@pytest.mark.parametrize("T_q, T_k, n_heads, kv_group, causal, deterministic", [
    (2048, 2048, 192, 1, True, False),  # a long causal grid: chunks of heads
    (2048, 2048, 193, 1, True, False),  # the last chunk short
    (1000, 1000, 7, 4, True, False),    # fewer tiles than blocks
    (300, 700, 12, 2, True, False),     # cross, causal bottom-right
    (2048, 2048, 192, 1, True, True),   # deterministic: one chunk
    (4096, 4096, 64, 1, False, False),  # non-causal: chunks of 8 heads at d = 64
    (4096, 4096, 64, 1, False, True),   # deterministic: one chunk
    (1000, 1000, 7, 4, False, False),   # non-causal, a K/V head's query side past a chunk: a head a chunk
])
@pytest.mark.parametrize("d, B_r", [(64, 128), (128, 64)])
def test_b07_takes_every_tile_once_heavy_first(T_q, T_k, n_heads, kv_group, causal, deterministic, d, B_r):
    T_c = -(-T_k // 128)
    tiles = b07_tiles(T_q, T_k, n_heads, kv_group, causal, deterministic, grid=min(132, T_c * n_heads), B_r=B_r, d=d)
    assert sorted((j, h) for j, h, _ in tiles) == [(j, h) for j in range(T_c) for h in range(n_heads)]
    assert tiles[0][2] == max(steps for *_, steps in tiles)
    heads_first = [h for j, h, _ in tiles if j == 0]
    if deterministic or (causal and T_c * n_heads < 16 * min(132, T_c * n_heads)):
        assert heads_first == list(range(n_heads)), "one chunk: every head's first key tile comes first"
    elif not causal:  # chunks of heads: a chunk's key tiles all come before the next chunk's first
        chunk = max(1, min(n_heads, (16 << 20) // (8 * kv_group * T_q * d)))
        assert [h for j, h, _ in tiles[:chunk * T_c]] == [h for _ in range(T_c) for h in range(chunk)]


def steps_per_block(steps, G, order):
    """Each of G blocks' steps when they take the tiles (heavy first) in `order`: "fixed" (block b tiles b,
    b + G, ...), "snake" (b counting up in even rounds of G, down in odd ones) or "counter" (b07's: tile b,
    then the next tile to whichever block has the fewest steps so far, the one a free block would draw)."""
    if order == "counter":
        load = [(steps[b], b) for b in range(min(G, len(steps)))]
        heapq.heapify(load)
        for s in steps[G:]:
            total, b = heapq.heappop(load)
            heapq.heappush(load, (total + s, b))
        return [total for total, _ in sorted(load, key=lambda entry: entry[1])]
    blocks = [0] * G
    for k, s in enumerate(steps):
        r, i = divmod(k, G)
        blocks[G - 1 - i if order == "snake" and r % 2 else i] += s
    return blocks


def test_b07_counter_balances_the_blocks_where_a_fixed_order_does_not():
    """docs/backward.md#b07's arithmetic: at 1 x 12 x 8192 the fixed order gives block 0 219 steps against
    a mean of 189 (it measured 0.87x of b06); a snake order evens that grid out but not 16 x 12 x 2048's
    chunks of heads, which the counter does."""
    def spread(T, B, order):
        blocks = steps_per_block([s for *_, s in b07_tiles(T, T, 12 * B, 1, True, False, 132)], 132, order)
        return blocks, max(blocks) / (sum(blocks) / len(blocks))

    blocks, worst = spread(8192, 1, "fixed")
    assert blocks[0] == max(blocks) == 219 and round(sum(blocks) / 132) == 189 and worst > 1.15
    assert spread(8192, 1, "snake")[1] < 1.01 and spread(8192, 1, "counter")[1] < 1.01
    assert spread(2048, 16, "snake")[1] > 1.3 and spread(2048, 16, "counter")[1] < 1.06


def b07_block(steps_of_tiles, seed, break_it=None, pingpong=False, turns_on=True, deterministic=False):
    """One block's agents over tiles with these step counts, interleaved at random with the copies: b07's
    consumers (one agent), or with pingpong b08's (two a warpgroup, below; turns_on False: without the
    turns; deterministic: each reduction waited for at once)."""
    C = 2 * PARTS if pingpong else 1  # consumer agents, each arriving once for all its threads
    full = [MBarrier(f"QdO_full{s}", 2) for s in range(2)]  # lane 0 and the other lanes
    empty = [MBarrier(f"QdO_empty{s}", C) for s in range(2)]  # the consumers
    kv_full, kv_empty = MBarrier("KV_full", 1), MBarrier("KV_empty", C)
    item_full = [MBarrier(f"item_full{s}", 1) for s in range(2)]  # lane 0
    item_empty = [MBarrier(f"item_empty{s}", C) for s in range(2)]  # the consumers
    stage, lse, kv, slot = [None, None], [None, None], [None], [None, None]
    reading, reading_kv = [set(), set()], set()  # the consumers reading each stage, and K_j and V_j
    copies, drawn = [], []
    END = len(steps_of_tiles)  # the number past the end

    def lane0():
        n = u = 0
        for t in range(END + 1):
            if t >= 2 and break_it != "no slot wait":
                yield lambda t=t: item_empty[t % 2].ready(t // 2 % 2 ^ 1, t // 2 - 1)
            slot[t % 2] = t
            item_full[t % 2].arrive()
            drawn.append(t)
            if t == END:
                break
            for step in range(steps_of_tiles[t]):
                if n >= 2 and break_it != "no stage wait":
                    yield lambda n=n: empty[n % 2].ready(n // 2 % 2 ^ 1, n // 2 - 1)
                full[n % 2].expect(2)
                copies.extend([("stage", n % 2, n, full[n % 2])] * 2)
                if reading[n % 2]:
                    raise Fail(f"lse_i of step {n} written while the consumers read its stage")
                lse[n % 2] = n
                full[n % 2].arrive()
                if step == 0:
                    if u > 0 and break_it != "no KV wait":
                        parity = (u - 1) & 1 if break_it != "KV parity" else u & 1
                        yield lambda u=u, parity=parity: kv_empty.ready(parity, u - 1)
                    kv_full.arrive(tx=2)
                    copies.extend([("kv", 0, u, kv_full)] * 2)
                    u += 1
                n += 1
                yield None
        if u > 0:
            yield lambda: kv_full.ready((u - 1) & 1, u - 1)
            for m in range(max(0, n - 2), n):
                yield lambda m=m: full[m % 2].ready(m // 2 % 2, m // 2)

    def lanes():
        n = 0
        for t in range(END + 1):
            yield lambda t=t: len(drawn) > t  # the shuffle from lane 0
            if t == END:
                break
            for _ in range(steps_of_tiles[t]):
                if n >= 2:
                    yield lambda n=n: empty[n % 2].ready(n // 2 % 2 ^ 1, n // 2 - 1)
                if reading[n % 2]:
                    raise Fail(f"lse_i of step {n} written while the consumers read its stage")
                lse[n % 2] = n
                full[n % 2].arrive()
                n += 1
                yield None

    def consumers():
        n = u = 0
        for t in range(END + 1):
            yield lambda t=t: item_full[t % 2].ready(t // 2 % 2, t // 2)
            if slot[t % 2] != t:
                raise Fail(f"the consumers read tile {slot[t % 2]} from slot {t % 2}, meaning tile {t}")
            item_empty[t % 2].arrive()
            if t == END:
                break
            steps = steps_of_tiles[t]
            if steps:
                yield lambda u=u: kv_full.ready(u & 1, u)
                reading_kv.add(0)
            for _ in range(steps):
                yield lambda n=n: full[n % 2].ready(n // 2 % 2, n // 2)
                reading[n % 2].add(0)
                for _ in range(2):  # the step's products, while copies land elsewhere
                    if (stage[n % 2], lse[n % 2], kv[0]) != (n, n, u):
                        raise Fail(f"step {n} of tile {u} read stage {stage[n % 2]}, lse {lse[n % 2]}, K/V {kv[0]}")
                    yield None
                reading[n % 2].discard(0)
                if break_it != "no stage release" or n != 1:
                    empty[n % 2].arrive()
                n += 1
            if steps:
                reading_kv.discard(0)
                kv_empty.arrive()
                u += 1

    def land(copy):
        if copy[0] == "reduce":  # b08's dQ_i reduction has read its shared memory
            return copy[1]()
        what, slot, value, barrier = copy
        if what == "stage":
            if reading[slot]:
                raise Fail(f"step {value}'s copy landed in a stage the consumers still read")
            stage[slot] = value
        else:
            if reading_kv:
                raise Fail(f"tile {value}'s K_j and V_j landed while the consumers still read the tile before")
            kv[0] = value
        barrier.complete_tx(1)

    agents, check_end = ([consumers()], lambda: None) if not pingpong else b08_consumers(
        steps_of_tiles, break_it, turns_on, deterministic, item_full, item_empty, slot, kv_full, kv_empty, kv,
        reading_kv, full, empty, stage, lse, reading, copies)
    interleave(random.Random(seed), [lane0(), lanes(), *agents], copies, land, copy_per_pending=True)
    check_end()


def test_b07_random_interleavings_keep_the_protocol():
    rnd = random.Random(7)
    real = [steps for k, (_, _, steps) in enumerate(b07_tiles(2048, 2048, 192, 1, True, False, 132)) if k % 132 == 0]
    for i in range(150):
        tiles = real if i == 0 else [rnd.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        try:
            b07_block(tiles, seed=i)
        except Fail as exc:
            pytest.fail(f"run {i}, tiles with steps {tiles}: {exc}")


@pytest.mark.parametrize("break_it", ["no stage wait", "no KV wait", "KV parity", "no stage release", "no slot wait"])
def test_b07_model_catches_a_broken_protocol(break_it):
    caught = []
    for seed in range(40):
        try:
            b07_block([3, 0, 0, 2, 0, 4, 1], seed=seed, break_it=break_it)
        except Fail as exc:
            caught.append(str(exc))
    assert caught, f"{break_it}: no run failed"


# -- kernels/backward/b08_pingpong.cu --------------------------------------------------------------
# b07's producer, ring, tiles and slots, with each consumer warpgroup as two agents: its warp 0 (whose
# thread 0 issues the dQ_i reductions and waits for them) and its warps 1-3, which meet only at barriers.
# The consumers take turns at the tensor core (named barriers of 256 threads: a generation is one
# consumer's two parts waiting and the other's two passing) and share dS^T's two buffers: each part
# writes its rows of dS^T(n) into buffer n % 2 once every part's readers of step n - 2 have landed (the
# buffer's empty barrier), arrives on its full barrier, and issues dQ_i(n) a step later, once every part has
# (the full barrier); a tile's last dQ_i goes alone in a turn after its last step, before K_j and V_j are
# released. dQ_i's share goes through shared memory (written by every part, then barrier 2 + c) to thread 0's
# reduction, which reads it until thread 0 waits for it: before the next turn with a dQ_i (deterministic:
# at once, pass_turn), and the other parts learn of that wait from the turn's barrier, or without the
# turns from barrier 2 + c. The turns alone order dQ_i(n) after the other consumer's rows of dS^T(n), so
# the full barrier matters to the kernel without them: the model runs both ways. Breaking it (no wait on
# either dS^T barrier, K_j released before the last dQ_i, a turn pass or take left out, no barrier after
# the reduction's wait without the turns) fails the tests below.

PARTS = 2  # agents a consumer warpgroup: warp 0 (thread 0's work too) and warps 1-3


class Gathering:
    """bar.sync / bar.arrive of several agents: `count` arrivals complete a generation; with `kinds`, a
    generation's arrivals (each a tag such as (consumer, waits)), sorted, must be that list."""

    def __init__(self, name, count, kinds=None):
        self.name, self.count, self.kinds, self.arrivals, self.generation = name, count, kinds, [], 0

    def arrive(self, tag):
        self.arrivals.append(tag)
        if len(self.arrivals) == self.count:
            if self.kinds is not None and sorted(self.arrivals) != self.kinds:
                raise Fail(f"{self.name}: a generation of {self.arrivals}")
            self.arrivals = []
            self.generation += 1

    def sync(self, tag):
        """bar.sync: arrive, and the condition the agent then waits on."""
        g = self.generation
        self.arrive(tag)
        return lambda: self.generation > g


def b08_consumers(steps_of_tiles, break_it, turns_on, deterministic, item_full, item_empty, slot, kv_full, kv_empty,
                  kv, reading_kv, full, empty, stage, lse, reading, copies):
    """The consumer agents of b08 (two a warpgroup), over b07_block's barriers and buffers; the turns,
    dS^T, dQ's shared memory and its reductions here."""
    END = len(steps_of_tiles)
    agents = [(c, p) for c in range(2) for p in range(PARTS)]
    turns = [Gathering(f"turn{c}", 2 * PARTS, sorted([(c, True)] * PARTS + [(1 - c, False)] * PARTS))
             for c in range(2)]
    own = [Gathering(f"barrier {2 + c}", PARTS) for c in range(2)]
    dS_full = [MBarrier(f"dS_full{b}", len(agents)) for b in range(2)]
    dS_empty = [MBarrier(f"dS_empty{b}", len(agents)) for b in range(2)]
    rows = [{}, {}]              # buffer -> {part: the step whose rows of dS^T it holds}
    dS_readers = [set(), set()]  # buffer -> (part, step) of the dQ_i products reading it
    share = [None, None]         # consumer -> the step whose dQ_i its shared memory holds
    reducing = [None, None]      # consumer -> the step whose reduction still reads that memory
    issued = []

    def take_turn(c, p):
        return turns[c].sync((c, True)) if turns_on else None

    def give_turn(c, p):
        if turns_on:
            turns[1 - c].arrive((c, False))

    def issue_dQ(part, m, u):
        if rows[m % 2] != dict.fromkeys(agents, m) or kv[0] != u:
            raise Fail(f"{part}'s dQ_i({m}) reads dS^T rows {rows[m % 2]}, K_j of tile {kv[0]}, not {u}")
        dS_readers[m % 2].add((part, m))

    def dQ_landed(part, m, u):
        if rows[m % 2] != dict.fromkeys(agents, m) or kv[0] != u:
            raise Fail(f"dS^T or K_j changed under {part}'s dQ_i({m}): {rows[m % 2]}, tile {kv[0]}")
        dS_readers[m % 2].discard((part, m))

    def share_free(c, p):  # before a turn whose products include a dQ_i
        if p == 0 and not deterministic:
            yield lambda: reducing[c] is None  # bulk_wait_read
        if not turns_on and break_it != "no share barrier":
            yield own[c].sync(p)

    def store_dQ(c, p, m):
        if reducing[c] is not None:
            raise Fail(f"consumer {c} part {p} writes dQ_i({m}) into the memory reduction {reducing[c]} still reads")
        share[c] = m
        yield own[c].sync(p)
        if p == 0:  # thread 0's reduction, read until it lands
            reducing[c] = m

            def land(c=c, m=m):
                if share[c] != m:
                    raise Fail(f"consumer {c}'s dQ_i memory changed under reduction {m}: holds {share[c]}")
                reducing[c] = None
            copies.append(("reduce", land))
            if deterministic:  # pass_turn: bulk_wait_all
                yield lambda: reducing[c] is None

    def consumer(c, p):
        part = (c, p)
        n = u = 0
        if c == 1 and turns_on and break_it != "no first pass":
            give_turn(c, p)
        for t in range(END + 1):
            yield lambda t=t: item_full[t % 2].ready(t // 2 % 2, t // 2)
            if slot[t % 2] != t:
                raise Fail(f"{part} read tile {slot[t % 2]} from slot {t % 2}, meaning tile {t}")
            item_empty[t % 2].arrive()
            if t == END:
                break
            steps = steps_of_tiles[t]
            if steps:
                yield lambda u=u: kv_full.ready(u & 1, u)
                reading_kv.add(part)
            for step in range(steps):
                yield lambda n=n: full[n % 2].ready(n // 2 % 2, n // 2)
                reading[n % 2].add(part)
                yield take_turn(c, p)  # S^T and dP^T
                issued.append(c)
                if (stage[n % 2], lse[n % 2], kv[0]) != (n, n, u):
                    raise Fail(f"step {n} of tile {u} read stage {stage[n % 2]}, lse {lse[n % 2]}, K/V {kv[0]}")
                give_turn(c, p)
                yield None  # landed
                if n >= 2 and break_it != "no dS empty wait":
                    yield lambda n=n: dS_empty[n % 2].ready(n // 2 % 2 ^ 1, n // 2 - 1)
                if dS_readers[n % 2]:
                    raise Fail(f"{part} writes dS^T({n}) while {dS_readers[n % 2]} read its buffer")
                rows[n % 2][part] = n
                dS_full[n % 2].arrive()
                if step > 0:
                    if break_it != "no dS full wait":
                        yield lambda m=n - 1: dS_full[m % 2].ready(m // 2 % 2, m // 2)
                    yield from share_free(c, p)
                yield take_turn(c, p)  # dV_j, dK_j and dQ_i(n - 1)
                issued.append(c)
                if stage[n % 2] != n:
                    raise Fail(f"step {n}'s dV_j and dK_j read stage {stage[n % 2]}")
                if step > 0:
                    issue_dQ(part, n - 1, u)
                give_turn(c, p)
                yield None  # landed
                if stage[n % 2] != n:
                    raise Fail(f"stage {n % 2} refilled under step {n}'s dV_j and dK_j")
                reading[n % 2].discard(part)
                empty[n % 2].arrive()
                if step > 0:
                    dQ_landed(part, n - 1, u)
                    dS_empty[(n - 1) % 2].arrive()
                    yield from store_dQ(c, p, n - 1)
                n += 1
            if steps:
                if break_it == "K_j released early":
                    reading_kv.discard(part)
                    kv_empty.arrive()
                if break_it != "no dS full wait":
                    yield lambda m=n - 1: dS_full[m % 2].ready(m // 2 % 2, m // 2)
                yield from share_free(c, p)
                yield take_turn(c, p)  # the tile's last dQ_i
                issued.append(c)
                issue_dQ(part, n - 1, u)
                give_turn(c, p)
                yield None
                dQ_landed(part, n - 1, u)
                if break_it != "K_j released early":
                    reading_kv.discard(part)
                    kv_empty.arrive()
                dS_empty[(n - 1) % 2].arrive()
                yield from store_dQ(c, p, n - 1)
                u += 1
        if c == 0 and turns_on and break_it != "no last take":
            yield take_turn(c, p)

    def check_end():  # every agent done: the turns alternated and no barrier is left half arrived
        assert len(issued) == len(agents) * sum(2 * s + (s > 0) for s in steps_of_tiles)
        if turns_on and issued != [i // PARTS % 2 for i in range(len(issued))]:
            raise Fail(f"turns out of order: {issued}")
        for turn in turns + own:
            if turn.arrivals:
                raise Fail(f"{turn.name} left half arrived: {turn.arrivals}")

    return [consumer(c, p) for c, p in agents], check_end


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("turns_on", [True, False], ids=["b08", "without_turns"])
def test_b08_random_interleavings_keep_the_protocol(turns_on, deterministic):
    rnd = random.Random(8)
    real = [steps for k, (_, _, steps) in enumerate(b07_tiles(2048, 2048, 192, 1, True, False, 132)) if k % 132 == 0]
    for i in range(100):
        tiles = real if i == 0 else [rnd.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        try:
            b07_block(tiles, seed=i, pingpong=True, turns_on=turns_on, deterministic=deterministic)
        except Fail as exc:
            pytest.fail(f"run {i}, tiles with steps {tiles}: {exc}")


@pytest.mark.parametrize("break_it,turns_on,deterministic", [
    ("no dS empty wait", True, False), ("no dS full wait", False, False), ("K_j released early", True, False),
    ("no first pass", True, False), ("no last take", True, False), ("no stage wait", True, False),
    ("no KV wait", True, False), ("no share barrier", False, False), ("no share barrier", False, True)])
def test_b08_model_catches_a_broken_protocol(break_it, turns_on, deterministic):
    caught = []
    for seed in range(80):
        try:
            b07_block([3, 0, 0, 2, 0, 4, 1], seed=seed, break_it=break_it, pingpong=True, turns_on=turns_on,
                      deterministic=deterministic)
        except Fail as exc:
            caught.append(str(exc))
    assert caught, f"{break_it}: no run failed"
