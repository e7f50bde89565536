"""The ``deepspeed`` (alias ``ds``) command.

``deepspeed [launcher options] script.py [script args]`` finds the resources (a
hostfile, default ``/job/hostfile``; without one, this machine's devices — on CPU one
process unless ``--num_procs``/``--num_gpus`` says more), narrows them with
``--include``/``--exclude`` or ``--num_nodes``/``--num_gpus``, and then:

* one node: runs the per-node launcher (:mod:`deepspeed.launcher.launch`) in this
  process, so signals to ``deepspeed`` reach every rank directly;
* several nodes (or ``--force_multi``): builds the command of the chosen back-end
  (:mod:`deepspeed.launcher.multinode_runner`) and supervises it.

Variables from ``.deepspeed_env`` (home directory, then the current directory, the
latter winning; or the file named by ``DS_ENV_FILE``) and variables whose names start
with NCCL/PYTHON/MV2/UCX/... are exported to every rank.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from typing import Dict, List, Optional

from .constants import (DEEPSPEED_ENVIRONMENT_FILE_VAR, DEEPSPEED_ENVIRONMENT_NAME, DEFAULT_MASTER_ADDR,
                        EXPORT_ENV_PREFIXES, MULTINODE_LAUNCHERS, PDSH_LAUNCHER, SSH_LAUNCHER,
                        TORCH_DISTRIBUTED_DEFAULT_PORT)
from .hostfile import (ResourceError, encode_world_info, fetch_hostfile, pool_from_slot_counts,
                       select_resources)

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "parse_args", "build_parser", "read_env_file",
           "load_deepspeed_env", "collect_exports", "resolve_resources", "multinode_commands"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepspeed", description="Launch a DeepSpeed training script on one or more nodes.")
    p.add_argument("-H", "--hostfile", default=None,
                   help="file of 'hostname slots=N' lines (default: /job/hostfile when it exists, "
                        "else this machine only)")
    p.add_argument("-i", "--include", default="",
                   help="use only these resources, e.g. 'worker-0:0,1@worker-1' ('localhost' without "
                        "a hostfile)")
    p.add_argument("-e", "--exclude", default="", help="use everything except these resources (same syntax)")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_gpus", type=int, default=-1,
                   help="processes per node (GPUs per node; on CPU the number of processes)")
    p.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT,
                   help="port of the rank-0 rendezvous (default 29500)")
    p.add_argument("--master_addr", default="",
                   help="address of the rank-0 node (default 127.0.0.1; multi-node: the first address "
                        "'hostname -I' prints on the first host, asked over ssh)")
    p.add_argument("--launcher", default=PDSH_LAUNCHER, choices=MULTINODE_LAUNCHERS,
                   help="multi-node back-end (default pdsh)")
    p.add_argument("--launcher_args", default="", help="extra arguments for the back-end, one quoted string")
    p.add_argument("--force_multi", action="store_true",
                   help="use the multi-node back-end even for a single node")
    p.add_argument("--no_ssh", action="store_true",
                   help="start only this node's ranks (every node runs deepspeed itself); needs --node_rank")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the ssh reachability check")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for pdsh/ssh")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--module", action="store_true", help="run user_script as a module (python -m)")
    g.add_argument("--no_python", action="store_true", help="run user_script directly, without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="write each rank's output to DIR/rank<N>.log")
    p.add_argument("--autotuning", default="", choices=["tune", "run"],
                   help="run the autotuner (deepspeed.autotuning) first: 'tune' writes the best configuration to "
                        "the autotuning results_dir, 'run' then trains with it")
    p.add_argument("--elastic_training", action="store_true",
                   help="run this node's ranks under torch.distributed.elastic (deepspeed.elasticity): failed "
                        "workers restart, nodes may leave or join between --min/--max_elastic_nodes")
    p.add_argument("--min_elastic_nodes", type=int, default=-1,
                   help="elastic training: fewest nodes to run on (default 1)")
    p.add_argument("--max_elastic_nodes", type=int, default=-1,
                   help="elastic training: most nodes to run on (default: the nodes in use)")
    p.add_argument("user_script", help="the training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")
    return p


def parse_args(args: Optional[List[str]] = None):
    return build_parser().parse_args(args)


# --------------------------------------------------------------------------- environment
def read_env_file(path: str) -> "OrderedDict[str, str]":
    """``NAME=VALUE`` lines (blank lines and ``#`` comments allowed); errors name file:line."""
    out: "OrderedDict[str, str]" = OrderedDict()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as err:
        raise ResourceError(f"cannot read {path!r}: {err.strerror or err}") from None
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _ENV_NAME.match(name):
            raise ResourceError(f"{path}:{lineno}: expected NAME=VALUE with a valid variable name, "
                                f"got {raw.strip()!r}")
        out[name] = value.strip()
    return out


def load_deepspeed_env(search_dirs=None, environ=None) -> "OrderedDict[str, str]":
    """Variables from ``.deepspeed_env`` files; ``DS_ENV_FILE`` names one explicitly."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(DEEPSPEED_ENVIRONMENT_FILE_VAR)
    if explicit:
        if not os.path.isfile(explicit):
            raise ResourceError(f"{DEEPSPEED_ENVIRONMENT_FILE_VAR}={explicit!r} does not exist")
        return read_env_file(explicit)
    if search_dirs is None:
        search_dirs = (environ.get("HOME") or os.path.expanduser("~"), ".")
    out: "OrderedDict[str, str]" = OrderedDict()
    seen = set()
    for d in search_dirs:
        path = os.path.abspath(os.path.join(d, DEEPSPEED_ENVIRONMENT_NAME))
        if path not in seen and os.path.isfile(path):
            seen.add(path)
            out.update(read_env_file(path))
    return out


def collect_exports(environ: Dict[str, str], env_file_vars: Dict[str, str]) -> "OrderedDict[str, str]":
    """What every remote rank must see: prefixed variables, then the env-file ones."""
    out: "OrderedDict[str, str]" = OrderedDict(
        (k, environ[k]) for k in sorted(environ) if k.startswith(EXPORT_ENV_PREFIXES))
    out.update(env_file_vars)
    return out


def job_environment(environ: Dict[str, str], env_file_vars: Dict[str, str], cwd: str) -> Dict[str, str]:
    """This process's environment plus the cwd on PYTHONPATH and the env-file variables."""
    env = dict(environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = cwd + (os.pathsep + old if old else "")
    env.update(env_file_vars)
    return env


# --------------------------------------------------------------------------- resources
def _local_pool(num_gpus: int) -> "OrderedDict[str, List[int]]":
    from ..accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        # On CPU a slot is a process; its count is what the user asks for (default 1).
        count = num_gpus if num_gpus > 0 else 1
    else:
        count = acc.device_count()
        if count < 1:
            raise ResourceError(f"no {acc.device_name()} devices are visible on this machine; set "
                                "DS_ACCELERATOR=cpu to run on CPU")
    return OrderedDict(localhost=list(range(count)))


def resolve_resources(args) -> "OrderedDict[str, List[int]]":
    """The active resources (host -> slot ids) for these arguments."""
    hosts = fetch_hostfile(args.hostfile)
    pool = pool_from_slot_counts(hosts) if hosts is not None else _local_pool(args.num_gpus)
    active = select_resources(pool, include=args.include, exclude=args.exclude,
                              num_nodes=args.num_nodes, num_gpus=args.num_gpus)
    if not active:
        raise ResourceError(f"--exclude {args.exclude!r} removes every slot; nothing is left to run on")
    return active


# --------------------------------------------------------------------------- running
def _launch_locally(args, world_info: str, node_rank: int, env: Dict[str, str]) -> int:
    from . import launch
    port = args.master_port
    if port == 0:  # one node: 0 means "any free port"
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    argv = [f"--world_info={world_info}", f"--node_rank={node_rank}",
            f"--master_addr={args.master_addr}", f"--master_port={port}"]
    for flag in ("no_local_rank", "module", "no_python"):
        if getattr(args, flag):
            argv.append(f"--{flag}")
    if args.enable_each_rank_log:
        argv.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    largs = launch.build_parser().parse_args(argv + [args.user_script] + list(args.user_args))
    return launch.run(largs, base_env=env)


def _check_ssh(args, host: str) -> None:
    cmd = ["ssh", "-o", "BatchMode=yes"] + (["-p", str(args.ssh_port)] if args.ssh_port else []) + [host, "hostname"]
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ResourceError(f"cannot reach {host!r} with passwordless ssh ({err}); set up ssh keys "
                            "or pass --no_ssh_check") from None
    if res.returncode != 0:
        raise ResourceError(f"cannot reach {host!r} with passwordless ssh: {res.stderr.strip() or res.returncode}; "
                            "set up ssh keys or pass --no_ssh_check")


def first_host_address(args, host: str) -> str:
    """DeepSpeed's default ``--master_addr`` for a multi-node job: the first address that
    ``hostname -I`` prints on the first host, asked over ssh."""
    cmd = ["ssh"] + (["-p", str(args.ssh_port)] if args.ssh_port else []) + [host, "hostname -I"]
    hint = "; pass --master_addr=<address of the first node> instead"
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ResourceError(f"cannot find the master address: 'ssh {host} hostname -I' failed ({err}){hint}") from None
    addrs = res.stdout.split()
    if res.returncode != 0 or not addrs:
        raise ResourceError(f"cannot find the master address: 'ssh {host} hostname -I' "
                            f"{'printed no address' if res.returncode == 0 else 'failed: ' + res.stderr.strip()}"
                            f"{hint}")
    return addrs[0]


def multinode_commands(args, environ: Optional[Dict[str, str]] = None):
    """Everything a multi-node launch would run, without running it.

    Returns ``(runner, commands)``; ``environ`` defaults to this process's environment.
    """
    from .multinode_runner import get_runner
    environ = dict(os.environ if environ is None else environ)
    active = resolve_resources(args)
    env_file_vars = load_deepspeed_env(environ=environ)
    env = job_environment(environ, env_file_vars, os.path.abspath(os.getcwd()))
    args.master_addr = args.master_addr or next(iter(active))
    runner = get_runner(args.launcher, args, encode_world_info(active), active,
                        collect_exports(env, env_file_vars))
    return runner, runner.node_commands(env)


def _launch_multinode(args) -> int:
    from ..utils.logging import logger
    from .supervisor import Member, Supervisor
    first = next(iter(resolve_resources(args)))
    if args.launcher in (PDSH_LAUNCHER, SSH_LAUNCHER) and not args.no_ssh_check:
        _check_ssh(args, first)
    if not args.master_addr:
        args.master_addr = first_host_address(args, first)
        logger.info(f"using IP address {args.master_addr} of node {first} as --master_addr")
    runner, cmds = multinode_commands(args)
    if not runner.backend_exists():
        raise ResourceError(f"--launcher {args.launcher} needs {runner.tool!r}, which is not on PATH; "
                            f"install it or choose another of {', '.join(MULTINODE_LAUNCHERS)}")
    for c in cmds:
        logger.info(f"{c.label}: {shlex.join(c.argv)}")
    members = [Member(label=c.label, argv=c.argv, env=c.env, stdin_pipe=c.stdin_pipe,
                      stderr_failure=c.stderr_failure) for c in cmds]
    code = Supervisor(members, logger).run()
    if code != 0 and hasattr(runner, "kill_command"):
        _sweep_nodes(runner.kill_command(), cmds[0].env, logger)
    return code


def _sweep_nodes(kill_cmd: List[str], env: Dict[str, str], logger) -> None:
    """After a failed or interrupted pdsh job: stop this job's node launchers on every host
    (DeepSpeed's kill_cmd). Stopping pdsh does not stop the remote commands; each node
    launcher stops its ranks on SIGTERM."""
    logger.info(f"stopping this job's node launchers on every host: {shlex.join(kill_cmd)}")
    try:
        subprocess.run(kill_cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        logger.error(f"could not run {kill_cmd[0]!r} to stop the node launchers: {err}")


def _launch_elastic(args, active) -> int:
    """``--elastic_training``: this node's ranks under torch.distributed.elastic's agent
    (deepspeed.elasticity.elastic_launch). One ``deepspeed`` per node, as with torchrun: with
    several hosts, start it on each with ``--no_ssh --node_rank``."""
    if len(active) > 1 and not args.no_ssh:
        raise ResourceError("--elastic_training starts one elastic agent per node: run 'deepspeed --elastic_training "
                            "--no_ssh --node_rank=<i> --master_addr=<rendezvous host> ...' on each node")
    if args.no_ssh and args.node_rank < 0:
        raise ResourceError("--no_ssh needs --node_rank (this node's index in the hostfile)")
    if len(active) > 1 and not args.master_addr:
        raise ResourceError("--elastic_training with several nodes needs --master_addr (the rendezvous host)")
    args.master_addr = args.master_addr or DEFAULT_MASTER_ADDR
    from ..elasticity.elastic_launch import run_elastic
    env = job_environment(os.environ, load_deepspeed_env(), os.path.abspath(os.getcwd()))
    node = list(active)[max(args.node_rank, 0)]
    return run_elastic(args, len(active[node]), len(active), env)


def run(args) -> int:
    """Resolve the resources and start the job; returns the exit code."""
    from ..utils.logging import logger
    active = resolve_resources(args)
    logger.info(f"active resources: {dict(active)}")
    if getattr(args, "autotuning", ""):
        from ..autotuning.autotuner import run_autotuning
        return run_autotuning(args, active)
    if getattr(args, "elastic_training", False):
        return _launch_elastic(args, active)
    if args.node_rank >= 0 and not args.no_ssh:
        raise ResourceError("--node_rank is only used with --no_ssh")
    if args.no_ssh or (len(active) == 1 and not args.force_multi):
        if args.no_ssh and args.node_rank < 0:
            raise ResourceError("--no_ssh needs --node_rank (this node's index in the hostfile)")
        if len(active) > 1 and not args.master_addr:
            raise ResourceError("--no_ssh with several nodes needs --master_addr (the rank-0 node)")
        args.master_addr = args.master_addr or DEFAULT_MASTER_ADDR
        if not (args.module or args.no_python) and not os.path.isfile(args.user_script):
            raise ResourceError(f"user_script {args.user_script!r} does not exist (looked in {os.getcwd()})")
        env_file_vars = load_deepspeed_env()
        env = job_environment(os.environ, env_file_vars, os.path.abspath(os.getcwd()))
        return _launch_locally(args, encode_world_info(active), max(args.node_rank, 0), env)
    return _launch_multinode(args)


def main(args: Optional[List[str]] = None) -> int:
    """The ``deepspeed`` command. Called with ``args`` (a program driving the launcher), a bad
    resource request raises, as DeepSpeed's ``runner.main`` does (``ResourceError`` is a
    ``ValueError``); from the command line (``args`` None) it is printed and the exit code is 2."""
    parsed = parse_args(args)
    if args is not None:
        return run(parsed)
    try:
        code = run(parsed)
    except ResourceError as err:
        print(f"deepspeed: error: {err}", file=sys.stderr)
        return 2
    if code != 0:
        _leave_now(code)
    return code


def _leave_now(code: int) -> None:
    """The job failed and every rank is gone: exit without interpreter finalization, which
    with torch loaded takes seconds on a busy machine (a job should be down within ~2 s of a
    rank's failure, e.g. a collective timeout). Output is flushed first."""
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------- DeepSpeed's helper names
def _parse_hostfile(hostfile_lines) -> "OrderedDict[str, int]":
    """DeepSpeed's name: hostfile lines -> ``{host: slot count}``."""
    from .hostfile import parse_hostfile_lines
    return parse_hostfile_lines(hostfile_lines)


def parse_resource_filter(host_info, include_str: str = "", exclude_str: str = "") -> "OrderedDict[str, List[int]]":
    """DeepSpeed's signature: narrow ``host_info`` (``{host: [slot ids]}`` or slot counts) with
    an ``--include`` or ``--exclude`` string (``host1:0,1@host2``); not both."""
    from .hostfile import as_slot_lists
    return select_resources(as_slot_lists(host_info), include=include_str or "", exclude=exclude_str or "")


def parse_inclusion_exclusion(resource_pool, inclusion: str, exclusion: str) -> "OrderedDict[str, List[int]]":
    """``resource_pool`` (``{host: slot count}``) narrowed by the include/exclude strings."""
    return parse_resource_filter(pool_from_slot_counts(resource_pool), inclusion, exclusion)


__all__ += ["fetch_hostfile", "encode_world_info", "parse_resource_filter", "parse_inclusion_exclusion"]
