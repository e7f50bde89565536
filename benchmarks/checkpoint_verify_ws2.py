"""Checkpoint verification at world size 2: per-rank CPU seconds and wall time of
``engine.load_checkpoint`` with and without verification (ZeRO-2, fp32, Adam, a ~34M-parameter
model, one ~0.54 GB tag, files in the page cache), medians of ``RUNS`` (default 3) loads each.
Each rank checks only its share of the tag (docs/checkpoints.md), so the verification CPU per
rank is about half the tag's CRC cost.

    python benchmarks/checkpoint_verify_ws2.py [REPO_ROOT]     (RUNS=6 for more loads)

``REPO_ROOT`` (default: this checkout) lets the same script measure another tree of the package.
"""
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def body(rank, world, root, runs):
    import torch
    import torch.distributed as dist
    import deepspeed
    from _common import BenchModel
    from deepspeed.runtime.checkpoint import manifest
    torch.manual_seed(0)
    model = BenchModel(d=1024, layers=4)
    cfg = {"train_batch_size": 2, "steps_per_print": 0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    eng, *_ = deepspeed.initialize(model=model, config=cfg)
    loss = eng(torch.randn(1, 1024), torch.randn(1, 16))
    eng.backward(loss)
    eng.step()
    eng.save_checkpoint(root, tag="t")
    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    for i in range(runs + 1):
        for v in (False, True):
            manifest._verified.clear()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            with manifest.set_checkpoint_verification(v):
                eng.load_checkpoint(root, tag="t")
            if i:   # the first round is a warm-up
                cpu[v].append(time.process_time() - c0)
                wall[v].append(time.perf_counter() - t0)
    return {"cpu_verify": statistics.median(cpu[True]), "cpu_plain": statistics.median(cpu[False]),
            "wall_verify": statistics.median(wall[True]), "wall_plain": statistics.median(wall[False])}


if __name__ == "__main__":
    from tests.helpers.dist import run_distributed
    root = tempfile.mkdtemp(dir="/tmp")
    res = run_distributed(body, 2, args=(root, int(os.environ.get("RUNS", 3))), timeout=900)
    tag = os.path.join(root, "t")
    size = sum(os.path.getsize(os.path.join(tag, n)) for n in os.listdir(tag))
    print(json.dumps({"tree": ROOT, "tag_bytes": size, "load_avg": os.getloadavg()[0], "per_rank": res}))
    import shutil
    shutil.rmtree(root)
