"""GPT-2's training pass in array code (NumPy or CuPy): the loss of a batch and every parameter's
gradient. Each layer's forward sits beside its backward, as in llm.c's train_gpt2.c; each forward
returns its output and what its backward needs.

    attn = Attention.make(kernel="v15", backward="b04")     # GPU rungs (the forward writes lab.lse)
    attn = Attention.reference()                             # kernels' reference pair: NumPy or CuPy
    loss, grads = loss_and_grads(params, config, idx, targets, attn, dtype="bfloat16")

params: checkpoint-native names -> float32 master arrays (gpt2.load, gpt2.random_weights); wte is
also the lm_head. idx, targets (B, T) token ids. loss: a Python float, the mean over B * T of
-log p(target); grads: the same names and shapes as params, float32.

Precision follows gpt2/model.py (whose forward this one equals): dtype="float32" computes in float32
throughout (float64 master weights, the CPU gradient check's, in float64). dtype="bfloat16" (or
"float16") is llm.c's mixed precision: the master weights are cast once per call; the products take
16-bit operands and accumulate in float32, and so do their backward products (dX = dY W^T and
dW = X^T dY), which return float32 for the master gradients; q, k, v, the attention and its
backward are 16-bit; the residual stream and its gradient, LayerNorm, GELU, the logits, softmax and
loss stay float32.

What is kept for the backward, per layer (N = B * T rows of width C; s the products' itemsize, 4 or
2; the float32 residual stream at 4):
    x       the layer's input (the residual stream)            4 N C
    ln1     ln_1's output as the QKV product took it           s N C    (+ mean, rstd: 8 N)
    qkv     q, k, v                                            3 s N C
    o, lse  the attention's output, each row's log-sum-exp     s N C + 4 N NH
    x_mid   the residual stream after the attention            4 N C
    ln2     ln_2's output as the MLP's first product took it   s N C    (+ mean, rstd: 8 N)
    h       the MLP's pre-activation                           4 s N C
    g       GELU(h) as the MLP's second product took it        4 s N C
64 N C bytes in float32, 36 N C in bfloat16 (+ 16 N + 4 N NH): about 450 MB a layer for GPT-2 small
at B x T = 16 x 1024 in bfloat16. Recomputed instead: the attention's output in the (N, C) layout of
its output product (a transposing copy of o, made again in the backward, so the kept o is the one
the backward rung reads), and each LayerNorm's normalized input (from x, mean and rstd). Keeping g
costs 4 s N C that recomputing GELU from h would save (llm.c's choice); kept for simplicity.

The classifier is fused with the loss (llm.c's fused classifier): the logits are computed a chunk of
rows at a time (at most CLASSIFIER_BYTES of float32 each) and overwritten in place by their gradient
(softmax - onehot) / N, so that no (N, vocab) array is ever held twice in float32. Its vocabulary is
padded with zero rows of wte to a multiple of VOCAB_MULTIPLE (50257 -> 50304, as nanoGPT and llm.c
pad it), since cuBLAS's tensor-core kernels want leading dimensions of 16 bytes' multiples; the
padded logits are excluded from the softmax and the padded rows of dwte dropped.

On the GPU (fused=True, float32 and bfloat16) the layer functions hand their non-GEMM work to
gpt2/train_kernels.py (kernels/fused/train.cu): the same math in one or two launches a layer function
where the array code below takes several CuPy kernels. Each `if fused:` line is that dispatch; the
array code after it stays the spec, the CPU's path and the GPU tests' reference. Two dispatches sit in
layers_forward instead, where the fused path folds linear_forward's bias add into the pass after it
(the heads' split of q, k, v; GELU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import kernels
from kernels import backward as backward_ladder
from kernels.runtime import lse_writers
from lm.arrays import array_module, cast_params, run_dtype
from lm.products import matmul

from . import train_kernels
from .config import GPT2Config
from .errors import LabError
from .model import GELU_C, gelu

# float32 logits per chunk of the fused classifier, at most: GPT-2 small at 16 x 1024 takes 4 chunks of
# 4,096 rows (each product's M large enough to fill the GPU); the whole batch at once would hold 3.7 GB
# more (float32 logits and bfloat16 dlogits), above PyTorch's peak memory
CLASSIFIER_BYTES = 2**30
VOCAB_MULTIPLE = 128  # the classifier pads the vocabulary to a multiple of this (cuBLAS's aligned kernels)


# -- attention: a forward that writes the log-sum-exp, and its backward ------------------------------


@dataclass(frozen=True)
class Attention:
    """Causal attention over (B, NH, T, hs) arrays: forward(q, k, v) -> (o, lse), lse (B, NH, T)
    float32; backward(q, k, v, o, lse, do) -> (dq, dk, dv). `dtypes` and `head_sizes`: what both
    passes support (None: any); `gpu`: whether they need CuPy arrays."""

    name: str
    forward: Callable
    backward: Callable
    dtypes: tuple[str, ...] | None = None
    head_sizes: tuple[int, ...] | None = None
    gpu: bool = False

    @classmethod
    def make(cls, kernel: str = "v13", backward: str = "b02", deterministic: bool = False) -> Attention:
        """A forward rung that writes the log-sum-exp (lab.lse) and a backward rung; LabError if the
        pair cannot train (no lse, no dtype or head size in common). deterministic: the backward rung's
        configurations that sum dQ in a fixed order (lab.deterministic), the same bits on every run;
        LabError where it has none."""
        try:
            fwd, bwd = kernels.load(kernel), backward_ladder.load(backward)
        except ValueError as exc:
            raise LabError(str(exc)) from None
        if not fwd.lse:
            raise LabError(f"kernel {fwd.name} does not write the log-sum-exp (lab.lse) that the backward reads; "
                           f"{lse_writers()} do")
        dtypes = tuple(t for t in fwd.dtypes if t in bwd.dtypes)
        if not dtypes:
            raise LabError(f"kernel {fwd.name} runs {', '.join(fwd.dtypes)} and backward {bwd.name} "
                           f"{', '.join(bwd.dtypes)}: no dtype in common (lab.dtypes)")
        heads = tuple(d for d in fwd.head_sizes() if d in bwd.head_sizes())
        if deterministic:
            heads = tuple(d for d in heads if any(bwd.is_deterministic(c) for c in bwd.configs if c[0] == d))
            if not heads:
                raise LabError(f"backward {bwd.name} has no deterministic configuration (lab.deterministic) for the "
                               f"head sizes it shares with {fwd.name}; {backward_ladder.deterministic_rungs()} have one")
        fwd_path, bwd_path = str(fwd.path), str(bwd.path)
        return cls(
            name=f"{fwd.name} + {bwd.name}",
            forward=lambda q, k, v: kernels.attention(q, k, v, kernel=fwd_path, return_lse=True),
            backward=lambda q, k, v, o, lse, do: kernels.attention_backward(q, k, v, o, lse, do, kernel=bwd_path,
                                                                            deterministic=deterministic),
            dtypes=dtypes, head_sizes=heads, gpu=True)

    @classmethod
    def reference(cls) -> Attention:
        """kernels.reference_attention and its backward: any dtype, NumPy or CuPy."""
        return cls(name="reference",
                   forward=lambda q, k, v: kernels.reference_attention(q, k, v, return_lse=True),
                   backward=kernels.reference_attention_backward)

    def check(self, xp, dtype: np.dtype, head_size: int) -> None:
        """LabError, in one line, if this attention cannot run a model of this dtype and head size."""
        if self.dtypes is not None and dtype.name not in self.dtypes:
            raise LabError(f"attention {self.name} runs {', '.join(self.dtypes)}, not {dtype.name} (lab.dtypes)")
        if self.head_sizes is not None and head_size not in self.head_sizes:
            raise LabError(f"attention {self.name} supports head sizes {', '.join(map(str, self.head_sizes))}; "
                           f"the model's is {head_size}")
        if self.gpu and xp is np:
            raise LabError(f"attention {self.name} runs on the GPU; on the CPU use the reference attention")


# -- the layers: each forward beside its backward --------------------------------------------------


def encoder_forward(wte, wpe, idx, act):
    """x (B, T, C) in act = wte[idx] + wpe[:T]. Keeps nothing (the backward needs idx alone)."""
    T = idx.shape[1]
    return wte[idx].astype(act, copy=False) + wpe[:T]


def encoder_backward(dwte, dwpe, dx, idx, fused: bool = False) -> None:
    """Add dx (B, T, C) into the rows of dwte the tokens read (a scatter: a token may repeat, its rows added
    in row order) and of dwpe. fused: train_kernels.embedding_backward, the same additions in the same
    order on the GPU, where CuPy's add.at adds a repeated token's rows in no fixed order."""
    xp = array_module(dx)
    B, T, C = dx.shape
    if fused and dx.dtype == dwte.dtype == np.float32:
        train_kernels.embedding_backward(dwte, xp.ascontiguousarray(dx.reshape(B * T, C)), idx)
    else:
        xp.add.at(dwte, idx.reshape(-1), dx.reshape(B * T, C))
    dwpe[:T] += dx.sum(axis=0)


def layernorm_forward(x, weight, bias, eps: float, out_dtype=None, fused: bool = False):
    """x (N, C) -> (out (N, C) in out_dtype (default x's), mean (N, 1), rstd (N, 1) in x's dtype); out as
    gpt2/model.py's layer_norm computes it. Keeps mean and rstd (and the caller keeps x)."""
    if fused:
        return train_kernels.layernorm_forward(x, weight, bias, eps, out_dtype or x.dtype)
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    rstd = ((xc * xc).mean(axis=-1, keepdims=True) + eps) ** -0.5  # biased variance, like torch's
    return (xc * rstd * weight + bias).astype(out_dtype or x.dtype, copy=False), mean, rstd


def residual_layernorm_forward(x, y, y_bias, weight, bias, eps: float, out_dtype=None, fused: bool = False):
    """(x_new, out, mean, rstd): the residual add x_new = x + (y + y_bias) of a product's output y (N, C)
    and its bias, in the weights' dtype as linear_forward adds them, into the residual stream x (N, C);
    then layernorm_forward of x_new. The caller keeps x_new (the next residual stream)."""
    if fused:
        return train_kernels.residual_layernorm_forward(x, y, y_bias, weight, bias, eps, out_dtype or x.dtype)
    x = x + (y + y_bias)
    return (x, *layernorm_forward(x, weight, bias, eps, out_dtype))


def layernorm_backward(dout, x, mean, rstd, weight, dresid=None, fused: bool = False):
    """(dx, dweight, dbias) from dout (N, C) and the forward's x, mean, rstd; where dresid (the residual's
    gradient) is given, dx is dresid + the LayerNorm's (fused: added into dresid in place)."""
    if fused:
        return train_kernels.layernorm_backward(dout, x, mean, rstd, weight, dresid)
    norm = (x - mean) * rstd  # recomputed: (N, C)
    dnorm = dout * weight
    dx = rstd * (dnorm - dnorm.mean(axis=-1, keepdims=True) - norm * (dnorm * norm).mean(axis=-1, keepdims=True))
    return dx if dresid is None else dresid + dx, (dout * norm).sum(axis=0), dout.sum(axis=0)


def linear_forward(x, weight, bias):
    """x (N, in) @ weight (in, out) + bias: in the weight's dtype (x is cast to it), accumulated in
    float32, as gpt2/model.py's linear. The caller keeps x in the weight's dtype, as the product took it."""
    return matmul(x, weight) + bias


def linear_backward(dout, x, weight, dx_dtype=None, gelu_of=None, fused: bool = False):
    """(dx, dweight, dbias) from dout (N, out) and the forward's x (N, in) in the weight's dtype: the
    products take 16-bit operands where the weights are 16-bit and accumulate in float32; dweight and
    dbias are float32 (float64 for float64 weights), dx is dx_dtype (default the same). gelu_of: the
    MLP's pre-activation h (N, out) where dout is the gradient at GELU(h), so that the layer's gradient
    is dout * GELU'(h) (cuBLASLt's DGELU_BGRAD epilogue, taken before the products)."""
    wide = np.result_type(weight.dtype, np.float32)
    if fused:  # GELU's backward, the bias's gradient and the products' operand, one pass
        cast = weight.dtype if gelu_of is not None or dout.dtype != weight.dtype else None
        dbias, dout_w = train_kernels.column_sums(dout, cast, gelu_of)
        dout_w = dout if dout_w is None else dout_w
    else:
        if gelu_of is not None:
            dout = gelu_backward(dout, gelu_of.astype(wide, copy=False))
        dout_w = dout.astype(weight.dtype, copy=False)  # the products' operand
        dbias = dout.astype(wide, copy=False).sum(axis=0)
    dx = matmul(dout_w, weight.T, dx_dtype or wide)  # (N, in)
    dweight = matmul(x.T, dout_w, wide)  # (in, out)
    return dx, dweight, dbias


def gelu_forward(h, act):
    """GELU(h) in h's dtype (the operand of the MLP's second product), computed in act (float32)."""
    return gelu(h.astype(act, copy=False)).astype(h.dtype, copy=False)


def gelu_backward(dout, h):
    """dout * GELU'(h) for GPT-2's tanh GELU, h the kept pre-activation widened to dout's dtype."""
    u = h * h
    t = array_module(h).tanh(GELU_C * h * (1.0 + 0.044715 * u))  # GELU(h) = h (1 + t) / 2
    return dout * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * u))


def attention_forward(qkv, n_head: int, attn: Attention):
    """qkv (B, T, 3C), columns [q | k | v] of n_head heads each -> (y (B * T, C), q, k, v, o, lse): q, k,
    v (B, NH, T, hs) views of qkv, o (B, NH, T, hs) and lse (B, NH, T) the forward's, all kept."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    qkv = qkv.reshape(B, T, 3, n_head, C // n_head)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (B, NH, T, hs), a view
    o, lse = attn.forward(q, k, v)
    return heads_side_by_side(o), q, k, v, o, lse


def heads_side_by_side(o, fused: bool = False):
    """(B, NH, T, hs) -> (B * T, C), the output product's layout (a copy)."""
    if fused:
        return train_kernels.heads_to_rows([o])
    B, NH, T, hs = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B * T, NH * hs)


def attention_backward(dy, q, k, v, o, lse, attn: Attention, fused: bool = False):
    """dqkv (B * T, 3C) in q's dtype from dy (B * T, C), the gradient of the heads side by side."""
    B, NH, T, hs = q.shape
    xp = array_module(dy)
    if fused:  # the layout the backward rung reads, written once (not a view it copies)
        (do,) = train_kernels.rows_to_heads(dy.astype(q.dtype, copy=False), B, NH)
    else:
        do = dy.astype(q.dtype, copy=False).reshape(B, T, NH, hs).transpose(0, 2, 1, 3)  # (B, NH, T, hs), a view
    dq, dk, dv = attn.backward(q, k, v, o, lse, do)
    if fused:
        return train_kernels.heads_to_rows([dq, dk, dv])  # one launch for the three copies below
    dqkv = xp.empty((B, T, 3, NH, hs), dtype=q.dtype)
    for i, d in enumerate((dq, dk, dv)):
        dqkv[:, :, i] = d.transpose(0, 2, 1, 3)
    return dqkv.reshape(B * T, 3 * NH * hs)


def softmax_cross_entropy(logits, targets, n: int, out_dtype, V: int | None = None):
    """(dlogits, loss) of logits (r, Vp) in float32 (float64) and their targets (r,), over the first V
    columns (default all; the rest are the classifier's padding): dlogits = (softmax - onehot) / n,
    computed over the logits in place and then in out_dtype, its padded columns zero; loss the sum of
    the rows' -log p(target), a 0-d array."""
    xp = array_module(logits)
    ar = xp.arange(logits.shape[0])
    live = logits[:, :V]  # (r, V), a view: the vocabulary's columns
    live -= live.max(axis=1, keepdims=True)
    target_logit = live[ar, targets]  # (r,), shifted like the rest
    xp.exp(live, out=live)
    total = live.sum(axis=1, keepdims=True)  # (r, 1)
    loss = (xp.log(total[:, 0]) - target_logit).sum()  # -log p(target) = log sum exp - logit
    live *= 1.0 / (total * n)  # now softmax / n
    live[ar, targets] -= 1.0 / n  # now dlogits = (softmax - onehot) / n
    logits[:, live.shape[1]:] = 0  # the padding: no probability, no gradient
    return logits.astype(out_dtype, copy=False), loss


def classifier_forward_backward(xf, wte, targets, rows: int | None = None, fused: bool = False,
                                multiple: int = VOCAB_MULTIPLE):
    """The fused classifier: (loss, dxf, dwte) of the mean cross-entropy of logits = xf @ wte^T.
    xf (N, C) in wte's dtype (V, C), targets (N,). The vocabulary is padded to Vp, a multiple of
    `multiple`, with zero rows of wte (a copy, per call), so that every product's leading dimension is
    aligned; the softmax excludes the padded columns and their dlogits are zero. Each chunk of `rows`
    rows (default: N split evenly into chunks of at most CLASSIFIER_BYTES of logits) computes its
    logits in float32 (float64 for float64 weights) and overwrites them with dlogits = (softmax -
    onehot) / N, which the two products then take (in wte's dtype), dwte's added into it in place.
    The loss is a 0-d array, read by the caller once the backward is queued: no synchronization
    inside the pass."""
    xp = array_module(xf)
    N, C = xf.shape
    V = wte.shape[0]
    Vp = -(-V // multiple) * multiple
    wide = np.result_type(wte.dtype, np.float32)
    head = wte
    if Vp != V:
        head = xp.zeros((Vp, C), dtype=wte.dtype)  # (Vp, C): the padded rows' logits are 0, excluded
        head[:V] = wte
    chunks = -(-N * Vp * wide.itemsize // CLASSIFIER_BYTES)  # the fewest within CLASSIFIER_BYTES
    rows = rows or -(-N // chunks)  # (r, Vp) float32 logits a chunk, the chunks even
    dxf = xp.empty((N, C), dtype=wide)
    dwte = xp.zeros((Vp, C), dtype=wide)
    loss = xp.zeros((), dtype=wide)
    cross_entropy = train_kernels.softmax_cross_entropy if fused else softmax_cross_entropy
    for start in range(0, N, rows):
        x, t = xf[start:start + rows], targets[start:start + rows]
        logits = matmul(x, head.T, wide)  # (r, Vp)
        dlogits, chunk_loss = cross_entropy(logits, t, N, wte.dtype, V)  # over the logits where it can
        loss += chunk_loss
        matmul(dlogits, head, out=dxf[start:start + rows])  # (r, C)
        matmul(dlogits.T, x, out=dwte, accumulate=True)  # (Vp, C) += (Vp, r) @ (r, C)
    return loss / N, dxf, dwte[:V]  # the padded rows' gradients (zero) dropped


# -- the model --------------------------------------------------------------------------------------


def loss_and_grads(params: dict, config: GPT2Config, idx, targets, attn: Attention, dtype="float32",
                   fused: bool = True, loss_on_host: bool = True):
    """(loss, grads) of the mean cross-entropy of the next tokens `targets` (B, T) given `idx` (B, T);
    see the module's docstring for the precision and what is kept. fused: the non-GEMM work through
    gpt2/train_kernels.py where it runs (CuPy arrays, float32 or bfloat16), else the array code.
    loss_on_host=False: the loss stays a 0-d array on the arrays' device, read by no one here, so that
    the pass reads nothing back to the host (a CUDA graph captures it: train.py --graph)."""
    xp = array_module(params["wte.weight"])
    idx, targets = xp.asarray(idx), xp.asarray(targets)
    if idx.ndim != 2 or targets.shape != idx.shape:
        raise LabError(f"idx and targets must both be (B, T); got {idx.shape} and {targets.shape}")
    B, T = idx.shape
    if T > config.n_positions:
        raise LabError(f"sequence length {T} exceeds the model's {config.n_positions} positions")
    act = np.result_type(params["wte.weight"].dtype, np.float32)  # the residual stream: float32 (float64)
    w = params if run_dtype(dtype) == np.float32 else cast_params(params, dtype)  # cast once per call
    cdtype = w["wte.weight"].dtype  # the products', q's, k's and v's
    attn.check(xp, cdtype, config.head_size)
    fused = fused and train_kernels.applies(xp, cdtype, config.n_embd, config.head_size)
    x, (xf, meanf, rstdf), kept = layers_forward(w, config, idx, attn, act, cdtype, fused)

    # the classifier and the loss, fused; then backward, layer by layer
    loss, dxf, dwte = classifier_forward_backward(xf, w["wte.weight"], targets.reshape(B * T), fused=fused)
    grads = {"wte.weight": dwte, "wpe.weight": xp.zeros(params["wpe.weight"].shape, dtype=act)}
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = layernorm_backward(dxf, x, meanf, rstdf, w["ln_f.weight"],
                                                                      fused=fused)
    dx = layers_backward(dx, kept, w, grads, config, attn, cdtype, fused)
    encoder_backward(grads["wte.weight"], grads["wpe.weight"], dx.reshape(B, T, config.n_embd), idx, fused=fused)
    return float(loss) if loss_on_host else loss, {name: grads[name] for name in params}


def layers_forward(w: dict, config: GPT2Config, idx, attn: Attention, act, cdtype, fused: bool):
    """The embeddings and every layer forward, keeping what each layer's backward reads: (x, the last
    layer's output (N, C); ln_f's (output, mean, rstd); the kept tuples, first layer first)."""
    B, T = idx.shape
    eps, N, C = config.layer_norm_epsilon, B * T, config.n_embd
    # x (N, C) is the residual stream; each residual add makes the LayerNorm after it too
    lns = [f"h.{i}.ln_1." for i in range(config.n_layer)] + ["ln_f."]  # the LayerNorms of x, in turn
    x = encoder_forward(w["wte.weight"], w["wpe.weight"], idx, act).reshape(N, C)
    ln1, mean1, rstd1 = layernorm_forward(x, w[lns[0] + "weight"], w[lns[0] + "bias"], eps, cdtype, fused)
    kept = []
    for i in range(config.n_layer):
        p = f"h.{i}."
        if fused:  # the bias added on the way into contiguous q, k, v: no copies later
            q, k, v = train_kernels.rows_to_heads(matmul(ln1, w[p + "attn.c_attn.weight"]), B, config.n_head,
                                                  w[p + "attn.c_attn.bias"])
            o, lse = attn.forward(q, k, v)
            y = heads_side_by_side(o, fused)
        else:
            qkv = linear_forward(ln1, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"]).astype(cdtype, copy=False)
            y, q, k, v, o, lse = attention_forward(qkv.reshape(B, T, 3 * C), config.n_head, attn)
        x_mid, ln2, mean2, rstd2 = residual_layernorm_forward(  # x + the output product, then ln_2
            x, matmul(y, w[p + "attn.c_proj.weight"]), w[p + "attn.c_proj.bias"], w[p + "ln_2.weight"],
            w[p + "ln_2.bias"], eps, cdtype, fused)
        del y  # remade from o in the backward
        if fused:  # the bias added in GELU's pass, which writes h too
            h, g = train_kernels.bias_gelu(matmul(ln2, w[p + "mlp.c_fc.weight"]), w[p + "mlp.c_fc.bias"])
        else:
            h = linear_forward(ln2, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"])  # (N, 4C) in cdtype
            g = gelu_forward(h, act)  # GELU in float32
        kept.append((x, ln1, mean1, rstd1, q, k, v, o, lse, x_mid, ln2, mean2, rstd2, h, g))
        x, ln1, mean1, rstd1 = residual_layernorm_forward(  # x_mid + the MLP's, then the next ln_1 (or ln_f)
            x_mid, matmul(g, w[p + "mlp.c_proj.weight"]), w[p + "mlp.c_proj.bias"], w[lns[i + 1] + "weight"],
            w[lns[i + 1] + "bias"], eps, cdtype, fused)
    return x, (ln1, mean1, rstd1), kept


def layers_backward(dx, kept: list, w: dict, grads: dict, config: GPT2Config, attn: Attention, cdtype,
                    fused: bool):
    """From dx at the last layer's output, every layer backward, last first, each popping its kept tuple
    and writing its weights' gradients into grads; returns dx at the first layer's input."""
    for i in reversed(range(config.n_layer)):
        p = f"h.{i}."
        x, ln1, mean1, rstd1, q, k, v, o, lse, x_mid, ln2, mean2, rstd2, h, g = kept.pop()
        dg, grads[p + "mlp.c_proj.weight"], grads[p + "mlp.c_proj.bias"] = linear_backward(
            dx, g, w[p + "mlp.c_proj.weight"], fused=fused)
        dln2, grads[p + "mlp.c_fc.weight"], grads[p + "mlp.c_fc.bias"] = linear_backward(
            dg, ln2, w[p + "mlp.c_fc.weight"], gelu_of=h, fused=fused)  # through GELU first
        # the gradient at x_mid: through the residual and through ln_2
        dx, grads[p + "ln_2.weight"], grads[p + "ln_2.bias"] = layernorm_backward(
            dln2, x_mid, mean2, rstd2, w[p + "ln_2.weight"], dresid=dx, fused=fused)
        dy, grads[p + "attn.c_proj.weight"], grads[p + "attn.c_proj.bias"] = linear_backward(
            dx, heads_side_by_side(o, fused), w[p + "attn.c_proj.weight"], dx_dtype=cdtype, fused=fused)
        dqkv = attention_backward(dy, q, k, v, o, lse, attn, fused)
        dln1, grads[p + "attn.c_attn.weight"], grads[p + "attn.c_attn.bias"] = linear_backward(
            dqkv, ln1, w[p + "attn.c_attn.weight"], fused=fused)
        dx, grads[p + "ln_1.weight"], grads[p + "ln_1.bias"] = layernorm_backward(
            dln1, x, mean1, rstd1, w[p + "ln_1.weight"], dresid=dx, fused=fused)
    return dx
