"""Configuration: typed, validated once at ``deepspeed.initialize``.

The documented classes ``Config``, ``TrainingConfig``, ``BatchConfig`` and
``FP16Config`` live in :mod:`deepspeed.config.documented`.
"""
from .errors import DeepSpeedConfigError, FeatureNotAvailableError  # noqa: F401
from .ds_config import (DeepSpeedConfig, DeepSpeedConfigModel, load_config_source,  # noqa: F401
                        resolve_batch_sizes)

try:  # the documented API classes (deepspeed.config.Config, ...)
    from .documented import BatchConfig, Config, FP16Config, TrainingConfig  # noqa: F401
except ImportError:  # pragma: no cover - during bring-up
    pass
