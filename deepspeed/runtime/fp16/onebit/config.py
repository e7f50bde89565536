"""``optimizer.params`` of the 1-bit optimizers: allowed keys, value checks, construction.

Called by :mod:`deepspeed.runtime.optimizers` for the types ``OneBitAdam``,
``ZeroOneAdam`` and ``OneBitLamb``. The parameters are DeepSpeed's (the constructor
signatures); ``deepspeed`` and ``group`` are not config keys.
"""
from __future__ import annotations

import importlib
import inspect

from ....config.errors import DeepSpeedConfigError, did_you_mean

# canonical config type -> (module, class)
ONEBIT_CLASSES = {
    "OneBitAdam": ("deepspeed.runtime.fp16.onebit.adam", "OnebitAdam"),
    "ZeroOneAdam": ("deepspeed.runtime.fp16.onebit.zoadam", "ZeroOneAdam"),
    "OneBitLamb": ("deepspeed.runtime.fp16.onebit.lamb", "OnebitLamb"),
}
_NOT_KEYS = {"self", "params", "deepspeed", "group"}
_INT_KEYS = {"freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"}
_BOOL_KEYS = {"bias_correction", "eps_inside_sqrt", "amsgrad", "cuda_aware"}
_NUMBER_KEYS = {"lr", "eps", "weight_decay", "max_grad_norm", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
                "factor_min", "factor_threshold"}


def onebit_class(name: str):
    mod, cls = ONEBIT_CLASSES[name]
    return getattr(importlib.import_module(mod), cls)


def onebit_keys(name: str) -> set:
    sig = inspect.signature(onebit_class(name).__init__)
    return {k for k in sig.parameters if k not in _NOT_KEYS}


def check_onebit_params(name: str, params: dict) -> None:
    allowed = onebit_keys(name)
    for key, value in (params or {}).items():
        where = f"optimizer.params.{key} = {value!r} (optimizer '{name}')"
        if key not in allowed:
            raise DeepSpeedConfigError(f"optimizer.params.{key} is not a parameter of optimizer '{name}'. "
                                       f"Valid keys: {', '.join(sorted(allowed))}.{did_you_mean(key, sorted(allowed))}")
        if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise DeepSpeedConfigError(f"{where}: must be a non-negative integer.")
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise DeepSpeedConfigError(f"{where}: must be true or false.")
        if key in _NUMBER_KEYS and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise DeepSpeedConfigError(f"{where}: must be a non-negative number.")
        if key == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2
                                   and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)):
            raise DeepSpeedConfigError(f"{where}: must be a list of two numbers in [0, 1), e.g. [0.9, 0.999].")
        if key == "comm_backend_name" and value is not None and str(value).lower() not in ("nccl", "compressed",
                                                                                          "mpi"):
            raise DeepSpeedConfigError(f"{where}: valid backends are 'nccl' (NCCL groups), 'compressed' (any "
                                       f"torch.distributed backend, gloo included) and 'mpi' (needs mpi4py); "
                                       f"'hccl' (Ascend) is not built here.")
        if key == "amsgrad" and value:
            raise DeepSpeedConfigError(f"{where}: {name} has no AMSGrad variant; remove it.")


def check_onebit_stage(name: str, zero_stage: int) -> None:
    if zero_stage != 0:
        raise DeepSpeedConfigError(
            f"optimizer.type '{name}' needs zero_optimization.stage 0 (as in DeepSpeed: the optimizer "
            f"compresses and averages whole momenta itself), got stage {zero_stage}. Set "
            f"zero_optimization.stage to 0, or use 'Adam'/'Lamb' with ZeRO.")


def build_onebit(name: str, params: dict, groups, *, dp_group=None, zero_stage: int = 0):
    check_onebit_params(name, params)
    check_onebit_stage(name, zero_stage)
    try:
        return onebit_class(name)(groups, group=dp_group, **params)
    except ValueError as err:
        raise DeepSpeedConfigError(f"optimizer '{name}': {err}") from None
