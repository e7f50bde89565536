"""Host work per step at ZeRO-3 next to ZeRO-2 and FSDP2 on the same model (issue 32).

Counts, per training step and per rank, with ``torch.profiler`` over a few steps after warm-up:

* ``collectives``: calls into ``torch.distributed`` (the profiler's ``c10d::``/``record_param_comms``
  events), i.e. how many collectives the step issues;
* ``copy_calls``: data-copying ops (``copy_``, ``to``, ``cat``, ``split_with_sizes_copy``,
  ``_chunk_cat``, ``_foreach_copy_``, ...) issued from Python or framework code (*top-level*: no
  other aten op above them): the per-parameter copies the issue is about, one per call however
  many tensors it moves; ``copy_calls_moving``, the same less the ``to``/``contiguous`` calls
  that return their input (already of that device and dtype: dispatched, nothing copied);
  and ``copy_calls_all``, every ``aten::copy_`` including those inside
  another op (on CPU a fused ``split_with_sizes_copy`` still loops over its outputs in C++ and
  ``.to()`` calls ``copy_``; on CUDA the fused op is one kernel); copies with no caller at all
  run on a communication backend's worker thread (gloo copies tensors in and out of its
  transport buffers) and are counted apart, as ``backend_thread_copies``; the model's own
  copies (e.g. ``unbind``'s backward) are in every mode's count alike;
* on CUDA: ``memcpy_calls`` (``cudaMemcpyAsync``) and ``kernel_launches`` (``cudaLaunchKernel``);

and, unprofiled, ``cpu_s_per_step`` (``time.process_time`` over the timed steps, all threads of
the rank's process, so the gloo/NCCL worker threads count) and ``wall_ms`` (median and IQR).

Modes: ``plain`` (world size 1 only: the model without any wrapper), ``zero2``, ``zero3``
(this package's engine; ``zero3_noalias``: at world size 1, with the partition aliasing off, so
every gather pays the copy a multi-rank gather pays) and ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per block and at
the root; same optimizer, clipping and precision). Everything runs in fresh processes per mode
(gloo on CPU, NCCL on CUDA) under a hard timeout. Prints one JSON object; the ratios are
``zero3 / zero2`` for copies and ``zero3 / fsdp2`` for CPU time and wall time, from one run.

    python benchmarks/zero3_host_cost.py                       # CPU, 2 ranks, fp32
    python benchmarks/zero3_host_cost.py --device cuda --world 1 --dtype bf16 --size full
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step import GPT  # noqa: E402

SIZES = {
    "small": dict(d=256, layers=4, heads=4, seq=64, batch=4, vocab=1024),
    "tiny": dict(d=64, layers=2, heads=4, seq=32, batch=2, vocab=256),
    "full": dict(d=1024, layers=8, heads=16, seq=512, batch=8, vocab=8192),
}


def _deepspeed_origin() -> str:
    """Which ``deepspeed`` the benchmark's processes import (PYTHONPATH may put an older copy first)."""
    import importlib.util
    spec = importlib.util.find_spec("deepspeed")
    return spec.origin if spec is not None else "not found"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _build(mode, cfg, dev, dtype):
    torch.manual_seed(0)
    model = GPT(**cfg)
    n = sum(p.numel() for p in model.parameters())
    if mode in ("plain", "fsdp2"):
        model = model.to(dev)
        autocast = mode == "plain" and dtype == "bf16"   # FSDP2 casts through its policy instead
        if mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
                  if dtype == "bf16" else MixedPrecisionPolicy())
            for b in model.blocks:
                fully_shard(b, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=dev.type == "cuda")

        def step(x, y):
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step, n, None
    import deepspeed
    stage = {"zero2": 2, "zero3": 3, "zero3_noalias": 3}[mode]
    if mode == "zero3_noalias":
        # world size 1 without the partition aliasing: every gather pays its copy, as a
        # multi-rank gather does (what one GPU of several would see on the host side)
        from deepspeed.runtime.zero import partitioned_gather
        partitioned_gather._alias_partitions = lambda todo: todo
    ds = {"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "steps_per_print": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
          "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step, n, engine


# Ops that copy data. A top-level one (no aten op above it) is one host-side copy call, however
# many tensors it moves; aten::copy_ nested inside another op is counted in copy_calls_all only.
_COPY_OPS = frozenset(("aten::copy_", "aten::to", "aten::_to_copy", "aten::cat", "aten::split_with_sizes_copy",
                       "aten::_chunk_cat", "aten::_foreach_copy_", "aten::clone", "aten::contiguous",
                       "aten::index_copy_", "aten::stack"))

_MAYBE_NOOP = frozenset(("aten::to", "aten::contiguous"))


def _count(prof, dev):
    c = {"collectives": 0, "copy_calls": 0, "copy_calls_moving": 0, "copy_calls_all": 0, "backend_thread_copies": 0,
         "memcpy_calls": 0, "kernel_launches": 0}
    sites = {}
    for e in prof.events():
        name = e.name
        if name.startswith("c10d::") or name == "record_param_comms":
            # record_param_comms sits inside the c10d:: op on the same thread: count the outer one
            if name.startswith("c10d::") or not (e.cpu_parent is not None and e.cpu_parent.name.startswith("c10d::")):
                c["collectives"] += 1
        elif name in _COPY_OPS:
            c["copy_calls_all"] += name == "aten::copy_"
            if e.cpu_parent is None:   # no caller at all: a communication backend's worker thread
                c["backend_thread_copies"] += 1
                continue
            par, top, where = e.cpu_parent, True, None
            while par is not None:
                if par.name.startswith("aten::"):
                    top = False
                    break
                if where is None and ("deepspeed/" in par.name or "torch/" in par.name or "Backward" in par.name):
                    where = par.name.split("deepspeed/")[-1][:70]
                par = par.cpu_parent
            if top:
                c["copy_calls"] += 1
                # ``to``/``contiguous`` on a tensor already of that device, dtype and layout return
                # it: dispatched, but nothing moves (counted in copy_calls, not here)
                c["copy_calls_moving"] += not (name in _MAYBE_NOOP and not any(
                    ch.name.startswith("aten::") for ch in e.cpu_children))
                key = f"{name} @ {where}"
                sites[key] = sites.get(key, 0) + 1
        elif name == "cudaMemcpyAsync":
            c["memcpy_calls"] += 1
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"):
            c["kernel_launches"] += 1
    return c, dict(sorted(sites.items(), key=lambda kv: -kv[1])[:10])


def _rank(rank, world, port, mode, cfg, dev_name, dtype, warmup, steps, prof_steps, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DEEPSPEED_LOG_LEVEL", "WARNING")   # stdout carries the JSON only
    res = {}
    try:
        dev = torch.device(dev_name, rank) if dev_name == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        step, n, engine = _build(mode, cfg, dev, dtype)
        g = torch.Generator().manual_seed(1 + rank)
        tok = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(dev)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        for _ in range(warmup):
            step(x, y)
        _sync(dev)
        torch.distributed.barrier()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(prof_steps):
                step(x, y)
            _sync(dev)
        counts, sites = _count(prof, dev)
        counts = {k: v / prof_steps for k, v in counts.items()}
        torch.distributed.barrier()
        walls, cpu0 = [], time.process_time()
        loss = None
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step(x, y)
            _sync(dev)
            walls.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / steps
        ms = sorted(w * 1e3 for w in walls)
        q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
        res = dict(counts, cpu_s_per_step=round(cpu, 5), wall_ms=round(statistics.median(ms), 3),
                   wall_iqr_ms=round(q[2] - q[0], 3), params=n, loss_last=float(loss.detach().float()),
                   peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 3) if dev.type == "cuda" else None,
                   copy_sites={k: v / prof_steps for k, v in sites.items()})
        if engine is not None:
            engine.destroy()
        torch.distributed.destroy_process_group()
    except Exception:
        res = {"error": traceback.format_exc()[-2000:]}
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)


def run_mode(mode, a, cfg, timeout):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "r")
        procs = [ctx.Process(target=_rank, args=(r, a.world, port, mode, cfg, a.device, a.dtype, a.warmup, a.steps,
                                                 a.prof_steps, out)) for r in range(a.world)]
        for p in procs:
            p.start()
        deadline = time.time() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.time()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if hung:
            return {"error": f"timed out after {timeout}s"}
        ranks = []
        for r in range(a.world):
            try:
                with open(f"{out}.{r}") as f:
                    ranks.append(json.load(f))
            except OSError:
                return {"error": f"rank {r} wrote no result (exit code {procs[r].exitcode})"}
    errs = [x["error"] for x in ranks if "error" in x]
    if errs:
        return {"error": errs[0]}
    keys = [k for k in ranks[0] if isinstance(ranks[0][k], (int, float)) and ranks[0][k] is not None]
    res = {k: round(statistics.mean(x[k] for x in ranks), 5) for k in keys}
    res["cpu_s_per_step_per_rank"] = [x["cpu_s_per_step"] for x in ranks]
    res["copy_sites_rank0"] = ranks[0].get("copy_sites")   # where the top-level copies come from
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, 1 on CUDA)")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on CPU, full on CUDA")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--modes", nargs="+", default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prof_steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.world = a.world or (1 if a.device == "cuda" else 2)
    a.size = a.size or ("full" if a.device == "cuda" else "small")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    modes = a.modes or (["plain", "zero2", "zero3", "zero3_noalias", "fsdp2"] if a.world == 1
                        else ["zero2", "zero3", "fsdp2"])
    cfg = SIZES[a.size]
    res = {"benchmark": "zero3_host_cost", "device": a.device, "world": a.world, "size": a.size, "model": cfg,
           "dtype": a.dtype, "steps": a.steps, "prof_steps": a.prof_steps, "torch": torch.__version__,
           "loadavg_before": os.getloadavg(), "deepspeed_from": _deepspeed_origin(), "modes": {}}
    for m in modes:
        res["modes"][m] = run_mode(m, a, cfg, a.timeout)
    res["loadavg_after"] = os.getloadavg()
    ms = res["modes"]

    def ratio(a_, b_, k):
        try:
            return round(ms[a_][k] / ms[b_][k], 3)
        except (KeyError, ZeroDivisionError, TypeError):
            return None
    res["ratios"] = {
        "copy_calls_zero3_over_zero2": ratio("zero3", "zero2", "copy_calls"),
        "copy_calls_moving_zero3_over_zero2": ratio("zero3", "zero2", "copy_calls_moving"),
        "copy_calls_all_zero3_over_zero2": ratio("zero3", "zero2", "copy_calls_all"),
        "memcpy_calls_zero3_over_zero2": ratio("zero3", "zero2", "memcpy_calls"),
        "cpu_zero3_over_fsdp2": ratio("zero3", "fsdp2", "cpu_s_per_step"),
        "wall_zero3_over_fsdp2": ratio("zero3", "fsdp2", "wall_ms"),
        "wall_zero3_over_plain": ratio("zero3", "plain", "wall_ms"),
        "wall_zero3_over_zero2": ratio("zero3", "zero2", "wall_ms"),
        "wall_zero3_noalias_over_plain": ratio("zero3_noalias", "plain", "wall_ms"),
        "wall_zero3_noalias_over_fsdp2": ratio("zero3_noalias", "fsdp2", "wall_ms"),
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
