"""Engine step time vs a plain PyTorch loop on the same model, one process, same run.

Prints one JSON object. Target ratio (engine / plain): at most 1.03. The two loops
are timed in alternating rounds so machine noise hits both alike; the figure is the
median of per-round medians.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import BenchModel, median_time, n_params  # noqa: E402


def main():
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    d, layers, batch = 256, 4, 64
    rounds, steps, warmup = 5, 20, 5
    torch.manual_seed(0)
    x, y = torch.randn(batch, d), torch.randn(batch, 16)

    plain = BenchModel(d, layers)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        loss = plain(x, y)
        loss.backward()
        opt.step()

    import deepspeed
    model = BenchModel(d, layers)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": batch, "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})

    def engine_step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    plain_t, eng_t = [], []
    for _ in range(rounds):
        plain_t.append(median_time(plain_step, steps, warmup))
        eng_t.append(median_time(engine_step, steps, warmup))
    p, e = statistics.median(plain_t), statistics.median(eng_t)
    print(json.dumps({
        "benchmark": "engine_overhead",
        "config": {"model": f"{layers}-block MLP d={d}", "params": n_params(model), "batch": batch,
                   "optimizer": "AdamW", "precision": "fp32", "world_size": 1,
                   "rounds": rounds, "steps_per_round": steps, "threads": torch.get_num_threads()},
        "plain_pytorch_step_ms": round(p * 1e3, 3),
        "engine_step_ms": round(e * 1e3, 3),
        "ratio_engine_vs_plain": round(e / p, 4),
        "target_ratio_max": 1.03,
    }))


if __name__ == "__main__":
    main()
