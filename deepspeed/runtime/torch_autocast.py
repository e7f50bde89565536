"""``deepspeed.runtime.torch_autocast``: DeepSpeed's helpers around the ``torch_autocast``
config section (``enabled``, ``dtype``, ``lower_precision_safe_modules``).

With ``torch_autocast.enabled`` the engine runs the forward under ``torch.autocast`` in the
configured dtype (see :func:`autocast_if_enabled`); parameters, gradients and the optimizer
stay in fp32.

Deviation from DeepSpeed 0.19 (docs/api_surface.md): DeepSpeed tags the parameters of the
"lower-precision safe" modules (``torch.nn.Linear``/``Conv*`` by default) with a
``comm_dtype`` attribute and reduces their gradients in the autocast dtype. Here gradients
are reduced in their own dtype (fp32, or ``communication_data_type``), so no parameter carries
a ``comm_dtype``: :func:`has_comm_dtype` is False and :func:`get_comm_dtype` returns the
parameter's dtype, which is what its gradient is reduced in.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, List, Set

import torch

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "torch.float16": torch.float16}


def autocast_dtype_of(section) -> torch.dtype:
    """The dtype a ``torch_autocast`` section names (bfloat16 when it names none, as DeepSpeed)."""
    return _DTYPES.get(getattr(section, "dtype", None) or "bfloat16", torch.bfloat16)


def get_default_autocast_lower_precision_modules() -> List[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    """True when ``param`` carries a ``comm_dtype`` of its own (never here: see the module doc)."""
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """The dtype ``param``'s gradient is communicated in (its ``comm_dtype``, else its dtype)."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable) -> Set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: List[torch.dtype]) -> List[torch.dtype]:
    return sorted(dtypes, key=str)


def is_autocast_initialized() -> bool:
    """DeepSpeed's flag that parameters were tagged for autocast communication (never here)."""
    return False


def get_autocast_dtype():
    """The dtype parameters were tagged with (None here: nothing is tagged)."""
    return None


@contextlib.contextmanager
def autocast_if_enabled(engine):
    """Run the enclosed forward under ``torch.autocast`` as the engine's ``torch_autocast``
    section says; without the section, an autocast the caller opened stays as it is."""
    section = engine.config_obj.model.torch_autocast
    if section.enabled:
        with torch.autocast(device_type=engine.device.type, dtype=autocast_dtype_of(section)):
            yield
    else:
        yield
