"""A tiny dropout MLP stack, run plainly or one checkpoint per block, and a saved-bytes meter."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, d=8, layers=3, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x, ckpt=None):
        for b in self.blocks:
            x = ckpt(b, x) if ckpt is not None else b(x)
        return self.head(x).pow(2).mean()


def grads_of(model, x, ckpt=None, rng_seed=123):
    """Loss and gradients (params and input) of one forward/backward with a fixed RNG seed."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(rng_seed)
    loss = model(x, ckpt)
    torch.manual_seed(rng_seed + 1)  # the recompute must not depend on the RNG state at backward time
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone()


class SavedBytes:
    """Sum of distinct storages saved for backward (the autograd saved-tensor hook sees every one)."""

    def __init__(self):
        self.storages = {}
        self.tensors = []

    def _pack(self, t):
        self.tensors.append(t)
        s = t.untyped_storage()
        self.storages[(s.data_ptr(), t.device.type)] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())
