"""The flash-attention ladder: one .cu file per rung, compiled at run time through CuPy.

    kernels.names()                                   rung names in ladder order
    kernels.attention(q, k, v, kernel="v08")          run a rung on (B, NH, T, d) float32 CuPy arrays
    kernels.reference_attention(q, k, v)              the same in plain array code (NumPy or CuPy)
    attend = kernels.Attend("v14")                    a rung as gpt2.forward's attend(q, k, v)
    kernels.resources("v08", arch="sm_90")            registers, shared memory, spills per config
"""

from .ladder import load, names, resolve
from .reference import reference_attention
from .runtime import (
    Attend,
    KernelCompileError,
    Resources,
    attention,
    compile_report,
    device_limits,
    gpu_available,
    instance,
    prepare,
    resources,
)

__all__ = [
    "Attend",
    "KernelCompileError",
    "Resources",
    "attention",
    "compile_report",
    "device_limits",
    "gpu_available",
    "instance",
    "load",
    "names",
    "prepare",
    "reference_attention",
    "resolve",
    "resources",
]
