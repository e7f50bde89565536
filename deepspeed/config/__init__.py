"""Configuration: typed, validated once at ``deepspeed.initialize``.

``DeepSpeedConfig`` parses a DeepSpeed config (dict or JSON/hjson file) into the
typed section models; the documented classes ``Config``, ``TrainingConfig``,
``BatchConfig`` and ``FP16Config`` live in :mod:`deepspeed.config.documented`.
"""
from .errors import DeepSpeedConfigError, FeatureNotAvailableError  # noqa: F401
from .ds_config import (DeepSpeedConfig, DeepSpeedConfigModel, load_config_source,  # noqa: F401
                        resolve_batch_sizes)
from .feature_sections import UNBUILT_FEATURES  # noqa: F401
from .documented import BatchConfig, Config, FP16Config, TrainingConfig  # noqa: F401
