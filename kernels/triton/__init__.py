"""The Triton family: `kernels/triton/tNN_<change>.py`, a flash-attention forward written in Triton
per file, run through the same API as the .cu rungs (kernels.attention(q, k, v, kernel="t01"),
kernels.prepare, kernels.Attend), on CuPy arrays passed to PyTorch without copies (DLPack) and
launched on CuPy's current stream.

A rung file declares in its docstring, one `lab.<key>` line each (read without importing Triton):

    lab.dtypes      float32, bfloat16, float16   input and output dtypes
    lab.head_sizes  32, 64, 128
    lab.precisions  tf32x3, ieee, tf32           float32's tl.dot input_precision, the default first
    lab.tolerance   tf32x3 8, bfloat16 2, ...    the tests' factor per precision (16-bit inputs: per dtype)
    lab.supports    noncausal, cross, gqa        as lab.supports of a .cu rung

and exports `CONFIGS` (the autotuner's tile shapes, dicts of BLOCK_M, BLOCK_N, num_warps, num_stages)
and `forward(q, k, v, o, *, scale, causal, precision, config=None) -> config`, on torch tensors.

Triton and PyTorch are an optional extra (pip install -e '.[triton]'): without them the rungs are
still listed (names()), unavailable() says why in one line, and running one raises that line.
kernels.names() lists the .cu ladder only: everything that compiles or reports rungs through NVRTC
iterates it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import ladder
from ..prepared import Prepared

TRITON_DIR = Path(__file__).resolve().parent
_RUNG_FILE = re.compile(r"^t(\d+)_([a-z0-9_]+)\.py$")
_NAME = re.compile(r"t(\d+)(?:_([a-z0-9_]+))?")
_DECL = re.compile(r"^\s*lab\.(\w+)\s+(.*?)\s*$")
_KEYS = {"dtypes", "head_sizes", "precisions", "tolerance", "supports"}
HALF = ("bfloat16", "float16")  # 16-bit inputs: one arithmetic, named by the dtype
INSTALL = "pip install -e '.[triton]' (and PyTorch with CUDA)"
compile_seconds = 0.0  # first launches of prepared rungs in this process: Triton's compilation and autotuning


def rung_files() -> list[Path]:
    files = [p for p in TRITON_DIR.glob("t*.py") if _RUNG_FILE.match(p.name)]
    return sorted(files, key=lambda p: (int(_RUNG_FILE.match(p.name).group(1)), p.name))


def names() -> list[str]:
    """The Triton rungs in order, whether or not Triton is installed (see unavailable())."""
    return [p.stem for p in rung_files()]


def unavailable() -> str | None:
    """None when Triton and PyTorch can be imported; else one line saying why the rungs cannot run."""
    missing = [m for m in ("triton", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        return f"the Triton rungs need {' and '.join(missing)}, not installed here: {INSTALL}"
    return None


def owns(kernel) -> bool:
    """Whether `kernel` names a Triton rung: t1, t01, t01_fa2, or a path to a .py file."""
    text = str(kernel)
    return text.endswith(".py") or _NAME.fullmatch(text) is not None


def resolve(kernel) -> Path:
    """`t1`, `t01`, `t01_fa2` or a path to a .py file -> the rung's file."""
    return ladder.find_rung(str(kernel), rung_files(), _RUNG_FILE, letter="t", ext=".py", family="Triton kernel")


@dataclass(frozen=True)
class TritonRung:
    """What validation and the tests read of a Triton rung (the names a .cu rung's ladder.Rung uses)."""

    name: str
    path: Path
    dtypes: tuple[str, ...]
    sizes: tuple[int, ...]
    precisions: tuple[str, ...]
    tolerances: dict = field(compare=False)
    supports: tuple[str, ...] = ()
    split_kv: bool = False

    def head_sizes(self) -> list[int]:
        return sorted(self.sizes)

    def tolerance_factor(self, precision: str) -> int:
        return self.tolerances[precision]

    def precision(self, dtype: str, config=None) -> str:
        """The arithmetic for inputs of `dtype`: float32's lab.precisions, the first by default
        (config None, a name, or a dict with "precision"); 16-bit inputs have one, named by the dtype."""
        asked = config.get("precision") if isinstance(config, dict) else config
        if dtype in HALF:
            if asked not in (None, dtype):
                raise ValueError(f"kernel {self.name}: {dtype} inputs multiply in {dtype} and accumulate in float32; "
                                 f"precision {asked!r} is for float32 inputs")
            return dtype
        if asked is None:
            return self.precisions[0]
        if asked not in self.precisions:
            raise ValueError(f"kernel {self.name}: precision {asked!r} is not one of {', '.join(self.precisions)}")
        return asked


def parse(path: Path) -> TritonRung:
    decl = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if m := _DECL.match(line):
            key, value = m.groups()
            if key not in _KEYS:
                raise ValueError(f"{path}:{lineno}: unknown declaration lab.{key} (known: {', '.join(sorted(_KEYS))})")
            decl[key] = value
    missing = [k for k in ("dtypes", "head_sizes", "precisions", "tolerance") if k not in decl]
    if missing:
        raise ValueError(f"{path}: missing declaration(s) {', '.join('lab.' + k for k in missing)}")

    def items(key):
        return tuple(t.strip() for t in decl.get(key, "").split(",") if t.strip())

    tolerances = {}
    for entry in items("tolerance"):
        precision, _, factor = entry.rpartition(" ")
        if not precision or not factor.isdigit():
            raise ValueError(f"{path}: lab.tolerance entries are '<precision> <factor>', got {entry!r}")
        tolerances[precision.strip()] = int(factor)
    rung = TritonRung(name=path.stem, path=path, dtypes=items("dtypes"), sizes=tuple(int(d) for d in items("head_sizes")),
                      precisions=items("precisions"), tolerances=tolerances, supports=items("supports"))
    needed = set(rung.precisions) | (set(rung.dtypes) & set(HALF))
    if needed - set(tolerances):
        raise ValueError(f"{path}: lab.tolerance has no factor for {', '.join(sorted(needed - set(tolerances)))}")
    return rung


_cache: dict[Path, tuple[int, TritonRung]] = {}


def load(kernel) -> TritonRung:
    """A Triton rung's declarations (no Triton needed), read again whenever its file changes."""
    path = resolve(kernel)
    stamp = path.stat().st_mtime_ns
    if path not in _cache or _cache[path][0] != stamp:
        _cache[path] = stamp, parse(path)
    return _cache[path][1]


_modules: dict[tuple[Path, int], object] = {}


def module(rung: TritonRung):
    """The rung's Python module, imported once per version of its file; RuntimeError naming the
    extra when Triton or PyTorch is missing."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"kernel {rung.name}: {why}")
    key = (rung.path, rung.path.stat().st_mtime_ns)
    if key not in _modules:
        spec = importlib.util.spec_from_file_location(f"kernels.triton.{rung.name}", rung.path)
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[key] = mod
    return _modules[key]


class Instance:
    """What the tests and benchmarks read of a prepared launch: the rung, its precision (`config`,
    the key of the rung's tolerance) and, once it has run, the tile shape the autotuner chose."""

    def __init__(self, rung: TritonRung, precision: str, tiles: dict | None):
        self.rung, self.config, self.tiles = rung, precision, tiles

    def describe(self) -> str:
        tiles = ", ".join(f"{k}={v}" for k, v in self.tiles.items()) if self.tiles else "autotuned on first run"
        return f"precision={self.config}, {tiles}"


def _tiles(rung: TritonRung, mod, config) -> dict | None:
    """A config's pinned tile shape (one of the rung's CONFIGS), or None for the autotuner's choice."""
    if not isinstance(config, dict) or config.keys() <= {"precision"}:
        return None
    tiles = {k: v for k, v in config.items() if k != "precision"}
    if tiles not in mod.CONFIGS:
        shapes = "; ".join(", ".join(f"{k}={v}" for k, v in c.items()) for c in mod.CONFIGS)
        raise ValueError(f"kernel {rung.name}: tile shape {tiles} is not one of its CONFIGS ({shapes})")
    return tiles


def _as_torch(torch, x):
    """A torch tensor over the CuPy array's memory (DLPack); bfloat16 goes through int16, which every
    DLPack producer and consumer carries."""
    import cupy

    if x.dtype.name == "bfloat16":
        return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


_streams: dict[tuple[int, int], object] = {}


def _current_stream(torch, device: int):
    """CuPy's current stream on `device` as a torch stream, so that Triton (which launches on torch's
    current stream) runs in order with CuPy's work. Stream 0 is the legacy default stream in both."""
    import cupy

    ptr = cupy.cuda.get_current_stream(device).ptr
    if (ptr, device) not in _streams:
        _streams[ptr, device] = (torch.cuda.default_stream(device) if ptr == 0
                                 else torch.cuda.ExternalStream(ptr, device=torch.device("cuda", device)))
    return _streams[ptr, device]


def prepare(rung: TritonRung, q, k, v, out, *, causal: bool, scale: float, config=None):
    """A Prepared that launches the rung on validated CuPy arrays and returns `out` (see
    runtime.prepare, which validates and allocates `out` first). `config`: a precision name, or a
    dict with "precision" and/or one of the rung's CONFIGS to pin the tile shape."""
    mod = module(rung)
    import torch

    precision = rung.precision(q.dtype.name, config)
    tiles = _tiles(rung, mod, config)
    device = q.device.id
    tq, tk, tv, to = (_as_torch(torch, x) for x in (q, k, v, out))
    arithmetic = precision if precision in rung.precisions else "tf32"  # 16-bit inputs: the compiler's default
    inst = Instance(rung, precision, tiles)
    first = True

    def run():
        nonlocal first
        start = time.perf_counter()
        with torch.cuda.stream(_current_stream(torch, device)):
            inst.tiles = mod.forward(tq, tk, tv, to, scale=scale, causal=causal, precision=arithmetic, config=tiles)
        if first:  # compiled and autotuned on the host, synchronously, unless an earlier launch did
            global compile_seconds
            compile_seconds += time.perf_counter() - start
            first = False
        return out

    return Prepared(run, inst, reads_inputs=True)  # zero-copy: run() reads the caller's arrays, with their new contents


def configs(kernel) -> list[dict]:
    """The tile shapes the rung's autotuner chooses among (imports the rung: needs Triton)."""
    return [dict(c) for c in module(load(kernel)).CONFIGS]
