"""A tiny model and a training loop shared by the optimizer tests."""
from __future__ import annotations

import copy

import torch


def tiny_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model.to(dtype)


def batches(n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)) for _ in range(n)]


def compute_grads(model, x, y) -> None:
    for p in model.parameters():
        p.grad = None
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()


def train(model, make_optimizer, steps: int = 5, dtype=torch.float32):
    """Train a copy of ``model``; returns (model, optimizer, per-step flat params)."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model)
    history = []
    for x, y in batches(steps, dtype):
        compute_grads(model, x, y)
        opt.step()
        history.append(flat(model))
    return model, opt, history


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_histories_close(a, b, rtol=1e-6, atol=1e-7):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"step {step}: {m}")
