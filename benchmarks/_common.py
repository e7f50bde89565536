"""Shared bits for benchmarks: a small transformer-ish MLP model and timing helpers."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class BenchModel(nn.Module):
    def __init__(self, d=256, layers=4, d_out=16):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, d_out)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def median_time(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
