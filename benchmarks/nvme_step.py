"""Engine step time with the ZeRO stage 1/2 optimizer state on NVMe vs in CPU memory.

Three engines train the same fp32 model (``--layers`` Linear layers of ``--width``;
fp32 master + Adam moments = 12 bytes per parameter) at ZeRO stage 2 with the config's
AdamW (DeepSpeed's CPU Adam), single process, same batches:

* ``cpu``: ``offload_optimizer.device: "cpu"`` (master and moments in host memory);
* ``nvme_overlap_off``: ``device: "nvme"``, ``pipeline_read/pipeline_write: false``
  (PartitionedOptimizerSwapper: read sub-group, update, write it back, next);
* ``nvme_overlap_on``: ``device: "nvme"``, ``pipeline_read/pipeline_write: true``
  (PipelinedOptimizerSwapper: the next sub-group's read and the last one's write-back run
  during the update).

The engines are stepped in rotated order, ``--steps`` steps each per round, for
``--repeats`` rounds after ``--warmup`` steps, so load changes hit all alike. Figures:

* ``step_s``: ``engine.step()`` wall time (the optimizer step: gradient norm, the update
  through the swapper, copy into the parameters), median over rounds of each round's
  median, with min/max of the round medians; ``fwd_bwd_s`` likewise for forward+backward.
* ``io_wait_s``: the swapper's blocked-wait timers per step (time the training thread sat
  in the I/O handle's ``wait()``, reads + writes).
* Ratios: ``nvme_overlap_off / cpu``, ``nvme_overlap_on / cpu``, ``on / off``.
* Hidden I/O time, two definitions: **wall clock**
  ``1 - (on - cpu) / (off - cpu)`` (the fraction of NVMe's extra step time over in-memory
  that the overlap removes: ``off - cpu`` is the I/O time when nothing overlaps it,
  ``on - cpu`` what is still exposed), and **blocked waits**
  ``1 - waits_on / waits_off`` (the fraction of the training thread's I/O waiting removed).

After the run the three engines' parameters are compared bit for bit (no gradient
clipping, so the three updates are elementwise and must agree exactly).

Usage: python benchmarks/nvme_step.py [--nvme_path /tmp/nvme_step] [--layers 6] [--width 2048]
                                      [--sub_group_size 4000000] [--buffer_count 3]
                                      [--steps 3] [--repeats 5] [--warmup 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("cpu", "nvme_overlap_off", "nvme_overlap_on")


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(layers)])


def _engine(mode: str, args):
    import deepspeed
    off = {"device": "cpu"}
    if mode != "cpu":
        pipe = mode == "nvme_overlap_on"
        off = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count,
               "pipeline_read": pipe, "pipeline_write": pipe}
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "offload_optimizer": off, "sub_group_size": args.sub_group_size},
           "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": args.aio_threads}}
    model = _model(args.layers, args.width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _io_wait(engine) -> float:
    nv = getattr(engine.optimizer, "_nvme", None)
    if nv is None:
        return 0.0
    s = nv.stats()
    return s["read_wait_s"] + s["write_wait_s"]


def _one_step(engine, x):
    t0 = time.perf_counter()
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    t1 = time.perf_counter()
    w0 = _io_wait(engine)
    engine.step()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, _io_wait(engine) - w0


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme_path", default=None, help="directory for the swap files (default: a new one in /tmp)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sub_group_size", type=int, default=4_000_000)
    ap.add_argument("--buffer_count", type=int, default=3)
    ap.add_argument("--aio_threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    made = args.nvme_path is None
    if made:
        args.nvme_path = tempfile.mkdtemp(prefix="nvme_step_", dir="/tmp")
    os.makedirs(args.nvme_path, exist_ok=True)
    from deepspeed.utils.logging import logger
    logger.setLevel(logging.WARNING)   # stdout carries the JSON only
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    load_start = os.getloadavg()
    engines = {m: _engine(m, args) for m in MODES}
    n_params = sum(p.numel() for p in engines["cpu"].module.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.batch, args.width, generator=g)
               for _ in range(args.warmup + args.steps * args.repeats)]
    for i in range(args.warmup):
        for m in MODES:
            _one_step(engines[m], batches[i])
    rounds = {m: {"fwd_bwd": [], "step": [], "io_wait": []} for m in MODES}
    k = args.warmup
    for r in range(args.repeats):
        order = MODES[r % 3:] + MODES[:r % 3]
        xs = batches[k:k + args.steps]
        k += args.steps
        for m in order:
            per = [_one_step(engines[m], x) for x in xs]
            rounds[m]["fwd_bwd"].append(statistics.median(p[0] for p in per))
            rounds[m]["step"].append(statistics.median(p[1] for p in per))
            rounds[m]["io_wait"].append(statistics.median(p[2] for p in per))
    load_end = os.getloadavg()
    # the three must have made the same updates (batches were fed in the same order to each)
    params = {m: [p.detach().clone() for p in engines[m].module.parameters()] for m in MODES}
    identical = all(torch.equal(a, b) for m in MODES[1:] for a, b in zip(params["cpu"], params[m]))
    nv = engines["nvme_overlap_on"].optimizer._nvme
    sub_groups, buffer_bytes = len(nv.subgroups), nv.swapper.buffer_bytes()
    for e in engines.values():
        e.destroy()
    if made:
        os.rmdir(args.nvme_path) if not os.listdir(args.nvme_path) else None

    med = {m: {k2: _summary(v) for k2, v in rounds[m].items()} for m in MODES}
    s = {m: med[m]["step"]["median"] for m in MODES}
    w = {m: med[m]["io_wait"]["median"] for m in MODES}
    # per-round versions of the hidden fractions, for their spread
    hid_wall = [1 - (on - c) / (off - c) if off > c else None for c, off, on in
                zip(rounds["cpu"]["step"], rounds["nvme_overlap_off"]["step"], rounds["nvme_overlap_on"]["step"])]
    hid_wait = [1 - on / off if off > 0 else None for off, on in
                zip(rounds["nvme_overlap_off"]["io_wait"], rounds["nvme_overlap_on"]["io_wait"])]
    out = {
        "benchmark": "nvme_step",
        "config": {"zero_stage": 2, "dtype": "fp32", "optimizer": "AdamW (config; DeepSpeedCPUAdam)",
                   "params": n_params, "optimizer_state_bytes": 12 * n_params, "layers": args.layers,
                   "width": args.width, "batch": args.batch, "sub_group_size": args.sub_group_size,
                   "sub_groups": sub_groups, "buffer_count": args.buffer_count,
                   "swap_buffer_bytes": buffer_bytes, "aio_threads": args.aio_threads, "steps": args.steps,
                   "repeats": args.repeats, "warmup": args.warmup, "nvme_path": args.nvme_path,
                   "torch_threads": torch.get_num_threads(), "host": platform.node()},
        "load_average": {"start": load_start, "end": load_end},
        "modes": med,
        "ratios": {"nvme_overlap_off/cpu": s["nvme_overlap_off"] / s["cpu"],
                   "nvme_overlap_on/cpu": s["nvme_overlap_on"] / s["cpu"],
                   "on/off": s["nvme_overlap_on"] / s["nvme_overlap_off"]},
        "io_hidden_by_overlap": {
            "definition_wall": "1 - (step_on - step_cpu) / (step_off - step_cpu): share of NVMe's extra step "
                               "time over in-memory that the overlap removes",
            "wall": 1 - (s["nvme_overlap_on"] - s["cpu"]) / (s["nvme_overlap_off"] - s["cpu"])
            if s["nvme_overlap_off"] > s["cpu"] else None,
            "wall_per_round": hid_wall,
            "definition_waits": "1 - io_wait_on / io_wait_off: share of the training thread's blocked I/O "
                                "waits that the overlap removes",
            "waits": 1 - w["nvme_overlap_on"] / w["nvme_overlap_off"] if w["nvme_overlap_off"] > 0 else None,
            "waits_per_round": hid_wait},
        "final_params_bit_identical": identical,
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
