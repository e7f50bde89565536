"""Reduce-scatter of full gradients into their owners' partitions, in buckets.

Gradient hooks hand each parameter's full gradient to :class:`GradReducer` as soon
as autograd has accumulated it (``p.grad`` is taken, not copied). When the pending
gradients reach half a bucket - ``reduce_bucket_size / 2`` elements (``cap =
reduce_bucket_size / N`` columns, never more than the trainable parameters need) -
one fused ``torch._chunk_cat`` lays them out as an ``(N, cols)`` buffer whose row
``r`` holds rank ``r``'s slice of every pending gradient (zero-padded), the full
gradients are dropped, and the buffer is reduce-scattered asynchronously (its rows
are the per-rank inputs). Pending gradients and their laid-out copy together stay
within ``reduce_bucket_size`` elements; one such buffer reduces while the next
fills (with one rank and no replicas there is nothing to reduce: each gradient goes straight
into its partition's gradient). Each rank receives its averaged slice of every parameter
of the bucket. The columns are ordered by the owner's layout (``order``), so a
``sink_many`` can add runs of adjacent partitions with one operation each; without
it, ``sink(param, slice)`` per parameter. No per-parameter copy on the hot path.
"""
from __future__ import annotations

import torch

from .stage3_comm import KIND_REDUCE, CheckedComm

_MAX_INFLIGHT = 1   # one bucket reducing while the next fills (2 was not faster on CPU; more memory)


class _Bucket:
    def __init__(self, buf, items):
        self.buf = buf          # (world_size, cols)
        self.items = items      # (param, column offset, partition size)
        self.fill = buf.shape[1]
        self.out = None
        self.work = None
        self.nbytes = 0


class GradReducer:
    def __init__(self, comm: CheckedComm, bucket_size: int, sink, *, overlap: bool = True, comm_dtype=None,
                 predivide: float = 1.0, max_columns: int = None, sink_many=None, order=None, replica=None,
                 direct: bool = True):
        self.comm = comm
        self.replica = replica               # MiCS: the reduced slices are all-reduced across replicas
        self.cap = max(1, int(bucket_size) // comm.world_size)
        if max_columns is not None:          # no bucket larger than what all trainable params need
            self.cap = max(1, min(self.cap, int(max_columns)))
        self.sink = sink
        self.sink_many = sink_many           # (items, out) -> None: a whole bucket's slices at once
        self.order = order                   # param -> sort key of its column in a bucket
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide = float(predivide)
        self.pending = []                    # (param, full gradient, partition size)
        self.pending_cols = 0
        self.pending_bytes = 0               # the pending gradients and their laid-out copy
        self.inflight = []
        self.inflight_bytes = 0
        self.launches = 0
        # one rank, no replicas: nothing to reduce, so no bucket - each gradient is added into its
        # partition's gradient as it arrives (no copy into a bucket, no memory beyond it). The
        # owner turns it off where the partitions' gradients live on another device (offload):
        # there a bucket makes one transfer of many small gradients.
        self.direct = bool(direct) and comm.world_size == 1 and replica is None
        self.peak_buffer_bytes = 0     # most bucket bytes alive at once (transient memory)

    @property
    def open(self):   # the bucket being filled: None when nothing is pending
        return self.pending or None

    def take(self, p) -> None:
        """Take ``p.grad`` into the pending bucket (``p.grad`` becomes None)."""
        grad, p.grad = p.grad, None
        self.add(p, grad)

    def add(self, p, grad: torch.Tensor, _owned: bool = True) -> None:
        s = p.ds_tensor.numel()
        if s == 0:
            return
        if self.direct and (self.comm_dtype is None or self.comm_dtype == grad.dtype) and grad.numel() == s:
            self.sink(p, grad.reshape(-1))
            return
        # launched at half a bucket: the pending full gradients and the buffer they are laid out
        # into then fit together in reduce_bucket_size elements, the memory one bucket had when
        # each gradient was copied in on arrival
        half = max(1, self.cap // 2)
        if self.pending and self.pending_cols + s > half:
            self._launch()
        self.pending.append((p, grad, s))
        self.pending_cols += s
        self.pending_bytes += 2 * s * self.comm.world_size * grad.element_size()
        if self.pending_cols >= half:
            self._launch()

    def flush(self) -> None:
        if self.pending:
            self._launch()
        while self.inflight:
            self._finish_oldest()

    def _layout(self, pending) -> torch.Tensor:
        """(world_size, sum of partition sizes): row r = elements [r*s, (r+1)*s) of each gradient."""
        ws = self.comm.world_size
        flats = [g.reshape(-1) for _, g, _ in pending]
        dtype = self.comm_dtype or flats[0].dtype
        if len({f.dtype for f in flats}) > 1:
            flats = [f.to(dtype) for f in flats]
        if ws == 1:
            buf = flats[0].view(1, -1) if len(flats) == 1 else torch.cat(flats).view(1, -1)
            if len(flats) == 1 and self.predivide != 1.0:
                buf = buf.clone()    # the caller's gradient is not divided in place
        else:
            buf = torch._chunk_cat(flats, 0, ws)
        return buf.to(dtype) if buf.dtype != dtype else buf

    def _launch(self) -> None:
        pending, self.pending, self.pending_cols = self.pending, [], 0
        pending_bytes, self.pending_bytes = self.pending_bytes, 0
        if not pending:
            return
        if self.order is not None and len(pending) > 1:
            pending.sort(key=lambda x: self.order(x[0]))
        params = [p for p, _, _ in pending]
        items, off = [], 0
        for p, _, s in pending:
            items.append((p, off, s))
            off += s
        self._account(pending_bytes)
        buf = self._layout(pending)
        del pending              # the full gradients go here: only the laid-out bucket remains
        b = _Bucket(buf, items)
        if self.comm.active:
            self.comm.check(KIND_REDUCE, [p.ds_id for p in params], b.fill * self.comm.world_size,
                            lambda: self.comm.describe(params))
        if self.predivide != 1.0:
            b.buf.div_(self.predivide)
        if self.comm.world_size == 1:     # nothing to reduce: the bucket is this rank's slice
            b.out = b.buf.view(-1)
        else:   # the laid-out bucket is ours: the communicator may reduce it in place
            b.out, b.work = self.comm.reduce_rows(b.buf, async_op=self.overlap)
        self.inflight.append(b)
        b.nbytes = b.buf.numel() * b.buf.element_size() + (
            0 if b.out.untyped_storage().data_ptr() == b.buf.untyped_storage().data_ptr()
            else b.out.numel() * b.out.element_size())
        self.inflight_bytes += b.nbytes
        self.launches += 1
        self._account()
        if not self.overlap:
            self._finish_oldest()
        while len(self.inflight) > _MAX_INFLIGHT:
            self._finish_oldest()

    def _account(self, pending_bytes: int = 0) -> None:
        # the buckets in flight, and while a bucket is laid out: its pending full gradients and
        # the (N, cols) buffer (counters kept as buckets come and go: no pass over them per launch)
        n = self.inflight_bytes + pending_bytes
        if n > self.peak_buffer_bytes:
            self.peak_buffer_bytes = n

    def _finish_oldest(self) -> None:
        b = self.inflight.pop(0)
        self.inflight_bytes -= b.nbytes
        if b.work is not None:
            b.work.wait()
        scale = self.predivide / self.comm.world_size
        if self.replica is not None:
            if self.comm.world_size == 1:   # one rank per shard: out may be the caller's gradient
                b.out = b.out.clone()
            self.replica.all_reduce(b.out)
            scale /= self.replica.world_size
        if scale != 1.0:
            b.out.mul_(scale)
        if self.sink_many is not None:
            self.sink_many(b.items, b.out)
        else:
            for p, off, s in b.items:
                self.sink(p, b.out[off:off + s])
        b.buf = b.out = b.items = None
