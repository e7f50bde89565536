"""Typed models for the config sections the engine consumes.

Every model forbids unknown keys, so a typo gets a 'did you mean' error instead of
being silently ignored. Defaults follow DeepSpeed's config reference.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .base import DSConfigModel

# ---------------------------------------------------------------- precision


class FP16Section(DSConfigModel):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, description="0 means dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = 1000
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_number(cls, v):
        # pydantic would take True as 1.0 and 'inf' as a scale; DeepSpeed 0.19 refuses both
        if isinstance(v, bool):
            raise ValueError("fp16.loss_scale must be a number, not a bool")
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError("fp16.loss_scale must be a number (0 = dynamic loss scaling)") from None
        if not math.isfinite(f):
            raise ValueError("fp16.loss_scale must be a finite number (0 = dynamic loss scaling)")
        if f < 0:
            raise ValueError("fp16.loss_scale must be >= 0 (0 = dynamic loss scaling)")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _dynamic_scale_number(cls, v, info):
        if isinstance(v, bool):
            raise ValueError(f"fp16.{info.field_name} must be a number, not a bool")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"fp16.{info.field_name} must be a finite number")
        return v

    @model_validator(mode="after")
    def _dynamic_scale_bounds(self):
        # the window and the floor are read only by the dynamic scaler (enabled, loss_scale 0), as in
        # DeepSpeed 0.19: a static-scale or disabled section may carry any value for them
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window < 1:
                raise ValueError(f"fp16.loss_scale_window = {self.loss_scale_window}: must be >= 1 with dynamic "
                                 "loss scaling (loss_scale 0)")
            if self.min_loss_scale <= 0:
                raise ValueError(f"fp16.min_loss_scale = {self.min_loss_scale}: must be > 0 with dynamic loss "
                                 "scaling (loss_scale 0)")
        return self


class BF16Section(DSConfigModel):
    enabled: bool = False
    immediate_grad_update: bool = False
    # DeepSpeed 0.19 (DeepSpeedBF16Config): True, as fp16 - a step whose gradients hold NaN/Inf is
    # skipped (counted in skipped_steps); false hands it to the nonfinite_gradients policy
    check_grad_overflow: bool = True


class TorchAutocastSection(DSConfigModel):
    enabled: bool = False
    dtype: Optional[Literal["bfloat16", "float16", "bf16", "fp16", "torch.bfloat16", "torch.float16"]] = None
    lower_precision_safe_modules: Optional[List[str]] = None


class AmpSection(DSConfigModel):
    model_config = DSConfigModel.model_config | {"extra": "allow"}  # apex's own options pass through
    enabled: bool = False


class DataTypesSection(DSConfigModel):
    grad_accum_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None
    # DeepSpeed 0.19.5: parameters train in the fp16/bf16 dtype (param_dtype, if given, must match);
    # floating buffers keep their dtype unless buffer_dtype names one (runtime/precision/module_cast.py)
    param_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None
    buffer_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = None


# ---------------------------------------------------------------- ZeRO


class OffloadOptimizerSection(DSConfigModel):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: Optional[str] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    # ZeRO-3 + cpu: step sub-groups during backward (runtime/zero/stage3_offload_overlap.py)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)   # accepted; the worker uses torch's threads


class OffloadParamSection(DSConfigModel):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: Optional[str] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = False


#: DeepSpeed 0.19's default ZeRO-3 leaf classes (sparse MoE blocks, whose experts run in a
#: data-dependent order): marked at initialize when the model has them.
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []


class LeafModuleSection(DSConfigModel):
    """``zero_optimization.leaf_module``: modules ZeRO-3 treats as leaves (one gather for the
    subtree), chosen by class (name or fully qualified name), module name, or name suffix.
    A single string is read as a one-element list; duplicates are dropped."""

    classes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: List[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        v = [v] if isinstance(v, str) else v
        return list(dict.fromkeys(v)) if isinstance(v, (list, tuple)) else v


class ZeroSection(DSConfigModel):
    stage: int = Field(0, ge=0, le=3)
    leaf_module: LeafModuleSection = Field(default_factory=LeafModuleSection)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    overlap_comm: Optional[bool] = None  # unset: DeepSpeed's per-stage default (see the validator and ``overlap``)
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParamSection] = None
    offload_optimizer: Optional[OffloadOptimizerSection] = None
    sub_group_size: int = Field(1_000_000_000, ge=1)
    cpu_offload: Optional[bool] = None  # deprecated spelling of offload_optimizer.device=cpu
    cpu_offload_param: Optional[bool] = None
    cpu_offload_use_pin_memory: Optional[bool] = None
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(2**63 - 1, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    stage3_gather_fp16_weights_on_model_save: Optional[bool] = None  # older spelling
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=1)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    grad_hooks: bool = True

    @classmethod
    def _section_class(cls, name: str):
        """The model class a field holds (a subclass may declare DeepSpeed's own, e.g.
        ``DeepSpeedZeroOffloadOptimizerConfig``): ``Optional[X]`` -> ``X``."""
        import typing
        ann = cls.model_fields[name].annotation
        return next((a for a in typing.get_args(ann) if isinstance(a, type) and a is not type(None)), ann)

    @model_validator(mode="after")
    def _legacy_spellings(self):
        if self.overlap_comm is None:   # DeepSpeed's default: on at stage 3 only (see ``overlap``)
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        pin = bool(self.cpu_offload_use_pin_memory)
        if self.cpu_offload and (self.offload_optimizer is None or self.offload_optimizer.device == "none"):
            object.__setattr__(self, "offload_optimizer",
                               self._section_class("offload_optimizer")(device="cpu", pin_memory=pin))
        if self.cpu_offload_param and (self.offload_param is None or self.offload_param.device == "none"):
            object.__setattr__(self, "offload_param", self._section_class("offload_param")(device="cpu", pin_memory=pin))
        if self.stage3_gather_fp16_weights_on_model_save is not None:
            object.__setattr__(self, "gather_16bit_weights_on_model_save",
                               bool(self.stage3_gather_fp16_weights_on_model_save))
        if self.stage == 3 and self.elastic_checkpoint:   # as DeepSpeed 0.19 (its field says so too)
            from ..utils.logging import logger
            logger.warning("zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated and "
                           "ignored; checkpoints here load at any data-parallel size (universal checkpointing).")
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):   # ZeRO++ (runtime/zero/zeropp.py)
            if getattr(self, key) and self.stage != 3:
                raise ValueError(f"zero_optimization.{key} (ZeRO++) quantizes ZeRO stage 3's collectives; it needs "
                                 f"zero_optimization.stage: 3 (got stage {self.stage}). Set stage 3 or {key}: false.")
        return self

    @property
    def overlap(self) -> bool:
        """``overlap_comm`` as the engine applies it: on unless the config sets it false. (The
        field itself reports DeepSpeed's default when unset, false below stage 3; our stages
        overlap anyway: the numerics are the same, only the timing differs.)"""
        return self.overlap_comm if "overlap_comm" in self.model_fields_set else True

    def reduce_bucket_size_or(self, default: int) -> int:
        """``reduce_bucket_size`` when the config sets it, else ``default``: DeepSpeed's 5e8
        default makes one bucket that cannot overlap backward, so each stage uses its own
        measured default instead (see docs/data_parallel.md and docs/zero3.md)."""
        return self.reduce_bucket_size if "reduce_bucket_size" in self.model_fields_set else default

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device if self.offload_param else "none"


# ---------------------------------------------------------------- optimizer / scheduler


class OptimizerSection(DSConfigModel):
    type: str
    params: Dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False
    # DeepSpeed reads torch_adam from params only and ignores this level (its own test_fp16.py puts it
    # here); read here as params.torch_adam when params does not set it
    torch_adam: Optional[bool] = None

    @model_validator(mode="after")
    def _torch_adam_into_params(self):
        if self.torch_adam is not None and "torch_adam" not in self.params:
            self.params = {**self.params, "torch_adam": self.torch_adam}
        return self


class SchedulerSection(DSConfigModel):
    type: str
    params: Dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------- activation checkpointing


class ActivationCheckpointingSection(DSConfigModel):
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


# ---------------------------------------------------------------- checkpoint options


class CheckpointParallelWrite(DSConfigModel):
    pipeline_stage: bool = False


class CheckpointSection(DSConfigModel):
    tag_validation: str = "Warn"  # Ignore | Warn | Fail, any capitalisation
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: CheckpointParallelWrite = Field(default_factory=CheckpointParallelWrite)

    @field_validator("tag_validation")
    @classmethod
    def _norm(cls, v):
        if str(v).capitalize() not in ("Ignore", "Warn", "Fail"):
            raise ValueError("allowed: 'Ignore', 'Warn', 'Fail'")
        return str(v).capitalize()
