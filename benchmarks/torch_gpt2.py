"""GPT-2 training in PyTorch as nanoGPT writes it: SDPA's causal attention (flash in bfloat16), bf16
autocast, fused AdamW with decay on tensors of 2+ dimensions; on the lab's weights (checkpoint-native
names, Conv1D weights (in, out)), so that `bench.py train` and tests/test_train_gpu.py run both on the same
model. `torch_compile` is the same step's loss under torch.compile.

    model = TorchGPT2(params, config, dtype="bfloat16")      params: name -> NumPy or CuPy float32 array
    loss = model.step(idx, targets, lr)                      forward, backward, clip, AdamW; the loss before
"""

from __future__ import annotations

import numpy as np

from . import device


def gpt2_loss(p: dict, config, idx, targets):
    """The mean cross-entropy of GPT-2 (nanoGPT's forward, Conv1D weights used as stored) on idx (B, T)."""
    torch = device.get_torch()
    F = torch.nn.functional
    B, T = idx.shape
    C, NH = config.n_embd, config.n_head
    eps = config.layer_norm_epsilon
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]  # (B, T, C)
    for i in range(config.n_layer):
        h = f"h.{i}."
        a = F.layer_norm(x, (C,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], eps)
        qkv = a @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]  # (B, T, 3C)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in qkv.split(C, dim=2))  # each (B, NH, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = F.layer_norm(x, (C,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], eps)
        m = F.gelu(m @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps)
    logits = x @ p["wte.weight"].T  # (B, T, V), tied lm_head
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class TorchGPT2:
    def __init__(self, params: dict, config, *, dtype: str = "bfloat16", compile: bool = False,
                 weight_decay: float = 0.1, grad_clip: float = 1.0, fused: bool = True):
        torch = device.get_torch()
        self.torch, self.config, self.dtype, self.grad_clip = torch, config, dtype, grad_clip
        self.params = {k: torch.nn.Parameter(torch.as_tensor(np.asarray(v.get() if hasattr(v, "get") else v),
                                                             dtype=torch.float32, device="cuda").clone())
                       for k, v in params.items()}
        groups = [{"params": [p for p in self.params.values() if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in self.params.values() if p.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        # static shapes: a row at a second batch size gets its own specialized graph, not the dynamic-shape
        # one torch.compile would otherwise fall back to on the second shape it sees
        self.loss_fn = torch.compile(gpt2_loss, dynamic=False) if compile else gpt2_loss

    def loss(self, idx, targets):
        """The loss under bf16 autocast (float32: none), its graph kept for backward()."""
        torch = self.torch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            return self.loss_fn(self.params, self.config, idx, targets)

    def step(self, idx, targets, lr: float) -> float:
        """One training step; the batch's loss before the update (a device tensor, not synchronized)."""
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(idx, targets)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        return loss.detach()
