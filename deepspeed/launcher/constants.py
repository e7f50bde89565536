"""Names and defaults shared by the runner and the per-node launcher."""
from __future__ import annotations

# The file whose NAME=VALUE lines are exported to every rank on every node.
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
# An explicit path to such a file overrides the home/current-directory search.
DEEPSPEED_ENVIRONMENT_FILE_VAR = "DS_ENV_FILE"

DEFAULT_HOSTFILE = "/job/hostfile"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
DEFAULT_MASTER_ADDR = "127.0.0.1"

PDSH_LAUNCHER = "pdsh"
SSH_LAUNCHER = "ssh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MULTINODE_LAUNCHERS = (PDSH_LAUNCHER, SSH_LAUNCHER, OPENMPI_LAUNCHER, MPICH_LAUNCHER, SLURM_LAUNCHER, MVAPICH_LAUNCHER)
# Where the mvapich runner writes its host list (DeepSpeed's path).
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"

# Variables whose names start with one of these are forwarded to remote nodes.
EXPORT_ENV_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW", "GLOO", "TORCH", "OMP")

# Seconds the launcher waits after SIGTERM before it sends SIGKILL.
KILL_GRACE_ENV = "DEEPSPEED_KILL_GRACE_S"
DEFAULT_KILL_GRACE_S = 5.0
