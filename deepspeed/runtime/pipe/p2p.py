"""Point-to-point transport of activations and gradients between adjacent stages.

A transfer on a channel starts with one *lead* message, whose first 16 bytes are a
two-int64 header ``[kind, n]`` and whose size both sides know: the header plus the tensors
of the channel's last transfer, packed (16-byte aligned), or just the header before the
first transfer.

* ``kind = 0`` (SAME): the tensors have the same description as last time on this
  channel and are inside the lead: one message per transfer.
* ``kind = 1`` (NEW): a new description follows (``n`` int64s: per tensor dtype code,
  requires_grad, ndim, shape...; activations only), then the tensors, one message each.
  Descriptions are therefore sent once and again only when a shape or dtype changes.
* ``kind = 2`` (ABORT, sent on both channels): ``n`` bytes of UTF-8 error text follow; the
  receiver raises :class:`PipelineError` with it (and the engine passes the abort on), so
  an exception on one stage stops every stage instead of leaving them blocked in ``recv``.

Activations and gradients travel with two different tags, so the two directions of traffic
between one pair of ranks (interleaved schedules wrap around) never match each other; every
engine gets its own pair of tags, so messages a failed engine left behind never reach a new one.
Sends are non-blocking (``isend``) and completed by :meth:`P2P.wait_sends`; receives
block with a timeout (``pipeline.p2p_timeout`` seconds in the config, default 300),
after which they raise naming the peer stage. Boolean tensors travel as uint8.

Over gloo, the leads are posted ahead (:meth:`P2P.plan`), so the sender's message goes out
at once and lands while the receiver computes.
"""
from __future__ import annotations

import datetime
import math
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
SAME, NEW, ABORT = 0, 1, 2
ACT_TAG, GRAD_TAG = 1, 2   # activations and gradients are separate channels (tags)
_CHANNELS = [0]            # P2P objects made in this process (engines are built collectively, so
                           # the count agrees across ranks): each gets its own pair of tags
ABORT_WAIT_S = 3.0


class PipelineError(RuntimeError):
    """A pipeline stage failed or a peer stopped answering (``src``: the global rank that told us)."""

    def __init__(self, message: str, src: Optional[int] = None):
        super().__init__(message)
        self.src = src


def _describe(tensors: Sequence[torch.Tensor], is_tuple: bool) -> List[int]:
    meta = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"pipeline: cannot send a tensor of dtype {t.dtype} between stages "
                            f"(supported: {[str(d) for d in _DTYPES]}).")
        meta += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return meta


def _parse(meta: List[int]):
    is_tuple, n, pos, out = bool(meta[0]), meta[1], 2, []
    for _ in range(n):
        dtype, rg, nd = _DTYPES[meta[pos]], bool(meta[pos + 1]), meta[pos + 2]
        shape = tuple(meta[pos + 3:pos + 3 + nd])
        pos += 3 + nd
        out.append((dtype, rg, shape))
    return is_tuple, out


HDR_BYTES = 16    # the header: two int64 [kind, n]
ALIGN = 16        # byte offset of each tensor inside a packed message


def _packed_size(shapes) -> int:
    """Bytes of a message holding the header and tensors of ``shapes`` ([(dtype, shape)])."""
    size = HDR_BYTES
    for dtype, shape in shapes:
        size = -(-size // ALIGN) * ALIGN + math.prod(shape) * dtype.itemsize
    return size


def _unpack(buf: torch.Tensor, shapes) -> List[torch.Tensor]:
    out, off = [], HDR_BYTES
    for dtype, shape in shapes:
        off = -(-off // ALIGN) * ALIGN
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[off:off + n].view(dtype).view(shape))
        off += n
    return out


_ABANDONED: list = []   # receives left posted by a failed schedule: kept alive, never freed under gloo


class P2P:
    """Channels of one stage to its neighbours (global ranks ``prev``/``next``, None at the ends).

    Every transfer on a channel starts with one *lead* message of a size both sides know:
    the header followed by the tensors, packed, in the shapes of the channel's last
    transfer (just the 16-byte header before the first one). When the shapes are the
    same (``kind`` SAME) the lead is the whole transfer: one message. Otherwise the lead's
    header says NEW (the description, for activations, and the tensors follow as messages
    of their own) or ABORT (the error text follows). Received tensors are views into the
    lead.

    Receives are posted ahead (over gloo, see :meth:`plan`): :meth:`plan` says how many
    receives each channel will see in the coming schedule; the first lead is posted at
    once and each later one as soon as the one before it is consumed. Gloo sends a
    message only once the receiver has posted a matching receive, so a receive posted
    when the data is needed costs a round trip on the critical path; posted ahead, the
    sender's message goes out at once and lands while the receiver computes."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device="cpu",
                 timeout_s: Optional[float] = None, stage_id: int = 0):
        self.prev, self.next = prev_rank, next_rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self.stage_id = stage_id
        self._sent_meta = {}      # (peer, tag) -> description last sent
        self._recv_meta = {}      # (peer, tag) -> parsed description last received
        self._sent_shapes = {}    # (peer, tag) -> [(wire dtype, shape)] last sent
        self._recv_shapes = {}    # (peer, tag) -> [(wire dtype, shape)] last received
        self._posted = {}         # (peer, tag) -> (lead buffer, work) posted ahead (one per channel)
        self._ahead = {}          # (peer, tag) -> receives still to post in this schedule
        self._works = []          # (work, tensor) pending isends
        self.bytes_sent = 0
        self.descriptions_sent = 0   # how often a (new) tensor description went out
        self.messages_sent = 0
        self.posted_ahead = 0        # receives that were posted before they were needed
        self.post_ahead = dist.is_initialized() and dist.get_backend() == "gloo"
        self._same = torch.tensor([SAME, 0], dtype=torch.int64, device=device).view(torch.uint8)
        # a fresh pair of tags per engine: messages left over by a failed engine (abort
        # notices) can never be read by a later one
        _CHANNELS[0] += 1
        self.act_tag, self.grad_tag = 2 * _CHANNELS[0] + ACT_TAG, 2 * _CHANNELS[0] + GRAD_TAG

    # ------------------------------------------------------------------ helpers
    def _isend(self, t: torch.Tensor, dst: int, tag: Optional[int] = None):
        t = t.contiguous()
        self._works.append((dist.isend(t, dst, tag=self.act_tag if tag is None else tag), t))
        self.bytes_sent += t.numel() * t.element_size()
        self.messages_sent += 1

    def _wait(self, work, src: int, what: str):
        try:
            ok = work.wait(self.timeout) if self.timeout is not None else work.wait()
        except RuntimeError as err:
            raise PipelineError(f"pipeline stage {self.stage_id}: receiving {what} from global rank {src} "
                                f"failed or timed out (pipeline.p2p_timeout / the process group timeout): "
                                f"{err}", src) from None
        if ok is False:
            raise PipelineError(f"pipeline stage {self.stage_id}: no {what} from global rank {src} within "
                                f"{self.timeout.total_seconds():.0f}s (pipeline.p2p_timeout).", src)

    def _recv(self, t: torch.Tensor, src: int, what: str, tag: Optional[int] = None):
        self._wait(dist.irecv(t, src, tag=self.act_tag if tag is None else tag), src, what)
        return t

    def _post(self, src: int, tag: int):
        lead = torch.empty(_packed_size(self._recv_shapes.get((src, tag), ())), dtype=torch.uint8,
                           device=self.device)
        return lead, dist.irecv(lead, src, tag=tag)

    def _lead(self, dst: int, tag: int, kind: int, n: int, tensors=()) -> torch.Tensor:
        """The lead message for ``dst``: the header, then ``tensors`` packed (SAME) or
        nothing (NEW/ABORT: a placeholder of the size the receiver posted)."""
        if kind == SAME:   # one concatenation: header, then each tensor's bytes at a 16-byte offset
            parts, size = [self._same], HDR_BYTES
            for t in tensors:
                if size % ALIGN:
                    parts.append(torch.zeros(ALIGN - size % ALIGN, dtype=torch.uint8, device=self.device))
                    size += ALIGN - size % ALIGN
                parts.append(t.reshape(-1).view(torch.uint8))
                size += t.numel() * t.element_size()
            return torch.cat(parts)
        buf = torch.zeros(_packed_size(self._sent_shapes.get((dst, tag), ())), dtype=torch.uint8, device=self.device)
        buf[:HDR_BYTES].view(torch.int64).copy_(torch.tensor([kind, n], dtype=torch.int64))
        return buf

    def plan(self, receives: dict) -> None:
        """``{(peer, tag): n}``: the receives each channel will see in the coming schedule;
        the first of each is posted now. Gloo only: NCCL runs the sends and receives between
        two ranks in order on one stream, so a receive posted ahead of a send to the same
        peer would hold that send back (the stages would wait on each other)."""
        self.abandon()
        if not self.post_ahead:
            return
        self._ahead = {k: n for k, n in receives.items() if n > 0 and k[0] is not None}
        for key in list(self._ahead):
            self._post_next(key)

    def _post_next(self, key) -> None:
        n = self._ahead.get(key, 0)
        if n > 0 and key not in self._posted:
            self._ahead[key] = n - 1
            self._posted[key] = self._post(*key)

    def _take(self, src: int, tag: int, what: str):
        """The next transfer's lead on a channel: (kind, n, lead buffer)."""
        posted = self._posted.pop((src, tag), None)
        if posted is None:
            posted = self._post(src, tag)
        else:
            self.posted_ahead += 1
        lead, work = posted
        self._wait(work, src, what)
        kind, n = lead[:HDR_BYTES].view(torch.int64).tolist()
        if kind == ABORT:
            text = self._recv(torch.zeros(n, dtype=torch.uint8, device=self.device), src, "abort message", tag)
            raise PipelineError(bytes(text.tolist()).decode("utf-8", "replace"), src)
        return kind, n, lead

    def abandon(self) -> None:
        """Forget receives posted ahead (after a failed schedule); gloo keeps their buffers."""
        _ABANDONED.extend(self._posted.values())
        self._posted.clear()
        self._ahead.clear()

    def wait_sends(self) -> None:
        for w, _ in self._works:
            w.wait()
        self._works.clear()

    # ------------------------------------------------------------------ activations
    def send_tensors(self, tensors: Sequence[torch.Tensor], dst: int, is_tuple: bool = True) -> None:
        wire = [(t.to(torch.uint8) if t.dtype == torch.bool else t).detach() for t in tensors]
        meta = _describe(tensors, is_tuple)
        key = (dst, self.act_tag)
        if self._sent_meta.get(key) != meta:
            self._isend(self._lead(dst, self.act_tag, NEW, len(meta)), dst)
            self._isend(torch.tensor(meta, dtype=torch.int64, device=self.device), dst)
            for t in wire:
                self._isend(t, dst)
            self._sent_meta[key] = meta
            self.descriptions_sent += 1
        else:
            self._isend(self._lead(dst, self.act_tag, SAME, 0, wire), dst)
        self._sent_shapes[key] = [(t.dtype, tuple(t.shape)) for t in wire]

    def recv_tensors(self, src: int, what: str = "activations"):
        """The tensors sent (a tuple, or one tensor when a single tensor was sent)."""
        key = (src, self.act_tag)
        kind, n, lead = self._take(src, self.act_tag, what)
        if kind == NEW:
            meta = self._recv(torch.zeros(n, dtype=torch.int64, device=self.device), src, what).tolist()
            self._recv_meta[key] = _parse(meta)
        elif key not in self._recv_meta:
            raise PipelineError(f"pipeline stage {self.stage_id}: {what} from rank {src} arrived without a "
                                f"description; the stages are out of step.")
        is_tuple, descr = self._recv_meta[key]
        shapes = [(torch.uint8 if dtype == torch.bool else dtype, shape) for dtype, _, shape in descr]
        if kind == NEW:
            data = [self._recv(torch.empty(shape, dtype=wire, device=self.device), src, what)
                    for wire, shape in shapes]
        else:
            data = _unpack(lead, shapes)
        self._recv_shapes[key] = shapes
        self._post_next(key)
        out = []
        for (dtype, rg, _), t in zip(descr, data):
            if dtype == torch.bool:
                t = t.to(torch.bool)
            if rg and t.is_floating_point():
                t.requires_grad_(True)
            out.append(t)
        return tuple(out) if is_tuple else out[0]

    # ------------------------------------------------------------------ gradients
    def send_grads(self, grads: Sequence[torch.Tensor], dst: int) -> None:
        key = (dst, self.grad_tag)
        grads = [g.detach() for g in grads]
        shapes = [(g.dtype, tuple(g.shape)) for g in grads]
        if self._sent_shapes.get(key) == shapes:
            self._isend(self._lead(dst, self.grad_tag, SAME, 0, grads), dst, self.grad_tag)
        else:   # first time, or new shapes: the tensors follow the lead
            self._isend(self._lead(dst, self.grad_tag, NEW, 0), dst, self.grad_tag)
            for g in grads:
                self._isend(g, dst, self.grad_tag)
        self._sent_shapes[key] = shapes

    def recv_grads(self, like: Sequence[torch.Tensor], src: int) -> List[torch.Tensor]:
        key = (src, self.grad_tag)
        kind, _, lead = self._take(src, self.grad_tag, "gradients")
        shapes = [(t.dtype, tuple(t.shape)) for t in like]
        if kind == NEW:
            data = [self._recv(torch.empty(shape, dtype=dtype, device=self.device), src, "gradients", self.grad_tag)
                    for dtype, shape in shapes]
        elif self._recv_shapes.get(key) != shapes:
            raise PipelineError(f"pipeline stage {self.stage_id}: gradients from rank {src} do not match the "
                                f"outputs they belong to; the stages are out of step.")
        else:
            data = _unpack(lead, shapes)
        self._recv_shapes[key] = shapes
        self._post_next(key)
        return data

    # ------------------------------------------------------------------ abort
    def abort(self, message: str, skip: Optional[int] = None) -> None:
        """Tell both neighbours (except ``skip``) that this stage failed. Waits at most
        ``ABORT_WAIT_S`` for each neighbour to read the notice on one of the two channels
        (so it arrives before this process can exit), never longer."""
        data = torch.tensor(list(message.encode("utf-8")[:4000]), dtype=torch.uint8, device=self.device)
        pending = {}                                  # peer -> its works (one pair per channel)
        for peer in {self.prev, self.next}:
            if peer is None or peer == skip:
                continue
            for tag in (self.act_tag, self.grad_tag):   # the neighbour may be waiting on either channel
                try:
                    lead = self._lead(peer, tag, ABORT, data.numel())   # the size the neighbour posted
                    works = [dist.isend(lead, peer, tag=tag), dist.isend(data, peer, tag=tag)]
                    pending.setdefault(peer, []).append(works)
                except Exception:  # noqa: BLE001 - best effort while failing
                    pass
        deadline = time.monotonic() + ABORT_WAIT_S
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                if any(all(w.is_completed() for w in pair) for pair in pending[peer]):
                    del pending[peer]
            time.sleep(0.005)
