"""Running a backward rung: validation, the choice of a configuration, compilation through CuPy (every
phase of a configuration in one module), the launches; and ptxas's report of every phase without a GPU."""

from __future__ import annotations

import math
import time

import numpy as np

from .. import backward, driver, runtime
from ..reports import Resources, ptxas_reports
from ..runtime import KernelCompileError


class BackwardInstance:
    """One backward rung compiled for one configuration on the current device: a function per phase."""

    def __init__(self, rung: backward.BackwardRung, config: tuple[int, ...]):
        cupy = runtime._cupy()
        self.rung, self.config = rung, config
        limits = runtime.device_limits()
        if not rung.runs_on(limits.arch):
            raise ValueError(f"kernel {rung.name} needs {rung.arch_needed()}; {limits.name} is {limits.arch}")
        expressions = [rung.entry_expression(p, config) for p in rung.phases]
        start = time.perf_counter()
        try:
            module = cupy.RawModule(code=rung.source, options=rung.options, name_expressions=expressions)
            self.functions = [module.get_function(e) for e in expressions]
            self.module = module  # its globals: tools/rung_trace.py reads a STEP_TRACE build's step_trace
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(f"{rung.path}: {', '.join(expressions)} failed to compile:\n"
                                     f"{runtime._log_of(exc)}") from None
        finally:
            runtime.compile_seconds += time.perf_counter() - start
        self.blocks = [rung.phase_block(p, config) for p in rung.phases]
        self.smem = [rung.phase_smem(p, config) for p in rung.phases]
        for phase, fn, block, smem in zip(rung.phases, self.functions, self.blocks, self.smem):
            runtime.fit(fn, math.prod(block), smem, limits, f"kernel {rung.name} config {self.describe()} {phase.entry}")

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.rung.params(self.config).items())

    def launch(self, q, k, v, o, lse, do, dq, dk, dv, D, dq_accum, dq_turns, scale: float, causal: bool,
               tensor_maps=()):
        """Every phase, in order, on CuPy's current stream; dq_accum and dq_turns None: null pointers.
        `tensor_maps`, a lab.tma rung's descriptors, are every phase's last parameters."""
        B, NH, T_q, _ = q.shape
        NH_kv, T_k = k.shape[1], k.shape[2]
        null = np.uint64(0)
        args = (q, k, v, o, do, lse, dq, dk, dv, D, null if dq_accum is None else dq_accum,
                null if dq_turns is None else dq_turns, np.int32(T_q), np.int32(T_k), np.int32(NH // NH_kv),
                np.int32(causal), np.float32(scale))
        if self.rung.has_persistent_phase:  # a grid of one block an SM no longer says the heads and the batch
            args += (np.int32(NH_kv), np.int32(B))
        sm_count = runtime.device_limits().sm_count
        stream = runtime._cupy().cuda.get_current_stream().ptr if tensor_maps else 0
        for phase, fn, block, smem in zip(self.rung.phases, self.functions, self.blocks, self.smem):
            grid = self.rung.grid(phase, self.config, B, NH, NH_kv, T_q, T_k, sm_count)
            if tensor_maps:  # a CUtensorMap goes by value: packed as 128 bytes for cuLaunchKernelEx
                driver.PackedLaunch(fn, grid, block, args + tuple(tensor_maps), shared_mem=smem, stream=stream,
                                    name=f"{self.rung.name}:{phase.entry}")()
            else:
                fn(grid, block, args, shared_mem=smem)


_instances: dict[tuple, BackwardInstance] = {}


def _compiled(rung: backward.BackwardRung, config: tuple[int, ...]) -> BackwardInstance:
    key = (runtime._cupy().cuda.runtime.getDevice(), rung.path, rung.source, rung.options, config)
    if key not in _instances:
        _instances[key] = BackwardInstance(rung, config)  # ValueError when it does not fit the device
    return _instances[key]


def candidates(rung: backward.BackwardRung, d_head: int, dtype: str, deterministic: bool, config=None) -> list:
    """The configurations to try, in order: `config` if given (checked against the rest), else the
    declared ones for d_head and dtype; deterministic ones only if asked, otherwise the others first."""
    if config is not None:
        config = runtime._as_config(rung, config)
        if config[0] != d_head:
            raise ValueError(f"config {config} has d_head={config[0]} but the inputs have d={d_head}")
        if rung.dtype_of(config) not in (None, dtype):
            raise ValueError(f"config {config} is kernel {rung.name}'s {rung.dtype_of(config)} instantiation, "
                             f"but the inputs are {dtype}")
        if deterministic and not rung.is_deterministic(config):
            raise ValueError(f"config {config} of kernel {rung.name} is not deterministic (lab.deterministic)")
        return [config]
    found = rung.configs_for(d_head, dtype)
    if not found:
        raise ValueError(f"kernel {rung.name} supports head sizes {', '.join(map(str, rung.head_sizes()))}; got d={d_head}")
    chosen = [c for c in found if rung.is_deterministic(c)]
    if deterministic:
        if not chosen:
            raise ValueError(f"kernel {rung.name} has no deterministic configuration for d={d_head} "
                             f"(lab.deterministic); {backward.deterministic_rungs()} have")
        return chosen
    return [c for c in found if not rung.is_deterministic(c)] + chosen  # the faster, atomic ones first


def instance(kernel, d_head: int, dtype: str, deterministic: bool = False, config=None) -> BackwardInstance:
    """The compiled rung: the first candidate configuration that fits this device."""
    rung = backward.load(kernel)
    errors = []
    for c in candidates(rung, d_head, dtype, deterministic, config):
        try:
            return _compiled(rung, c)
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError("no configuration fits this device:\n  " + "\n  ".join(errors))


def check_layout(q, k, v, o, lse, do, rung: backward.BackwardRung, causal: bool, scale) -> None:
    """The checks that need only shapes and dtypes (so they run on NumPy arrays too): q, k, v as the
    forward's, o and do q's shape and dtype, lse float32 (B, NH, T_q)."""
    runtime.check_layout(q, k, v, rung, causal, scale, family=backward)
    for name, x in (("o", o), ("do", do)):
        if getattr(x, "shape", None) != q.shape or x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's shape {q.shape} and dtype {q.dtype}; got "
                             f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}".rstrip())
    if getattr(lse, "shape", None) != q.shape[:3] or lse.dtype != np.float32:
        raise ValueError(f"lse must be float32 of shape (B, NH, T_q) = {q.shape[:3]} (the forward's log-sum-exp: "
                         f"kernels.attention(..., return_lse=True)); got {getattr(lse, 'shape', type(lse).__name__)} "
                         f"{getattr(lse, 'dtype', '')}".rstrip())


def validate(q, k, v, o, lse, do, rung: backward.BackwardRung, causal: bool, scale) -> None:
    """Raise a clear TypeError or ValueError for anything the rung cannot run."""
    cupy = runtime._cupy()
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("do", do)):
        if isinstance(x, np.ndarray):
            raise TypeError(f"{name} is a NumPy array; kernel {rung.name} runs on the GPU and needs a CuPy array "
                            "(cupy.asarray(x)), or use kernels.reference_attention_backward for NumPy")
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    check_layout(q, k, v, o, lse, do, rung, causal, scale)


def prepare_backward(q, k, v, o, lse, do, *, kernel, causal: bool = True, scale=None, deterministic: bool = False,
                     config=None):
    """Validate and compile once; return a function that launches every phase and returns (dq, dk, dv),
    the same arrays each time (for timing loops); its `instance` attribute is the configuration chosen."""
    cupy = runtime._cupy()
    rung = backward.load(kernel)
    validate(q, k, v, o, lse, do, rung, causal, scale)
    B, NH, T_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    inst = instance(rung.path, d, q.dtype.name, deterministic, config)
    q, k, v, o, lse, do = (_contiguous(cupy, x) for x in (q, k, v, o, lse, do))
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    D = cupy.empty((B, NH, T_q), dtype=np.float32)
    dq_accum = dq_turns = None
    if rung.dq_accum:  # cleared by the rung's first phase
        dq_accum = cupy.empty(q.shape, dtype=np.float32)
        counts = B * NH * -(-T_q // rung.params(inst.config)["B_r"])  # then a persistent phase's tile counter
        dq_turns = cupy.empty(counts + rung.has_persistent_phase, dtype=np.int32)
    causal = bool(causal)
    tensors = {"Q": q, "K": k, "V": v, "O": o, "dO": do, "dQ_accum": dq_accum}
    tensor_maps = [driver.encode_tensor_map(a, t) for t, a in
                   zip(dict(rung.tma), tensor_map_arguments(rung, inst.config, tensors), strict=True)]

    def run():
        inst.launch(q, k, v, o, lse, do, dq, dk, dv, D, dq_accum, dq_turns, scale, causal, tensor_maps)
        return dq, dk, dv

    run.instance = inst
    return run


def tensor_map_arguments(rung: backward.BackwardRung, config, tensors: dict) -> list[driver.TensorMapArguments]:
    """The descriptors' arguments of a lab.tma rung, in its declaration's order; `tensors` maps Q, K, V,
    O, dO and dQ_accum to the arrays the phases read and write."""
    return [driver.tensor_map_arguments(tensors[t], box, name=t) for t, box in rung.tma_boxes(config).items()]


def _contiguous(cupy, x):
    """x itself if C-contiguous and on a 16-byte boundary (the rungs read rows 16 bytes at a time), else
    a copy that is (a new allocation is 256-byte aligned)."""
    if x.flags.c_contiguous and x.data.ptr % 16 == 0:
        return x
    return cupy.array(x, order="C", copy=True)


def attention_backward(q, k, v, o, lse, do, *, kernel, causal: bool = True, scale=None, deterministic: bool = False,
                       config=None):
    """The gradients (dq, dk, dv) of attention's output o = attention(q, k, v) given do = dL/do, with a
    backward rung ("b02"; kernels.backward_names()). q, o, do (B, NH, T_q, d) and k, v (B, NH_kv, T_k, d)
    CuPy arrays of one dtype the rung declares; lse the forward's float32 (B, NH, T_q) log-sum-exp
    (kernels.attention(..., return_lse=True)). causal and scale as in kernels.attention; dk and dv of a
    K/V head sum its query heads'. deterministic=True takes a configuration that gives the same bits on
    every run (dQ summed in a fixed order). New contiguous arrays of the inputs' dtype."""
    return prepare_backward(q, k, v, o, lse, do, kernel=kernel, causal=causal, scale=scale,
                            deterministic=deterministic, config=config)()


def compile_report(kernel, arch: str, configs=None) -> list[Resources]:
    """ptxas's report (kernels.compile_report's) of every phase of every declared configuration (or
    `configs`), compiled with NVRTC for `arch`, no GPU needed; `kernel` is "b02_fa2:backward_dk_dv"."""
    rung = backward.load(kernel)
    configs = [runtime._as_config(rung, c) for c in configs] if configs else list(rung.configs)
    pairs = [(c, p) for c in configs for p in rung.phases]
    reports = ptxas_reports(rung, arch, [rung.entry_expression(p, c) for c, p in pairs])
    return [Resources(kernel=f"{rung.name}:{p.entry}", config=rung.params(c), arch=arch,
                      threads=math.prod(rung.phase_block(p, c)), dynamic_smem=rung.phase_smem(p, c), **values)
            for (c, p), values in zip(pairs, reports)]
