"""Model checks of two persistent kernels' protocols (the kernels themselves run only on the GPU): v24_persistent's
below, and kernels/fused/decode_step.cu's weight stream after it (its plans' slot counts and items; a release
before the reads end fails it). The backward's, b07's and b08's, are in tests/test_backward_protocol.py.

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
import random

import pytest

from tests.protocol_model import Fail, MBarrier, Named, interleave


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
