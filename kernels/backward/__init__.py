"""The backward ladder: `kernels/backward/bNN_<change>.cu`, one attention backward pass per file
(dQ, dK, dV from Q, K, V, the forward's O and log-sum-exp, and dO), numbered, declared, compiled and
tested like the forward rungs (kernels/ladder.py); kernels.attention_backward runs them.

A backward rung is one or more kernels, its phases, launched one after another on one stream, every
one with the same parameters:

    template <int d_head, int B_r, int B_c, ...>
    __global__ void backward_<phase>(const T* Q, const T* K, const T* V, const T* O, const T* dO,
                                     const float* lse, T* dQ, T* dK, T* dV,
                                     float* D, float* dQ_accum, int* dQ_turns,
                                     int T_q, int T_k, int kv_group, int causal, float scale);

T is float, or the raw 16 bits of a bfloat16 or float16 (lab.dtypes, lab.dtype_param, as forward).
Every array is contiguous (the launcher copies views): Q, O, dO and dQ (B, NH, T_q, d); K, V, dK and
dV (B, NH_kv, T_k, d), NH_kv = NH / kv_group; lse (B, NH, T_q), the forward's log-sum-exp of each
row's scaled scores (natural log, +inf for a row that sees no key: lab.lse in kernels/ladder.py);
D (B, NH, T_q) float32 scratch, for rowsum(dO o O). With lab.dq_accum, dQ_accum is float32 scratch
of dQ's shape and dQ_turns B x NH x ceil(T_q / B_r) ints (one more, a tile counter, for a rung with a
persistent phase), both the rung's to clear in its first phase
(b02: dQ added into dQ_accum with atomics, then converted; a deterministic configuration's blocks
take turns per query tile); without it both are null. The mask is the forward's: causal aligned
bottom-right when T_q != T_k; with grouped-query heads dK and dV sum the group's query heads.

A phase's grid is over query tiles, (ceil(T_q / B_r), NH, B), or over key tiles,
(ceil(T_k / B_c), NH_kv, B); a persistent phase (`key tiles persistent`) is one block an SM,
(min(tiles x heads x B, SMs), 1, 1), each walking the tiles, and then every phase of the rung takes
two more ints after scale, `int n_kv_heads, int batches` (NH_kv and B: a persistent grid no longer
says them). A rung declares, beside the forward's lab.template, lab.configs,
lab.options, lab.stack, lab.dtypes, lab.dtype_param, lab.supports, lab.min_arch and
lab.tf32_products (each meaning what it does there):

    lab.threads    128                       block shape of every phase, unless the phase says
    lab.smem       0                         dynamic shared memory of every phase, unless the phase says
    lab.phase      backward_dk_dv: key tiles, threads 2 * B_c, smem 4 * B_c * d_head
                                             one line per kernel, in launch order: its entry point,
                                             the tiles of its grid (`persistent` after them: one
                                             block an SM walks them), and, if not the defaults, its
                                             block and shared memory (expressions of the parameters)
    lab.dq_accum   true                      dQ_accum and dQ_turns are allocated (default false)
    lab.deterministic deterministic          1 for a configuration that gives the same bits on every
                                             run (an expression; default 0): what
                                             attention_backward(..., deterministic=True) picks
    lab.tolerance  3                         each gradient's error against float64 at most this times
                                             a plain implementation's in the same dtype (default 3,
                                             FlashAttention's rule)
    lab.tma        Q: (B_r, 64), dQ_accum: (B_r, 32)
                                             TMA descriptors (the forward's lab.tma) of any of Q, K, V,
                                             O, dO and dQ_accum (with lab.dq_accum), 128-byte swizzle
    lab.unverified not yet run on a GPU      a rung landed before a GPU ran it: tested and run when
                                             named, but train.py and bench.py do not pick it by default

A rung with lab.tma takes one `const __grid_constant__ CUtensorMap` per declared tensor after the
parameters above, in the declaration's order, in every phase (the phases share one signature); the
launcher then launches through cuLaunchKernelEx (driver.PackedLaunch), as the forward's TMA rungs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .. import ladder

BACKWARD_DIR = Path(__file__).resolve().parent
_RUNG_FILE = re.compile(r"^b(\d+)_([a-z0-9_]+)\.cu$")
_KEYS = {"template", "configs", "threads", "smem", "options", "stack", "tolerance", "dtypes", "dtype_param",
         "supports", "min_arch", "tf32_products", "phase", "dq_accum", "deterministic", "tma", "unverified"}
TMA_TENSORS = ("Q", "K", "V", "O", "dO", "dQ_accum")  # what a backward rung's lab.tma may describe
TILES = {"query": "B_r", "key": "B_c"}  # a phase's grid, and the parameter that sizes its tiles
_PHASE = re.compile(r"(\w+):\s*(query|key) tiles(\s+persistent)?\s*((?:,\s*(?:threads|smem)\s+.+)*)")


@dataclass(frozen=True)
class Phase:
    entry: str  # the kernel's name, "backward_dk_dv"
    tiles: str  # "query" or "key": what its blocks tile
    threads: tuple[str, ...] | None = None  # block shape, expressions; None: lab.threads
    smem: str | None = None  # dynamic shared memory in bytes, an expression; None: lab.smem
    persistent: bool = False  # one block an SM walks the tiles: grid (min(tiles, SMs), 1, 1)


@dataclass(frozen=True)
class BackwardRung(ladder.Rung):
    """A backward rung: its declarations as a forward rung's (lab.threads and lab.smem the defaults of its
    phases; its entry points are its phases', not attention_forward), and its phases."""

    phases: tuple[Phase, ...] = ()
    dq_accum: bool = False
    deterministic: str = "0"

    def phase_block(self, phase: Phase, config) -> tuple[int, int, int]:
        dims = [ladder.evaluate(e, self.params(config)) for e in (phase.threads or self.threads)]
        return tuple(dims + [1] * (3 - len(dims)))

    def phase_smem(self, phase: Phase, config) -> int:
        return ladder.evaluate(phase.smem or self.smem, self.params(config))

    def entry_expression(self, phase: Phase, config) -> str:
        """`backward_dk_dv<64, 64, 64, 0>`: one phase of one configuration, as NVRTC names it."""
        return f"{phase.entry}<{', '.join(str(int(v)) for v in config)}>"

    def is_deterministic(self, config) -> bool:
        return ladder.evaluate(self.deterministic, self.params(config)) == 1

    def tile(self, phase: Phase, config) -> int:
        """Rows of Q (query tiles) or of K (key tiles) per block of the phase."""
        return self.params(config)[TILES[phase.tiles]]

    @property
    def has_persistent_phase(self) -> bool:
        """Whether a phase walks its tiles in a grid of one block an SM: then every phase takes the
        K/V heads and the batch as two more ints after scale."""
        return any(p.persistent for p in self.phases)

    def grid(self, phase: Phase, config, B: int, NH: int, NH_kv: int, T_q: int, T_k: int,
             sm_count: int | None = None) -> tuple[int, int, int]:
        rows, heads = (T_q, NH) if phase.tiles == "query" else (T_k, NH_kv)
        tiles = -(-rows // self.tile(phase, config))
        if phase.persistent:
            if sm_count is None:
                raise ValueError(f"{self.name}: {phase.entry} is persistent: its grid needs the SM count")
            return max(1, min(tiles * heads * B, sm_count)), 1, 1
        return tiles, heads, B


def rung_files() -> list[Path]:
    """Every `bNN_<change>.cu` in kernels/backward/, in ladder order."""
    files = [p for p in BACKWARD_DIR.glob("b*.cu") if _RUNG_FILE.match(p.name)]
    return sorted(files, key=lambda p: (int(_RUNG_FILE.match(p.name).group(1)), p.name))


def names() -> list[str]:
    return [p.stem for p in rung_files()]


def default_names() -> list[str]:
    """The rungs a run takes when none is named: every one but those not yet run on a GPU (lab.unverified)."""
    return [n for n in names() if load(n).unverified is None]


def owns(kernel) -> bool:
    """Whether `kernel` names a backward rung by name (b1, b01, b01_naive); a path may be either."""
    return re.fullmatch(r"b\d+(?:_[a-z0-9_]+)?", str(kernel)) is not None


def resolve(kernel: str | Path) -> Path:
    """`b1`, `b01`, `b01_naive` or a path to a .cu file -> the rung's file."""
    return ladder.find_rung(str(kernel), rung_files(), _RUNG_FILE, letter="b", ext=".cu", family="backward kernel")


_cache: dict[Path, BackwardRung] = {}


def load(kernel: str | Path) -> BackwardRung:
    """Read a backward rung's file and declarations; read again whenever it or a file it includes changes."""
    path = resolve(kernel)
    rung = _cache.get(path)
    if rung is None or any(not p.exists() or ladder._stamp(p) != stamp for p, stamp in rung.files):
        rung = _cache[path] = parse(path)
    return rung


def parse_phase(text: str, where: str) -> Phase:
    """`backward_dq: query tiles, threads 128, smem 0` -> Phase("backward_dq", "query", ("128",), "0")."""
    m = _PHASE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{where} must read like `backward_dq: query tiles, threads 128, smem 0` (key tiles for "
                         f"a grid over K; threads and smem optional), got {text!r}")
    entry, tiles, persistent, rest = m.groups()
    fields = {}
    for item in re.split(r",\s*(?=(?:threads|smem)\s)", rest.strip().lstrip(",").strip()) if rest.strip() else []:
        key, _, value = item.strip().partition(" ")
        if key in fields:
            raise ValueError(f"{where}: {key} given twice in {text!r}")
        fields[key] = value.strip()
    threads = tuple(_top_level_items(fields["threads"])) if "threads" in fields else None
    return Phase(entry=entry, tiles=tiles, threads=threads, smem=fields.get("smem"), persistent=bool(persistent))


def _top_level_items(text: str) -> list[str]:
    """"2 * B_c, min(B_r, 4)" -> ["2 * B_c", "min(B_r, 4)"]: split at the commas outside parentheses."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if c == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return items + [text[start:].strip()]


def parse(path: Path) -> BackwardRung:
    decl = ladder.declarations(path, _KEYS, repeated=("phase",))
    decl.setdefault("tolerance", "3")
    where = f"{path}: lab.phase"
    phases = tuple(parse_phase(text, where) for text in decl.pop("phase"))
    if not phases:
        raise ValueError(f"{path}: no lab.phase: a backward rung declares its kernels, one lab.phase line each")
    entries = [p.entry for p in phases]
    if len(set(entries)) != len(entries):
        raise ValueError(f"{where}: an entry point appears twice ({', '.join(entries)})")
    rung = ladder.build(path, decl, cls=BackwardRung, tma_tensors=TMA_TENSORS, phases=phases,
                        dq_accum=decl.get("dq_accum", "false").lower() == "true",
                        deterministic=decl.get("deterministic", "0"))
    if "dQ_accum" in dict(rung.tma) and not rung.dq_accum:
        raise ValueError(f"{path}: lab.tma describes dQ_accum, which exists only with lab.dq_accum true")
    needed = {TILES[p.tiles] for p in phases} | ({"B_r"} if rung.dq_accum else set())
    missing = needed - set(rung.template)
    if missing:
        raise ValueError(f"{path}: the phases' tiles need template parameter(s) {', '.join(sorted(missing))}")
    for c in rung.configs:  # fail at load, not at launch, on a bad expression
        for p in phases:
            rung.phase_block(p, c), rung.phase_smem(p, c)
        if ladder.evaluate(rung.deterministic, rung.params(c)) not in (0, 1):
            raise ValueError(f"{path}: lab.deterministic {rung.deterministic} is not 0 or 1 for config {c}")
    return rung


def deterministic_rungs() -> str:
    """The rungs with a deterministic configuration, in words."""
    return ", ".join(n for n in names() if any(load(n).is_deterministic(c) for c in load(n).configs)) or "no rung"
