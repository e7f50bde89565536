"""Tiny models and deterministic data shared by tests, and a plain-PyTorch reference loop."""
from __future__ import annotations

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, d_out=4, layers=2):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, y=None):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        if y is None:
            return x
        return nn.functional.mse_loss(x, y)


def make_model(seed=0, **kw) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP(**kw)


def global_batches(n_steps, global_batch, d_in=8, d_out=4, seed=1):
    """``n_steps`` (x, y) global batches, identical on every process."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, d_in, generator=g), torch.randn(global_batch, d_out, generator=g))
            for _ in range(n_steps)]


def micro_slice(batch, rank, world_size, micro, mb):
    """The micro-batch ``micro`` of data-parallel ``rank``: the global batch is split
    into ``world_size`` contiguous rank shards, each into micro-batches of ``mb``."""
    x, y = batch
    per_rank = x.shape[0] // world_size
    lo = rank * per_rank + micro * mb
    return x[lo:lo + mb], y[lo:lo + mb]


def reference_train(model, opt, batches, clip=0.0, scheduler=None):
    """Plain PyTorch: one step per global batch, mean loss over the whole batch."""
    for x, y in batches:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model


def full_weights(engine):
    """The engine's parameters as full fp32 copies, at any ZeRO stage (gathered at stage 3)."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):   # no-op below stage 3
        return [p.detach().float().clone() for p in params]


def row_batches(n, seed=1, rows=4, d_in=4, d_out=2):
    """``n`` global micro-batches of ``rows`` (x, y) rows (rank r of 2 trains on rows [2r, 2r + 2))."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)) for _ in range(n)]
