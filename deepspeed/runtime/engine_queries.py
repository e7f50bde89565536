"""DeepSpeed's engine accessors for configuration values.

Ecosystem code (Hugging Face Accelerate and Transformers, Megatron-style trainers) calls
them on the engine (``engine.zero_reduce_bucket_size()``, ``engine.steps_per_print()``,
``engine.get_batch_info()``, ...). Each reads the typed config parsed once at
``initialize`` (``engine.config_obj``); none parses or stores anything of its own. The last
section holds DeepSpeed's few small engine helpers that are not queries (``gradient_average``,
``all_gather_scalar``, ``_change_recovery_script_permissions``), kept out of the facade.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..utils.logging import logger

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _world_size_of(mpu, getters) -> Optional[int]:
    for name in getters:
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return None


def _checkpoint_parallel_metadata(mpu) -> dict:
    """DeepSpeed's module-level helper (its ``runtime/engine.py``): the model-states entry
    ``{"checkpoint_parallel_dimensions": {"pp_degree": P, "tp_degree": T}}`` that records the
    pipeline and tensor-parallel degrees of the job that saved the checkpoint (read back by
    ``deepspeed.checkpoint.get_model_3d_descriptor`` / ``DeepSpeedCheckpoint``). Taken from
    ``mpu`` as DeepSpeed does: the pipeline size from ``get_pipeline_model_parallel_world_size``
    or ``get_pipe_parallel_world_size`` (else 1), the tensor size from
    ``get_tensor_model_parallel_world_size``, ``get_slice_parallel_world_size`` or
    ``get_model_parallel_world_size``; both 1 without an ``mpu``."""
    from ..checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
    if mpu is None:
        pp, tp = 1, 1
    else:
        pp = _world_size_of(mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")) or 1
        tp = _world_size_of(mpu, ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                                  "get_model_parallel_world_size"))
        if tp is None:
            raise AttributeError(f"mpu {type(mpu).__name__} has none of get_tensor_model_parallel_world_size / "
                                 f"get_slice_parallel_world_size / get_model_parallel_world_size")
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


class EngineConfigQueries:
    """Mixed into :class:`~deepspeed.runtime.engine.DeepSpeedEngine`."""

    # -- batch -----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config_obj.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config_obj.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config_obj.gradient_accumulation_steps

    def managed_gradient_accumulation(self) -> bool:
        """The top-level ``managed_gradient_accumulation`` (DeepSpeed 0.19; default True). False: the
        caller's ``step()`` is the accumulation boundary (runtime/unmanaged_accumulation.py)."""
        return bool(self.config_obj.managed_gradient_accumulation)

    def get_batch_info(self) -> Tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (the micro batch
        and the world size stay)."""
        mb, ws = self.train_micro_batch_size_per_gpu(), self.dp_world_size
        if not isinstance(train_batch_size, int) or train_batch_size < 1 or train_batch_size % (mb * ws):
            raise ValueError(f"set_train_batch_size: train_batch_size {train_batch_size!r} must be a positive "
                             f"multiple of train_micro_batch_size_per_gpu ({mb}) * data-parallel world size ({ws}).")
        self.config_obj.gradient_accumulation_steps = train_batch_size // (mb * ws)
        self.config_obj.train_batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch size, keeping the accumulation steps (so the global batch
        size changes with it)."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size: micro_batch_size must be a positive integer, "
                             f"got {micro_batch_size!r}.")
        self.config_obj.train_micro_batch_size_per_gpu = micro_batch_size
        self.config_obj.train_batch_size = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size

    # -- precision ---------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config_obj.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self.config_obj.bfloat16_enabled

    def amp_enabled(self) -> bool:
        return self.config_obj.model.amp.enabled   # always False: amp is refused at initialize

    def fp16_auto_cast(self) -> bool:
        return self.config_obj.fp16.auto_cast

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.config_obj.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config_obj.fp16.initial_scale_power)

    def communication_data_type(self) -> Optional[torch.dtype]:
        name = self.config_obj.model.communication_data_type
        return _DTYPES[name] if name in _DTYPES else None

    def get_data_types(self) -> Tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accum = self.config_obj.model.data_types.grad_accum_dtype
        return model, _DTYPES[accum] if accum else model

    # -- gradients ---------------------------------------------------------------------------
    @property
    def _config(self):
        """DeepSpeed's name for the engine's config object (tools and tests read it)."""
        return self.config_obj

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def log_level(self):
        """The ``log_level`` the config set (None: not set)."""
        return self._config.log_level

    # DeepSpeed 0.19.5's module cast (runtime/precision/module_cast.py), under its method names
    def _assert_valid_mixed_precision_config(self):
        from .precision.module_cast import assert_valid_mixed_precision_config
        assert_valid_mixed_precision_config(self)

    def _mixed_precision_dtypes(self):
        from .precision.module_cast import mixed_precision_dtypes
        return mixed_precision_dtypes(self)

    def _cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model):
        from .precision.module_cast import cast_module_mixed_precision
        cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model)

    def prescale_gradients(self) -> bool:
        return self.config_obj.model.prescale_gradients

    def postscale_gradients(self) -> bool:
        return not self.prescale_gradients()

    def gradient_predivide_factor(self) -> float:
        return self.config_obj.model.gradient_predivide_factor

    def sparse_gradients_enabled(self) -> bool:
        return self.config_obj.model.sparse_gradients

    @property
    def sparse_tensor_module_names(self) -> set:
        """DeepSpeed's bookkeeping: ``"<name>.weight"`` of each Embedding/EmbeddingBag whose
        gradient is reduced as a sparse tensor (empty unless ``sparse_gradients`` is on). A
        checkpoint's set replaces it on load, as in DeepSpeed."""
        saved = self.__dict__.get("_sparse_names")
        if saved is not None:
            return saved
        if not self.sparse_gradients_enabled():
            return set()
        return {f"{n}.weight" if n else "weight" for n, m in self.module.named_modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    @sparse_tensor_module_names.setter
    def sparse_tensor_module_names(self, names) -> None:
        self.__dict__["_sparse_names"] = set(names)

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank) -> str:
        """DeepSpeed's name for an expert-parallel rank's optimizer file (tools build paths
        with it): ``<path>/<tag>/expp_rank_<r>_mp_rank_XX_optim_states.pt``."""
        import os
        return os.path.join(str(checkpoints_path), str(tag),
                            f"expp_rank_{expp_rank}_mp_rank_{self.mp_rank:02d}_optim_states.pt")

    @property
    def sparse_attention(self):
        """The parsed ``sparse_attention`` section (None when the config has none)."""
        return self.config_obj.model.sparse_attention

    def sparse_attention_config(self, num_heads: int):
        """The ``SparsityConfig`` the ``sparse_attention`` section describes, for layers with
        ``num_heads`` heads (None when the config has no such section)."""
        section = self.config_obj.model.sparse_attention
        if section is None:
            return None
        from ..ops.sparse_attention import sparsity_config_from_section
        return sparsity_config_from_section(section, num_heads)

    # -- ZeRO --------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.config_obj.zero_enabled

    def zero_optimization_stage(self) -> int:
        return self.config_obj.zero_optimization_stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_offload_optimizer(self):
        return self.config_obj.zero.offload_optimizer

    def zero_offload_param(self):
        return self.config_obj.zero.offload_param

    def zero_cpu_offload(self) -> bool:
        return self.config_obj.zero.offload_optimizer_device == "cpu"

    def zero_reduce_bucket_size(self) -> int:
        """The bucket size the engine uses: the configured one, or the stage's own default
        when the config leaves it unset (not DeepSpeed's 5e8, see ``ZeroSection.reduce_bucket_size_or``)."""
        return getattr(self.strategy, "reduce_bucket_size", self.config_obj.zero.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        return self.config_obj.zero.allgather_bucket_size

    def zero_reduce_scatter(self) -> bool:
        return self.config_obj.zero.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        """The effective value (unset means on)."""
        return self.config_obj.zero.overlap

    def zero_contiguous_gradients(self) -> bool:
        return self.config_obj.zero.contiguous_gradients

    def zero_sub_group_size(self) -> int:
        return self.config_obj.zero.sub_group_size

    def zero_max_live_parameters(self) -> int:
        return self.config_obj.zero.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config_obj.zero.max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        return self.config_obj.zero.prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config_obj.zero.param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self.config_obj.zero.model_persistence_threshold

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        z = self.config_obj.zero
        return bool(z.gather_16bit_weights_on_model_save or z.stage3_gather_fp16_weights_on_model_save)

    zero_gather_fp16_weights_on_model_save = zero_gather_16bit_weights_on_model_save

    def zero_elastic_checkpoint(self) -> bool:
        return self.config_obj.zero.elastic_checkpoint

    def zero_load_from_fp32_weights(self) -> bool:
        return self.config_obj.zero.load_from_fp32_weights

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config_obj.zero.ignore_unused_parameters

    # -- optimizer and schedule ----------------------------------------------------------------
    def optimizer_name(self) -> Optional[str]:
        return self.config_obj.optimizer_name

    def optimizer_params(self) -> Optional[dict]:
        return self.config_obj.optimizer_params

    def scheduler_name(self) -> Optional[str]:
        return self.config_obj.scheduler_name

    def scheduler_params(self) -> Optional[dict]:
        return self.config_obj.scheduler_params

    # -- parallel groups ---------------------------------------------------------------------
    def get_sequence_parallel_group(self):
        """This rank's sequence-parallel group (None without sequence parallelism)."""
        return getattr(self, "seq_parallel_group", None)

    def get_data_parallel_rank(self) -> int:
        """Rank in the data-parallel group (which excludes the sequence-parallel dimension)."""
        return self.dp_rank

    def get_model_parallel_rank(self) -> int:
        return self.mp_rank

    def get_tensor_parallel_rank(self) -> int:
        from ..utils import groups
        return groups.get_tensor_model_parallel_rank()

    # -- logging -----------------------------------------------------------------------------
    def steps_per_print(self) -> int:
        return self.config_obj.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config_obj.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self.config_obj.model.memory_breakdown

    def dump_state(self) -> bool:
        return self.config_obj.model.dump_state

    # -- DeepSpeed's small engine helpers (not config queries; kept here, out of the facade) ------
    @property
    def gradient_average(self) -> bool:
        """DeepSpeed's switch: True averages the data-parallel gradient reduction, False keeps the sum
        (initially ``gradient_allreduce_op`` 'mean' / 'sum'). Assignable at ZeRO stage 0."""
        bucketers = getattr(self.strategy, "bucketers", None)
        if bucketers:
            return bucketers[0].average
        return self.config_obj.model.gradient_allreduce_op == "mean"

    @gradient_average.setter
    def gradient_average(self, value: bool) -> None:
        bucketers = getattr(self.strategy, "bucketers", None)
        if bucketers is None:
            raise NotImplementedError(
                f"engine.gradient_average can be assigned at ZeRO stage 0 only (this engine runs "
                f"{type(self.strategy).__name__}); set gradient_allreduce_op ('mean' or 'sum') in the config")
        for b in bucketers:
            b.average = bool(value)

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """Make the ``zero_to_fp32.py`` copied beside a checkpoint executable (DeepSpeed's helper); where
        permissions cannot be changed (a missing file, a file share that refuses chmod) log it and go on."""
        from .checkpoint.io import make_executable
        try:
            make_executable(dst)
        except (FileNotFoundError, PermissionError) as err:
            logger.info(f"Could not change the permissions of {dst} ({err}); continuing without changing them.")

    def all_gather_scalar(self, value: torch.Tensor, dp_group=None) -> list:
        """DeepSpeed's helper: ``value`` from every rank of ``dp_group`` (a list, in group-rank order)."""
        out = [torch.zeros_like(value) for _ in range(dist.get_world_size(group=dp_group))]
        dist.all_gather(out, value.contiguous(), group=dp_group)
        return out
