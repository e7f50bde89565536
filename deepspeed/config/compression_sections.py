"""Typed model for ``compression_training``: layer reduction, weight and activation
quantization, and sparse / row / head / channel pruning.

Every technique has the same shape: ``shared_parameters`` (typed per technique)
and ``different_groups``, a dict of named groups, each ``{params, modules,
related_modules}``. The section turns the feature on when any technique's
``shared_parameters.enabled`` (or ``layer_reduction.enabled``) is true.
"""
from __future__ import annotations

import re
from typing import Dict, List, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .base import DSConfigModel

QuantType = Literal["symmetric", "asymmetric"]

# ---------------------------------------------------------------- group params


class WeightQuantParams(DSConfigModel):
    start_bits: int = Field(8, ge=1, le=32)
    target_bits: int = Field(8, ge=1, le=32)
    quantization_period: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _order(self):
        if self.target_bits > self.start_bits:
            raise ValueError(f"target_bits ({self.target_bits}) must be <= start_bits ({self.start_bits})")
        return self


class ActivationQuantParams(DSConfigModel):
    bits: int = Field(8, ge=4, le=32)


class PruningParams(DSConfigModel):
    dense_ratio: float = Field(0.5, gt=0.0, le=1.0)


class _Group(DSConfigModel):
    """``modules``: name patterns (regular expressions searched in module names, ``"*"`` for
    all); ``related_modules``: one list of patterns per entry of ``modules``."""

    modules: List[str] = Field(default_factory=lambda: ["*"])
    related_modules: Optional[List[List[str]]] = None

    @model_validator(mode="after")
    def _related_shape(self):
        if not self.modules:
            raise ValueError("'modules' must name at least one module pattern ('*' for all)")
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ValueError(f"related_modules has {len(self.related_modules)} entries but modules has "
                             f"{len(self.modules)}; give one list of related patterns per module pattern")
        return self


class WeightQuantGroup(_Group):
    params: WeightQuantParams = Field(default_factory=WeightQuantParams)


class ActivationQuantGroup(_Group):
    params: ActivationQuantParams = Field(default_factory=ActivationQuantParams)


class PruningGroup(_Group):
    params: PruningParams = Field(default_factory=PruningParams)


# ---------------------------------------------------------------- shared parameters


class FP16MixedQuantizeShared(DSConfigModel):
    enabled: bool = False
    quantize_change_ratio: float = Field(0.001, ge=0.0, le=1.0)


class WeightQuantShared(DSConfigModel):
    enabled: bool = False
    quantizer_kernel: bool = False
    schedule_offset: int = Field(0, ge=0)
    quantize_groups: int = Field(1, ge=1)
    quantize_verbose: bool = False
    quantization_type: QuantType = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"
    quantize_weight_in_forward: bool = False
    fp16_mixed_quantize: FP16MixedQuantizeShared = Field(default_factory=FP16MixedQuantizeShared)


class ActivationQuantShared(DSConfigModel):
    enabled: bool = False
    quantization_type: QuantType = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "static"
    schedule_offset: int = Field(0, ge=0)


class SparsePruningShared(DSConfigModel):
    enabled: bool = False
    schedule_offset: int = Field(0, ge=0)
    schedule_offset_end: int = Field(0, ge=0)
    schedule_offset_stride: int = Field(1, ge=1)
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    block_pattern: str = "4x1"
    dense_ratio: float = Field(0.1, gt=0.0, le=1.0)
    excluded_modules: List[str] = Field(default_factory=list)

    @field_validator("block_pattern")
    @classmethod
    def _pattern(cls, v):
        if not re.fullmatch(r"\d+[x:]\d+", v):
            raise ValueError("block_pattern must look like 'NxM' or 'N:M' (e.g. '4x1', '2:4')")
        return v

    @model_validator(mode="after")
    def _snip_window(self):
        if self.enabled and self.method == "snip_momentum" and self.schedule_offset_end <= self.schedule_offset:
            raise ValueError(f"sparse_pruning with method 'snip_momentum' needs schedule_offset_end "
                             f"({self.schedule_offset_end}) greater than schedule_offset ({self.schedule_offset})")
        return self


class RowChannelPruningShared(DSConfigModel):
    enabled: bool = False
    schedule_offset: int = Field(0, ge=0)
    method: Literal["l1", "topk"] = "l1"


class HeadPruningShared(DSConfigModel):
    enabled: bool = False
    schedule_offset: int = Field(0, ge=0)
    method: Literal["topk"] = "topk"
    num_heads: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _heads(self):
        if self.enabled and self.num_heads is None:
            raise ValueError("head_pruning.shared_parameters.num_heads is required when head pruning is enabled")
        return self


# ---------------------------------------------------------------- techniques


class WeightQuantization(DSConfigModel):
    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    different_groups: Dict[str, WeightQuantGroup] = Field(default_factory=dict)


class ActivationQuantization(DSConfigModel):
    shared_parameters: ActivationQuantShared = Field(default_factory=ActivationQuantShared)
    different_groups: Dict[str, ActivationQuantGroup] = Field(default_factory=dict)


class SparsePruning(DSConfigModel):
    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    different_groups: Dict[str, PruningGroup] = Field(default_factory=dict)


class RowChannelPruning(DSConfigModel):
    shared_parameters: RowChannelPruningShared = Field(default_factory=RowChannelPruningShared)
    different_groups: Dict[str, PruningGroup] = Field(default_factory=dict)


class HeadPruning(DSConfigModel):
    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    different_groups: Dict[str, PruningGroup] = Field(default_factory=dict)


class LayerReduction(DSConfigModel):
    enabled: bool = False
    keep_number_layer: Optional[int] = Field(None, ge=1)
    module_name_prefix: Optional[str] = None
    teacher_layer: List[int] = Field(default_factory=list)
    other_module_name: List[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _layers(self):
        if self.enabled:
            if self.keep_number_layer is None:
                raise ValueError("layer_reduction.keep_number_layer is required when layer reduction is enabled")
            if self.teacher_layer and len(self.teacher_layer) != self.keep_number_layer:
                raise ValueError(f"layer_reduction.teacher_layer has {len(self.teacher_layer)} entries but "
                                 f"keep_number_layer is {self.keep_number_layer}; they must match")
        return self


TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
              "head_pruning", "channel_pruning")


class CompressionTrainingSection(DSConfigModel):
    """``compression_training``: any technique whose ``enabled`` is true turns compression on."""

    weight_quantization: Optional[WeightQuantization] = None
    activation_quantization: Optional[ActivationQuantization] = None
    sparse_pruning: Optional[SparsePruning] = None
    row_pruning: Optional[RowChannelPruning] = None
    head_pruning: Optional[HeadPruning] = None
    channel_pruning: Optional[RowChannelPruning] = None
    layer_reduction: Optional[LayerReduction] = None

    def enabling_keys(self) -> List[str]:
        keys = []
        if self.layer_reduction is not None and self.layer_reduction.enabled:
            keys.append("layer_reduction.enabled")
        for name in TECHNIQUES:
            tech = getattr(self, name)
            if tech is not None and tech.shared_parameters.enabled:
                keys.append(f"{name}.shared_parameters.enabled")
        return keys

    @property
    def enabled(self) -> bool:
        return bool(self.enabling_keys())
