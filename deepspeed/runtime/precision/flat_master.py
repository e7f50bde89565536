"""Flat fp32 master weights: the engine of mixed precision and of ZeRO stages 1 and 2.

One class serves three strategies, because they differ only in how many ranks share
a group's master weights (``n_parts``) and in who keeps gradients:

=================  =======  ===============================  =======================
strategy           n_parts  gradients                        reduction
=================  =======  ===============================  =======================
stage 0, 16-bit    1        full flat buffer per group       all-reduce per bucket
stage 1            N        full flat buffer per group       reduce-scatter per bucket
stage 2            N        this rank's partition only       reduce-scatter per bucket,
                                                             every micro-step
=================  =======  ===============================  =======================

Per parameter group everything is flat (see :mod:`.flat_layout`): the module's
parameters are views into one 16-bit (or fp32) buffer; the fp32 master weights of the
rank's partition are one contiguous tensor (in fp32 without offload the master *is*
the partition of the parameter buffer - no copy is kept); the optimizer is built over
those master tensors, so Adam is one fused kernel per group. A step is: one
collective for the overflow flag and the squared gradient norm, one multiply that
unscales, averages and clips, the optimizer update, one copy master -> 16-bit and an
in-place all-gather per bucket. The object is both the engine's strategy and the
``engine.optimizer`` users see (it is a ``torch.optim.Optimizer`` so LR schedulers
accept it; ``param_groups`` are the inner optimizer's).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from functools import partial
from typing import List

import torch
import torch.distributed as dist

from ...config.errors import DeepSpeedConfigError
from ...utils.logging import logger
from ...utils.pin_memory import native_pinning
from ..comm.optimizer_hooks import gradient_allreduce_needed
from ..nonfinite import on_nonfinite
from ..strategy import StepOutcome, StrategyContext, TrainingStrategy
from ..utils import clip_coef, is_model_parallel_parameter
from ..zero.stage0 import comm_dtype as _comm_dtype
from .flat_layout import GroupLayout, order_buckets
from .flat_state import FlatStateMixin
from .grad_reduce import FullGradReducer, PartitionGradReducer, _Comm, transient_buffer
from .inner_optimizer import InnerOptimizerFace, build_inner_optimizer, user_param_groups
from .loss_scaler import create_loss_scaler, warn_stuck_at_min_scale
from .nvme_master import NvmeMasters, NvmeStateAccess
from .streamed import STREAM_CHUNK, sliced_norms, staging_buffer, sum_of_squares

_ACCUM = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class UnusedParametersError(RuntimeError, AssertionError):
    """A parameter got no gradient in an accumulation window with
    ``zero_optimization.ignore_unused_parameters`` false. DeepSpeed asserts there, so this is
    an ``AssertionError`` (what its clients catch) as well as a ``RuntimeError``."""

class FlatMasterOptimizer(InnerOptimizerFace, NvmeStateAccess, FlatStateMixin, TrainingStrategy, torch.optim.Optimizer):
    """Strategy + optimizer over flat fp32 master weights (see the module docstring)."""

    stage = 0
    partition_master = False     # stage 1/2: master and optimizer state split across ranks
    partition_grads = False      # stage 2: gradients split across ranks
    _grads_local = False         # this window's gradients were not reduced (1-bit optimizers)

    def __init__(self, module: torch.nn.Module, ctx: StrategyContext):
        TrainingStrategy.__init__(self, module, ctx)
        self._init_optimizer_hook_dicts()
        self._configure(ctx)
        groups = user_param_groups(ctx)
        self._build_layouts(groups)
        self._build_parameter_storage()
        # offload_optimizer.device nvme: masters and optimizer state in swap files, by sub-group (.nvme_master)
        self._nvme = NvmeMasters(self) if ctx.config.zero.offload_optimizer_device == "nvme" else None
        self._build_gradient_storage()
        self.inner = build_inner_optimizer(ctx, [dict({k: v for k, v in g.items() if k != "params"},
                                                      params=list(ts)) for g, ts in zip(groups, self.opt_tensors)])
        if self._nvme is not None and not self._nvme.attach(self.inner):
            self._nvme = None       # no optimizer, nothing to swap: the masters stay in memory
            self._segment_masters()
        # engine.optimizer is this object; its .optimizer is the base optimizer that steps the masters
        # (DeepSpeed's FP16_Optimizer / ZeRO optimizer .optimizer)
        self.engine_optimizer = self if self.inner is not None else None
        self.optimizer = self.inner
        self._hooks = [s.param.register_post_accumulate_grad_hook(partial(self._on_grad, s))
                       for lay in self.layouts for s in lay.slots]
        for lay in self.layouts:
            for s in lay.slots:
                s.param._ds_state_owner = self
        self.overflow = False
        self.last_grad_norm = None

    # ------------------------------------------------------------------ construction
    def _init_optimizer_hook_dicts(self):
        # What torch.optim.Optimizer.__init__ would create; we don't call it (no own params).
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())

    def _configure(self, ctx):
        cfg = ctx.config
        z = cfg.zero
        self.dtype = torch.float16 if cfg.fp16_enabled else torch.bfloat16 if cfg.bfloat16_enabled else torch.float32
        self.mixed = self.dtype != torch.float32
        accum = cfg.model.data_types.grad_accum_dtype
        self.grad_dtype = _ACCUM[accum] if accum else self.dtype
        # ZeRO-1/2 accumulate in any grad_accum_dtype, as DeepSpeed's stage_1_and_2; stage 0 takes the
        # training dtype or fp32 (the config refuses other mixes with DeepSpeed's NotImplementedError)
        if self.stage == 0 and self.grad_dtype not in (torch.float32, self.dtype):
            raise DeepSpeedConfigError(
                f"data_types.grad_accum_dtype '{accum}' does not fit training in "
                f"{ {v: k for k, v in _ACCUM.items()}[self.dtype]}: use 'fp32' or the training dtype.")
        self.comm_dtype = _comm_dtype(cfg.model.communication_data_type) or self.grad_dtype
        self.world = ctx.dp_world_size
        # gradients are sums over ``world`` ranks divided by ``average_over``; the MoE composite
        # sets it to the whole data-parallel size for expert parameters (reduced over fewer ranks)
        # (``gradient_allreduce_op: "sum"``: 1, the sum is kept and no predivide applies)
        self.sum_gradients = cfg.model.gradient_allreduce_op == "sum"
        self.average_over = 1 if self.sum_gradients else self.world
        self.rank = ctx.dp_rank
        self.n_parts = self.world if self.partition_master else 1
        self.part_rank = self.rank if self.partition_master else 0
        self.overlap = z.overlap
        self.offload = z.offload_optimizer_device in ("cpu", "nvme")   # nvme: the update runs on the host too
        self.pin_memory = bool(self.offload and z.offload_optimizer.pin_memory)
        self.master_device = torch.device("cpu") if self.offload else torch.device(ctx.device)
        self.clip = cfg.gradient_clipping
        pre = cfg.model.gradient_predivide_factor
        # divide before the collective; the rest of 1/N is folded into the step's multiply
        self.predivide = pre if (cfg.model.prescale_gradients or pre != 1.0) and self.world > 1 \
            and not self.sum_gradients else 1.0
        self.ignore_unused = z.ignore_unused_parameters
        # As at stage 0: one 5e8 bucket (the documented default) cannot overlap backward, so
        # unless the config sets reduce_bucket_size, buckets hold 4M elements.
        from ..zero.stage0 import STAGE0_DEFAULT_BUCKET
        self.reduce_bucket_size = z.reduce_bucket_size_or(STAGE0_DEFAULT_BUCKET)
        self.allgather_bucket_size = z.allgather_bucket_size
        self.skip_on_overflow = cfg.fp16_enabled or (cfg.bfloat16_enabled and cfg.bf16.check_grad_overflow)
        # DeepSpeed's stage-0 fp16 optimizers do not read fp16.hysteresis (ZeRO-1/2 do)
        self.scaler = create_loss_scaler(cfg.fp16, cfg.fp16_enabled, hysteresis=self.stage != 0)
        self.comm = _Comm(ctx.dp_group, self.world, self.rank)

    def _build_layouts(self, groups: List[dict]):
        names = {}
        for n, p in self.module.named_parameters():
            names.setdefault(id(p), n)
        module_index = {id(p): i for i, p in enumerate(self.module.parameters())}
        seen = set()
        self.layouts: List[GroupLayout] = []
        for gi, g in enumerate(groups):
            params = []
            for p in g["params"]:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"param group {gi} holds a {type(p).__name__}, not a tensor.")
                if not p.requires_grad or p.numel() == 0:
                    continue  # frozen (or empty): stays in the module, never in a flat buffer
                if id(p) not in names:
                    raise ValueError(f"param group {gi} holds a parameter of shape {tuple(p.shape)} that is not "
                                     f"a parameter of the model passed to deepspeed.initialize.")
                if id(p) in seen:
                    raise ValueError(f"parameter '{names[id(p)]}' appears in more than one parameter group.")
                if not p.is_floating_point():
                    raise TypeError(f"parameter '{names[id(p)]}' is {p.dtype}; only floating parameters train.")
                seen.add(id(p))
                params.append(p)
            self.layouts.append(GroupLayout(gi, params, [names[id(p)] for p in params], self.n_parts,
                                            self.reduce_bucket_size))
        self.buckets = order_buckets(self.layouts, module_index)
        self.slots = [s for lay in self.layouts for s in lay.slots]
        self.fragments = [lay.fragments(self.part_rank) for lay in self.layouts]

    def _build_parameter_storage(self):
        """Masters first (from the full-precision weights), then cast the module and
        re-home every trainable parameter into its group's flat buffer."""
        separate_master = self.mixed or self.offload
        self.masters = []
        self._pinned_masters = []   # pinned through the accelerator: destroy() unpins them
        for lay, frags in zip(self.layouts, self.fragments):
            if not separate_master:
                self.masters.append(None)
                continue
            m = torch.zeros(lay.part_numel, dtype=torch.float32, device=self.master_device)
            # pinned when asked and something can pin: a device runtime, or DS_PIN_MEMORY_BACKEND=native
            # (page-locked with or without a device); through the accelerator, so its backend and
            # the pin-memory tracker see it
            if self.pin_memory and (torch.device(self.ctx.device).type != "cpu" or native_pinning()):
                from ...accelerator import get_accelerator
                m = get_accelerator().pin_memory(m)
                self._pinned_masters.append(m)
            for f in frags:
                src = f.slot.param.detach().reshape(-1).narrow(0, f.param_start, f.numel)
                m.narrow(0, f.part_offset, f.numel).copy_(src)
            self.masters.append(m)
        if self.mixed:   # parameters only: the engine casts the buffers (precision/module_cast.py)
            for p in self.module.parameters():
                if p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
        self.param_flats = []
        self.opt_tensors = []
        for lay, m in zip(self.layouts, self.masters):
            dev = lay.slots[0].param.device if lay.slots else torch.device(self.ctx.device)
            flat = torch.zeros(lay.numel, dtype=self.dtype, device=dev)
            for s in lay.slots:
                view = flat.narrow(0, s.flat_offset, s.numel)
                view.copy_(s.param.detach().reshape(-1))
                s.param.data = view.view(s.shape)
            self.param_flats.append(flat)
        self._segment_masters()

    def _segment_masters(self):
        """The tensors the optimizer steps, and which of them holds each fragment: the one
        flat master of the group, or (fp32 in place) this rank's chunk of each bucket of
        the parameter buffer."""
        self.segments, self.opt_tensors, self._frag_seg = [], [], {}
        for g, (lay, frags, m) in enumerate(zip(self.layouts, self.fragments, self.masters)):
            if m is None:
                segs = [(b.part_start, b.part_start + b.chunk) for b in lay.buckets]
                self.opt_tensors.append([self.param_flats[g][slice(*b.chunk_range(self.part_rank))]
                                         for b in lay.buckets])
            else:
                segs = [(0, lay.part_numel)] if lay.part_numel else []
                self.opt_tensors.append([m] if segs else [])
            self.segments.append(segs)
            for f in frags:
                k = next(i for i, (a, b) in enumerate(segs) if a <= f.part_offset < b)
                self._frag_seg[id(f)] = (k, f.part_offset - segs[k][0])

    def _build_gradient_storage(self):
        self.grad_bufs, self.part_grads, self._grad_views = [], [], {}
        for lay, flat in zip(self.layouts, self.param_flats):
            if self.partition_grads:
                self.part_grads.append(torch.zeros(lay.part_numel, dtype=self.grad_dtype, device=flat.device))
            else:
                buf = torch.zeros(lay.numel, dtype=self.grad_dtype, device=flat.device)
                self.grad_bufs.append(buf)
                for s in lay.slots:
                    view = buf.narrow(0, s.flat_offset, s.numel)
                    self._grad_views[id(s)] = view
                    if self.grad_dtype == self.dtype:
                        s.param.grad = view.view(s.shape)
        common = dict(overlap=self.overlap, predivide=self.predivide)
        if self.partition_grads:
            self.reducer = PartitionGradReducer(
                self.buckets, self.part_grads, self.n_parts, self.comm,
                reduce_scatter=self.ctx.config.zero.reduce_scatter,
                comm_dtype=self.comm_dtype, contiguous=self.ctx.config.zero.contiguous_gradients, **common)
        else:
            mode = "all_reduce" if self.n_parts == 1 else (
                "reduce_scatter" if self.ctx.config.zero.reduce_scatter else "reduce")
            self.reducer = FullGradReducer(self.buckets, self.grad_bufs, self.n_parts, self.comm, mode=mode,
                                           comm_dtype=self.comm_dtype, **common)
        self._touched = set()

    # ------------------------------------------------------------------ the optimizer face
    @property
    def loss_scale(self) -> float:
        return self.scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.scaler.cur_scale

    @property
    def loss_scaler(self):
        """DeepSpeed's attribute name for the scaler object."""
        return self.scaler

    @property
    def loss_scale_config(self):
        """DeepSpeed 0.19's name for the scaler state (cur_scale, cur_iter, scale_window, ...)."""
        return self.scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.scaler.dynamic

    @property
    def launch_counts(self) -> dict:
        """Collectives launched since construction, by kind (tests count them)."""
        return dict(self.comm.launches)

    def __repr__(self):
        return f"{type(self).__name__}(stage={self.stage}, dtype={self.dtype}, inner={type(self.inner).__name__})"

    # ------------------------------------------------------------------ backward
    def scale_loss(self, loss):
        return self.scaler.scale_loss(loss)

    def _on_grad(self, slot, p):
        self._touched.add(id(slot))
        if self.partition_grads:
            if not self._sync_enabled:
                # engine.no_sync() at stage 2: the full local gradient stays in p.grad, autograd
                # sums later micro-steps into it, and the next synced backward reduces the sum.
                self._unsynced = True
                return
            self.reducer.add_grad(slot, p.grad)
            p.grad = None
            return
        view = self._grad_views[id(slot)]
        if self.grad_dtype != self.dtype:   # accumulate in a wider dtype than autograd's
            view.add_(p.grad.reshape(-1))
            p.grad = None
        elif p.grad.data_ptr() != view.data_ptr():  # someone replaced p.grad (module.zero_grad())
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view(slot.shape)
        self.reducer.mark_ready(slot)

    def backward(self, loss, *, sync, retain_graph=False):
        boundary = self.begin_backward(sync)
        loss.backward(retain_graph=retain_graph)
        self.end_backward(boundary)

    # begin/end are separate so a composite (deepspeed/moe/training.py: expert parameters
    # reduced over their own group) can run one autograd pass for several strategies.
    def begin_backward(self, sync) -> bool:
        boundary = sync and self._sync_enabled
        if boundary:  # 1-bit optimizers average (compressed) in their own step: gradients stay local
            self._grads_local = self.world > 1 and not gradient_allreduce_needed(self.inner)
        if not self.partition_grads:
            self.reducer.armed = boundary and self.world > 1 and not self._grads_local
        return boundary

    def end_backward(self, boundary) -> None:
        if self.partition_grads and self._sync_enabled and getattr(self, "_unsynced", False):
            for s in self.slots:  # no_sync() gradients of parameters this backward did not reach
                if s.param.grad is not None:
                    self._touched.add(id(s))
                    self.reducer.add_grad(s, s.param.grad)
                    s.param.grad = None
            self._unsynced = False
        if self.partition_grads:
            if self._sync_enabled:   # under no_sync() the gradients stay in p.grad: nothing to launch
                self.reducer.finish()
        elif boundary:
            self.reducer.finish()
        if boundary and not self.ignore_unused:
            missing = [s.name for s in self.slots if id(s) not in self._touched]
            if missing:
                raise UnusedParametersError(
                    f"Parameters received no gradient in this accumulation window: {missing[:10]}"
                    f"{' ...' if len(missing) > 10 else ''}. Set zero_optimization.ignore_unused_parameters "
                    f"true to treat their gradients as zero, or freeze them (requires_grad=False).")

    def allreduce_gradients(self) -> None:
        """Reduce the full gradient buffers a boundary backward(sync=False) left local (stages 0/1;
        stage 2 reduces into the partitions in every backward)."""
        if not self.partition_grads and self.world > 1 and gradient_allreduce_needed(self.inner):
            self.reducer.armed = True
            self.reducer.finish()

    # ------------------------------------------------------------------ step
    def step(self, closure=None) -> StepOutcome:
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure) is not supported: a ZeRO/mixed-precision step "
                             "runs after engine.backward().")
        if self.inner is None:
            return StepOutcome()
        if getattr(self, "_unsynced", False):
            raise RuntimeError("engine.step() after backward passes under engine.no_sync() with no synced backward "
                               "since: those gradients were never reduced across ranks. Run the last micro-step's "
                               "backward outside no_sync().")
        prep = self.prepare_step()
        flag, sq = self._overflow_and_sq_norm(prep[2])
        norm = math.sqrt(sq) * self.grad_norm_factor() if math.isfinite(sq) else float(sq)
        return self.finish_step(prep, flag, norm)

    # prepare/finish are separate so a composite (deepspeed/moe/training.py) can decide
    # overflow and the global norm once over several strategies before any of them steps.
    def prepare_step(self):
        """(streamed?, staging or master grads, local squared norm of the summed, scaled grads)."""
        self._adopt_assigned_grads()
        if self._nvme is not None:
            return self._nvme.prepare_step()
        streamed = self._use_streamed_step()
        if streamed:
            staging = staging_buffer(max(m.numel() for m in self.masters), self.stream_chunk)
            local_sq = sum_of_squares([n for g, m in enumerate(self.masters)
                                       for n in sliced_norms(m.numel(), self._grad_filler(g), staging)])
            return streamed, staging, local_sq
        grads = self._attach_master_grads()
        return streamed, grads, sum_of_squares(list(torch._foreach_norm(grads, 2.0)) if grads else [])

    def _adopt_assigned_grads(self):
        """A ``p.grad`` the caller assigned since backward (not the view into the flat buffer)
        is the gradient the step uses, as DeepSpeed's stage-0 FP16/BF16 optimizers read ``p.grad``
        (its ZeRO-1/2 step reads the partitions reduced during backward, and so does this one)."""
        if self.stage != 0 or self.partition_grads:
            return
        for s in self.slots:
            g = s.param.grad
            if g is None:
                continue
            view = self._grad_views[id(s)]
            if g.data_ptr() == view.data_ptr():
                continue
            view.copy_(g.reshape(-1))
            s.param.grad = view.view(s.shape) if self.grad_dtype == self.dtype else None

    def grad_norm_factor(self) -> float:
        """Multiplier from the norm of the summed, loss-scaled gradients to the true norm."""
        if self._grads_local:
            return 1.0 / self.scaler.cur_scale
        return self.predivide / self.average_over / self.scaler.cur_scale

    def finish_step(self, prep, flag, norm) -> StepOutcome:
        """Skip (overflow) or clip by ``norm`` (the true global norm) and update."""
        streamed, staging, _ = prep
        grads = staging
        if flag and self.skip_on_overflow:
            return self._skip_step()
        if flag:   # fp32, or bf16 without overflow checking: never apply a NaN/Inf step
            on_nonfinite(self.ctx.config, norm, f"ZeRO stage {self.ctx.config.zero_optimization_stage}")
            self._detach_master_grads()
            self.last_grad_norm = None
            return StepOutcome(skipped=True, grad_norm=None)
        post = 1.0 if self._grads_local else self.predivide / self.average_over
        scale = self.scaler.cur_scale
        mult = post / scale * (clip_coef(norm, self.clip) if self.clip > 0 else 1.0)
        if self._nvme is not None:   # sub-group by sub-group through the swapper, then all-gather
            self._nvme.step(prep, mult)
            if self.n_parts > 1:
                self._all_gather_params()
        elif streamed:
            self.inner.step_streamed(self._fill_master_grad, staging, self._copy_back_chunk, grad_mult=mult)
            if self.n_parts > 1:
                self._all_gather_params()
        else:
            if mult != 1.0 and grads:
                torch._foreach_mul_(grads, mult)
            self.inner.step()
            self._detach_master_grads()
            self.refresh_module_params()
        self.scaler.update_scale(False)
        self.overflow = False
        self.last_grad_norm = norm
        return StepOutcome(skipped=False, grad_norm=norm)

    # -- the streamed step (see .streamed): 16-bit gradients, fp32 masters in host memory --
    # Each updated slice of masters is copied into the 16-bit parameters while in cache.
    stream_chunk = STREAM_CHUNK
    _streamed = None  # decided at the first step (the inner optimizer exists by then)

    def _use_streamed_step(self) -> bool:
        if self._streamed is None:
            masters = [m for m in self.masters if m is not None]
            self._streamed = bool(
                masters and len(masters) == len(self.masters) and self.grad_dtype != torch.float32
                and all(m.device.type == "cpu" for m in masters)
                and all(m.device == f.device for m, f in zip(self.masters, self.param_flats))
                and callable(getattr(self.inner, "step_streamed", None))
                and self.inner.supports_streamed_step()
                and [[id(p) for p in g["params"]] for g in self.inner.param_groups] == [[id(m)] for m in self.masters])
            self._master_group = {id(m): g for g, m in enumerate(self.masters)}
        return self._streamed

    def _grad_filler(self, g):
        """``fill(lo, hi, out)``: group ``g``'s reduced gradients ``[lo, hi)`` (partition
        offsets) cast into ``out``."""
        whole = self._whole_grads(g)
        return lambda lo, hi, out: self._copy_partition_grads(g, lo, hi, whole, out)

    def _fill_master_grad(self, m, lo, hi, out):
        self._grad_filler(self._master_group[id(m)])(lo, hi, out)

    def _copy_back_chunk(self, m, lo, hi):
        """Masters ``[lo, hi)`` of the partition into this rank's 16-bit parameter storage."""
        self._copy_partition_to_params(self._master_group[id(m)], lo, hi, m.narrow(0, lo, hi - lo))

    def _copy_partition_to_params(self, g, lo, hi, src):
        """``src`` (partition range ``[lo, hi)`` of group ``g``) into this rank's parameter storage."""
        flat = self.param_flats[g]
        if self.n_parts == 1:
            flat.narrow(0, lo, hi - lo).copy_(src)
            return
        for b in self.layouts[g].buckets:
            a, z = max(lo, b.part_start), min(hi, b.part_start + b.chunk)
            if a < z:
                at = b.chunk_range(self.part_rank)[0] + a - b.part_start   # where part offset a sits in flat
                flat.narrow(0, at, z - a).copy_(src.narrow(0, a - lo, z - a))

    def _grad_chunks(self, g):
        """This rank's reduced gradients of group ``g``, one tensor per bucket, partition order."""
        lay = self.layouts[g]
        if self.partition_grads:
            pg = self.part_grads[g]
            return [pg.narrow(0, b.part_start, b.chunk) for b in lay.buckets]
        buf = self.grad_bufs[g]
        return [buf[slice(*b.chunk_range(self.part_rank))] for b in lay.buckets]

    def _attach_master_grads(self) -> List[torch.Tensor]:
        grads = []
        for g, (lay, m) in enumerate(zip(self.layouts, self.masters)):
            if m is None:  # fp32 in place: the reduced chunks are the gradients, no copy
                for t, c in zip(self.opt_tensors[g], self._grad_chunks(g)):
                    if c.dtype != t.dtype:   # ZeRO-1/2 with a 16-bit grad_accum_dtype: the step reads fp32
                        c = c.to(t.dtype)
                    t.grad = c
                    grads.append(c)
                continue
            whole = self._whole_grads(g)
            for t, (a, b) in zip(self.opt_tensors[g], self.segments[g]):
                if whole is not None and whole.dtype == torch.float32 and whole.device == m.device:
                    t.grad = whole.narrow(0, a, b - a)
                else:
                    t.grad = transient_buffer(b - a, torch.float32, m.device)
                    self._copy_partition_grads(g, a, b, whole, t.grad)
                grads.append(t.grad)
        return grads

    def _whole_grads(self, g):
        """This rank's reduced gradients of group ``g`` as one tensor indexed by partition
        offset, where one exists (stage 2's partition, or the whole buffer at one part)."""
        return self.part_grads[g] if self.partition_grads else (self.grad_bufs[g] if self.n_parts == 1 else None)

    def _copy_partition_grads(self, g, a, b, whole, out):
        """Reduced gradients of partition range ``[a, b)`` into ``out`` (cast, maybe to the host)."""
        if whole is not None:
            out.copy_(whole.narrow(0, a, b - a))
            return
        for bk, chunk in zip(self.layouts[g].buckets, self._grad_chunks(g)):
            lo, hi = max(a, bk.part_start), min(b, bk.part_start + bk.chunk)
            if lo < hi:
                out.narrow(0, lo - a, hi - lo).copy_(chunk.narrow(0, lo - bk.part_start, hi - lo))

    def _detach_master_grads(self):
        for ts in self.opt_tensors:
            for t in ts:
                t.grad = None

    def _overflow_and_sq_norm(self, sq):
        """One collective: (any rank non-finite?, squared norm of the summed gradients),
        from this rank's local squared norm ``sq`` (float64)."""
        flag = 0.0 if math.isfinite(sq.item()) else 1.0
        mpu = self.ctx.mpu
        mp_split = mpu is not None and mpu.get_model_parallel_world_size() > 1
        if mp_split and mpu.get_model_parallel_rank() != 0:
            sq = self._sq_norm_model_parallel_only()
        if not self.partition_master and self.rank != 0:
            sq = torch.zeros((), dtype=torch.float64)  # replicated gradients: count them once
        # on the training device: ``sq`` is there without offload, and NCCL reduces device tensors only
        dev = torch.device(self.ctx.device)
        packed = torch.stack([torch.tensor(flag, dtype=torch.float64, device=dev), sq.to(dev)])
        if self.world > 1:
            dist.all_reduce(packed, group=self.ctx.dp_group)
        if mp_split:
            dist.all_reduce(packed, group=mpu.get_model_parallel_group())
        return packed[0].item() > 0, packed[1].item()

    def _sq_norm_model_parallel_only(self):
        parts = []
        for g, frags in enumerate(self.fragments):
            for f in frags:
                if is_model_parallel_parameter(f.slot.param):
                    parts.append(self._fragment_grad(g, f).float())
        return sum_of_squares(list(torch._foreach_norm(parts, 2.0)) if parts else [])

    def _skip_step(self) -> StepOutcome:
        prev = self.scaler.cur_scale
        names = self._overflowed_names()
        self._detach_master_grads()
        self.scaler.update_scale(True)
        self.overflow = True
        self.last_grad_norm = None
        if self.ctx.dp_rank == 0:
            logger.info(f"[deepspeed] {'fp16' if self.dtype == torch.float16 else 'bf16'} gradient overflow on some "
                        f"rank: step skipped, loss scale {prev} -> {self.scaler.cur_scale}")
        if getattr(self.scaler, "overflows_at_min_scale", 0) >= 2:
            gathered = [None] * self.world
            if self.world > 1:
                dist.all_gather_object(gathered, names, group=self.ctx.dp_group)
            else:
                gathered = [names]
            warn_stuck_at_min_scale(self.scaler, sorted({n for ns in gathered for n in ns}))
        return StepOutcome(skipped=True, grad_norm=None)

    def _overflowed_names(self):
        out = []
        for g, frags in enumerate(self.fragments):
            for f in frags:
                if not torch.isfinite(self._fragment_grad(g, f)).all():
                    out.append(f.slot.name)
        return out

    # ------------------------------------------------------------------ DeepSpeed's introspection names
    @property
    def single_partition_of_fp32_groups(self) -> list:
        """Per parameter group, this rank's flat fp32 master partition (DeepSpeed's ZeRO-1/2 name).
        Without a separate master (fp32 training, no offload) the parameters are the masters:
        this rank's part of their flat buffer is returned (a copy)."""
        out = []
        for g, (lay, m) in enumerate(zip(self.layouts, self.masters)):
            if m is not None:
                out.append(m)
            elif self.n_parts == 1:
                out.append(self.param_flats[g])
            else:
                out.append(torch.cat([self.param_flats[g][slice(*b.chunk_range(self.part_rank))]
                                      for b in lay.buckets]))
        return out

    @property
    def fp32_groups_flat(self) -> list:
        """DeepSpeed's FP16_Optimizer name for the same flat fp32 masters."""
        return self.single_partition_of_fp32_groups

    @property
    def fp32_groups(self) -> list:
        """DeepSpeed's FP16_UnfusedOptimizer / FP16_Optimizer name: per parameter group, one fp32 master
        per parameter, shaped like it (views into the flat masters: writing them changes the masters).
        Only where every rank holds every master (stage 0)."""
        if self.n_parts != 1:
            raise AttributeError("fp32_groups (one fp32 master per parameter) exists where every rank holds every "
                                 "master (stage 0); at ZeRO-1/2 use single_partition_of_fp32_groups")
        return [[flat.narrow(0, s.flat_offset, s.numel).view(s.shape) for s in lay.slots]
                for lay, flat in zip(self.layouts, self.single_partition_of_fp32_groups)]

    def _fragment_grad(self, g, f):
        """This rank's reduced (still scaled, summed) gradient of fragment ``f``."""
        b = f.slot.bucket
        chunk = self._grad_chunks(g)[b.index]
        return chunk.narrow(0, f.part_offset - b.part_start, f.numel)

    # ------------------------------------------------------------------ parameters after the update
    def refresh_module_params(self):
        """Copy the updated masters into the 16-bit parameters and all-gather the partitions."""
        for g, (lay, m) in enumerate(zip(self.layouts, self.masters)):
            if m is None:
                continue
            flat = self.param_flats[g]
            if self.n_parts == 1:
                flat.copy_(m, non_blocking=self.pin_memory)
            else:
                for b in lay.buckets:
                    flat[slice(*b.chunk_range(self.part_rank))].copy_(m.narrow(0, b.part_start, b.chunk),
                                                                       non_blocking=self.pin_memory)
        if self.n_parts > 1:
            self._all_gather_params()

    def _all_gather_params(self):
        """In-place all-gather per bucket; at most ``allgather_bucket_size`` elements in flight."""
        inflight, n_inflight = [], 0
        for b in self.buckets:
            region = self.param_flats[b.group].narrow(0, b.flat_start, b.region_numel(self.n_parts))
            inflight.append((self.comm.all_gather_inplace(region, b.chunk), region.numel()))
            n_inflight += region.numel()
            while n_inflight > self.allgather_bucket_size and len(inflight) > 1:
                w, n = inflight.pop(0)
                w.wait()
                n_inflight -= n
        for w, _ in inflight:
            w.wait()

    # ------------------------------------------------------------------ gradients between steps
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient storage (``set_to_none`` keeps the buffers: they are reused)."""
        for buf in self.grad_bufs:
            buf.zero_()
        for pg in self.part_grads:
            pg.zero_()
        for s in self.slots:
            if self.partition_grads or self.grad_dtype != self.dtype:
                s.param.grad = None
            else:
                s.param.grad = self._grad_views[id(s)].view(s.shape)
        self._touched.clear()
        self._unsynced = False

    def module_state_dict(self) -> dict:
        from ...checkpoint.utils import clone_tensors_for_torch_save
        return clone_tensors_for_torch_save(self.module.state_dict(), device=None)

    def destroy(self) -> None:
        if self._nvme is not None:
            self._nvme.close()   # deletes this run's swap files
        pinned, self._pinned_masters = getattr(self, "_pinned_masters", []), []
        if pinned:   # native backend: the page-locked allocations freed; torch's pinning: a no-op
            from ...accelerator import get_accelerator
            for m in pinned:
                get_accelerator().unpin_memory(m)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for s in self.slots:
            if getattr(s.param, "_ds_state_owner", None) is self:
                del s.param._ds_state_owner
