"""``DeepSpeedEngine``: a thin facade over the parts chosen from the config.

The engine owns the counters, the forward call, the accumulation boundary, the LR
schedule, logging and checkpoint orchestration. Everything that depends on the
ZeRO stage or the precision lives in the strategy picked by
:func:`deepspeed.runtime.strategy_factory.build_strategy`; the engine never
branches on the stage.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Optional, Union

import torch
import torch.distributed as dist

from .. import comm
from ..accelerator import get_accelerator
from ..comm import groups
from ..config import DeepSpeedConfig
from ..config.errors import DeepSpeedConfigError
from ..utils.logging import log_dist, logger
from ..utils.timer import NoopTimer, SynchronizedWallClockTimer, ThroughputTimer
from .checkpoint.engine_checkpoint import load_engine_checkpoint, save_engine_checkpoint
from .dataloader import DeepSpeedDataLoader
from .engine_monitor import attach_observability
from .engine_features import EngineFeatureMethods, build_features
from .engine_queries import EngineConfigQueries, _checkpoint_parallel_metadata  # noqa: F401 - DeepSpeed's helper
from .sequence_parallel.engine_groups import resolve_sequence_parallel_mpu, sequence_parallel_layout
from .strategy import StrategyContext
from .strategy_factory import build_strategy
from .torch_backward import TorchBackward, TorchBackwardMethods
from .precision.module_cast import cast_buffers, configured_buffer_dtype
from .torch_autocast import autocast_if_enabled
from . import unmanaged_accumulation as unmanaged

FORWARD, BACKWARD, STEP = "forward", "backward", "step"

# DeepSpeed's type aliases for the optimizer / lr_scheduler callables deepspeed.initialize accepts
# (clients annotate with them): a callable taking the model parameters (or parameter groups) and
# returning an optimizer, and one taking the optimizer and returning an LR scheduler.
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], Dict[str, Iterable]]],
                                      torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def _normalize_param_groups(model, model_parameters):
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if items and isinstance(items[0], tuple) and len(items[0]) == 2:  # named_parameters()
        return [{"params": [p for _, p in items]}]
    return [{"params": items}]


class DeepSpeedEngine(EngineFeatureMethods, EngineConfigQueries, TorchBackwardMethods, torch.nn.Module):
    """Wraps a model for training as configured. See ``deepspeed.initialize``."""

    inside_no_sync_ctxt = False   # DeepSpeed's flag: True inside engine.no_sync()

    def __init__(self, args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                 lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
                 config_class: Optional[DeepSpeedConfig] = None, dont_change_device=False):
        super().__init__()
        if model is None or not isinstance(model, torch.nn.Module):
            raise TypeError(f"deepspeed.initialize: 'model' must be a torch.nn.Module, got {type(model).__name__}.")
        comm.init_distributed(dist_init_required=dist_init_required, verbose=False)
        # sequence_parallel_size in the config: the sequence-parallel mpu (runtime/sequence_parallel)
        mpu = resolve_sequence_parallel_mpu(mpu, config_class if config_class is not None else config)
        self.mpu = mpu
        groups.set_mpu(mpu)
        self.dp_group = groups.get_data_parallel_group(mpu)
        self.dp_world_size = groups.get_data_parallel_world_size(mpu)
        self.dp_rank = groups.get_data_parallel_rank(mpu)
        self.mp_world_size = groups.get_model_parallel_world_size(mpu)
        self.mp_rank = groups.get_model_parallel_rank(mpu)
        # ZeRO partitions, broadcasts and reduces over the sequence-data-parallel group (every
        # replica: sequence x data parallel); dp_* above exclude the sequence dimension.
        sp = sequence_parallel_layout(model, self.dp_group, self.dp_world_size, self.dp_rank)
        self.seq_parallel_group, self.sequence_parallel_size, self._sp_grad_factor = sp.sp_group, sp.sp_size, \
            sp.grad_factor
        self.seq_data_parallel_group, self.seq_dp_world_size, self.seq_dp_rank = sp.sdp_group, sp.sdp_world_size, \
            sp.sdp_rank
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.local_rank = comm.get_local_rank()

        self.config_obj = config_class if config_class is not None else DeepSpeedConfig(
            config, mpu=mpu, world_size=self.dp_world_size)
        if self.config_obj.world_size != self.dp_world_size:  # built before dist init: re-resolve
            self.config_obj = DeepSpeedConfig(self.config_obj.raw, world_size=self.dp_world_size)
        cfg = self.config_obj
        if not cfg.managed_gradient_accumulation:
            unmanaged.check_supported(self)
        self._assert_valid_mixed_precision_config()   # data_types.param_dtype agrees with fp16/bf16
        if cfg.log_level is not None:   # DeepSpeed 0.19's log_level key
            from ..utils.logging import set_log_level_from_string
            set_log_level_from_string(cfg.log_level)
        from .._version import __version__
        self.ds_version = __version__

        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        comm.timeouts.set_step_source(self)   # collective failures name this engine's step
        self._boundary_override = None
        self._unmanaged_backward_count = 0   # managed_gradient_accumulation false: runtime/unmanaged_accumulation.py
        self._running_engine_step = False
        self._step_applied = None   # did the last step() update the weights (None: no step() yet)
        self._last_loss = None
        self._losses_since_print = []
        self._warned_no_optimizer = False
        self._torch_backward = TorchBackward(self)   # loss.backward() without engine.backward (torch_backward.py)

        acc = get_accelerator()
        self.device = acc.device(self.local_rank) if acc.device_name() != "cpu" else torch.device("cpu")
        if not dont_change_device:
            model.to(self.device)
        self.module = model
        # zero_optimization.leaf_module: ZeRO-3 leaves by class/name/suffix (DeepSpeed marks them here)
        from ..utils.z3_leaf_module import apply_zero_leaf_module_config
        apply_zero_leaf_module_config(model, cfg.zero.leaf_module)
        self._broadcast_model()

        self.timers = SynchronizedWallClockTimer() if cfg.wall_clock_breakdown else NoopTimer()
        self.tput_timer = ThroughputTimer(batch_size=cfg.train_batch_size)

        # ---- optimizer and strategy --------------------------------------------------------
        from .model_checks import check_model_trainable   # no parameters / none trainable: a clear error
        if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
            model_parameters = list(model_parameters)   # a generator (model.parameters()) is read twice below
        check_model_trainable(model, model_parameters, optimizer is not None or cfg.optimizer is not None)
        if optimizer is not None and cfg.optimizer is not None and self.global_rank == 0:
            # DeepSpeed's rule (engine._configure_optimizer): the client's optimizer wins.
            logger.warning(f"deepspeed.initialize: an optimizer was passed and the config has an 'optimizer' "
                           f"section ({cfg.optimizer.type}); using the passed optimizer, the section is ignored.")
        client_optimizer, factory = None, None
        if isinstance(optimizer, torch.optim.Optimizer):
            client_optimizer = optimizer
        elif callable(optimizer):
            factory = optimizer
        elif optimizer is not None:
            raise TypeError(f"deepspeed.initialize: 'optimizer' must be a torch.optim.Optimizer or a callable "
                            f"taking parameters, got {type(optimizer).__name__}.")
        elif cfg.optimizer is not None:
            from .optimizers import build_optimizer
            opt_type, opt_params = cfg.optimizer.type, cfg.optimizer.params
            # With optimizer offload the update runs in host memory: the CPU kernels.
            offload = cfg.zero.offload_optimizer_device == "cpu"
            factory = lambda groups_: build_optimizer(opt_type, opt_params, groups_,  # noqa: E731
                                                      cpu_offload=offload, dp_group=self.seq_data_parallel_group,
                                                      zero_stage=cfg.zero_optimization_stage)
        ctx = StrategyContext(config=cfg, dp_group=self.seq_data_parallel_group,
                              dp_world_size=self.seq_dp_world_size, dp_rank=self.seq_dp_rank, mpu=mpu, device=self.device, timers=self.timers,
                              param_groups=_normalize_param_groups(model, model_parameters),
                              optimizer_factory=factory, client_optimizer=client_optimizer)
        self.strategy = build_strategy(model, ctx)
        # the strategy cast the parameters; buffers keep their dtype unless data_types.buffer_dtype
        # (normalisation statistics follow their weights): precision/module_cast.py
        cast_buffers(model, configured_buffer_dtype(cfg))
        self.optimizer = getattr(self.strategy, "engine_optimizer", self.strategy.optimizer)
        if self.optimizer is not None and not hasattr(self.optimizer, "overflow"):
            with contextlib.suppress(AttributeError):  # read-only on some optimizer wrappers
                self.optimizer.overflow = False
        self.lr_scheduler = self._build_lr_scheduler(lr_scheduler)
        attach_observability(self)  # engine.monitor, engine.flops_profiler, comms logger, self._obs
        # curriculum, data efficiency, PLD, eigenvalue: registered plug-ins (runtime/engine_features.py)
        self._features = build_features(self)

        # ---- data ----------------------------------------------------------------------------
        self.collate_fn = collate_fn
        self.training_dataloader = self.deepspeed_io(training_data) if training_data is not None else None

        if self.global_rank == 0:
            log_dist(f"DeepSpeedEngine: zero stage {self.zero_optimization_stage()}, "
                     f"{'fp16' if cfg.fp16_enabled else 'bf16' if cfg.bfloat16_enabled else 'fp32'}, "
                     f"dp world size {self.dp_world_size}, train_batch_size {cfg.train_batch_size} = "
                     f"{cfg.train_micro_batch_size_per_gpu} x {cfg.gradient_accumulation_steps} x "
                     f"{self.dp_world_size}", ranks=[0])

    # ------------------------------------------------------------------ construction helpers
    def _broadcast_model(self):
        """Start every replica (data- and sequence-parallel ranks) from rank 0's weights and buffers."""
        if self.seq_dp_world_size <= 1:
            return
        from ..moe.training import broadcast_expert_params
        broadcast_expert_params(self.module)  # MoE experts: from rank 0 of their expert-data-parallel group
        tensors = [t for t in list(self.module.parameters()) + list(self.module.buffers())
                   if not hasattr(t, "ds_id")  # zero.Init parameters are already consistent
                   and getattr(t, "allreduce", True)]  # expert parameters differ across expert ranks
        if not tensors:
            return
        group = self.seq_data_parallel_group
        src = comm.get_global_rank(group, 0) if self.mpu is not None else 0
        for dtype in {t.dtype for t in tensors}:
            ts = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.data.reshape(-1) for t in ts])
            flat = comm.to_comm_device(flat, group)  # dont_change_device may leave the model on the host
            dist.broadcast(flat, src=src, group=group)
            off = 0
            for t in ts:
                t.data.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    def _build_lr_scheduler(self, client_scheduler):
        cfg = self.config_obj
        if client_scheduler is not None:
            if cfg.scheduler is not None and self.global_rank == 0:
                # DeepSpeed's rule (engine._configure_lr_scheduler): the client's scheduler wins.
                logger.warning(f"deepspeed.initialize: an lr_scheduler was passed and the config has a 'scheduler' "
                               f"section ({cfg.scheduler.type}); using the passed scheduler, the section is ignored.")
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self.optimizer)
            return client_scheduler
        if cfg.scheduler is not None:
            if self.optimizer is None:
                raise DeepSpeedConfigError("The config has a 'scheduler' section but no optimizer was given.")
            from .lr_schedules import build_lr_scheduler
            return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, self.optimizer)
        return None

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        if not (isinstance(dataset, torch.utils.data.Dataset) or hasattr(dataset, "__getitem__")):
            raise TypeError("deepspeed.initialize: 'training_data' must be a torch.utils.data.Dataset.")
        batch_sampler = None  # curriculum data sampling serves whole micro-batches (engine_features)
        if data_sampler is None and route not in ("eval", "predict") and self._features:
            batch_sampler = self._features.batch_sampler(self, dataset)
        return DeepSpeedDataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                   batch_sampler=batch_sampler,
                                   pin_memory=pin_memory and self.device.type != "cpu",
                                   collate_fn=collate_fn or self.collate_fn, data_sampler=data_sampler,
                                   num_local_io_workers=num_local_io_workers,
                                   data_parallel_world_size=self.dp_world_size,
                                   data_parallel_rank=self.dp_rank, tput_timer=None,
                                   dataloader_drop_last=self.dataloader_drop_last())

    def dataloader_drop_last(self) -> bool:
        """The config's top-level ``dataloader_drop_last`` (DeepSpeed's default: False)."""
        return bool(self.config_obj.model.dataloader_drop_last)

    # ------------------------------------------------------------------ module fall-through
    def __getattr__(self, name):
        with contextlib.suppress(AttributeError):
            return super().__getattr__(name)
        modules = self.__dict__.get("_modules", {})
        if "module" in modules and hasattr(modules["module"], name):
            return getattr(modules["module"], name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ------------------------------------------------------------------ training API
    def forward(self, *inputs, **kwargs):
        self.timers(FORWARD).start()
        obs = self._obs
        if obs is not None:
            obs.forward_begin()
        if self.tput_timer._t0 is None:  # first forward of this optimizer step
            self.tput_timer.start()
        self.strategy.pre_forward()
        if self._features and self.module.training:  # curriculum_seqlen, pld_theta, ...
            self._features.forward_kwargs(self, kwargs)
        cfg = self.config_obj
        if cfg.fp16_enabled and cfg.fp16.auto_cast:
            inputs = tuple(_cast_floating(x, torch.float16) for x in inputs)
            kwargs = {k: _cast_floating(v, torch.float16) for k, v in kwargs.items()}
        with autocast_if_enabled(self):   # the torch_autocast section (runtime/torch_autocast.py)
            out = self.module(*inputs, **kwargs)
        if self.module.training and torch.is_grad_enabled():
            self._torch_backward.watch(out)   # a user-driven loss.backward() reduces too
        if obs is not None:
            obs.forward_end()
        self.timers(FORWARD).stop()
        return out

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False,
                 scale_wrt_gas=True):
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError("engine.backward(loss): 'loss' must be a scalar tensor.")
        self.timers(BACKWARD).start()
        obs = self._obs
        if obs is not None:
            obs.backward_begin(loss)
        self._last_loss = loss.detach()
        if self._features:   # eigenvalue differentiates the loss itself: the output hooks stand aside
            self._torch_backward.engine_running = True
            try:
                self._features.before_backward(self, loss)
            finally:
                self._torch_backward.engine_running = False
        gas = self.gradient_accumulation_steps()
        returned = loss / gas if scale_wrt_gas and gas > 1 else loss   # DeepSpeed 0.19: in the loss's dtype
        if scale_wrt_gas and gas > 1:
            loss = loss.float() / gas  # DeepSpeed: _scale_loss_by_gas(loss.float())
        # DeepSpeed returns the loss after the accumulation division, never multiplied by
        # the fp16 loss scale: the scaled copy only drives the backward pass.
        # Sequence parallelism sums gradients over the sequence ranks (runtime/sequence_parallel/engine_groups.py)
        scaled = self.strategy.scale_loss(loss * self._sp_grad_factor if self._sp_grad_factor != 1.0 else loss)
        boundary = self.is_gradient_accumulation_boundary()
        if not self.config_obj.managed_gradient_accumulation:
            unmanaged.count_backward(self)
        tb = self._torch_backward
        tb.engine_running = True   # the output hooks stand aside
        try:
            self.strategy.backward(scaled, sync=allreduce_gradients and boundary, retain_graph=retain_graph)
        finally:
            tb.engine_running = False
        # backward(allreduce_gradients=False) on the boundary: engine.allreduce_gradients() reduces later
        self._unreduced_grads = boundary and not allreduce_gradients
        if obs is not None:
            obs.backward_end()
        self.timers(BACKWARD).stop()
        return returned

    def allreduce_gradients(self, bucket_size=None):
        """Reduce across the data-parallel ranks the gradients that a boundary
        ``backward(loss, allreduce_gradients=False)`` left local (DeepSpeed's explicit reduction).
        After a backward that reduced (the default) there is nothing pending and this does nothing;
        ``bucket_size`` is accepted for DeepSpeed's signature (the configured buckets are used)."""
        if getattr(self, "_unreduced_grads", False):
            self.strategy.allreduce_gradients()
            self._unreduced_grads = False

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self.config_obj.managed_gradient_accumulation:   # the caller's step() is the boundary
            return self._running_engine_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the boundary (Accelerate drives accumulation itself)."""
        if not self.config_obj.managed_gradient_accumulation:
            unmanaged.refuse("set_gradient_accumulation_boundary()")
        self._boundary_override = bool(is_boundary)

    def step(self, lr_kwargs=None):
        if self._torch_backward.coalescing:
            self._refuse_inside_coalesce("engine.step()")
        self.timers(STEP).start()
        obs = self._obs
        if obs is not None:
            obs.step_begin()
        managed = self.config_obj.managed_gradient_accumulation
        if not managed:   # every step() is the boundary: reduce what the window left local
            unmanaged.open_step(self)
        if self.inside_no_sync_ctxt:   # as DeepSpeed: the update would apply gradients never reduced
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager: leave the "
                                 "engine.no_sync() block first (the gradients inside it are not reduced)")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self._features:  # schedules advance before the optimizer step, as in DeepSpeed
                self._features.on_boundary(self)
            if self.optimizer is None:
                if not self._warned_no_optimizer:
                    logger.warning("engine.step() called but no optimizer was configured; parameters are unchanged.")
                    self._warned_no_optimizer = True
                outcome_skipped, norm = False, None
            else:
                outcome = self.strategy.step()
                outcome_skipped, norm = outcome.skipped, outcome.grad_norm
                with contextlib.suppress(AttributeError):
                    self.optimizer.overflow = outcome_skipped
            self._global_grad_norm = norm
            self._step_applied = not outcome_skipped
            if outcome_skipped:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.strategy.zero_grad(set_to_none=True)
            self.global_steps += 1
            self.global_samples += self.train_batch_size() if managed else unmanaged.window_samples(self)
            if self._features:  # compression's scheduler steps after the optimizer step
                self._features.after_step(self)
            self.tput_timer.stop(global_step=True)
            self._maybe_log()
        if not managed:
            unmanaged.close_step(self)
        self.micro_steps += 1
        self.timers(STEP).stop()
        if obs is not None:
            obs.step_end()

    def _maybe_log(self):
        spp = self.config_obj.steps_per_print
        if not spp or self.global_steps % spp:
            return
        loss = self._last_loss.item() if self._last_loss is not None else float("nan")
        lr = self.get_lr()
        log_dist(f"step={self.global_steps}, skipped={self.skipped_steps}, loss={loss:.4f}, "
                 f"lr={lr}, samples/s={self.tput_timer.avg_samples_per_sec():.2f}", ranks=[0])
        if self.config_obj.wall_clock_breakdown:
            self.timers.log([FORWARD, BACKWARD, STEP], normalizer=spp)

    def zero_grad(self, set_to_none: bool = True):
        self.strategy.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate local gradients without reducing them (manual accumulation)."""
        if self._torch_backward.coalescing:
            self._refuse_inside_coalesce("engine.no_sync()")
        if self.inside_no_sync_ctxt:   # DeepSpeed's AssertionError
            raise AssertionError("no_sync context manager reentry is unsupported: engine.no_sync() is already active")
        self.inside_no_sync_ctxt = True
        try:
            with self.strategy.no_sync():
                yield
        finally:
            self.inside_no_sync_ctxt = False

    def train(self, mode: bool = True):
        super().train(mode)
        return self

    def eval(self):
        return self.train(False)

    def destroy(self):
        self.strategy.destroy()

    def empty_partition_cache(self):
        """Release the ZeRO-3 parameters still gathered and return the memory to the allocator."""
        from .zero.generation import empty_partition_cache
        empty_partition_cache(self)

    # ------------------------------------------------------------------ queries
    @property
    def config(self) -> dict:
        return self.config_obj.to_dict()

    def get_lr(self):
        if self.optimizer is None:
            return []
        return [g.get("lr", 0.0) for g in self.optimizer.param_groups]   # DeepSpeed: 0.0 for a group without lr

    def get_mom(self):
        if self.optimizer is None:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] if "betas" in g else g.get("momentum")
                for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return getattr(self, "_global_grad_norm", None)

    @property
    def loss_scale(self) -> float:
        return self.strategy.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.strategy.loss_scale

    @property
    def was_step_applied(self) -> "_CallableBool":
        """Whether the last ``step()`` updated the weights (False: fp16 overflow skipped it, or a
        managed non-boundary step). DeepSpeed's is a method: ``engine.was_step_applied()``; the
        value also reads as a bool without the call, as this property always did."""
        applied = self._step_applied   # None: no step() ran (or the pipeline engine's own step did)
        return _CallableBool(not getattr(self.optimizer, "overflow", False) if applied is None else applied)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        return save_engine_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                      save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return load_engine_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only, custom_load_fn=custom_load_fn)

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False):
        """Load full module weights into the engine (re-partitioned at stage 3) and refresh
        the fp32 masters from them. ``checkpoint``: a checkpoint dict with the weights under
        ``"module"`` (DeepSpeed's form) or a plain state dict. ``custom_load_fn(src=, dst=)``
        replaces the ``load_state_dict`` call (not at stage 3, whose parameters are
        partitioned)."""
        sd = checkpoint["module"] if isinstance(checkpoint, dict) and isinstance(checkpoint.get("module"), dict) \
            else checkpoint
        self._load_module_weights(sd, strict, custom_load_fn)
        self.strategy.after_module_load()

    def _load_module_weights(self, sd, strict=True, custom_load_fn=None) -> None:
        if not isinstance(sd, dict):
            raise TypeError(f"load_module_state_dict: expected a state dict (or a checkpoint dict with a "
                            f"'module' entry), got {type(sd).__name__}.")
        if custom_load_fn is None:
            self.strategy.load_module_state_dict(sd, strict=strict)
            return
        if self.zero_optimization_partition_weights():
            raise ValueError("custom_load_fn cannot be used with zero_optimization.stage 3: the module's "
                             "parameters are partitioned. Load without it (the weights are re-partitioned), "
                             "or modify them inside deepspeed.zero.GatheredParameters(..., modifier_rank=0).")
        custom_load_fn(src=sd, dst=self.module)

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        return self.strategy.module_state_dict()

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Write the full module state dict (16-bit when training in 16-bit) from rank 0."""
        import os
        from .checkpoint.io import atomic_torch_save
        allowed = getattr(self.strategy, "check_16bit_model_save", None)  # stage 3: the gather config key
        if allowed is not None and not allowed():
            return False
        sd = self.strategy.module_state_dict()  # collective at stage 3
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            atomic_torch_save({k: v.detach().cpu() for k, v in sd.items()}, os.path.join(save_dir, save_filename))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return True

    save_fp16_model = save_16bit_model

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """Full 16-bit state dict (Accelerate calls this); collective at stage 3, where only
        data-parallel rank 0 receives the tensors."""
        sd = self.strategy.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd


class _CallableBool:
    """A bool that can also be called (``engine.was_step_applied`` and ``was_step_applied()``)."""
    __slots__ = ("value",)

    def __init__(self, value: bool):
        self.value = bool(value)

    def __bool__(self) -> bool:
        return self.value

    def __call__(self) -> bool:
        return self.value

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, _CallableBool) else other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return repr(self.value)

    def __reduce__(self):   # pickles as the plain bool
        return (bool, (self.value,))


def _cast_floating(x, dtype):
    if torch.is_tensor(x) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    return x
