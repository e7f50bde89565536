"""The elastic training job (``deepspeed --elastic_training``) of the node-loss test.

Each (re)start resumes from the latest checkpoint in ``--ckpt`` (if any) and trains
``TinyMLP`` with the ``elasticity`` section below up to ``--steps`` global steps on the
shared deterministic global batches (8 samples per step at every world size: 2 ranks x
micro 4, or 1 rank x micro 4 x 2 accumulation steps), saving a checkpoint after every
step. Rank 0 appends one JSON line per step to ``<out>/log.jsonl``: the step, the global
batch's loss (mean over all micro-batches of all ranks), the world size, the batch
sizes the engine chose, the torchelastic restart count, the step it resumed from, and
the wall time.
"""
import argparse
import json
import os
import time

import torch

import deepspeed
from tests.helpers.models import global_batches, make_model, micro_slice

ELASTICITY = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2, 4], "min_gpus": 1,
              "max_gpus": 2, "version": 0.1}

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--step_sleep", type=float, default=0.0)
a = p.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
config = {"elasticity": ELASTICITY, "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepspeed.initialize(model=make_model(seed=0), config=config)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
path, _ = engine.load_checkpoint(a.ckpt) if os.path.exists(os.path.join(a.ckpt, "latest")) else (None, None)
resumed_from = engine.global_steps
gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
batches = global_batches(a.steps, engine.train_batch_size())
while engine.global_steps < a.steps:
    step = engine.global_steps
    local = torch.zeros(1)
    for m in range(gas):
        x, y = micro_slice(batches[step], rank, world, m, micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        local += loss.detach()
    torch.distributed.all_reduce(local)
    engine.save_checkpoint(a.ckpt)
    if rank == 0:
        rec = {"step": step, "loss": local.item() / (gas * world), "world": world, "gas": gas, "micro": micro,
               "train_batch_size": engine.train_batch_size(), "resumed_from": resumed_from,
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "time": time.time()}
        with open(os.path.join(a.out, "log.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    time.sleep(a.step_sleep)
if rank == 0:
    torch.save([q.detach() for q in engine.module.parameters()], os.path.join(a.out, "final.pt"))
torch.distributed.destroy_process_group()
