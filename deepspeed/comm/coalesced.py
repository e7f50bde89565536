"""Coalesced collectives and the smaller ``deepspeed.comm`` names (group queries, the
``*_fn`` aliases, launcher rank variables).

A coalesced collective packs many tensors into one flat buffer per dtype, runs a single
collective on it and copies the results back: one launch instead of one per tensor.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import List

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


class _CoalescedWork:
    """An async handle whose ``wait()`` also copies the flat results back into place."""

    def __init__(self, works, finish):
        self._works, self._finish, self._done = works, finish, False

    def wait(self):
        if not self._done:
            for w in self._works:
                w.wait()
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _by_dtype(tensors):
    groups = OrderedDict()
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce every tensor of ``tensors`` in place with one collective per dtype."""
    tensors = list(tensors)
    if not tensors or _world(group) == 1:
        return _CoalescedWork([], lambda: None) if async_op else None
    flats, works = [], []
    for _, idx in _by_dtype(tensors).items():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        flats.append((idx, flat))
        works.append(dist.all_reduce(flat, op=op, group=group, async_op=True))

    def finish():
        for idx, flat in flats:
            off = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].detach().copy_(flat[off:off + n].view_as(tensors[i]))
                off += n

    handle = _CoalescedWork(works, finish)
    return handle if async_op else handle.wait() and None


def all_gather_coalesced(output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], group=None,
                         async_op: bool = False):
    """Gather every rank's ``input_tensors`` at once: ``output_tensors[r][k]`` receives rank
    ``r``'s ``input_tensors[k]`` (torch.distributed's ``all_gather_coalesced`` layout)."""
    world = _world(group)
    inputs = list(input_tensors)
    if len(output_tensors) != world or any(len(o) != len(inputs) for o in output_tensors):
        raise ValueError(f"all_gather_coalesced: output_tensors must be {world} lists (one per rank) of "
                         f"{len(inputs)} tensors each")
    if not inputs:
        return _CoalescedWork([], lambda: None) if async_op else None
    dtypes = {t.dtype for t in inputs}
    if len(dtypes) != 1:
        raise TypeError(f"all_gather_coalesced: input tensors must share one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([t.detach().reshape(-1) for t in inputs])
    out = torch.empty(flat.numel() * world, dtype=flat.dtype, device=flat.device)
    works = [dist.all_gather_into_tensor(out, flat, group=group, async_op=True)] if world > 1 else []
    if world == 1:
        out.copy_(flat)

    def finish():
        for r in range(world):
            off = r * flat.numel()
            for k, t in enumerate(inputs):
                output_tensors[r][k].copy_(out[off:off + t.numel()].view_as(output_tensors[r][k]))
                off += t.numel()

    handle = _CoalescedWork(works, finish)
    return handle if async_op else handle.wait() and None


@torch.no_grad()
def reduce_scatter_coalesced(tensors: List[torch.Tensor], group=None) -> List[torch.Tensor]:
    """Average ``tensors`` across the group and return this rank's partition of each: tensor
    ``t`` is split into ``world`` chunks of ``ceil(t.numel() / world)`` elements, as ZeRO
    partitions it; one reduce-scatter for all of them (short chunks travel zero-padded). As
    DeepSpeed's, each output holds only this rank's real elements: the last chunks of a
    tensor that does not divide evenly are shorter, and may be empty."""
    world = _world(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    sizes = [math.ceil(t.numel() / world) for t in tensors]
    per_rank = []
    for r in range(world):
        for t, s in zip(tensors, sizes):
            flat = t.detach().reshape(-1)
            piece = flat[r * s:(r + 1) * s]
            per_rank.append(piece)
            if piece.numel() < s:
                per_rank.append(torch.zeros(s - piece.numel(), dtype=t.dtype, device=t.device))
    buf = torch.cat(per_rank).div_(world)
    mine = torch.empty(sum(sizes), dtype=buf.dtype, device=buf.device)
    if world > 1:
        dist.reduce_scatter_tensor(mine, buf, group=group)
    else:
        mine.copy_(buf)
    out, off = [], 0
    for t, s in zip(tensors, sizes):
        real = max(0, min(s, t.numel() - rank * s))   # this rank's elements of t (padding dropped)
        out.append(mine[off:off + real])
        off += s
    return out


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """Synchronous in-place all-reduce used on inference paths; returns ``tensor``."""
    if _world(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def get_all_ranks_from_group(group=None) -> List[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(_world(None)))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def get_world_group():
    return dist.group.WORLD


def get_world_rank_from_launcher() -> int:
    return int(os.environ["RANK"])


def get_world_size_from_launcher() -> int:
    return int(os.environ["WORLD_SIZE"])


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return True


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's spelling of ``all_gather_into_tensor``."""
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    """DeepSpeed's spelling of ``reduce_scatter_tensor``."""
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


# DeepSpeed's names for the remaining torch.distributed calls and types.
ProcessGroup = dist.ProcessGroup


def P2POp(op, tensor, peer=None, group=None, tag=0):  # noqa: N802 - DeepSpeed's name
    """A point-to-point op for ``batch_isend_irecv``; ``op`` may be deepspeed.comm's or
    torch.distributed's ``isend``/``irecv``."""
    name = getattr(op, "__name__", "")
    if name in ("isend", "irecv"):
        op = getattr(dist, name)
    return dist.P2POp(op, tensor, peer, group=group, tag=tag)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def batch_isend_irecv(p2p_op_list):
    return dist.batch_isend_irecv(p2p_op_list)


def all_gather_base(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's older name for ``all_gather_into_tensor``."""
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_base(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, debug=None):
    """DeepSpeed's older name for ``reduce_scatter_tensor``."""
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_allgather_base() -> bool:
    return True


def has_reduce_scatter_base() -> bool:
    return True


__all__ = ["ProcessGroup", "P2POp", "gather", "scatter", "batch_isend_irecv", "all_gather_base",
           "reduce_scatter_base", "has_allgather_base", "has_reduce_scatter_base"]
__all__ += ["all_reduce_coalesced", "all_gather_coalesced", "reduce_scatter_coalesced", "inference_all_reduce",
           "get_all_ranks_from_group", "get_world_group", "get_world_rank_from_launcher",
           "get_world_size_from_launcher", "has_all_reduce_coalesced", "has_coalescing_manager",
           "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "allgather_fn", "reduce_scatter_fn",
           "all_to_all"]


# Collective failures named (deepspeed.comm.timeouts), under the logger's wrapper.
from .timeouts import wrap_ops as _name_failures  # noqa: E402

_name_failures(globals(), ("all_reduce_coalesced", "all_gather_coalesced", "reduce_scatter_coalesced"))

# The communication logger wraps these ops too (see deepspeed.comm.comms_logging).
from .comms_logging import wrap_ops as _wrap_ops  # noqa: E402

_wrap_ops(globals())
