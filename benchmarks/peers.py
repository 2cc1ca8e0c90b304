"""The peers every rung is timed beside: the CuPy reference (kernels.reference_attention), torch's
scaled_dot_product_attention with one backend enabled at a time (math, memory-efficient, flash, cuDNN),
and the plain PyTorch attention (torch_attention.py) run eagerly or compiled with torch.compile (two
modes; opt-in: --peers), run on the rungs' own inputs with the rungs' mask."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import kernels

from . import device, timing
from .cases import Case, Inputs, Shape
from .device import NotComparable, Unavailable, first_line


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    backend: str | None  # torch.nn.attention.SDPBackend member; None for the CuPy reference
    materialises: bool  # builds the T x T score matrix: memory grows with T^2
    plain: str | None = None  # the plain PyTorch attention: "eager", or the torch.compile mode it is compiled in

    def memory_needed(self, shape: Shape | Case) -> int:
        """A generous estimate for the materialising peers: three (B, NH, T_q, T_k) float32 temporaries."""
        return 3 * 4 * shape.B * shape.NH * shape.T_q * shape.T_k + (1 << 28) if self.materialises else 0


PEERS = {p.name: p for p in (
    Peer("reference", "CuPy reference", None, True),
    Peer("sdpa_math", "SDPA math", "MATH", True),
    Peer("sdpa_efficient", "SDPA efficient", "EFFICIENT_ATTENTION", False),
    Peer("sdpa_flash", "SDPA flash", "FLASH_ATTENTION", False),
    Peer("sdpa_cudnn", "SDPA cuDNN", "CUDNN_ATTENTION", False),
    Peer("torch_naive", "PyTorch (plain)", None, True, plain="eager"),
    Peer("torch_compile", "torch.compile", None, True, plain="default"),
    Peer("torch_compile_max", "torch.compile max-autotune", None, True, plain="max-autotune-no-cudagraphs"),
)}
COMPILED = ("torch_compile", "torch_compile_max")  # compiled on first use per shape and dtype: minutes at worst
DEFAULT_PEERS = {"float32": ("reference", "sdpa_math", "sdpa_efficient"),
                 "bfloat16": ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn"),
                 "float16": ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn")}
COMPARE_TO = {"float32": ("sdpa_efficient", "reference"),  # the README's "vs" columns, besides the previous rung
              "bfloat16": ("sdpa_flash", "sdpa_cudnn"),
              "float16": ("sdpa_flash", "sdpa_cudnn")}
FEATURE_PEER = {"float32": "sdpa_efficient", "bfloat16": "sdpa_flash", "float16": "sdpa_flash"}  # `features`


def sdpa_mask(shape: Shape | Case) -> str:
    """How SDPA expresses the rungs' mask for this shape: "none" (non-causal, or one query row under the
    bottom-right mask, which hides nothing from it), "is_causal" (T_q == T_k, where is_causal's top-left
    alignment is the same mask) or "lower_right" (T_q != T_k: torch.nn.attention.bias.causal_lower_right)."""
    if not shape.causal:
        return "none"
    if shape.T_q == shape.T_k:
        return "is_causal"
    return "none" if shape.T_q == 1 else "lower_right"


def lower_right_backend(q, k, v) -> str:
    """The SDPBackend member torch runs causal_lower_right with on these tensors under the backends now
    enabled: flash if it can, else memory-efficient, else the math path on a materialised mask
    (torch/nn/attention/bias.py, CausalBias._dispatch)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    try:
        params = SDPAParams(q, k, v, None, 0.0, False, False)  # torch >= 2.5: enable_gqa last
    except TypeError:
        params = SDPAParams(q, k, v, None, 0.0, False)
    if can_use_flash_attention(params):
        return "FLASH_ATTENTION"
    return "EFFICIENT_ATTENTION" if can_use_efficient_attention(params) else "MATH"


def sdpa_launch(torch, peer: Peer, q, k, v, shape: Shape | Case):
    """A function running torch SDPA on q, k, v as the rungs compute `shape` (its mask, cross lengths,
    grouped-query heads), under the backend the caller enabled; its `note` says how. Grouped-query heads
    go through enable_gqa=True where this torch and backend take it (one trial call), else through K and
    V repeated to NH heads for the peer only. NotComparable where the mask cannot be expressed."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs, notes = {}, []
    mask = sdpa_mask(shape)
    if mask == "is_causal":
        kwargs["is_causal"] = True
    elif mask == "lower_right":
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError:
            raise NotComparable("n/a: this torch has no torch.nn.attention.bias.causal_lower_right, and "
                                "is_causal=True aligns the mask top-left, not bottom-right") from None
        runs = lower_right_backend(q, k, v)
        if runs != peer.backend:
            raise NotComparable(f"n/a: torch runs the bottom-right causal mask of these inputs with {runs}, not "
                                f"{peer.backend}")
        kwargs["attn_mask"] = causal_lower_right(shape.T_q, shape.T_k)
        notes.append("attn_mask=causal_lower_right(T_q, T_k)")
    elif shape.causal:
        notes.append("one query row: the bottom-right mask hides no key, so is_causal=False")
    if shape.NH_kv != shape.NH:
        try:
            sdpa(q, k, v, enable_gqa=True, **kwargs)
            torch.cuda.synchronize()
            kwargs["enable_gqa"] = True
            notes.append("enable_gqa=True")
        except (TypeError, RuntimeError) as exc:  # an older torch, or a backend without grouped heads
            group = shape.NH // shape.NH_kv
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            notes.append(f"K and V repeated to {shape.NH} heads for the peer only (enable_gqa=True: "
                         f"{first_line(exc)})")

    def launch():
        return sdpa(q, k, v, **kwargs)

    launch.note = "; ".join(notes)
    return launch


@contextlib.contextmanager
def peer_sessions(peer: Peer, inputs_list: list[Inputs]):
    """Yield (launches, stream) for a peer on each of these inputs (all of one shape), its backend
    enabled while the block runs; raise Unavailable if it cannot run them."""
    cupy = device.get_cupy()
    shape = inputs_list[0].shape
    if peer.materialises:
        need, have = peer.memory_needed(shape), device.free_memory()
        if need > have:
            raise Unavailable(f"does not fit: needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB free")
    if peer.plain is not None:
        torch = device.get_torch()
        yield [plain_launch(torch, peer, x) for x in inputs_list], torch_stream(cupy, torch)
        return
    if peer.backend is None:
        def reference(inputs):
            q, k, v = inputs.q32, inputs.k32, inputs.v32
            return lambda: kernels.reference_attention(q, k, v, causal=shape.causal)

        yield [reference(x) for x in inputs_list], cupy.cuda.get_current_stream()
        return
    torch = device.get_torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, peer.backend)]):
        yield [sdpa_launch(torch, peer, *x.torch_qkv(), shape) for x in inputs_list], torch_stream(cupy, torch)


def torch_stream(cupy, torch):
    """torch's current stream as a CuPy stream: torch peers are timed where they run."""
    ptr = torch.cuda.current_stream().cuda_stream
    stream = cupy.cuda.get_current_stream()
    return stream if ptr == stream.ptr else cupy.cuda.ExternalStream(ptr)


_compiled_functions: dict[str, object] = {}  # torch.compile mode -> plain_attention compiled in it
compile_log: dict[tuple, dict] = {}  # (peer, B, NH, T_q, T_k, d, dtype) -> compile seconds, kernels one call ran


def plain_launch(torch, peer: Peer, inputs: Inputs):
    """The plain PyTorch attention on these inputs, eager or compiled. A compiled peer is compiled (and
    autotuned) by its first call at each shape and dtype, here, outside any timing: `compile_seconds`
    says how long that took, and `note` which kernels one call runs (Inductor may fuse the pattern into
    an attention kernel of its own choosing)."""
    from . import torch_attention

    shape = inputs.shape
    if shape.NH_kv != shape.NH:
        raise NotComparable("n/a: the plain PyTorch attention is written for one K/V head per query head")
    q, k, v = inputs.torch_qkv()
    if peer.plain == "eager":
        fn = torch_attention.plain_attention
    else:
        if peer.plain not in _compiled_functions:
            _compiled_functions[peer.plain] = torch_attention.compiled(peer.plain)
        fn = _compiled_functions[peer.plain]

    def launch():
        return fn(q, k, v, shape.causal)

    if peer.plain == "eager":
        return launch
    key = (peer.name, shape.B, shape.NH, shape.T_q, shape.T_k, shape.d, inputs.dtype)
    if key not in compile_log:
        device.progress(f"  {peer.label}: compiling for {shape.label}, {inputs.dtype} ({peer.plain}) ...")
        torch.cuda.synchronize()
        start = time.perf_counter()
        launch()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        compile_log[key] = {"seconds": seconds, "kernels": ran_kernels(launch)}
        device.progress(f"  {peer.label}: compiled in {seconds:.1f} s")
    entry = compile_log[key]
    launch.compile_seconds = entry["seconds"]
    launch.note = f"mode {peer.plain}; compiled in {entry['seconds']:.1f} s; {entry['kernels']}"
    return launch


def ran_kernels(launch) -> str:
    """The CUDA kernels one call launches (CUPTI through torch's profiler), in a few words."""
    try:
        found = timing.kernel_timing([launch], reps=1)
    except Exception as exc:  # a profiler that will not start here
        return f"kernels not profiled ({first_line(exc)})"
    if not found:
        return "kernels not profiled"
    names = [n if len(n) <= 48 else n[:45] + "..." for n in found["kernels"]]
    return f"{found['kernels_per_call']:g} kernels per call: " + ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


@contextlib.contextmanager
def peer_session(peer: Peer, inputs: Inputs):
    """Yield (launch, stream) for a peer on these inputs; raise Unavailable if it cannot run."""
    with peer_sessions(peer, [inputs]) as (launches, stream):
        yield launches[0], stream


def run_peer_once(r: dict, peer: Peer, inputs: Inputs, outputs: dict) -> bool:
    """The peer once on `inputs`, its output kept for the check; False (the row says why) if it cannot run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with peer_session(peer, inputs) as (launch, stream):
                out = launch()
                stream.synchronize()
                if getattr(launch, "note", ""):
                    r["note"] = launch.note
                if hasattr(launch, "compile_seconds"):  # a torch.compile peer: compiled before this call
                    r["compile_seconds"] = launch.compile_seconds
            outputs[r["name"]] = out
            return True
        except Unavailable as exc:
            r["status"], r["reason"] = "n/a" if isinstance(exc, NotComparable) else "unavailable", str(exc)
        except Exception as exc:  # a backend that refuses this dtype or shape, out of memory, ...
            why = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
            r["status"], r["reason"] = "unavailable", first_line(exc) + (f" ({why})" if why else "")
            device.release_memory()
    return False
