"""Real launches: the ``deepspeed`` CLI starting ranks that all-reduce over gloo, rank
failures and signals stopping the whole node, and a two-"node" ssh launch through a
local stand-in for ssh. Every subprocess has a timeout; leftovers are killed."""
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.helpers.dist import free_port

BIN = os.path.dirname(sys.executable)
DEEPSPEED = os.path.join(BIN, "deepspeed")

ALLREDUCE = textwrap.dedent("""
    import argparse, json, os, sys
    import torch
    import torch.distributed as dist
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--use_deepspeed", action="store_true")
    a = p.parse_args()
    if a.use_deepspeed:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", init_method="env://")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE", "DS_TEST_VAR"]
    rec = dict(rank=r, world=dist.get_world_size(), sum=t.item(), local_rank_arg=a.local_rank,
               argv=sys.argv[1:], env={k: os.environ.get(k) for k in names})
    with open(os.path.join(a.out, f"rank{r}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()
""")

# Rank 1 fails (exit 1 or SIGKILL) once rank 0 is set up; rank 0 ignores SIGTERM and has
# a child of its own, so the launcher must escalate to SIGKILL and sweep the group.
FAILING = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[-2], sys.argv[-1]
    rank = int(os.environ["RANK"])
    def note(name, pid):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(str(pid))
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    if rank == 0:
        if mode != "sleep":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        note("grandchild", subprocess.Popen(["sleep", "120"]).pid)
        note("pid0", os.getpid())
        time.sleep(120)
    else:
        note("pid1", os.getpid())
        deadline = time.time() + 30
        while not os.path.exists(os.path.join(out, "pid0")) and time.time() < deadline:
            time.sleep(0.05)
        if mode == "exit1":
            sys.exit(1)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
""")


def _env(tmp_path, **extra):
    env = dict(os.environ)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), DEEPSPEED_KILL_GRACE_S="1", **extra)
    env.pop("DS_ENV_FILE", None)
    return env


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(out, names=("pid0", "pid1", "grandchild")):
    return {n: int((out / n).read_text()) for n in names if (out / n).exists()}


def _wait_for(paths, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.05)
    return False


def _cleanup(pids):
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _records(out, n):
    return sorted((json.loads((out / f"rank{r}.json").read_text()) for r in range(n)), key=lambda d: d["rank"])


def _script(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ----------------------------------------------------------------------------- happy paths
def test_cli_two_ranks_allreduce_with_local_rank(tmp_path):
    script = _script(tmp_path, "ar.py", ALLREDUCE)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / ".deepspeed_env").write_text("DS_TEST_VAR=hello world\n")
    port = free_port()
    res = subprocess.run([DEEPSPEED, "--num_procs", "2", "--master_port", str(port), script,
                          "--out", str(out), "--use_deepspeed"],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    recs = _records(out, 2)
    for r, rec in enumerate(recs):
        assert rec["world"] == 2 and rec["sum"] == 3.0  # 1 + 2
        assert rec["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": "0",
                              "CROSS_SIZE": "1", "DS_TEST_VAR": "hello world"}
        assert rec["local_rank_arg"] == r and rec["argv"][0] == f"--local_rank={r}"


def test_python_m_runner_no_local_rank(tmp_path):
    script = _script(tmp_path, "ar.py", ALLREDUCE)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    res = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                          "--master_addr", "127.0.0.1", "--master_port", str(port), script, "--out", str(out)],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for r, rec in enumerate(_records(out, 2)):
        assert rec["sum"] == 3.0 and rec["env"]["RANK"] == str(r) and rec["env"]["LOCAL_RANK"] == str(r)
        assert rec["local_rank_arg"] is None
        assert not any(x.startswith("--local_rank") for x in rec["argv"])


FAKE_SSH = """#!/bin/bash
# stand-in for ssh: run the last argument (the remote command) in a local shell
for last; do :; done
exec bash -c "$last"
"""

FAKE_PDSH = """#!/bin/bash
# stand-in for pdsh: run the command once per -w host, locally, with %n = the host's index
while [ $# -gt 0 ]; do
  case "$1" in -S) shift;; -f) shift 2;; -w) hosts="$2"; shift 2;; *) break;; esac
done
cmd="$*"; i=0; pids=()
IFS=, read -ra hs <<< "$hosts"
for h in "${hs[@]}"; do bash -c "${cmd//%n/$i}" & pids+=($!); i=$((i+1)); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


# both slow: tests/multinode runs pdsh (make test) and ssh (test-all) across real namespace hosts
@pytest.mark.parametrize("launcher", [pytest.param("ssh", marks=pytest.mark.slow), pytest.param("pdsh", marks=pytest.mark.slow)])
def test_two_nodes_through_local_stand_in(tmp_path, launcher):
    """The ssh and pdsh back-ends for real, with the tool replaced by a script that runs
    the remote command in a local shell: exercises quoting, cd, exports, node ranks and
    world info (not the network transport)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / launcher
    fake.write_text(FAKE_SSH if launcher == "ssh" else FAKE_PDSH)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("DS_TEST_VAR=it's a 'quoted' $value\n")
    script = _script(tmp_path, "ar.py", ALLREDUCE)
    out = tmp_path / "out"
    out.mkdir()
    env = _env(tmp_path)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    port = free_port()
    check = ["--no_ssh_check"] if launcher == "pdsh" else []  # the ssh stand-in also serves the check
    res = subprocess.run([DEEPSPEED, "--hostfile", "hostfile", "--launcher", launcher, *check,
                          "--master_addr", "127.0.0.1", "--master_port", str(port), "ar.py", "--out", "out"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for r, rec in enumerate(_records(out, 2)):
        assert rec["sum"] == 3.0
        assert rec["env"] == {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": str(r),
                              "CROSS_SIZE": "2", "DS_TEST_VAR": "it's a 'quoted' $value"}
        assert rec["local_rank_arg"] == 0


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("mode, how", [("exit1", "exited with code 1"),
                                       ("kill", "was killed by signal SIGKILL (9)")])
def test_failing_rank_stops_the_node(tmp_path, mode, how):
    script = _script(tmp_path, "fail.py", FAILING)
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    try:
        res = subprocess.run([DEEPSPEED, "--num_procs", "2", "--master_port", str(free_port()), script,
                              str(out), mode], cwd=tmp_path, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
        text = res.stdout + res.stderr
        assert res.returncode != 0, text
        assert f"rank 1 (local_rank 1, node 0, host localhost) {how}" in text
        assert "sending SIGKILL" in text  # rank 0 ignored SIGTERM
        assert elapsed < 10, f"launcher took {elapsed:.1f}s"
        pids = _pids(out)
        assert set(pids) == {"pid0", "pid1", "grandchild"}
        assert [n for n, p in pids.items() if _alive(p)] == []
    finally:
        _cleanup(_pids(out).values())


def test_sigterm_to_launcher_stops_every_rank(tmp_path):
    script = _script(tmp_path, "fail.py", FAILING)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([DEEPSPEED, "--num_procs", "2", "--master_port", str(free_port()), script,
                             str(out), "sleep"], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for([out / "pid0", out / "pid1", out / "grandchild"]), "ranks did not start"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        assert proc.returncode == 128 + signal.SIGTERM, text
        assert "launcher received SIGTERM" in text
        assert [n for n, p in _pids(out).items() if _alive(p)] == []
    finally:
        proc.kill()
        proc.communicate(timeout=30)
        _cleanup(_pids(out).values())


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL cannot be forwarded: the kernel (PR_SET_PDEATHSIG) must stop the ranks."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    script = _script(tmp_path, "fail.py", FAILING)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([DEEPSPEED, "--num_procs", "2", "--master_port", str(free_port()), script,
                             str(out), "sleep"], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_for([out / "pid0", out / "pid1"]), "ranks did not start"
        ranks = [int((out / n).read_text()) for n in ("pid0", "pid1")]
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while any(_alive(p) for p in ranks) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in ranks)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        _cleanup(_pids(out).values())


def test_node_launcher_stops_when_stdin_closes(tmp_path):
    """Under ssh the per-node launcher's stdin is the connection: EOF stops the node."""
    from deepspeed.launcher.hostfile import encode_world_info
    script = _script(tmp_path, "fail.py", FAILING)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.launch",
                             f"--world_info={encode_world_info({'localhost': [0, 1]})}", "--exit_on_stdin_eof",
                             f"--master_port={free_port()}", script, str(out), "sleep"],
                            cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert _wait_for([out / "pid0", out / "pid1"]), "ranks did not start"
        proc.stdin.close()
        proc.wait(timeout=30)
        text = proc.stdout.read()
        assert proc.returncode == 128 + signal.SIGTERM, text
        assert [n for n, p in _pids(out).items() if _alive(p)] == []
    finally:
        proc.kill()
        proc.wait(timeout=30)
        _cleanup(_pids(out).values())
