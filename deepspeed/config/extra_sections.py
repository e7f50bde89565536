"""Typed models for the remaining top-level sections: ``sparse_attention``,
``elasticity``, ``autotuning``, ``aio``, ``pipeline``, ``progressive_layer_drop``,
``eigenvalue``, ``quantize_training``, ``hybrid_engine``, ``nebula`` and
``weight_quantization``.

Keys and defaults follow DeepSpeed's config reference. ``aio`` and ``pipeline``
only configure things and are always accepted; the others are feature sections
refused while their feature is not built (see ``feature_sections.py``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import AliasChoices, Field, field_validator, model_validator

from .base import DSConfigModel
from .feature_sections import FeatureSection, PresenceFeatureSection

# ---------------------------------------------------------------- sparse attention

SPARSE_MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")

#: The keys each sparsity mode reads (``block`` and ``different_layout_per_head`` are common).
SPARSE_MODE_KEYS: Dict[str, tuple] = {
    "dense": (),
    "fixed": ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
              "num_different_global_patterns"),
    "variable": ("num_random_blocks", "local_window_blocks", "global_block_indices",
                 "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices"),
}


class SparseAttentionSection(PresenceFeatureSection):
    """Block-sparse self-attention layout. There is no ``enabled`` flag: the section's
    presence turns it on. Keys a mode does not read are accepted (DeepSpeed's own
    example lists them all) and ignored; ``mode_params()`` returns the ones it reads."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    block: int = Field(16, ge=1)
    different_layout_per_head: bool = False
    num_local_blocks: int = Field(4, ge=1)
    num_global_blocks: int = Field(1, ge=1)
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = Field(1, ge=1)
    num_random_blocks: int = Field(0, ge=0)
    local_window_blocks: List[int] = Field(default_factory=lambda: [4])
    global_block_indices: List[int] = Field(default_factory=lambda: [0])
    global_block_end_indices: Optional[List[int]] = None
    num_sliding_window_blocks: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _mode_rules(self):
        m = self.mode
        if m in ("fixed", "variable") and self.horizontal_global_attention and self.attention != "bidirectional":
            raise ValueError("sparse_attention.horizontal_global_attention is only valid with "
                             "attention 'bidirectional'")
        if m == "fixed":
            if self.num_local_blocks % self.num_global_blocks:
                raise ValueError(f"sparse_attention (mode 'fixed'): num_local_blocks ({self.num_local_blocks}) "
                                 f"must be divisible by num_global_blocks ({self.num_global_blocks})")
            if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
                raise ValueError("sparse_attention (mode 'fixed'): num_different_global_patterns > 1 "
                                 "needs different_layout_per_head true")
            limit = self.num_local_blocks // self.num_global_blocks
            if self.num_different_global_patterns > limit:
                raise ValueError(f"sparse_attention (mode 'fixed'): num_different_global_patterns "
                                 f"({self.num_different_global_patterns}) cannot exceed num_local_blocks // "
                                 f"num_global_blocks = {limit}")
        if m == "variable" and not self.local_window_blocks:
            raise ValueError("sparse_attention (mode 'variable'): local_window_blocks must not be empty")
        if m in ("variable", "bslongformer") and self.global_block_end_indices is not None:
            starts, ends = self.global_block_indices, self.global_block_end_indices
            if len(starts) != len(ends):
                raise ValueError(f"sparse_attention: global_block_end_indices ({len(ends)} entries) must have "
                                 f"as many entries as global_block_indices ({len(starts)})")
            bad = [(s, e) for s, e in zip(starts, ends) if not s < e]
            if bad:
                raise ValueError(f"sparse_attention: each global window must end after it starts, got "
                                 f"(start, end) pairs {bad}")
        return self

    def mode_params(self) -> Dict[str, Any]:
        """The parameters the selected mode reads."""
        keys = ("block", "different_layout_per_head") + SPARSE_MODE_KEYS[self.mode]
        return {k: getattr(self, k) for k in keys}


# ---------------------------------------------------------------- elasticity / autotuning


class ElasticitySection(FeatureSection):
    """Elastic training: picks a global batch size that works for a range of GPU counts."""

    max_train_batch_size: int = Field(2000, ge=1)
    micro_batch_sizes: List[int] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: int = Field(1, ge=1)
    max_gpus: int = Field(10000, ge=1)
    min_time: int = Field(0, ge=0)
    prefer_large_batch: bool = True
    prefer_larger_batch: Optional[bool] = None  # the name DeepSpeed's code reads (docs: prefer_large_batch)
    version: float = 0.2
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: int = Field(1, ge=1)
    model_parallel_size: int = Field(1, ge=1)

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive_sizes(cls, v):
        if not v or any(x < 1 for x in v):
            raise ValueError("elasticity.micro_batch_sizes must be a non-empty list of positive integers")
        return v

    @field_validator("version")
    @classmethod
    def _known_version(cls, v):
        if v not in (0.1, 0.2):
            raise ValueError("elasticity.version must be 0.1 or 0.2")
        return v

    @model_validator(mode="after")
    def _gpu_range(self):
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"elasticity.min_gpus ({self.min_gpus}) must not exceed max_gpus ({self.max_gpus})")
        return self


class AutotuningSection(FeatureSection):
    """The autotuner's search over ZeRO stages and micro-batch sizes."""

    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = False
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    start_profile_step: int = Field(3, ge=0)
    end_profile_step: int = Field(5, ge=0)
    fast: bool = True
    max_train_batch_size: Optional[int] = Field(None, ge=1)
    mp_size: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    tuner_type: Literal["gridsearch", "random", "model_based"] = "model_based"
    tuner_early_stopping: int = Field(5, ge=1)
    tuner_num_trials: int = Field(50, ge=1)
    arg_mappings: Optional[Dict[str, str]] = None
    model_info: Optional[Dict[str, Any]] = None
    model_info_path: Optional[str] = None
    metric_path: Optional[str] = None  # where an experiment writes its metric (set by the autotuner)

    @field_validator("metric", mode="before")
    @classmethod
    def _lower_metric(cls, v):
        return v.lower() if isinstance(v, str) else v  # the reference spells it "FLOPS"

    @model_validator(mode="after")
    def _profile_window(self):
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step ({self.end_profile_step}) must not be less than "
                             f"start_profile_step ({self.start_profile_step})")
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError("autotuning.min_train_micro_batch_size_per_gpu must not exceed "
                             "max_train_micro_batch_size_per_gpu")
        return self


# ---------------------------------------------------------------- aio / pipeline (always accepted)


class AioSection(DSConfigModel):
    """Asynchronous (libaio) I/O settings for NVMe offload."""

    block_size: int = Field(1048576, ge=1)
    queue_depth: int = Field(8, ge=1)
    thread_count: int = Field(1, ge=1)
    intra_op_parallelism: Optional[int] = Field(None, ge=1, description="newer name of thread_count")
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @property
    def parallelism(self) -> int:
        return self.intra_op_parallelism or self.thread_count


class PipelineSection(DSConfigModel):
    """Pipeline-engine settings (the model itself is a ``PipelineModule``)."""

    stages: Any = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    # False: the module checkpoints with deepspeed.checkpointing.non_reentrant_checkpoint
    use_reentrant: Optional[bool] = True   # None: True, as in DeepSpeed
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    # seconds a stage waits in a point-to-point receive before failing (None: the process
    # group's timeout); an exception on a stage is passed on at once, this bounds silent deaths
    p2p_timeout: Optional[float] = Field(None, gt=0)

    @field_validator("stages")
    @classmethod
    def _stages(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("pipeline.stages must be 'auto' or a positive integer")

    @field_validator("partition")
    @classmethod
    def _partition(cls, v):
        if v.lower() in ("best", "parameters", "uniform") or v.lower().startswith("type:"):
            return v
        raise ValueError("pipeline.partition must be 'best', 'parameters', 'uniform' or 'type:<regex>'")


# ---------------------------------------------------------------- training techniques


class ProgressiveLayerDropSection(FeatureSection):
    theta: float = Field(1.0, ge=0.0, le=1.0)   # 0: every layer's keep probability decays to 0
    gamma: float = Field(0.001, gt=0.0)


class EigenvalueSection(FeatureSection):
    verbose: bool = False
    max_iter: int = Field(100, ge=1)
    tol: float = Field(1e-2, gt=0.0)
    stability: float = Field(1e-6, ge=0.0)
    gas_boundary_resolution: int = Field(1, ge=1)
    layer_name: str = "bert.encoder.layer"
    layer_num: int = Field(0, ge=0)


class QuantizeBits(DSConfigModel):
    start_bits: int = Field(16, ge=1, le=32)
    target_bits: int = Field(8, ge=1, le=32)

    @model_validator(mode="after")
    def _order(self):
        if self.target_bits > self.start_bits:
            raise ValueError(f"target_bits ({self.target_bits}) must be <= start_bits ({self.start_bits})")
        return self


class QuantizeSchedule(DSConfigModel):
    quantize_period: int = Field(100, ge=1)
    schedule_offset: int = Field(100, ge=0)


class QuantizeAlgo(DSConfigModel):
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"


class FP16MixedQuantize(DSConfigModel):
    enabled: bool = False
    quantize_change_ratio: float = Field(0.001, ge=0.0, le=1.0)


class QuantizeTrainingSection(FeatureSection):
    """MoQ: quantization-aware training with a bit-width schedule."""

    quantize_verbose: bool = False
    quantizer_kernel: bool = False
    quantize_groups: int = Field(1, ge=1)
    quantize_bits: QuantizeBits = Field(default_factory=QuantizeBits)
    quantize_schedule: QuantizeSchedule = Field(default_factory=QuantizeSchedule)
    # DeepSpeed's tutorial spells this key "quantize-algo".
    quantize_algo: QuantizeAlgo = Field(default_factory=QuantizeAlgo,
                                        validation_alias=AliasChoices("quantize_algo", "quantize-algo"))
    fp16_mixed_quantize: FP16MixedQuantize = Field(default_factory=FP16MixedQuantize)


class HybridEngineSection(FeatureSection):
    """RLHF hybrid engine: switches the model between training and inference layouts."""

    max_out_tokens: int = Field(512, ge=1)
    inference_tp_size: int = Field(1, ge=1)
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = Field(8, ge=1)


class NebulaSection(FeatureSection):
    """Asynchronous checkpointing to a Nebula service."""

    persistent_storage_path: Optional[str] = None
    persistent_time_interval: int = Field(100, ge=1)
    num_of_version_in_retention: int = Field(2, ge=1)
    enable_nebula_load: bool = True
    load_path: Optional[str] = None


class WeightQuantizationSection(FeatureSection):
    """Weight quantization at initialization or after it. As in DeepSpeed, the section
    is on by default once present (``enabled`` defaults to true)."""

    enabled: bool = True
    quantized_initialization: Dict[str, Any] = Field(default_factory=dict)
    post_init_quant: Dict[str, Any] = Field(default_factory=dict)
