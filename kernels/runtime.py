"""One launcher for every rung: validate, pick a configuration, compile through CuPy, launch.

Compilation goes through `cupy.RawModule(code=..., options=..., name_expressions=[...])` and CuPy's
disk cache; the compiled text has every local include inlined (see ladder.assemble), so an edited
.cu or helper is always recompiled. The resource reports (ptxas's, through NVRTC, with or without a
GPU) are kernels/reports.py's.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np

from . import driver, fp8, ladder
from . import triton as triton_rungs
from .prepared import Prepared

COMMON_OPTIONS = ("-ftz=true",)  # CuPy adds -ftz=true to every compile; the NVRTC path matches it
MAX_GRID_YZ = 65535
MAX_PERSISTENT_TILES = 2**31 - 1  # a persistent rung counts its tiles in a 32-bit int

compile_seconds = 0.0  # total time spent compiling in this process (lab.py reports it apart)

# Attend.prepare of inputs not in the rung's dtype: casts into copies made once, one prepare a pass (the
# values bit for bit those of a call: tests/test_kernels_gpu.py, tests/test_fused_gpu.py, -k prepared_cast).
# Off, each layer casts, validates and prepares anew: tools/prefill_profile.py compares the two.
PREPARE_CASTS = True

# prepare() of a persistent or split-KV rung: its zeroed workspace waited for by a CUDA event, and only by a
# launch on another stream than the one that zeroed it (ZeroedOn), where today the host synchronizes the
# stream at every prepare (the eager prefill's layers then run host and device in turn). Its GPU tests pass
# (tests/test_kernels_gpu.py, tests/test_decode_gpu.py: -k waits_by_event), but tools/prefill_profile.py
# measured no gain from it beside PREPARE_CASTS: off, the simpler path, until a pass it speeds up.
WAIT_BY_EVENT = False


class KernelCompileError(RuntimeError):
    """A rung failed to compile; the message names the .cu file and line with NVRTC's log."""


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("CuPy is not installed: pip install -e '.[cuda12]' (or '.[cuda13]')") from exc
    return cupy


def gpu_available() -> bool:
    try:
        cupy = _cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    arch: str  # "sm_90"
    sm_count: int
    max_threads_per_block: int
    max_shared_per_block: int  # opt-in limit for dynamic shared memory

    @staticmethod
    def current() -> DeviceLimits:
        cupy = _cupy()
        dev = cupy.cuda.Device()
        attrs = dev.attributes
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        return DeviceLimits(
            name=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            arch=f"sm_{dev.compute_capability}",
            sm_count=attrs["MultiProcessorCount"],
            max_threads_per_block=attrs["MaxThreadsPerBlock"],
            max_shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
        )


_limits: dict[int, DeviceLimits] = {}


def device_limits() -> DeviceLimits:
    dev = _cupy().cuda.runtime.getDevice()
    if dev not in _limits:
        _limits[dev] = DeviceLimits.current()
    return _limits[dev]


class Instance:
    """One rung compiled for one configuration on the current device."""

    def __init__(self, rung: ladder.Rung, config: tuple[int, ...]):
        global compile_seconds
        cupy = _cupy()
        self.rung, self.config = rung, config
        self.block = rung.block(config)
        self.smem = rung.shared_bytes(config)
        self.workspace_per_row = rung.workspace_per_row(config)
        self.B_r = rung.params(config).get("B_r", 1)
        self.cluster = rung.cluster_size(config)  # None: launched without clusters
        limits = device_limits()
        if not rung.runs_on(limits.arch):
            raise ValueError(f"kernel {rung.name} needs {rung.arch_needed()}; {limits.name} is {limits.arch}")
        expr = rung.name_expression(config)
        start = time.perf_counter()
        try:
            self.module = cupy.RawModule(code=rung.source, options=rung.options, name_expressions=[expr])
            self.function = self.module.get_function(expr)  # the module's globals: tools/rung_trace.py
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(f"{rung.path}: {expr} failed to compile:\n{_log_of(exc)}") from None
        finally:
            compile_seconds += time.perf_counter() - start
        self._fit(limits)
        if self.cluster is not None:
            self._allow_cluster()

    def _fit(self, limits: DeviceLimits):
        fit(self.function, math.prod(self.block), self.smem, limits, f"kernel {self.rung.name} config {self.describe()}")

    def _allow_cluster(self):
        """The cluster size is compiled in (__cluster_dims__), so an ordinary launch forms the clusters
        as long as gridDim.x is a multiple of it; past the portable 8 blocks the kernel must opt in."""
        width = driver.required_cluster_width(self.function)
        if width and width != self.cluster:
            raise KernelCompileError(f"kernel {self.rung.name} config {self.describe()}: lab.cluster is {self.cluster}, "
                                     f"but the kernel is compiled for clusters of {width}")
        if self.cluster > 8:
            driver.allow_non_portable_clusters(self.function)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.rung.params(self.config).items())

    def blocks_per_sm(self) -> int:
        if not hasattr(self, "_blocks_per_sm"):
            self._blocks_per_sm = driver.blocks_per_sm(self.function, math.prod(self.block), self.smem)
        return self._blocks_per_sm

    def grid(self, B: int, NH: int, T_q: int, T_k: int) -> tuple[int, int, int]:
        """The launch grid: (T_r x splits, NH, B), a block per tile (and split); for a lab.persistent
        rung (min(tiles, SMs x blocks per SM), 1, 1), the blocks that run at once, each walking tiles."""
        T_r = (T_q + self.B_r - 1) // self.B_r
        if not self.rung.persistent:
            return T_r * self.splits(B, NH, T_q, T_k), NH, B
        tiles = T_r * NH * B
        if tiles > MAX_PERSISTENT_TILES:
            raise ValueError(f"kernel {self.rung.name}: {tiles} tiles of {self.B_r} rows; a persistent rung "
                             f"takes at most {MAX_PERSISTENT_TILES}")
        resident = device_limits().sm_count * self.blocks_per_sm()
        if resident < 1:
            raise ValueError(f"kernel {self.rung.name} config {self.describe()}: no block fits on an SM")
        return min(tiles, resident), 1, 1

    def splits(self, B: int, NH: int, T_q: int, T_k: int) -> int:
        """Key blocks per query tile for a split-KV rung: enough blocks to fill every SM twice,
        no split shorter than one K/V tile. The kernel reads it back as gridDim.x / T_r; split s
        writes its unnormalised O and its (m, l) per query row into the workspace, and the last
        split of a tile to start (a ticket counter after the partials) combines them; each launch
        leaves the whole workspace at zero. A rung with lab.cluster has its splits fixed at compile
        time: the cluster's blocks are the splits of one tile and combine in shared memory."""
        if not self.rung.split_kv:
            return 1
        if self.cluster is not None:
            return self.cluster
        tiles = B * NH * ((T_q + self.B_r - 1) // self.B_r)
        B_c = self.rung.params(self.config).get("B_c", 64)
        wanted = -(-2 * device_limits().sm_count // tiles)
        return max(1, min(wanted, -(-T_k // B_c), 128))

    def workspace_floats(self, B: int, NH: int, T_q: int, T_k: int) -> int:
        if self.rung.persistent:  # the tile counter, then the rows' scratch
            return 1 + B * NH * T_q * self.workspace_per_row
        if not self.rung.split_kv:
            return B * NH * T_q * self.workspace_per_row
        if self.cluster is not None:  # partials in the cluster's shared memory
            return B * NH * T_q * self.workspace_per_row
        splits = self.splits(B, NH, T_q, T_k)
        d_head = self.config[0]
        tiles = B * NH * ((T_q + self.B_r - 1) // self.B_r)
        return B * NH * T_q * splits * (d_head + 2) + tiles  # partials, then one counter per tile

    def launch(self, q, k, v, out, workspace, scale: float, causal: bool, tensor_maps=(), lse=None, scales=()):
        """One launch, its arguments in the order of the rung's parameters (ladder.PARAMETERS): `lse` for
        a lab.lse rung (None: a null pointer, nothing written), `scales` (Q's, K's, V's tiles) for a
        lab.fp8 rung, `tensor_maps` (a lab.tma rung's descriptors, in its declaration's order) last."""
        B, NH, T_q, _ = q.shape
        NH_kv, T_k = k.shape[1], k.shape[2]
        item = q.itemsize
        (qb, qh, qr), (kb, kh, kr) = q.strides[:3], k.strides[:3]
        values = {"Q": q, "K": k, "V": v, "O": out, "workspace": workspace, "T_q": np.int32(T_q),
                  "T_k": np.int32(T_k), "kv_group": np.int32(NH // NH_kv), "causal": np.int32(causal),
                  "scale": np.float32(scale), "q_batch_stride": np.int64(qb // item),
                  "q_head_stride": np.int64(qh // item), "q_row_stride": np.int64(qr // item),
                  "kv_batch_stride": np.int64(kb // item), "kv_head_stride": np.int64(kh // item),
                  "kv_row_stride": np.int64(kr // item), "lse": np.uint64(0) if lse is None else lse,
                  "n_heads": np.int32(NH), "batch": np.int32(B)}
        values.update(zip(("q_scale", "k_scale", "v_scale"), scales))
        args = tuple(map(values.__getitem__, self.rung.argument_names)) + tuple(tensor_maps)
        grid = self.grid(B, NH, T_q, T_k)
        if tensor_maps:  # a CUtensorMap goes by value: packed as 128 bytes for cuLaunchKernelEx
            stream = _cupy().cuda.get_current_stream().ptr
            driver.PackedLaunch(self.function, grid, self.block, args, shared_mem=self.smem, stream=stream,
                                name=self.rung.name)()
        else:
            self.function(grid, self.block, args, shared_mem=self.smem)


def fit(function, threads: int, smem: int, limits: DeviceLimits, where: str) -> None:
    """A compiled kernel's block and dynamic shared memory checked against the device (ValueError, naming
    `where`), and the shared-memory limit raised past the 48 KiB default where it needs more."""
    cap = min(limits.max_threads_per_block, function.max_threads_per_block)
    static = function.shared_size_bytes
    if threads > cap:
        raise ValueError(f"{where}: {threads} threads per block, but {limits.name} allows {cap} for it")
    if smem + static > limits.max_shared_per_block:
        raise ValueError(f"{where}: needs {smem + static} bytes of shared memory per block, "
                         f"{limits.name} has {limits.max_shared_per_block}")
    if smem > 48 * 1024:  # beyond the default, the kernel must opt in
        function.max_dynamic_shared_size_bytes = smem


def _log_of(exc) -> str:
    text = exc.get_message() if hasattr(exc, "get_message") else str(exc)
    return text.strip()


def instance(kernel, d_head: int, config=None, dtype: str | None = None, grid: tuple[int, int, int] | None = None) -> Instance:
    """The compiled rung for head size d_head: `config` if given, else the first declared
    configuration for d_head that fits this device (rungs declare them in order of preference).
    For a rung with lab.dtype_param, `dtype` (the inputs' dtype name) selects that dtype's configs.
    `grid` = (B, NH, T_q) lets a small problem take another declared tile shape (see _fill)."""
    rung = ladder.load(kernel)
    if config is not None:
        candidates = [_as_config(rung, config)]
        if candidates[0][0] != d_head:
            raise ValueError(f"config {config} has d_head={candidates[0][0]} but the inputs have d={d_head}")
        made_for = rung.dtype_of(candidates[0])
        if dtype is not None and made_for not in (None, dtype):
            raise ValueError(f"config {config} is kernel {rung.name}'s {made_for} instantiation "
                             f"({rung.dtype_param}={rung.params(candidates[0])[rung.dtype_param]}), but the inputs are {dtype}")
    else:
        candidates = rung.configs_for(d_head, dtype)
        if not candidates:
            sizes = ", ".join(map(str, rung.head_sizes()))
            raise ValueError(f"kernel {rung.name} supports head sizes {sizes}; got d={d_head}")
    errors = []
    for i, c in enumerate(candidates):
        try:
            first = _compiled(rung, c)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if config is not None or grid is None or rung.split_kv:
            return first
        # other tile shapes of the same kernel variant (same d_head and non-tile parameters)
        same = [o for o in candidates[i + 1:] if o[:1] + o[3:] == c[:1] + c[3:]]
        return _fill(rung, first, same, grid)
    raise ValueError("no configuration fits this device:\n  " + "\n  ".join(errors))


_instances: dict[tuple, Instance] = {}


def _compiled(rung: ladder.Rung, config: tuple[int, ...]) -> Instance:
    key = (_cupy().cuda.runtime.getDevice(), rung.path, rung.source, rung.options, config)
    if key not in _instances:
        _instances[key] = Instance(rung, config)  # ValueError when it does not fit the device
    return _instances[key]


_choices: dict[tuple, Instance] = {}


def _fill(rung: ladder.Rung, first: Instance, others: list[tuple[int, ...]], grid: tuple[int, int, int]) -> Instance:
    """The rung's first choice when its grid fills the device for two waves or more. A grid smaller
    than the SMs hold at once leaves warps unused that another declared tile shape may put to work:
    then the launcher takes the shape with the most warps resident, min(blocks, SMs x blocks per SM) x
    warps per block. A grid of one wave and part of another leaves most SMs idle in its last: then it
    takes the shape whose busiest SM has the fewest rows to do, waves x B_r (GPT-2 XL's 1,000-token
    prefill, 25 heads: 150 tiles of 192 rows on 132 SMs run as 2 x 192 rows, 200 of 128 as 2 x 128).
    The earlier declared wins ties."""
    B, NH, T_q = grid
    key = (id(first), tuple(others), B, NH, T_q)
    if key in _choices:
        return _choices[key]
    sms = device_limits().sm_count

    def blocks(inst):
        return -(-T_q // inst.B_r) * NH * B

    def resident_warps(inst):
        return min(blocks(inst), sms * inst.blocks_per_sm()) * -(-math.prod(inst.block) // 32)

    def busiest_rows(inst):
        return -(-blocks(inst) // (sms * inst.blocks_per_sm())) * inst.B_r

    best = first
    slots = sms * first.blocks_per_sm()
    if others and blocks(first) < 2 * slots:
        under = blocks(first) < slots
        for c in others:
            try:
                inst = _compiled(rung, c)
            except ValueError:
                continue
            if (resident_warps(inst) > resident_warps(best)) if under else (busiest_rows(inst) < busiest_rows(best)):
                best = inst
    _choices[key] = best
    return best


def _as_config(rung: ladder.Rung, config) -> tuple[int, ...]:
    if isinstance(config, dict):
        unknown = set(config) - set(rung.template)
        if unknown or len(config) != len(rung.template):
            raise ValueError(f"config {config} must give exactly {', '.join(rung.template)}")
        config = [config[name] for name in rung.template]
    if isinstance(config, str):
        config = [int(v) for v in re.split(r"[,x ]+", config.strip()) if v]
    config = tuple(int(v) for v in config)
    if len(config) != len(rung.template) or min(config[:3]) <= 0 or min(config) < 0:
        raise ValueError(f"config {config} must be {len(rung.template)} integers ({', '.join(rung.template)}): "
                         "d_head, B_r and B_c positive, the others not negative")
    if rung.dtype_param is not None and not 0 <= rung.params(config)[rung.dtype_param] < len(rung.dtypes):
        raise ValueError(f"config {config}: {rung.dtype_param} must index lab.dtypes "
                         f"({', '.join(f'{i} = {t}' for i, t in enumerate(rung.dtypes))})")
    return config


def validate(q, k, v, rung: ladder.Rung, causal: bool, scale):
    """Raise a clear TypeError or ValueError for anything the rung cannot run."""
    cupy = _cupy()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} is a NumPy array; kernel {rung.name} runs on the GPU and needs a CuPy array "
                "(cupy.asarray(x)), or use kernels.reference_attention for NumPy"
            )
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    check_layout(q, k, v, rung, causal, scale)


def check_layout(q, k, v, rung: ladder.Rung, causal: bool, scale, family=ladder):
    """The checks that need only shapes, dtypes and strides (so they run on NumPy arrays too). `family`
    (names() and load()) is where the rungs that do support a missing feature are looked up."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype.name not in rung.dtypes:
            raise TypeError(f"{name} has dtype {x.dtype}; kernel {rung.name} supports {', '.join(rung.dtypes)}")
        if x.dtype != q.dtype:
            raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, NH, T, d), got shape {x.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"shapes disagree: q {q.shape} is (B, NH, T_q, d), k {k.shape} and v {v.shape} must both be (B, NH_kv, T_k, d)"
        )
    B, NH, T_q, d = q.shape
    NH_kv, T_k = k.shape[1], k.shape[2]
    if 0 in (B, NH, T_q, d, NH_kv, T_k):
        raise ValueError(f"empty input: q {q.shape}, k {k.shape} (every dimension must be at least 1)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.strides[3] != x.itemsize:
            raise ValueError(f"{name}'s last dimension must have unit stride; its strides are {x.strides} bytes")
    if B > MAX_GRID_YZ or NH > MAX_GRID_YZ:
        raise ValueError(f"B and NH must each be at most {MAX_GRID_YZ}; got B={B}, NH={NH}")
    if d not in rung.head_sizes():
        sizes = ", ".join(map(str, rung.head_sizes()))
        raise ValueError(f"kernel {rung.name} supports head sizes {sizes}; got d={d}")
    if NH % NH_kv:
        raise ValueError(f"q has {NH} heads, k and v {NH_kv}: the query heads must be a multiple of the key/value heads")
    check_features(rung, causal, T_q, T_k, NH, NH_kv, scale, family)


def check_features(rung: ladder.Rung, causal: bool, T_q: int, T_k: int, NH: int, NH_kv: int, scale, family=ladder):
    """What a rung must declare (lab.supports) for these lengths, heads and mask, and a finite scale."""
    needs = {"noncausal": not causal, "cross": T_q != T_k, "gqa": NH_kv != NH}
    what = {"noncausal": "causal=False", "cross": f"query length {T_q} != key length {T_k}",
            "gqa": f"{NH_kv} key/value heads for {NH} query heads"}
    for feature, needed in needs.items():
        if needed and feature not in rung.supports:
            able = [n for n in family.names() if feature in family.load(n).supports]
            raise ValueError(f"kernel {rung.name} does not support {what[feature]}"
                             + (f"; {', '.join(able)} do" if able else "; no rung does yet"))
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")


_split_workspaces: dict[tuple, object] = {}  # one per device, rung instance and size; launches on one stream


def tensor_map_arguments(rung: ladder.Rung, config, tensors: dict) -> list[driver.TensorMapArguments]:
    """The descriptors' arguments of a lab.tma rung, in its declaration's order; `tensors` maps Q, K, V
    and O to the arrays the kernel reads and writes."""
    return [driver.tensor_map_arguments(tensors[t], box, name=t, swizzle=driver.swizzle_for(box[-1] * tensors[t].dtype.itemsize))
            for t, box in rung.tma_boxes(config).items()]


def _aligned(x, boundary: int = 16) -> bool:
    return x.data.ptr % boundary == 0 and all(st % boundary == 0 for st in x.strides[:3])


def _workspace(inst: Instance, B: int, NH: int, T_q: int, T_k: int):
    """The launch's float32 workspace, and a ZeroedOn to wait for (None: nothing to wait for). A persistent
    rung's tile counter and a split-KV rung's counters start at zero and every launch leaves them there."""
    cupy, rung = _cupy(), inst.rung
    floats = max(1, inst.workspace_floats(B, NH, T_q, T_k))
    if rung.persistent:
        # a workspace of this call's own, so that calls prepared apart may run on different streams at once
        workspace = cupy.zeros(floats, dtype=np.float32)
    elif rung.split_kv:
        # zero once, reuse
        key = (cupy.cuda.runtime.getDevice(), id(inst), floats)
        if key not in _split_workspaces:
            _split_workspaces[key] = cupy.zeros(floats, dtype=np.float32)
            if WAIT_BY_EVENT:  # the host waits once, here: a later prepare's event marks only its own stream
                cupy.cuda.get_current_stream().synchronize()
        workspace = _split_workspaces[key]
    else:  # written before it is read
        return cupy.empty(floats, dtype=np.float32), None
    # the zeros are written on this stream: wait for them, so that run() may launch on any stream (a
    # non-blocking stream does not wait for this one, and would read the pool's old bytes); a stream
    # capturing a graph (a prefill's, lm/prefill_graph.py) cannot be synchronized, and holds the zeros in
    # its own order
    if WAIT_BY_EVENT or cupy.cuda.get_current_stream().is_capturing():
        return workspace, ZeroedOn(cupy)
    cupy.cuda.get_current_stream().synchronize()
    return workspace, None


def prepare(q, k, v, *, kernel, causal: bool = True, scale=None, config=None, out=None, return_lse: bool = False):
    """Validate and compile once; return a Prepared that launches the rung when called (for timing
    loops), its `instance` the compiled configuration chosen for these inputs. With return_lse (a
    lab.lse rung) a call returns (out, lse), lse the float32 (B, NH, T_q) log-sum-exp."""
    cupy = _cupy()
    if triton_rungs.owns(kernel):
        if return_lse:
            raise ValueError(f"return_lse: the Triton rung {kernel} does not write the log-sum-exp; {lse_writers()} do")
        return _prepare_triton(q, k, v, kernel, causal, scale, config, out)
    rung = ladder.load(kernel)
    if return_lse and not rung.lse:
        raise ValueError(f"return_lse: kernel {rung.name} does not write the log-sum-exp (lab.lse); {lse_writers()} do")
    validate(q, k, v, rung, causal, scale)
    B, NH, T, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    causal = bool(causal)
    inst = instance(rung.path, d, config, dtype=q.dtype.name, grid=(B, NH, T))
    if rung.fp8:  # e4m3 copies, quantized here once with the configuration's tiles as the blocks
        inputs = fp8.quantize_fp8(q, k, v, block_q=inst.B_r, block_k=rung.params(inst.config)["B_c"],
                                  v_per_head=rung.fp8_v == "head", qk=rung.fp8_qk)
        fp8.warn_if_peaked(inputs, scale)
        run = _prepare_fp8(inst, inputs, causal, scale, _output(q, out))
        return Prepared(run.run, inst, reads_inputs=False)  # it reads the e4m3 copies
    given = q, k, v
    if not rung.strided:
        q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
    else:
        # strided rungs load 16-byte vectors: rows must start on 16-byte boundaries (a TMA
        # descriptor asks the same of the address and the outer strides)
        q, k, v = (x if _aligned(x) else cupy.ascontiguousarray(x) for x in (q, k, v))
        if k.strides != v.strides:  # the kernel reads K and V through one set of strides
            k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
    out = _output(q, out)
    workspace, zeroed = _workspace(inst, B, NH, T, k.shape[2])

    tensors = {"Q": q, "K": k, "V": v, "O": out}
    tensor_maps = [driver.encode_tensor_map(a, t) for t, a in
                   zip(dict(rung.tma), tensor_map_arguments(rung, inst.config, tensors), strict=True)]

    lse = cupy.empty((B, NH, T), dtype=np.float32) if return_lse else None

    def run():
        if zeroed is not None:
            zeroed.wait()
        inst.launch(q, k, v, out, workspace, scale, causal, tensor_maps, lse)
        return (out, lse) if return_lse else out

    return Prepared(run, inst, reads_inputs=all(a is b for a, b in zip((q, k, v), given, strict=True)))


class ZeroedOn:
    """Work queued on the current stream (a workspace's zeros), marked by an event recorded after it. A
    launch on that stream follows it in the stream's order and needs nothing; one on another stream waits
    for the event: on the device (the stream waits), or, while that stream captures a graph (which cannot
    wait on an event recorded outside it), on the host."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.stream = cupy.cuda.get_current_stream()
        self.event = self.stream.record()

    def wait(self) -> None:
        stream = self.cupy.cuda.get_current_stream()
        if stream.ptr == self.stream.ptr:
            return
        if stream.is_capturing():
            self.event.synchronize()
        else:
            stream.wait_event(self.event)


def fp8_rung(inputs=None) -> str:
    """The newest rung declaring lab.fp8 with e4m3 Q and K (ValueError if none does); given Fp8Inputs, the
    newest that takes them (a rung declaring lab.fp8_v head takes V quantized with one scale per head,
    one declaring lab.fp8_qk bf16 Q and K in bfloat16); never one not yet run on a GPU (lab.unverified)."""
    fp8 = [n for n in ladder.names() if ladder.load(n).fp8 and ladder.load(n).unverified is None]
    able = [n for n in fp8 if ladder.load(n).fp8_qk == "e4m3"]
    if inputs is not None:  # the newest that takes them: their Q and K, their V's scales
        able = [n for n in fp8 if ladder.load(n).fp8_qk == inputs.qk]
        if not (inputs.v_per_head or inputs.per_tensor):
            able = [n for n in able if ladder.load(n).fp8_v == "tile"]
    if not able:
        raise ValueError("no rung computes in FP8 (lab.fp8)" + (" on these inputs" if inputs is not None else ""))
    return able[-1]


def check_fp8_inputs(inputs, rung: ladder.Rung, causal: bool, scale) -> None:
    """Fp8Inputs a lab.fp8 rung can run: codes and scales of agreeing shapes and dtypes, a head size
    and the features the rung declares (a clear TypeError or ValueError otherwise)."""
    if not isinstance(inputs, fp8.Fp8Inputs):
        raise TypeError(f"inputs must be kernels.Fp8Inputs (kernels.quantize_fp8), got {type(inputs).__name__}")
    if not rung.fp8:
        raise ValueError(f"kernel {rung.name} does not compute in FP8 (lab.fp8); {fp8_rung()} does")
    arrays = {"q": inputs.q, "k": inputs.k, "v_t": inputs.v_t, "q_scale": inputs.q_scale,
              "k_scale": inputs.k_scale, "v_scale": inputs.v_scale}
    bf16 = {"q", "k"} if inputs.qk == "bf16" else set()
    for name, x in arrays.items():
        want = "float32" if name.endswith("scale") else "bfloat16" if name in bf16 else "uint8"
        if getattr(getattr(x, "dtype", None), "name", None) != want or x.ndim != (3 if name.endswith("scale") else 4):
            raise TypeError(f"inputs.{name} must be a {3 if want == 'float32' else 4}-d {want} array, got "
                            f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    B, NH, T_q, d = inputs.q.shape
    _, NH_kv, T_k, _ = inputs.k.shape
    T_pad = inputs.v_t.shape[3]
    shapes = {"k": (B, NH_kv, T_k, d), "v_t": (B, NH_kv, d, T_pad),
              "q_scale": (B, NH, -(-T_q // inputs.block_q)), "k_scale": (B, NH_kv, -(-T_k // inputs.block_k)),
              "v_scale": (B, NH_kv, -(-T_k // inputs.block_k))}
    for name, shape in shapes.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"inputs.{name} has shape {tuple(arrays[name].shape)}; with q {inputs.q.shape}, k "
                             f"{inputs.k.shape} and blocks of ({inputs.block_q}, {inputs.block_k}) rows it must be {shape}")
    if T_pad % 16 or T_pad < -(-T_k // inputs.block_k) * inputs.block_k or 0 in (B, NH, T_q, NH_kv, T_k) or NH % NH_kv:
        raise ValueError(f"inputs: q {inputs.q.shape}, k {inputs.k.shape}, v_t {inputs.v_t.shape}: every dimension at "
                         "least 1, NH a multiple of NH_kv, v_t's keys T_k rounded up to whole blocks and to 16")
    if d not in rung.head_sizes():
        raise ValueError(f"kernel {rung.name} supports head sizes {', '.join(map(str, rung.head_sizes()))}; got d={d}")
    if B > MAX_GRID_YZ or NH > MAX_GRID_YZ:
        raise ValueError(f"B and NH must each be at most {MAX_GRID_YZ}; got B={B}, NH={NH}")
    if rung.fp8_qk != inputs.qk:
        raise ValueError(f"kernel {rung.name} takes Q and K as {rung.fp8_qk} (lab.fp8_qk), the inputs hold "
                         f"{inputs.qk}: quantize with kernels.quantize_for({rung.name!r}, q, k, v)")
    if rung.fp8_v == "head" and not (inputs.v_per_head or inputs.per_tensor):
        raise ValueError(f"kernel {rung.name} needs V with one scale per head (lab.fp8_v head): quantize with "
                         f"kernels.quantize_fp8(..., v_per_head=True), or kernels.quantize_for({rung.name!r}, q, k, v)")
    check_features(rung, causal, T_q, T_k, NH, NH_kv, scale)


def quantize_for(kernel, q, k, v, *, config=None, **options):
    """kernels.quantize_fp8 of q, k, v as the FP8 rung `kernel` takes them: blocks of its configuration's
    B_r and B_c rows (`config`, or the one the launcher picks for the head size), V's scales per head where
    it declares lab.fp8_v head, Q and K in bfloat16 where it declares lab.fp8_qk bf16; `options`
    (hadamard, seed, per_tensor) go to quantize_fp8."""
    rung = ladder.load(kernel)
    if not rung.fp8:
        raise ValueError(f"kernel {rung.name} does not compute in FP8 (lab.fp8); {fp8_rung()} does")
    configs = [_as_config(rung, config)] if config is not None else rung.configs_for(q.shape[3])
    if not configs:
        raise ValueError(f"kernel {rung.name} supports head sizes {', '.join(map(str, rung.head_sizes()))}; "
                         f"got d={q.shape[3]}")
    params = rung.params(configs[0])
    return fp8.quantize_fp8(q, k, v, block_q=params["B_r"], block_k=params["B_c"],
                            v_per_head=rung.fp8_v == "head", qk=rung.fp8_qk, **options)


def fp8_config(rung: ladder.Rung, inputs, config=None) -> tuple[int, ...]:
    """The configuration whose tiles are the inputs' blocks (B_r = block_q, B_c = block_k): `config`,
    checked, or the first declared one (ValueError naming the rung's tile shapes if none)."""
    d = inputs.shape[3]
    tiles = lambda c: (rung.params(c)["B_r"], rung.params(c)["B_c"])  # noqa: E731
    if config is not None:
        candidates = [_as_config(rung, config)]
    else:
        candidates = rung.configs_for(d)
    fitting = [c for c in candidates if c[0] == d and tiles(c) == (inputs.block_q, inputs.block_k)]
    if not fitting:
        shapes = ", ".join(f"{r} x {c}" for r, c in dict.fromkeys(tiles(c) for c in rung.configs_for(d)))
        raise ValueError(f"the inputs are quantized in blocks of {inputs.block_q} x {inputs.block_k} rows (Q x K, V), "
                         + (f"config {candidates[0]} has tiles {tiles(candidates[0])}" if config is not None else
                            f"kernel {rung.name} has tiles {shapes} (B_r x B_c) at d={d}")
                         + ": quantize with block_q=B_r and block_k=B_c of one of them")
    return fitting[0]


def prepare_fp8(inputs, *, kernel=None, causal: bool = True, scale=None, config=None, out=None):
    """prepare() for kernels.Fp8Inputs (kernels.quantize_fp8 of CuPy arrays): validate and compile once,
    return run() -> out, the bfloat16 (B, NH, T_q, d) output. `kernel` defaults to the newest rung
    declaring lab.fp8 that takes the inputs; its configuration is the one whose tiles are the inputs' blocks."""
    rung = ladder.load(kernel if kernel is not None else fp8_rung(inputs if isinstance(inputs, fp8.Fp8Inputs) else None))
    check_fp8_inputs(inputs, rung, causal, scale)
    cupy = _cupy()
    if not all(isinstance(x, cupy.ndarray) for x in (inputs.q, inputs.k, inputs.v_t, inputs.q_scale)):
        raise TypeError(f"inputs hold NumPy arrays; kernel {rung.name} runs on the GPU: quantize CuPy arrays "
                        "(or use kernels.fp8.emulated_attention for NumPy)")
    inst = instance(rung.path, inputs.shape[3], fp8_config(rung, inputs, config))
    import ml_dtypes

    if out is None:
        out = cupy.empty(inputs.shape, dtype=ml_dtypes.bfloat16)
    elif not (isinstance(out, cupy.ndarray) and out.dtype == ml_dtypes.bfloat16 and out.shape == inputs.shape
              and out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous bfloat16 CuPy array of shape {inputs.shape}")
    return _prepare_fp8(inst, inputs, causal, scale, out)


def _prepare_fp8(inst: Instance, inputs, causal: bool, scale, out):
    """run() of a lab.fp8 rung on checked Fp8Inputs, into `out`."""
    cupy = _cupy()
    scale = 1.0 / math.sqrt(inputs.shape[3]) if scale is None else float(scale)
    q, k, v_t = (cupy.ascontiguousarray(x) for x in (inputs.q, inputs.k, inputs.v_t))
    scales = tuple(cupy.ascontiguousarray(x) for x in (inputs.q_scale, inputs.k_scale, inputs.v_scale))
    B, NH, T_q, _ = q.shape
    workspace, zeroed = _workspace(inst, B, NH, T_q, inputs.T_k)
    tensors = {"Q": q, "K": k, "V": v_t, "O": out}
    tensor_maps = [driver.encode_tensor_map(a, t) for t, a in
                   zip(dict(inst.rung.tma), tensor_map_arguments(inst.rung, inst.config, tensors), strict=True)]

    def run():
        if zeroed is not None:
            zeroed.wait()
        inst.launch(q, k, v_t, out, workspace, scale, bool(causal), tensor_maps, scales=scales)
        return out

    return Prepared(run, inst, reads_inputs=True)


def attention_fp8(inputs, *, kernel=None, causal: bool = True, scale=None, config=None, out=None):
    """The FP8 rung on kernels.Fp8Inputs (prepare_fp8, then run): bfloat16 (B, NH, T_q, d). Causal by
    default, the mask aligned bottom-right when T_q != T_k; `scale` defaults to 1/sqrt(d)."""
    return prepare_fp8(inputs, kernel=kernel, causal=causal, scale=scale, config=config, out=out)()


def lse_writers() -> str:
    """The rungs that declare lab.lse, in words: "v13_fa2_partitioning, v14_tf32_mma" or "no rung"."""
    return ", ".join(n for n in ladder.names() if ladder.load(n).lse) or "no rung"


def _output(q, out):
    """`out` checked, or a new array: C-contiguous, q's dtype and shape."""
    cupy = _cupy()
    if out is None:
        return cupy.empty(q.shape, dtype=q.dtype)
    if not (isinstance(out, cupy.ndarray) and out.dtype == q.dtype and out.shape == q.shape and out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous {q.dtype} CuPy array of shape {q.shape}")
    return out


def _prepare_triton(q, k, v, kernel, causal, scale, config, out):
    """prepare() for a Triton rung (kernels/triton/): the same validation and output, its own launch."""
    rung = triton_rungs.load(kernel)
    triton_rungs.module(rung)  # without Triton, say how to install it before anything else
    validate(q, k, v, rung, causal, scale)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return triton_rungs.prepare(rung, q, k, v, _output(q, out), causal=bool(causal), scale=scale, config=config)


class Attend:
    """A rung as the attention function gpt2.forward takes: attend(q, k, v) is kernels.attention with
    the rung (resolved once) and causal fixed; with `dtype`, inputs of another dtype (a bfloat16 run's
    float32 prefill on the fast path) are cast to it and the output back to theirs.
    attend.prepare(q, k, v) returns run() -> o for callers that launch on the same arrays many times
    with new contents (gpt2.fast's whole-sequence pass: every layer of a step reads one qkv buffer):
    validated and compiled once, one output array reused. Where the rung needs copies of its inputs
    (contiguous, 16-byte aligned, or cast), run() makes them anew; with PREPARE_CASTS, inputs to cast
    go into copies made once, on which the rung is prepared once (Attend._prepare_cast)."""

    def __init__(self, kernel, causal: bool = True, dtype: str | None = None):
        # resolving a name scans kernels/ (or kernels/triton/)
        self.path = str(triton_rungs.resolve(kernel) if triton_rungs.owns(kernel) else ladder.resolve(kernel))
        self.causal, self.dtype = causal, dtype

    def __call__(self, q, k, v):
        if self.dtype is None or q.dtype.name == self.dtype:
            return attention(q, k, v, kernel=self.path, causal=self.causal)
        cast = (x.astype(self.dtype) for x in (q, k, v))
        return attention(*cast, kernel=self.path, causal=self.causal).astype(q.dtype)

    def prepare(self, q, k, v):
        if self.dtype is not None and q.dtype.name != self.dtype:
            return self._prepare_cast(q, k, v) if PREPARE_CASTS else (lambda: self(q, k, v))
        run = prepare(q, k, v, kernel=self.path, causal=self.causal)
        return run if run.reads_inputs else (lambda: self(q, k, v))

    def _prepare_cast(self, q, k, v):
        """prepare() for inputs not in the rung's dtype: the rung prepared once on contiguous copies in
        its dtype, and run() casting q, k, v into them, launching, and casting the output back into an
        array of q's dtype made once; each cast one element-wise copy on the current stream, the one
        astype makes. The values of self(q, k, v): the same casts, rung and configuration (chosen by
        dtype and shape, not strides)."""
        if not triton_rungs.owns(self.path) and ladder.load(self.path).fp8:
            return lambda: self(q, k, v)  # it quantizes its inputs when prepared: copies of nothing yet
        cupy = _cupy()
        copies = tuple(cupy.empty(x.shape, dtype=self.dtype) for x in (q, k, v))
        run = prepare(*copies, kernel=self.path, causal=self.causal)
        if not run.reads_inputs:  # copies of the copies (a strided rung's rows off 16 bytes)
            return lambda: self(q, k, v)
        out = cupy.empty(q.shape, dtype=q.dtype)

        def cast_run():
            for x, copy in zip((q, k, v), copies, strict=True):
                cupy.copyto(copy, x, casting="unsafe")
            cupy.copyto(out, run(), casting="unsafe")
            return out

        return cast_run


def launcher(attend, q, k, v):
    """attend(q, k, v) as run() -> o, for a caller that launches it on the same arrays many times with
    new contents: a kernels.Attend prepared once (Attend.prepare), any other attention called each time."""
    return attend.prepare(q, k, v) if isinstance(attend, Attend) else (lambda: attend(q, k, v))


def attention(q, k, v, *, kernel, causal: bool = True, scale=None, config=None, out=None, return_lse: bool = False):
    """Attention of q (B, NH, T_q, d) over k, v (B, NH_kv, T_k, d), CuPy arrays (float32, or a dtype
    the rung declares), with the named rung (a .cu rung, or a Triton rung: "t01"); a new contiguous (B, NH, T_q, d) array of the input
    dtype (or `out`, filled). Causal by default, the mask aligned bottom-right when T_q != T_k;
    `scale` defaults to 1/sqrt(d). Non-causal, T_q != T_k and NH_kv < NH need a rung declaring them.
    return_lse=True (a rung declaring lab.lse) returns (out, lse): lse (B, NH, T_q) float32, each query
    row's log-sum-exp of its scaled scores in natural log (+inf for a row that sees no key), what
    kernels.attention_backward takes.

    The FP8 rungs (kernel="v25", "v26" or "v27") quantize q, k and v to e4m3 first. Its error is an order of magnitude above
    bfloat16's even on N(0, 1) inputs and grows with the spread of the scaled scores (3 mantissa bits under a
    peaked softmax), fastest when q and k share an offset: use it where a few percent of relative error is
    acceptable and the scores' std stays small (measured: `bench.py fp8 --envelope`, docs/results.md#envelope;
    docs/ladder.md, v25). Past kernels.fp8.PEAKED_SCORE_ESTIMATE, an upper estimate of the scores' spread
    from the block maxima, it warns (a UserWarning; rare outliers alone can raise the estimate)."""
    return prepare(q, k, v, kernel=kernel, causal=causal, scale=scale, config=config, out=out, return_lse=return_lse)()

