"""Config sections whose features are not built in this version.

They are parsed (so a typo is still caught) and, when enabled, refused with an
error that names the feature. ``UNBUILT_FEATURES`` maps top-level key to a
human name; ``check_unbuilt`` applies the rule.
"""
from __future__ import annotations

from typing import Any

from .errors import FeatureNotAvailableError

# key -> feature name. A section counts as enabled when it is a dict whose
# "enabled" is true (or, for sections without that flag, when it is present and non-empty).
UNBUILT_FEATURES: dict[str, str] = {
    "tensorboard": "the TensorBoard monitor",
    "wandb": "the Weights & Biases monitor",
    "comet": "the Comet monitor",
    "csv_monitor": "the CSV monitor",
    "flops_profiler": "the flops profiler",
    "comms_logger": "the communication logger",
    "sparse_attention": "sparse attention kernels",
    "compression_training": "compression training",
    "elasticity": "elastic training",
    "autotuning": "the autotuner",
    "data_efficiency": "data efficiency (curriculum learning / random-LTD)",
    "curriculum_learning": "curriculum learning",
    "progressive_layer_drop": "progressive layer drop",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantization-aware training",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "nebula": "Nebula checkpointing",
    "weight_quantization": "weight quantization",
}


def section_enabled(value: Any) -> bool:
    if value is None:
        return False
    if hasattr(value, "enabled"):
        return bool(getattr(value, "enabled"))
    if isinstance(value, dict):
        if "enabled" in value:
            return bool(value["enabled"])
        return False
    return bool(value)


def check_unbuilt(model) -> None:
    for key, feature in UNBUILT_FEATURES.items():
        value = getattr(model, key, None)
        if section_enabled(value):
            raise FeatureNotAvailableError(key, feature)
