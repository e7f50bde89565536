"""Activation memory and step time of a 12-layer transformer with and without checkpointing.

Prints one JSON object. Targets: checkpointing (one ``deepspeed.checkpointing.checkpoint``
per layer) keeps at least 60% less activation memory at no more than 1.4x the step time
of the same model run plainly, in the same process.

Activation memory is measured the same way for both runs, on any device: every tensor
autograd saves for backward passes through a ``saved_tensors_hooks`` pack hook, which
counts its storage (once per distinct storage, parameters excluded) until autograd frees
it; the figure is the peak of those live bytes over a whole forward + backward, so the
recompute's own saved tensors during backward are included. Step time (forward,
backward, SGD step) is the median over alternating rounds so machine noise hits both alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

import deepspeed.checkpointing as ds_ckpt


class Layer(nn.Module):
    """Pre-LN transformer layer: self-attention (PyTorch SDPA) and a 4x MLP, with dropout."""

    def __init__(self, d, heads, p_drop):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(self, layers, d, heads, vocab, p_drop):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, p_drop) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, targets, use_ckpt):
        x = self.emb(ids)
        for layer in self.layers:
            x = ds_ckpt.checkpoint(layer, x) if use_ckpt else layer(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


class PeakSavedBytes:
    """Peak live bytes of tensors saved for backward (distinct storages, parameters excluded)."""

    def __init__(self, model):
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs, self.sizes = {}, {}
        self.live = self.peak = 0

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.param_storages:
            return t
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = t.untyped_storage().nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, key, self)

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)

    def hooks(self):
        return saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, _Held) else h)


class _Held:
    """Stands for a saved tensor; tells the meter when autograd drops it."""

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


def make_step(model, opt, ids, targets, use_ckpt):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets, use_ckpt)
        loss.backward()
        opt.step()
    return step


def peak_activation_bytes(model, ids, targets, use_ckpt) -> int:
    meter = PeakSavedBytes(model)
    with meter.hooks():
        model(ids, targets, use_ckpt).backward()
    model.zero_grad(set_to_none=True)
    assert meter.live == 0, "saved tensors outlived backward"
    return meter.peak


def grads_match(model, ids, targets) -> bool:
    """Same seed, with and without checkpointing: identical gradients (dropout masks replayed)."""
    grads = []
    for use_ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        model(ids, targets, use_ckpt).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(*grads))


def timed(fn, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared hosts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(args.layers, args.d_model, args.heads, args.vocab, args.dropout)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    ds_ckpt.configure(None)

    same_grads = grads_match(model, ids, targets)
    mem_plain = peak_activation_bytes(model, ids, targets, use_ckpt=False)
    mem_ckpt = peak_activation_bytes(model, ids, targets, use_ckpt=True)

    plain_step = make_step(model, opt, ids, targets, use_ckpt=False)
    ckpt_step = make_step(model, opt, ids, targets, use_ckpt=True)
    plain_step(), ckpt_step()  # warm-up
    plain_t, ckpt_t = [], []
    for _ in range(args.rounds):
        plain_t.append(timed(plain_step, args.steps))
        ckpt_t.append(timed(ckpt_step, args.steps))
    t_plain, t_ckpt = statistics.median(plain_t), statistics.median(ckpt_t)

    reduction = 1 - mem_ckpt / mem_plain
    time_ratio = t_ckpt / t_plain
    print(json.dumps({
        "benchmark": "activation_checkpointing",
        "config": {"model": f"{args.layers}-layer pre-LN transformer", "d_model": args.d_model,
                   "heads": args.heads, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
                   "dropout": args.dropout, "params": sum(p.numel() for p in model.parameters()),
                   "precision": "fp32", "device": "cpu", "threads": torch.get_num_threads(),
                   "checkpointing": "deepspeed.checkpointing.checkpoint per layer (reentrant)",
                   "rounds": args.rounds, "steps_per_round": args.steps, "step": "forward+backward+SGD"},
        "memory_method": "peak live bytes of tensors saved for backward (torch.autograd.graph."
                         "saved_tensors_hooks; distinct storages, parameters excluded; forward+backward)",
        "plain_peak_activation_bytes": mem_plain,
        "checkpointed_peak_activation_bytes": mem_ckpt,
        "activation_memory_ratio": round(mem_ckpt / mem_plain, 4),
        "activation_memory_reduction": round(reduction, 4),
        "plain_step_ms": round(t_plain * 1e3, 2),
        "checkpointed_step_ms": round(t_ckpt * 1e3, 2),
        "step_time_ratio": round(time_ratio, 4),
        "gradients_identical": same_grads,
        "target": {"activation_memory_reduction_min": 0.60, "step_time_ratio_max": 1.4},
        "meets_target": bool(reduction >= 0.60 and time_ratio <= 1.4),
    }, indent=None))


if __name__ == "__main__":
    main()
