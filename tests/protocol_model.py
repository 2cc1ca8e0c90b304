"""The machinery of the protocol models (tests/test_persistent_protocol.py, tests/test_backward_protocol.py):
mbarriers with phases and transaction bytes, named barriers, and a random interleaving of agents (Python
generators that yield the condition they wait on) with the copies they issue landing at random."""

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
