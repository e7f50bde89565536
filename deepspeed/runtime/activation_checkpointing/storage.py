"""How a checkpointed call keeps its inputs until backward, and gets them back.

A checkpointed call saves only its inputs (the activations at the checkpoint
boundary); everything inside is recomputed. The memory options change where and
how those inputs are kept:

* ``partition_activations``: in model parallelism every rank of the group holds
  the same activation. Each rank keeps only its 1/P slice (flattened, padded to a
  multiple of P) and the full tensor is all-gathered before the recompute.
* ``checkpoint_in_cpu``: the kept copy lives in host memory (pinned when the
  accelerator is not the CPU) and is copied back for backward. On a CPU-only
  machine it is still a separate host copy, so the same code path runs everywhere.
* ``contiguous_checkpointing``: partitions are copied into one buffer allocated
  once for ``num_checkpoints`` calls, so long-lived checkpoints do not fragment
  memory between short-lived recompute activations.

Only floating-point, non-parameter tensors are treated as activations; integer
masks, parameters and non-tensor arguments are kept as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from .settings import CheckpointSettings

# Kinds of kept argument.
_OBJECT = "object"        # non-tensor: kept by reference
_TENSOR = "tensor"        # tensor kept as-is (saved for backward)
_PARTITION = "partition"  # this rank's slice of a flattened activation
_HOST = "host"            # whole activation copied to host memory


@dataclass
class KeptArg:
    """How to rebuild one argument of a checkpointed call."""
    kind: str
    value: Any = None            # the object, for _OBJECT
    index: int = -1              # position in the saved-tensor list
    shape: Tuple[int, ...] = ()
    numel: int = 0
    device: Optional[torch.device] = None
    requires_grad: bool = False


def is_activation(x) -> bool:
    """Floating-point tensors that are not parameters: the things worth moving or splitting."""
    return torch.is_tensor(x) and x.is_floating_point() and not isinstance(x, torch.nn.Parameter)


def _host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc = get_accelerator()
    t = torch.empty(numel, dtype=dtype, device="cpu")
    return t if acc.device_name() == "cpu" else acc.pin_memory(t)


class ContiguousBuffers:
    """One preallocated ``[num_checkpoints, partition_numel]`` buffer per argument position.

    Each checkpointed call claims the lowest slot above every slot still in use and
    gives it back in its backward, so live slots are never overwritten. Calls that
    are never followed by backward (evaluation with grad enabled) keep their slots
    until :func:`reset`.
    """

    def __init__(self):
        self.buffers: Dict[int, torch.Tensor] = {}
        self.live: set = set()

    def claim(self, num_checkpoints: int) -> int:
        slot = max(self.live) + 1 if self.live else 0
        if slot >= num_checkpoints:
            raise RuntimeError(
                f"The contiguous activation-checkpoint buffer is full: it holds number_checkpoints="
                f"{num_checkpoints} checkpointed calls that have not run backward yet. Set "
                "activation_checkpointing.number_checkpoints (num_checkpoints) to the number of checkpoint() "
                "calls in one forward, or call deepspeed.checkpointing.reset() after forwards that are not "
                "followed by backward (e.g. evaluation).")
        self.live.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self.live.discard(slot)

    def view(self, position: int, slot: int, numel: int, dtype, device, num_checkpoints: int) -> torch.Tensor:
        buf = self.buffers.get(position)
        if buf is None:
            if device.type == "cpu":
                buf = _host_empty(num_checkpoints * numel, dtype).view(num_checkpoints, numel)
            else:
                buf = torch.empty(num_checkpoints, numel, dtype=dtype, device=device)
            self.buffers[position] = buf
        elif buf.shape[1] != numel or buf.dtype != dtype or buf.device != device:
            raise RuntimeError(
                f"Contiguous activation checkpointing needs homogeneous checkpoints: argument {position} "
                f"was first saved as {buf.shape[1]} elements of {buf.dtype} on {buf.device}, now "
                f"{numel} elements of {dtype} on {device}. Checkpoint layers whose inputs have the same "
                "shape and dtype, or turn contiguous_memory_optimization off.")
        # A tensor of its own over the slot's memory: slices of one base share a version
        # counter, so writing slot k+1 would look like an in-place change of slot k to autograd.
        slot_tensor = torch.empty(0, dtype=dtype, device=device)
        return slot_tensor.set_(buf.untyped_storage(), buf.storage_offset() + slot * numel, (numel,))

    def reset(self) -> None:
        """Drop the buffers. Calls still waiting for backward keep their own slot alive."""
        self.buffers = {}
        self.live = set()


CONTIGUOUS_BUFFERS = ContiguousBuffers()


def _model_parallel(mpu) -> Tuple[int, int, Any]:
    if mpu is None:
        return 1, 0, None
    return int(mpu.get_model_parallel_world_size()), int(mpu.get_model_parallel_rank()), \
        mpu.get_model_parallel_group()


class KeptInputs:
    """The inputs of one checkpointed call, kept according to the settings."""

    def __init__(self, settings: CheckpointSettings, mpu):
        self.settings = settings
        self.world, self.rank, self.group = _model_parallel(mpu)
        self.layout: List[KeptArg] = []
        self.slot: Optional[int] = None
        self.slot_released = False

    # -- forward --------------------------------------------------------------
    def keep(self, args) -> List[torch.Tensor]:
        """Record how to rebuild ``args``; returns the tensors to save for backward."""
        s = self.settings
        if s.partition_activations and s.contiguous_checkpointing and any(is_activation(a) for a in args):
            self.slot = CONTIGUOUS_BUFFERS.claim(s.num_checkpoints)
        saved: List[torch.Tensor] = []
        for position, arg in enumerate(args):
            if not torch.is_tensor(arg):
                self.layout.append(KeptArg(_OBJECT, value=arg))
                continue
            meta = dict(index=len(saved), shape=tuple(arg.shape), numel=arg.numel(), device=arg.device,
                        requires_grad=arg.requires_grad)
            if is_activation(arg) and s.partition_activations:
                saved.append(self._partition(position, arg))
                self.layout.append(KeptArg(_PARTITION, **meta))
            elif is_activation(arg) and s.checkpoint_in_cpu:
                host = _host_empty(arg.numel(), arg.dtype)
                host.copy_(arg.detach().reshape(-1), non_blocking=True)
                saved.append(host)
                self.layout.append(KeptArg(_HOST, **meta))
            else:
                saved.append(arg)
                self.layout.append(KeptArg(_TENSOR, **meta))
        return saved

    def _partition(self, position: int, arg: torch.Tensor) -> torch.Tensor:
        """A fresh tensor holding this rank's slice (never a view of ``arg``, so ``arg`` can be freed)."""
        s = self.settings
        numel = arg.numel()
        chunk = max(1, math.ceil(numel / self.world))
        start = min(self.rank * chunk, numel)
        n = min(chunk, numel - start)
        home = torch.device("cpu") if s.checkpoint_in_cpu else arg.device
        if self.slot is not None:
            part = CONTIGUOUS_BUFFERS.view(position, self.slot, chunk, arg.dtype, home, s.num_checkpoints)
        elif home.type == "cpu" and arg.device.type != "cpu":
            part = _host_empty(chunk, arg.dtype)
        else:
            part = torch.empty(chunk, dtype=arg.dtype, device=home)
        part[:n].copy_(arg.detach().reshape(-1)[start:start + n], non_blocking=True)
        if n < chunk:
            part[n:].zero_()
        return part

    # -- backward -------------------------------------------------------------
    def restore(self, saved) -> List[Any]:
        """Rebuild the arguments as fresh leaves (requires_grad as they were)."""
        if self.slot_released:
            raise RuntimeError(
                "A checkpointed call ran backward twice (retain_graph=True) with contiguous_memory_optimization "
                "on: its buffer slot was handed back after the first backward and may have been reused. "
                "Turn contiguous_memory_optimization off to backpropagate through the same graph twice.")
        out = []
        for k in self.layout:
            if k.kind == _OBJECT:
                out.append(k.value)
                continue
            t = saved[k.index]
            if k.kind == _PARTITION:
                t = self._gather(t, k)
            elif k.kind == _HOST:
                t = t.to(k.device, non_blocking=True).view(k.shape)
            t = t.detach()
            t.requires_grad_(k.requires_grad)
            out.append(t)
        if self.slot is not None:
            CONTIGUOUS_BUFFERS.release(self.slot)
            self.slot, self.slot_released = None, True
        return out

    def _gather(self, part: torch.Tensor, k: KeptArg) -> torch.Tensor:
        part = part.to(k.device, non_blocking=True)
        full = torch.empty(part.numel() * self.world, dtype=part.dtype, device=k.device)
        if self.world == 1:
            full.copy_(part)
        else:
            dist.all_gather_into_tensor(full, part.contiguous(), group=self.group)
        return full[:k.numel].view(k.shape)
