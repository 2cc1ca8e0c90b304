"""The flash-attention ladder: one .cu file per rung, compiled at run time through CuPy.

    kernels.names()                                   rung names in ladder order
    kernels.default_rung("bfloat16", 128, gqa=True, arch="sm_90")   the rung a run gets when none is named
                                                      (kernels.rungs_for: all that fit, oldest first)
    kernels.attention(q, k, v, kernel="v08")          run a rung on (B, NH, T, d) float32 CuPy arrays
    kernels.reference_attention(q, k, v)              the same in plain array code (NumPy or CuPy)
    attend = kernels.Attend("v14")                    a rung as gpt2.forward's attend(q, k, v)
    kernels.resources("v08", arch="sm_90")            registers, shared memory, spills per config
    kernels.triton_names()                            the Triton rungs (kernels/triton/tNN_*.py), run by the
                                                      same attention/prepare/Attend: kernel="t01"
    kernels.triton_unavailable()                      None, or one line: why they cannot run here
    o, lse = kernels.attention(q, k, v, kernel="v15", return_lse=True)   and each row's log-sum-exp
    dq, dk, dv = kernels.attention_backward(q, k, v, o, lse, do, kernel="b04")   the backward ladder
                                                      (kernels/backward/bNN_*.cu): the gradients
    kernels.reference_attention_backward(q, k, v, o, lse, do)   the same in plain array code
    inputs = kernels.quantize_fp8(q, k, v, block_q=128, block_k=128)   e4m3 codes and per-tile scales (kernels.fp8)
    o = kernels.attention_fp8(inputs)                 the newest FP8 rung that takes them (v26 here; v27 takes
                                                      V per head: kernels.quantize_for("v27", q, k, v));
                                                      kernels.attention(q, k, v, kernel="v27") quantizes itself
    kernels.backward_names()                          the backward rungs in ladder order

names(), load(), resolve() and resources() are the .cu ladder's (NVRTC); kernels.triton has the
Triton family's own (names, resolve, load, configs), kernels.backward the backward ladder's (names,
resolve, load; kernels.backward.launcher: prepare_backward, compile_report).
"""

from .backward import names as backward_names
from .backward.launcher import attention_backward
from .fp8 import Fp8Inputs, quantize_fp8
from .ladder import default_rung, load, names, resolve, rungs_for
from .prepared import Prepared
from .reference import reference_attention, reference_attention_backward
from .reports import Resources, compile_report, resources
from .runtime import (
    Attend,
    KernelCompileError,
    attention,
    attention_fp8,
    device_limits,
    gpu_available,
    instance,
    launcher,
    prepare,
    prepare_fp8,
    quantize_for,
)
from .triton import names as triton_names
from .triton import unavailable as triton_unavailable

__all__ = [
    "Attend",
    "Fp8Inputs",
    "KernelCompileError",
    "Prepared",
    "Resources",
    "attention",
    "attention_backward",
    "attention_fp8",
    "backward_names",
    "compile_report",
    "default_rung",
    "device_limits",
    "gpu_available",
    "instance",
    "launcher",
    "load",
    "names",
    "prepare",
    "prepare_fp8",
    "quantize_for",
    "quantize_fp8",
    "reference_attention",
    "reference_attention_backward",
    "resolve",
    "resources",
    "rungs_for",
    "triton_names",
    "triton_unavailable",
]
