"""Model checks of the persistent backward rungs' protocols (the kernels themselves run only on the GPU):
kernels/backward/b07_persistent.cu's producer, ring, tiles and slots, and b08_pingpong.cu's consumers
on them (their turns, dS^T's barriers, the late dQ_i and its reductions), each under random interleavings
of its agents with the copies landing at random; and b07's order of the tiles, by arithmetic."""

import heapq
import random

import pytest

from tests.protocol_model import Fail, Gathering, MBarrier, interleave

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


def b07_block(steps_of_tiles, seed, break_it=None, pingpong=False, turns_on=True, deterministic=False, dq_first=False):
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
        reading_kv, full, empty, stage, lse, reading, copies, dq_first)
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


def b08_consumers(steps_of_tiles, break_it, turns_on, deterministic, item_full, item_empty, slot, kv_full, kv_empty,
                  kv, reading_kv, full, empty, stage, lse, reading, copies, dq_first=False):
    """The consumer agents of b08 (two a warpgroup), over b07_block's barriers and buffers; the turns,
    dS^T, dQ's shared memory and its reductions here. dq_first: d = 128's order (DQ_FIRST), the second
    turn's dQ_i share in a commit group of its own before dV_j and dK_j, landed and stored while they run."""
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
                if step > 0 and dq_first:  # wait_group 1: the share landed, out while dV_j and dK_j run
                    yield None
                    dQ_landed(part, n - 1, u)
                    dS_empty[(n - 1) % 2].arrive()
                    yield from store_dQ(c, p, n - 1)
                yield None  # landed
                if stage[n % 2] != n:
                    raise Fail(f"stage {n % 2} refilled under step {n}'s dV_j and dK_j")
                reading[n % 2].discard(part)
                empty[n % 2].arrive()
                if step > 0 and not dq_first:
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


@pytest.mark.parametrize("dq_first", [False, True], ids=["d64", "d128"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("turns_on", [True, False], ids=["b08", "without_turns"])
def test_b08_random_interleavings_keep_the_protocol(turns_on, deterministic, dq_first):
    rnd = random.Random(8)
    real = [steps for k, (_, _, steps) in enumerate(b07_tiles(2048, 2048, 192, 1, True, False, 132)) if k % 132 == 0]
    for i in range(100):
        tiles = real if i == 0 else [rnd.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 6))]
        try:
            b07_block(tiles, seed=i, pingpong=True, turns_on=turns_on, deterministic=deterministic, dq_first=dq_first)
        except Fail as exc:
            pytest.fail(f"run {i}, tiles with steps {tiles}: {exc}")


@pytest.mark.parametrize("break_it,turns_on,deterministic", [
    ("no dS empty wait", True, False), ("no dS full wait", False, False), ("K_j released early", True, False),
    ("no first pass", True, False), ("no last take", True, False), ("no stage wait", True, False),
    ("no KV wait", True, False), ("no share barrier", False, False), ("no share barrier", False, True)])
@pytest.mark.parametrize("dq_first", [False, True], ids=["d64", "d128"])
def test_b08_model_catches_a_broken_protocol(break_it, turns_on, deterministic, dq_first):
    caught = []
    for seed in range(80):
        try:
            b07_block([3, 0, 0, 2, 0, 4, 1], seed=seed, break_it=break_it, pingpong=True, turns_on=turns_on,
                      deterministic=deterministic, dq_first=dq_first)
        except Fail as exc:
            caught.append(str(exc))
    assert caught, f"{break_it}: no run failed"
