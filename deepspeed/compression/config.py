"""``get_compression_config``: the ``compression_training`` section as DeepSpeed's nested
dict, every technique present with its defaults filled in.

Validation is done once, by the typed model
:class:`deepspeed.config.compression_sections.CompressionTrainingSection` (unknown keys,
wrong types and inconsistent values are errors naming the key); this module only turns
the validated section into the dict form the helpers (and users' scripts) index with
the names in :mod:`.constants`.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..config.base import DSConfigModel, parse_section
from ..config.compression_sections import (ActivationQuantization, CompressionTrainingSection, HeadPruning,
                                           LayerReduction, RowChannelPruning, SparsePruning, WeightQuantization)
from .constants import COMPRESSION_TRAINING

_DEFAULTS = {
    "weight_quantization": WeightQuantization,
    "activation_quantization": ActivationQuantization,
    "sparse_pruning": SparsePruning,
    "row_pruning": RowChannelPruning,
    "head_pruning": HeadPruning,
    "channel_pruning": RowChannelPruning,
    "layer_reduction": LayerReduction,
}


def _raw_config(config: Any) -> dict:
    """A DeepSpeed config given as a dict, a JSON file path or a parsed config object."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        if not os.path.exists(config):
            raise ValueError(f"Expected a deepspeed config dict or the path of an existing JSON file, got {config!r}.")
        with open(config) as f:
            return json.load(f)
    raw = getattr(config, "raw", None) or getattr(config, "_param_dict", None)
    if isinstance(raw, dict):
        return raw
    raise TypeError(f"deepspeed_config must be a dict, a JSON file path or a DeepSpeedConfig, got "
                    f"{type(config).__name__}.")


def parse_compression_section(config: Any) -> CompressionTrainingSection:
    """The validated ``compression_training`` section of ``config`` (empty when absent)."""
    if isinstance(config, CompressionTrainingSection):
        return config
    raw = _raw_config(config)
    return parse_section(CompressionTrainingSection, raw.get(COMPRESSION_TRAINING) or {}, COMPRESSION_TRAINING)


def get_compression_config(param_dict: Any) -> dict:
    """DeepSpeed's ``get_compression_config``: ``{technique: {...}}`` for all seven techniques."""
    section = parse_compression_section(param_dict)
    out = {}
    for key, cls in _DEFAULTS.items():
        value: DSConfigModel = getattr(section, key) or cls()
        out[key] = value.model_dump()
    return out
