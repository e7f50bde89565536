"""Autotuning on the demo's GPT: the tuned configuration's throughput against the hand-written
``examples/ds_config.json``, both measured in this run the same way, and the tuning time.

    python benchmarks/autotuning.py [--num_procs 1] [--stages 0,1,2,3] [--max_mbs 64]

1. ``deepspeed --autotuning tune examples/train_gpt.py ...`` with the hand-written config plus an
   ``autotuning`` section (fast mode: ZeRO stage and micro-batch size); wall time = tuning time.
2. The hand-written config and ``ds_config_optimal.json`` are then run ``--repeats`` times each,
   alternating, with only the measurement on (``autotuning.enabled`` with a ``metric_path``: the
   engine times steps ``start_profile_step``..``end_profile_step`` and stops); the medians are
   compared, so load that comes and goes on a shared machine hits both alike.
Prints one JSON object: samples/s of both, the ratio, the tuning time and the experiments run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_gpt.py")
sys.path.insert(0, REPO)


def _deepspeed(args, cwd, launcher=(), timeout=3600):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *launcher, SCRIPT, "--steps", "100",
           "--out", os.path.join(cwd, "out"), "--deepspeed", *args]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def _measure(cfg: dict, name: str, work: str, launcher, start: int, end: int) -> dict:
    cfg = dict(cfg)
    metric = os.path.join(work, f"{name}_metrics.json")
    cfg["autotuning"] = {"enabled": True, "start_profile_step": start, "end_profile_step": end,
                         "metric_path": metric}
    path = os.path.join(work, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    _deepspeed(["--deepspeed_config", path], work, launcher)
    with open(metric) as f:
        return json.load(f)


def main():
    from deepspeed.config.ds_config import load_config_source
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_procs", type=int, default=1)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--max_mbs", type=int, default=64)
    ap.add_argument("--num_mbs", type=int, default=3)
    ap.add_argument("--start", type=int, default=2)
    ap.add_argument("--end", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ds_autotuning_bench_")
    launcher = ["--num_procs", str(a.num_procs)]
    hand = load_config_source(os.path.join(REPO, "examples", "ds_config.json"))
    hand["tensorboard"] = {"enabled": False}          # the measured runs write no logs
    hand["wall_clock_breakdown"] = False
    tune_cfg = dict(hand, zero_optimization={"stage": [int(s) for s in a.stages.split(",")]})
    tune_cfg["autotuning"] = {"enabled": True, "fast": True, "start_profile_step": a.start,
                              "end_profile_step": a.end, "num_tuning_micro_batch_sizes": a.num_mbs,
                              "max_train_micro_batch_size_per_gpu": a.max_mbs}
    with open(os.path.join(work, "tune.json"), "w") as f:
        json.dump(tune_cfg, f)
    t0 = time.time()
    r = _deepspeed(["--deepspeed_config", "tune.json"], work, ["--autotuning", "tune", *launcher])
    tuning_s = time.time() - t0
    res = os.path.join(work, "autotuning_results")
    with open(os.path.join(res, "ds_config_optimal.json")) as f:
        optimal = json.load(f)
    n_exps = sum(1 for d in os.listdir(res) if os.path.exists(os.path.join(res, d, "result.json")))
    runs = {"hand": [], "tuned": []}
    for i in range(a.repeats):
        runs["hand"].append(_measure(hand, f"hand{i}", work, launcher, a.start, a.end))
        runs["tuned"].append(_measure(optimal, f"tuned{i}", work, launcher, a.start, a.end))
    base, tuned = (sorted(runs[k], key=lambda m: m["throughput"])[len(runs[k]) // 2] for k in ("hand", "tuned"))
    print(json.dumps({
        "benchmark": "autotuning", "model": "examples/gpt.py GPT(ctx=128, d_model=128, n_layer=4)",
        "processes": a.num_procs, "stages": a.stages, "window_steps": [a.start, a.end],
        "hand_written": {"zero_stage": hand["zero_optimization"]["stage"],
                         "micro_batch": hand["train_micro_batch_size_per_gpu"],
                         "samples_per_s": round(base["throughput"], 2), "step_ms": round(base["latency"], 1)},
        "tuned": {"zero_stage": optimal["zero_optimization"]["stage"],
                  "micro_batch": optimal["train_micro_batch_size_per_gpu"],
                  "samples_per_s": round(tuned["throughput"], 2), "step_ms": round(tuned["latency"], 1)},
        "throughput_ratio_tuned_over_hand": round(tuned["throughput"] / base["throughput"], 3),
        "all_samples_per_s": {k: [round(m["throughput"], 2) for m in v] for k, v in runs.items()},
        "tuning_seconds": round(tuning_s, 1), "experiments": n_exps,
        "summary": open(os.path.join(res, "summary.txt")).read().splitlines()[:12],
        "workdir": work}, indent=1))
    del r


if __name__ == "__main__":
    main()
