"""Bucketed gradient reduction for the flat-buffer strategies (stages 0-mixed, 1, 2).

Two owners of gradients:

* :class:`FullGradReducer` (stage 0 mixed, stage 1): every rank keeps the full
  gradients of its micro-steps in one flat buffer per group (``p.grad`` are views into
  it). Only the boundary micro-step reduces: each bucket region is all-reduced
  (stage 0) or reduce-scattered in place (stage 1; or reduced to its owners with
  ``reduce_scatter: false``), launched from the backward hook of its last parameter.
* :class:`PartitionGradReducer` (stage 2): no full buffer survives a micro-step. A
  parameter's gradient is copied into its bucket's staging buffer and freed; a full
  bucket is reduce-scattered and each rank adds its chunk into its gradient partition.
  Every micro-step reduces, so accumulation happens in the partition. A staging buffer
  is written once (first gradient copied, unwritten slots and padding zeroed at launch)
  and, once its bucket is reduced, reused by a later bucket of the same backward; none
  is kept between micro-steps.

Averaging is *not* done here: regions are divided by ``predivide`` before the
collective and the rest of the ``1/N`` is folded into the single multiply the step
applies anyway (unscale and clip), saving a pass over the gradients.
Launch order is the same on every rank (buckets are launched strictly in
``Bucket.order``), so collectives always pair up.
"""
from __future__ import annotations

from collections import Counter
from typing import List, Optional

import torch
import torch.distributed as dist

from ... import comm as ds_comm
from .flat_layout import Bucket, Slot

# Collectives go through deepspeed.comm (which uses the *_single names where torch has
# them) so the communication logger sees them.


_HUGE_MIN_BYTES = 4 << 20


def transient_buffer(numel: int, dtype, device, zero: bool = False) -> torch.Tensor:
    """A buffer that lives for one step or one bucket (fp32 gradient copy, stage-2 staging).

    On the host, large ones are backed by 2 MiB huge pages before first touch: the C
    allocator hands such blocks back to the OS when freed, so a 4 KiB-paged one is
    page-faulted in afresh every time (measured 4x slower than the copy into it)."""
    t = torch.empty(numel, dtype=dtype, device=device)
    if t.device.type == "cpu" and numel * t.element_size() >= _HUGE_MIN_BYTES:
        from ...ops.adam.cpu_adam import _madvise_hugepages
        _madvise_hugepages(t)
    return t.zero_() if zero else t


class LateGradientError(RuntimeError):
    """A gradient arrived for a bucket whose reduction was already launched."""


def _late(slot: Slot) -> LateGradientError:
    return LateGradientError(
        f"Parameter '{slot.name}' received another gradient after its bucket was already reduced in this "
        f"backward (reentrant activation checkpointing, or the parameter used in a second autograd graph). "
        f"Set zero_optimization.overlap_comm to false so buckets are reduced after backward completes.")


class _Comm:
    """The collectives of the flat strategies, counted by kind.

    Reduce-scatter and all-gather work in place on a region of ``N`` equal chunks (the
    rank's chunk is ``region[r*c:(r+1)*c]``). On gloo both are carried by all-reduce:
    gloo's own reduce-scatter and all-gather measured 1.7x and 1.3x slower than its
    ring all-reduce of the whole region (8.4M fp32 at 2 ranks: 36 and 27 ms vs 21 ms),
    and the region is already whole in memory either way. All-gather by all-reduce is
    exact: every rank zeroes the chunks it does not own first, so each element is
    one value plus zeros. NCCL uses the native collectives.
    """

    def __init__(self, group, world_size: int, rank: int):
        self.group = group
        self.world = world_size
        self.rank = rank
        self.launches: Counter = Counter()
        self.via_all_reduce = (world_size > 1 and dist.is_initialized()
                               and dist.get_backend(group) == "gloo")

    def global_rank(self, r: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def all_reduce(self, t):
        self.launches["all_reduce"] += 1
        return [ds_comm.all_reduce(t, group=self.group, async_op=True)]

    def reduce_scatter_inplace(self, region, chunk: int):
        """Sum ``region`` across ranks into this rank's chunk of it."""
        self.launches["reduce_scatter"] += 1
        if self.via_all_reduce:
            return [ds_comm.all_reduce(region, group=self.group, async_op=True,
                                       log_name="all_reduce[reduce_scatter]")]
        mine = region.narrow(0, self.rank * chunk, chunk)
        return [ds_comm.reduce_scatter_tensor(mine, region, group=self.group, async_op=True)]

    def all_gather_inplace(self, region, chunk: int):
        """Every rank's chunk of ``region`` onto every rank."""
        self.launches["all_gather"] += 1
        mine = region.narrow(0, self.rank * chunk, chunk)
        if self.via_all_reduce:
            if self.rank > 0:
                region.narrow(0, 0, self.rank * chunk).zero_()
            region.narrow(0, (self.rank + 1) * chunk, region.numel() - (self.rank + 1) * chunk).zero_()
            return ds_comm.all_reduce(region, group=self.group, async_op=True, log_name="all_reduce[all_gather]")
        return ds_comm.all_gather_into_tensor(region, mine, group=self.group, async_op=True)

    def reduce_to_owners(self, inp, chunk: int):
        works = []
        for r in range(self.world):
            self.launches["reduce"] += 1
            works.append(ds_comm.reduce(inp[r * chunk:(r + 1) * chunk], dst=self.global_rank(r),
                                        group=self.group, async_op=True))
        return works


class _InOrderLauncher:
    """Tracks ready parameters per bucket and launches full buckets in ``order``."""

    def __init__(self, buckets: List[Bucket], overlap: bool):
        self.buckets = sorted(buckets, key=lambda b: b.order)
        self.overlap = overlap
        self.ready = [set() for _ in self.buckets]
        self.launched = [False] * len(self.buckets)
        self.next = 0

    def mark(self, slot: Slot) -> None:
        b = slot.bucket
        if self.launched[b.order]:
            raise _late(slot)
        self.ready[b.order].add(id(slot))
        if self.overlap:
            while self.next < len(self.buckets) and len(self.ready[self.next]) == len(self.buckets[self.next].slots):
                self._go(self.next)

    def launch_rest(self) -> None:
        while self.next < len(self.buckets):
            self._go(self.next)

    def _go(self, i: int) -> None:
        self.launched[i] = True
        self.next = i + 1
        self.launch(self.buckets[i])

    def reset(self) -> None:
        for s in self.ready:
            s.clear()
        self.launched = [False] * len(self.buckets)
        self.next = 0

    def launch(self, b: Bucket) -> None:  # overridden
        raise RuntimeError("abstract")


class FullGradReducer(_InOrderLauncher):
    """Reduce full flat gradient buffers at the accumulation boundary (stages 0 and 1)."""

    def __init__(self, buckets, grad_bufs: List[torch.Tensor], n_parts: int, comm: _Comm, *, mode: str,
                 overlap: bool, predivide: float, comm_dtype: Optional[torch.dtype]):
        super().__init__(buckets, overlap)
        self.grad_bufs = grad_bufs
        self.n_parts = n_parts
        self.comm = comm
        self.mode = mode                  # "all_reduce" | "reduce_scatter" | "reduce"
        self.predivide = predivide
        self.comm_dtype = comm_dtype
        self.pending = []                 # (bucket, works, send buffer)
        self.armed = False

    def region(self, b: Bucket) -> torch.Tensor:
        return self.grad_bufs[b.group].narrow(0, b.flat_start, b.region_numel(self.n_parts))

    def mark_ready(self, slot: Slot) -> None:
        if self.armed:
            self.mark(slot)

    def launch(self, b: Bucket) -> None:
        region = self.region(b)
        if self.predivide != 1.0:
            region.div_(self.predivide)
        send = region if self.comm_dtype in (None, region.dtype) else region.to(self.comm_dtype)
        if self.comm.world == 1:
            works = []
        elif self.mode == "all_reduce":
            works = self.comm.all_reduce(send)
        elif self.mode == "reduce_scatter":
            works = self.comm.reduce_scatter_inplace(send, b.chunk)
        else:
            works = self.comm.reduce_to_owners(send, b.chunk)
        self.pending.append((b, works, send))

    def finish(self) -> None:
        """Launch what is left (unused parameters, overlap off), wait, copy back."""
        if not self.armed:
            return
        self.launch_rest()
        for b, works, send in self.pending:
            for w in works:
                w.wait()
            region = self.region(b)
            if send is not region:
                region.copy_(send)
        self.pending.clear()
        self.reset()
        self.armed = False


class PartitionGradReducer(_InOrderLauncher):
    """Reduce every micro-step's gradients into this rank's partition (stage 2)."""

    def __init__(self, buckets, part_grads: List[torch.Tensor], n_parts: int, comm: _Comm, *, reduce_scatter: bool,
                 overlap: bool, predivide: float, comm_dtype: torch.dtype, contiguous: bool, max_inflight: int = 2):
        super().__init__(buckets, overlap)
        self.part_grads = part_grads
        self.n_parts = n_parts
        self.comm = comm
        self.use_reduce_scatter = reduce_scatter
        self.predivide = predivide
        self.comm_dtype = comm_dtype
        self.contiguous = contiguous
        self.max_inflight = max(1, max_inflight)
        self.staging = {}                 # bucket order -> staging buffer
        self.written = {}                 # bucket order -> ids of the slots written this micro-step
        self.spare = []                   # staging buffers of completed buckets, reused within the step
        self.bases = {}                   # bucket order -> the (maybe larger) buffer its staging slices
        self.held = {}                    # bucket order -> [(slot, grad)] when not contiguous
        self.pending = []                 # (bucket, works, out)
        # one rank, nothing to divide: a bucket would only be zeroed, filled and added back, so
        # a gradient on the partition's device is added straight into the partition (a
        # gradient on another device - offload - still goes through a staging buffer, so the
        # bucket makes one transfer)
        self.direct = comm.world == 1 and predivide == 1.0 and contiguous

    def add_grad(self, slot: Slot, grad: torch.Tensor) -> None:
        """Take ``grad`` (the parameter's gradient of this backward) into the bucket."""
        b = slot.bucket
        if self.launched[b.order]:
            raise _late(slot)
        if self.direct and grad.device == self.part_grads[b.group].device:
            self.part_grads[b.group].narrow(0, b.part_start + slot.bucket_offset, slot.numel).add_(grad.reshape(-1))
        elif self.contiguous:
            self._write(b, slot, grad)
        else:
            self.held.setdefault(b.order, []).append((slot, grad))
        self.mark(slot)

    def _write(self, b: Bucket, slot: Slot, grad: torch.Tensor) -> None:
        """``grad`` into ``slot``'s place in ``b``'s staging buffer: copied the first time in a
        micro-step, added after that (a parameter used twice, reentrant checkpointing)."""
        dst = self._staging(b).narrow(0, slot.bucket_offset, slot.numel)
        written = self.written[b.order]
        if id(slot) in written:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            written.add(id(slot))

    def _staging(self, b: Bucket) -> torch.Tensor:
        """``b``'s staging buffer, not zeroed: each slot's first gradient is copied in and what
        no gradient wrote is zeroed at launch (``_zero_unwritten``), so the buffer is written
        once, not zero-filled and then added into. Buffers of buckets already reduced in this
        backward are reused (they are released at ``finish``, so nothing is held between steps)."""
        buf = self.staging.get(b.order)
        if buf is None:
            n = b.region_numel(self.n_parts)
            dev = self.part_grads[b.group].device
            for i, spare in enumerate(self.spare):
                if spare.numel() >= n and spare.device == dev:
                    base = self.spare.pop(i)
                    break
            else:   # none fits: free them (memory stays at what the buckets in flight need)
                self.spare.clear()
                base = transient_buffer(n, self.comm_dtype, dev)
            buf = base if base.numel() == n else base[:n]
            self.staging[b.order] = buf
            self.bases[b.order] = base
            self.written[b.order] = set()
        return buf

    def _zero_unwritten(self, b: Bucket, buf: torch.Tensor) -> None:
        """Zero what no gradient wrote in this micro-step: the slots of parameters that got no
        gradient and the padding after the last slot."""
        written = self.written.pop(b.order, ())
        if len(written) < len(b.slots):
            for slot in b.slots:
                if id(slot) not in written:
                    buf.narrow(0, slot.bucket_offset, slot.numel).zero_()
        if buf.numel() > b.numel:
            buf.narrow(0, b.numel, buf.numel() - b.numel).zero_()

    def launch(self, b: Bucket) -> None:
        if self.direct and b.order not in self.staging:
            return   # every gradient of the bucket went straight into the partition
        for slot, g in self.held.pop(b.order, []):
            self._write(b, slot, g)
        buf = self._staging(b)
        self._zero_unwritten(b, buf)
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        r, c = self.comm.rank, b.chunk
        if self.comm.world == 1:
            works, out = [], buf
        else:
            out = buf[r * c:(r + 1) * c]
            works = (self.comm.reduce_scatter_inplace(buf, c) if self.use_reduce_scatter
                     else self.comm.reduce_to_owners(buf, c))
        self.pending.append((b, works, out))
        if len(self.pending) > self.max_inflight:
            self._complete(self.pending.pop(0))

    def _complete(self, item) -> None:
        b, works, out = item
        for w in works:
            w.wait()
        self.part_grads[b.group].narrow(0, b.part_start, b.chunk).add_(out)
        self.staging.pop(b.order, None)
        base = self.bases.pop(b.order, None)
        if base is not None:
            self.spare.append(base)

    def finish(self) -> None:
        self.launch_rest()
        while self.pending:
            self._complete(self.pending.pop(0))
        self.staging.clear()
        self.written.clear()
        self.spare.clear()
        self.bases.clear()
        self.held.clear()
        self.reset()
