"""Step time at data-parallel world size 2 (gloo, CPU): our engine at ZeRO stages 0-3
against torch DistributedDataParallel and FSDP2 (``fully_shard``) on the same model,
in the same run. Prints one JSON object with ratios.

Targets: stage 0 / DDP <= 1.0; stage 3 / FSDP2 <= 1.0. Stages 1 and 2 are reported
as ratios to stage 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _common import BenchModel, n_params  # noqa: E402

D, LAYERS, MB = 512, 4, 16


def _timed(step, steps, warmup):
    for _ in range(warmup):
        step()
    dist.barrier()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    # the slowest rank sets the pace
    t = torch.tensor([statistics.median(ts)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(MB, D, generator=g), torch.randn(MB, 16, generator=g)


def run_ddp(rank, steps, warmup):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(BenchModel(D, LAYERS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(rank)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    return _timed(step, steps, warmup)


def run_fsdp2(rank, steps, warmup):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = BenchModel(D, LAYERS)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(rank)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    return _timed(step, steps, warmup)


def run_ds(rank, stage, steps, warmup):
    import deepspeed
    torch.manual_seed(0)
    model = BenchModel(D, LAYERS)
    cfg = {"train_micro_batch_size_per_gpu": MB, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    except Exception as err:  # a stage not available in this build
        return f"unavailable: {err}"
    x, y = _data(rank)

    def step():
        engine.backward(engine(x, y))
        engine.step()
    t = _timed(step, steps, warmup)
    engine.destroy()
    return t


def worker(rank, world, port, steps, warmup, rounds, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {k: [] for k in ("ddp", "fsdp2", "stage0", "stage1", "stage2", "stage3")}
    for _ in range(rounds):  # alternate so noise hits every variant alike
        results["ddp"].append(run_ddp(rank, steps, warmup))
        for s in range(4):
            results[f"stage{s}"].append(run_ds(rank, s, steps, warmup))
        results["fsdp2"].append(run_fsdp2(rank, steps, warmup))
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    world = 2
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args.steps, args.warmup, args.rounds, q))
             for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=1200)
    for p in procs:
        p.join(timeout=60)

    def med(k):
        vals = [v for v in res[k] if isinstance(v, float)]
        return statistics.median(vals) if vals else None
    ms = {k: med(k) for k in res}
    out = {"benchmark": "data_parallel",
           "config": {"world_size": world, "backend": "gloo", "model": f"{LAYERS}-block MLP d={D}",
                      "params": n_params(BenchModel(D, LAYERS)), "micro_batch": MB, "optimizer": "AdamW",
                      "precision": "fp32", "steps": args.steps, "rounds": args.rounds, "threads_per_rank": 1},
           "step_ms": {k: (round(v * 1e3, 2) if v else None) for k, v in ms.items()},
           "unavailable": {k: v[0] for k, v in res.items() if v and isinstance(v[0], str)}}
    r = {}
    if ms["stage0"] and ms["ddp"]:
        r["stage0_vs_ddp"] = round(ms["stage0"] / ms["ddp"], 3)
    for s in (1, 2, 3):
        if ms[f"stage{s}"] and ms["stage0"]:
            r[f"stage{s}_vs_stage0"] = round(ms[f"stage{s}"] / ms["stage0"], 3)
    if ms["stage3"] and ms["fsdp2"]:
        r["stage3_vs_fsdp2"] = round(ms["stage3"] / ms["fsdp2"], 3)
    out["ratios"] = r
    out["targets"] = {"stage0_vs_ddp": "<= 1.0", "stage3_vs_fsdp2": "<= 1.0"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
