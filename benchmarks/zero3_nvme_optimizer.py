"""ZeRO stage 3 with the optimizer state on NVMe vs in host memory: peak resident memory
and step time for the same model, each mode in its own fresh process.

Model: ``--layers`` bias-free ``Linear(--dim, --dim)`` in bf16, stage 3 at one rank,
DeepSpeed's AdamW (DeepSpeedCPUAdam, the streamed step), ``--sub-group`` elements per
sub-group. Modes: ``cpu`` (offload_optimizer cpu: fp32 master + moments in memory),
``nvme`` (PipelinedOptimizerSwapper, 3 buffers), ``nvme_nopipe`` (PartitionedOptimizerSwapper,
1 buffer).

Per mode: ``peak_growth`` = peak RSS (VmHWM, reset just before ``deepspeed.initialize``)
minus RSS before it, over initialize + ``--steps`` steps; the fp32 master + Adam bytes
(12 per parameter) are printed beside it, with the engine's own accounting
(``model_state_bytes``). ``step_s``: median step time (forward+backward+step) after the
first step, with min/max. Rounds rotate the mode order so load changes hit all alike.

Usage: python benchmarks/zero3_nvme_optimizer.py [--dir /tmp] [--layers 32] [--dim 1280]
                                                 [--sub-group 4000000] [--steps 4] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc, json, os, sys, time
sys.path.insert(0, REPO)
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
import deepspeed

def rss():
    with open("/proc/self/status") as f:
        st = dict(l.split(":", 1) for l in f)
    return int(st["VmRSS"].split()[0]) * 1024, int(st["VmHWM"].split()[0]) * 1024

def run(mode, layers, dim, sub_group, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]).bfloat16()
    off = {"cpu": {"device": "cpu"},
           "nvme": {"device": "nvme", "nvme_path": PATH, "buffer_count": 3, "pipeline_read": True,
                    "pipeline_write": True},
           "nvme_nopipe": {"device": "nvme", "nvme_path": PATH, "buffer_count": 1}}[mode]
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "sub_group_size": sub_group, "offload_optimizer": off,
                                 "stage3_param_persistence_threshold": 0, "reduce_bucket_size": dim * dim,
                                 "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
                                 "stage3_prefetch_bucket_size": 0}}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss()[0]
    t0 = time.perf_counter()
    eng = deepspeed.initialize(model=model, config=cfg)[0]
    init_s = time.perf_counter() - t0
    x = torch.randn(2, dim).bfloat16()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()
        times.append(time.perf_counter() - t0)
    out = {"peak_growth": rss()[1] - base, "init_s": init_s, "step_times": times,
           "bytes": eng.strategy.model_state_bytes()}
    nv = eng.strategy.parts.nvme
    if nv is not None:
        out["swapper"] = dict(nv.swapper.stats)
    eng.destroy()
    return out

args = json.loads(sys.argv[1])
PATH = args["dir"]
run(args["mode"], 1, 64, 4096, 1)          # imports and one-time set-up out of the measurement
print(json.dumps(run(args["mode"], args["layers"], args["dim"], args["sub_group"], args["steps"])))
"""


def _child(mode, a, path):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    spec = json.dumps({"mode": mode, "dir": path, "layers": a.layers, "dim": a.dim, "sub_group": a.sub_group,
                       "steps": a.steps})
    src = CHILD.replace("REPO)", repr(REPO) + ")", 1)
    res = subprocess.run([sys.executable, "-c", src, spec], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} child failed: {res.stderr[-2000:]}")
    return json.loads(lines[-1])


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--sub-group", dest="sub_group", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    modes = ["cpu", "nvme", "nvme_nopipe"]
    runs = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(dir=a.dir) as path:
        for r in range(a.repeats):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for m in order:
                runs[m].append(_child(m, a, path))
    n = a.layers * a.dim * a.dim
    mib = 2 ** 20
    out = {"config": vars(a), "params": n, "fp32_master_plus_adam_MiB": 12 * n / mib, "modes": {}}
    for m, rs in runs.items():
        steps = [t for r in rs for t in r["step_times"][1:]]
        growth = [r["peak_growth"] / mib for r in rs]
        b = rs[0]["bytes"]
        out["modes"][m] = {
            "peak_growth_MiB": {"median": statistics.median(growth), "min": min(growth), "max": max(growth)},
            "peak_growth_over_master_plus_adam": statistics.median(growth) / (12 * n / mib),
            "grads_MiB": b["grads"] / mib, "param_partitions_MiB": b["param_partitions"] / mib,
            "swap_buffers_MiB": b.get("nvme_swap_buffers", 0) / mib,
            "step_s": {"median": statistics.median(steps), "min": min(steps), "max": max(steps)},
            "init_s": statistics.median(r["init_s"] for r in rs),
        }
        if "swapper" in rs[0]:
            sw = rs[0]["swapper"]
            out["modes"][m]["swapper_first_run"] = {k: round(v, 4) if isinstance(v, float) else v
                                                    for k, v in sw.items()}
    cpu = out["modes"]["cpu"]["step_s"]["median"]
    for m in ("nvme", "nvme_nopipe"):
        out["modes"][m]["step_time_vs_cpu"] = out["modes"][m]["step_s"]["median"] / cpu
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
