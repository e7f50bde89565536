"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned across the
data-parallel group (the stage-3 strategy of DESIGN.md).

The parts, each in its own file:

* ``partitioned_param``: a parameter's partition state, conversion, release and fetch lists;
* ``partitioned_gather``: gathering partitions (flat, quantized, hpZ secondary) and their handles;
* ``parameter_offload.ParameterCoordinator``: module hooks - when to gather, prefetch
  and release;
* ``stage3_grads.GradReducer``: bucketed, overlapped reduce-scatter of gradients;
* ``stage3_master.MasterPartitions``: partitions, fp32 master weights, gradient
  partitions, the optimizer step;
* ``stage3_comm``: collectives that raise a clear error when ranks diverge;
* ``stage3_state_dict`` / ``stage3_checkpoint``: full state dicts and checkpoints.

This class wires them together behind the :class:`TrainingStrategy` interface.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist

from ...utils.logging import logger
from ..precision.inner_optimizer import InnerOptimizerFace
from ..precision.loss_scaler import create_loss_scaler
from ..nonfinite import on_nonfinite
from ..strategy import StepOutcome, StrategyContext, TrainingStrategy
from ..utils import clip_coef, is_model_parallel_parameter
from .estimators import estimate_zero3_model_states_mem_needs  # noqa: F401 - DeepSpeed's import path
from .estimators import estimate_zero3_model_states_mem_needs_all_cold  # noqa: F401
from .estimators import estimate_zero3_model_states_mem_needs_all_live  # noqa: F401
from .parameter_offload import ParameterCoordinator
from .partitioned_param import (PartitionSpec, ZeroParamStatus, _flat_input, _runs, convert_param, fetch_lists_version,
                                gather_params, invalidate_fetch_lists, is_quantized, is_zero_param, quantize_partition,
                                release_param)
from .stage3_comm import KIND_GATHER, KIND_STEP, comm_for
from .stage3_fragments import Stage3StateAccess
from .stage3_grads import GradReducer
from .stage3_master import MasterPartitions
from .stage3_nvme_params import SwappedPartitionMasters
from .stage3_state_dict import gather_module_state_dict, load_full_state_dict
from .zeropp import exact_gathers, wrap_comm

# Elements per gradient bucket when the config does not set reduce_bucket_size: about one
# transformer layer's weight matrix. Measured (fp32, 8.4M params, 2 ranks, gloo): backward's peak
# above the gathered parameters was 13.9 MiB with 2M-element buckets, 29 MiB with 4M and 35 MiB
# with one bucket for every gradient, at the same step time.
STAGE3_DEFAULT_BUCKET = 2 ** 21
_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _comm_dtype(name):
    if name is None:
        return None
    from .stage0 import comm_dtype
    return comm_dtype(name)


def _refuse_unsupported(z) -> None:
    from ...config.errors import DeepSpeedConfigError
    if z.zero_quantized_nontrainable_weights and z.offload_param_device == "nvme":
        raise DeepSpeedConfigError("zero_optimization.zero_quantized_nontrainable_weights cannot be combined with "
                                   "offload_param.device 'nvme' (frozen weights are kept quantized in memory); "
                                   "set one of them off.")
    if z.mics_shard_size > 0 and z.zero_hpz_partition_size > 1:
        raise DeepSpeedConfigError("zero_optimization: mics_shard_size and zero_hpz_partition_size > 1 cannot be "
                                   "combined (both give gathers a node-sized group); set one of them.")


def _node_groups(comm, size: int, key: str):
    """The CheckedComm over this rank's group of ``size`` consecutive data-parallel ranks.
    Collective: every rank creates every group, in the same order."""
    if size <= 1:
        return None
    from .mics import shard_and_replica_groups
    shard, _ = shard_and_replica_groups(comm.group, size, key)
    return comm_for(shard) if shard is not None else comm


class DeepSpeedZeroOptimizer_Stage3(InnerOptimizerFace, Stage3StateAccess, TrainingStrategy,  # noqa: N801
                                    torch.optim.Optimizer):
    """ZeRO stage 3 for fp32, fp16 and bf16 training (see the module docstring); also
    ``engine.optimizer`` (DeepSpeed's class name), a ``torch.optim.Optimizer`` whose
    ``param_groups`` are the dicts of the optimizer that runs the update (the client's own
    object when one was passed), so LR schedulers drive the real LR."""

    stage = 3

    def __init__(self, module: torch.nn.Module, ctx: StrategyContext):
        TrainingStrategy.__init__(self, module, ctx)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())  # what torch.optim.Optimizer.__init__ would make
        self.overflow = False
        cfg = ctx.config
        z = cfg.zero
        _refuse_unsupported(z)
        self.fp16, self.bf16 = cfg.fp16_enabled, cfg.bfloat16_enabled
        self.dtype = torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32
        self.clip = cfg.gradient_clipping
        self.comm = comm_for(ctx.dp_group)
        # MiCS (mics_shard_size): parameters, gradients and optimizer state are partitioned over
        # a shard group of that many ranks and replicated across the groups; gradients are
        # reduce-scattered in the shard group, then all-reduced across the replicas.
        self.replica_comm = None
        if z.mics_shard_size > 0:
            from .mics import shard_and_replica_groups
            shard, replica = shard_and_replica_groups(self.comm.group, z.mics_shard_size, "mics_shard_size")
            if shard is not None:
                self.comm, self.replica_comm = comm_for(shard), comm_for(replica)
        self.comm = wrap_comm(self.comm, z, weights=any(   # ZeRO++ qwZ/qgZ collectives when configured
            getattr(getattr(p, "_z3", None), "quantized_weights", False) for p in module.parameters()))
        off_param = z.offload_param_device == "cpu"
        off_opt = z.offload_optimizer_device in ("cpu", "nvme")   # nvme: updated in host memory (stage3_nvme)
        nvme_opt = z.offload_optimizer_device == "nvme"
        nvme_param = z.offload_param_device == "nvme"   # partitions in swap files (stage3_nvme_params)
        self.spec = PartitionSpec(self.comm, ctx.device, torch.device("cpu") if off_param or nvme_param else ctx.device,
                                  pin_memory=bool(off_param and z.offload_param.pin_memory))
        if nvme_param:
            from .stage3_nvme_params import param_swapper_for
            self.spec.swapper = param_swapper_for(module, z.offload_param, cfg.model.aio, self.dtype)
        # hpZ: a secondary partition per node-sized group; backward gathers stay inside it
        self.spec.sec_comm = _node_groups(self.comm, z.zero_hpz_partition_size, "zero_hpz_partition_size")
        if self.spec.sec_comm is self.comm:
            self.spec.sec_comm = None   # one node: the primary gather already stays inside it
        self.persistent = []
        self._partition_module(z)
        grad_dtype = _DT.get(cfg.model.data_types.grad_accum_dtype or "", self.dtype)
        self.groups = self._param_groups()
        self.parts = (SwappedPartitionMasters if nvme_param else MasterPartitions)(
            self.groups, dtype=self.dtype, grad_dtype=grad_dtype,
            opt_device=torch.device("cpu") if off_opt else ctx.device, share_master=(off_param == off_opt),
            sub_group_size=z.sub_group_size, pin_memory=bool(off_opt and z.offload_optimizer.pin_memory),
            nvme=nvme_opt)
        self.inner = self._build_optimizer()
        if self.inner is not None:   # zero_allow_untested_optimizer: false refuses an untested class
            from ..precision.inner_optimizer import check_zero_tested_optimizer
            check_zero_tested_optimizer(ctx, ctx.client_optimizer if ctx.client_optimizer is not None else self.inner)
        if nvme_opt:
            self.parts.swap_to_nvme(self.inner, z.offload_optimizer, cfg.model.aio)
        self.optimizer = self if self.inner is not None else None
        self.spec.listeners.append(self._on_param_modified)
        self.scaler = create_loss_scaler(cfg.fp16, self.fp16)
        # DeepSpeed's reduce_bucket_size default (5e8) would make one bucket holding every
        # gradient - a bound only in name - and one reduce-scatter that cannot overlap backward;
        # unless the config sets the key, buckets hold STAGE3_DEFAULT_BUCKET elements.
        self.reduce_bucket_size = z.reduce_bucket_size_or(STAGE3_DEFAULT_BUCKET)
        self.reducer = GradReducer(self.comm, self.reduce_bucket_size, self.parts.accumulate,
                                   overlap=z.overlap,
                                   comm_dtype=_comm_dtype(cfg.model.communication_data_type),
                                   predivide=cfg.model.gradient_predivide_factor,
                                   max_columns=sum(c.numel for c in self.parts.chunks),
                                   sink_many=self.parts.accumulate_many, order=self.parts.slot_order,
                                   replica=self.replica_comm, direct=not off_opt)
        self.coordinator = ParameterCoordinator(module, z.prefetch_bucket_size, z.max_live_parameters,
                                                z.max_reuse_distance)
        seen = set()
        self._unsynced = {}  # parameter -> full local gradient held under engine.no_sync()
        self._grad_hooks = []
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._find_leaf_params()
        self.gather_16bit_on_save = bool(z.gather_16bit_weights_on_model_save)
        self.last_grad_norm = None
        self._persistent_stale = False
        for c in self.parts.chunks:
            for p in c.params:
                p._ds_state_owner = self   # deepspeed.utils.safe_get_full_fp32_param & co.

    # -- construction ------------------------------------------------------------------------
    def _partition_module(self, z) -> None:
        """Partition the module's parameters (adopting those built under zero.Init), cast them
        to the training dtype, and keep small ones whole (``stage3_param_persistence_threshold``)."""
        budget = z.model_persistence_threshold
        to_persist, seen = [], set()
        # zero.Init(zero_quantized_nontrainable_weights=True) asks for it as the config key does
        quant_frozen = bool(z.zero_quantized_nontrainable_weights) or any(
            getattr(getattr(p, "_z3", None), "quantize_frozen", False) for p in self.module.parameters())
        for name, p in self.module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            cast = p.is_floating_point() and self._dtype_of(p) != self.dtype
            numel = p.ds_numel if is_zero_param(p) else p.numel()
            persist = numel < z.param_persistence_threshold and numel <= budget
            if persist:
                budget -= numel
            if is_zero_param(p):
                self._adopt(p, cast)
                if persist and not p.ds_persist:
                    to_persist.append(p)
            else:
                if cast:
                    p.data = p.data.to(self.dtype)
                convert_param(p, self.spec, persist=persist)
            self.comm.names[p.ds_id] = name
            if p.ds_persist or persist:
                self.persistent.append(p)
        # buffers: cast once by the engine (precision/module_cast.py)
        if quant_frozen:   # ZeRO++ zero_quantized_nontrainable_weights: frozen partitions kept as int8 blocks
            for p in {id(q): q for q in self.module.parameters()}.values():
                if not p.requires_grad and not p.ds_persist and p.is_floating_point() and not is_quantized(p):
                    quantize_partition(p)
        if to_persist:  # zero.Init partitioned them; keep them whole from now on
            if self.spec.swapper is not None:   # whole params keep their partition in memory
                self.spec.swapper.remove_params(to_persist)
            with exact_gathers(self.comm):
                gather_params(to_persist, what="small parameters kept whole (stage3_param_persistence_threshold)")
            for p in to_persist:
                p.ds_persist = True
                p._z3.gathered -= p.ds_numel   # whole for good: not part of the gathered working set
            invalidate_fetch_lists()

    @staticmethod
    def _dtype_of(p):
        return p.ds_tensor.dtype if is_zero_param(p) else p.dtype

    def _adopt(self, p, cast: bool) -> None:
        if p._z3.world_size != self.spec.world_size:
            raise RuntimeError(
                f"ZeRO stage 3: parameter {self.comm.names.get(p.ds_id, p.ds_id)} was partitioned by zero.Init over "
                f"{p._z3.world_size} ranks but the engine's data-parallel group has {self.spec.world_size}; pass the "
                f"same data_parallel_group (or mpu) to zero.Init and deepspeed.initialize.")
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist:
            release_param(p, force=True)
        old_sw = getattr(p._z3, "swapper", None)
        if old_sw is not None and old_sw.is_swapped(p):   # built under zero.Init(remote_device="nvme")
            if old_sw is self.spec.swapper and not cast:
                p._z3 = self.spec
                return
            old_sw.remove_params([p])   # into memory; re-registered below when the engine swaps too
        part = p.ds_tensor
        if cast or part.device != self.spec.partition_device:
            part = part.to(device=self.spec.partition_device, dtype=self.dtype if cast else part.dtype)
            part.ds_numel = part.numel()
            p.ds_tensor = part
            p._z3_full = None
        if p.ds_persist and cast:
            p.data = p.data.to(self.dtype)
        elif not p.ds_persist:
            p.data = torch.empty(0, dtype=p.ds_tensor.dtype, device=self.spec.device)
        p._z3 = self.spec
        if self.spec.swapper is not None and not p.ds_persist:
            self.spec.swapper.add_params([p])

    def _param_groups(self):
        client = self.ctx.client_optimizer
        src = [dict(g) for g in client.param_groups] if client is not None else self.ctx.param_groups
        module_ids = {id(p) for p in self.module.parameters()}
        seen, groups = set(), []
        for gi, g in enumerate(src):
            params = []
            for p in g["params"]:
                if id(p) not in module_ids:
                    raise ValueError(f"ZeRO stage 3: optimizer parameter group {gi} holds a tensor that is not a "
                                     f"parameter of the model passed to deepspeed.initialize.")
                if id(p) in seen:
                    raise ValueError(f"ZeRO stage 3: a parameter appears in more than one optimizer parameter "
                                     f"group (group {gi}).")
                seen.add(id(p))
                if p.requires_grad:
                    params.append(p)
            groups.append(dict(g, params=params))
        return groups

    def _build_optimizer(self):
        groups = self.parts.optimizer_groups()
        client = self.ctx.client_optimizer
        if client is not None:
            # Keep the user's optimizer object (they may hold a reference) but point it at the
            # fp32 partitions; its state is per tensor, so it starts empty.
            for cg, g in zip(client.param_groups, groups):
                cg["params"] = g["params"]
            client.state.clear()
            return client
        if self.ctx.optimizer_factory is not None:
            return self.ctx.optimizer_factory(groups)
        return None

    # -- forward / backward ----------------------------------------------------------------
    def pre_forward(self) -> None:
        self.spec.version += 1   # hpZ: a forward gathers from the primary partitions (they may have changed)
        if self._persistent_stale:   # set_local_fp32_param changed a parameter kept whole
            self._persistent_stale = False
            self.refresh_persistent()
        self.coordinator.new_step()

    def _find_leaf_params(self) -> None:
        """The trainable parameters of each outermost ZeRO-3 leaf module
        (``deepspeed.utils.set_z3_leaf_modules``), in module order. A leaf's forward may use a
        different subset of its parameters on each rank (MoE experts, a child chosen by rank): their
        gradients are handed over together at the end of backward, zeros for the ones this rank's
        backward did not reach, so every rank reduces the same parameters in the same order (as
        DeepSpeed does when the leaf's backward ends). They are held until then."""
        order, seen = [], set()
        for m in self.module.modules():
            if m.__dict__.get("_z3_leaf") and not m.__dict__.get("_z3_inside_leaf"):
                for p in m.parameters():
                    if p.requires_grad and id(p) not in seen and self.parts.owns(p):
                        seen.add(id(p))
                        order.append(p)
        self._leaf_order, self._leaf_ids = order, seen

    def _on_grad(self, p) -> None:
        # Release the gathered parameter first and let the reducer take the gradient out of
        # p.grad (freeing it before a full bucket is launched): at no point do the full
        # parameter, its full gradient and a bucket's reduce-scatter buffers coexist.
        self.coordinator.release_after_backward(p)
        if self._leaf_ids and id(p) in self._leaf_ids:
            return    # a leaf module's gradient: _hand_over_leaf_grads at the end of backward
        grad, p.grad = p.grad, None   # the reducer holds the only reference
        self._hand_over(p, grad)

    def _hand_over(self, p, grad) -> None:
        if grad is not None and self.parts.owns(p):
            if self._unsynced:   # (a Parameter's hash is a Python call: only looked up when something is held)
                held = self._unsynced.pop(p, None)
                if held is not None:
                    grad = grad.add_(held)
            if not self._sync_enabled:
                # engine.no_sync() (DeepSpeed refuses it at stage 3): hold the full local gradient
                # until the next synced backward, which adds it in before the reduce-scatter.
                self._unsynced[p] = grad
            else:
                self.reducer.add(p, grad)

    def _hand_over_leaf_grads(self) -> None:
        for p in self._leaf_order:
            grad, p.grad = p.grad, None
            if grad is None:
                grad = torch.zeros(p.ds_shape, dtype=p.dtype, device=p.device)
            self._hand_over(p, grad)

    # backward = begin_backward (nothing to prepare: gradients are reduced as they arrive);
    # loss.backward(); end_backward (TrainingStrategy.backward)
    def end_backward(self, token) -> None:
        if self._leaf_order:
            self._hand_over_leaf_grads()
        if self._sync_enabled:
            for p, held in list(self._unsynced.items()):  # held gradients this backward did not reach
                del self._unsynced[p]
                self.reducer.add(p, held)
        self.reducer.flush()
        self.coordinator.end_backward()

    # -- the optimizer face (engine.optimizer) ----------------------------------------------
    def state_dict(self) -> dict:
        """This rank's optimizer-side state (its checkpoint file's content): fp32 master
        fragments, optimizer state, hyperparameters, loss scaler."""
        from .stage3_checkpoint import stage3_rank_state
        mp = self.ctx.mpu.get_model_parallel_rank() if self.ctx.mpu is not None else 0
        return stage3_rank_state(self, self.ctx.dp_rank, mp)

    def load_state_dict(self, state_dict) -> None:
        """One rank state, or the list of every rank's states (any world size or stage);
        hyperparameters are written into the existing param-group dicts."""
        from ..checkpoint.universal import FragmentIndex
        from .stage3_checkpoint import load_stage3_from_index
        whole = isinstance(state_dict, (list, tuple))
        states = list(state_dict) if whole else [state_dict]
        load_stage3_from_index(self, FragmentIndex("<state_dict>", states=states, complete=whole), "load_state_dict")

    def __repr__(self):
        return f"{type(self).__name__}(stage=3, dtype={self.dtype}, inner={type(self.inner).__name__})"

    # -- precision -------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.scaler.loss_scale

    @property
    def loss_scaler(self):
        return self.scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(getattr(self.scaler, "dynamic", False))

    def scale_loss(self, loss):
        return self.scaler.scale_loss(loss) if self.fp16 else loss

    # -- step ------------------------------------------------------------------------------
    def _global_sq_norm(self) -> float:
        mpu = self.ctx.mpu
        filt = None
        if mpu is not None and mpu.get_model_parallel_world_size() > 1 and mpu.get_model_parallel_rank() != 0:
            filt = is_model_parallel_parameter  # replicated params count once, on model-parallel rank 0
        t = self.parts.local_sq_norm(filt).reshape(1)   # float64
        if self.comm.active and dist.get_backend(self.comm.group) != "gloo":
            t = t.to(self.spec.device)  # NCCL reduces device tensors only
        self.comm.check(KIND_STEP, [self.ctx.dp_world_size], 1, "the optimizer step's gradient norm")
        self.comm.all_reduce(t)
        if mpu is not None and mpu.get_model_parallel_world_size() > 1:
            dist.all_reduce(t, group=mpu.get_model_parallel_group())
        return float(t.item())

    def _get_norm_groups(self) -> list:
        """DeepSpeed's name: the L2 norm of the current gradient partitions of each optimizer
        parameter group, over all ranks (one fp32 0-d tensor per group; collective). It reads
        the partitions as they are now, so ``safe_set_local_grad`` edits show."""
        n = len(self.parts.group_hparams)
        sq = torch.zeros(n, dtype=torch.float64)
        for c in self.parts.chunks:
            g = c.grad
            sq[c.group] += float(torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2) if g.numel() else 0.0
        if self.comm.active and dist.get_backend(self.comm.group) != "gloo":
            sq = sq.to(self.spec.device)
        self.comm.check(KIND_STEP, [n, -1], n, "the gradient norm of each parameter group")
        self.comm.all_reduce(sq)
        mpu = self.ctx.mpu
        if mpu is not None and mpu.get_model_parallel_world_size() > 1:
            dist.all_reduce(sq, group=mpu.get_model_parallel_group())
        return [t.sqrt().to(dtype=torch.float32, device=self.spec.device) for t in sq.unbind(0)]

    def step(self, closure=None) -> StepOutcome:
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure) is not supported: a ZeRO-3 step runs after "
                             "engine.backward().")
        if self._unsynced:
            raise RuntimeError("engine.step() after backward passes under engine.no_sync() with no synced backward "
                               "since: those gradients were never reduced across ranks. Run the last micro-step's "
                               "backward outside no_sync().")
        self.reducer.flush()
        self.coordinator.release_all()
        self.spec.version += 1   # hpZ: the partitions change here; secondaries are stale from now on
        sq = self._global_sq_norm()
        total = math.sqrt(sq) if sq >= 0 and math.isfinite(sq) else float("nan") if math.isnan(sq) else float("inf")
        scale = self.scaler.loss_scale if self.fp16 else 1.0
        if self.fp16:
            overflow = not math.isfinite(total)
            self.scaler.update_scale(overflow)
            if overflow:
                self.parts.zero_grads()
                logger.info(f"ZeRO-3 fp16: gradient overflow; step skipped, loss scale now {self.scaler.loss_scale}")
                self.last_grad_norm = None
                return StepOutcome(skipped=True, grad_norm=None)
        elif not math.isfinite(total):   # fp32/bf16: never apply a NaN/Inf step (deepspeed.runtime.nonfinite)
            on_nonfinite(self.ctx.config, total, "ZeRO stage 3")
            self.parts.zero_grads()
            self.last_grad_norm = None
            return StepOutcome(skipped=True, grad_norm=None)
        norm = total / scale
        coef = (1.0 / scale) * clip_coef(norm, self.clip)
        if self.inner is not None:
            self.parts.step(self.inner, coef)
            self.refresh_persistent()
        self.parts.zero_grads()
        self.last_grad_norm = norm
        return StepOutcome(skipped=False, grad_norm=norm)

    def refresh_persistent(self, params=None) -> None:
        """All-gather the updated partitions of parameters kept whole (in buckets)."""
        ps = [p for p in (params if params is not None else self.persistent)
              if self.parts.owns(p) and p.ds_numel > 0]
        limit = max(1, self.ctx.config.zero.allgather_bucket_size)
        ws = self.comm.world_size
        if ws == 1:   # the partition is the whole parameter: keep the parameter a view of it, no copy
            ps = [p for p in ps if not self._alias_whole(p)]
        # evenly split parameters first: their batches copy out in one fused operation
        ps.sort(key=lambda p: p.ds_numel != ws * p.ds_tensor.numel())
        for batch in _runs(ps, lambda p: p.ds_tensor.numel() * ws, limit):
            self._gather_whole(batch)

    def _alias_whole(self, p) -> bool:
        """One rank: make ``p.data`` (kept whole) a view of its partition, which the optimizer
        updates in place. False where the partition lives elsewhere (offloaded) or differs."""
        part = p.ds_tensor
        if (part.device != self.spec.device or part.dtype != p.dtype or part.numel() < p.ds_numel
                or not part.untyped_storage().nbytes()):
            return False
        if p.data.data_ptr() != part.data_ptr() or tuple(p.data.shape) != tuple(p.ds_shape):
            p.data = part[:p.ds_numel].view(p.ds_shape)
        return True

    @torch.no_grad()
    def _gather_whole(self, batch) -> None:
        sizes = [p.ds_tensor.numel() for p in batch]
        total, ws = sum(sizes), self.comm.world_size
        inp = _flat_input([p.ds_tensor for p in batch])
        if inp.device != self.spec.device:
            inp = inp.to(self.spec.device)
        out = torch.empty(ws * total, dtype=inp.dtype, device=inp.device)
        self.comm.check(KIND_GATHER, [p.ds_id for p in batch], ws * total, "parameters kept whole, after the step")
        self.comm.all_gather_into(out, inp)
        rows = out.view(ws, total)
        # one fused copy into every parameter whose size the ranks split evenly (no padding),
        # one copy each for the others
        even = [p.ds_numel == ws * s and p.data.is_contiguous() and p.data.dtype == out.dtype
                for p, s in zip(batch, sizes)]
        if all(even):
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=[p.data.view(ws, s) for p, s in zip(batch, sizes)])
            return
        off = 0
        for p, s in zip(batch, sizes):
            full = rows[:, off:off + s].reshape(-1)[:p.ds_numel]
            p.data.copy_(full.view(p.ds_shape))
            off += s

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._unsynced.clear()
        self.parts.zero_grads()
        for p in self._all_params():
            p.grad = None

    def _all_params(self) -> list:
        """The module's parameters, cached while none is set or deleted (the version of
        module_params_to_fetch's lists: every module's ``_parameters`` reports changes)."""
        v = fetch_lists_version()
        cached = self.__dict__.get("_params_cache")
        if cached is None or cached[0] != v:
            cached = self._params_cache = (v, list(self.module.parameters()))
        return cached[1]

    # -- DeepSpeed's introspection names (tests and tools read them) ------------------------
    # A "sub-group" is one chunk of MasterPartitions: whole partitions of one optimizer group,
    # at most sub_group_size elements (DeepSpeed's sub_group_size has the same meaning).
    @property
    def parameter_offload(self):
        """The module-hook owner (DeepSpeed's ``DeepSpeedZeRoOffload``): ``forward_hooks``,
        ``_register_deepspeed_module``, ``_remove_module_hooks``."""
        return self.coordinator

    @property
    def fp16_groups(self) -> list:
        """Per sub-group, its parameters (the training-dtype module parameters)."""
        return [list(c.params) for c in self.parts.chunks]

    @property
    def fp16_partitioned_groups_flat(self) -> list:
        """Per sub-group, the flat tensor holding this rank's partitions in the training dtype."""
        return [c.lp for c in self.parts.chunks]

    @property
    def fp32_partitioned_groups_flat(self) -> list:
        """Per sub-group, this rank's flat fp32 master partition: the tensor the optimizer steps,
        so ``optimizer.state[fp32_partitioned_groups_flat[i]]`` is its state."""
        return [c.master for c in self.parts.chunks]

    @property
    def averaged_gradients(self) -> dict:
        """{sub-group: [this rank's reduced (averaged, accumulated) gradient partition of each
        parameter]}, views of the gradient partitions the step will use (until it zeroes them).
        Complete after ``engine.backward`` (which waits for the reductions it launched)."""
        return {i: [self.parts.grad_view(p) for p in c.params] for i, c in enumerate(self.parts.chunks)}

    def get_fp32_grad_partitions(self) -> dict:
        """{sub-group: {parameter index in it: this rank's gradient partition, as fp32}}."""
        return {i: {j: g.float() for j, g in enumerate(grads)} for i, grads in self.averaged_gradients.items()}

    @property
    def _global_grad_norm(self):
        """The gradient norm of the last step (None before one, or after an fp16 overflow)."""
        return self.last_grad_norm

    # -- parameters modified outside training (GatheredParameters with modifier_rank) ---------
    def _on_param_modified(self, p) -> None:
        if self.parts.owns(p):
            self.parts.refresh_master_from_partitions([p])

    # -- state -----------------------------------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full state dict, gathered module by module. Collective; like DeepSpeed's
        ``_zero3_consolidated_16bit_state_dict`` only data-parallel rank 0 keeps the tensors
        (host memory for the whole model on one rank), other ranks return an empty dict."""
        with exact_gathers(self.comm):
            return gather_module_state_dict(self.module, keep=self.ctx.dp_rank == 0)

    def check_16bit_model_save(self) -> bool:
        """Whether ``engine.save_16bit_model`` may gather the weights (the config key)."""
        if not self.gather_16bit_on_save:
            logger.warning("save_16bit_model: not saving, because zero_optimization."
                           "stage3_gather_16bit_weights_on_model_save is false (the weights are partitioned). "
                           "Set it to true, or save a checkpoint and use zero_to_fp32.")
        return self.gather_16bit_on_save

    def load_module_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        load_full_state_dict(self.module, state_dict, strict)
        self.after_module_load()

    def after_module_load(self) -> None:
        self.parts.refresh_master_from_partitions()
        self.refresh_persistent()

    def save_optimizer_state(self, writer, dp_rank: int, mp_rank: int) -> None:
        from .stage3_checkpoint import save_stage3_optimizer_state
        save_stage3_optimizer_state(self, writer, dp_rank, mp_rank)

    def load_optimizer_state(self, reader, load_optimizer_states: bool = True) -> None:
        from .stage3_checkpoint import load_stage3_optimizer_state
        load_stage3_optimizer_state(self, reader, load_optimizer_states)

    # -- accounting ------------------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes this rank holds for the model state (what the estimators predict)."""
        out = self.parts.bytes()
        owned = {id(p) for c in self.parts.chunks for p in c.params}
        seen, other, persistent_full = set(), 0, 0
        for p in self.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in owned:
                if is_quantized(p):   # int8 codes (padded blocks) + fp32 scales
                    other += sum(t.numel() * t.element_size() for t in p._z3_q)
                else:
                    other += p.ds_tensor.numel() * p.ds_tensor.element_size()
            if p.ds_persist:
                persistent_full += p.numel() * p.element_size()
        out["frozen_partitions"] = other
        out["persistent_full_params"] = persistent_full
        if self.spec.sec_comm is not None:   # hpZ: 1/h of every partitioned parameter, kept between gathers
            out["hpz_secondary_partitions"] = sum(
                -(-p.ds_numel // self.spec.sec_comm.world_size) * p.ds_tensor.element_size()
                for p in {id(q): q for q in self.module.parameters()}.values() if not p.ds_persist)
        opt = 0
        if self.inner is not None:
            for st in self.inner.state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.numel() > 1:
                        opt += v.numel() * v.element_size()
        out["optimizer_state"] = opt
        out["total"] = sum(out.values())
        return out

    def write_checkpoint_extras(self, writer) -> None:
        from ..precision.flat_state import ZERO_TO_FP32_SCRIPT
        writer.write_text("zero_to_fp32.py", ZERO_TO_FP32_SCRIPT, executable=True)

    def destroy(self) -> None:
        self.parts.close()   # NVMe swap files
        self._unpin_host_buffers()
        if self.spec.swapper is not None:
            self.spec.swapper.close()   # NVMe parameter partitions (offload_param.device: nvme)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        self.coordinator.remove()
        for c in self.parts.chunks:
            for p in c.params:
                if getattr(p, "_ds_state_owner", None) is self:
                    del p._ds_state_owner


    def _unpin_host_buffers(self) -> None:
        """Release the host memory this strategy pinned: the chunks' buffers, and the partitions
        of pinned offloaded parameters outside the chunks (``get_accelerator().unpin_memory``:
        the native backend frees the page-locked allocation; torch's pinning: a no-op)."""
        self.parts.unpin_host_buffers()
        if not self.spec.pin_memory:
            return
        from ...accelerator import get_accelerator
        acc = get_accelerator()
        owned = {id(p) for c in self.parts.chunks for p in c.params}
        for p in {id(q): q for q in self.module.parameters()}.values():
            t = getattr(p, "ds_tensor", None)
            if (id(p) not in owned and getattr(p, "_z3", None) is self.spec and t is not None
                    and t.untyped_storage().nbytes() and acc.is_pinned(t)):
                acc.unpin_memory(t)


def is_zero3_param(p) -> bool:
    return is_zero_param(p)
