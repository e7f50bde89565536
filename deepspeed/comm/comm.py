from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..utils.logging import logger

ReduceOp = dist.ReduceOp
# torch >= 2.9 names the single-tensor collectives *_single (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
    "get_local_rank", "barrier", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "send", "recv",
    "isend", "irecv", "new_group", "get_global_rank", "destroy_process_group", "ReduceOp",
    "all_to_all_single", "get_backend", "monitored_barrier", "default_timeout", "all_gather_object",
    "comm_device", "to_comm_device", "CompletedWork",
]

# DeepSpeed's default process-group timeout is 10 minutes (deepspeed.constants.default_pg_timeout,
# 0.19); DEEPSPEED_TIMEOUT (minutes) overrides.
def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(minutes=float(os.environ.get("DEEPSPEED_TIMEOUT", "10")))


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _mpi_discovery(distributed_port: int, verbose: bool) -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from MPI-style variables (OpenMPI,
    MPICH/Intel MPI, Slurm) when the launcher's variables are absent."""
    candidates = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ]
    for rank_v, size_v, local_v, local_size_v in candidates:
        if rank_v in os.environ and size_v in os.environ:
            os.environ["RANK"] = os.environ[rank_v]
            os.environ["WORLD_SIZE"] = os.environ[size_v]
            os.environ.setdefault("LOCAL_RANK", os.environ.get(local_v, "0"))
            if local_size_v in os.environ:
                os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ[local_size_v].split("(")[0])
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
            if verbose:
                logger.info(f"MPI-style discovery via {rank_v}: rank={os.environ['RANK']} "
                            f"world_size={os.environ['WORLD_SIZE']}")
            return True
    return False


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed once (a second call is a no-op).

    With no launcher variables and no MPI variables, a single process initialises
    a world of one on 127.0.0.1 so the same script runs unchanged.
    """
    if is_initialized():
        _install_clean_exit()
        return
    if dist_init_required is False:
        # DeepSpeed asserts here (comm.init_distributed); AssertionError is what clients catch.
        raise DistributedNotInitializedError(
            "init_distributed(dist_init_required=False) was called but torch.distributed is not "
            "initialized. Initialize it first (torch.distributed.init_process_group or "
            "deepspeed.init_distributed()), or pass dist_init_required=True/None.")
    from ..accelerator import get_accelerator
    backend = dist_backend or get_accelerator().communication_backend_name()
    timeout = timeout or default_timeout()
    have_env = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if not have_env and auto_mpi_discovery:
        have_env = _mpi_discovery(distributed_port, verbose)
    if not have_env and init_method is None and rank < 0:
        # Single process without a launcher.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if rank < 0:
        rank = int(os.environ.get("RANK", "0"))
    if world_size < 0:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        get_accelerator().set_device(local_rank)
    if verbose:
        logger.info(f"Initializing torch.distributed backend={backend} rank={rank} world_size={world_size}")
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=timeout)
    _install_clean_exit()


class DistributedNotInitializedError(AssertionError, RuntimeError):
    """``dist_init_required=False`` without an initialized process group (DeepSpeed: AssertionError)."""


def _install_clean_exit() -> None:
    """Tear the process group down at exit (see ``deepspeed.comm.shutdown``)."""
    from . import shutdown
    shutdown.install()


def destroy_process_group(group=None):
    if is_initialized():
        dist.destroy_process_group(group)


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None):
    return dist.get_backend(group) if is_initialized() else None


# Backends that take host (CPU) tensors; "cpu:gloo,cuda:nccl"-style multi-device backends too.
_HOST_BACKENDS = frozenset(("gloo", "mpi", "ccl", "fake"))


def comm_device(group=None) -> torch.device:
    """The device a tensor must be on for a collective over ``group``.

    NCCL (and the other accelerator-only backends: hccl, xccl, ...) reduce device tensors
    only - a CPU tensor fails with "No backend type associated with device type cpu", even
    in a world of one - so for them this is the current accelerator device; for gloo, MPI,
    oneCCL, a backend with a ``cpu:`` entry, or no process group at all it is the CPU.
    Small host-side values (flags, counts, norms) go ``.to(comm_device(group))`` before the
    collective (see :func:`to_comm_device`) and are read back with ``.item()``/``.tolist()``.
    """
    if not is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    entries = [e.strip() for e in backend.split(",")]
    if any(e.startswith("cpu:") or e.rsplit(":", 1)[-1] in _HOST_BACKENDS for e in entries):
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    from ..accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def to_comm_device(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` on :func:`comm_device` of ``group`` (``tensor`` itself when already there).
    Code that needs the result in the original tensor copies it back when the two differ."""
    return tensor.to(comm_device(group))


class CompletedWork:
    """The handle a collective launched with ``async_op=True`` returns when it had nothing
    to do (a world of one, or no process group): already complete, so ``wait()`` returns
    at once - client code written for torch's ``Work`` runs unchanged."""

    def __init__(self, result=None):
        self._result = [] if result is None else list(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def result(self):
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def __repr__(self):
        return "CompletedWork()"


def _done(async_op, *tensors):
    """What a short-circuited collective returns: a completed handle for ``async_op``."""
    return CompletedWork(tensors) if async_op else None


def barrier(group=None, async_op=False):
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op)
    return _done(async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    if is_initialized():
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _single(group) -> bool:
    return not is_initialized() or dist.get_world_size(group) == 1


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    if _single(group):
        return _done(async_op, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    if _single(group):
        return _done(async_op, tensor)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if _single(group):
        tensor_list[0].copy_(tensor)
        return _done(async_op, *tensor_list)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    if _single(group):
        object_list[0] = obj
        return None
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if _single(group):
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _done(async_op, output_tensor)
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    if _single(group):
        output.copy_(input_list[0])
        return _done(async_op, output)
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    if _single(group):
        output.copy_(input.reshape(output.shape))
        return _done(async_op, output)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    if _single(group):
        return _done(async_op, tensor)
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src=0, group=None):
    if _single(group):
        return None
    return dist.broadcast_object_list(object_list, src=src, group=group)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def send(tensor, dst, group=None, tag=0):
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0):
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0):
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor, src=None, group=None, tag=0):
    return dist.irecv(tensor, src, group=group, tag=tag)


def new_group(ranks=None, timeout=None, backend=None):
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


# A collective that times out or loses a peer raises CollectiveTimeoutError naming the op and
# the training step, from the call or from its async handle's wait() (deepspeed.comm.timeouts);
# applied under the communication logger's wrapper, which must stay outermost (it names the caller).
from .timeouts import CollectiveTimeoutError, wrap_ops as _name_failures  # noqa: E402,F401

_name_failures(globals(), ("barrier", "monitored_barrier", "all_reduce", "reduce", "all_gather", "all_gather_object",
                           "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
                           "broadcast_object_list", "all_to_all_single", "send", "recv", "isend", "irecv"))
__all__ += ["CollectiveTimeoutError"]


# The communication logger (deepspeed.comm.comms_logging) wraps every op above once;
# while it is off each call costs one flag check. Keep this at the end of the file.
from .comms_logging import configure, log_summary, comms_logger, wrap_ops as _wrap_ops  # noqa: E402,F401

_wrap_ops(globals())
__all__ += ["configure", "log_summary", "comms_logger"]

