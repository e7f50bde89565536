"""How often a finished 2-process launcher job exits 0 when the script never calls
``destroy_process_group`` (issue 12 section 4).

Runs ``deepspeed --num_gpus 2 <workload>`` ``--runs`` times in a row, with the clean-exit
hook on (default) or off (``--hook off`` sets ``DEEPSPEED_CLEAN_EXIT=0``), and prints one
JSON object: the exit codes seen, how many runs exited 0, how many printed gloo's
"terminate called without an active exception", and the wall time per run.

Workloads: ``train`` (tests/behaviours/clean_exit_train.py: ``deepspeed.initialize``, a few
ZeRO steps, return) and ``allreduce`` (tests/behaviours/clean_exit_allreduce.py: returns
right after its last collective, the race's worst case). Usage::

    python benchmarks/clean_exit.py --runs 50 --hook on
    python benchmarks/clean_exit.py --runs 50 --hook off --workload allreduce
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"train": os.path.join(ROOT, "tests", "behaviours", "clean_exit_train.py"),
           "allreduce": os.path.join(ROOT, "tests", "behaviours", "clean_exit_allreduce.py")}
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(hook: bool, stage: int = 1, timeout: float = 180.0, workload: str = "train"):
    """One launcher run; returns (exit code, combined output, seconds)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["DEEPSPEED_CLEAN_EXIT"] = "1" if hook else "0"
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(_free_port()), SCRIPTS[workload]]
    if workload == "train":
        cmd += ["--stage", str(stage)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return rc, out, time.perf_counter() - t0


def _torch_version():
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True)
    return p.stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--hook", choices=("on", "off", "alternate"), default="on",
                    help="alternate: on and off in turns, so both see the same machine load")
    ap.add_argument("--stage", type=int, default=1, help="ZeRO stage of the train workload")
    ap.add_argument("--workload", choices=sorted(SCRIPTS), default="train")
    ap.add_argument("--max_seconds", type=float, default=None,
                    help="stop starting runs after this long and report the runs done (shared machines)")
    a = ap.parse_args()
    modes = ["on", "off"] if a.hook == "alternate" else [a.hook]
    stats = {m: dict(codes=collections.Counter(), terminate=0, secs=[], failures=[]) for m in modes}
    t_start = time.perf_counter()
    for i in range(a.runs):
        if a.max_seconds is not None and time.perf_counter() - t_start > a.max_seconds:
            break
        mode = modes[i % len(modes)]
        st = stats[mode]
        rc, out, s = run_once(mode == "on", a.stage, workload=a.workload)
        st["codes"][str(rc)] += 1
        st["secs"].append(s)
        if "terminate called" in out:
            st["terminate"] += 1
        if rc != 0:
            st["failures"].append({"run": i, "rc": rc, "tail": out[-600:]})
        print(f"run {i} hook {mode}: rc={rc} {s:.1f}s" + (f"\n{out[-1500:]}" if rc != 0 else ""),
              file=sys.stderr, flush=True)
    report = {"claim": "finished 2-process launcher jobs exit 0 without destroy_process_group",
              "workload": a.workload, "zero_stage": a.stage if a.workload == "train" else None,
              "order": a.hook, "python": sys.version.split()[0], "torch": _torch_version()}
    for mode, st in stats.items():
        report[f"hook_{mode}"] = {"runs": len(st["secs"]), "exit_0": st["codes"].get("0", 0),
                                  "exit_codes": dict(st["codes"]), "terminate_called_runs": st["terminate"],
                                  "seconds_per_run_median": round(statistics.median(st["secs"]), 2)
                                  if st["secs"] else None,
                                  "first_failures": st["failures"][:3]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
