"""``deepspeed.runtime.zero.utils``: DeepSpeed's ZeRO helper names.

``ZeRORuntimeException`` is the error ZeRO raises for a misuse at run time;
``is_zero_supported_optimizer`` says whether ZeRO was tested with the optimizer's
exact class (anything else needs ``zero_allow_untested_optimizer``); the rank-agreement
helpers check that every rank holds the same list of integers.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ...utils.logging import logger


class ZeRORuntimeException(Exception):
    """A ZeRO misuse detected while training (wrong call order, unsupported combination)."""


def _supported_optimizers() -> list:
    from ...ops.adagrad import DeepSpeedCPUAdagrad
    from ...ops.adam import DeepSpeedCPUAdam, FusedAdam
    from ...ops.lamb import FusedLamb
    from ...ops.lion import DeepSpeedCPULion, FusedLion
    return [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, FusedAdam,
            DeepSpeedCPUAdam, FusedLamb, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion]


def __getattr__(name):
    if name == "ZERO_SUPPORTED_OPTIMIZERS":
        return _supported_optimizers()
    raise AttributeError(f"module 'deepspeed.runtime.zero.utils' has no attribute '{name}'")


def is_zero_supported_optimizer(optimizer) -> bool:
    """True when ``type(optimizer)`` is one ZeRO is tested with (exact class, as DeepSpeed checks)."""
    ok = type(optimizer) in _supported_optimizers()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.info(f"Checking ZeRO support for optimizer={type(optimizer).__name__}: {ok}")
    return ok


def get_lst_from_rank0(lst: List[int]) -> List[int]:
    """``lst`` as rank 0 of the default group has it (every rank must pass a list of the same length)."""
    t = torch.tensor(list(lst), dtype=torch.long)
    if dist.is_available() and dist.is_initialized():
        from ... import comm as ds_comm
        t = ds_comm.to_comm_device(t)
        dist.broadcast(t, src=0)
    return t.tolist()


def assert_ints_same_as_other_ranks(ints: List[int]) -> None:
    """Raise ZeRORuntimeException naming both lists when this rank's ``ints`` differ from rank 0's."""
    rank0 = get_lst_from_rank0(ints)
    if list(ints) != rank0:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        raise ZeRORuntimeException(f"disagreement between rank0 and rank{rank}: rank0: {rank0}, "
                                   f"rank{rank}: {list(ints)}")


def _initialize_parameter_parallel_groups(parameter_parallel_size=None):
    """This rank's group of ``parameter_parallel_size`` consecutive ranks (all ranks by default)."""
    world = dist.get_world_size()
    size = parameter_parallel_size or world
    if world % size != 0:
        raise ZeRORuntimeException(f"world size {world} is not divisible by parameter_parallel_size {size}")
    rank = dist.get_rank()
    mine = None
    for i in range(world // size):
        g = dist.new_group(list(range(i * size, (i + 1) * size)))
        if i == rank // size:
            mine = g
    return mine
