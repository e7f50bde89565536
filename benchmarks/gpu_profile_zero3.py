"""Where a ZeRO-3 step spends its time on one GPU, next to ZeRO-2: ``torch.profiler`` over a
few steps of the GPT of ``benchmarks/gpu_step.py``.

Prints one JSON object: per stage the median step time, the top operators by self CPU time
(host-side cost: Python hooks, kernel launches) and by self CUDA time, the number of calls
that block the host (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``aten::_local_scalar_dense`` = ``.item()``/``bool(tensor)``, device-to-host copies) with the
Python stacks that issue them, and the kernel-launch count per step. A diagnostic, not a
figure to report on its own (the profiler adds overhead of its own).

    python benchmarks/gpu_profile_zero3.py [--size full|tiny] [--stages 2 3] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step import GPT, SIZES  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "aten::_local_scalar_dense", "aten::item", "cudaMemcpy", "Memcpy DtoH")


def _python_profile(step, dev, steps) -> list:
    """cProfile over ``steps`` steps: the Python functions by own time (ms per step) and their
    cumulative time - where the host's Python work goes (hooks, bookkeeping)."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"fn": f"{os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}({fn})",
                     "calls_per_step": round(nc / steps, 1), "own_ms_per_step": round(1e3 * tt / steps, 3),
                     "cum_ms_per_step": round(1e3 * ct / steps, 3)})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:45]


def profile_stage(stage, cfg, dev, steps, warmup, python_profile=False, extra_zero=None):
    import deepspeed
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = GPT(**cfg)
    ds_cfg = {"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_clipping": 1.0, "steps_per_print": 0,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, **(extra_zero or {})}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(dev)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, with_stack=True, record_shapes=False) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    ka = prof.key_averages()
    per = float(steps)
    py_top = _python_profile(step, dev, steps) if python_profile else None

    def row(e, cuda):
        r = {"name": e.key[:80], "calls_per_step": round(e.count / per, 1),
             "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1000 / per, 3)}
        if cuda:
            r["self_device_ms_per_step"] = round(getattr(e, "self_device_time_total", 0) / 1000 / per, 3)
        return r

    cuda = dev.type == "cuda"
    top_cpu = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    top_dev = sorted(ka, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:12] if cuda else []
    blocking = [row(e, cuda) for e in ka if any(b in e.key for b in BLOCKING)]
    stacks = []
    for e in prof.key_averages(group_by_stack_n=6):
        if any(b in e.key for b in BLOCKING) and e.stack:
            stacks.append({"name": e.key[:60], "calls_per_step": round(e.count / per, 1),
                           "stack": [s for s in e.stack if "torch/" not in s][:6]})
    stacks.sort(key=lambda s: -s["calls_per_step"])
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    out = {"stage": stage, "step_ms_median_unprofiled": round(1000 * statistics.median(times), 3),
           "kernel_launches_per_step": round(launches / per, 1),
           "top_self_cpu": [row(e, cuda) for e in top_cpu], "top_self_device": [row(e, cuda) for e in top_dev],
           "blocking": blocking, "blocking_stacks": stacks[:15]}
    if py_top is not None:
        out["python_top_own_time"] = py_top
    engine.destroy()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--python-profile", action="store_true",
                    help="also cProfile the steps: Python functions by own time per step")
    ap.add_argument("--zero", default=None, help="extra zero_optimization keys as JSON, e.g. "
                    "'{\"stage3_param_persistence_threshold\": 0}'")
    args = ap.parse_args(argv)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    size = args.size or ("full" if dev.type == "cuda" else "tiny")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import logging

    import deepspeed
    from deepspeed.utils.logging import logger
    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(verbose=False)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    res = {"benchmark": "gpu_profile_zero3", "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "size": size, "model": SIZES[size], "stages": {}}
    for st in args.stages:
        try:
            res["stages"][str(st)] = profile_stage(st, SIZES[size], dev, args.steps, args.warmup, args.python_profile,
                                                   json.loads(args.zero) if args.zero else None)
        except Exception as err:   # noqa: BLE001 - record and go on with the next stage
            res["stages"][str(st)] = {"error": f"{type(err).__name__}: {err}"}
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
