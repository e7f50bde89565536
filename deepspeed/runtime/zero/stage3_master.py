"""This rank's slice of the training state: parameter partitions, fp32 master weights,
gradient partitions, and the optimizer that updates them.

Trainable parameters are laid out per optimizer parameter group in *chunks* of at
most ``sub_group_size`` elements (whole partitions only). Each chunk owns three flat
tensors and every parameter's ``ds_tensor`` becomes a view into the first:

* ``lp``: the partitions in the training dtype, on the partition device (host memory
  with ``offload_param``);
* ``master``: fp32 copy the optimizer updates, on the optimizer device (host memory
  with ``offload_optimizer``). In fp32 training, when parameters and optimizer live on
  the same side, ``master`` *is* ``lp``: no copy at all, so fp32 stage 3 holds
  4 (params) + 4 (grads) + 8 (Adam) bytes per parameter divided by N;
* ``grad``: the accumulated, averaged gradient partition (``data_types.grad_accum_dtype``,
  default the training dtype, as DeepSpeed documents), on the optimizer device.

With ``offload_optimizer.device: nvme`` (``nvme=True``) ``master`` is a zero-element
holder and the values, with the optimizer's per-element state, live in swap files
(:mod:`.stage3_nvme`, attached by :meth:`MasterPartitions.swap_to_nvme`).

The optimizer sees one tensor per chunk. The step runs chunk waves of at most
``sub_group_size`` elements, so the fp32 gradient copies mixed precision needs
are bounded by that size. On the host, with DeepSpeed's Adam, there are no such
copies: the 16-bit gradients are cast a cache-sized slice at a time into a small
staging buffer, for the norm and again for the update (``FusedAdam.step_streamed``;
see ``runtime/precision/streamed.py``, shared with the flat strategies).

With ``offload_optimizer.super_offload`` the chunks are stepped during backward, each as
soon as its gradients are in (:mod:`.stage3_offload_overlap`; resolved at the first
gradient, from the owning strategy's config). The step's work shows in the engine's step
trace as ``offload.*`` ranges (``offload.grad_to_host``: reduced gradients added into the
chunks' gradient buffers; ``offload.optimizer_subgroup``: the optimizer over one chunk).
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from ...accelerator import get_accelerator
from ..precision.streamed import STREAM_CHUNK, sliced_norms, staging_buffer, sum_of_squares
from ...utils.pin_memory import native_pinning
from .partitioned_gather import _runs

_FP32 = torch.float32
_UNSET = object()

_NO_RANGE = contextlib.nullcontext()


def _range(name: str):
    """A named profiler range, only while a profiler records (``record_function`` costs about
    10-30 us of host time per use even when nothing listens: a step's per-bucket gradient adds
    paid it once per bucket)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


class Chunk:
    """Whole partitions of some parameters of one optimizer group, and their flat tensors."""

    def __init__(self, group: int, params):
        self.group = group
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets, n = [], 0
        for s in self.sizes:
            self.offsets.append(n)
            n += s
        self.numel = n
        self.lp = self.master = self.grad = None


def _chunk_params(params, sub_group_size):
    """Whole partitions in chunks of at most ``sub_group_size`` elements (a larger one alone)."""
    return _runs(params, lambda p: p.ds_tensor.numel(), sub_group_size)


def _gathered_first(params):
    """A group's parameters with a partition, in the chunk order: those gathered for forward
    first, in their order, then those kept whole (``ds_persist``). So the partitions a module or
    a prefetch bucket gathers lie back to back in the chunk and go in as one view, not one
    concatenation per gather. Only the layout changes: checkpoints are keyed by name."""
    params = [p for p in params if p.ds_tensor.numel() > 0]
    return [p for p in params if not p.ds_persist] + [p for p in params if p.ds_persist]


class MasterPartitions:
    stream_chunk = STREAM_CHUNK
    streamed = None          # whether the step streams; decided at the first step

    def __init__(self, groups, *, dtype, grad_dtype, opt_device, share_master: bool, sub_group_size: int,
                 pin_memory: bool = False, nvme: bool = False):
        self.dtype = dtype
        self.nvme = None                # NvmeMasters once swap_to_nvme ran
        self._nvme_holders = bool(nvme)
        self.grad_dtype = grad_dtype
        self.opt_device = torch.device(opt_device)
        self.sub_group_size = int(sub_group_size)
        self.chunks = []
        self.slot = {}                  # id(param) -> (chunk, offset, size)
        self.group_hparams = []
        # host masters/gradients pinned when asked and something can pin them (a CUDA runtime, or
        # DS_PIN_MEMORY_BACKEND=native); every pin goes through the accelerator (_pin)
        pin = pin_memory and self.opt_device.type == "cpu" and (torch.cuda.is_available()
                                                                 or native_pinning())
        self._pinned = []               # what _pin pinned: unpin_host_buffers() releases it
        for gi, g in enumerate(groups):
            self.group_hparams.append({k: v for k, v in g.items() if k != "params"})
            for plist in _chunk_params(_gathered_first(g["params"]), self.sub_group_size):
                c = Chunk(gi, plist)
                self._build(c, share_master, pin)
                self.chunks.append(c)
        self._chunk_index = {id(c): i for i, c in enumerate(self.chunks)}
        self._ovl = _UNSET              # OverlapStepper (super_offload) or None, resolved on first use
        self._grad_views = {}           # id(p) -> (its chunk's gradient buffer, p's view of it)

    def _overlap(self):
        if self._ovl is _UNSET:
            from .stage3_offload_overlap import plan_overlap
            self._ovl = plan_overlap(self) if self.chunks else None
        return self._ovl

    def _settle(self) -> None:
        """Before the partitions are read or written from outside the step: no speculative
        update outstanding (super_offload), so they hold the state before the step."""
        if self._ovl is not _UNSET and self._ovl is not None:
            self._ovl.rollback_all()

    def _build(self, c: Chunk, share: bool, pin: bool) -> None:
        dev = c.params[0]._z3.partition_device
        lp = torch.empty(c.numel, dtype=self.dtype, device=dev)
        if c.params[0]._z3.pin_memory:
            lp = self._pin(lp)
        for p, off, s in zip(c.params, c.offsets, c.sizes):
            lp[off:off + s].copy_(p.ds_tensor)
            view = lp[off:off + s]
            view.ds_numel = s
            p.ds_tensor = view
            self.slot[id(p)] = (c, off, s)
        c.lp = lp
        if self._nvme_holders:          # values go to the swapper in swap_to_nvme, chunk by chunk
            c.master = torch.empty(0, dtype=_FP32, device=self.opt_device)
        elif share and self.dtype == _FP32 and dev == self.opt_device:
            c.master = lp
        else:
            c.master = lp.to(device=self.opt_device, dtype=_FP32, copy=True)
            if pin:
                c.master = self._pin(c.master)
        c.grad = torch.zeros(c.numel, dtype=self.grad_dtype, device=self.opt_device)
        if pin:
            c.grad = self._pin(c.grad)

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` pinned by the accelerator (its backend, the pin-memory tracker), remembered for
        :meth:`unpin_host_buffers`."""
        t = get_accelerator().pin_memory(t)
        self._pinned.append(t)
        return t

    def unpin_host_buffers(self) -> None:
        """engine.destroy(): release every host buffer :meth:`_pin` pinned (the chunks' partitions,
        masters, gradients) through ``get_accelerator().unpin_memory`` - with the native backend the
        page-locked allocations are freed (the tensors keep readable, pageable memory); with
        torch's pinning a no-op (freed with the tensors)."""
        acc = get_accelerator()
        pinned, self._pinned = self._pinned, []
        for t in pinned:
            acc.unpin_memory(t)

    # -- NVMe-swapped masters (offload_optimizer.device: nvme) -------------------------------
    def swap_to_nvme(self, optimizer, offload_optimizer, aio=None) -> None:
        """Move every chunk's master and optimizer state into a swapper, one chunk at a time."""
        from .stage3_nvme import NvmeMasters
        if not self._nvme_holders:
            raise RuntimeError("MasterPartitions was built without nvme=True")
        nv = NvmeMasters(self, offload_optimizer, aio)
        try:
            nv.build(optimizer)
        except BaseException:
            nv.close()
            raise
        self.nvme = nv

    def chunk_state(self, index: int, optimizer, mapped: bool = False):
        """(fp32 master, per-element optimizer state, scalar state) of chunk ``index`` (with
        NVMe the swapped ones read back as ordinary tensors, or with ``mapped`` as views of a
        memory map of the swap file, for a checkpoint save)."""
        from ..checkpoint.universal import split_param_state
        self._settle()
        c = self.chunks[index]
        state = optimizer.state.get(c.master, {}) if optimizer is not None else {}
        per_elem, scalars = split_param_state(state, c.master.shape)
        if self.nvme is None:
            return c.master, per_elem, scalars
        master, per_elem = self.nvme.chunk_state(index, mapped=mapped)
        return master, per_elem, scalars

    def master_for_load(self, index: int) -> torch.Tensor:
        """The tensor a checkpoint load writes chunk ``index``'s fp32 master into."""
        self._settle()
        if self.nvme is None:
            return self.chunks[index].master
        return self.nvme._master_from_partitions(self.chunks[index])

    def close(self) -> None:
        """Delete the swap files (engine.destroy()); stop the super_offload worker."""
        if self._ovl is not _UNSET and self._ovl is not None:
            self._ovl.close()
        if self.nvme is not None:
            self.nvme.close()

    # -- optimizer -------------------------------------------------------------------------
    def optimizer_groups(self):
        out = []
        for gi, hp in enumerate(self.group_hparams):
            out.append(dict(hp, params=[c.master for c in self.chunks if c.group == gi]))
        return out

    # -- gradients -------------------------------------------------------------------------
    def owns(self, p) -> bool:
        return id(p) in self.slot

    def accumulate(self, p, reduced: torch.Tensor) -> None:
        c, off, s = self.slot[id(p)]
        ov = self._ovl if self._ovl is not _UNSET else self._overlap()
        if ov is not None:
            ov.before_add(self._chunk_index[id(c)])
        # p's view of its chunk's gradient buffer, made once per buffer (one rank hands every
        # gradient over here, one call per parameter per backward)
        gv = self._grad_views.get(id(p))
        if gv is None or gv[0] is not c.grad:
            gv = self._grad_views[id(p)] = (c.grad, c.grad[off:off + s])
        dst = gv[1]
        # blocking: a non-blocking device-to-host copy could be read before it lands
        with _range("offload.grad_to_host"):
            dst.add_(reduced.to(dst.device) if reduced.device != dst.device else reduced)   # add_ casts the dtype
        if ov is not None:
            ov.added(self._chunk_index[id(c)], s)

    def slot_order(self, p):
        """Sort key of ``p``'s partition in this rank's layout (chunk index, offset)."""
        c, off, _ = self.slot[id(p)]
        return (self._chunk_index[id(c)], off)

    def accumulate_many(self, items, reduced: torch.Tensor) -> None:
        """``items``: (param, offset in ``reduced``, size), in slot order. Runs of partitions that
        are adjacent both in ``reduced`` and in one chunk's gradient go in one add."""
        run = None   # [chunk, chunk offset, reduced offset, length]
        ov = self._overlap()
        with _range("offload.grad_to_host"):
            for p, roff, s in items:
                c, off, _ = self.slot[id(p)]
                if run is not None and run[0] is c and run[1] + run[3] == off and run[2] + run[3] == roff:
                    run[3] += s
                    continue
                if run is not None:
                    self._add_run(*run, reduced, ov)
                run = [c, off, roff, s]
            if run is not None:
                self._add_run(*run, reduced, ov)

    def _add_run(self, c, off, roff, n, reduced, ov=None) -> None:
        if ov is not None:
            ov.before_add(self._chunk_index[id(c)])
        # blocking: a non-blocking device-to-host copy could be read before it lands
        src = reduced[roff:roff + n]
        dst = c.grad[off:off + n]
        if src.device != dst.device:
            src = src.to(dst.device)
        dst.add_(src)    # add_ casts the dtype itself
        if ov is not None:   # the chunk's last gradient in: super_offload hands it to the worker
            ov.added(self._chunk_index[id(c)], n)

    def zero_grads(self) -> None:
        if self._ovl is not _UNSET and self._ovl is not None:
            self._ovl.reset()      # a step skipped after speculative updates: they are undone
        for c in self.chunks:
            c.grad.zero_()

    def grad_view(self, p):
        self._settle()
        c, off, s = self.slot[id(p)]
        return c.grad[off:off + s]

    def master_view(self, p):
        self._settle()
        if self.nvme is not None:
            raise RuntimeError("ZeRO-3 with offload_optimizer.device 'nvme': the fp32 masters live in swap files; "
                               "there is no in-memory view of them (save a checkpoint to read them).")
        c, off, s = self.slot[id(p)]
        return c.master[off:off + s]

    def local_sq_norm(self, param_filter=None) -> torch.Tensor:
        """Sum of squares of this rank's gradient partitions (float64 scalar)."""
        ov = self._ovl if self._ovl is not _UNSET else None
        if ov is not None and param_filter is None:
            ov.drain()   # the worker computed the norms of the chunks it stepped: same values, same order
            norms = [n for i, c in enumerate(self.chunks) for n in (ov.norms.get(i) or self._chunk_norms(c))]
            return sum_of_squares(norms)
        if param_filter is None:
            grads = [c.grad for c in self.chunks]
        else:
            grads = [c.grad[off:off + s] for c in self.chunks for p in c.params if param_filter(p)
                     for _, off, s in [self.slot[id(p)]]]
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        total = torch.zeros((), dtype=torch.float64)
        by_device = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            if dev.type == "cpu":
                norms = self._host_norms(gs)
            else:
                norms = torch._foreach_norm(gs, 2.0, dtype=_FP32)   # one fused launch, no copies
            sq = sum_of_squares(norms)
            total += sq if sq.device.type == "cpu" else sq.cpu()  # one sync per device
        return total

    def _chunk_norms(self, c):
        """The norms ``local_sq_norm`` sums for chunk ``c`` (host gradients)."""
        return self._host_norms([c.grad])

    def _host_norms(self, grads):
        """L2 norms of host gradients, 16-bit ones cast a slice at a time into one small
        staging buffer (no whole fp32 copy; torch's fp32-accumulating norm of bf16/fp16
        runs ~10x slower on the CPU than cast + norm)."""
        low = [g for g in grads if g.dtype != _FP32]
        staging = staging_buffer(max(g.numel() for g in low), self.stream_chunk) if low else None
        norms = []
        for g in grads:
            if g.dtype == _FP32:
                norms.append(torch.linalg.vector_norm(g))
            else:
                norms += sliced_norms(g.numel(), lambda lo, hi, out, g=g: out.copy_(g[lo:hi]), staging)
        return norms

    # -- update ----------------------------------------------------------------------------
    def step(self, optimizer, coef: float) -> None:
        """Run the optimizer over chunk waves of at most sub_group_size elements; ``coef``
        (loss-scale inverse times clip coefficient) is applied to the gradients first.
        With NVMe: one chunk at a time through the swapper's pipeline."""
        if self.nvme is not None:
            self.nvme.step(optimizer, coef, self._use_streamed(optimizer), self.stream_chunk)
            return
        ov = self._overlap()
        if ov is not None:
            ov.step(optimizer, coef)
            return
        wave, n = [], 0
        for c in self.chunks:
            if wave and n + c.numel > self.sub_group_size:
                with _range("offload.optimizer_subgroup"):
                    self._step_wave(optimizer, wave, coef)
                wave, n = [], 0
            wave.append(c)
            n += c.numel
        if wave:
            with _range("offload.optimizer_subgroup"):
                self._step_wave(optimizer, wave, coef)

    def _use_streamed(self, optimizer) -> bool:
        if self.streamed is None:
            self.streamed = bool(
                self.chunks and callable(getattr(optimizer, "step_streamed", None))
                and optimizer.supports_streamed_step()
                and all(c.grad.dtype != _FP32 and c.master is not c.lp
                        and c.grad.device.type == c.master.device.type == c.lp.device.type == "cpu"
                        for c in self.chunks))
        return self.streamed

    def _step_wave(self, optimizer, wave, coef) -> None:
        if self._use_streamed(optimizer):
            by_master = {id(c.master): c for c in wave}

            def fill(m, lo, hi, out):
                out.copy_(by_master[id(m)].grad[lo:hi])

            def copy_back(m, lo, hi):
                by_master[id(m)].lp[lo:hi].copy_(m[lo:hi])

            staging = staging_buffer(max(c.numel for c in wave), self.stream_chunk)
            optimizer.step_streamed(fill, staging, copy_back, grad_mult=coef, params=[c.master for c in wave])
            return
        self._step_wave_whole(optimizer, wave, coef)

    def _step_wave_whole(self, optimizer, wave, coef) -> None:
        """One ``optimizer.step()`` over the wave's masters with fp32 copies of the gradients."""
        for c in wave:
            g = c.grad
            if g.dtype != _FP32 or g.device != c.master.device:
                g = g.to(device=c.master.device, dtype=_FP32)
            if coef != 1.0:
                g.mul_(coef)
            c.master.grad = g
        optimizer.step()
        for c in wave:
            c.master.grad = None
            self._master_to_lp(c, non_blocking=True)

    def _master_to_lp(self, c, non_blocking: bool = False) -> None:
        """The updated master into the chunk's training-dtype partitions."""
        if c.lp is not c.master:
            c.lp.copy_(c.master, non_blocking=non_blocking)

    def refresh_master_from_partitions(self, params=None) -> None:
        """Copy partitions (e.g. just loaded or modified) into the fp32 master."""
        self._settle()
        if self.nvme is not None:
            self.nvme.refresh_from_partitions(params)
            return
        for c in self.chunks:
            if c.lp is c.master:
                continue
            if params is None:
                c.master.copy_(c.lp)
            else:
                for p in params:
                    if id(p) in self.slot and self.slot[id(p)][0] is c:
                        _, off, s = self.slot[id(p)]
                        c.master[off:off + s].copy_(c.lp[off:off + s])

    def copy_master_to_partitions(self) -> None:
        self._settle()
        if self.nvme is not None:
            self.nvme.copy_to_partitions()
            return
        for c in self.chunks:
            self._master_to_lp(c)

    # -- accounting ------------------------------------------------------------------------
    def bytes(self) -> dict:
        lp = sum(c.lp.numel() * c.lp.element_size() for c in self.chunks if c.lp is not None)
        master = sum(c.master.numel() * 4 for c in self.chunks if c.master is not c.lp)
        grads = sum(c.grad.numel() * c.grad.element_size() for c in self.chunks)
        out = {"param_partitions": lp, "master": master, "grads": grads}
        if self.nvme is not None:
            out["nvme_swap_buffers"] = self.nvme.buffer_bytes()
        return out
