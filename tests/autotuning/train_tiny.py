"""A tiny training script for the autotuning tests: an MLP trained on fixed random
data through the DeepSpeed engine for ``--steps`` optimizer steps.

``--crash_above_mbs N`` makes a micro-batch size above N fail like an out-of-memory
error (a stand-in for a configuration that does not fit). ``--out FILE`` is written
only when training runs to the end (an autotuning experiment stops itself earlier).
"""
import argparse
import json
import os

import torch

import deepspeed

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--crash_above_mbs", type=int, default=0)
p.add_argument("--out", default=None)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
mbs = engine.train_micro_batch_size_per_gpu()
if args.crash_above_mbs and mbs > args.crash_above_mbs:
    raise RuntimeError(f"simulated out of memory: micro-batch {mbs} > {args.crash_above_mbs}")
g = torch.Generator().manual_seed(1234 + engine.global_rank)
losses = []
for step in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 32, generator=g)
        y = x[:, :4].sum(dim=1).round().long().clamp(0, 3)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    losses.append(loss.item())
if args.out and engine.global_rank == 0:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "micro_batch": mbs, "steps": engine.global_steps,
                   "stage": engine.zero_optimization_stage(), "world_size": engine.world_size,
                   "config": os.path.abspath(args.deepspeed_config)}, f)
