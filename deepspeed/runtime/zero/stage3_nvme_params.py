"""ZeRO stage 3 with ``offload_param.device: "nvme"``: the strategy's side of NVMe-backed
parameter partitions.

* :func:`param_swapper_for`: the :class:`~deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper`
  the strategy puts on its :class:`~.partitioned_param.PartitionSpec` (``spec.swapper``);
  a model built under ``zero.Init(remote_device="nvme")`` already has one, and the
  strategy takes it over (no copy) when it holds the training dtype.
* :class:`SwappedPartitionMasters`: :class:`~.stage3_master.MasterPartitions` without the
  flat in-memory copy of the partitions (``Chunk.lp``) that the in-memory layout keeps:
  for a chunk holding NVMe-backed partitions ``lp`` is None, the fp32 master is built from
  the partitions one partition at a time (``resident_partitions``), and after the update
  the master is copied back into them (``write_back``), again one at a time, so at most one
  partition of the chunk is resident beyond what the swapper caches (``max_in_cpu``).
  With ``offload_optimizer.device: nvme`` too, the masters are swapped
  (:mod:`.stage3_nvme`) and reach the partitions through the same ``resident_partitions``.
"""
from __future__ import annotations

import torch

from .partitioned_param import is_zero_param, resident_partitions
from .stage3_master import MasterPartitions

_FP32 = torch.float32


def param_swapper_for(module, offload_param, aio, dtype):
    """The swapper for ``module``'s partitions: zero.Init's when there is exactly one and it
    holds ``dtype``, else a new one from the ``offload_param`` and ``aio`` sections."""
    from ..swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    found = {}
    for p in module.parameters():
        sw = getattr(getattr(p, "_z3", None), "swapper", None) if is_zero_param(p) else None
        if sw is not None and not sw.closed:
            found[id(sw)] = sw
    if len(found) == 1:
        sw = next(iter(found.values()))
        if sw.dtype == dtype:
            return sw
    return AsyncPartitionedParameterSwapper.from_config(offload_param, aio, dtype=dtype)


def _swapped_chunk(c) -> bool:
    return any(getattr(p._z3, "swapper", None) is not None and p._z3.swapper.is_swapped(p) for p in c.params)


def partitions_to_master(c, out) -> None:
    """Chunk ``c``'s partitions -> ``out`` (its flat fp32 master), one partition at a time."""
    for p, off, s in zip(c.params, c.offsets, c.sizes):
        with resident_partitions([p]):
            out[off:off + s].copy_(p.ds_tensor)


def master_to_partitions(c, master) -> None:
    """``master`` -> chunk ``c``'s partitions (written back to NVMe), one partition at a time."""
    for p, off, s in zip(c.params, c.offsets, c.sizes):
        with resident_partitions([p], overwrite=True):   # not read first: every element is written
            p.ds_tensor.copy_(master[off:off + s])


class SwappedPartitionMasters(MasterPartitions):
    """:class:`MasterPartitions` for NVMe-backed partitions (see the module docstring)."""

    def _build(self, c, share: bool, pin: bool) -> None:
        if not _swapped_chunk(c):
            return super()._build(c, share, pin)
        for p, off, s in zip(c.params, c.offsets, c.sizes):
            self.slot[id(p)] = (c, off, s)
        c.lp = None
        if self._nvme_holders:   # offload_optimizer nvme: the masters are built into the swapper later
            c.master = torch.empty(0, dtype=_FP32, device=self.opt_device)
        else:
            c.master = torch.empty(c.numel, dtype=_FP32, device=self.opt_device)
            partitions_to_master(c, c.master)
            if pin:
                c.master = self._pin(c.master)
        c.grad = torch.zeros(c.numel, dtype=self.grad_dtype, device=self.opt_device)
        if pin:
            c.grad = self._pin(c.grad)

    def _use_streamed(self, optimizer) -> bool:
        if self.streamed is None and any(c.lp is None for c in self.chunks):
            if self.nvme is None:
                self.streamed = False   # the update copies whole chunk masters back (master_to_partitions)
            else:
                self.streamed = bool(callable(getattr(optimizer, "step_streamed", None))
                                     and optimizer.supports_streamed_step()
                                     and all(c.grad.dtype != _FP32 and c.grad.device.type == "cpu"
                                             for c in self.chunks))
        return super()._use_streamed(optimizer)

    def _step_wave(self, optimizer, wave, coef) -> None:
        if all(c.lp is not None for c in wave):
            return super()._step_wave(optimizer, wave, coef)
        self._step_wave_whole(optimizer, wave, coef)

    def _master_to_lp(self, c, non_blocking: bool = False) -> None:
        if c.lp is None:            # NVMe-backed partitions: written back one at a time
            master_to_partitions(c, c.master)
        else:
            super()._master_to_lp(c, non_blocking)

    def refresh_master_from_partitions(self, params=None) -> None:
        if self.nvme is not None or all(c.lp is not None for c in self.chunks):
            return super().refresh_master_from_partitions(params)
        want = None if params is None else {id(p) for p in params}
        for c in self.chunks:
            if c.lp is c.master:
                continue
            for p, off, s in zip(c.params, c.offsets, c.sizes):
                if want is not None and id(p) not in want:
                    continue
                if c.lp is None:
                    with resident_partitions([p]):
                        c.master[off:off + s].copy_(p.ds_tensor)
                else:
                    c.master[off:off + s].copy_(c.lp[off:off + s])

