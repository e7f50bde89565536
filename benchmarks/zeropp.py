"""ZeRO++ (qwZ / qgZ) vs plain ZeRO stage 3: bytes on the wire and step time, one run.

World size 4 (gloo, one process per rank, 1 thread each), BenchModel (d=256, 4 blocks,
~2.1 M parameters), every parameter gathered (stage3_param_persistence_threshold 0), in forward
and again in backward (nothing kept between them: max_live_parameters/reuse distance 0). Bytes
are the inputs rank 0 hands to torch.distributed's all-gather / reduce-scatter / all-to-all
during the timed steps (stage 3's small header exchanges are not included), per step.
hpZ (``zero_hpz_partition_size`` 2) and MiCS (``mics_shard_size`` 2) run as 2 simulated nodes
of 2 ranks: ``gather_bytes_in_group_per_step`` is the part of the all-gather bytes that stays
inside a 2-rank group (the rest crosses "nodes"). Prints one JSON object; ratios are against
plain stage 3 measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _common import BenchModel, n_params  # noqa: E402

VARIANTS = {"stage3": {}, "qwZ": {"zero_quantized_weights": True}, "qgZ": {"zero_quantized_gradients": True},
            "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
            "hpZ": {"zero_hpz_partition_size": 2}, "MiCS": {"mics_shard_size": 2}}


class _Counter:
    def __init__(self):
        import deepspeed.comm.comm as c
        self.bytes = {"all_gather": 0, "reduce": 0, "all_gather_in_group": 0, "all_reduce": 0}
        oar = dist.all_reduce
        og, ors_t, ors, oa = c._all_gather_single, c._reduce_scatter_single, dist.reduce_scatter, dist.all_to_all_single

        def nb(t):
            return t.numel() * t.element_size()

        def g(out, inp, *a, **k):
            self.bytes["all_gather"] += nb(inp)
            grp = k.get("group", a[0] if a else None)
            if grp is not None and dist.get_world_size(grp) < dist.get_world_size():
                self.bytes["all_gather_in_group"] += nb(inp)
            return og(out, inp, *a, **k)

        def ar(t, *a, **k):   # MiCS: the cross-replica all-reduce of the reduced slices
            if t.is_floating_point() and t.numel() > 4:
                self.bytes["all_reduce"] += nb(t)
            return oar(t, *a, **k)

        def rs_t(out, inp, *a, **k):
            self.bytes["reduce"] += nb(inp)
            return ors_t(out, inp, *a, **k)

        def rs(out, lst, *a, **k):
            self.bytes["reduce"] += sum(nb(t) for t in lst)
            return ors(out, lst, *a, **k)

        def a2a(out, inp, *a, **k):   # qgZ's all-to-all replaces the reduce-scatter
            self.bytes["reduce"] += nb(inp)
            return oa(out, inp, *a, **k)

        c._all_gather_single, c._reduce_scatter_single, dist.reduce_scatter, dist.all_to_all_single = g, rs_t, rs, a2a
        dist.all_reduce = ar


def run_variant(rank, world, extra, counter, warmup, steps):
    import deepspeed
    torch.manual_seed(0)
    model = BenchModel(d=256, layers=4)
    numel = n_params(model)
    # every parameter gathered in forward and again in backward, as for a model larger than
    # stage3_max_live_parameters (on this small model the defaults keep them between the two)
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
        "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0, **extra}}
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                        config=cfg)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(8, 256, generator=g), torch.randn(8, 16, generator=g)
    times, losses = [], []
    for i in range(warmup + steps):
        if i == warmup:
            counter.bytes = {k: 0 for k in counter.bytes}
        t0 = time.perf_counter()
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    t = torch.tensor([statistics.median(times[warmup:])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    from deepspeed.runtime.zero.zeropp import zeropp_stats
    st = zeropp_stats(eng.strategy.comm)
    out = {"gather_bytes_per_step": counter.bytes["all_gather"] / steps,
           "gather_bytes_in_group_per_step": counter.bytes["all_gather_in_group"] / steps,
           "reduce_bytes_per_step": counter.bytes["reduce"] / steps,
           "cross_replica_all_reduce_bytes_per_step": counter.bytes["all_reduce"] / steps,
           "step_s": round(t.item(), 5),
           "loss_first_last": [round(losses[0], 5), round(losses[-1], 5)], "n_params": numel}
    if st is not None:
        out["weight_error_bound"] = st.weight_error_bound
        out["grad_error_bound"] = st.grad_error_bound
    eng.destroy()
    return out


def worker(rank, world, port, warmup, steps, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DEEPSPEED_LOG_LEVEL", "WARNING")   # stdout carries the JSON only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counter = _Counter()
    out = {name: run_variant(rank, world, extra, counter, warmup, steps) for name, extra in VARIANTS.items()}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.world, port, a.warmup, a.steps, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    base = res["stage3"]
    for name, r in res.items():
        for k in ("gather", "reduce"):
            r[f"{k}_bytes_ratio_vs_stage3"] = round(r[f"{k}_bytes_per_step"] / base[f"{k}_bytes_per_step"], 4)
        r["step_time_ratio_vs_stage3"] = round(r["step_s"] / base["step_s"], 3)
    print(json.dumps({"world_size": a.world, "backend": "gloo", "dtype": "fp32", "steps": a.steps,
                      "loadavg": os.getloadavg(), "results": res}, indent=1))


if __name__ == "__main__":
    main()
