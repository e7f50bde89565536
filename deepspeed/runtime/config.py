"""``deepspeed.runtime.config``: the import path DeepSpeed's own config object has,
which integrations (Hugging Face, monitor examples) use. The code lives in
:mod:`deepspeed.config`."""
from ..config import (DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedConfigModel,  # noqa: F401
                      FeatureNotAvailableError)

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigModel", "DeepSpeedConfigError", "FeatureNotAvailableError"]
