"""Elastic training across two namespace hosts that loses one of them mid-training.

``deepspeed --elastic_training --no_ssh --node_rank i --min_elastic_nodes 1
--max_elastic_nodes 2`` runs on worker-0 and worker-1 (one worker each; the rendezvous
store with node 0). After a few steps at world size 2, every process on worker-1 is
SIGKILLed (the node is gone). worker-0's agent restarts its worker at world size 1; the
job resumes from the latest checkpoint and finishes with exit code 0. Checked against an
uninterrupted single-process plain PyTorch run on the same global batches: every step's
loss (before and after the loss of the node) and the final parameters; the global batch
stays 8 (2 x 4 x 1 before, 1 x 4 x 2 after: the ``elasticity`` section's choice).

The second test is the other direction: a node joins a running job, which grows to world
size 2 from the latest checkpoint.

(tests/elasticity covers compute_elastic_config, the engine's elastic batch sizes and a
one-node worker restart; this is the multi-host case.)
"""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.helpers.models import global_batches, make_model, reference_train
from tests.multinode.conftest import DEEPSPEED, REPO

JOB = os.path.join(REPO, "tests", "multinode", "elastic_job.py")
STEPS = 10
# Short rendezvous waits: a round with enough nodes waits 2 s for more; a node whose
# heartbeat (every 1 s) is missing 3 times is dead. (torch's defaults: 30 s, 5 s x 3.)
# Resuming with another gradient accumulation (world size 2 -> 1: 1 -> 2 steps) must start a
# fresh accumulation window (load_checkpoint recomputes micro_steps then; it once restored the
# saved count and the first resumed step updated after one micro-batch).
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def start_elastic_nodes(bed, workdir, env, port, steps=STEPS, step_sleep=0.5, run_id="node-loss",
                        hosts=("worker-0", "worker-1")):
    """Start one elastic agent on each of ``hosts`` (of the job's two, worker-0 and worker-1);
    returns {host: Popen}."""
    hostfile = bed.hostfile(os.path.join(workdir, "hostfile"), slots=1, hosts=["worker-0", "worker-1"])
    env = dict(env, DS_ELASTIC_RDZV_CONF=RDZV_CONF, ELASTIC_RUN_ID=run_id)
    procs = {}
    for i, h in enumerate(["worker-0", "worker-1"]):
        if h not in hosts:
            continue
        argv = [DEEPSPEED, "--hostfile", hostfile, "--elastic_training", "--no_ssh", "--node_rank", str(i),
                "--master_addr", "worker-0", "--master_port", str(port), "--min_elastic_nodes", "1",
                "--max_elastic_nodes", "2", JOB, "--out", workdir, "--ckpt", os.path.join(workdir, "ckpt"),
                "--steps", str(steps), "--step_sleep", str(step_sleep)]
        procs[h] = bed.popen(h, argv, cwd=workdir, env=env, stdout=open(os.path.join(workdir, f"{h}.log"), "w"),
                             stderr=subprocess.STDOUT)
    return procs


def read_log(workdir):
    path = os.path.join(workdir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(predicate, timeout, what, procs=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if procs:
            for h, p in procs.items():
                assert p.poll() is None, f"the agent on {h} exited early ({p.returncode})"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def kill_node(bed, host):
    """The node is lost: SIGKILL every process on it (its agent and its workers)."""
    for pid in bed.job_pids(host):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_nodes(procs):
    """Kill whatever node agents are still running (their process groups) and reap them all."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def check_against_reference(log, final_path, steps):
    """Every step ran, each logged loss is the uninterrupted plain run's (a re-run step repeats it),
    and the final parameters are that run's."""
    ref_losses, ref_params = reference_losses_and_params(steps)
    assert sorted({r["step"] for r in log}) == list(range(steps))
    for r in log:
        assert r["loss"] == pytest.approx(ref_losses[r["step"]], rel=1e-5, abs=1e-6), r
    final = torch.load(final_path)
    for got, want in zip(final, ref_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def reference_losses_and_params(steps):
    ref = make_model(seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for batch in global_batches(steps, 8):
        losses.append(ref(*batch).item())
        reference_train(ref, opt, [batch], clip=1.0)      # the job's gradient_clipping
    return losses, [q.detach() for q in ref.parameters()]


@pytest.mark.slow
def test_elastic_job_survives_node_loss(clean_bed, tmp_path, job_env):
    from tests.helpers.dist import free_port
    workdir = str(tmp_path)
    procs = start_elastic_nodes(clean_bed, workdir, job_env, free_port())
    try:
        wait_for(lambda: sum(r["world"] == 2 for r in read_log(workdir)) >= 3, 240,
                 "3 steps at world size 2", procs)
        before = read_log(workdir)
        kill_node(clean_bed, "worker-1")
        killed_at = time.time()
        assert procs["worker-0"].wait(timeout=240) == 0, open(os.path.join(workdir, "worker-0.log")).read()[-6000:]
    finally:
        stop_nodes(procs)
    log = read_log(workdir)
    after = [r for r in log if r["time"] > killed_at]
    check_against_reference(log, os.path.join(workdir, "final.pt"), STEPS)
    # the global batch is kept; the elastic config picks micro 4 and the accumulation per world size
    assert {(r["train_batch_size"], r["micro"]) for r in log} == {(8, 4)}
    assert {(r["world"], r["gas"]) for r in before} >= {(2, 1)}
    assert after and {(r["world"], r["gas"]) for r in after} == {(1, 2)}
    # resumed from the latest checkpoint (saved before each step is logged), not from scratch
    # (a step's checkpoint is written just before its log line: the latest one at the kill is
    # the last logged step's, or the next step's if the kill fell between the two)
    first = after[0]
    last_logged = max(r["step"] for r in log if r["time"] <= killed_at)
    assert first["restart"] > max(r["restart"] for r in before)
    assert first["resumed_from"] == first["step"]
    assert last_logged + 1 <= first["resumed_from"] <= last_logged + 2, (last_logged, first)


@pytest.mark.slow
def test_elastic_job_grows_when_a_node_joins(clean_bed, tmp_path, job_env):
    """The other direction: worker-0 trains alone (world size 1, 2 accumulation steps); worker-1's
    agent joins mid-training; both restart their workers from the latest checkpoint at world
    size 2 (1 accumulation step, global batch still 8) and finish, with the losses and final
    parameters of the uninterrupted plain PyTorch run."""
    from tests.helpers.dist import free_port
    workdir, port, steps = str(tmp_path), free_port(), 16
    # a second per step: time for worker-1's agent to start and join while worker-0 trains
    start = dict(steps=steps, step_sleep=1.0, run_id="node-join")
    procs = start_elastic_nodes(clean_bed, workdir, job_env, port, hosts=("worker-0",), **start)
    try:
        wait_for(lambda: sum(r["world"] == 1 for r in read_log(workdir)) >= 3, 240, "3 steps at world size 1", procs)
        joined_at = time.time()
        procs.update(start_elastic_nodes(clean_bed, workdir, job_env, port, hosts=("worker-1",), **start))
        for h, p in procs.items():
            assert p.wait(timeout=240) == 0, open(os.path.join(workdir, f"{h}.log")).read()[-6000:]
    finally:
        stop_nodes(procs)
    log = read_log(workdir)
    check_against_reference(log, os.path.join(workdir, "final.pt"), steps)
    before = [r for r in log if r["time"] <= joined_at]
    after = [r for r in log if r["time"] > joined_at and r["world"] == 2]
    assert before and {(r["world"], r["gas"], r["train_batch_size"]) for r in before} == {(1, 2, 8)}
    assert after and {(r["gas"], r["train_batch_size"]) for r in after} == {(1, 8)}
    assert after[0]["resumed_from"] == after[0]["step"] >= 3
    # (a membership change restarts the workers without counting a failure: the restart count stays)
