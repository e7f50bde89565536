"""ZeRO stage 3 with ``offload_optimizer.device: "nvme"``: the fp32 master weights and the
optimizer's per-element state live in swap files, one sub-group per chunk.

:class:`~.stage3_master.MasterPartitions` keeps its chunks (``sub_group_size`` elements of
whole partitions each) and, per chunk, the flat gradient buffer in host memory as with CPU
offload. What changes is the master: ``chunk.master`` is a zero-element *holder* tensor -
the object the inner optimizer holds in its param groups and keys its state by - and the
values live in an :class:`~deepspeed.runtime.swap_tensor.OptimizerSwapper` sub-group
together with every per-element state tensor of the optimizer (``exp_avg``/``exp_avg_sq``
for Adam; whatever tensors shaped like the parameter the optimizer keeps). Scalars
(``step``) stay in ``optimizer.state[holder]`` in memory.

* **Build** (:meth:`NvmeMasters.build`): the optimizer's per-element state names are found
  by one step on a 3-element probe tensor under each group's hyperparameters (the probe's
  state is dropped); then chunk by chunk the master is made from the partitions, written
  to the swapper with zero state, and freed, so only one chunk's master exists at a time.
* **Step** (:meth:`NvmeMasters.step`): the swapper's ``iterate()`` loop (pipelined reads
  and writes when ``pipeline_read``/``pipeline_write``): for each chunk the holder is
  pointed at the swapped-in master (``Tensor.set_``), the state views are put into
  ``optimizer.state[holder]``, the optimizer updates them in place, the updated master is
  copied into the parameters' partitions, and the holder is emptied again before the
  buffer is written back. A chunk never stepped before (fresh run, or loaded from a
  checkpoint without optimizer state) lets the optimizer create its state in memory as it
  always does; that state is copied into the swap buffer after the update and dropped.
* **Checkpoints**: a save takes each chunk as views of a memory map of its swap file
  (:meth:`chunk_state` with ``mapped=True``), so ``torch.save`` streams the state from the
  page cache and no copy of it is made in anonymous memory; a load fills one swap buffer per
  chunk straight from the memory-mapped checkpoint (:meth:`chunk_for_load`). The files
  are the ordinary stage-3 fragment files (no swap paths).
* **Lifecycle**: :meth:`close` (from ``engine.destroy()``) deletes the run's swap files;
  a crashed run's directory is removed by the next swapper on the same ``nvme_path``
  (:mod:`deepspeed.runtime.swap_tensor.swap_files`).

Parameter partitions are read and written only inside
:func:`~.partitioned_param.resident_partitions`, one chunk at a time, so NVMe-backed
partitions (``offload_param.device: nvme``) are resident for one chunk only.
"""
from __future__ import annotations

import contextlib

import torch

from ...utils.logging import logger
from .partitioned_param import resident_partitions

_FP32 = torch.float32
PROBE_NUMEL = 3
PARAM_KEY = "param"


def _empty_holder(device) -> torch.Tensor:
    return torch.empty(0, dtype=_FP32, device=device)


def probe_state_keys(optimizer, group_index: int, device) -> list:
    """Names of the per-element state tensors ``optimizer`` keeps for a parameter of
    ``group_index`` (one step on a small probe tensor under that group's hyperparameters;
    the optimizer's own state and groups are left as they were)."""
    probe = torch.zeros(PROBE_NUMEL, dtype=_FP32, device=device)
    probe.grad = torch.zeros_like(probe)
    groups = optimizer.param_groups
    optimizer.param_groups = [dict(groups[group_index], params=[probe])]
    try:
        optimizer.step()
        state = optimizer.state.get(probe, {})
    finally:
        optimizer.param_groups = groups
        optimizer.state.pop(probe, None)
    keys = []
    for k, v in state.items():
        if not (torch.is_tensor(v) and v.shape == probe.shape and k != "step"):
            continue
        if v.dtype != _FP32:
            raise ValueError(f"offload_optimizer.device 'nvme': the optimizer {type(optimizer).__name__} keeps its "
                             f"state '{k}' in {v.dtype}; the NVMe swapper holds float32 state only. Use "
                             f"offload_optimizer.device 'cpu' for this optimizer.")
        if k == PARAM_KEY:
            raise ValueError(f"offload_optimizer.device 'nvme': the optimizer's state name '{k}' clashes with the "
                             f"swapper's name for the master weights.")
        keys.append(k)
    return keys


class NvmeMasters:
    """The swapped fp32 masters and optimizer state of a :class:`MasterPartitions`."""

    def __init__(self, parts, offload_optimizer, aio=None):
        from ..swap_tensor import swapper_from_config
        get = offload_optimizer.get if isinstance(offload_optimizer, dict) else \
            (lambda k, d=None: getattr(offload_optimizer, k, d))
        if get("pipeline_read", False) and get("buffer_count", 4) < 2:
            raise ValueError("zero_optimization.offload_optimizer.pipeline_read needs buffer_count >= 2 (one buffer "
                             "is updated while the next sub-group is read into another); got buffer_count "
                             f"{get('buffer_count', 4)}.")
        self.parts = parts
        self.swapper = swapper_from_config(offload_optimizer, aio)
        self.keys = {}            # group index -> per-element state names
        self.stepped = set()      # chunk indices whose swapped state came from an optimizer step
        self.optimizer = None
        self._closed = False

    @property
    def swap_folder(self) -> str:
        return self.swapper.swap_folder

    # -- build -----------------------------------------------------------------------------
    def build(self, optimizer) -> None:
        """Write every chunk's master (from the partitions) and zero state to the swapper,
        one chunk at a time."""
        self.optimizer = optimizer
        parts = self.parts
        for gi in range(len(parts.group_hparams)):
            has = any(c.group == gi for c in parts.chunks)
            self.keys[gi] = probe_state_keys(optimizer, gi, parts.opt_device) if optimizer is not None and has else []
        for i, c in enumerate(parts.chunks):
            master = self._master_from_partitions(c)
            zeros = torch.zeros(1, dtype=_FP32).expand(c.numel)    # no memory: a stride-0 view
            tensors = {PARAM_KEY: master}
            tensors.update({k: zeros for k in self.keys[c.group]})
            self.swapper.add_sub_group(i, tensors)
            del master, tensors
        logger.info(f"ZeRO-3 offload_optimizer nvme: {len(parts.chunks)} sub-groups "
                    f"({sum(c.numel for c in parts.chunks)} fp32 elements, state {sorted(set().union(*self.keys.values()))}) "
                    f"in '{self.swap_folder}', {self.swapper.buffer_count} swap buffers of "
                    f"{self.swapper.buffer_bytes() // max(1, self.swapper.buffer_count)} bytes")

    @staticmethod
    def _master_from_partitions(c, out=None) -> torch.Tensor:
        master = torch.empty(c.numel, dtype=_FP32) if out is None else out
        with resident_partitions(c.params, write_back=False):
            for p, off, s in zip(c.params, c.offsets, c.sizes):
                master[off:off + s].copy_(p.ds_tensor)
        return master

    @staticmethod
    def _master_to_partitions(c, master) -> None:
        with resident_partitions(c.params, write_back=True):
            for p, off, s in zip(c.params, c.offsets, c.sizes):
                p.ds_tensor.copy_(master[off:off + s])

    # -- step ------------------------------------------------------------------------------
    def step(self, optimizer, coef: float, streamed: bool, stream_chunk: int) -> None:
        from ..precision.streamed import staging_buffer
        chunks = self.parts.chunks
        staging = staging_buffer(max(c.numel for c in chunks), stream_chunk) if streamed and chunks else None
        for i, views in self.swapper.iterate():
            c = chunks[i]
            holder = c.master
            holder.set_(views[PARAM_KEY])
            state = optimizer.state[holder]
            per_elem = [k for k in views if k != PARAM_KEY]
            fresh = i not in self.stepped
            before = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            if not fresh:
                for k in per_elem:
                    state[k] = views[k]
            ok = False
            try:
                if streamed:
                    def fill(m, lo, hi, out, g=c.grad):
                        out.copy_(g[lo:hi])
                    optimizer.step_streamed(fill, staging, None, grad_mult=coef, params=[holder])
                else:
                    g = c.grad.to(dtype=_FP32, copy=True)
                    if coef != 1.0:
                        g.mul_(coef)
                    holder.grad = g
                    optimizer.step()
                if fresh:
                    missing = [k for k in per_elem if k not in state]
                    if missing:
                        raise RuntimeError(f"offload_optimizer nvme: the optimizer did not create state {missing} "
                                           f"it created for the probe tensor at build time")
                    for k in per_elem:
                        views[k].copy_(state[k])
                    self.stepped.add(i)
                self._master_to_partitions(c, holder)
                ok = True
            finally:
                holder.grad = None
                for k in per_elem:
                    state.pop(k, None)
                if not ok:   # the swap file keeps the state from before this step: so do the scalars
                    state.clear()
                    state.update(before)
                holder.set_(_empty_holder(holder.device))

    # -- masters <-> partitions ----------------------------------------------------------------
    def refresh_from_partitions(self, params=None) -> None:
        """Partitions (just loaded or modified) -> swapped masters; state untouched."""
        chunks = self.parts.chunks
        ids = list(range(len(chunks))) if params is None else \
            sorted({chunks.index(self.parts.slot[id(p)][0]) for p in params if id(p) in self.parts.slot})
        for i, views in self.swapper.iterate(ids):
            self._master_from_partitions(chunks[i], out=views[PARAM_KEY])

    def copy_to_partitions(self) -> None:
        for i, c in enumerate(self.parts.chunks):
            views = self.swapper.swap_in(i)
            try:
                self._master_to_partitions(c, views[PARAM_KEY])
            finally:
                self.swapper.release(i)

    # -- checkpoints -----------------------------------------------------------------------
    def chunk_state(self, i: int, mapped: bool = False):
        """(master, per-element state) of chunk ``i``; state is empty for a chunk never
        stepped (as the optimizer's own state would be). ``mapped=False``: ordinary tensors
        (a copy). ``mapped=True``: views of a private memory map of the chunk's swap file
        (file-backed pages, no copy), for a checkpoint save that writes them at once and
        drops them before the next step (see ``OptimizerSwapper.map_sub_group``)."""
        t = self.swapper.map_sub_group(i) if mapped else self.swapper.read_sub_group(i)
        master = t.pop(PARAM_KEY)
        return master, (t if i in self.stepped else {})

    @contextlib.contextmanager
    def chunk_for_load(self, i: int, keys, where: str):
        """Overwrite chunk ``i`` in place: yields ``(master, per_elem)``, views of a zeroed swap
        buffer, the master pre-filled from the parameters' partitions and ``per_elem`` holding
        the state tensors ``keys`` (empty: the chunk starts fresh, as an optimizer without
        state does); the caller fills them, and on a normal exit the buffer is written to the
        chunk's file. Nothing chunk-sized is allocated besides the swap buffer."""
        from ..checkpoint.errors import CheckpointError
        c = self.parts.chunks[i]
        own = self.keys.get(c.group, [])
        keys = list(keys or [])
        if keys and set(keys) != set(own):
            raise CheckpointError(f"{where}: the checkpoint has optimizer state {sorted(keys)} but this "
                                  f"optimizer ({type(self.optimizer).__name__}) keeps {sorted(own)} in the NVMe "
                                  f"swapper; load with load_optimizer_states=False or use the same optimizer.")
        with self.swapper.overwrite_sub_group(i) as views:
            master = views[PARAM_KEY]
            self._master_from_partitions(c, out=master)
            yield master, {k: views[k] for k in keys}
        if keys:
            self.stepped.add(i)
        else:
            self.stepped.discard(i)

    # -- accounting / lifecycle ------------------------------------------------------------------
    def buffer_bytes(self) -> int:
        return self.swapper.buffer_bytes()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.swapper.close()

    # -- per-parameter fragments (deepspeed.utils.safe_get_full_fp32_param & co.) ----------------
    def read_fragment(self, c, off: int, k: int, what: str, key=None):
        """A copy of elements ``[off, off + k)`` of chunk ``c``'s master (``what == "fp32"``) or
        of its optimizer state ``key``; None where that state does not exist (yet)."""
        i = self.parts.chunks.index(c)
        if what != "fp32" and (i not in self.stepped or key not in self.keys.get(c.group, [])):
            return None
        views = self.swapper.swap_in(i)
        try:
            return views[PARAM_KEY if what == "fp32" else key][off:off + k].clone()
        finally:
            self.swapper.release(i)

    def write_fragment(self, c, off: int, k: int, what: str, key, value) -> None:
        """Overwrite elements ``[off, off + k)`` of chunk ``c``'s master (and the parameters'
        partitions) or of its optimizer state ``key``."""
        i = self.parts.chunks.index(c)
        if what != "fp32" and (i not in self.stepped or key not in self.keys.get(c.group, [])):
            raise KeyError(f"optimizer state '{key}' does not exist (yet) for this parameter. "
                           f"Optimizer state is created by the first optimizer step.")
        for _, views in self.swapper.iterate([i]):
            views[PARAM_KEY if what == "fp32" else key][off:off + k].copy_(value.reshape(-1))
            if what == "fp32":
                self._master_to_partitions(c, views[PARAM_KEY])
