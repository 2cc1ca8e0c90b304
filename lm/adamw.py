"""AdamW as torch.optim.AdamW computes it, global-norm clipping as clip_grad_norm_ does, and the
learning-rate schedule: what train.py steps the float32 master weights with (NumPy or CuPy).

    opt = AdamW(params, weight_decay=0.1)              float32 m and v beside each parameter
    norm = clip_grad_norm(grads, 1.0)                  the total norm before clipping; grads scaled in place
    opt.step(params, grads, lr=get_lr(step, ...))      params updated in place

One step of a parameter p with gradient g (torch's _single_tensor_adamw, the same order of operations):

    p = p * (1 - lr * wd)                    decoupled decay: only where p.ndim >= 2 (no biases, no LayerNorm)
    m = m + (1 - beta1) * (g - m)            torch's lerp
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The scalars are formed in double precision on the host and applied in float32, as torch applies a
Python float to a float32 tensor. On CuPy the step of each parameter is one fused elementwise kernel.

    opt = AdamW(params)                                CuPy: every tensor in two launches (kernels/fused/adamw.cu)
    opt = AdamW(params, multi_tensor=False)            CuPy: a launch or two per tensor, the reference
    norm = opt.step(params, grads, lr, max_norm=1.0)   clipping and the update; the norm returned

The multi-tensor path (CuPy's default) does the same arithmetic with the same roundings, bit for bit, in one
launch for the global norm (and the clipping scale, on the device) and one for every tensor's update,
where the per-tensor path takes a launch or two per tensor; it leaves the gradients unscaled (the scale
is applied inside the update). Its launches read everything that changes from step to step from device
memory (the table of addresses, the step's scalars, the scale), so that a CUDA graph can capture them:

    scalars = opt.advance(lr)                          t += 1, the step's scalars (host floats)
    opt.multi.load(params, grads, scalars)             host to device: the addresses and the scalars
    opt.multi.launch(max_norm)                         the two launches (the update's adamw_step_graph,
                                                       its scalars read from memory): no host copy or read
"""

from __future__ import annotations

import math

import numpy as np

from .arrays import array_module

BETAS = (0.9, 0.95)
EPS = 1e-8
THREADS = 256  # kernels/fused/adamw.cu's THREADS and CHUNK: a block takes CHUNK elements of one tensor
CHUNK = THREADS * 32
KERNELS = (f"adamw_sum_squares<{THREADS}>", f"adamw_step<{THREADS}>", f"adamw_step_graph<{THREADS}>")
OPTIONS = ("-fmad=false",)  # no contraction: the roundings of the NumPy form, as the per-tensor kernel's
HYPER = ("keep_decay", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "bc2_sqrt", "eps")  # advance()'s


def decays(p) -> bool:
    """Weight decay on the matrices (and the embeddings), none on biases or LayerNorm's parameters."""
    return p.ndim >= 2


class AdamW:
    def __init__(self, params: dict, *, weight_decay: float = 0.1, betas: tuple[float, float] = BETAS,
                 eps: float = EPS, multi_tensor: bool | None = None):
        """multi_tensor: None, the multi-tensor path on CuPy arrays and the per-tensor one on NumPy's."""
        self.weight_decay, self.betas, self.eps = weight_decay, betas, eps
        self.m = {k: array_module(p).zeros(p.shape, np.float32) for k, p in params.items()}
        self.v = {k: array_module(p).zeros(p.shape, np.float32) for k, p in params.items()}
        self.decay = {k: decays(p) for k, p in params.items()}
        self.t = 0  # steps taken
        on_host = any(array_module(p) is np for p in params.values())
        multi_tensor = not on_host if multi_tensor is None else multi_tensor
        if multi_tensor and on_host:
            raise ValueError("multi_tensor: the multi-tensor AdamW runs on CuPy arrays")
        self.multi = MultiTensor(self.m, self.v, self.decay) if multi_tensor else None

    def step(self, params: dict, grads: dict, lr: float, max_norm: float | None = None) -> float | None:
        """One update of every float32 parameter in place, from its float32 gradient. With max_norm, the
        gradients are first clipped as clip_grad_norm(grads, max_norm) clips them, and the norm before
        clipping is returned (max_norm <= 0: measured, not clipped)."""
        scalars = self.advance(lr)
        if self.multi is not None:
            return self.multi.step(params, grads, max_norm, scalars)
        norm = None if max_norm is None else clip_grad_norm(grads, max_norm)
        undecayed = (1.0, *scalars[1:])  # 1 - lr * 0, exactly
        for name, p in params.items():
            own = scalars if self.decay[name] else undecayed
            if array_module(p) is np:
                _step_numpy(p, grads[name], self.m[name], self.v[name], *(np.float32(s) for s in own))
            else:
                _step_kernel()(grads[name], *(np.float32(s) for s in own), p, self.m[name], self.v[name])
        return norm

    def advance(self, lr: float) -> tuple[float, ...]:
        """Count a step (t += 1) and return its scalars, formed in double on the host: (1 - lr * weight_decay,
        1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t), sqrt(1 - beta2^t), eps)."""
        self.t += 1
        beta1, beta2 = self.betas
        return (1 - lr * self.weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** self.t),
                math.sqrt(1 - beta2 ** self.t), self.eps)


def _step_numpy(p, g, m, v, keep, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps):
    p *= keep
    m += one_minus_beta1 * (g - m)
    v *= beta2
    v += one_minus_beta2 * (g * g)
    p -= step_size * (m / (np.sqrt(v) / bc2_sqrt + eps))


_KERNEL = []


def _step_kernel():
    """The CuPy form of _step_numpy: one pass over p, m, v and g (compiled once, on first use)."""
    if not _KERNEL:
        import cupy

        _KERNEL.append(cupy.ElementwiseKernel(
            "float32 g, float32 keep, float32 one_minus_beta1, float32 beta2, float32 one_minus_beta2, "
            "float32 step_size, float32 bc2_sqrt, float32 eps",
            "float32 p, float32 m, float32 v",
            """
            p = p * keep;
            m = m + one_minus_beta1 * (g - m);
            v = beta2 * v + one_minus_beta2 * (g * g);
            p = p - step_size * (m / (sqrtf(v) / bc2_sqrt + eps));
            """,
            "lab_adamw_step", options=OPTIONS))
    return _KERNEL[0]


def chunk_tables(sizes) -> tuple[np.ndarray, np.ndarray]:
    """(block_tensor, first_block), int32: for tensors of `sizes` elements cut into chunks of CHUNK, the
    tensor of each block of adamw.cu's grid and the first block of each tensor."""
    chunks = -(-np.asarray(sizes, dtype=np.int64) // CHUNK)
    first_block = (np.cumsum(chunks) - chunks).astype(np.int32)
    return np.repeat(np.arange(len(chunks), dtype=np.int32), chunks), first_block


class MultiTensor:
    """kernels/fused/adamw.cu's two launches over every tensor. The chunk tables, sizes and decay flags
    are built once (the shapes are fixed); the table of addresses of p, g, m and v (the gradients are
    new arrays each step) and the step's scalars are copied each step into device arrays of their own,
    at fixed addresses, that the launches read."""

    def __init__(self, m: dict, v: dict, decay: dict):
        import cupy as cp

        self.names = list(m)
        sizes = [m[k].size for k in self.names]
        block_tensor, first_block = chunk_tables(sizes)
        self.blocks = len(block_tensor)
        self.tables = tuple(cp.asarray(a) for a in (np.array(sizes, dtype=np.int64), block_tensor, first_block))
        self.decays = cp.asarray(np.array([decay[k] for k in self.names], dtype=np.int32))
        self.addresses = np.zeros((4, len(self.names)), dtype=np.uint64)  # rows p, g, m, v: adamw.cu's table
        self.addresses[2:] = [[state[k].data.ptr for k in self.names] for state in (m, v)]
        self.table = cp.asarray(self.addresses)  # rows p and g written by load()
        self.hyper = cp.zeros(len(HYPER), np.float32)  # the step's scalars, in HYPER's order
        self.shapes = [m[k].shape for k in self.names]
        self.partial = cp.empty(self.blocks, dtype=np.float32)
        self.ticket = cp.zeros(1, dtype=np.uint32)  # adamw_sum_squares resets it after each launch
        self.norm, self.scale, self.one = cp.empty(1, np.float64), cp.empty(1, np.float32), cp.ones(1, np.float32)

    def step(self, params: dict, grads: dict, max_norm: float | None, scalars: tuple) -> float | None:
        """load() of the addresses, launch() with the scalars by value (adamw_step), and the norm before
        clipping read back (None without max_norm)."""
        self.load(params, grads)
        self.launch(max_norm, scalars)
        return None if max_norm is None else float(self.norm[0])

    def load(self, params: dict, grads: dict, scalars: tuple | None = None) -> None:
        """The addresses of params and grads, and the step's scalars (AdamW.advance's) where given, copied to
        the device on the current stream: what the next launch() reads."""
        self.addresses[0] = [self.address(params, k, shape) for k, shape in zip(self.names, self.shapes)]
        self.addresses[1] = [self.address(grads, k, shape) for k, shape in zip(self.names, self.shapes)]
        self.table.set(self.addresses)
        if scalars is not None:
            self.hyper.set(np.array(scalars, dtype=np.float32))

    def launch(self, max_norm: float | None, scalars: tuple | None = None) -> None:
        """The norm's launch (with max_norm: the norm into self.norm, the clipping scale into self.scale)
        and the update's, on the current stream: with `scalars`, adamw_step takes them by value; without,
        adamw_step_graph reads them from self.hyper (load()'s), so that a CUDA graph may capture the
        launches (no host copy, no host read) and each replay takes its step's. max_norm, passed by value,
        is the graph's for good."""
        from kernels import fused

        n = np.int32(len(self.names))
        if max_norm is not None:
            fused.launch(fused.function("adamw", KERNELS[0], OPTIONS), self.blocks, THREADS,
                         (self.table, *self.tables, n, np.float64(max_norm), self.partial, self.ticket, self.norm,
                          self.scale))
        update = (self.hyper,) if scalars is None else tuple(np.float32(s) for s in scalars)
        fused.launch(fused.function("adamw", KERNELS[1 if scalars is not None else 2], OPTIONS), self.blocks,
                     THREADS, (self.table, *self.tables, self.decays, n, self.one if max_norm is None else self.scale,
                               *update))

    @staticmethod
    def address(arrays: dict, name: str, shape) -> int:
        a = arrays[name]
        if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"multi_tensor: {name} is {a.dtype} {a.shape}, not contiguous float32 {shape}")
        return a.data.ptr


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """The global 2-norm of all gradients (torch.nn.utils.clip_grad_norm_): where max_norm / (norm + 1e-6)
    is below 1 every gradient is scaled by it, in place. max_norm <= 0 measures without clipping."""
    xp = array_module(next(iter(grads.values())))
    total = float(xp.sqrt(sum(xp.vdot(g.ravel(), g.ravel()).astype(np.float64) for g in grads.values())))
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1:
        for g in grads.values():
            g *= np.float32(coef)
    return total


def get_lr(step: int, *, lr: float, min_lr: float, warmup: int, steps: int, schedule: str = "cosine") -> float:
    """The learning rate of step `step` (from 0), nanoGPT's get_lr: linear warmup to lr over `warmup`
    steps (step 0 at lr / warmup, as llm.c), then `cosine` from lr down to min_lr at the last step,
    or `constant` at lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"schedule {schedule!r}: cosine or constant")
    span = steps - 1 - warmup
    ratio = (step - warmup) / span if span > 0 else 0.0  # one step after warmup: the peak
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (lr - min_lr)
