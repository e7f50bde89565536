"""1-bit Adam, 0/1 Adam and 1-bit LAMB vs data-parallel Adam (ZeRO stage 0), gloo on CPU.

In one run, at world sizes 2 and 4, the same model and data through our engine with
optimizer types Adam, OneBitAdam, ZeroOneAdam, OneBitLamb (and Lamb for the loss curve):

* **bytes on the wire per step after warm-up**: every torch.distributed collective the
  package issues is intercepted and charged what one rank sends with the usual algorithms
  (ring all-reduce ``2(N-1)/N * bytes``, ring all-gather ``(N-1) * bytes``, pairwise
  all-to-all ``(N-1)/N * bytes``; :func:`deepspeed.runtime.comm.compressed.wire_bytes`),
  summed over the measured steps. Ratio = Adam's bytes / the optimizer's bytes.
* **step time**: median over the measured steps (slowest rank), ratio to Adam.
* **loss curve** (world size 4): PNG of the training loss of every optimizer.

Targets: 1-bit Adam >= 16x fewer bytes than Adam after warm-up; 0/1 Adam more than that.
Prints one JSON object.
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

D, LAYERS, MB = 256, 4, 16


class WireCounter:
    """Charges every collective its wire bytes (see module docstring)."""

    def __init__(self):
        import deepspeed.comm.comm as dcomm
        from deepspeed.runtime.comm.compressed import wire_bytes
        self.bytes = 0.0
        self.calls = 0
        self._saved = []
        world = dist.get_world_size()

        def nb(t):
            return t.numel() * t.element_size()
        charges = {"all_reduce": lambda a, k: wire_bytes("all_reduce", nb(a[0]), world),
                   "all_to_all_single": lambda a, k: wire_bytes("all_to_all", nb(a[1]), world),
                   "all_gather_into_tensor": lambda a, k: wire_bytes("all_gather", nb(a[1]), world),
                   "broadcast": lambda a, k: float(nb(a[0]))}
        for name, charge in charges.items():
            self._wrap(dist, name, charge)
        self._wrap(dcomm, "_all_gather_single", charges["all_gather_into_tensor"])

    def _wrap(self, mod, name, charge):
        fn = getattr(mod, name)
        self._saved.append((mod, name, fn))

        def wrapped(*a, **k):
            self.bytes += charge(a, k)
            self.calls += 1
            return fn(*a, **k)
        setattr(mod, name, wrapped)

    def restore(self):
        for mod, name, fn in self._saved:
            setattr(mod, name, fn)


def _batches(rank, world, n):
    """A learnable task (a fixed random teacher), each rank its own shard."""
    torch.manual_seed(1234)
    teacher = BenchModel(D, 1)
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        x = torch.randn(MB * world, D, generator=g)
        with torch.no_grad():
            y = teacher.head(teacher.blocks(x)) * 3
        out.append((x[rank * MB:(rank + 1) * MB], y[rank * MB:(rank + 1) * MB]))
    return out


def _variants(warmup, steps):
    return {
        "Adam": ("Adam", {"lr": 1e-3}),
        "OneBitAdam": ("OneBitAdam", {"lr": 1e-3, "freeze_step": warmup}),
        "ZeroOneAdam": ("ZeroOneAdam", {"lr": 1e-3, "var_freeze_step": warmup, "var_update_scaler": 4,
                                        "local_step_scaler": max(1, steps // 8), "local_step_clipper": 16}),
        "Lamb": ("Lamb", {"lr": 1e-2}),
        "OneBitLamb": ("OneBitLamb", {"lr": 1e-2, "freeze_step": warmup}),
    }


def run_variant(rank, world, opt_type, params, warmup, steps):
    import deepspeed
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MB, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": opt_type, "params": params}, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=BenchModel(D, LAYERS), config=cfg)
    data = _batches(rank, world, warmup + steps)
    losses, times = [], []
    counter = None
    for i, (x, y) in enumerate(data):
        if i == warmup:
            dist.barrier()
            counter = WireCounter()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    counter.restore()
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    engine.destroy()
    return {"bytes_per_step": counter.bytes / steps, "collectives_per_step": counter.calls / steps,
            "step_s": t.item(), "losses": losses}


def worker(rank, world, port, warmup, steps, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {name: run_variant(rank, world, t, p, warmup, steps) for name, (t, p) in _variants(warmup, steps).items()}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def run_world(world, warmup, steps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, warmup, steps, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=3000)
    for p in procs:
        p.join(timeout=60)
    return res


def plot(res, path, warmup, world):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1.2)
    ax.axvline(warmup, color="gray", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step (dotted: end of warm-up / variance freeze)")
    ax.set_ylabel("training loss (rank 0 micro-batch)")
    ax.set_title(f"1-bit optimizers vs Adam/LAMB, world size {world}, gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "measurements",
                                                  "onebit_loss.png"))
    args = ap.parse_args()
    out = {"benchmark": "onebit",
           "config": {"backend": "gloo", "model": f"{LAYERS}-block MLP d={D}",
                      "params": n_params(BenchModel(D, LAYERS)),
                      "micro_batch": MB, "zero_stage": 0, "precision": "fp32", "warmup_steps": args.warmup,
                      "measured_steps": args.steps, "threads_per_rank": 1,
                      "bytes": "per rank per step, counted at torch.distributed (ring/pairwise algorithms)"},
           "worlds": {}}
    for world in args.worlds:
        res = run_world(world, args.warmup, args.steps)
        adam = res["Adam"]
        w = {}
        for name, r in res.items():
            w[name] = {"bytes_per_step": round(r["bytes_per_step"]), "collectives_per_step":
                       round(r["collectives_per_step"], 2), "step_ms": round(r["step_s"] * 1e3, 2),
                       "final_loss": round(statistics.mean(r["losses"][-5:]), 4)}
            if name != "Adam":
                w[name]["bytes_vs_adam"] = round(adam["bytes_per_step"] / max(r["bytes_per_step"], 1e-9), 2)
                w[name]["step_time_vs_adam"] = round(r["step_s"] / adam["step_s"], 3)
        out["worlds"][str(world)] = w
        if world == max(args.worlds) and args.png:
            os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
            plot(res, args.png, args.warmup, world)
            out["loss_png"] = os.path.relpath(os.path.abspath(args.png), os.path.join(os.path.dirname(__file__), ".."))
    top = out["worlds"][str(max(args.worlds))]
    out["targets"] = {"OneBitAdam bytes_vs_adam": ">= 16", "ZeroOneAdam bytes_vs_adam": "> OneBitAdam's"}
    out["met"] = {"OneBitAdam": top["OneBitAdam"]["bytes_vs_adam"] >= 16,
                  "ZeroOneAdam": top["ZeroOneAdam"]["bytes_vs_adam"] > top["OneBitAdam"]["bytes_vs_adam"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
