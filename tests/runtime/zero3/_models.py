"""Tiny models and helpers for the ZeRO stage-3 tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ = 16, 8, 6


class Block(nn.Module):
    def __init__(self, d=DIM):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding tied to the LM head, ``n_layers`` residual blocks, optional activation
    checkpointing ("reentrant" / "non_reentrant": torch.utils.checkpoint; "deepspeed":
    deepspeed.checkpointing.checkpoint) and an optionally frozen first block."""

    def __init__(self, n_layers=2, ckpt=None, freeze_first=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.ckpt = ckpt
        if freeze_first:
            for p in self.blocks[0].parameters():
                p.requires_grad_(False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for b in self.blocks:
            if self.ckpt == "deepspeed" and self.training:
                import deepspeed
                x = deepspeed.checkpointing.checkpoint(b, x)
            elif self.ckpt and self.training:
                x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_lm(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**kw)


def lm_batches(n_steps, global_batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        idx = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def shard(batch, rank, world_size, micro, mb):
    x, y = batch
    lo = rank * (x.shape[0] // world_size) + micro * mb
    return x[lo:lo + mb], y[lo:lo + mb]


def plain_reference(model, batches, lr, clip=0.0, weight_decay=0.0):
    """Plain PyTorch AdamW, one step per global batch (mean loss over the whole batch)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    for x, y in batches:
        opt.zero_grad()
        model(x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stage3_config(gas=1, mb=2, **zero):
    z = {"stage": 3, "stage3_param_persistence_threshold": 0}
    z.update(zero)
    return {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas, "zero_optimization": z,
            "gradient_clipping": 0.0}


def train_engine(model, config, batches, rank, world_size, lr, weight_decay=0.0):
    """Train with deepspeed.initialize on this rank's shard of each global batch; returns the engine.
    Uses a client torch AdamW unless the config has an "optimizer" section."""
    import deepspeed
    opt = None if "optimizer" in config else \
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gas, mb = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    for b in batches:
        for m in range(gas):
            x, y = shard(b, rank, world_size, m, mb)
            eng.backward(eng(x, y))
            eng.step()
    return eng
