"""The top-level DeepSpeed config: parsed once at ``initialize`` into typed models.

``DeepSpeedConfig(source, world_size=..., mpu=...)`` accepts a dict, a JSON/hjson
path, or an already-built config, validates every section, resolves the batch
sizes against the data-parallel world size, and exposes typed sections
(``cfg.zero``, ``cfg.fp16`` ...) plus the flat attribute names DeepSpeed's own
config object has (``cfg.train_batch_size``, ``cfg.zero_optimization_stage`` ...).
"""
from __future__ import annotations

import copy
import json
import math
import os
from typing import Any, Dict, Literal, Optional, Union

from pydantic import Field, field_validator

from .base import DSConfigModel, parse_section
from .errors import DeepSpeedConfigAssertionError, DeepSpeedConfigError, DeepSpeedConfigNotImplementedError
from .compression_sections import CompressionTrainingSection
from .data_sections import CurriculumLearningSection, DataEfficiencySection
from .extra_sections import (AioSection, AutotuningSection, EigenvalueSection, ElasticitySection,
                             HybridEngineSection, NebulaSection, PipelineSection, ProgressiveLayerDropSection,
                             QuantizeTrainingSection, SparseAttentionSection, WeightQuantizationSection)
from .feature_sections import check_unbuilt
from .monitor_sections import (CometSection, CommsLoggerSection, CSVMonitorSection, FlopsProfilerSection,
                               TensorBoardSection, WandbSection)
from .sections import (ActivationCheckpointingSection, AmpSection, BF16Section, CheckpointSection,
                       DataTypesSection, FP16Section, OptimizerSection, SchedulerSection,
                       TorchAutocastSection, ZeroSection)

AnyDict = Optional[Dict[str, Any]]
GRADIENT_ALLREDUCE_OPS = ("mean", "sum")


class DeepSpeedConfigModel(DSConfigModel):
    """Every top-level key of DeepSpeed's config reference."""

    train_batch_size: Optional[int] = Field(None, ge=1)
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, ge=1)
    gradient_accumulation_steps: Optional[int] = Field(None, ge=1)
    # an int >= 0, or float("inf") for "never" (Accelerate writes that)
    steps_per_print: Optional[Union[int, float]] = Field(10, ge=0)
    wall_clock_breakdown: bool = False
    dump_state: bool = False
    memory_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    # how data-parallel gradients are combined: "mean" (average over the ranks) or "sum" (no
    # division at all: predivide/prescale do not apply); any capitalisation, as DeepSpeed 0.19
    gradient_allreduce_op: str = "mean"
    # DeepSpeed 0.19.3+ GRADIENT_CLIPPING_DEFAULT is 1.0 (was 0); the config reference documents 1.0.
    gradient_clipping: float = Field(1.0, ge=0)
    dataloader_drop_last: bool = False
    communication_data_type: Optional[str] = None
    seq_parallel_communication_data_type: Optional[str] = None
    # Ulysses sequence parallelism (deepspeed.runtime.sequence_parallel): ranks per sequence;
    # the batch-size arithmetic uses world / sequence_parallel_size data-parallel ranks.
    sequence_parallel_size: int = Field(1, ge=1)
    # DeepSpeed's device-mesh form: with sequence_parallel_size, dp x sp must be the world size
    data_parallel_size: Optional[int] = Field(None, ge=1)
    sparse_gradients: bool = False
    disable_allgather: bool = False
    zero_allow_untested_optimizer: bool = True
    zero_force_ds_cpu_optimizer: bool = True
    graph_harvesting: bool = False
    use_data_before_expert_parallelism: bool = False
    seed: Optional[int] = None
    # Not in DeepSpeed (which applies such a step): what an fp32 step, or a bf16 one without
    # bf16.check_grad_overflow, does with a NaN/Inf global gradient norm - skip it (warn, count
    # it in skipped_steps) or raise (deepspeed.runtime.nonfinite).
    nonfinite_gradients: Literal["skip", "raise"] = "skip"
    # DeepSpeed 0.19: the DeepSpeed logger's level, set when the engine is built (None: unchanged)
    log_level: Optional[str] = None
    # DeepSpeed 0.19: false = the caller's step() is the accumulation boundary (backward only
    # accumulates, every step() reduces and updates): runtime/unmanaged_accumulation.py
    managed_gradient_accumulation: bool = True

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_name(cls, v):
        if v is None:
            return v
        from ..utils.logging import log_levels
        if not isinstance(v, str) or v.lower() not in log_levels:
            raise ValueError(f"log_level must be one of {', '.join(n.upper() for n in log_levels)}, got {v!r}")
        return v

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, v):
        value = v.lower() if isinstance(v, str) else v
        if value not in GRADIENT_ALLREDUCE_OPS:
            raise ValueError(f"Invalid gradient_allreduce_op. Supported operations: {list(GRADIENT_ALLREDUCE_OPS)}. "
                             f"Got: {v!r}")
        return value

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _steps_per_print_int_or_inf(cls, v):
        if isinstance(v, float) and not isinstance(v, bool):
            if v == math.inf:
                return v
            if math.isfinite(v) and v == int(v):
                return int(v)
            raise ValueError(f"steps_per_print must be a non-negative integer or float('inf') (never print), "
                             f"got {v!r}")
        return v

    optimizer: Optional[OptimizerSection] = None
    scheduler: Optional[SchedulerSection] = None
    fp16: FP16Section = Field(default_factory=FP16Section)
    bf16: BF16Section = Field(default_factory=BF16Section)
    torch_autocast: TorchAutocastSection = Field(default_factory=TorchAutocastSection)
    amp: AmpSection = Field(default_factory=AmpSection)
    data_types: DataTypesSection = Field(default_factory=DataTypesSection)
    zero_optimization: ZeroSection = Field(default_factory=ZeroSection)
    activation_checkpointing: ActivationCheckpointingSection = Field(default_factory=ActivationCheckpointingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    # Sections parsed and validated; those in feature_sections.UNBUILT_FEATURES are
    # refused at initialize when switched on. aio and pipeline only configure things.
    tensorboard: Optional[TensorBoardSection] = None
    wandb: Optional[WandbSection] = None
    comet: Optional[CometSection] = None
    csv_monitor: Optional[CSVMonitorSection] = None
    flops_profiler: Optional[FlopsProfilerSection] = None
    comms_logger: Optional[CommsLoggerSection] = None
    sparse_attention: Optional[SparseAttentionSection] = None
    compression_training: Optional[CompressionTrainingSection] = None
    elasticity: Optional[ElasticitySection] = None
    autotuning: Optional[AutotuningSection] = None
    data_efficiency: Optional[DataEfficiencySection] = None
    curriculum_learning: Optional[CurriculumLearningSection] = None
    progressive_layer_drop: Optional[ProgressiveLayerDropSection] = None
    eigenvalue: Optional[EigenvalueSection] = None
    quantize_training: Optional[QuantizeTrainingSection] = None
    hybrid_engine: Optional[HybridEngineSection] = None
    nebula: Optional[NebulaSection] = None
    weight_quantization: Optional[WeightQuantizationSection] = None
    aio: Optional[AioSection] = None
    pipeline: Optional[PipelineSection] = None
    moe: AnyDict = None
    zero_config: AnyDict = None


def load_config_source(source: Union[str, os.PathLike, dict, None]) -> dict:
    """Read a config dict from a dict or a JSON/hjson file path."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise DeepSpeedConfigError(f"DeepSpeed config file '{path}' does not exist.")
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()

        def no_duplicates(pairs):   # DeepSpeed refuses a key given twice (json would keep the last)
            seen = [k for i, (k, _) in enumerate(pairs) if k in {k2 for k2, _ in pairs[:i]}]
            if seen:
                raise DeepSpeedConfigError(f"DeepSpeed config file '{path}' gives the key(s) {sorted(set(seen))} more "
                                           f"than once in the same object; keep one of each.")
            return dict(pairs)
        try:
            return json.loads(text, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError:
            import hjson  # only for a file that is not plain JSON (hjson pulls in decimal: ~10 ms at import)
            try:
                data = hjson.loads(text, object_pairs_hook=no_duplicates)
            except DeepSpeedConfigError:
                raise
            except Exception as err:  # hjson raises its own HjsonDecodeError
                raise DeepSpeedConfigError(
                    f"DeepSpeed config file '{path}' is neither valid JSON nor hjson: {err}") from None
            return json.loads(json.dumps(data))  # OrderedDicts -> plain dicts
    raise DeepSpeedConfigError(
        f"DeepSpeed config must be a dict or a path to a JSON/hjson file, got {type(source).__name__}.")


#: Features that set the batch sizes from their own section register here (``deepspeed.elasticity``):
#: ``provider(raw_config: dict, world_size: int)`` returns ``(train_batch_size,
#: train_micro_batch_size_per_gpu, gradient_accumulation_steps)``, or None to leave them as given.
BATCH_SIZE_PROVIDERS: list = []


def resolve_batch_sizes(train_batch_size, micro_batch, grad_acc, world_size):
    """Any two of the three give the third; all three must agree.

    Returns ``(train_batch_size, micro_batch, grad_acc)`` or raises with the arithmetic
    (DeepSpeedConfigAssertionError: DeepSpeed's _batch_assertion uses ``assert``).
    """
    tb, mb, ga, ws = train_batch_size, micro_batch, grad_acc, world_size
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * ws:
            raise DeepSpeedConfigAssertionError(
                f"Batch sizes are inconsistent: train_batch_size ({tb}) must equal "
                f"train_micro_batch_size_per_gpu ({mb}) * gradient_accumulation_steps ({ga}) "
                f"* data-parallel world size ({ws}) = {mb * ga * ws}.")
        return tb, mb, ga
    if tb is not None and mb is not None:
        if tb % (mb * ws):
            raise DeepSpeedConfigAssertionError(
                f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu ({mb}) "
                f"* data-parallel world size ({ws}) = {mb * ws}, so gradient_accumulation_steps "
                f"would be {tb / (mb * ws):g}, not an integer.")
        return tb, mb, tb // (mb * ws)
    if tb is not None and ga is not None:
        if tb % (ga * ws):
            raise DeepSpeedConfigAssertionError(
                f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps ({ga}) "
                f"* data-parallel world size ({ws}) = {ga * ws}, so train_micro_batch_size_per_gpu "
                f"would be {tb / (ga * ws):g}, not an integer.")
        return tb, tb // (ga * ws), ga
    if mb is not None and ga is not None:
        return mb * ga * ws, mb, ga
    if tb is not None:
        if tb % ws:
            raise DeepSpeedConfigAssertionError(
                f"train_batch_size ({tb}) is not divisible by the data-parallel world size ({ws}); "
                f"set train_micro_batch_size_per_gpu and gradient_accumulation_steps explicitly.")
        return tb, tb // ws, 1
    if mb is not None:
        return mb * ws, mb, 1
    raise DeepSpeedConfigAssertionError(
        "The config must set train_batch_size or train_micro_batch_size_per_gpu "
        "(any two of train_batch_size, train_micro_batch_size_per_gpu and "
        "gradient_accumulation_steps determine the third).")


class DeepSpeedConfig:
    """Parsed, validated DeepSpeed config (also importable as
    ``deepspeed.runtime.config.DeepSpeedConfig``)."""

    def __init__(self, config: Union[str, dict, "DeepSpeedConfig", None], mpu=None,
                 world_size: Optional[int] = None, check_features: bool = True):
        if isinstance(config, DeepSpeedConfig):
            config = config.raw
        self.raw: dict = load_config_source(config)
        _legacy_zero_optimization_bool(self.raw)
        self.model: DeepSpeedConfigModel = parse_section(DeepSpeedConfigModel, self.raw)
        if check_features:
            check_unbuilt(self.model)
        if world_size is None:
            world_size = _dp_world_size(mpu, self.model.sequence_parallel_size)
        self.world_size = world_size
        m = self.model
        batch = (m.train_batch_size, m.train_micro_batch_size_per_gpu, m.gradient_accumulation_steps)
        for provider in BATCH_SIZE_PROVIDERS:  # e.g. elasticity: batch sizes from its own section
            batch = provider(self.raw, world_size) or batch
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            resolve_batch_sizes(*batch, world_size)
        self._validate_cross_section()

    def _configure_train_batch_size(self):
        """DeepSpeed's name for the batch-size resolution: re-resolves ``train_batch_size``,
        ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` from these
        attributes as they stand now (any two give the third; None = not given) over
        ``self.world_size``, and raises ``DeepSpeedConfigAssertionError`` (an ``AssertionError``,
        as DeepSpeed's own check) when they do not fit together."""
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                self.gradient_accumulation_steps, self.world_size)

    @property
    def _param_dict(self) -> dict:
        """DeepSpeed's name for the config dict as the user gave it (``self.raw``)."""
        return self.raw

    # -- cross-section rules -------------------------------------------------
    def _validate_cross_section(self):
        m = self.model
        if m.gradient_allreduce_op == "sum" and m.zero_optimization.stage == 3:
            # as DeepSpeed 0.19: ZeRO-3's reduce-scatter always averages
            raise DeepSpeedConfigError("gradient_allreduce_op='sum' is not supported with ZeRO stage 3; use "
                                       "'mean' (the default) or zero_optimization.stage 0, 1 or 2.")
        if m.fp16.enabled and m.bf16.enabled:  # DeepSpeed asserts this
            raise DeepSpeedConfigAssertionError(
                "fp16.enabled and bf16.enabled are both true; choose one 16-bit format.")
        if m.amp.enabled:
            raise DeepSpeedConfigError(
                "amp.enabled requires NVIDIA apex, which this deepspeed does not use. "
                "Use the 'torch_autocast' section (enabled, dtype) or 'bf16'/'fp16' instead.")
        if m.torch_autocast.enabled and (m.fp16.enabled or m.bf16.enabled):
            raise DeepSpeedConfigError(
                "torch_autocast.enabled cannot be combined with fp16.enabled or bf16.enabled: "
                "torch_autocast keeps fp32 parameters and autocasts compute, fp16/bf16 hold 16-bit parameters.")
        z = m.zero_optimization
        if not m.managed_gradient_accumulation and z.overlap_comm and z.stage < 2:
            # DeepSpeed asserts this: stage 0/1 reduce in step(), after every backward of the window
            raise DeepSpeedConfigAssertionError(
                f"managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2 (or 3): at "
                f"zero_optimization.stage {z.stage} the gradients are reduced in step(), after the backward passes, "
                f"so there is nothing to overlap. Set zero_optimization.overlap_comm false (or leave it unset), "
                f"use stage 2 or 3, or set managed_gradient_accumulation true.")
        # ZeRO-Infinity NVMe swapping: each case is lifted where it is built.
        if z.offload_optimizer_device == "nvme" and z.stage in (1, 2):  # stage 1/2: runtime/precision/nvme_master.py
            check_nvme_path(z.offload_optimizer.nvme_path, "zero_optimization.offload_optimizer.nvme_path")
        if z.offload_optimizer_device == "nvme" and z.stage == 3:  # stage 3: runtime/zero/stage3_nvme.py
            check_nvme_path(z.offload_optimizer.nvme_path, "zero_optimization.offload_optimizer.nvme_path")
        if z.offload_param_device == "nvme" and z.stage == 3:  # stage 3: swap_tensor/partitioned_param_swapper.py
            check_nvme_path(z.offload_param.nvme_path, "zero_optimization.offload_param.nvme_path")
        if z.offload_param_device != "none" and z.stage != 3:
            # DeepSpeed parses the section and only stage 3 reads it; Accelerate writes it for any stage.
            _warn(f"zero_optimization.offload_param (device '{z.offload_param_device}') only applies at "
                  f"zero_optimization.stage 3; it is ignored at stage {z.stage}.")
        if z.stage in (1, 2) and z.allgather_bucket_size % 2:
            # DeepSpeed's stage 1/2 optimizer asserts this (4-byte-aligned all-gather buffers).
            raise DeepSpeedConfigAssertionError(
                f"zero_optimization.allgather_bucket_size ({z.allgather_bucket_size}) must be even: "
                f"allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2.")
        if z.offload_optimizer_device != "none" and z.stage == 0:
            raise DeepSpeedConfigError(
                "zero_optimization.offload_optimizer requires zero_optimization.stage 1, 2 or 3, got stage 0.")
        accum = m.data_types.grad_accum_dtype
        model_dtype = "fp16" if m.fp16.enabled else "bf16" if m.bf16.enabled else "fp32"
        if z.stage == 0 and accum is not None and accum != model_dtype and accum != "fp32":
            # DeepSpeed (engine._do_optimizer_sanity_check): without ZeRO the gradients accumulate in the
            # model dtype; ZeRO 1-3 take any grad_accum_dtype. Here fp32 accumulation of 16-bit training
            # is also built at stage 0 (FP16_Optimizer / BF16_Optimizer with fp32 gradient buffers).
            fits = f"'{model_dtype}'" + ("" if model_dtype == "fp32" else " or 'fp32'")
            raise DeepSpeedConfigNotImplementedError(
                f"data_types.grad_accum_dtype '{accum}' with {model_dtype} training at zero_optimization.stage 0: "
                f"unsupported mix of model and gradient-accumulation dtypes; use {fits}, or ZeRO stage 1-3.")

    # -- typed sections --------------------------------------------------------
    @property
    def fp16(self):
        return self.model.fp16

    @property
    def bf16(self):
        return self.model.bf16

    @property
    def zero(self):
        return self.model.zero_optimization

    zero_config = zero

    @property
    def optimizer(self):
        return self.model.optimizer

    @property
    def scheduler(self):
        return self.model.scheduler

    @property
    def monitor_config(self):
        """The monitor sections together (``MonitorMaster(ds_config.monitor_config)``)."""
        from types import SimpleNamespace
        m = self.model
        return SimpleNamespace(tensorboard=m.tensorboard, wandb=m.wandb, comet=m.comet, csv_monitor=m.csv_monitor,
                               enabled=any(getattr(s, "enabled", False) for s in
                                           (m.tensorboard, m.wandb, m.comet, m.csv_monitor) if s is not None))

    @property
    def activation_checkpointing_config(self):
        return self.model.activation_checkpointing

    # -- DeepSpeed's flat attribute names ---------------------------------------
    @property
    def zero_optimization_stage(self) -> int:
        return self.model.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization_stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self.model.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.model.bf16.enabled

    bf16_enabled = bfloat16_enabled

    @property
    def gradient_clipping(self) -> float:
        return self.model.gradient_clipping

    @property
    def log_level(self):
        return self.model.log_level

    @property
    def param_dtype(self):
        return self.model.data_types.param_dtype

    @property
    def buffer_dtype(self):
        return self.model.data_types.buffer_dtype

    @property
    def steps_per_print(self):
        return self.model.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self.model.wall_clock_breakdown

    # DeepSpeed's flat eigenvalue_* attributes, from the "eigenvalue" section (defaults without one)
    def _eigenvalue(self, key):
        section = self.model.eigenvalue
        if section is None:
            section = EigenvalueSection()
        return getattr(section, key)

    eigenvalue_enabled = property(lambda self: self._eigenvalue("enabled"))
    eigenvalue_verbose = property(lambda self: self._eigenvalue("verbose"))
    eigenvalue_max_iter = property(lambda self: self._eigenvalue("max_iter"))
    eigenvalue_tol = property(lambda self: self._eigenvalue("tol"))
    eigenvalue_stability = property(lambda self: self._eigenvalue("stability"))
    eigenvalue_gas_boundary_resolution = property(lambda self: self._eigenvalue("gas_boundary_resolution"))
    eigenvalue_layer_name = property(lambda self: self._eigenvalue("layer_name"))
    eigenvalue_layer_num = property(lambda self: self._eigenvalue("layer_num"))

    @property
    def optimizer_name(self):
        return self.model.optimizer.type.lower() if self.model.optimizer else None

    @property
    def optimizer_params(self):
        return self.model.optimizer.params if self.model.optimizer else None

    @property
    def scheduler_name(self):
        return self.model.scheduler.type if self.model.scheduler else None

    @property
    def scheduler_params(self):
        return self.model.scheduler.params if self.model.scheduler else None

    def __getattr__(self, name):
        # Fall through to top-level model fields (e.g. cfg.prescale_gradients).
        model = self.__dict__.get("model")
        if model is not None and name in type(model).model_fields:
            return getattr(model, name)
        raise AttributeError(f"'DeepSpeedConfig' has no attribute '{name}'")

    def to_dict(self) -> dict:
        """The effective config as a dict, batch sizes resolved (``engine.config``)."""
        d = copy.deepcopy(self.raw)
        d["train_batch_size"] = self.train_batch_size
        d["train_micro_batch_size_per_gpu"] = self.train_micro_batch_size_per_gpu
        d["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        return d

    def print(self, name="DeepSpeedConfig"):
        print(f"{name}:\n{json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)}")


def check_nvme_path(path, key: str) -> None:
    """An NVMe swap path must name an existing directory this process can write."""
    if not path or not isinstance(path, str):
        raise DeepSpeedConfigError(f"{key} is required when the device is 'nvme': set it to a writable directory "
                                   f"on the NVMe drive (swap files go under <{key.rsplit('.', 1)[-1]}>/ds_swap/).")
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        raise DeepSpeedConfigError(f"{key} '{path}' is not an existing directory; create it, or point {key} at a "
                                   f"writable directory on the NVMe drive.")
    if not os.access(full, os.W_OK | os.X_OK):
        raise DeepSpeedConfigError(f"{key} '{path}' is not writable by this process; point {key} at a writable "
                                   f"directory on the NVMe drive.")


def _warn(msg: str) -> None:
    from ..utils.logging import logger
    logger.warning(msg)


def _legacy_zero_optimization_bool(raw: dict) -> None:
    """DeepSpeed's deprecated ``"zero_optimization": true|false`` (read_zero_config_deprecated):
    true is stage 1 with the top-level ``allgather_size`` (default 5e8) as the all-gather bucket,
    false is stage 0; DeepSpeed logs a deprecation warning. Rewrites ``raw`` in place."""
    value = raw.get("zero_optimization") if isinstance(raw, dict) else None
    if not isinstance(value, bool):
        return
    section = {"stage": 1 if value else 0}
    allgather = raw.pop("allgather_size", None)
    if value:
        section["allgather_bucket_size"] = int(allgather) if allgather is not None else 500_000_000
    raw["zero_optimization"] = section
    _warn(f"DeepSpeedConfig: \"zero_optimization\": {str(value).lower()} is deprecated; read as "
          f"{section}. Use the form \"zero_optimization\": {{\"stage\": N, ...}}.")


def _dp_world_size(mpu, sequence_parallel_size: int = 1) -> int:
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    # DeepSpeed: without an mpu, "sequence_parallel_size" divides the world for the batch sizes
    return max(1, world // max(1, int(sequence_parallel_size)))
