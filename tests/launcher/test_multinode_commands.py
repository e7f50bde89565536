"""The exact commands each multi-node back-end builds (nothing is run here), and the
per-node launcher's rank environments."""
import sys
from collections import OrderedDict

import pytest

from deepspeed.launcher import launch, runner
from deepspeed.launcher.hostfile import ResourceError, encode_world_info

PY = sys.executable


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A two-node hostfile, a home and a working directory with .deepspeed_env files,
    and a controlled environment."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (cwd / ".deepspeed_env").write_text("# per-project\nSHARED=cwd value\n")
    (cwd / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.chdir(cwd)
    environ = {"HOME": str(home), "PATH": "/usr/bin", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/opt/lib",
               "UNRELATED": "x"}
    return str(cwd), environ


def _commands(environ, *argv):
    args = runner.parse_args(["--hostfile", "hostfile", *argv, "train.py", "--lr", "0.1"])
    return runner.multinode_commands(args, environ=environ)


def _remote(cwd, node_rank, *extra, world=None):
    world = world or encode_world_info(OrderedDict([("worker-0", [0, 1]), ("worker-1", [0, 1])]))
    return (f"cd {cwd} && export NCCL_DEBUG=INFO && export PYTHONPATH={cwd}:/opt/lib && export FROM_HOME=1 "
            f"&& export SHARED='cwd value' && exec {PY} -u -m deepspeed.launcher.launch "
            f"--world_info={world} --node_rank={node_rank}{''.join(' ' + e for e in extra)} "
            f"--master_addr=worker-0 --master_port=29500 train.py --lr 0.1")


def test_pdsh_command(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "pdsh", "--launcher_args", "-R ssh -t 5")
    assert len(cmds) == 1
    assert cmds[0].argv == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh", "-t", "5",
                            _remote(cwd, "%n")]
    assert cmds[0].env["PDSH_RCMD_TYPE"] == "ssh"
    assert cmds[0].env["SHARED"] == "cwd value" and cmds[0].env["PYTHONPATH"] == f"{cwd}:/opt/lib"


def test_ssh_command_one_per_node(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "ssh", "--ssh_port", "2222", "--master_port", "29500")
    assert [c.label for c in cmds] == ["node 0 (worker-0)", "node 1 (worker-1)"]
    for rank, (c, host) in enumerate(zip(cmds, ["worker-0", "worker-1"])):
        assert c.argv == ["ssh", "-o", "BatchMode=yes", "-p", "2222", host,
                          _remote(cwd, rank, "--exit_on_stdin_eof")]
        assert c.stdin_pipe  # the remote launcher stops when this pipe closes


def test_ssh_flags_reach_the_node_launcher(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "ssh", "--no_local_rank", "--master_addr", "10.0.0.1",
                        "--num_gpus", "1")
    remote = cmds[1].argv[-1]
    world = encode_world_info(OrderedDict([("worker-0", [0]), ("worker-1", [0])]))
    assert f"--world_info={world} --node_rank=1 --exit_on_stdin_eof --master_addr=10.0.0.1 " \
           f"--master_port=29500 --no_local_rank train.py --lr 0.1" in remote


def test_openmpi_command(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "openmpi", "--launcher_args", "--mca btl ^openib")
    # DeepSpeed's defaults: TCP on eth0 (the user set btl, so it is not repeated), UCX_TLS=tcp
    assert cmds[0].argv == [
        "mpirun", "-n", "4", "-H", "worker-0:2,worker-1:2", "-wdir", cwd,
        "--mca", "btl_tcp_if_include", "eth0", "--mca", "btl", "^openib",
        "-x", "NCCL_DEBUG=INFO", "-x", f"PYTHONPATH={cwd}:/opt/lib", "-x", "FROM_HOME=1",
        "-x", "SHARED=cwd value", "-x", "UCX_TLS=tcp", "-x", "MASTER_ADDR=worker-0", "-x", "MASTER_PORT=29500",
        PY, "-u", "train.py", "--lr", "0.1"]
    # a NIC named by the user replaces the eth0 default; -mca and --mca both count
    for flag in ("-mca", "--mca"):
        r, cmds = _commands(environ, "--launcher", "openmpi", "--launcher_args", f"{flag} btl_tcp_if_include eth1")
        argv = cmds[0].argv
        assert "eth0" not in argv and argv[argv.index("eth1") - 2:argv.index("eth1") + 1] == \
            [flag, "btl_tcp_if_include", "eth1"]
        assert argv[7:10] == ["--mca", "btl", "^openib"]


def test_get_cmd_has_deepspeeds_shapes(job):
    """DeepSpeed's get_cmd: PDSH returns (cmd, kill_cmd, env); MPI/Slurm/MVAPICH one argv list."""
    from deepspeed.launcher import multinode_runner as mn
    cwd, environ = job
    args = runner.parse_args(["train.py"])
    pool = {"worker-0": 4, "worker-1": 4}
    world = encode_world_info(pool)
    cmd, kill, env = mn.PDSHRunner(args, world).get_cmd(dict(environ), pool)
    assert cmd[0] == "pdsh" and env["PDSH_RCMD_TYPE"] == "ssh" and kill[0] == "pdsh"
    escaped = world.replace("+", "\\+")      # an extended regex: base64's '+' escaped
    assert kill[-1] == f"pkill -f '[d]eepspeed\\.launcher\\.launch --world_info={escaped}'"
    for cls, head in ((mn.OpenMPIRunner, "mpirun"), (mn.MPICHRunner, "mpirun"), (mn.SlurmRunner, "srun"),
                      (mn.MVAPICHRunner, "mpirun")):
        got = cls(args, world, pool).get_cmd(dict(environ), pool)
        assert isinstance(got, list) and got[0] == head and all(isinstance(x, str) for x in got), cls
    mv = mn.MVAPICHRunner(args, world, pool).get_cmd(dict(environ), pool)
    assert mv[:7] == ["mpirun", "-np", "8", "-ppn", "4", "--hostfile", mn.MVAPICH_TMP_HOSTFILE]
    assert "MV2_SMP_USE_CMA=0" in mv
    with open(mn.MVAPICH_TMP_HOSTFILE) as f:
        assert f.read() == "worker-0\nworker-1\n"
    # a runner built with an unreadable world info only fails when it must build a command
    bad = mn.PDSHRunner(args, "not-base64")
    bad.add_export("A", "1")
    with pytest.raises(ResourceError, match="--world_info"):
        bad.node_commands(dict(environ))


def test_mpich_command(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "mpich", "--include", "worker-1@worker-0:0,1",
                        "--master_addr", "head")
    assert cmds[0].argv == [
        "mpirun", "-n", "4", "-hosts", "worker-0:2,worker-1:2", "-wdir", cwd,
        "-genv", "NCCL_DEBUG", "INFO", "-genv", "PYTHONPATH", f"{cwd}:/opt/lib", "-genv", "FROM_HOME", "1",
        "-genv", "SHARED", "cwd value", "-genv", "MASTER_ADDR", "head", "-genv", "MASTER_PORT", "29500",
        PY, "-u", "train.py", "--lr", "0.1"]


def test_slurm_command(job):
    cwd, environ = job
    r, cmds = _commands(environ, "--launcher", "slurm", "--num_gpus", "1", "--module",
                        "--launcher_args=--partition=gpu")
    assert cmds[0].argv == [
        "srun", "-n", "2", "--nodes", "2", "--ntasks-per-node", "1", "--nodelist", "worker-0,worker-1",
        "--chdir", cwd, "--export=ALL,NCCL_DEBUG,PYTHONPATH,FROM_HOME,SHARED,MASTER_ADDR,MASTER_PORT",
        "--partition=gpu", PY, "-u", "-m", "train.py", "--lr", "0.1"]
    env = cmds[0].env  # srun takes the values of the names in --export from its environment
    assert (env["SHARED"], env["FROM_HOME"], env["MASTER_ADDR"], env["MASTER_PORT"]) == \
        ("cwd value", "1", "worker-0", "29500")


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "slurm"])
def test_mpi_style_launchers_refuse_specific_slots(job, launcher):
    cwd, environ = job
    with pytest.raises(ResourceError, match=rf"--launcher {launcher} cannot use slots \[1\] on host 'worker-0'"):
        _commands(environ, "--launcher", launcher, "--include", "worker-0:1@worker-1:0")


def test_slurm_refuses_uneven_nodes(job):
    cwd, environ = job
    with pytest.raises(ResourceError, match="same number of slots on every node, got worker-0=1, worker-1=2"):
        _commands(environ, "--launcher", "slurm", "--include", "worker-0:0@worker-1")


def test_unknown_launcher_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(["--launcher", "carrier-pigeon", "train.py"])
    assert "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- node launcher
def test_rank_environments_second_node():
    world = OrderedDict([("a", [0, 1, 2]), ("b", [0, 1])])
    envs = launch.rank_environments(world, 1, "10.1.1.1", 1234, {"KEEP": "me"})
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("3", "0"), ("4", "1")]
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["CROSS_RANK"], e["CROSS_SIZE"]) == ("5", "2", "1", "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["KEEP"]) == ("10.1.1.1", "1234", "me")
    with pytest.raises(ResourceError, match="--node_rank 2 is out of range"):
        launch.rank_environments(world, 2, "x", 1, {})


def test_cuda_visible_devices_follow_chosen_slots():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.accelerator.real_accelerator import set_accelerator
    previous = get_accelerator()
    set_accelerator(CUDA_Accelerator())  # builds env only; needs no GPU
    try:
        envs = launch.rank_environments(OrderedDict(h=[1, 3]), 0, "127.0.0.1", 1, {})
    finally:
        set_accelerator(previous)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "1,3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]


def test_slots_index_into_an_existing_cuda_visible_devices():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.accelerator.real_accelerator import set_accelerator
    previous = get_accelerator()
    set_accelerator(CUDA_Accelerator())
    try:
        envs = launch.rank_environments(OrderedDict(h=[1, 3]), 0, "127.0.0.1", 1,
                                        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
        assert envs[0]["CUDA_VISIBLE_DEVICES"] == "5,7"
        with pytest.raises(ResourceError, match=r"slot\(s\) \[2\] do not exist: CUDA_VISIBLE_DEVICES='4,5'"):
            launch.rank_environments(OrderedDict(h=[0, 2]), 0, "127.0.0.1", 1, {"CUDA_VISIBLE_DEVICES": "4,5"})
    finally:
        set_accelerator(previous)


def test_rank_commands():
    p = launch.build_parser()
    a = p.parse_args(["--world_info=x", "train.py", "--lr", "1"])
    assert launch.rank_command(a, 1) == [PY, "-u", "train.py", "--local_rank=1", "--lr", "1"]
    a = p.parse_args(["--world_info=x", "--no_local_rank", "--module", "pkg.train", "--lr", "1"])
    assert launch.rank_command(a, 1) == [PY, "-u", "-m", "pkg.train", "--lr", "1"]
    a = p.parse_args(["--world_info=x", "--no_python", "./run.sh"])
    assert launch.rank_command(a, 0) == ["./run.sh", "--local_rank=0"]


def test_master_addr_default_is_first_hosts_hostname_i(tmp_path, monkeypatch):
    """DeepSpeed's default --master_addr: the first word 'ssh <first host> hostname -I' prints
    (a stand-in ssh here; the real one runs in tests/multinode); no address: a clear error."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\n"
                              "[ \"$FAKE_SSH_FAIL\" = 1 ] && { echo 'no route to host' >&2; exit 255; }\n"
                              "echo '10.1.2.3 172.17.0.1 '\n")
    (fake / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")
    args = runner.parse_args(["--ssh_port", "2222", "train.py"])
    assert runner.first_host_address(args, "worker-0") == "10.1.2.3"
    assert (fake / "args").read_text().split() == ["-p", "2222", "worker-0", "hostname", "-I"]
    monkeypatch.setenv("FAKE_SSH_FAIL", "1")
    with pytest.raises(ResourceError, match="worker-0 hostname -I' failed: no route to host; pass --master_addr"):
        runner.first_host_address(args, "worker-0")


def test_pdsh_reported_host_failure_stops_the_job(tmp_path, capfd):
    """pdsh waits for every host; its 'pdsh@head: host: ssh exited with exit code N' line on
    stderr stops the job at once (the rest of the job, here a 'sleep', is stopped) with that code,
    and the line is still shown. Lines that report nothing do nothing."""
    import logging
    import time

    from deepspeed.launcher import multinode_runner as mn
    from deepspeed.launcher.supervisor import Member, Supervisor
    assert mn.pdsh_host_failure("pdsh@worker-0: worker-1: ssh exited with exit code 137") == 137
    assert mn.pdsh_host_failure("pdsh@worker-0: worker-1: ssh exited with exit code 0") is None
    assert mn.pdsh_host_failure("worker-1: ... exited with exit code 1") is None
    cmd = mn.PDSHRunner(runner.parse_args(["train.py"]), encode_world_info({"a": 1, "b": 1})).node_commands({})[0]
    assert cmd.stderr_failure is mn.pdsh_host_failure
    script = ("echo 'worker-0: still training' >&2; sleep 0.2; "
              "echo 'pdsh@head: worker-1: ssh exited with exit code 9' >&2; exec sleep 30")
    member = Member("pdsh", ["sh", "-c", script], stderr_failure=mn.pdsh_host_failure)
    t0 = time.monotonic()
    code = Supervisor([member], logging.getLogger("test"), grace_s=1).run()
    assert code == 9 and time.monotonic() - t0 < 5
    err = capfd.readouterr().err
    assert "worker-0: still training" in err and "worker-1: ssh exited with exit code 9" in err
