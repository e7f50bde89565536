"""Step time of ZeRO stage 3 with the parameter partitions on NVMe (``offload_param.device:
nvme``) vs in host memory, with the prefetcher's read-ahead on and off.

One process, fp32, a stack of MLP blocks, client ``torch.optim.SGD`` (so the step is cheap
and the parameter I/O shows). Modes, measured in turns (round-robin, ``--repeats`` rounds)
so they see the same machine load:

* ``memory``: ``offload_param`` off (partitions in host memory: CPU is the device here);
* ``nvme``: partitions in swap files, ``max_in_cpu: 0`` (every use reads them), the
  stage-3 prefetcher's trace submits the next modules' reads ahead
  (``stage3_prefetch_bucket_size`` elements);
* ``nvme_no_readahead``: the same with ``stage3_prefetch_bucket_size: 0`` (each read waited
  for when its module runs).

Prints one JSON object: per mode the median step time over the measured steps of each
round, the swapper's read-wait seconds per step and bytes read/written per step, and the
ratios nvme/memory. The parameters of all modes are checked to be bit-identical at the end
of each round.

    python benchmarks/zero3_nvme_params.py --nvme_path /tmp/bench --layers 8 --width 1024
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(layers, width, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(layers)])


def _config(mode, args):
    width = args.width
    z = {"stage": 3, "stage3_param_persistence_threshold": 0,
         "stage3_prefetch_bucket_size": 0 if mode == "nvme_no_readahead" else 8 * width * width,
         "stage3_max_live_parameters": 16 * width * width}
    if mode != "memory":
        z["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4,
                              "buffer_size": 4 * width * width, "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": z,
            "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 2}}


def run(mode, args):
    import deepspeed
    model = _model(args.layers, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eng = deepspeed.initialize(model=model, optimizer=opt, config=_config(mode, args))[0]
    sw = eng.optimizer.spec.swapper
    g = torch.Generator().manual_seed(1)
    times, waits, rd, wr = [], [], [], []
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.seq, args.width, generator=g)
        s0 = dict(sw.stats) if sw is not None else None
        t0 = time.perf_counter()
        eng.backward(eng(x).pow(2).mean())
        eng.step()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            if sw is not None:
                waits.append(sw.stats["read_wait_s"] - s0["read_wait_s"])
                rd.append(sw.stats["bytes_read"] - s0["bytes_read"])
                wr.append(sw.stats["bytes_written"] - s0["bytes_written"])
    params = [p.detach().clone() for p in eng.module_state_dict().values()]
    eng.destroy()
    out = {"step_s": statistics.median(times)}
    if sw is not None:
        out.update(read_wait_s=statistics.median(waits), bytes_read=statistics.median(rd),
                   bytes_written=statistics.median(wr))
    return out, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme_path", default="/tmp")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    os.makedirs(args.nvme_path, exist_ok=True)
    import logging
    from deepspeed.utils.logging import logger
    logger.setLevel(logging.WARNING)   # stdout carries the JSON only
    load_start = os.getloadavg()
    modes = ["memory", "nvme", "nvme_no_readahead"]
    rounds = []
    for r in range(args.repeats):
        res, ref = {}, None
        for mode in modes[r % 3:] + modes[:r % 3]:
            res[mode], params = run(mode, args)
            if ref is None:
                ref = params
            elif not all(torch.equal(a, b) for a, b in zip(ref, params)):
                raise SystemExit(f"round {r}: {mode} ended with different parameters")
        res["nvme_over_memory"] = res["nvme"]["step_s"] / res["memory"]["step_s"]
        res["nvme_no_readahead_over_memory"] = res["nvme_no_readahead"]["step_s"] / res["memory"]["step_s"]
        res["readahead_on_over_off"] = res["nvme"]["step_s"] / res["nvme_no_readahead"]["step_s"]
        rounds.append(res)
    n_params = sum(p.numel() for p in _model(args.layers, args.width).parameters())
    summary = {}
    for key in ("nvme_over_memory", "nvme_no_readahead_over_memory", "readahead_on_over_off"):
        vals = sorted(r[key] for r in rounds)
        summary[key] = {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}
    for mode in modes:
        vals = sorted(r[mode]["step_s"] for r in rounds)
        summary[f"{mode}_step_s"] = {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}
    print(json.dumps({"config": vars(args), "params": n_params, "param_bytes": 4 * n_params,
                      "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "summary": summary,
                      "rounds": rounds, "identical": True}, indent=1))


if __name__ == "__main__":
    main()
