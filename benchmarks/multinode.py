"""Multi-node on one machine: the same job over the namespace network vs on one node.

Builds the test bed of tests/multinode (network namespaces joined by a bridge, sshd in
each; needs root, ip, sshd, pdsh: ``sh tests/multinode/setup_packages.sh``) and measures,
in one run:

* ``step_time``: the median per-step time (after warm-up) of one data-parallel job (a
  ``TinyMLP`` widened to ``--hidden``, SGD, global batch 8) on 2 nodes x 1 process
  (``deepspeed --hostfile`` with pdsh, gloo over the veth/bridge network) and on
  1 node x 2 processes (gloo over loopback), and their ratio;
* ``node_loss``: an elastic job (``--elastic_training``, 2 nodes, min 1) that loses one node
  (SIGKILL of every process on it): seconds from the kill to the first step finished at the
  new world size (the agent notices the failed worker, the c10d rendezvous completes with the
  remaining node, the worker restarts, loads the latest checkpoint and trains).

Prints one JSON object. Absolute times on a shared machine are noisy; compare the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.multinode.testbed import TestBed, unavailable_reason  # noqa: E402

DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
TRAIN = os.path.join(REPO, "tests", "multinode", "train_job.py")


def _env(workdir):
    home = os.path.join(workdir, "home")
    os.makedirs(home, exist_ok=True)
    env = dict(os.environ, HOME=home, PYTHONPATH=REPO, DEEPSPEED_KILL_GRACE_S="1")
    env.pop("DS_ENV_FILE", None)
    return env


def step_time(bed, hosts, slots, args):
    """Median step time (s) of the training job on ``hosts`` x ``slots`` processes."""
    with tempfile.TemporaryDirectory() as d:
        hostfile = bed.hostfile(os.path.join(d, "hostfile"), slots=slots, hosts=hosts)
        argv = [DEEPSPEED, "--hostfile", hostfile, "--launcher", "pdsh", TRAIN, "--out", d,
                "--steps", str(args.steps + args.warmup), "--global_batch", "8", "--hidden", str(args.hidden),
                "--layers", "3"]
        res = bed.exec("worker-0", argv, cwd=d, env=_env(d), timeout=600, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"the job on {hosts} x {slots} failed:\n{(res.stdout + res.stderr)[-4000:]}")
        world = len(hosts) * slots
        recs = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
        # a step ends when the slowest rank ends it: take the per-step max over ranks
        per_step = [max(r["step_times"][s] for r in recs) for s in range(args.warmup, args.warmup + args.steps)]
        return statistics.median(per_step), sorted({r["host"] for r in recs})


def node_loss(bed):
    from tests.helpers.dist import free_port
    from tests.multinode.test_elastic_node_loss import kill_node, read_log, start_elastic_nodes, wait_for
    with tempfile.TemporaryDirectory() as d:
        procs = start_elastic_nodes(bed, d, _env(d), free_port(), steps=12, step_sleep=0.3, run_id="bench")
        try:
            wait_for(lambda: sum(r["world"] == 2 for r in read_log(d)) >= 3, 300, "3 steps at world size 2", procs)
            kill_node(bed, "worker-1")
            killed = time.time()
            code = procs["worker-0"].wait(timeout=300)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                p.wait()
        after = [r for r in read_log(d) if r["time"] > killed]
        if code != 0 or not after:
            raise RuntimeError(f"the elastic job did not resume (exit {code}): "
                               f"{open(os.path.join(d, 'worker-0.log')).read()[-4000:]}")
        return {"kill_to_first_step_at_new_world_size_s": round(after[0]["time"] - killed, 2),
                "resumed_from_step": after[0]["resumed_from"], "world_size_after": after[0]["world"],
                "gradient_accumulation_after": after[0]["gas"], "train_batch_size_after": after[0]["train_batch_size"],
                "rendezvous_conf": os.environ.get("DS_ELASTIC_RDZV_CONF") or
                "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3 (the test's)"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(json.dumps({"benchmark": "multinode", "skipped": reason}))
        return
    bed = TestBed(2).setup()
    try:
        two_nodes, hosts2 = step_time(bed, ["worker-0", "worker-1"], 1, args)
        one_node, hosts1 = step_time(bed, ["worker-0"], 2, args)
        loss = node_loss(bed)
    finally:
        bed.teardown()
    hidden = args.hidden
    n_params = (8 * hidden + hidden) + (hidden * hidden + hidden) + (hidden * 4 + 4)
    print(json.dumps({
        "benchmark": "multinode",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},
        "job": {"model": f"TinyMLP(8 -> {hidden} -> {hidden} -> 4), 3 layers", "params": n_params,
                "optimizer": "SGD", "global_batch": 8, "steps_timed": args.steps, "warmup": args.warmup,
                "backend": "gloo", "launcher": "pdsh"},
        "step_time": {"two_nodes_x1_s": round(two_nodes, 5), "two_nodes_hosts": hosts2,
                      "one_node_x2_s": round(one_node, 5), "one_node_hosts": hosts1,
                      "ratio_two_nodes_over_one_node": round(two_nodes / one_node, 3),
                      "network": "two nodes: veth pairs on a Linux bridge between network namespaces (10.77.0.0/24, MTU 1500); "
                                 "one node: loopback (MTU 65536)"},
        "node_loss": loss,
    }, indent=1))


if __name__ == "__main__":
    main()
