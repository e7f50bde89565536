"""Collectives for ZeRO stage 3 that fail clearly instead of hanging or crashing.

Stage 3 issues its collectives from module hooks, so their sequence follows the
model's control flow. If data-parallel ranks take different paths (one rank skips
a branch, runs an extra forward, or reaches the optimizer step early) the ranks
would pair up different collectives. With NCCL that hangs until the watchdog
fires; with gloo, mismatched sizes abort the process (SIGABRT) with no message.

Every stage-3 collective is therefore preceded by a tiny fixed-size header
exchange (kind, sequence number, a digest of the parameters involved, element
count). The header collective always has the same shape on every rank, so it
pairs up safely even when the ranks disagree; on a mismatch every rank raises
:class:`ZeroRankMismatchError` naming what each rank was doing. Headers travel on
a gloo group (the data-parallel group itself on CPU, a gloo twin of it on GPU),
so checking never synchronises the host with the device.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ... import comm as ds_comm  # the model-state collectives go through deepspeed.comm (comms logger)

KIND_GATHER, KIND_REDUCE, KIND_STEP, KIND_INIT, KIND_BROADCAST = 1, 2, 3, 4, 5
KIND_NAMES = {KIND_GATHER: "all-gathering parameters", KIND_REDUCE: "reduce-scattering gradients",
              KIND_STEP: "reducing the gradient norm for the optimizer step",
              KIND_INIT: "partitioning parameters at construction (zero.Init)",
              KIND_BROADCAST: "broadcasting modified parameters (GatheredParameters)"}
_HEADER = 4
_MASK = (1 << 62) - 1
_gloo_twins: dict = {}
# torch >= 2.13 renamed the tensor-in/tensor-out collectives (the old names warn).
_all_gather_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ZeroRankMismatchError(RuntimeError):
    """Data-parallel ranks issued different ZeRO-3 collectives (their control flow diverged)."""


class ZeroCollectiveTimeoutError(ZeroRankMismatchError, ds_comm.CollectiveTimeoutError):
    """A ZeRO-3 collective did not complete on every rank (a peer stalled past the timeout,
    died, or waits elsewhere): both a rank mismatch and a collective failure."""


def digest(ids) -> int:
    """A deterministic 62-bit digest of a sequence of parameter ids (same on every process)."""
    h = 1469598103934665603
    for i in ids:
        h = ((h ^ (int(i) + 1)) * 1099511628211) & _MASK
    return h


def _group_ranks(group):
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _header_group(group):
    """The group headers travel on: ``group`` itself when it is gloo, else a gloo twin.

    Creating groups is collective over the whole world, so when a twin is needed every
    rank creates the twins of every data-parallel group, in the same order."""
    if dist.get_backend(group) == "gloo":
        return group
    key = tuple(_group_ranks(group))
    if key not in _gloo_twins:
        all_keys = [None] * dist.get_world_size()
        dist.all_gather_object(all_keys, key)
        for k in sorted(set(all_keys)):
            if k not in _gloo_twins:
                _gloo_twins[k] = dist.new_group(ranks=list(k), backend="gloo")
    return _gloo_twins[key]


class CheckedComm:
    """Collectives over one data-parallel group, each checked by a header exchange."""

    def __init__(self, group=None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.header_group = _header_group(group) if self.active else None
        # gloo's tensor-in/tensor-out reduce-scatter is about 2x slower than its list form
        # (measured: 8.4M floats, 2 ranks: 60 ms vs 35 ms); NCCL prefers the tensor form.
        self.list_reduce_scatter = self.active and dist.get_backend(group) == "gloo"
        # gloo's reduce-scatter (either form) clones its input and copies the result out; an
        # in-place all-reduce of a bucket the caller owns makes neither copy and was as fast or
        # faster (2 ranks, 64K-4M floats: 0.6-1.0x the list form's wall time), so gradient buckets
        # are summed in place there and each rank reads its row (reduce_rows)
        self.reduce_in_place = self.list_reduce_scatter
        self.seq = 0
        self.names = {}        # ds_id -> parameter name, for error messages
        self.gather_calls = 0  # parameter all-gathers issued on this group, and their output elements
        self.gather_elems = 0

    def __deepcopy__(self, memo):  # process groups cannot be copied; a copied model shares them
        return self

    def __getstate__(self):
        raise TypeError("ZeRO-3 partitioned parameters cannot be pickled; gather them first "
                        "(deepspeed.zero.GatheredParameters or engine.save_16bit_model).")

    # -- checking ------------------------------------------------------------------------
    def check(self, kind: int, ids, numel: int, what="") -> None:
        """Exchange a header describing the next collective; raise if ranks disagree. ``what``
        (a string, or a callable that makes it) is only rendered for an error message."""
        if not self.active:
            return
        self.seq += 1
        # from numpy: a header is four host integers, not a tensor op worth a dispatch
        hdr = torch.from_numpy(np.array([kind, self.seq, digest(ids), int(numel)], dtype=np.int64))
        out = torch.empty(self.world_size * _HEADER, dtype=torch.int64)
        try:
            _all_gather_1(out, hdr, group=self.header_group)
        except RuntimeError as err:   # a peer died, or waits in a collective that is not ZeRO-3's
            from ...comm.timeouts import mark_failed, step_text
            what = what() if callable(what) else what
            mark_failed()   # the group is broken: the exit hook leaves at once
            raise ZeroCollectiveTimeoutError(
                f"ZeRO stage 3: collective #{self.seq} ({KIND_NAMES.get(kind, kind)}"
                + (f" for {what}" if what else "") + f") did not complete on every data-parallel rank{step_text()}: "
                f"{err}\nAnother rank failed (see its log) or is blocked elsewhere - e.g. it left the training "
                f"loop early, or entered save_checkpoint/a barrier while this rank was still in forward/backward. "
                f"Every rank must run the same steps.") from err
        rows = out.view(self.world_size, _HEADER)
        if bool((rows == rows[0]).all()):
            return
        # Every rank sees the same rows, so every rank takes this branch: exchanging the
        # descriptions is itself a matched collective.
        what = what() if callable(what) else what
        mine = f"{KIND_NAMES.get(kind, kind)}" + (f" for {what}" if what else "") + f" ({numel} elements)"
        descs = [None] * self.world_size
        dist.all_gather_object(descs, mine, group=self.header_group)
        lines = "\n".join(f"  rank {r}: collective #{int(rows[r, 1])}: {d}" for r, d in enumerate(descs))
        raise ZeroRankMismatchError(
            "ZeRO stage 3: data-parallel ranks diverged - they are issuing different collectives:\n"
            f"{lines}\n"
            "Every rank must run the same modules, in the same order, the same number of times in each "
            "forward/backward (a branch taken on one rank but not another, or a different number of "
            "forward calls, breaks this). Make the control flow identical on all ranks, e.g. run the "
            "skipped module on a dummy input and multiply its output by zero.")

    def describe(self, params) -> str:
        names = [self.names.get(getattr(p, "ds_id", None), f"ds_id {getattr(p, 'ds_id', '?')}") for p in params]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    # -- collectives (call check() first) --------------------------------------------------
    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        self.gather_calls += 1
        self.gather_elems += out.numel()
        if not self.active:
            out.copy_(inp.reshape(out.shape))
            return None
        return ds_comm.all_gather_into_tensor(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter_rows(self, out: torch.Tensor, rows: torch.Tensor, async_op: bool = False):
        """Sum over ranks of ``rows[r]`` lands in ``out`` on rank ``r`` (rows may be strided views)."""
        if not self.active:
            out.copy_(rows[0])
            return None
        if self.list_reduce_scatter:
            return ds_comm.reduce_scatter(out, list(rows.unbind(0)), group=self.group, async_op=async_op)
        return ds_comm.reduce_scatter_tensor(out, rows.contiguous().view(-1), group=self.group, async_op=async_op)

    def reduce_rows(self, rows: torch.Tensor, async_op: bool = False):
        """Sum over ranks of ``rows[r]``, for rank r: returns (this rank's sum, work or None).
        ``rows`` is the caller's to overwrite: where the backend's reduce-scatter copies
        (``reduce_in_place``) and ``rows`` is contiguous, it is all-reduced in place and the result
        is a view of this rank's row."""
        if self.reduce_in_place and rows.is_contiguous():
            return rows[self.rank], ds_comm.all_reduce(rows, group=self.group, async_op=async_op)
        out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        return out, self.reduce_scatter_rows(out, rows, async_op=async_op)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM):
        if self.active:
            ds_comm.all_reduce(t, op=op, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src_rank: int):
        """Broadcast from data-parallel rank ``src_rank`` (a rank within the group)."""
        if self.active:
            src = dist.get_global_rank(self.group, src_rank) if self.group not in (None, dist.group.WORLD) \
                else src_rank
            ds_comm.broadcast(t, src=src, group=self.group)
        return t


_default_comms: dict = {}


def _world_key():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return id(dist.distributed_c10d._get_default_group())
    except Exception:  # noqa: BLE001 - private API; fall back to "initialised"
        return True


def comm_for(group=None) -> CheckedComm:
    """One CheckedComm per group (and per process-group lifetime), shared by zero.Init,
    GatheredParameters and the engine so their header sequence numbers advance together."""
    if group is dist.group.WORLD:
        group = None
    key = (id(group) if group is not None else None, _world_key())
    c = _default_comms.get(key)
    if c is None:
        c = CheckedComm(group)
        _default_comms[key] = c
    return c
