"""Reduce-scatter of full gradients into their owners' partitions, in buckets.

Gradient hooks hand each parameter's full gradient to :class:`GradReducer` as soon
as autograd has accumulated it. Once the pending gradients reach
``reduce_bucket_size`` elements they are laid out rank-major (every rank's slice
of every parameter side by side) in one buffer and reduce-scattered
asynchronously, so communication overlaps the rest of backward; at most two
buckets are in flight, which bounds the transient memory by the bucket size. Each
rank receives its averaged slice of every parameter in the bucket and hands it to
``sink(param, slice)``, which accumulates it into the partitioned gradient.
"""
from __future__ import annotations

import torch

from .stage3_comm import KIND_REDUCE, CheckedComm

_MAX_INFLIGHT = 2


class GradReducer:
    def __init__(self, comm: CheckedComm, bucket_size: int, sink, *, overlap: bool = True, comm_dtype=None,
                 predivide: float = 1.0):
        self.comm = comm
        self.bucket_size = max(1, int(bucket_size))
        self.sink = sink
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide = float(predivide)
        self.pending = []
        self.pending_numel = 0
        self.inflight = []
        self.launches = 0
        self.peak_buffer_bytes = 0     # largest bucket buffers alive at once (input + output)

    def add(self, p, grad: torch.Tensor) -> None:
        s = p.ds_tensor.numel()
        if s == 0:
            return
        self.pending.append((p, grad))
        self.pending_numel += s * self.comm.world_size
        if self.pending_numel >= self.bucket_size:
            self._launch()

    def flush(self) -> None:
        if self.pending:
            self._launch()
        while self.inflight:
            self._finish_oldest()

    def _launch(self) -> None:
        items, self.pending, self.pending_numel = self.pending, [], 0
        ws = self.comm.world_size
        params = [p for p, _ in items]
        sizes = [p.ds_tensor.numel() for p in params]
        total = sum(sizes)
        self.comm.check(KIND_REDUCE, [p.ds_id for p in params], total * ws, self.comm.describe(params))
        dtypes = {g.dtype for _, g in items}
        dtype = self.comm_dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
        inp = torch.empty(ws, total, dtype=dtype, device=items[0][1].device)
        off = 0
        for (p, g), s in zip(items, sizes):
            flat = g.reshape(-1)
            n = flat.numel()
            k = min(n // s, ws)
            if k:
                inp[:k, off:off + s].copy_(flat[:k * s].view(k, s))
            if k < ws:
                rem = n - k * s
                if rem:
                    inp[k, off:off + rem].copy_(flat[k * s:])
                inp[k, off + rem:off + s].zero_()
                inp[k + 1:, off:off + s].zero_()
            off += s
        del items
        if self.predivide != 1.0:
            inp.div_(self.predivide)
        out = torch.empty(total, dtype=dtype, device=inp.device)
        work = self.comm.reduce_scatter(out, inp.view(-1), async_op=self.overlap)
        self.inflight.append((params, sizes, out, work, inp))
        self.launches += 1
        live = sum(b[4].numel() * b[4].element_size() + b[2].numel() * b[2].element_size() for b in self.inflight)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, live)
        if not self.overlap:
            self._finish_oldest()
        while len(self.inflight) > _MAX_INFLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        params, sizes, out, work, _inp = self.inflight.pop(0)
        if work is not None:
            work.wait()
        scale = self.predivide / self.comm.world_size
        if scale != 1.0:
            out.mul_(scale)
        off = 0
        for p, s in zip(params, sizes):
            self.sink(p, out[off:off + s])
            off += s
