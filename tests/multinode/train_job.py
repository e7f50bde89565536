"""The training job the multi-node tests launch on the namespace hosts.

Every rank trains ``tests.helpers.models.TinyMLP`` with DeepSpeed (plain data parallel,
SGD) on the shared deterministic global batches (``--global_batch`` samples per step,
split into contiguous rank shards), and writes ``<out>/rank<R>.json``: its host, the
rendezvous variables it saw, the value of ``DS_MN_MARK`` (set only in the job's
``.deepspeed_env``), its per-step losses, and (rank 0) the trained parameters.

``--hidden``/``--layers`` widen the model (benchmarks/multinode.py).
``--hang_after N``: after ``N`` steps (0: right after ``init_distributed``) every rank
writes ``<out>/ready<R>`` with its pid and idles in all-reduces, so a test can kill one.
"""
import argparse
import json
import os
import socket
import time

import torch

import deepspeed
from tests.helpers.models import global_batches, make_model, micro_slice

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--global_batch", type=int, default=8)
p.add_argument("--hang_after", type=int, default=-1)
p.add_argument("--idle", choices=["allreduce", "sleep"], default="allreduce",
               help="with --hang_after: idle in all-reduces, or sleep (no collective to notice a lost peer)")
p.add_argument("--hidden", type=int, default=16, help="TinyMLP width (the benchmark uses a wider one)")
p.add_argument("--layers", type=int, default=2)
a = p.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()


def idle_in_collectives():
    with open(os.path.join(a.out, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:                          # keep talking to the peers until someone dies
        if a.idle == "sleep":
            time.sleep(1)
            continue
        torch.distributed.all_reduce(torch.ones(1))
        time.sleep(0.05)


if a.hang_after == 0:
    idle_in_collectives()
config = {"train_batch_size": a.global_batch, "train_micro_batch_size_per_gpu": a.global_batch // world,
          "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepspeed.initialize(model=make_model(seed=0, hidden=a.hidden, layers=a.layers), config=config)
losses, step_times = [], []
for step, batch in enumerate(global_batches(a.steps, a.global_batch)):
    if step == a.hang_after:
        idle_in_collectives()
    t0 = time.perf_counter()
    x, y = micro_slice(batch, rank, world, 0, a.global_batch // world)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    step_times.append(time.perf_counter() - t0)
    losses.append(loss.item())
rec = {"rank": rank, "world": world, "host": socket.gethostname(), "mark": os.environ.get("DS_MN_MARK"),
       "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
       "local_rank_arg": a.local_rank, "losses": losses, "step_times": step_times}
if rank == 0:
    rec["params"] = [q.detach().tolist() for q in engine.module.parameters()]
with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
    json.dump(rec, f)
torch.distributed.destroy_process_group()
