"""``deepspeed.runtime.precision_config``: DeepSpeed's module for the ``fp16`` / ``bf16`` config
sections. The classes are the typed sections of :mod:`deepspeed.config` (one parser); the
``get_*_config(param_dict)`` helpers read a section out of a whole config dict, with the same
error messages as ``deepspeed.initialize`` (key paths prefixed ``fp16.`` / ``bf16.``)."""
from __future__ import annotations

from ..config.base import parse_section
from ..config.sections import BF16Section, FP16Section

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"   # DeepSpeed's older spelling, still read


class DeepSpeedFP16Config(FP16Section):
    """The ``fp16`` section."""


class DeepSpeedBF16Config(BF16Section):
    """The ``bf16`` section (``bfloat16`` is read too)."""


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    return parse_section(DeepSpeedFP16Config, (param_dict or {}).get(FP16, {}), prefix=FP16)


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    param_dict = param_dict or {}
    key = BFLOAT16 if param_dict.get(BFLOAT16) is not None else BFLOAT16_OLD
    return parse_section(DeepSpeedBF16Config, param_dict.get(key, {}), prefix=key)
