"""Typed models for the data-side training techniques: ``data_efficiency``
(curriculum learning by data sampling, random layerwise token dropping) and the
legacy ``curriculum_learning`` section.

Keys follow DeepSpeed's config reference. Keys the reference marks "N/A" (no
default) are optional here, but required once the technique is enabled, so a
half-written config is caught at parse time, not mid-training.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import Field, model_validator

from .base import DSConfigModel
from .feature_sections import FeatureSection

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


def _require(obj, keys, where: str) -> None:
    missing = [k for k in keys if getattr(obj, k) is None]
    if missing:
        raise ValueError(f"{where} needs {', '.join(repr(k) for k in missing)}")


class CurriculumScheduleConfig(DSConfigModel):
    """Pacing-function parameters; which are needed depends on ``schedule_type``."""

    total_curriculum_step: Optional[int] = Field(None, ge=1)
    difficulty_step: Optional[int] = Field(None, ge=1)
    root_degree: Optional[int] = Field(None, ge=1)
    difficulty: Optional[List[int]] = None
    max_step: Optional[List[int]] = None


def check_schedule(schedule_type: Optional[str], cfg: CurriculumScheduleConfig, where: str) -> None:
    """The pacing function's documented requirements."""
    if schedule_type in ("fixed_linear", "fixed_root"):
        keys = ["total_curriculum_step", "difficulty_step"] + (["root_degree"] if schedule_type == "fixed_root" else [])
        _require(cfg, keys, f"{where}.schedule_config (schedule_type '{schedule_type}')")
    elif schedule_type == "fixed_discrete":
        _require(cfg, ["difficulty", "max_step"], f"{where}.schedule_config (schedule_type 'fixed_discrete')")
        if len(cfg.difficulty) != len(cfg.max_step) + 1:
            raise ValueError(f"{where}.schedule_config: 'difficulty' needs exactly one more entry than "
                             f"'max_step' (the last level holds after the last step), got "
                             f"{len(cfg.difficulty)} and {len(cfg.max_step)}")


def _check_difficulty_range(obj, where: str) -> None:
    _require(obj, ["min_difficulty", "max_difficulty", "schedule_type"], where)
    if obj.min_difficulty > obj.max_difficulty:
        raise ValueError(f"{where}: min_difficulty ({obj.min_difficulty}) must not exceed "
                         f"max_difficulty ({obj.max_difficulty})")


# ---------------------------------------------------------------- legacy curriculum learning


class CurriculumLearningSection(FeatureSection):
    """The legacy sequence-length curriculum (superseded by ``data_efficiency``)."""

    curriculum_type: str = "seqlen"
    min_difficulty: Optional[int] = Field(None, ge=0)
    max_difficulty: Optional[int] = Field(None, ge=0)
    schedule_type: Optional[ScheduleType] = None
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)

    @model_validator(mode="after")
    def _complete_when_enabled(self):
        if self.enabled:
            _check_difficulty_range(self, "curriculum_learning")
            check_schedule(self.schedule_type, self.schedule_config, "curriculum_learning")
        return self


# ---------------------------------------------------------------- data efficiency: sampling


class CurriculumMetric(DSConfigModel):
    """One difficulty metric, produced by offline data analysis."""

    index_to_sample_path: Optional[str] = None
    index_to_metric_path: Optional[str] = None
    difficulty_type: Optional[Literal["value", "percentile"]] = None
    clustering_type: Optional[Literal["schedule_based", "single_cluster"]] = None
    min_difficulty: Optional[int] = Field(None, ge=0)
    max_difficulty: Optional[int] = Field(None, ge=0)
    schedule_type: Optional[ScheduleType] = None
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)


class DataCurriculumLearning(DSConfigModel):
    enabled: bool = False
    data_cluster_path: Optional[str] = None
    curriculum_metrics: Dict[str, CurriculumMetric] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete_when_enabled(self):
        if not self.enabled:
            return self
        where = "data_efficiency.data_sampling.curriculum_learning"
        _require(self, ["data_cluster_path"], where)
        if not self.curriculum_metrics:
            raise ValueError(f"{where} needs at least one entry in 'curriculum_metrics'")
        for name, metric in self.curriculum_metrics.items():
            mwhere = f"{where}.curriculum_metrics.{name}"
            _require(metric, ["difficulty_type", "clustering_type"], mwhere)
            if metric.clustering_type != "single_cluster":  # a single cluster holds every sample: no index
                _require(metric, ["index_to_sample_path"]
                         + (["index_to_metric_path"] if metric.difficulty_type == "value" else []), mwhere)
            _check_difficulty_range(metric, mwhere)
            check_schedule(metric.schedule_type, metric.schedule_config, mwhere)
        return self


class DataSampling(DSConfigModel):
    enabled: bool = False
    num_epochs: int = Field(1000, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    curriculum_learning: DataCurriculumLearning = Field(default_factory=DataCurriculumLearning)


# ---------------------------------------------------------------- data efficiency: routing


class RandomLTDScheduleConfig(DSConfigModel):
    require_steps: Optional[int] = Field(None, ge=1)
    seq_per_step: Optional[int] = Field(None, ge=1)


class RandomLTDSchedule(DSConfigModel):
    """Effective sequence length grows linearly from ``min_value`` to ``max_value``."""

    min_value: Optional[int] = Field(None, ge=1)
    max_value: Optional[int] = Field(None, ge=1)
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleConfig = Field(default_factory=RandomLTDScheduleConfig)


class RandomLTD(DSConfigModel):
    """Random layerwise token dropping."""

    enabled: bool = False
    total_layer_num: Optional[int] = Field(None, ge=1)
    random_ltd_layer_num: Optional[int] = Field(None, ge=1)
    random_ltd_layer_id: Optional[List[int]] = None
    model_mask_name: Optional[str] = None
    model_type: Optional[Literal["decoder", "encoder"]] = None
    hidden_state_order: Optional[Literal["batch_seq_dim", "seq_batch_dim"]] = None
    random_ltd_schedule: RandomLTDSchedule = Field(default_factory=RandomLTDSchedule)
    layer_token_lr_schedule: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _complete_when_enabled(self):
        if not self.enabled:
            return self
        where = "data_efficiency.data_routing.random_ltd"
        _require(self, ["total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
                        "model_type", "hidden_state_order"], where)
        ids = self.random_ltd_layer_id
        if len(ids) != self.random_ltd_layer_num:
            raise ValueError(f"{where}.random_ltd_layer_id has {len(ids)} entries but random_ltd_layer_num "
                             f"is {self.random_ltd_layer_num}; they must match")
        out = [i for i in ids if not 0 <= i < self.total_layer_num]
        if out:
            raise ValueError(f"{where}.random_ltd_layer_id entries {out} are outside "
                             f"0..{self.total_layer_num - 1} (total_layer_num {self.total_layer_num})")
        sched = self.random_ltd_schedule
        _require(sched, ["min_value", "max_value"], f"{where}.random_ltd_schedule")
        _require(sched.schedule_config, ["require_steps", "seq_per_step"],
                 f"{where}.random_ltd_schedule.schedule_config")
        if sched.min_value > sched.max_value:
            raise ValueError(f"{where}.random_ltd_schedule: min_value ({sched.min_value}) must not exceed "
                             f"max_value ({sched.max_value})")
        return self


class DataRouting(DSConfigModel):
    enabled: bool = False
    random_ltd: RandomLTD = Field(default_factory=RandomLTD)


class DataEfficiencySection(FeatureSection):
    """The Data Efficiency library; ``enabled`` is its master switch."""

    seed: int = 1234
    data_routing: DataRouting = Field(default_factory=DataRouting)
    data_sampling: DataSampling = Field(default_factory=DataSampling)
