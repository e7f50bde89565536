"""How each multi-node back-end starts the job: one small class per tool.

Each runner turns (arguments, active resources, exported variables) into the exact
commands to run on this machine, as :class:`NodeCommand` objects (argv + the
environment of the local client process). The runner module runs them under the same
supervisor as the ranks.

* ``pdsh`` and ``ssh`` run the per-node launcher (``deepspeed.launcher.launch``) on every
  node, inside ``cd <cwd> && export NAME=VALUE && ...``; ranks get ``--local_rank``.
* ``openmpi``, ``mpich`` and ``slurm`` start every rank themselves (one MPI task per
  slot); ranks read their rank from the tool's variables (``OMPI_COMM_WORLD_RANK``,
  ``PMI_RANK``, ``SLURM_PROCID``), which ``deepspeed.init_distributed`` understands, and
  get ``MASTER_ADDR``/``MASTER_PORT`` exported. These tools cannot pick device ids, so
  every node must use slots ``0..n-1``.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .constants import (MPICH_LAUNCHER, MVAPICH_LAUNCHER, MVAPICH_TMP_HOSTFILE, OPENMPI_LAUNCHER, PDSH_LAUNCHER,
                        SLURM_LAUNCHER, SSH_LAUNCHER)
from .hostfile import ResourceError, as_slot_lists, decode_world_info, total_slots


@dataclass
class NodeCommand:
    """One process to start here: ``label`` names it in messages."""
    label: str
    argv: List[str]
    env: Dict[str, str]
    stdin_pipe: bool = False
    # a stderr line -> the exit code of a failed part of the job it reports, else None
    stderr_failure: Optional[Callable[[str], Optional[int]]] = None


class MultiNodeRunner:
    """Base class: holds the job description and the shared command pieces."""
    name = ""
    tool = ""

    def __init__(self, args, world_info_base64: str, resources=None, exports: "Optional[Dict[str, str]]" = None):
        # DeepSpeed's constructors: (args, world_info_base64) for pdsh, (..., resource_pool) for
        # MPI/Slurm with slot counts; without resources they come from the encoded world info.
        self.args = args
        self.world_info_base64 = world_info_base64
        self.resources = OrderedDict()
        self._world_info_error = None
        if resources is not None:
            self.resources = as_slot_lists(resources)
        else:   # read lazily: a runner built only to collect exports needs no valid world info
            try:
                self.resources = decode_world_info(world_info_base64)
            except ResourceError as err:
                self._world_info_error = err
        self.exports = OrderedDict(exports or {})
        self.cwd = os.path.abspath(os.getcwd())

    def _use(self, active_resources) -> None:
        """DeepSpeed passes the active resources to get_cmd; they replace the constructor's."""
        if active_resources is not None:
            self.resources = as_slot_lists(active_resources)
        elif self._world_info_error is not None:
            raise self._world_info_error

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank (DeepSpeed's runner method)."""
        self.exports[key.strip()] = str(var).strip()

    def validate_args(self) -> None:
        """Checks a back-end makes before building commands (slot-choosing limits for MPI/Slurm)."""
        if self.name in ("openmpi", "mpich", "slurm"):
            self.require_leading_slots()

    def backend_exists(self) -> bool:
        return shutil.which(self.tool) is not None

    def node_commands(self, environment: Dict[str, str], active_resources=None) -> List[NodeCommand]:
        """The processes to start here (argv and environment each); what ``deepspeed`` runs."""
        raise TypeError(f"{type(self).__name__} does not build commands; use a concrete runner")

    def get_cmd(self, environment: Dict[str, str], active_resources=None):
        """DeepSpeed's shape: the one command line (a list of strings) to run here. (PDSH
        returns ``(cmd, kill_cmd, environment)``; SSH one command line per node.)"""
        cmds = self.node_commands(environment, active_resources)
        environment.update(cmds[0].env)   # what the command needs in its environment (srun: the exports)
        return cmds[0].argv

    # -- shared pieces -------------------------------------------------------
    @property
    def launcher_args(self) -> List[str]:
        return shlex.split(self.args.launcher_args or "")

    def script_argv(self) -> List[str]:
        """The user's program, as MPI/Slurm start it directly."""
        a = self.args
        if a.no_python:
            head = [a.user_script]
        elif a.module:
            head = [sys.executable, "-u", "-m", a.user_script]
        else:
            head = [sys.executable, "-u", a.user_script]
        return head + list(a.user_args)

    def launch_argv(self, node_rank) -> List[str]:
        """The per-node launcher command for ``node_rank`` (an int, or pdsh's ``%n``)."""
        a = self.args
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
               f"--world_info={self.world_info_base64}", f"--node_rank={node_rank}",
               f"--master_addr={a.master_addr}", f"--master_port={a.master_port}"]
        for flag in ("no_local_rank", "module", "no_python"):
            if getattr(a, flag, False):
                cmd.append(f"--{flag}")
        if getattr(a, "enable_each_rank_log", None):
            cmd.append(f"--enable_each_rank_log={a.enable_each_rank_log}")
        return cmd + [a.user_script] + list(a.user_args)

    def remote_shell_command(self, argv: List[str]) -> str:
        """``cd <cwd> && export K=V && ... && exec <argv>`` for a remote shell."""
        parts = [f"cd {shlex.quote(self.cwd)}"]
        parts += [f"export {k}={shlex.quote(v)}" for k, v in self.exports.items()]
        parts.append("exec " + " ".join(shlex.quote(x) for x in argv))
        return " && ".join(parts)

    def require_leading_slots(self) -> None:
        """MPI and Slurm start ``n`` tasks per node; they cannot choose device ids."""
        for host, slots in self.resources.items():
            if list(slots) != list(range(len(slots))):
                raise ResourceError(
                    f"--launcher {self.name} cannot use slots {slots} on host {host!r}: it starts "
                    f"tasks on slots 0..n-1 only. Use --num_gpus, or --launcher pdsh/ssh to pick "
                    f"specific slots")

    def equal_slots_per_node(self, launcher: str) -> int:
        """The slot count every node shares (Slurm and MVAPICH start ``n`` tasks on each node)."""
        per_node = {len(s) for s in self.resources.values()}
        if len(per_node) != 1:
            counts = ", ".join(f"{h}={len(s)}" for h, s in self.resources.items())
            raise ResourceError(f"--launcher {launcher} needs the same number of slots on every node, got "
                                f"{counts}; use --num_gpus to even them out")
        return per_node.pop()

    def host_counts(self, sep: str = ":") -> str:
        return ",".join(f"{h}{sep}{len(s)}" for h, s in self.resources.items())

    def mpi_exports(self) -> "OrderedDict[str, str]":
        out = OrderedDict(self.exports)
        out["MASTER_ADDR"] = str(self.args.master_addr)
        out["MASTER_PORT"] = str(self.args.master_port)
        return out


class PDSHRunner(MultiNodeRunner):
    """``pdsh -S -f 1024 -w h1,h2 '<remote command>'``; pdsh puts each host's index in %n."""
    name = PDSH_LAUNCHER
    tool = "pdsh"

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        env = dict(environment)
        env["PDSH_RCMD_TYPE"] = "ssh"
        if getattr(self.args, "ssh_port", None):
            env["PDSH_SSH_ARGS_APPEND"] = (env.get("PDSH_SSH_ARGS_APPEND", "") +
                                           f" -p {self.args.ssh_port}").strip()
        argv = ["pdsh", "-S", "-f", "1024", "-w", ",".join(self.resources)] + self.launcher_args
        argv.append(self.remote_shell_command(self.launch_argv("%n")))
        return [NodeCommand("pdsh", argv, env, stderr_failure=pdsh_host_failure)]

    def kill_command(self) -> List[str]:
        """``pdsh -w <hosts> pkill -f '<this job's node launchers>'`` (DeepSpeed's kill_cmd).

        pdsh cannot stop remote commands itself: killing it (or its ssh clients) leaves the
        node launchers and ranks running on the other hosts. The pattern is a regular
        expression matching ``deepspeed.launcher.launch --world_info=<this job's>``; its first
        letter is bracketed so it does not match the remote shell running pkill."""
        pattern = "[d]" + _ere_escape(f"eepspeed.launcher.launch --world_info={self.world_info_base64}")
        return ["pdsh", "-S", "-f", "1024", "-w", ",".join(self.resources)] + self.launcher_args + \
            ["pkill -f " + shlex.quote(pattern)]

    def get_cmd(self, environment, active_resources=None):
        """DeepSpeed's shape: ``(cmd, kill_cmd, environment)``; ``kill_cmd`` stops the
        per-node launchers of this job (pdsh runs ``pkill -f`` on every node)."""
        cmd = self.node_commands(environment, active_resources)[0]
        environment.update(cmd.env)
        return cmd.argv, self.kill_command(), environment


_PDSH_HOST_FAILED = re.compile(r"^pdsh@[^:\s]+: ([^:\s]+): \S+ exited with exit code (\d+)$")


def pdsh_host_failure(line: str) -> Optional[int]:
    """The exit code in pdsh's ``pdsh@head: worker-1: ssh exited with exit code 137`` line.

    pdsh waits for every host; when one host's command fails the others may run on (until their
    collectives notice), so the launcher stops the job as soon as pdsh reports such a line."""
    m = _PDSH_HOST_FAILED.match(line)
    return int(m.group(2)) if m and int(m.group(2)) != 0 else None


def _ere_escape(text: str) -> str:
    """``text`` as a POSIX extended regular expression matching itself (base64 has ``+``)."""
    return "".join("\\" + c if c in ".[]()*+?{}|^$\\" else c for c in text)


class SSHRunner(MultiNodeRunner):
    """One ``ssh host '<remote command>'`` per node; the remote launcher stops when the
    connection (its stdin) closes."""
    name = SSH_LAUNCHER
    tool = "ssh"

    def ssh_prefix(self) -> List[str]:
        argv = ["ssh", "-o", "BatchMode=yes"]
        if getattr(self.args, "ssh_port", None):
            argv += ["-p", str(self.args.ssh_port)]
        return argv + self.launcher_args

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        cmds = []
        for node_rank, host in enumerate(self.resources):
            launch = self.launch_argv(node_rank)
            launch.insert(launch.index(f"--node_rank={node_rank}") + 1, "--exit_on_stdin_eof")
            argv = self.ssh_prefix() + [host, self.remote_shell_command(launch)]
            cmds.append(NodeCommand(f"node {node_rank} ({host})", argv, dict(environment), stdin_pipe=True))
        return cmds

    def get_cmd(self, environment, active_resources=None):
        """One ``ssh`` command line per node."""
        return [c.argv for c in self.node_commands(environment, active_resources)]


class OpenMPIRunner(MultiNodeRunner):
    """``mpirun -n N -H h1:n1,h2:n2 -wdir <cwd> --mca btl ^openib --mca btl_tcp_if_include eth0
    -x K=V ... python -u script args``.

    DeepSpeed's defaults: the openib transport off and TCP on ``eth0``, each unless
    ``--launcher_args`` sets that parameter itself (``-mca``/``--mca btl ...`` or
    ``btl_tcp_if_include ...``), and ``UCX_TLS=tcp`` exported unless the environment sets it."""
    name = OPENMPI_LAUNCHER
    tool = "ompi_info"

    def __init__(self, args, world_info_base64: str, resources=None, exports=None):
        super().__init__(args, world_info_base64, resources, exports)
        self.exports.setdefault("UCX_TLS", "tcp")

    def _mca_defaults(self) -> List[str]:
        la = self.launcher_args
        given = {b for a, b in zip(la, la[1:]) if a in ("-mca", "--mca")}
        return (([] if "btl" in given else ["--mca", "btl", "^openib"])
                + ([] if "btl_tcp_if_include" in given else ["--mca", "btl_tcp_if_include", "eth0"]))

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        self.require_leading_slots()
        argv = ["mpirun", "-n", str(total_slots(self.resources)), "-H", self.host_counts(),
                "-wdir", self.cwd] + self._mca_defaults() + self.launcher_args
        for k, v in self.mpi_exports().items():
            argv += ["-x", f"{k}={v}"]
        return [NodeCommand("mpirun", argv + self.script_argv(), dict(environment))]


class MPICHRunner(MultiNodeRunner):
    """``mpirun -n N -hosts h1:n1,h2:n2 -wdir <cwd> -genv K V ... python -u script args`` (Hydra)."""
    name = MPICH_LAUNCHER
    tool = "mpirun"

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        self.require_leading_slots()
        argv = ["mpirun", "-n", str(total_slots(self.resources)), "-hosts", self.host_counts(),
                "-wdir", self.cwd] + self.launcher_args
        for k, v in self.mpi_exports().items():
            argv += ["-genv", k, v]
        return [NodeCommand("mpirun", argv + self.script_argv(), dict(environment))]


class SlurmRunner(MultiNodeRunner):
    """``srun -n N --nodes M --ntasks-per-node n --nodelist h1,h2 --export=ALL,K,...``.

    Values travel in srun's own environment and are named in ``--export`` (srun takes
    a bare name's value from its environment), so values may contain commas.
    """
    name = SLURM_LAUNCHER
    tool = "srun"

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        self.require_leading_slots()
        per_node = self.equal_slots_per_node("slurm")
        exports = self.mpi_exports()
        env = dict(environment)
        env.update(exports)
        argv = ["srun", "-n", str(total_slots(self.resources)), "--nodes", str(len(self.resources)),
                "--ntasks-per-node", str(per_node), "--nodelist", ",".join(self.resources),
                "--chdir", self.cwd, "--export=" + ",".join(["ALL"] + list(exports))]
        return [NodeCommand("srun", argv + self.launcher_args + self.script_argv(), env)]


class MVAPICHRunner(MultiNodeRunner):
    """MVAPICH2-GDR: ``mpirun -np N -ppn n --hostfile <file> -env K=V ... python -u script args``,
    with DeepSpeed's MV2_* settings exported. The host list goes to a file
    (``MVAPICH_TMP_HOSTFILE``), written when the command is built."""
    name = MVAPICH_LAUNCHER
    tool = "mpiname"

    def __init__(self, args, world_info_base64: str, resources=None, exports=None):
        super().__init__(args, world_info_base64, resources, exports)
        settings = [("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1"), ("MV2_SUPPORT_DL", "1"),
                    ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"), ("MV2_CUDA_USE_NAIVE", "0")]
        from ..accelerator import get_accelerator
        if get_accelerator().device_name() == "cuda":
            settings.insert(2, ("MV2_USE_CUDA", "1"))
        for k, v in settings:
            self.exports.setdefault(k, v)

    def backend_exists(self) -> bool:
        """``mpiname`` on PATH and reporting MVAPICH2-GDR (what DeepSpeed requires)."""
        if shutil.which("mpiname") is None:
            return False
        import subprocess
        try:
            out = subprocess.run(["mpiname"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
        return "MVAPICH2-GDR" in out

    def node_commands(self, environment, active_resources=None):
        self._use(active_resources)
        self.require_leading_slots()
        per_node = self.equal_slots_per_node("mvapich")
        with open(MVAPICH_TMP_HOSTFILE, "w") as f:
            f.write("".join(f"{h}\n" for h in self.resources))
        argv = ["mpirun", "-np", str(total_slots(self.resources)), "-ppn", str(per_node),
                "--hostfile", MVAPICH_TMP_HOSTFILE] + self.launcher_args
        for k, v in self.mpi_exports().items():
            argv += ["-env", f"{k}={v}"]
        return [NodeCommand("mpirun", argv + self.script_argv(), dict(environment))]


RUNNERS = {r.name: r for r in (PDSHRunner, SSHRunner, OpenMPIRunner, MPICHRunner, SlurmRunner, MVAPICHRunner)}


def get_runner(name: str, args, world_info_base64: str, resources, exports) -> MultiNodeRunner:
    try:
        cls = RUNNERS[name]
    except KeyError:
        raise ResourceError(f"--launcher {name!r} is not supported; choose one of "
                            f"{', '.join(RUNNERS)}") from None
    return cls(args, world_info_base64, resources, exports)
