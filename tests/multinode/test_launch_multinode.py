"""The ``deepspeed`` launcher across real hosts (network namespaces with sshd, see
testbed.py), started on worker-0 as a user would on the head node.

* a data-parallel training job through the pdsh, ssh and OpenMPI runners ends with the
  parameters of a single-process plain PyTorch run on the same global batches, and each
  rank ran on the host the hostfile put it on, talking gloo over the namespace addresses;
* ``.deepspeed_env`` in the job directory reaches every remote rank;
* ``--master_addr`` defaults, as in DeepSpeed, to the first address ``hostname -I``
  prints on the first host (here 10.77.0.10);
* ``--num_nodes``, ``--include``, ``--exclude`` pick the hosts;
* a rank killed on a remote node brings the whole job down with a non-zero exit within
  10 s, the failing host and rank named, and no process left on any host.

``make test`` runs one training job (pdsh, 2 nodes x 1 process: ~15-25 s on 2 shared cores);
the rest (other runners, 2 x 2, host selection, failures, Ctrl-C) is marked slow.
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

TRAIN = os.path.join(REPO, "tests", "multinode", "train_job.py")
STEPS, GLOBAL_BATCH = 3, 8
MARK = "set in .deepspeed_env on the head node"


def _job_dir(tmp_path):
    (tmp_path / ".deepspeed_env").write_text(f"DS_MN_MARK={MARK}\n")
    return tmp_path


def _launch(bed, tmp_path, env, launcher, slots, *select, timeout=240):
    hostfile = bed.hostfile(str(tmp_path / "hostfile"), slots=slots)
    argv = [DEEPSPEED, "--hostfile", hostfile, "--launcher", launcher, *select,
            TRAIN, "--out", str(tmp_path), "--steps", str(STEPS), "--global_batch", str(GLOBAL_BATCH)]
    res = bed.exec("worker-0", argv, cwd=str(_job_dir(tmp_path)), env=env, timeout=timeout, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    return res


def _check_training(tmp_path, hosts, slots):
    world = len(hosts) * slots
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    ref = make_model(seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for batch in global_batches(STEPS, GLOBAL_BATCH):
        ref_losses.append(ref(*batch).item())
        reference_train(ref, opt, [batch], clip=1.0)   # the job's gradient_clipping
    for got, want in zip(recs[0]["params"], ref.parameters()):
        torch.testing.assert_close(torch.tensor(got), want.detach(), rtol=1e-5, atol=1e-6)
    # each rank's loss is its shard's mean; equal shards: their mean is the global batch's loss
    mean_losses = [sum(r["losses"][s] for r in recs) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for r, rec in enumerate(recs):
        assert rec["world"] == world and rec["rank"] == r
        assert rec["host"] == hosts[r // slots], rec        # rank r ran on its hostfile host
        assert rec["mark"] == MARK, rec                     # .deepspeed_env reached the remote side
    return recs


def test_pdsh_two_nodes_train_like_plain_pytorch(clean_bed, tmp_path, job_env):
    # three hosts in the hostfile, --num_nodes 2: the job runs on worker-0 and worker-1
    res = _launch(clean_bed, tmp_path, job_env, "pdsh", 1, "--num_nodes", "2")
    recs = _check_training(tmp_path, ["worker-0", "worker-1"], 1)
    # --master_addr defaulted to worker-0's address, found with 'hostname -I' over ssh
    assert "using IP address 10.77.0.10 of node worker-0" in res.stdout + res.stderr
    assert {r["env"]["MASTER_ADDR"] for r in recs} == {"10.77.0.10"}
    assert [r["local_rank_arg"] for r in recs] == [0, 0]
    assert not (tmp_path / "rank2.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher, slots", [("ssh", 1), ("openmpi", 1), ("pdsh", 2), ("ssh", 2), ("openmpi", 2)])
def test_runners_two_nodes_train_like_plain_pytorch(clean_bed, tmp_path, job_env, launcher, slots):
    _launch(clean_bed, tmp_path, job_env, launcher, slots, "--num_nodes", "2")
    recs = _check_training(tmp_path, ["worker-0", "worker-1"], slots)
    assert {r["env"]["MASTER_ADDR"] for r in recs} == {"10.77.0.10"}


@pytest.mark.slow
def test_include_exclude_and_master_addr(clean_bed, tmp_path, job_env):
    # --include worker-0@worker-2: ranks on those two hosts only; then --exclude worker-0 with
    # an explicit --master_addr by name (resolved on each node through its hosts file)
    _launch(clean_bed, tmp_path, job_env, "pdsh", 1, "--include", "worker-0@worker-2")
    _check_training(tmp_path, ["worker-0", "worker-2"], 1)
    for f in tmp_path.glob("rank*.json"):
        f.unlink()
    _launch(clean_bed, tmp_path, job_env, "ssh", 1, "--exclude", "worker-0", "--master_addr", "worker-1")
    recs = _check_training(tmp_path, ["worker-1", "worker-2"], 1)
    assert {r["env"]["MASTER_ADDR"] for r in recs} == {"worker-1"}


def _kill_remote_rank(bed, tmp_path, env, launcher, slots, hang_after, interrupt=False, idle="allreduce"):
    """Start a job that idles in all-reduces, SIGKILL the last rank (on worker-1) (or, with
    ``interrupt``, send SIGINT to the launcher as Ctrl-C does), and return (exit code, seconds
    from the kill to the launcher's exit, output)."""
    hostfile = bed.hostfile(str(tmp_path / "hostfile"), slots=slots, hosts=["worker-0", "worker-1"])
    argv = [DEEPSPEED, "--hostfile", hostfile, "--launcher", launcher, TRAIN, "--out", str(tmp_path),
            "--hang_after", str(hang_after), "--idle", idle]
    world = 2 * slots
    proc = bed.popen("worker-0", argv, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"ready{r}").exists() for r in range(world)):
            assert proc.poll() is None, proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, "the job did not reach its first step in 180 s"
            time.sleep(0.1)
        victim = int((tmp_path / f"ready{world - 1}").read_text())
        assert victim in bed.pids("worker-1"), "the last rank should run on worker-1"
        t0 = time.monotonic()
        if interrupt:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - t0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _check_teardown(bed, code, elapsed, out, failed_rank):
    assert code != 0, out[-6000:]
    assert elapsed < 10, f"the job took {elapsed:.1f}s to stop after the kill:\n{out[-6000:]}"
    assert f"rank {failed_rank} (local_rank " in out and "host worker-1) was killed by signal SIGKILL" in out, \
        out[-6000:]
    left = bed.wait_quiet(10)
    assert not left, f"processes left per host: {left}"


@pytest.mark.slow
def test_ssh_remote_rank_killed_stops_the_job(clean_bed, tmp_path, job_env):
    code, elapsed, out = _kill_remote_rank(clean_bed, tmp_path, job_env, "ssh", 1, hang_after=0)
    _check_teardown(clean_bed, code, elapsed, out, 1)
    assert "node 1 (worker-1) exited with code 137" in out, out[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["pdsh", "ssh", "openmpi"])
def test_remote_rank_killed_stops_the_job_2x2(clean_bed, tmp_path, job_env, launcher):
    code, elapsed, out = _kill_remote_rank(clean_bed, tmp_path, job_env, launcher, 2, hang_after=1)
    assert code != 0, out[-6000:]
    assert elapsed < 10, f"the job took {elapsed:.1f}s to stop after the kill:\n{out[-6000:]}"
    if launcher == "openmpi":     # mpirun starts the ranks itself and names the host
        assert "process rank 3" in out and "on node worker-1 exited on signal 9" in out, out[-6000:]
    else:
        _check_teardown(clean_bed, code, elapsed, out, 3)
        assert ("worker-1: ssh exited with exit code 137" if launcher == "pdsh"
                else "node 1 (worker-1) exited with code 137") in out, out[-6000:]
    left = clean_bed.wait_quiet(10)
    assert not left, f"processes left per host: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["pdsh", "ssh", "openmpi"])
def test_interrupted_launcher_leaves_nothing(clean_bed, tmp_path, job_env, launcher):
    """Ctrl-C on the head node stops every rank on every host. (pdsh cannot stop remote
    commands: the launcher then runs DeepSpeed's kill command, pkill of this job's node
    launchers through pdsh; before that fix the ranks on both hosts kept running.)"""
    code, elapsed, out = _kill_remote_rank(clean_bed, tmp_path, job_env, launcher, 1, hang_after=0, interrupt=True)
    assert code == 130, out[-6000:]                      # 128 + SIGINT
    assert "launcher received SIGINT" in out, out[-6000:]
    left = clean_bed.wait_quiet(10)
    assert not left, f"processes left per host: {left}"


@pytest.mark.slow
def test_pdsh_remote_rank_killed_while_peers_compute(clean_bed, tmp_path, job_env):
    """The surviving ranks are in no collective (they sleep), so nothing on worker-0 notices the
    loss; pdsh reports worker-1's failure and waits for worker-0. The launcher stops the job on
    that report and sweeps every host. (Before: the job ran on until worker-0's ranks ended.)"""
    code, elapsed, out = _kill_remote_rank(clean_bed, tmp_path, job_env, "pdsh", 1, hang_after=0, idle="sleep")
    _check_teardown(clean_bed, code, elapsed, out, 1)
    assert code == 137, out[-6000:]                          # worker-1's exit code, from pdsh's report
    assert "pdsh reports a failure: pdsh@worker-0: worker-1: ssh exited with exit code 137" in out, out[-6000:]
