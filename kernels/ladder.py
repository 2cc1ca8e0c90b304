"""The ladder: discover rungs (`kernels/vNN_<change>.cu`), read their declarations, assemble source.

A rung declares what the launcher needs in its header comment, one `lab.<key>` line each:

    lab.template   d_head, B_r, B_c          template parameters, in order
    lab.configs    (64, 64, 64), (64, 32, 32) instantiations, in order of preference
    lab.threads    B_c, 16                    block shape (x, y, z), expressions of the parameters
    lab.smem       4 * (B_r + 2 * B_c) * d_head  dynamic shared memory in bytes
    lab.workspace  2                          floats of global scratch per query row (default 0)
    lab.strided    true                       reads Q, K, V through strides (default: contiguous)
    lab.options    --use_fast_math            extra NVRTC options
    lab.stack      0                          local-memory bytes allowed per thread (default 0)
    lab.tolerance  8                          allowed error, in multiples of a plain implementation's
                                              error against float64, in the same dtype (default 8)
    lab.dtypes     bfloat16, float16          input and output dtypes (default float32)
    lab.dtype_param dtype_id                  the template parameter that selects the dtype: its value in
                                              a config is the dtype's position in lab.dtypes, and the
                                              launcher takes only the configs of the inputs' dtype
    lab.supports   noncausal, cross, gqa      beyond causal self-attention: causal=False, query and
                                              key lengths that differ, fewer K/V heads than Q heads
    lab.split_kv   true                       split the keys across `splits` blocks per query tile
                                              (flash-decoding); see runtime.Instance.splits
    lab.cluster    CLUSTER                    the kernel is compiled with __cluster_dims__(CLUSTER, 1, 1):
                                              with lab.split_kv, the splits of a tile are one cluster,
                                              so a tile always has CLUSTER splits (default: none)
    lab.tf32_products 1 + 2 * split           float32 inputs multiplied on the TF32 tensor cores: TF32 products
                                              per product, an expression (3xTF32: 3; plain TF32: 1); the
                                              benchmarks hold the rung to the TF32 ceiling over it (default 0:
                                              FFMA, held to the fp32 FFMA ceiling)
    lab.min_arch   sm_90                      the oldest architecture the rung compiles for (clusters,
                                              DSMEM); older devices are refused (default: any). With
                                              lab.options -arch=sm_90a (wgmma) it runs on sm_90 only
    lab.tma        Q: (B_r, d_head), K: (B_c, d_head)  TMA descriptors of these tensors (Q, K, V, O), each
                                              for a box of these extents (expressions), in the array's
                                              order (B, NH, T, d), the leading ones 1 if left out
    lab.lse        true                       also writes each query row's log-sum-exp, what the backward
                                              pass needs (default false; see below)
    lab.persistent true                       a persistent grid: one block per resident slot (SMs x
                                              blocks per SM, at most one per tile); the kernel walks
                                              the tiles itself (default: one block per tile)
    lab.fp8        true                       computes on e4m3 copies of its inputs with one scale per
                                              tile (see below; default false)
    lab.fp8_v      head                       V's scales: one per tile of B_c keys (tile, the default) or
                                              the head's in every tile (head: O keeps one unit across the
                                              tiles; the launcher quantizes so and refuses other Fp8Inputs)
    lab.fp8_qk     bf16                       Q and K: e4m3 codes (e4m3, the default) or bfloat16 values
                                              (bf16: the scores on bfloat16 tensor cores, only V and P in
                                              e4m3; the launcher quantizes so and refuses other Fp8Inputs)
    lab.unverified not yet run on a GPU       a rung landed before a GPU ran it (as a backward rung's): tested
                                              and run when named, but no default takes it (kernels.rungs_for,
                                              so lab.py; train.py; bench.py's backward and e2e)

Every rung exports the same entry point, `attention_forward<...>`, with one signature (PARAMETERS
below: the order, and the declarations that add parameters), launched on a grid of (ceil(T_q / B_r),
n_heads, batch) blocks: one block per tile of B_r query rows of one head.
A rung with lab.tma takes one more parameter per declared tensor, in the declaration's order, after
the others: `const __grid_constant__ CUtensorMap`, the tensor's descriptor (driver.tensor_map_arguments)
with the swizzle whose span the box's inner extent fills: 64 or 32 bytes for a box 64 or 32 bytes
wide, otherwise 128 bytes (driver.swizzle_for), so a box's inner extent is at most 128 bytes.

A rung with lab.fp8 computes on e4m3 copies of its inputs: the launcher quantizes bfloat16 inputs
(kernels.quantize_fp8, with the chosen configuration's B_r and B_c as the blocks, Hadamard on) or
takes kernels.Fp8Inputs made beforehand (runtime.prepare_fp8), and launches the kernel on uint8
arrays: Q (B, NH, T_q, d), K (B, NH_kv, T_k, d) and V^T (B, NH_kv, d, T_pad), V transposed (its
lab.tma box in that array's order), output bfloat16; Q and K bfloat16 where it declares lab.fp8_qk bf16. It takes three more parameters, q_scale, k_scale
and v_scale: one scale per tile, (B, NH, ceil(T_q / B_r)) and (B, NH_kv,
ceil(T_k / B_c)) twice. Its accuracy is FP8's, not its dtype's: the ladder's tolerance tests and the
default choices of a rung for a dtype (lab.py, bench.py) leave it out; tests/test_fp8_gpu.py holds it
to its float64 emulation (kernels.fp8.emulated_attention) and to RMSE bounds.

A rung with lab.lse takes `float* lse`: null, or a float32 (B, NH, T_q) array into which each query row's log-sum-exp goes, in natural log:
lse_i = log(sum_j exp(scale * q_i . k_j)) over the keys the row sees, +inf for a row that sees none
(so that exp(s - lse) is 0 there, as FlashAttention stores it); the rungs take the logarithm of the
row sum on the special-function unit (lg2.approx, within 2 units in float32's last place: log2f's
slow path cost registers that some configurations do not have). kernels.attention(..., return_lse=True)
passes the array and returns (out, lse); the backward ladder (kernels/backward/) reads it.
A rung with lab.persistent is launched on a grid of (min(tiles, SMs x blocks per SM), 1, 1) blocks,
tiles = ceil(T_q / B_r) x n_heads x batch, and takes two more parameters, n_heads and batch. Its workspace starts with one 32-bit word, a tile
counter, that is zero at every launch: the launcher zeroes the workspace once per prepared call and
the kernel must leave the counter at zero when it ends (then come its lab.workspace floats per row).
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
ENTRY = "attention_forward"
DTYPES = ("float32", "float16", "bfloat16")

# attention_forward's parameters in order: (name, C++ kind, the declaration that adds it: None for every
# rung). Pointers are to the element type (Q, K, V, O), float (workspace, the FP8 scales, lse); a lab.tma
# rung then takes one CUtensorMap per declared tensor. runtime.Instance.launch packs its arguments by
# this table; tests/test_kernels_cpu.py checks every rung's declaration against it.
PARAMETERS = (
    ("Q", "pointer", None), ("K", "pointer", None), ("V", "pointer", None), ("O", "pointer", None),
    ("workspace", "pointer", None),
    ("T_q", "int", None), ("T_k", "int", None), ("kv_group", "int", None), ("causal", "int", None),
    ("scale", "float", None),
    ("q_batch_stride", "long long", None), ("q_head_stride", "long long", None), ("q_row_stride", "long long", None),
    ("kv_batch_stride", "long long", None), ("kv_head_stride", "long long", None),
    ("kv_row_stride", "long long", None),
    ("q_scale", "pointer", "fp8"), ("k_scale", "pointer", "fp8"), ("v_scale", "pointer", "fp8"),
    ("lse", "pointer", "lse"),
    ("n_heads", "int", "persistent"), ("batch", "int", "persistent"),
)
_RUNG_FILE = re.compile(r"^v(\d+)_([a-z0-9_]+)\.cu$")
_DECL = re.compile(r"^\s*(?:\*|//)\s*lab\.(\w+)\s+(.*?)\s*$")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_KEYS = {"template", "configs", "threads", "smem", "workspace", "strided", "options", "stack", "tolerance", "dtypes",
         "dtype_param", "supports", "split_kv", "cluster", "min_arch", "tf32_products", "tma", "persistent", "lse",
         "fp8", "fp8_v", "fp8_qk", "unverified"}
FEATURES = ("noncausal", "cross", "gqa")
TMA_TENSORS = ("Q", "K", "V", "O")


@dataclass(frozen=True)
class Rung:
    name: str  # "v02_pad_k", or the file's stem for a user's own .cu
    path: Path
    template: tuple[str, ...]
    configs: tuple[tuple[int, ...], ...]
    threads: tuple[str, ...]
    smem: str
    workspace: str = "0"
    strided: bool = False
    options: tuple[str, ...] = ()
    stack: int = 0
    tolerance: str = "8"
    dtypes: tuple[str, ...] = ("float32",)
    dtype_param: str | None = None  # the template parameter whose value indexes lab.dtypes
    supports: tuple[str, ...] = ()
    split_kv: bool = False
    cluster: str | None = None  # blocks per cluster along x, an expression of the template parameters
    min_arch: int = 0  # 90 for sm_90: the oldest architecture it compiles for
    tf32_products: str = "0"  # TF32 tensor-core products per product of float32 inputs (0: FFMA)
    tma: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (tensor, box extents as expressions), declared order
    lse: bool = False  # takes a float* lse after the strides: each query row's log-sum-exp (null: not wanted)
    persistent: bool = False  # a grid of the resident blocks, the kernel walking the tiles (lab.persistent)
    fp8: bool = False  # computes on e4m3 copies of its inputs, one scale per tile (lab.fp8)
    fp8_v: str = "tile"  # V's scales: "tile" (one per tile) or "head" (the head's in every tile; lab.fp8_v)
    fp8_qk: str = "e4m3"  # Q and K: "e4m3" codes or "bf16" values (lab.fp8_qk)
    unverified: str | None = None  # why the rung is no run's default yet (lab.unverified): it runs when named
    source: str = field(default="", repr=False, compare=False)
    files: tuple = field(default=(), repr=False, compare=False)  # (path, stamp) of the file and its includes

    @property
    def number(self) -> str:
        return self.name.split("_", 1)[0]

    @functools.cached_property
    def parameters(self) -> tuple[tuple[str, str], ...]:
        """attention_forward's (name, kind) in order for this rung (PARAMETERS, with its declarations'),
        its lab.tma descriptors last."""
        params = [(name, kind) for name, kind, added_by in PARAMETERS if added_by is None or getattr(self, added_by)]
        return tuple(params + [(f"{tensor}_map", "tensor map") for tensor, _ in self.tma])

    @functools.cached_property
    def argument_names(self) -> tuple[str, ...]:
        """The parameters the launcher passes as arguments, in order: all but the lab.tma descriptors."""
        return tuple(name for name, kind in self.parameters if kind != "tensor map")

    def head_sizes(self) -> list[int]:
        return sorted({c[0] for c in self.configs})

    def dtype_of(self, config: tuple[int, ...]) -> str | None:
        """The dtype a config is instantiated for, or None if every config takes every declared dtype."""
        if self.dtype_param is None:
            return None
        return self.dtypes[self.params(config)[self.dtype_param]]

    def configs_for(self, d_head: int, dtype: str | None = None) -> list[tuple[int, ...]]:
        """The declared configs for head size d_head (and dtype, if given), in order of preference."""
        return [c for c in self.configs if c[0] == d_head and (dtype is None or self.dtype_of(c) in (None, dtype))]

    def params(self, config: tuple[int, ...]) -> dict[str, int]:
        return dict(zip(self.template, config))

    def name_expression(self, config: tuple[int, ...]) -> str:
        """The one canonical spelling: `attention_forward<64, 32, 32>`."""
        return f"{ENTRY}<{', '.join(str(int(v)) for v in config)}>"

    def block(self, config) -> tuple[int, int, int]:
        dims = [evaluate(e, self.params(config)) for e in self.threads]
        return tuple(dims + [1] * (3 - len(dims)))

    def shared_bytes(self, config) -> int:
        return evaluate(self.smem, self.params(config))

    def workspace_per_row(self, config) -> int:
        return evaluate(self.workspace, self.params(config))

    def tolerance_factor(self, config) -> int:
        return evaluate(self.tolerance, self.params(config))

    def tf32_products_of(self, config) -> int:
        """TF32 products per product a config's float32 arithmetic issues: 3 for 3xTF32, 1 for plain TF32,
        0 for FFMA (lab.tf32_products)."""
        return evaluate(self.tf32_products, self.params(config))

    def tma_boxes(self, config) -> dict[str, tuple[int, ...]]:
        """{"Q": (64, 64), ...}: each lab.tma tensor's box for a config, in the declaration's order."""
        return {t: tuple(evaluate(e, self.params(config)) for e in box) for t, box in self.tma}

    def cluster_size(self, config) -> int | None:
        """Blocks per cluster (lab.cluster) of a config, or None for a rung launched without clusters."""
        return None if self.cluster is None else evaluate(self.cluster, self.params(config))

    @property
    def specific_arch(self) -> int | None:
        """90 for a rung built for an architecture-specific target (lab.options -arch=sm_90a: wgmma),
        whose features later architectures do not carry; None otherwise."""
        for option in self.options:
            if m := re.fullmatch(r"-arch=sm_(\d+)a", option):
                return int(m.group(1))
        return None

    def arch_needed(self) -> str:
        """What runs_on asks for, in words: "sm_90 or newer (lab.min_arch)", or for an
        architecture-specific target "sm_90 (lab.options -arch=sm_90a)"."""
        if self.specific_arch is not None:
            return f"sm_{self.specific_arch} (lab.options -arch=sm_{self.specific_arch}a)"
        return f"sm_{self.min_arch} or newer (lab.min_arch)"

    def runs_on(self, arch: str) -> bool:
        """Whether the rung compiles for `arch` ("sm_80", "sm_90a"): lab.min_arch or newer, and, for an
        architecture-specific target, that architecture only."""
        if self.specific_arch is not None and arch_number(arch) != self.specific_arch:
            return False
        return arch_number(arch) >= self.min_arch


def rung_files() -> list[Path]:
    """Every `vNN_<change>.cu` in kernels/, in ladder order."""
    files = [p for p in KERNEL_DIR.glob("v*.cu") if _RUNG_FILE.match(p.name)]
    return sorted(files, key=lambda p: (int(_RUNG_FILE.match(p.name).group(1)), p.name))


def names() -> list[str]:
    return [p.stem for p in rung_files()]


def rungs_for(dtype: str, head_size: int | None = None, gqa: bool = False, arch: str | None = None, *,
              decode: bool = False, unverified: bool = False) -> list[str]:
    """The rungs, in ladder order, that compute in dtype, take head_size (None: any) and, with gqa,
    grouped-query attention, and run on arch (None: any). Whole-sequence rungs; with decode, the split-KV
    ones (lab.split_kv: a few query rows over a long cache). Never an FP8 rung (lab.fp8): it quantizes
    its inputs, so it runs only when named; nor one not yet run on a GPU (lab.unverified), unless asked
    (`unverified`: bench.py measures those too)."""
    able = []
    for name in names():
        rung = load(name)
        if (rung.split_kv == decode and not rung.fp8 and (unverified or not rung.unverified) and dtype in rung.dtypes
                and (head_size is None or head_size in rung.head_sizes()) and (not gqa or "gqa" in rung.supports)
                and (arch is None or rung.runs_on(arch))):
            able.append(name)
    return able


def default_rung(dtype: str, head_size: int | None = None, gqa: bool = False, arch: str | None = None, *,
                 decode: bool = False) -> str | None:
    """The newest of rungs_for(...): the attention a run gets when none is named; None if no rung fits."""
    able = rungs_for(dtype, head_size, gqa, arch, decode=decode)
    return able[-1] if able else None


_resolved: dict[tuple[str, int], Path] = {}


def resolve(kernel: str | Path) -> Path:
    """`v8`, `v08`, `v08_o_in_smem` or a path to a .cu file -> the rung's file."""
    text = str(kernel)
    key = (text, KERNEL_DIR.stat().st_mtime_ns)  # a rung added or removed changes the folder's mtime
    if key not in _resolved:
        _resolved[key] = _resolve(text)
    path = _resolved[key]
    if not path.is_file():
        del _resolved[key]
        return _resolve(text)
    return path


def _resolve(text: str) -> Path:
    return find_rung(text, rung_files(), _RUNG_FILE, letter="v", ext=".cu", family="kernel")


def find_rung(text: str, files: list[Path], file_re: re.Pattern, *, letter: str, ext: str, family: str) -> Path:
    """A family's name lookup: `text` is a path ending in `ext` (which must exist), or the family's
    letter and a number, with or without the change (v8, v08, v08_o_in_smem), matched against `files`
    through `file_re` (number, change); otherwise ValueError naming the family's known rungs."""
    if text.endswith(ext):
        path = Path(text).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"kernel file {text!r} does not exist")
        return path
    m = re.fullmatch(rf"{letter}(\d+)(?:_([a-z0-9_]+))?", text)
    for p in files:
        number, change = file_re.match(p.name).groups()
        if m and int(m.group(1)) == int(number) and m.group(2) in (None, change):
            return p
    known = ", ".join(p.stem for p in files) or "none"
    raise ValueError(f"unknown {family} {text!r}: known {family}s are {known}, or give a path to a {ext} file")


_cache: dict[Path, Rung] = {}


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def load(kernel: str | Path) -> Rung:
    """Read a rung's file and declarations; read again whenever it or a file it includes changes."""
    path = resolve(kernel)
    rung = _cache.get(path)
    if rung is None or any(not p.exists() or _stamp(p) != stamp for p, stamp in rung.files):
        rung = _cache[path] = parse(path)
    return rung


def reload(kernel: str | Path) -> Rung:
    """load(), reading the file again whatever its stamps say: a save within the file system's timestamp
    granularity, of the same size, changes no stamp (the watcher, benchmarks/watch.py, hashes content)."""
    path = resolve(kernel)
    _cache.pop(path, None)
    rung = _cache[path] = parse(path)
    return rung


def parse(path: Path) -> Rung:
    return build(path, declarations(path, _KEYS))


def declarations(path: Path, keys, repeated=()) -> dict:
    """{key: value} of a file's `lab.<key> value` lines, each key one of `keys`; a key in `repeated` may
    have several lines, its values a list in the file's order."""
    decl: dict = {key: [] for key in repeated}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        m = _DECL.match(line)
        if m:
            key, value = m.groups()
            if key not in keys:
                raise ValueError(f"{path}:{lineno}: unknown declaration lab.{key} (known: {', '.join(sorted(keys))})")
            if key in repeated:
                decl[key].append(value)
            else:
                decl[key] = value
    return decl


def build(path: Path, decl: dict, cls=Rung, tma_tensors=TMA_TENSORS, **extra) -> Rung:
    """A rung (a `cls`, given `extra` fields beyond Rung's) from its file's declarations, checked; its
    lab.tma may name the tensors in `tma_tensors`."""
    files: list[Path] = []
    source = assemble(path, files=files)
    missing = [k for k in ("template", "configs", "threads", "smem") if k not in decl]
    if missing:
        raise ValueError(f"{path}: missing declaration(s) {', '.join('lab.' + k for k in missing)}")
    template = tuple(s.strip() for s in decl["template"].split(","))
    if template[0] != "d_head":
        raise ValueError(f"{path}: the first template parameter must be d_head")
    try:
        configs = ast.literal_eval("[" + decl["configs"] + "]")
        configs = tuple(tuple(int(v) for v in (c if isinstance(c, tuple) else (c,))) for c in configs)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"{path}: lab.configs is not a list of tuples: {decl['configs']!r}") from exc
    for c in configs:
        if len(c) != len(template):
            raise ValueError(f"{path}: config {c} does not match lab.template ({', '.join(template)})")
    rung = cls(
        name=path.stem,
        path=path,
        template=template,
        configs=configs,
        threads=tuple(s.strip() for s in decl["threads"].split(",")),
        smem=decl["smem"],
        workspace=decl.get("workspace", "0"),
        strided=decl.get("strided", "false").lower() == "true",
        options=tuple(decl.get("options", "").split()),
        stack=int(decl.get("stack", "0")),
        tolerance=decl.get("tolerance", "8"),
        dtypes=tuple(t.strip() for t in decl.get("dtypes", "float32").split(",")),
        dtype_param=decl.get("dtype_param"),
        supports=tuple(t.strip() for t in decl.get("supports", "").split(",") if t.strip()),
        split_kv=decl.get("split_kv", "false").lower() == "true",
        cluster=decl.get("cluster"),
        min_arch=arch_number(decl["min_arch"], f"{path}: lab.min_arch") if "min_arch" in decl else 0,
        tf32_products=decl.get("tf32_products", "0"),
        tma=parse_tma(decl["tma"], f"{path}: lab.tma", tma_tensors) if "tma" in decl else (),
        lse=decl.get("lse", "false").lower() == "true",
        persistent=decl.get("persistent", "false").lower() == "true",
        fp8=decl.get("fp8", "false").lower() == "true",
        fp8_v=decl.get("fp8_v", "tile").strip(),
        fp8_qk=decl.get("fp8_qk", "e4m3").strip(),
        unverified=decl.get("unverified"),
        source=source,
        files=tuple((p, _stamp(p)) for p in files),
        **extra,
    )
    unknown = set(rung.dtypes) - set(DTYPES)
    if unknown:
        raise ValueError(f"{path}: lab.dtypes {', '.join(sorted(unknown))} not among {', '.join(DTYPES)}")
    if rung.dtype_param is not None:
        check_dtype_param(rung)
    if rung.persistent and (rung.split_kv or rung.cluster is not None):
        raise ValueError(f"{path}: lab.persistent sizes the grid by the device; it cannot go with "
                         f"lab.{'split_kv' if rung.split_kv else 'cluster'}, which size it by the tiles")
    unknown = set(rung.supports) - set(FEATURES)
    if unknown:
        raise ValueError(f"{path}: lab.supports {', '.join(sorted(unknown))} not among {', '.join(FEATURES)}")
    if rung.fp8_v not in ("tile", "head") or (rung.fp8_v != "tile" and not rung.fp8):
        raise ValueError(f"{path}: lab.fp8_v {rung.fp8_v!r}: tile or head, and only with lab.fp8 true")
    if rung.fp8_qk not in ("e4m3", "bf16") or (rung.fp8_qk != "e4m3" and not rung.fp8):
        raise ValueError(f"{path}: lab.fp8_qk {rung.fp8_qk!r}: e4m3 or bf16, and only with lab.fp8 true")
    for c in configs:  # fail at load, not at launch, on a bad expression
        rung.block(c), rung.shared_bytes(c), rung.workspace_per_row(c), rung.tolerance_factor(c)
        rung.tf32_products_of(c)
        for t, box in rung.tma_boxes(c).items():
            if not all(1 <= b <= 256 for b in box):
                raise ValueError(f"{path}: lab.tma {t} box is {box} for config {c}; a TMA box is 1 to 256 elements a side")
        if rung.cluster is not None and not 1 <= rung.cluster_size(c) <= 16:
            raise ValueError(f"{path}: lab.cluster {rung.cluster} is {rung.cluster_size(c)} for config {c}; "
                             "a cluster holds 1 to 16 blocks")
    return rung


def parse_tma(text: str, where: str, tensors=TMA_TENSORS) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`Q: (B_r, d_head), K: (B_c, d_head)` -> (("Q", ("B_r", "d_head")), ("K", ("B_c", "d_head")));
    each key one of `tensors`."""
    form = f"{where} must read like `Q: (B_r, d_head), K: (B_c, d_head)` (tensors {', '.join(tensors)})"
    try:
        tree = ast.parse("{" + text + "}", mode="eval").body
    except SyntaxError:
        raise ValueError(f"{form}, got {text!r}") from None
    if not isinstance(tree, ast.Dict) or not tree.keys:
        raise ValueError(f"{form}, got {text!r}")
    declared = []
    for key, value in zip(tree.keys, tree.values):
        if not (isinstance(key, ast.Name) and key.id in tensors and isinstance(value, ast.Tuple) and value.elts):
            raise ValueError(f"{form}, got {text!r}")
        if key.id in dict(declared):
            raise ValueError(f"{where} declares {key.id} twice")
        if len(value.elts) > 4:
            raise ValueError(f"{where}: {key.id}'s box has {len(value.elts)} extents; the tensors have 4 dimensions")
        declared.append((key.id, tuple(ast.unparse(e) for e in value.elts)))
    return tuple(declared)


def arch_number(arch: str, where: str = "architecture") -> int:
    """An architecture's number: 90 for "sm_90", "sm_90a" or "compute_90"."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", arch.strip())
    if not m:
        raise ValueError(f"{where} must look like sm_90, got {arch!r}")
    return int(m.group(1))


def check_dtype_param(rung: Rung) -> None:
    """lab.dtype_param names a template parameter (not d_head) whose every value indexes lab.dtypes,
    and every head size has a config for every dtype."""
    where = f"{rung.path}: lab.dtype_param {rung.dtype_param}"
    if rung.dtype_param not in rung.template[1:]:
        raise ValueError(f"{where} is not one of the template parameters after d_head ({', '.join(rung.template[1:])})")
    for c in rung.configs:
        value = rung.params(c)[rung.dtype_param]
        if not 0 <= value < len(rung.dtypes):
            raise ValueError(f"{where}: config {c} has {rung.dtype_param}={value}, but lab.dtypes has "
                             f"{len(rung.dtypes)} entries ({', '.join(f'{i} = {t}' for i, t in enumerate(rung.dtypes))})")
    for d in rung.head_sizes():
        missing = [t for t in rung.dtypes if not rung.configs_for(d, t)]
        if missing:
            raise ValueError(f"{where}: no config for d_head={d} in {', '.join(missing)}")


def assemble(path: Path, seen: tuple[Path, ...] = (), files: list[Path] | None = None) -> str:
    """The text NVRTC compiles: the file, with local `#include "x"` inlined and `#line` directives
    so that compiler messages name the user's file and line. Inlining also puts every included
    helper into the text CuPy hashes for its disk cache, so an edited helper is never stale."""
    if path in seen:
        raise ValueError(f"{path}: #include cycle through {' -> '.join(map(str, seen))}")
    if files is not None:
        files.append(path)
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        m = _INCLUDE.match(line)
        if m:
            included = (path.parent / m.group(1)).resolve()
            if not included.is_file():
                raise ValueError(f"{path}:{lineno}: included file {m.group(1)!r} not found")
            out.append(assemble(included, seen + (path,), files))
            out.append(f'#line {lineno + 1} "{path}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_FUNCS = {"min": min, "max": max}


def evaluate(expr: str, names: dict[str, int]) -> int:
    """Integer arithmetic on the template parameters: + - * // % min max, nothing else."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"cannot evaluate {ast.unparse(node)!r} in {expr!r} (names: {', '.join(names)})")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"bad expression {expr!r}") from exc
    return int(ev(tree))
