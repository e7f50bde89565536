"""Build the optimizer named by the config's ``optimizer`` section.

``{"optimizer": {"type": T, "params": {...}}}`` resolves ``T`` case-insensitively:

* ``Adam`` / ``AdamW``: DeepSpeed's Adam. ``adam_w_mode`` (default True, for ``Adam``
  too, as DeepSpeed documents) selects decoupled weight decay (AdamW) over L2; ``AdamW``
  is always decoupled. ``torch_adam: true`` uses ``torch.optim.AdamW``/``Adam`` (fused
  kernel where the device has one); otherwise ``FusedAdam``, or ``DeepSpeedCPUAdam``
  when the optimizer state is offloaded to the CPU. ``weight_decay`` defaults to 0 on
  every path, so switching ``torch_adam`` never changes the math.
* ``Lamb`` -> ``FusedLamb``; ``Lion`` -> ``FusedLion`` / ``DeepSpeedCPULion`` (offload);
  ``Adagrad`` -> ``torch.optim.Adagrad`` / ``DeepSpeedCPUAdagrad`` (offload); ``SGD`` and
  any other ``torch.optim`` class by name, with PyTorch's fused or foreach kernels
  turned on unless the params choose.
* ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``: the communication-compressing optimizers of
  ``runtime/fp16/onebit`` (ZeRO stage 0 only, at least 2 data-parallel ranks).

Every error names the config key (``optimizer.type``, ``optimizer.params.<key>``).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List

import torch

from ..config.errors import DeepSpeedConfigError, did_you_mean
from ..ops.adagrad import DeepSpeedCPUAdagrad
from ..ops.adam import DeepSpeedCPUAdam, FusedAdam
from ..ops.lamb import FusedLamb
from ..ops.lion import DeepSpeedCPULion, FusedLion

ADAM_OPTIMIZER = "Adam"
ADAMW_OPTIMIZER = "AdamW"
LAMB_OPTIMIZER = "Lamb"
LION_OPTIMIZER = "Lion"
ADAGRAD_OPTIMIZER = "Adagrad"
SGD_OPTIMIZER = "SGD"
ONEBIT_ADAM_OPTIMIZER = "OneBitAdam"
ONEBIT_LAMB_OPTIMIZER = "OneBitLamb"
ZERO_ONE_ADAM_OPTIMIZER = "ZeroOneAdam"
ONEBIT_OPTIMIZERS = [ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER]
DEEPSPEED_OPTIMIZERS = [ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, LION_OPTIMIZER, ADAGRAD_OPTIMIZER,
                        SGD_OPTIMIZER] + ONEBIT_OPTIMIZERS
UNAVAILABLE_OPTIMIZERS = []

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "torch_adam", "adam_w_mode",
              "set_grad_none", "fp32_optimizer_states"}
_BOOL_KEYS = {"torch_adam", "adam_w_mode", "bias_correction", "amsgrad", "nesterov", "set_grad_none",
              "eps_inside_sqrt", "fp32_optimizer_states", "maximize", "foreach", "fused", "capturable",
              "differentiable", "decoupled_weight_decay"}
_NON_NEGATIVE_KEYS = {"lr", "eps", "weight_decay", "momentum", "dampening", "max_grad_norm", "max_coeff",
                      "min_coeff", "lr_decay", "initial_accumulator_value", "alpha"}


def _err(msg: str) -> DeepSpeedConfigError:
    return DeepSpeedConfigError(msg)


# ---------------------------------------------------------------- type resolution

def _torch_optimizer_classes() -> Dict[str, type]:
    out = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            out[name] = obj
    return out


def valid_optimizer_names() -> List[str]:
    names = list(DEEPSPEED_OPTIMIZERS)
    names += [n for n in sorted(_torch_optimizer_classes()) if n.lower() not in {d.lower() for d in names}]
    return names


def resolve_optimizer_type(type_name: Any) -> str:
    """Canonical spelling of ``type_name`` (case-insensitive), or a DeepSpeedConfigError."""
    if not isinstance(type_name, str) or not type_name.strip():
        raise _err(f"optimizer.type must be a non-empty string naming an optimizer, got {type_name!r}. "
                   f"Valid: {', '.join(valid_optimizer_names())}.")
    key = type_name.strip().lower()
    for name in UNAVAILABLE_OPTIMIZERS:
        if key == name.lower():
            raise _err(f"optimizer.type '{type_name}': {name} (1-bit / 0-1 compressed communication) is not "
                       f"available in this version of deepspeed. Use 'Adam' or 'Lamb' instead.")
    valid = valid_optimizer_names()
    for name in valid:
        if key == name.lower():
            return name
    lower_to_name = {n.lower(): n for n in valid}
    # DeepSpeed's own names first: 'Adma' should suggest Adam, not torch's Adamax.
    hint = did_you_mean(key, [n.lower() for n in DEEPSPEED_OPTIMIZERS]) or did_you_mean(key, list(lower_to_name))
    for lower, name in lower_to_name.items():
        hint = hint.replace(repr(lower), repr(name))
    raise _err(f"optimizer.type '{type_name}' is not a known optimizer. Valid types: {', '.join(valid)} "
               f"(case-insensitive).{hint}")


def _signature_keys(cls) -> set:
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # drop self, params
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _allowed_keys(name: str, params: dict) -> set:
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        keys = set(_ADAM_KEYS)
        if params.get("torch_adam"):
            keys |= _signature_keys(torch.optim.Adam) | _signature_keys(torch.optim.AdamW)
        return keys
    if name == LAMB_OPTIMIZER:
        return _signature_keys(FusedLamb)
    if name == LION_OPTIMIZER:
        return _signature_keys(FusedLion) | _signature_keys(DeepSpeedCPULion)
    if name == ADAGRAD_OPTIMIZER:
        return _signature_keys(torch.optim.Adagrad) | _signature_keys(DeepSpeedCPUAdagrad)
    return _signature_keys(_torch_optimizer_classes()[name])


# ---------------------------------------------------------------- parameter checks

def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_value(name: str, key: str, value) -> None:
    where = f"optimizer.params.{key} = {value!r} (optimizer '{name}')"
    if key in _BOOL_KEYS and value is not None and not isinstance(value, bool):
        raise _err(f"{where}: must be true or false.")
    if key in _NON_NEGATIVE_KEYS and not (_is_number(value) and value >= 0):
        raise _err(f"{where}: must be a non-negative number.")
    if key == "betas":
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(b) for b in value)
        if not ok or not all(0.0 <= b < 1.0 for b in value):
            raise _err(f"{where}: must be a list of two numbers in [0, 1), e.g. [0.9, 0.999].")


def check_optimizer_params(name: str, params: Any) -> None:
    """Key names and value types of ``optimizer.params`` for the canonical type ``name``."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise _err(f"optimizer.params must be a dictionary of keyword arguments, got {type(params).__name__}.")
    allowed = _allowed_keys(name, params)
    for key, value in params.items():
        if key not in allowed:
            hint = did_you_mean(key, sorted(allowed))
            raise _err(f"optimizer.params.{key} is not a parameter of optimizer '{name}'. "
                       f"Valid keys: {', '.join(sorted(allowed))}.{hint}")
        _check_value(name, key, value)
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        _check_adam_modes(name, params)
    if name == LAMB_OPTIMIZER and params.get("min_coeff", 0.01) > params.get("max_coeff", 10.0):
        raise _err(f"optimizer.params.min_coeff ({params.get('min_coeff', 0.01)}) must not exceed "
                   f"optimizer.params.max_coeff ({params.get('max_coeff', 10.0)}) (optimizer 'Lamb').")
    if name in (LAMB_OPTIMIZER, ADAGRAD_OPTIMIZER) and params.get("amsgrad"):
        raise _err(f"optimizer.params.amsgrad = True: {name} has no amsgrad variant; remove it.")


def _check_adam_modes(name: str, params: dict) -> None:
    if name == ADAMW_OPTIMIZER and params.get("adam_w_mode") is False:
        raise _err("optimizer.params.adam_w_mode = False contradicts optimizer.type 'AdamW' (always decoupled "
                   "weight decay). For Adam with L2 regularisation use type 'Adam' with adam_w_mode false.")
    if params.get("torch_adam"):
        if params.get("bias_correction") is False:
            raise _err("optimizer.params.bias_correction = False is not supported with torch_adam = true "
                       "(torch.optim.Adam always corrects bias). Drop torch_adam to use DeepSpeed's Adam.")
    elif params.get("amsgrad"):
        raise _err(f"optimizer.params.amsgrad = True: DeepSpeed's fused and CPU Adam do not implement amsgrad "
                   f"(optimizer '{name}'). Set 'torch_adam': true to use torch.optim's amsgrad, or remove it.")


def validate_optimizer_config(type_name: Any, params: Any) -> str:
    """Validate the ``optimizer`` section before any model parameter exists.

    Checks the type, every key and value, then builds the optimizer once over a dummy
    parameter so constructor-level checks run at ``initialize`` too. Returns the
    canonical type name.
    """
    name = resolve_optimizer_type(type_name)
    if name in ONEBIT_OPTIMIZERS:  # needs a process group to build: keys and values only here
        from .fp16.onebit.config import check_onebit_params
        check_onebit_params(name, params)
        return name
    check_optimizer_params(name, params)
    dummy = [torch.zeros(2, 2, requires_grad=True)]
    try:
        build_optimizer(name, dict(params or {}), dummy)
    except DeepSpeedConfigError:
        raise
    except (ValueError, TypeError, RuntimeError) as e:
        raise _err(f"optimizer '{name}' rejected optimizer.params {params!r}: {e}") from e
    return name


# ---------------------------------------------------------------- construction

def _materialize(model_parameters: Iterable) -> list:
    if isinstance(model_parameters, torch.Tensor):
        return [model_parameters]
    return list(model_parameters)


def _tensors(groups: list) -> List[torch.Tensor]:
    out = []
    for g in groups:
        if isinstance(g, dict):
            ps = g.get("params", [])
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            out.append(g)
    return out


def _fused_devices() -> List[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return list(_get_fused_kernels_supported_devices())
    except ImportError:
        return ["cuda"]


def _construct_torch(cls, params: dict, groups: list) -> torch.optim.Optimizer:
    """``cls(groups, **params)`` with PyTorch's fused kernel when every tensor allows it,
    else foreach, unless the config already chose one of them."""
    keys = _signature_keys(cls)
    if "fused" in params or "foreach" in params:
        return cls(groups, **params)
    tensors = _tensors(groups)
    if "fused" in keys and tensors and all(t.is_floating_point() for t in tensors) \
            and len({t.device.type for t in tensors}) == 1 and tensors[0].device.type in _fused_devices():
        try:
            return cls(groups, **params, fused=True)
        except (RuntimeError, ValueError):
            pass  # this optimizer/option combination has no fused kernel: use foreach
    if "foreach" in keys:
        return cls(groups, **params, foreach=True)
    return cls(groups, **params)


def _build_adam(name: str, params: dict, groups: list, cpu_offload: bool) -> torch.optim.Optimizer:
    params = dict(params)
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = params.pop("adam_w_mode", True) or name == ADAMW_OPTIMIZER
    params.setdefault("weight_decay", 0.0)
    if torch_adam:
        for key in ("bias_correction", "set_grad_none", "fp32_optimizer_states"):
            params.pop(key, None)
        return _construct_torch(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, params, groups)
    if cpu_offload:
        params.pop("set_grad_none", None)
        return DeepSpeedCPUAdam(groups, adamw_mode=adam_w_mode, **params)
    params.pop("fp32_optimizer_states", None)
    return FusedAdam(groups, adam_w_mode=adam_w_mode, **params)


def build_optimizer(type_name: str, params: dict, model_parameters, *, cpu_offload: bool = False,
                    dp_group=None, zero_stage: int = 0):
    """The optimizer for config ``type_name``/``params`` over ``model_parameters``
    (tensors or param-group dicts). ``cpu_offload=True`` picks the CPU optimizers
    DeepSpeed uses with ``offload_optimizer.device: cpu``. ``dp_group``/``zero_stage``
    matter to the 1-bit optimizers only (their communication group; stage 0 required)."""
    name = resolve_optimizer_type(type_name)
    params = dict(params or {})
    if name in ONEBIT_OPTIMIZERS:
        from .fp16.onebit.config import build_onebit
        return build_onebit(name, params, _materialize(model_parameters), dp_group=dp_group,
                            zero_stage=1 if cpu_offload else zero_stage)
    check_optimizer_params(name, params)
    groups = _materialize(model_parameters)
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        return _build_adam(name, params, groups, cpu_offload)
    if name == LAMB_OPTIMIZER:
        return FusedLamb(groups, **params)
    if name == LION_OPTIMIZER:
        if cpu_offload:
            params.pop("set_grad_none", None)
            return DeepSpeedCPULion(groups, **params)
        params.pop("fp32_optimizer_states", None)
        return FusedLion(groups, **params)
    if name == ADAGRAD_OPTIMIZER:
        if cpu_offload and set(params) <= _signature_keys(DeepSpeedCPUAdagrad):
            return DeepSpeedCPUAdagrad(groups, **params)
        params.pop("fp32_optimizer_states", None)
        params.pop("amsgrad", None)
        return _construct_torch(torch.optim.Adagrad, params, groups)
    return _construct_torch(_torch_optimizer_classes()[name], params, groups)
