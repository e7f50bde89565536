"""Reduce-scatter of full gradients into their owners' partitions, in buckets.

Gradient hooks hand each parameter's full gradient to :class:`GradReducer` as soon
as autograd has accumulated it. The gradient is copied at once into the open
bucket - an ``(N, cap)`` buffer whose row ``r`` collects rank ``r``'s slice of every
parameter in the bucket - and the full gradient is freed, so at most one full
gradient exists outside the buckets. A bucket holds at most ``reduce_bucket_size``
elements (``cap = reduce_bucket_size / N`` columns, never more than the trainable
parameters need); when the next slice does not fit, the bucket is reduce-scattered
asynchronously (its rows are the per-rank inputs, so no re-layout copy is needed)
and a new one opens. One bucket reduces while the next fills, which bounds the
transient memory by twice the bucket size (plus the received slices). Each rank
receives its averaged slice of every parameter of the bucket and hands it to
``sink(param, slice)``.
"""
from __future__ import annotations

import torch

from .stage3_comm import KIND_REDUCE, CheckedComm

_MAX_INFLIGHT = 1   # one bucket reducing while the next fills (2 was not faster on CPU; more memory)


class _Bucket:
    def __init__(self, buf):
        self.buf = buf          # (world_size, cap)
        self.items = []         # (param, column offset, partition size)
        self.fill = 0
        self.out = None
        self.work = None


class GradReducer:
    def __init__(self, comm: CheckedComm, bucket_size: int, sink, *, overlap: bool = True, comm_dtype=None,
                 predivide: float = 1.0, max_columns: int = None):
        self.comm = comm
        self.cap = max(1, int(bucket_size) // comm.world_size)
        if max_columns is not None:          # no bucket larger than what all trainable params need
            self.cap = max(1, min(self.cap, int(max_columns)))
        self.sink = sink
        self.overlap = overlap
        self.comm_dtype = comm_dtype
        self.predivide = float(predivide)
        self.open = None
        self.inflight = []
        self.launches = 0
        self.peak_buffer_bytes = 0     # most bucket bytes alive at once (transient memory)

    def take(self, p) -> None:
        """Move ``p.grad`` into the open bucket and drop it (``p.grad`` becomes None) before a
        full bucket is launched, so the full gradient is not alive during the reduce-scatter."""
        grad, p.grad = p.grad, None
        self.add(p, grad, _owned=True)

    def add(self, p, grad: torch.Tensor, _owned: bool = False) -> None:
        s = p.ds_tensor.numel()
        if s == 0:
            return
        if self.open is not None and self.open.fill + s > self.open.buf.shape[1]:
            self._launch()
        if self.open is None:
            ws = self.comm.world_size
            dtype = self.comm_dtype or grad.dtype
            self.open = _Bucket(torch.empty(ws, max(self.cap, s), dtype=dtype, device=grad.device))
            self._account()
        b = self.open
        self._copy_in(b.buf, b.fill, s, grad.reshape(-1))
        if _owned:
            del grad          # the caller holds no other reference: freed here
        b.items.append((p, b.fill, s))
        b.fill += s
        if b.fill >= b.buf.shape[1]:
            self._launch()

    def _copy_in(self, buf, off, s, flat) -> None:
        """Row r, columns [off, off+s): elements [r*s, (r+1)*s) of the gradient, zero-padded."""
        ws, n = buf.shape[0], flat.numel()
        k = min(n // s, ws)
        if k:
            buf[:k, off:off + s].copy_(flat[:k * s].view(k, s))
        if k < ws:
            rem = n - k * s
            if rem:
                buf[k, off:off + rem].copy_(flat[k * s:])
            buf[k, off + rem:off + s].zero_()
            buf[k + 1:, off:off + s].zero_()

    def flush(self) -> None:
        if self.open is not None and self.open.items:
            self._launch()
        self.open = None
        while self.inflight:
            self._finish_oldest()

    def _launch(self) -> None:
        b, self.open = self.open, None
        if b is None or not b.items:
            return
        params = [p for p, _, _ in b.items]
        self.comm.check(KIND_REDUCE, [p.ds_id for p in params], b.fill * self.comm.world_size,
                        self.comm.describe(params))
        rows = b.buf[:, :b.fill]
        if self.predivide != 1.0:
            rows.div_(self.predivide)
        b.out = torch.empty(b.fill, dtype=b.buf.dtype, device=b.buf.device)
        b.work = self.comm.reduce_scatter_rows(b.out, rows, async_op=self.overlap)
        self.inflight.append(b)
        self.launches += 1
        self._account()
        if not self.overlap:
            self._finish_oldest()
        while len(self.inflight) > _MAX_INFLIGHT:
            self._finish_oldest()

    def _account(self) -> None:
        live = [x for x in self.inflight] + ([self.open] if self.open is not None else [])
        n = sum(x.buf.numel() * x.buf.element_size() + (x.out.numel() * x.out.element_size() if x.out is not None
                                                         else 0) for x in live)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, n)

    def _finish_oldest(self) -> None:
        b = self.inflight.pop(0)
        if b.work is not None:
            b.work.wait()
        scale = self.predivide / self.comm.world_size
        if scale != 1.0:
            b.out.mul_(scale)
        for p, off, s in b.items:
            self.sink(p, b.out[off:off + s])
        b.buf = b.out = b.items = None
