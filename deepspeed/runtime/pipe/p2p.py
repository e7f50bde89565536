"""Point-to-point transport of activations and gradients between adjacent stages.

A transfer on a channel (one peer, one direction, one kind of data) starts with one *lead*
message whose size both sides know without asking: a 16-byte header ``[kind, n]`` followed by
the tensors, packed (16-byte aligned), in the shapes of the transfer ``LAG`` (= 2) before it on
the channel (just the header for the first ``LAG`` transfers).

* ``kind = 0`` (SAME): the tensors have the description of the transfer ``LAG`` before and are
  inside the lead: one message per transfer. After the first ``LAG`` transfers of a shape this is
  every transfer.
* ``kind = 1`` (NEW): the tensors follow as messages of their own on the channel's *extras* tag,
  preceded by ``n`` int64s of description (per tensor dtype code, requires_grad, ndim, shape...;
  activations only) when it differs from the previous transfer's (``n = 0``: unchanged).
  Descriptions are therefore sent once, and again only when a shape or dtype changes.
* ``kind = 2`` (ABORT, sent on both channels): ``n`` bytes of UTF-8 error text follow on the
  extras tag; the receiver raises :class:`PipelineError` with it (and the engine passes the abort
  on), so an exception on one stage stops every stage instead of leaving them blocked in ``recv``.

Why ``LAG`` 2: a receiver can then keep two leads posted per channel (:meth:`P2P.plan`), the
second sized before the first has arrived. Why the extras tag: the follow-up messages of a NEW or
ABORT transfer must not land in a lead posted ahead.

Activations and gradients travel with different tags, so the two directions of traffic between
one pair of ranks (interleaved schedules wrap around) never match each other; every engine gets
its own tags, so messages a failed engine left behind never reach a new one. Sends are
non-blocking (``isend``) and completed by :meth:`P2P.wait_sends`; receives block with a timeout
(``pipeline.p2p_timeout`` seconds in the config, default 300), after which they raise naming the
peer stage. Boolean tensors travel as uint8.

Over gloo the leads are posted ahead (:meth:`P2P.plan`): the sender's message goes out at once
and lands while the receiver computes. Gloo's calls cost a socket write that wakes the peer
each (0.05-0.7 ms on this host, more under load), so new receives are posted where the stage
has just handed its own data on (after a send) or is about to wait anyway, not between a receive
and the compute that needs it, and not before the first stage's first forward. In 1F1B a stage's
send is followed by the wait for its neighbour's message, so what its thread does between the end
of a compute and the socket write, and between a receive's return and the next compute, is on the
critical path: there the stage packs and calls ``ProcessGroup.send`` directly (not the
``dist.isend`` wrapper), and reads the header through a NumPy view and the tensors through views
made when the receive was posted (where the stage waits anyway).
"""
from __future__ import annotations

import collections
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
ACT_TAG, GRAD_TAG = 0, 1   # activations and gradients are separate channels (tags)
EXTRAS = 2                 # + EXTRAS: the channel's tag for the follow-up messages of NEW/ABORT
LAG = 2                    # a lead is sized by the transfer LAG before it; up to LAG leads posted
_CHANNELS = [0]            # P2P objects made in this process (engines are built collectively, so
                           # the count agrees across ranks): each gets its own four tags
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


class _Posted:
    """A posted receive: ``lead`` (its buffer), ``header`` (the lead's first two int64s, a NumPy
    view on CPU), ``views`` (the tensors of a SAME transfer, views into the lead, made when it
    is posted) and ``work``."""

    __slots__ = ("lead", "header", "views", "work")

    def __init__(self, size: int, shapes, device, pg, src: int, tag: int):
        self.lead = torch.empty(size, dtype=torch.uint8, device=device)
        header = self.lead[:HDR_BYTES].view(torch.int64)
        self.header = header.numpy() if self.lead.device.type == "cpu" else header
        self.views = _unpack(self.lead, shapes) if shapes else []
        self.work = pg.recv([self.lead], src, tag) if pg is not None else dist.irecv(self.lead, src, tag=tag)


_ABANDONED: list = []   # receives left posted by a failed schedule: kept alive, never freed under gloo


class _Inbound:
    """Receiving side of one channel: leads posted ahead (oldest first, each with the history
    entry its size came from), receives still to post in this schedule, and the last ``LAG``
    transfers received (``(wire shapes, description)``, oldest first; None before any)."""

    __slots__ = ("posted", "todo", "hist", "descr")

    def __init__(self):
        self.posted = collections.deque()
        self.todo = 0
        self.hist = [None] * LAG
        self.descr = None          # the description of the last transfer (activations)


class P2P:
    """Channels of one stage to its neighbours (global ranks ``prev``/``next``, None at the ends).

    Every transfer on a channel starts with one *lead* message of a size both sides know: the
    header followed by the tensors, packed, in the shapes of the channel's transfer ``LAG``
    before (just the 16-byte header before there is one). When the shapes are those (``kind``
    SAME) the lead is the whole transfer: one message. Otherwise the lead's header says NEW (the
    description, when it changed, and the tensors follow on the extras tag) or ABORT (the error
    text follows there). Received tensors are views into the lead.

    Receives are posted ahead over gloo: :meth:`plan` says how many receives each channel will
    see in the coming schedule and posts the first of each; up to ``LAG`` more are posted as
    the stage goes, right after each of its sends and before each wait (see the module
    docstring). Gloo sends a message only once the receiver has posted a matching receive, so a
    receive posted when the data is needed costs a round trip on the critical path; posted
    ahead, the sender's message goes out at once and lands while the receiver computes."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device="cpu",
                 timeout_s: Optional[float] = None, stage_id: int = 0):
        self.prev, self.next = prev_rank, next_rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self.stage_id = stage_id
        self._in = {}             # (peer, tag) -> _Inbound
        self._out_hist = {}       # (peer, tag) -> the last LAG transfers sent: (wire shapes, description)
        self._out_meta = {}       # (peer, tag) -> the description of the last transfer sent
        self._force_desc = set()  # channels whose next transfer sends its description again
        self._works = []          # (work, tensor) pending isends
        self._pads = {}
        self.bytes_sent = 0
        self.descriptions_sent = 0   # how often a (new) tensor description went out
        self.messages_sent = 0
        self.posted_ahead = 0        # receives that were posted before they were needed
        self.post_ahead = dist.is_initialized() and dist.get_backend() == "gloo"
        # gloo: sends and receives call the default group directly (a global rank is its rank
        # there), without dist.isend/irecv's wrapper
        self._pg = dist.group.WORLD if self.post_ahead else None
        self._same = torch.tensor([SAME, 0], dtype=torch.int64, device=device).view(torch.uint8)
        # fresh tags per engine: messages left over by a failed engine (abort notices) can never
        # be read by a later one
        _CHANNELS[0] += 1
        base = 4 * _CHANNELS[0]
        self.act_tag, self.grad_tag = base + ACT_TAG, base + GRAD_TAG

    # ------------------------------------------------------------------ helpers
    def _isend(self, t: torch.Tensor, dst: int, tag: int):
        t = t.contiguous()
        self._works.append((self._pg.send([t], dst, tag) if self._pg is not None else dist.isend(t, dst, tag=tag), t))
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

    def _recv(self, t: torch.Tensor, src: int, what: str, tag: int):
        self._wait(dist.irecv(t, src, tag=tag), src, what)
        return t

    def _post(self, key, inb: _Inbound) -> None:
        """Post the lead of the channel's next unposted transfer (sized by the one LAG before)."""
        entry = inb.hist[len(inb.posted)]
        shapes = entry[0] if entry is not None else ()
        inb.posted.append((_Posted(_packed_size(shapes), shapes, self.device, self._pg, key[0], key[1]), entry))
        if inb.todo > 0:
            inb.todo -= 1

    def _top_up(self) -> None:
        """Post the receives due: up to LAG per channel, within the schedule's count."""
        for key, inb in self._in.items():
            while inb.todo > 0 and len(inb.posted) < LAG:
                self._post(key, inb)

    def _packed(self, wire) -> torch.Tensor:
        """A SAME lead: the header, then each tensor's bytes at a 16-byte offset (one concatenation)."""
        parts, size = [self._same], HDR_BYTES
        for t in wire:
            pad = -size % ALIGN
            if pad:
                if pad not in self._pads:
                    self._pads[pad] = torch.zeros(pad, dtype=torch.uint8, device=self.device)
                parts.append(self._pads[pad])
                size += pad
            parts.append(t.reshape(-1).view(torch.uint8))
            size += t.numel() * t.element_size()
        return torch.cat(parts)

    def _placeholder(self, key, kind: int, n: int) -> torch.Tensor:
        """A NEW/ABORT lead for ``key``: the header in a message of the size the receiver posted."""
        entry = self._out_hist.get(key, [None])[0]
        buf = torch.zeros(_packed_size(entry[0] if entry is not None else ()), dtype=torch.uint8,
                          device=self.device)
        buf[:HDR_BYTES].view(torch.int64).copy_(torch.tensor([kind, n], dtype=torch.int64))
        return buf

    def plan(self, receives: dict, post_now: bool = True) -> None:
        """``{(peer, tag): n}``: the receives each channel will see in the coming schedule;
        the first of each is posted now (``post_now``), or else by the stage's first send or
        wait (a stage that starts with a compute: a post now would delay it). Gloo only: NCCL
        runs the sends and receives between two ranks in order on one stream, so a receive
        posted ahead of a send to the same peer would hold that send back (the stages would
        wait on each other)."""
        self.abandon()
        if not self.post_ahead:
            return
        for key, n in receives.items():
            if n > 0 and key[0] is not None:
                inb = self._in.setdefault(key, _Inbound())
                inb.todo = n
                if post_now:
                    self._post(key, inb)

    def _take(self, key, what: str):
        """The next transfer's lead on a channel: (kind, n, posted receive, its size's history entry)."""
        src, tag = key
        inb = self._in.setdefault(key, _Inbound())
        if inb.posted:
            self.posted_ahead += 1
        else:
            self._post(key, inb)
        self._top_up()            # about to wait: post what is due now, not after the data is in
        posted, entry = inb.posted.popleft()
        self._wait(posted.work, src, what)
        kind, n = int(posted.header[0]), int(posted.header[1])
        if kind == ABORT:
            text = self._recv(torch.zeros(n, dtype=torch.uint8, device=self.device), src, "abort message",
                              tag + EXTRAS)
            raise PipelineError(bytes(text.tolist()).decode("utf-8", "replace"), src)
        return kind, n, posted, entry

    def abandon(self) -> None:
        """Forget receives posted ahead (after a failed schedule); gloo keeps their buffers."""
        for inb in self._in.values():
            _ABANDONED.extend(inb.posted)
            inb.posted.clear()
            inb.todo = 0

    def wait_sends(self) -> None:
        for w, _ in self._works:
            w.wait()
        self._works.clear()

    def reset_descriptions(self) -> None:
        """Send the activation description again with the next transfer on every channel."""
        self._force_desc.update(k for k in self._out_hist if k[1] == self.act_tag)

    def _send(self, key, wire, shapes, meta) -> None:
        dst, tag = key
        hist = self._out_hist.setdefault(key, [None] * LAG)
        entry = (shapes, meta)
        if hist[0] == entry and key not in self._force_desc:
            self._isend(self._packed(wire), dst, tag)
        else:   # the first LAG transfers, or new shapes: the tensors follow the lead
            desc = meta is not None and (self._out_meta.get(key) != meta or key in self._force_desc)
            self._isend(self._placeholder(key, NEW, len(meta) if desc else 0), dst, tag)
            if desc:
                self._isend(torch.tensor(meta, dtype=torch.int64, device=self.device), dst, tag + EXTRAS)
                self.descriptions_sent += 1
            for t in wire:
                self._isend(t, dst, tag + EXTRAS)
            self._force_desc.discard(key)
        self._out_meta[key] = meta
        hist.pop(0)
        hist.append(entry)
        self._top_up()            # this stage's data is on its way: post the receives due now

    # ------------------------------------------------------------------ activations
    def send_tensors(self, tensors: Sequence[torch.Tensor], dst: int, is_tuple: bool = True) -> None:
        wire = [(t.to(torch.uint8) if t.dtype == torch.bool else t).detach() for t in tensors]
        self._send((dst, self.act_tag), wire, [(t.dtype, tuple(t.shape)) for t in wire],
                   _describe(tensors, is_tuple))

    def recv_tensors(self, src: int, what: str = "activations"):
        """The tensors sent (a tuple, or one tensor when a single tensor was sent)."""
        key = (src, self.act_tag)
        kind, n, posted, entry = self._take(key, what)
        inb = self._in[key]
        if kind == NEW:
            if n:
                inb.descr = _parse(self._recv(torch.zeros(n, dtype=torch.int64, device=self.device), src, what,
                                              self.act_tag + EXTRAS).tolist())
            elif inb.descr is None:
                raise PipelineError(f"pipeline stage {self.stage_id}: {what} from rank {src} arrived without a "
                                    f"description; the stages are out of step.")
            descr = inb.descr
            shapes = [(torch.uint8 if dtype == torch.bool else dtype, shape) for dtype, _, shape in descr[1]]
            data = [self._recv(torch.empty(shape, dtype=wire, device=self.device), src, what, self.act_tag + EXTRAS)
                    for wire, shape in shapes]
        elif entry is None:
            raise PipelineError(f"pipeline stage {self.stage_id}: {what} from rank {src} arrived without a "
                                f"description; the stages are out of step.")
        else:
            shapes, descr = entry
            data = posted.views
        inb.descr = descr
        inb.hist.pop(0)
        inb.hist.append((shapes, descr))
        is_tuple, parts = descr
        out = []
        for (dtype, rg, _), t in zip(parts, data):
            if dtype == torch.bool:
                t = t.to(torch.bool)
            if rg and t.is_floating_point():
                t.requires_grad_(True)
            out.append(t)
        return tuple(out) if is_tuple else out[0]

    # ------------------------------------------------------------------ gradients
    def send_grads(self, grads: Sequence[torch.Tensor], dst: int) -> None:
        grads = [g.detach() for g in grads]
        self._send((dst, self.grad_tag), grads, [(g.dtype, tuple(g.shape)) for g in grads], None)

    def recv_grads(self, like: Sequence[torch.Tensor], src: int) -> List[torch.Tensor]:
        key = (src, self.grad_tag)
        kind, _, posted, entry = self._take(key, "gradients")
        shapes = [(t.dtype, tuple(t.shape)) for t in like]
        if kind == NEW:
            data = [self._recv(torch.empty(shape, dtype=dtype, device=self.device), src, "gradients",
                               self.grad_tag + EXTRAS) for dtype, shape in shapes]
        elif entry is None or entry[0] != shapes:
            raise PipelineError(f"pipeline stage {self.stage_id}: gradients from rank {src} do not match the "
                                f"outputs they belong to; the stages are out of step.")
        else:
            data = posted.views
        inb = self._in[key]
        inb.hist.pop(0)
        inb.hist.append((shapes, None))
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
                    lead = self._placeholder((peer, tag), ABORT, data.numel())   # the size the neighbour posted
                    works = [dist.isend(lead, peer, tag=tag), dist.isend(data, peer, tag=tag + EXTRAS)]
                    pending.setdefault(peer, []).append(works)
                except Exception:  # noqa: BLE001 - best effort while failing
                    pass
        deadline = time.monotonic() + ABORT_WAIT_S
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                if any(all(w.is_completed() for w in pair) for pair in pending[peer]):
                    del pending[peer]
            time.sleep(0.005)
