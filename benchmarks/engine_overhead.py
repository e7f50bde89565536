"""Engine step time vs a plain PyTorch loop on the same model, one process, same run.

Prints one JSON object. Target ratio (engine / plain): at most 1.03. Both loops drive the
same model and optimizer object (only the orchestration differs). The loops
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
    rounds, steps, warmup = 15, 20, 5
    torch.manual_seed(0)
    x, y = torch.randn(batch, d), torch.randn(batch, 16)

    # The plain loop and the engine drive the SAME model and optimizer object, so the math,
    # the tensors and the allocator's history are shared and only the orchestration differs.
    import deepspeed
    model = BenchModel(d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                      config={"train_batch_size": batch, "steps_per_print": 0})
    # The config's "AdamW" (our fused flat-kernel Adam) on its own model, for information.
    model2 = BenchModel(d, layers)
    engine2, *_ = deepspeed.initialize(model=model2, config={
        "train_batch_size": batch, "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})

    def make_step(eng):
        def step():
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
        return step
    engine_step, engine2_step = make_step(engine), make_step(engine2)

    plain_t, eng_t, eng2_t = [], [], []
    variants = [(plain_step, plain_t), (engine_step, eng_t), (engine2_step, eng2_t)]
    for r in range(rounds):  # rotate the order so drift and noise hit every variant alike
        for fn, out in variants[r % 3:] + variants[:r % 3]:
            out.append(median_time(fn, steps, warmup))
    p, e, e2 = statistics.median(plain_t), statistics.median(eng_t), statistics.median(eng2_t)
    # The engine's fixed cost per step, isolated on a model too small to hide it.
    tiny = torch.nn.Linear(4, 4)
    tiny_opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    tiny2 = torch.nn.Linear(4, 4)
    tiny_eng, *_ = deepspeed.initialize(model=tiny2, optimizer=torch.optim.SGD(tiny2.parameters(), lr=0.1),
                                        config={"train_batch_size": 2, "steps_per_print": 0})
    tx = torch.randn(2, 4)

    def tiny_plain():
        tiny_opt.zero_grad(set_to_none=True)
        tiny(tx).sum().backward()
        tiny_opt.step()

    def tiny_engine():
        tiny_eng.backward(tiny_eng(tx).sum())
        tiny_eng.step()
    tp, te = [], []
    for _ in range(5):
        tp.append(median_time(tiny_plain, 500, 50))
        te.append(median_time(tiny_engine, 500, 50))
    fixed_us = (statistics.median(te) - statistics.median(tp)) * 1e6

    print(json.dumps({
        "benchmark": "engine_overhead",
        "config": {"model": f"{layers}-block MLP d={d}", "params": n_params(model), "batch": batch,
                   "optimizer": "torch.optim.AdamW (foreach) in both loops", "precision": "fp32", "world_size": 1,
                   "rounds": rounds, "steps_per_round": steps, "threads": torch.get_num_threads()},
        "plain_pytorch_step_ms": round(p * 1e3, 3),
        "engine_step_ms": round(e * 1e3, 3),
        "ratio_engine_vs_plain": round(e / p, 4),
        "engine_with_config_AdamW_step_ms": round(e2 * 1e3, 3),
        "ratio_engine_config_AdamW_vs_plain": round(e2 / p, 4),
        "target_ratio_max": 1.03,
        "engine_fixed_overhead_us_per_step": round(fixed_us, 1),
        "fixed_overhead_as_fraction_of_plain_step": round(fixed_us * 1e-6 / p, 5),
    }))


if __name__ == "__main__":
    main()
