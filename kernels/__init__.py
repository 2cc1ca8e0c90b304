"""The flash-attention ladder: one .cu file per rung, compiled at run time through CuPy.

    kernels.names()                                   rung names in ladder order
    kernels.attention(q, k, v, kernel="v08")          run a rung on (B, NH, T, d) float32 CuPy arrays
    kernels.reference_attention(q, k, v)              the same in plain array code (NumPy or CuPy)
    attend = kernels.Attend("v14")                    a rung as gpt2.forward's attend(q, k, v)
    kernels.resources("v08", arch="sm_90")            registers, shared memory, spills per config
    kernels.triton_names()                            the Triton rungs (kernels/triton/tNN_*.py), run by the
                                                      same attention/prepare/Attend: kernel="t01"
    kernels.triton_unavailable()                      None, or one line: why they cannot run here

names(), load(), resolve() and resources() are the .cu ladder's (NVRTC); kernels.triton has the
Triton family's own (names, resolve, load, configs).
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
from .triton import names as triton_names
from .triton import unavailable as triton_unavailable

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
    "triton_names",
    "triton_unavailable",
]
