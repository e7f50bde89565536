"""Gathering partitioned parameters (ZeRO stage 3): the collectives that make a parameter whole.

The per-parameter state these work on (``ds_tensor``, ``PartitionSpec``, conversion, release,
the fetch lists) is in :mod:`.partitioned_param`, which re-exports every name here; this module
imports nothing from it. What lives here:

* :class:`ZeroParamStatus`, the state a gather moves a parameter through
  (NOT_AVAILABLE -> INFLIGHT -> AVAILABLE; :func:`~.partitioned_param.release_param` moves it back),
  and :func:`partition_size`, the partition arithmetic both halves share;
* :func:`gather_params` and its handles (:class:`GatherHandle`, ``_MultiHandle``, :func:`wait_available`);
* the full buffer a parameter is gathered into (``_full_buffer``);
* flat multi-parameter gathers (``_pieces``, ``_flat_input``, ``FLAT_GATHER_ELEMENTS``), the
  one-rank aliasing of partitions (``_alias_partitions``), NVMe-held partitions during a gather
  (``_swapper_groups``, ``_pool_batches``, ``_release_swapped``);
* ZeRO++: frozen weights kept quantized (:func:`quantize_partition`, :func:`is_quantized`,
  ``_gather_quantized``) and hpZ secondary partitions (``_keep_secondary``, ``_secondary_valid``,
  ``_gather_secondary``).

Gathering allocates (or regrows) one full-size buffer per parameter; releasing
shrinks that buffer's storage to zero bytes. One parameter is all-gathered straight
into its buffer. Several (a module's, a prefetch bucket's) go as **one** collective:
their partitions - already adjacent in the rank's flat partition chunk, so usually
without a copy - are gathered into one flat rank-major buffer, and one fused
``split_with_sizes_copy`` writes every parameter's buffer from it (one kernel on
CUDA): no per-parameter collective, copy or device transfer. With one rank
(nothing to gather) a parameter whose partition already sits on the compute device
is made a view of that partition: no buffer, no copy. The buffer's storage object is kept for the parameter's lifetime,
so views autograd saved during forward (``weight.t()`` inside ``F.linear``) see
the data again when backward regathers the parameter - no special linear layer
is needed, and activation checkpointing that recomputes forward inside backward
works unchanged.

Code that replaces one of the private helpers here (a test counting ``_flat_input`` calls)
patches this module: :func:`gather_params` looks them up here.
"""
from __future__ import annotations

import enum

import torch

from ...ops.quantizer.quantizer import dequantize_blockwise, quantize_blockwise
from .stage3_comm import KIND_GATHER


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1       # full data in param.data
    NOT_AVAILABLE = 2   # only the partition (param.ds_tensor) exists
    INFLIGHT = 3        # an all-gather into the full buffer is in progress



def partition_size(numel: int, world_size: int) -> int:
    return -(-numel // world_size) if numel else 0



def _secondary_size(p) -> int:
    return partition_size(p.ds_numel, p._z3.sec_comm.world_size)


def _full_buffer(p) -> torch.Tensor:
    spec = p._z3
    need = p.ds_tensor.numel() * spec.world_size
    if spec.sec_comm is not None:   # also holds the secondary layout (h slices, padded)
        need = max(need, _secondary_size(p) * spec.sec_comm.world_size)
    if p._z3_full is None:
        p._z3_full = torch.empty(need, dtype=p.ds_tensor.dtype, device=spec.device)
    else:
        st = p._z3_full.untyped_storage()
        nbytes = need * p._z3_full.element_size()
        if st.nbytes() < nbytes:
            st.resize_(nbytes)
    return p._z3_full


class GatherHandle:
    """An all-gather of several parameters; :meth:`wait` makes them AVAILABLE."""

    def __init__(self, params, works, keep, swapped=(), flat=None, primary=True):
        self.params = params
        self.primary = primary  # gathered from the primary partitions (not hpZ secondaries)
        self.works = works
        self.keep = keep       # device copies of host partitions, alive until the gather ends
        self.swapped = swapped  # (swapper, params) whose NVMe partitions are held until the gather ends
        self.flat = flat       # [(rank-major gathered buffer, params, partition sizes)] of flat gathers
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        try:
            for w in self.works:
                if w is not None:
                    w.wait()
        finally:
            _release_swapped(self.swapped)
            self.swapped = ()
        self.works = []   # a finished work still holds its tensors: the gathered buffers go with it
        flats, self.flat = self.flat or [], None
        while flats:   # each gathered piece: full buffers now, one fused copy, then the piece goes
            out, ps, sizes = flats.pop(0)
            rows = out.view(-1, sum(sizes))
            with torch.no_grad():
                torch.split_with_sizes_copy(rows, sizes, dim=1,
                                            out=[_full_buffer(p)[:rows.shape[0] * s].view(-1, s)
                                                 for p, s in zip(ps, sizes)])
            del out, rows
        for p in self.params:
            p.data = p._z3_full[:p.ds_numel].view(p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE
            p._z3_handle = None
            if self.primary and p._z3.sec_comm is not None:
                _keep_secondary(p)
        self.done = True
        self.keep = None


def _swapper_groups(params):
    """[(swapper, params)] for the NVMe-backed params among ``params``."""
    out = {}
    for p in params:
        sw = getattr(p._z3, "swapper", None)
        if sw is not None and sw.is_swapped(p):
            out.setdefault(id(sw), (sw, []))[1].append(p)
    return list(out.values())


def _release_swapped(swapped) -> None:
    for sw, ps in swapped:
        sw.release_resident(ps)


def _runs(params, size, cap):
    """``params`` in order, in runs whose ``size(p)`` sum stays within ``cap`` (a parameter
    larger than ``cap`` is a run of its own)."""
    out, cur, n = [], [], 0
    for p in params:
        k = size(p)
        if cur and n + k > cap:
            out.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += k
    if cur:
        out.append(cur)
    return out


def _pool_batches(sw, params):
    """Split ``params`` into runs whose partitions fit ``sw``'s buffer pool together."""
    return _runs(params, lambda p: -(-p.ds_tensor.numel() * p.ds_tensor.element_size() // 4096) * 4096,
                 sw.buffer_count * sw.buffer_bytes)


# ---------------------------------------------------------------- ZeRO++ frozen weights kept quantized
QUANT_BLOCK = 2048   # elements per block (one fp32 scale each), as qwZ's gathers


def quantize_partition(p, block: int = QUANT_BLOCK) -> None:
    """``zero_quantized_nontrainable_weights``: keep frozen ``p``'s partition as int8 blocks with
    one fp32 scale each (|error| <= scale/2 per element) and drop the full-precision partition:
    ``p.ds_tensor`` keeps its shape and dtype but holds no storage."""
    part = p.ds_tensor
    codes, scales = quantize_blockwise(part, min(block, max(1, part.numel())), bits=8)
    p._z3_q = (codes.to(part.device), scales.to(part.device))
    p._z3_q_bound = float(scales.max()) / 2 if scales.numel() else 0.0
    holder = torch.empty(part.numel(), dtype=part.dtype, device=part.device)
    holder.untyped_storage().resize_(0)
    holder.ds_numel = part.numel()
    p.ds_tensor = holder


def is_quantized(p) -> bool:
    return p.__dict__.get("_z3_q") is not None


def _gather_quantized(comm, todo, what: str):
    """All-gather the int8 codes and scales of quantized frozen partitions (two collectives for
    all of them) and dequantize each into its full buffer. Synchronous."""
    base = getattr(comm, "_base", comm)     # codes go as they are, never re-quantized by qwZ
    ws = base.world_size
    codes = torch.cat([p._z3_q[0] for p in todo])
    scales = torch.cat([p._z3_q[1] for p in todo])
    nb, blk = codes.shape
    base.check(KIND_GATHER, [p.ds_id for p in todo], ws * (codes.numel() + scales.numel()),
               lambda: (_render(what) + " (quantized frozen weights)") if what else base.describe(todo))
    all_codes = torch.empty((ws, nb, blk), dtype=torch.int8, device=codes.device)
    all_scales = torch.empty((ws, nb), dtype=torch.float32, device=codes.device)
    base.all_gather_into(all_codes.view(-1), codes.view(-1))
    base.all_gather_into(all_scales.view(-1), scales.view(-1))
    off = 0
    for p in todo:
        k = p._z3_q[1].numel()
        s = p.ds_tensor.numel()
        full = _full_buffer(p)
        spec = p._z3
        vals = all_codes[:, off:off + k].float() * all_scales[:, off:off + k, None]
        with torch.no_grad():
            full[:ws * s].view(ws, s).copy_(vals.reshape(ws, -1)[:, :s].to(device=spec.device))
        off += k
        p.data = full[:p.ds_numel].view(p.ds_shape)
        p.ds_status = ZeroParamStatus.AVAILABLE
        spec.gathered += p.ds_numel
        if spec.sec_comm is not None:
            _keep_secondary(p)


def _keep_secondary(p) -> None:
    """hpZ: keep this rank's slice of the just-gathered ``p`` for gathers inside its group."""
    sec = p._z3.sec_comm
    s2 = _secondary_size(p)
    buf = p.__dict__.get("_z3_sec")
    if buf is None or buf.numel() != s2:
        buf = p._z3_sec = torch.empty(s2, dtype=p.ds_tensor.dtype, device=p._z3.device)
    lo = sec.rank * s2
    hi = min(p.ds_numel, lo + s2)
    with torch.no_grad():
        if hi > lo:
            buf[:hi - lo].copy_(p._z3_full[lo:hi])
        if hi - lo < s2:
            buf[max(0, hi - lo):].zero_()
    p._z3_sec_version = p._z3.version


def _secondary_valid(p) -> bool:
    return (p._z3.sec_comm is not None and p.__dict__.get("_z3_sec") is not None
            and p.__dict__.get("_z3_sec_version") == p._z3.version)


def _set_inflight(p) -> None:
    p.ds_status = ZeroParamStatus.INFLIGHT
    p._z3.gathered += p.ds_numel


# Most elements one flat gather's rank-major buffer holds: the transient above a per-parameter
# gather is one such buffer while its piece is copied out. Parameters larger than this are
# gathered one by one straight into their buffers (no copy at all); smaller ones in batches.
FLAT_GATHER_ELEMENTS = 2 ** 19


def _pieces(params, world_size: int):
    """``params`` in runs whose gathered size stays within FLAT_GATHER_ELEMENTS (a larger
    parameter is a run of its own)."""
    return _runs(params, lambda p: p.ds_tensor.numel() * world_size, FLAT_GATHER_ELEMENTS)


def _flat_input(parts) -> torch.Tensor:
    """``parts`` as one flat tensor: a view when they lie back to back in one storage (the
    partitions of parameters adjacent in a master chunk), else one concatenation."""
    first = parts[0]
    st, esz = first.untyped_storage(), first.element_size()
    nxt = first.data_ptr()
    for t in parts:
        if t.untyped_storage().data_ptr() != st.data_ptr() or t.data_ptr() != nxt or not t.is_contiguous():
            return torch.cat([t.reshape(-1) for t in parts])
        nxt += t.numel() * esz
    n = sum(t.numel() for t in parts)
    return first.new_empty(0).set_(st, first.storage_offset(), (n,))


def _alias_partitions(todo) -> list:
    """With one rank a partition is the whole parameter: make each parameter whose partition
    lives on its compute device (same dtype, in memory) a view of it. Returns the rest."""
    rest = []
    for p in todo:
        part = p.ds_tensor
        d = p.__dict__
        view = d.get("_z3_alias_view")
        # the view made last time, while the partition is the same tensor over the same memory
        # (a partition moved or replaced is checked again below)
        if (view is not None and d.get("_z3_alias_src") is part and part.data_ptr() == view.data_ptr()
                and part.untyped_storage().nbytes()):
            p.data = view
        elif (p._z3.comm.world_size == 1 and getattr(p._z3, "swapper", None) is None
                and part.device == p._z3.device and part.numel() >= p.ds_numel and part.untyped_storage().nbytes()):
            view = part[:p.ds_numel].view(p.ds_shape)
            p._z3_alias_view, p._z3_alias_src = view, part
            p.data = view
        else:
            rest.append(p)
            continue
        p._z3_alias = True
        p.ds_status = ZeroParamStatus.AVAILABLE
    return rest


def _render(what) -> str:
    """A collective's description: given as a string or, on the hot path, a callable that makes
    it (rendered only for an error message)."""
    return what() if callable(what) else what


def gather_params(params, async_op: bool = False, what="", alias: bool = False, secondary: bool = False):
    """Start (and unless ``async_op``, finish) gathering every NOT_AVAILABLE param in ``params``.

    Collective: every rank of the parameters' group must call it with the same params.
    ``alias``: the training schedule's gathers (not GatheredParameters, whose callers may keep
    what they read): with one rank, parameters become views of their partitions.
    ``secondary``: the schedule's gathers inside one forward/backward: hpZ secondary partitions
    of the current version are gathered inside the node group.
    Returns the handle (None when nothing needed gathering)."""
    todo, seen = [], set()
    for p in params:
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and id(p) not in seen:
            seen.add(id(p))
            todo.append(p)
    if alias and todo:
        todo = _alias_partitions(todo)
    if not todo:
        return None
    if any(is_quantized(p) for p in todo):   # frozen weights kept quantized: their codes are gathered
        _gather_quantized(todo[0]._z3.comm, [p for p in todo if is_quantized(p)], what)
        todo = [p for p in todo if not is_quantized(p)]
        if not todo:
            return None
    if secondary and any(_secondary_valid(p) for p in todo):   # hpZ: these gather inside the node group
        sec = [p for p in todo if _secondary_valid(p)]
        rest = [p for p in todo if not _secondary_valid(p)]
        handles = [_gather_secondary(sec, async_op, what)]
        if rest:
            handles.append(gather_params(rest, async_op, what, alias))
        h = _MultiHandle(handles)
        if not async_op:
            h.wait()
        return h
    comm = todo[0]._z3.comm
    if any(p._z3.comm is not comm for p in todo):  # one collective group per call
        handles = [gather_params([p for p in todo if p._z3.comm is c], async_op, what)
                   for c in {id(p._z3.comm): p._z3.comm for p in todo}.values()]
        return _MultiHandle(handles)
    swapped = _swapper_groups(todo)
    if len(swapped) == 1 and len(_pool_batches(*swapped[0])) > 1:
        # More NVMe partitions than the swap buffers hold at once: gather them a pool's worth at a
        # time (synchronously), so the buffer_count/buffer_size bound holds; the rest as asked.
        sw, ps = swapped[0]
        for batch in _pool_batches(sw, ps):
            gather_params(batch, async_op=False, what=what)
        rest = [p for p in todo if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        return gather_params(rest, async_op, what) if rest else None
    comm.check(KIND_GATHER, [p.ds_id for p in todo], sum(p.ds_tensor.numel() for p in todo) * comm.world_size,
               lambda: _render(what) or comm.describe(todo))
    held = []
    flat = None
    try:
        for sw, ps in swapped:
            sw.make_resident(ps)
            held.append((sw, ps))
        works, keep = [], []
        if len(todo) > 1 and len({(p.ds_tensor.dtype, p._z3.device) for p in todo}) == 1:
            # one collective per piece of at most FLAT_GATHER_ELEMENTS gathered elements: the
            # partitions in as one flat input, a rank-major flat buffer out; the full buffers are
            # made when the piece has arrived (GatherHandle.wait), so a piece in flight holds
            # its gathered size once, as a per-parameter gather does
            flat = []
            for piece in _pieces(todo, comm.world_size):
                if len(piece) == 1:
                    p = piece[0]
                    src = p.ds_tensor if p.ds_tensor.device == p._z3.device else \
                        p.ds_tensor.to(p._z3.device, non_blocking=True)
                    keep.append(src)
                    works.append(comm.all_gather_into(_full_buffer(p), src, async_op=async_op))
                    _set_inflight(p)
                    continue
                sizes = [p.ds_tensor.numel() for p in piece]
                src = _flat_input([p.ds_tensor for p in piece])
                if src.device != piece[0]._z3.device:
                    src = src.to(piece[0]._z3.device, non_blocking=True)
                keep.append(src)
                out = torch.empty(comm.world_size * src.numel(), dtype=src.dtype, device=src.device)
                for p in piece:
                    _set_inflight(p)
                works.append(comm.all_gather_into(out, src, async_op=async_op))
                flat.append((out, piece, sizes))
        else:
            for p in todo:
                full = _full_buffer(p)
                src = p.ds_tensor
                if src.device != p._z3.device:
                    src = src.to(p._z3.device, non_blocking=True)
                    keep.append(src)
                works.append(comm.all_gather_into(full, src, async_op=async_op))
                _set_inflight(p)
    except BaseException:
        _release_swapped(held)
        for p in todo:
            if p.ds_status == ZeroParamStatus.INFLIGHT:
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
                p._z3.gathered -= p.ds_numel
        raise
    handle = GatherHandle(todo, works, keep, held, flat)
    for p in todo:
        p._z3_handle = handle
    if not async_op:
        handle.wait()
    return handle


def _gather_secondary(todo, async_op: bool, what: str):
    """hpZ: all-gather ``todo`` from their secondary partitions over the node group."""
    groups = {}
    for p in todo:
        groups.setdefault(id(p._z3.sec_comm), (p._z3.sec_comm, []))[1].append(p)
    if len(groups) > 1:
        return _MultiHandle([_gather_secondary(ps, async_op, what) for _, ps in groups.values()])
    comm = todo[0]._z3.sec_comm
    sizes = [p._z3_sec.numel() for p in todo]
    comm.check(KIND_GATHER, [p.ds_id for p in todo], sum(sizes) * comm.world_size,
               lambda: (_render(what) + " from hpZ secondary partitions") if what else comm.describe(todo))
    for p in todo:
        _set_inflight(p)
    try:
        if len(todo) == 1:
            p = todo[0]
            works = [comm.all_gather_into(_full_buffer(p)[:sizes[0] * comm.world_size], p._z3_sec,
                                          async_op=async_op)]
            flat, keep = None, []
        else:
            src = torch.cat([p._z3_sec for p in todo])
            out = torch.empty(comm.world_size * src.numel(), dtype=src.dtype, device=src.device)
            works = [comm.all_gather_into(out, src, async_op=async_op)]
            flat, keep = [(out, todo, sizes)], [src]
    except BaseException:
        for p in todo:
            if p.ds_status == ZeroParamStatus.INFLIGHT:
                p._z3.gathered -= p.ds_numel
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        raise
    handle = GatherHandle(todo, works, keep, (), flat, primary=False)
    for p in todo:
        p._z3_handle = handle
    if not async_op:
        handle.wait()
    return handle


class _MultiHandle:
    def __init__(self, handles):
        self.handles = [h for h in handles if h is not None]

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def wait(self):
        for h in self.handles:
            h.wait()


def wait_available(params) -> None:
    for p in params:
        if p.ds_status == ZeroParamStatus.INFLIGHT:
            p._z3_handle.wait()
