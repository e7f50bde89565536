"""``deepspeed.runtime.config``: the import path DeepSpeed's own config object has,
which integrations (Hugging Face, monitor examples) use. The code lives in
:mod:`deepspeed.config`; this module adds DeepSpeed's optimizer-name constants.

The optimizer names are DeepSpeed's (lower-case, as ``engine.optimizer_name()``
compares them); ``DEEPSPEED_OPTIMIZERS`` lists those this version builds itself
(the MuP optimizers are not built: see ``UNAVAILABLE_OPTIMIZERS``). The
parser accepts any capitalisation of these names (``deepspeed.runtime.optimizers``).
"""
from ..config import (DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedConfigModel,  # noqa: F401
                      FeatureNotAvailableError)
from .config_utils import (ScientificNotationEncoder, dict_raise_error_on_duplicate_keys,  # noqa: F401
                           get_scalar_param)
from .constants import *  # noqa: F401,F403

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
SGD_OPTIMIZER = "sgd"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER,
                        ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER]
UNAVAILABLE_OPTIMIZERS = [MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER]

# Adam's own option names in ``optimizer.params``
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigModel", "DeepSpeedConfigError", "FeatureNotAvailableError",
           "DEEPSPEED_OPTIMIZERS", "ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER",
           "LION_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER",
           "TORCH_ADAM_PARAM", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT", "get_gradient_clipping", "get_log_level",
           "get_managed_gradient_accumulation"]


def get_gradient_clipping(param_dict: dict) -> float:
    """``gradient_clipping`` of a config dict, or DeepSpeed 0.19's default (1.0)."""
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)  # noqa: F405


def get_log_level(param_dict: dict):
    """``log_level`` of a config dict (None: the logger's level is left as it is)."""
    return param_dict.get(LOG_LEVEL, LOG_LEVEL_DEFAULT)  # noqa: F405


def get_managed_gradient_accumulation(param_dict: dict) -> bool:
    """``managed_gradient_accumulation`` of a config dict, or DeepSpeed 0.19's default (True)."""
    return param_dict.get(MANAGED_GRADIENT_ACCUMULATION, MANAGED_GRADIENT_ACCUMULATION_DEFAULT)  # noqa: F405
