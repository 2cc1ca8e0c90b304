"""b07's persistent loop on the CPU: which tiles each block takes, and the mbarrier protocol between its
producer warp and its consumers, run under random interleavings.

The kernel's control flow is transcribed here (tile order, the ring's step counter n and K_j/V_j's use
counter u, every wait with its parity, every arrival, every copy and when it lands), so this checks the
design that the .cu file follows, not the compiled code: that every (key tile, K/V head) is taken once,
that no interleaving deadlocks, that every read sees the step's and the tile's own data, and that no copy
lands in a stage or in K_j/V_j while the consumers still read it. GPU tests check the kernel itself."""

import random

import pytest

STAGES = 2


def items_of(T_q, T_k, n_heads, kv_group, causal, deterministic, grid, B_r=128, B_c=128, d=64, l2_chunk=16 << 20):
    """b07's item_at for every item: (k, j, kv_bh, steps)."""
    T_c, T_r, offset = -(-T_k // B_c), -(-T_q // B_r), T_k - T_q
    items = T_c * n_heads
    chunk = n_heads
    if causal and not deterministic and items >= 16 * grid:
        chunk = min(n_heads, max(l2_chunk // (8 * kv_group * T_q * d), -(-2 * grid // T_c)))
    out = []
    for k in range(items):
        first_head = k // (chunk * T_c) * chunk
        heads_here = min(chunk, n_heads - first_head)
        within = k % (chunk * T_c)
        j, kv_bh = within // heads_here, first_head + within % heads_here
        first_tile = (max(0, j * B_c - offset) if causal else 0) // B_r
        out.append((k, j, kv_bh, kv_group * max(0, T_r - first_tile)))
    return out


@pytest.mark.parametrize("T_q, T_k, n_heads, kv_group, causal, deterministic, grid", [
    (2048, 2048, 192, 1, True, False, 132),  # a long causal grid: chunks of heads
    (2048, 2048, 193, 1, True, False, 132),  # the last chunk short
    (1000, 1000, 7, 4, True, False, 132),    # fewer tiles than blocks
    (300, 700, 12, 2, True, False, 132),     # cross, causal bottom-right
    (2048, 2048, 192, 1, True, True, 132),   # deterministic: one chunk
    (4096, 4096, 64, 1, False, False, 132),  # non-causal: one chunk
])
def test_every_tile_is_taken_once(T_q, T_k, n_heads, kv_group, causal, deterministic, grid):
    items = items_of(T_q, T_k, n_heads, kv_group, causal, deterministic, min(grid, -(-T_k // 128) * n_heads))
    pairs = [(j, kv_bh) for _, j, kv_bh, _ in items]
    assert sorted(pairs) == [(j, h) for j in range(-(-T_k // 128)) for h in range(n_heads)]
    if causal and not deterministic:  # within a chunk, key tiles count up: heavy first
        steps = [s for *_, s in items]
        assert steps[0] == max(steps)


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def arrive(self, n=1, tx=0):
        self.tx += tx
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self._maybe_complete()

    def complete_tx(self, n):
        self.tx -= n
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def done(self, parity):  # mbarrier.try_wait.parity: the phase of that parity has completed
        return (self.phases & 1) != parity


def run_block(steps_of_tiles, seed):
    """One block's producer lane 0, its other 31 lanes and its consumers over tiles with these step
    counts, interleaved at random with the copies' landings."""
    rng = random.Random(seed)
    kv_full, kv_empty = Barrier(1), Barrier(256)
    full, empty = [Barrier(32) for _ in range(STAGES)], [Barrier(256) for _ in range(STAGES)]
    stage_data, stage_lse, kv_data = [None] * STAGES, [None] * STAGES, [None]
    reading, reading_kv = [False] * STAGES, [False]
    copies = []  # (what, slot, value, barrier)

    def parity(n):
        return (n // STAGES) & 1

    def lane0():
        n = u = 0
        for steps in steps_of_tiles:
            for step in range(steps):
                if n >= STAGES:
                    yield lambda n=n: empty[n % STAGES].done(parity(n) ^ 1)
                full[n % STAGES].arrive(0, tx=2)  # expect_tx: Q_i and dO_i
                copies.append(("stage", n % STAGES, n, full[n % STAGES]))
                copies.append(("stage", n % STAGES, n, full[n % STAGES]))
                assert not reading[n % STAGES], "lse_i written while the consumers read the stage"
                stage_lse[n % STAGES] = n
                full[n % STAGES].arrive()
                if step == 0:
                    if u > 0:
                        yield lambda u=u: kv_empty.done((u - 1) & 1)
                    kv_full.arrive(1, tx=2)
                    copies.append(("kv", 0, u, kv_full))
                    copies.append(("kv", 0, u, kv_full))
                    u += 1
                n += 1
                yield lambda: True
        if u > 0:
            yield lambda: kv_full.done((u - 1) & 1)
            for m in range(max(0, n - STAGES), n):
                yield lambda m=m: full[m % STAGES].done(parity(m))

    def lanes():
        n = 0
        for steps in steps_of_tiles:
            for _ in range(steps):
                if n >= STAGES:
                    yield lambda n=n: empty[n % STAGES].done(parity(n) ^ 1)
                assert not reading[n % STAGES], "lse_i written while the consumers read the stage"
                stage_lse[n % STAGES] = n
                full[n % STAGES].arrive(31)
                n += 1
                yield lambda: True

    def consumers():
        n = u = 0
        for steps in steps_of_tiles:
            if steps:
                yield lambda u=u: kv_full.done(u & 1)
                reading_kv[0] = True
            for _ in range(steps):
                yield lambda n=n: full[n % STAGES].done(parity(n))
                reading[n % STAGES] = True
                assert stage_data[n % STAGES] == n and stage_lse[n % STAGES] == n and kv_data[0] == u
                yield lambda: True  # the step's products, while copies may land elsewhere
                assert stage_data[n % STAGES] == n and kv_data[0] == u
                reading[n % STAGES] = False
                empty[n % STAGES].arrive(256)
                n += 1
            if steps:
                reading_kv[0] = False
                kv_empty.arrive(256)
                u += 1

    actors = [lane0(), lanes(), consumers()]
    waiting = [lambda: True] * len(actors)
    for _ in range(1_000_000):
        runnable = [i for i, a in enumerate(actors) if a is not None and waiting[i]()]
        if not runnable and not copies:
            break
        if copies and (not runnable or rng.random() < 0.3):
            what, slot, value, barrier = copies.pop(rng.randrange(len(copies)))
            if what == "stage":
                assert not reading[slot], "a copy landed in a stage the consumers still read"
                stage_data[slot] = value
            else:
                assert not reading_kv[0], "K_j and V_j landed while the consumers still read them"
                kv_data[0] = value
            barrier.complete_tx(1)
            continue
        i = rng.choice(runnable)
        try:
            waiting[i] = next(actors[i])
        except StopIteration:
            actors[i] = None
    assert all(a is None for a in actors), "deadlock: an actor still waits"
    assert not copies


@pytest.mark.parametrize("seed", range(40))
def test_the_producer_and_consumers_never_deadlock_nor_read_stale_data(seed):
    rng = random.Random(seed)
    tiles = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 6))]
    run_block(tiles, seed)


def test_a_block_of_real_tiles():
    """Block 0's tiles at 16 x 12 x 2048 causal on 132 SMs (chunks of heads, heavy first)."""
    items = items_of(2048, 2048, 192, 1, True, False, 132)
    run_block([steps for k, _, _, steps in items if k % 132 == 0], seed=1)
