"""The one allow-list of non-tensor types a checkpoint file may hold.

Every reader of checkpoint files in the package loads through
:func:`deepspeed.runtime.checkpoint.io.load_file`, i.e. ``torch.load(weights_only=True)``
with exactly these extra types allowed (besides what torch's weights-only unpickler
allows by default: tensors, plain containers, numbers, strings, ``torch.Size``,
``OrderedDict``...). A pickle naming anything else - ``os.system``, ``builtins.eval``,
a user's class - is refused before any of it runs.

The extra types are the non-tensor objects DeepSpeed itself pickles into its files (its
``LossScaler``, ``ZeroStageEnum`` and ``fragment_address``), as inert stand-ins registered
under DeepSpeed's module paths: data only, no behaviour.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class _LossScaler:
    """DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` as pickled: its attributes only."""


class _DynamicLossScaler(_LossScaler):
    """DeepSpeed's ``DynamicLossScaler`` as pickled: its attributes only."""


try:  # the package's own enum at DeepSpeed's path, when built
    from ..zero.config import ZeroStageEnum as _ZeroStageEnum
except ImportError:  # pragma: no cover - a stand-in with the same values
    class _ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3


@dataclass
class _FragmentAddress:
    numel: int
    start: int


for _cls, _mod, _name in ((_LossScaler, "deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                          (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                          (_ZeroStageEnum, "deepspeed.runtime.zero.config", "ZeroStageEnum"),
                          (_FragmentAddress, "deepspeed.utils.tensor_fragment", "fragment_address")):
    if (_cls.__module__, _cls.__name__) != (_mod, _name):
        _cls.__module__, _cls.__name__, _cls.__qualname__ = _mod, _name, _name

#: exactly the non-tensor types DeepSpeed stores (besides torch.Size / OrderedDict, allowed by default)
SAFE_GLOBALS = [_LossScaler, _DynamicLossScaler, _ZeroStageEnum, _FragmentAddress]


def allowed_names() -> list:
    return [f"{c.__module__}.{c.__name__}" for c in SAFE_GLOBALS]
