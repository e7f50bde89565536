"""ZeRO stage 0-2 optimizer state on NVMe (``offload_optimizer.device: "nvme"``) for
:class:`~.flat_master.FlatMasterOptimizer`.

With the optimizer offloaded to NVMe the rank's flat fp32 master partition of each
parameter group is cut into ``zero_optimization.sub_group_size``-element *sub-groups*.
Each sub-group's master slice and the optimizer's per-element state (Adam: ``exp_avg``,
``exp_avg_sq``; in general every state tensor shaped like the master) live in the files
of one :class:`~deepspeed.runtime.swap_tensor.OptimizerSwapper` (built by
``swapper_from_config`` from the ``offload_optimizer`` and ``aio`` sections); the host
holds only the swapper's ``buffer_count`` sub-group buffers. Scalar state (``step``)
stays in memory, in the optimizer.

Parts:

* :class:`NvmeMasters` -- the sub-groups, the swapper and the step. The inner optimizer is
  built over one *placeholder* tensor per sub-group (empty between steps); the step is
  ``for sg, t in swapper.iterate()``: the placeholder becomes a view of the sub-group's
  master in its swap buffer, its state entries views of the swapped state, the inner
  optimizer steps it alone (the other placeholders have no gradient, so torch-style
  optimizers skip them) and the updated master slice is copied into the rank's 16-bit
  (or fp32) parameter partition while the buffer is still resident.
  The set of per-element state keys is learnt once at construction by stepping the inner
  optimizer on a 2-element probe (its state and group hyperparameters are restored), so
  each sub-group's file layout is fixed before the first step; the first real step of a
  sub-group still starts from the optimizer's own fresh state (its state entries are only
  handed to the optimizer once they exist), so every optimizer initialises as it would in
  memory.
* :class:`NvmeStateAccess` -- the checkpoint and ``tensor_fragment`` entry points of
  :class:`~.flat_state.FlatStateMixin`. A checkpoint of an NVMe run is an ordinary one (no
  swap paths; the fragments of the in-memory layout) and loads at any offload mode, stage
  and world size, and the reverse. Neither direction holds the state in anonymous memory:
  a save (:meth:`NvmeMasters.mapped_fragments`) hands ``torch.save`` every fragment as a
  view of a memory map of the swap files (a fragment straddling sub-groups is assembled in
  an unlinked temporary file, mapped), saved without a copy, so the pages stream from the
  page cache; a load (:meth:`NvmeMasters.load_from_index`) fills one sub-group at a time
  from the memory-mapped checkpoint and writes it back. ``state_dict()``, the
  ``tensor_fragment`` accessors and ``set_*`` run over a *resident* copy: every sub-group
  read back into one in-memory master (and state tensors) per group, exactly the layout of
  ``offload_optimizer.device: "cpu"``, written back after a ``set_*``.

Gradient norm, clipping and the fp16 overflow skip are unchanged (they read only the
gradients, in memory); a skipped step touches no file. The norm is computed as the same
config without NVMe computes it: over the reduced fp32 gradient chunks (fp32 gradients,
as without offload), or in cache-sized fp32 slices (16-bit gradients, as the streamed
step of ``device: "cpu"``).
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Dict, List, Optional

import torch

from ...config.ds_config import check_nvme_path
from ...config.errors import DeepSpeedConfigError
from ...utils.logging import logger
from ..swap_tensor.utils import map_file
from .grad_reduce import transient_buffer
from .streamed import sliced_norms, staging_buffer, sum_of_squares

NVME_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
_EMPTY = torch.empty(0, dtype=torch.float32)
SUB_GROUP_ALIGN = 64   # elements; sub_group_size is rounded up to a multiple of this


class _SubGroup:
    __slots__ = ("sg_id", "group", "lo", "hi", "placeholder", "has_state")

    def __init__(self, sg_id, group, lo, hi, placeholder):
        self.sg_id, self.group, self.lo, self.hi, self.placeholder = sg_id, group, lo, hi, placeholder
        self.has_state = False   # whether the optimizer has stepped it (its state entries in the file are real)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def _probe_state_keys(inner, p: torch.Tensor) -> List[str]:
    """The per-element state keys ``inner`` creates for ``p``: one step on a 2-element
    probe standing in for ``p``; the probe's state and every group's hyperparameters are
    restored afterwards."""
    saved_groups = [{k: copy.deepcopy(v) for k, v in grp.items() if k != "params"} for grp in inner.param_groups]
    data = p.data
    p.data = torch.zeros(2, dtype=torch.float32, device=data.device)
    p.grad = torch.zeros(2, dtype=torch.float32, device=data.device)
    try:
        inner.step()
        state = inner.state.pop(p, {})
    finally:
        p.grad = None
        p.data = data
        inner.state.pop(p, None)
        for grp, saved in zip(inner.param_groups, saved_groups):
            grp.update(saved)
    return [k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.shape == (2,)]


class NvmeMasters:
    """Sub-groups of the flat fp32 master partitions in an :class:`OptimizerSwapper`."""

    def __init__(self, owner):
        """Phase 1 (after the owner built its masters in memory, before its inner
        optimizer): cut the masters into sub-groups and make the owner's optimizer
        tensors one placeholder per sub-group."""
        self.owner = owner
        z = owner.ctx.config.zero
        self.section = z.offload_optimizer
        check_nvme_path(self.section.nvme_path, NVME_PATH_KEY)   # the config checked it; it may be gone since
        self.nvme_path = os.path.abspath(self.section.nvme_path)
        # a multiple of SUB_GROUP_ALIGN: the host's vectorised update kernels treat the elements
        # after the last full vector of a tensor differently (last-bit differences), so sub-group
        # edges must fall where the whole-tensor update has no edge of its own
        self.sub_group_size = -(-int(z.sub_group_size) // SUB_GROUP_ALIGN) * SUB_GROUP_ALIGN
        self.subgroups: List[_SubGroup] = []
        self.by_group: List[List[_SubGroup]] = []
        for g, m in enumerate(owner.masters):
            sgs = []
            for i, lo in enumerate(range(0, m.numel(), self.sub_group_size)):
                hi = min(m.numel(), lo + self.sub_group_size)
                p = torch.empty(0, dtype=torch.float32, device=m.device)
                p.data = m.narrow(0, lo, hi - lo)      # real until attach(): optimizers may look at it
                sgs.append(_SubGroup((g, i), g, lo, hi, p))
            self.by_group.append(sgs)
            self.subgroups.extend(sgs)
            owner.opt_tensors[g] = [s.placeholder for s in sgs]
            owner.segments[g] = [(s.lo, s.hi) for s in sgs]
        owner._frag_seg = {}        # fragments straddle sub-groups: only the resident form maps them
        self.keys: List[List[str]] = [[] for _ in owner.masters]
        self.swapper = None
        self._resident = False
        self._streamed = None

    # ------------------------------------------------------------------ construction, phase 2
    def attach(self, inner) -> bool:
        """Phase 2 (the inner optimizer exists): learn its state keys, write every
        sub-group to its swap file and free the in-memory masters. False when there is no
        optimizer (nothing to swap: the owner keeps its masters in memory)."""
        if inner is None:
            return False
        self.inner = inner
        for g, sgs in enumerate(self.by_group):
            if sgs:
                self.keys[g] = _probe_state_keys(inner, sgs[0].placeholder)
        from ..swap_tensor import swapper_from_config
        if int(self.section.buffer_count) < 1:
            raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.buffer_count is "
                                       f"{self.section.buffer_count}; it must be >= 1 with device 'nvme'.")
        section = self.section.model_dump()
        # never more buffers than sub-groups: each buffer is as large as the largest sub-group
        count = max(1, min(int(self.section.buffer_count), len(self.subgroups)))
        if count < 2 and section.get("pipeline_read"):
            # reading the next sub-group ahead needs a second buffer
            logger.info("offload_optimizer.pipeline_read needs 2 swap buffers; with "
                        f"{count} (buffer_count {self.section.buffer_count}, {len(self.subgroups)} sub-groups) "
                        "the next sub-group is read after the current one is written")
            section["pipeline_read"] = False
        section.update(nvme_path=self.nvme_path, buffer_count=count)
        self.swapper = swapper_from_config(section, self.owner.ctx.config.model.aio)
        try:
            zeros = torch.zeros(max([s.numel for s in self.subgroups] + [1]), dtype=torch.float32)
            for s in self.subgroups:
                tensors = {"param": s.placeholder.data}
                tensors.update({k: zeros.narrow(0, 0, s.numel) for k in self.keys[s.group]})
                self.swapper.add_sub_group(s.sg_id, tensors)
                s.placeholder.data = _EMPTY
            del zeros
        except BaseException:
            self.close()
            raise
        self.owner.masters = [_EMPTY for _ in self.owner.masters]
        return True

    # ------------------------------------------------------------------ step
    def _use_streamed(self) -> bool:
        """The streamed update (16-bit gradients cast slice by slice, as with device 'cpu')
        when the gradients are 16-bit on the host and the optimizer has ``step_streamed``."""
        if self._streamed is None:
            o = self.owner
            self._streamed = bool(o.grad_dtype != torch.float32
                                  and all(f.device.type == "cpu" for f in o.param_flats)
                                  and callable(getattr(self.inner, "step_streamed", None))
                                  and self.inner.supports_streamed_step())
        return self._streamed

    def prepare_step(self):
        """The owner's ``prepare_step`` tuple: (streamed?, staging buffer, local squared norm)."""
        o = self.owner
        n_max = max([lay.part_numel for lay in o.layouts] + [1])
        if o.grad_dtype == torch.float32:
            # as without offload: the norm of this rank's reduced fp32 chunks, no copy
            chunks = [c for g in range(len(o.layouts)) for c in o._grad_chunks(g)]
            sq = sum_of_squares(list(torch._foreach_norm(chunks, 2.0)) if chunks else [])
            return False, None, sq
        device = o.param_flats[0].device if o.param_flats else torch.device("cpu")
        staging = staging_buffer(n_max, o.stream_chunk, device=device)
        sq = sum_of_squares([n for g, lay in enumerate(o.layouts)
                             for n in sliced_norms(lay.part_numel, o._grad_filler(g), staging)])
        return self._use_streamed(), staging, sq

    def step(self, prep, mult: float) -> None:
        """Update every sub-group through the swapper; copy each updated master slice into
        the rank's parameter partition while it is in its buffer (the caller all-gathers)."""
        streamed, staging, _ = prep
        o, inner = self.owner, self.inner
        index = {s.sg_id: s for s in self.subgroups}
        for sg_id, t in self.swapper.iterate():
            s = index[sg_id]
            g, lo, p = s.group, s.lo, s.placeholder
            keys = self.keys[g]
            p.data = t["param"]
            state = inner.state[p]
            if s.has_state:
                state.update({k: t[k] for k in keys})
            try:
                if streamed:
                    whole = o._whole_grads(g)
                    inner.step_streamed(
                        lambda _p, a, b, out: o._copy_partition_grads(g, lo + a, lo + b, whole, out), staging,
                        lambda _p, a, b: o._copy_partition_to_params(g, lo + a, lo + b, _p.narrow(0, a, b - a)),
                        grad_mult=mult, params=[p])
                else:
                    p.grad = self._grad_slice(s)
                    if mult != 1.0:
                        p.grad.mul_(mult)
                    inner.step()
                    o._copy_partition_to_params(g, lo, s.hi, t["param"])
                per_elem = [k for k, v in state.items()
                            if k != "step" and torch.is_tensor(v) and v.shape == p.shape]
                if sorted(per_elem) != sorted(keys):
                    raise RuntimeError(
                        f"offload_optimizer.device 'nvme': {type(inner).__name__} keeps per-element state "
                        f"{sorted(per_elem)} but it was {sorted(keys)} when the swap files were laid out; an "
                        f"optimizer whose state tensors change after its first step cannot swap to NVMe.")
                if not s.has_state:   # first step of this sub-group: its fresh state goes into the buffer
                    for k in keys:
                        t[k].copy_(state[k])
                    s.has_state = True
            finally:
                for k in keys:
                    state.pop(k, None)
                p.grad = None
                p.data = _EMPTY

    def _grad_slice(self, s: _SubGroup) -> torch.Tensor:
        """The reduced fp32 gradient of sub-group ``s`` on the host (a view where it exists)."""
        o = self.owner
        whole = o._whole_grads(s.group)
        if whole is not None and whole.dtype == torch.float32 and whole.device.type == "cpu":
            return whole.narrow(0, s.lo, s.numel)
        out = transient_buffer(s.numel, torch.float32, torch.device("cpu"))
        o._copy_partition_grads(s.group, s.lo, s.hi, whole, out)
        return out

    # ------------------------------------------------------------------ resident form (checkpoints)
    @property
    def is_resident(self) -> bool:
        return self._resident

    @contextlib.contextmanager
    def resident(self, write_back: bool):
        """Read every sub-group into one master (and state tensors) per group and give the
        owner and its optimizer the layout of ``device: "cpu"`` for the duration; with
        ``write_back`` write it all back into the swap files on a normal exit."""
        if self._resident:
            yield
            return
        o, inner = self.owner, self.inner
        saved_params = [list(grp["params"]) for grp in inner.param_groups]
        fulls = []
        for g, (lay, sgs) in enumerate(zip(o.layouts, self.by_group)):
            full = torch.zeros(lay.part_numel, dtype=torch.float32)
            stepped = [s.has_state for s in sgs]
            if any(stepped) and not all(stepped):
                raise RuntimeError(f"param group {g}: some sub-groups were stepped and some not "
                                   f"(an optimizer step failed part way); the state cannot be read as a whole")
            per_elem = {k: torch.zeros_like(full) for k in self.keys[g]} if sgs and all(stepped) else {}
            for s in sgs:
                got = self.swapper.read_sub_group(s.sg_id)
                full.narrow(0, s.lo, s.numel).copy_(got["param"])
                for k, v in per_elem.items():
                    v.narrow(0, s.lo, s.numel).copy_(got[k])
            scalars = dict(inner.state.get(sgs[0].placeholder, {})) if sgs else {}
            fulls.append(full)
            o.masters[g], o.opt_tensors[g] = full, [full]
            o.segments[g] = [(0, lay.part_numel)] if lay.part_numel else []
            for f in o.fragments[g]:
                o._frag_seg[id(f)] = (0, f.part_offset)
            inner.param_groups[g]["params"] = [full]
            if per_elem:
                inner.state[full] = dict(scalars, **per_elem)
        self._resident = True
        ok = False
        try:
            yield
            ok = True
        finally:
            try:
                if ok and write_back:
                    self._write_back(fulls, saved_params)
            finally:
                for g, full in enumerate(fulls):
                    inner.state.pop(full, None)
                    inner.param_groups[g]["params"] = saved_params[g]
                    o.masters[g] = _EMPTY
                    o.opt_tensors[g] = saved_params[g]
                    o.segments[g] = [(s.lo, s.hi) for s in self.by_group[g]]
                o._frag_seg = {}
                self._resident = False

    # ------------------------------------------------------------------ checkpoints, streamed
    @contextlib.contextmanager
    def mapped_fragments(self):
        """For a checkpoint save: give the owner and its optimizer, for the duration, one
        tensor per fragment (and its state tensors) that views a private memory map of the
        swap files (:meth:`OptimizerSwapper.map_sub_group`), laid out as ``_rank_state``
        reads them. Nothing is copied into anonymous memory: ``torch.save`` (with
        ``share_saved_tensors``) streams the pages from the page cache, which the kernel can
        reclaim. A fragment that straddles sub-groups is assembled in a temporary file under
        the swap directory (unlinked at once, mapped shared), so the saved fragments are
        exactly those of the in-memory layout. Read-only: nothing is written back."""
        if self._resident:
            yield
            return
        o, inner = self.owner, self.inner
        maps = {}

        def view(s, name, lo, n):   # partition elements [lo, lo + n) of sub-group s's tensor `name`
            if s.sg_id not in maps:
                maps[s.sg_id] = self.swapper.map_sub_group(s.sg_id)
            return maps[s.sg_id][name].narrow(0, lo - s.lo, n)

        plans, straddle = [], 0
        for g, sgs in enumerate(self.by_group):
            stepped = [s.has_state for s in sgs]
            if any(stepped) and not all(stepped):
                raise RuntimeError(f"param group {g}: some sub-groups were stepped and some not "
                                   f"(an optimizer step failed part way); the state cannot be read as a whole")
            keys = list(self.keys[g]) if sgs and all(stepped) else []
            items = []
            for f in o.fragments[g]:
                a, b = f.part_offset, f.part_offset + f.numel
                inside = [s for s in sgs if s.lo < b and a < s.hi]
                if len(inside) == 1:
                    items.append((f, inside, None))
                else:
                    items.append((f, inside, straddle))
                    straddle += f.numel * (1 + len(keys))
            plans.append((keys, items))
        saved_opt, saved_seg = list(o.opt_tensors), o._frag_seg
        installed = []
        self._resident = True
        try:
            big = None
            if straddle:
                tmp = os.path.join(self.swapper.swap_folder, f"checkpoint_straddlers.{os.getpid()}.tmp")
                try:
                    big = map_file(tmp, straddle, torch.float32, create=True)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)      # the mapping keeps the pages; nothing is left behind on a crash
            frag_seg = {}
            for g, (keys, items) in enumerate(plans):
                sgs = self.by_group[g]
                scalars = ({k: v for k, v in inner.state.get(sgs[0].placeholder, {}).items() if k not in keys}
                           if sgs else {})
                tensors = []
                for j, (f, inside, pos) in enumerate(items):
                    if pos is None:
                        vs = {n: view(inside[0], n, f.part_offset, f.numel) for n in ["param"] + keys}
                    else:
                        vs = {}
                        for q, n in enumerate(["param"] + keys):
                            dst = big.narrow(0, pos + q * f.numel, f.numel)
                            for s in inside:
                                a, b = max(f.part_offset, s.lo), min(f.part_offset + f.numel, s.hi)
                                dst.narrow(0, a - f.part_offset, b - a).copy_(view(s, n, a, b - a))
                            vs[n] = dst
                    t = vs["param"]
                    tensors.append(t)
                    frag_seg[id(f)] = (j, 0)
                    if keys:
                        inner.state[t] = dict(scalars, **{k: vs[k] for k in keys})
                        installed.append(t)
                if not tensors:   # no fragment of this group on this rank: its scalars only
                    t = torch.empty(0, dtype=torch.float32)
                    tensors.append(t)
                    if keys:
                        inner.state[t] = dict(scalars)
                        installed.append(t)
                o.opt_tensors[g] = tensors
            o._frag_seg = frag_seg
            yield
        finally:
            for t in installed:
                inner.state.pop(t, None)
            for g, ts in enumerate(saved_opt):
                o.opt_tensors[g] = ts
            o._frag_seg = saved_seg
            self._resident = False

    def load_from_index(self, idx, load_optimizer_states: bool) -> None:
        """A checkpoint load (``FlatStateMixin._load_from_index`` for NVMe), one sub-group at
        a time: each is swapped in, its master (and with ``load_optimizer_states`` its state)
        overwritten from the memory-mapped checkpoint, copied into the parameters, and
        written back; then the scalars and hyperparameters go to the optimizer and the
        parameters are all-gathered. Memory: the swap buffers only. Everything that can fail
        for the checkpoint's content (missing parameters, elements or state, another
        optimizer's state, group counts) is checked before any file is written."""
        from ..checkpoint.errors import CheckpointError
        from ..checkpoint.universal import apply_group_hyperparameters, load_torch_optimizer
        o, inner = self.owner, self.inner
        where = f"loading '{idx.directory}'"
        idx.require([s.name for s in o.slots] if idx.complete
                    else sorted({f.slot.name for frags in o.fragments for f in frags}))
        with_state = bool(load_optimizer_states) and inner is not None
        group_of = idx.group_of()
        plans = []   # per group: (state keys loaded, scalars, {id(fragment): its state keys})
        for g, frags in enumerate(o.fragments):
            keys, scalars, keyed = None, {}, {}
            for f in frags:
                idx.check(f.slot.name, "fp32", f.param_start, f.numel)
                keyed[id(f)] = idx.state_keys(f.slot.name) if with_state else []
                if not keyed[id(f)]:
                    continue
                if keys is None:   # the group's state: the keys of its first fragment that has some
                    keys = keyed[id(f)]
                    scalars = idx.group_state[group_of.get(f.slot.name, 0)]
                extra = sorted(set(keyed[id(f)]) - set(keys))
                if extra:
                    raise CheckpointError(f"{where}: parameter '{f.slot.name}' has optimizer state {extra} that "
                                          f"the other parameters of its group lack ({sorted(keys)}).")
                for k in keyed[id(f)]:
                    idx.check(f.slot.name, k, f.param_start, f.numel)
            keys = list(keys or [])
            if keys and sorted(keys) != sorted(self.keys[g]):
                raise RuntimeError(
                    f"param group {g}: the loaded optimizer state has per-element entries {sorted(keys)}, "
                    f"but {type(inner).__name__}'s swap files hold {sorted(self.keys[g])}; load a checkpoint "
                    f"written with the same optimizer type.")
            plans.append((keys, scalars, keyed))
        if with_state:   # the group-count check of the hyperparameters, before anything is written
            apply_group_hyperparameters(idx.param_groups, [{k: v for k, v in grp.items() if k != "params"}
                                                           for grp in inner.param_groups], where)
        index = {s.sg_id: s for s in self.subgroups}
        for sg_id, t in self.swapper.iterate():
            s = index[sg_id]
            g = s.group
            keys, _, keyed = plans[g]
            if with_state:
                for k in self.keys[g]:
                    t[k].zero_()
            for f in o.fragments[g]:
                a, b = max(f.part_offset, s.lo), min(f.part_offset + f.numel, s.hi)
                if a >= b:
                    continue
                start = f.param_start + a - f.part_offset
                idx.read(f.slot.name, "fp32", start, b - a, out=t["param"].narrow(0, a - s.lo, b - a))
                for k in keyed[id(f)]:
                    idx.read(f.slot.name, k, start, b - a, out=t[k].narrow(0, a - s.lo, b - a))
            o._copy_partition_to_params(g, s.lo, s.hi, t["param"])
        if with_state:
            states = {}
            for g, sgs in enumerate(self.by_group):
                keys, scalars, _ = plans[g]
                for s in sgs:
                    s.has_state = bool(keys)
                    if keys:   # one copy per sub-group: optimizers update scalars like `step` in place
                        states[id(s.placeholder)] = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                                     for k, v in scalars.items()}
            load_torch_optimizer(inner, states, idx.param_groups, where)
            saved = idx.loss_scaler
            if saved is not None and o.scaler.dynamic and saved.get("dynamic"):
                o.scaler.load_state_dict(saved)
        if o.n_parts > 1:
            o._all_gather_params()

    def masters_from_module(self) -> None:
        """``after_module_load`` for NVMe (module weights loaded without optimizer state): each
        sub-group's master follows the module's parameters, one sub-group at a time; the
        optimizer state in the files is kept."""
        o = self.owner
        index = {s.sg_id: s for s in self.subgroups}
        for sg_id, t in self.swapper.iterate():
            s = index[sg_id]
            for f in o.fragments[s.group]:
                a, b = max(f.part_offset, s.lo), min(f.part_offset + f.numel, s.hi)
                if a < b:
                    src = f.slot.param.detach().reshape(-1).narrow(0, f.param_start + a - f.part_offset, b - a)
                    t["param"].narrow(0, a - s.lo, b - a).copy_(src)

    def _write_back(self, fulls, saved_params) -> None:
        inner = self.inner
        for g, full in enumerate(fulls):
            state = inner.state.get(full, {})
            per_elem = {k: v for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.shape == full.shape}
            scalars = {k: v for k, v in state.items() if k not in per_elem}
            if per_elem and sorted(per_elem) != sorted(self.keys[g]):
                raise RuntimeError(
                    f"param group {g}: the loaded optimizer state has per-element entries {sorted(per_elem)}, "
                    f"but {type(inner).__name__}'s swap files hold {sorted(self.keys[g])}; load a checkpoint "
                    f"written with the same optimizer type.")
            for s in self.by_group[g]:
                tensors = {"param": full.narrow(0, s.lo, s.numel)}
                for k in self.keys[g]:
                    v = per_elem.get(k)
                    tensors[k] = (v.narrow(0, s.lo, s.numel).float() if v is not None
                                  else torch.zeros(s.numel, dtype=torch.float32))
                self.swapper.write_sub_group(s.sg_id, tensors)
                s.has_state = bool(per_elem)
                p = s.placeholder
                inner.state.pop(p, None)
                if per_elem:
                    inner.state[p] = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                      for k, v in scalars.items()}

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> Dict[str, float]:
        return dict(self.swapper.stats) if self.swapper is not None else {}

    def close(self) -> None:
        """Finish in-flight I/O and delete the swap files (the engine's ``destroy()``)."""
        if self.swapper is not None:
            self.swapper.close()


class NvmeStateAccess:
    """The :class:`~.flat_state.FlatStateMixin` entry points that read or write masters and
    optimizer state, run over the resident form when the masters live on NVMe
    (``self._nvme``); otherwise straight through. Reads return copies outside a resident
    form (the buffers they would view are reused)."""

    _nvme: Optional[NvmeMasters] = None

    def _nvme_resident(self, write_back: bool):
        return self._nvme.resident(write_back) if self._nvme is not None else contextlib.nullcontext()

    def _rank_state(self, dp_rank: int, mp_rank: int) -> dict:
        with self._nvme_resident(False):
            return super()._rank_state(dp_rank, mp_rank)

    def save_optimizer_state(self, writer, dp_rank, mp_rank):
        if self._nvme is None or self._nvme.is_resident or not (self.partition_master or dp_rank == 0):
            return super().save_optimizer_state(writer, dp_rank, mp_rank)
        # the fragments as views of the memory-mapped swap files, saved without a copy: the
        # state streams from the page cache instead of being held in anonymous memory
        from ..checkpoint.universal import share_saved_tensors
        with self._nvme.mapped_fragments(), share_saved_tensors():
            super().save_optimizer_state(writer, dp_rank, mp_rank)

    def _load_from_index(self, idx, load_optimizer_states: bool) -> None:
        if self._nvme is None or self._nvme.is_resident:
            return super()._load_from_index(idx, load_optimizer_states)
        self._nvme.load_from_index(idx, load_optimizer_states)   # sub-group by sub-group

    def after_module_load(self) -> None:
        if self._nvme is None or self._nvme.is_resident:
            return super().after_module_load()
        self._nvme.masters_from_module()

    def _local(self, param, what: str, key: Optional[str] = None):
        if self._nvme is None or self._nvme.is_resident or what == "grad":
            return super()._local(param, what, key)
        with self._nvme.resident(False):
            out = super()._local(param, what, key)
            return None if out is None else out.clone()

    def set_full_fp32_param(self, param, value):
        with self._nvme_resident(True):
            super().set_full_fp32_param(param, value)

    def set_full_optimizer_state(self, param, key, value):
        with self._nvme_resident(True):
            super().set_full_optimizer_state(param, key, value)

    def set_local_fp32_param(self, param, value):
        with self._nvme_resident(True):
            super().set_local_fp32_param(param, value)

    def set_local_optimizer_state(self, param, key, value):
        with self._nvme_resident(True):
            super().set_local_optimizer_state(param, key, value)
