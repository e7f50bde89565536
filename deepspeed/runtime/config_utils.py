"""``deepspeed.runtime.config_utils``: DeepSpeed's base class for config models and the
small dict helpers its config code and clients use.

``DeepSpeedConfigModel`` is the base of every typed section in :mod:`deepspeed.config`
(it extends ``DSConfigModel``: unknown keys are errors with a "did you mean" hint), plus
DeepSpeed's conventions for models clients define themselves: ``"auto"`` and ``None``
values are dropped unless ``strict=True`` (so the field keeps its default), and a field
declared with ``json_schema_extra={"deprecated": True, "new_param": "x"}`` still works,
warns, and forwards its value to the new field (through ``new_param_fn`` if given).
Note: ``deepspeed.runtime.config.DeepSpeedConfigModel`` is a different class, the whole
top-level config model; this one is the base for sections.
"""
from __future__ import annotations

import collections
import json
from functools import reduce
from typing import Any

from ..config.base import DSConfigModel
from ..config.errors import DeepSpeedConfigAssertionError, DeepSpeedConfigError
from ..utils.logging import logger


class DeepSpeedConfigModel(DSConfigModel):
    def __init__(self, strict: bool = False, **data):
        if not strict:
            data = {k: v for k, v in data.items() if v is not None and (v != "auto" or k == "replace_method")}
        super().__init__(**data)
        self._deprecated_fields_check()

    def _deprecated_fields_check(self) -> None:
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("deprecated") and name in self.model_fields_set:
                self._process_deprecated_field(name, field, extra)

    def _process_deprecated_field(self, name: str, field, extra: dict) -> None:
        value = getattr(self, name)
        new_param = extra.get("new_param", "")
        msg = f"Config parameter {name} is deprecated" + (f", use {new_param} instead" if new_param else "")
        if extra.get("deprecated_msg"):
            msg += f". {extra['deprecated_msg']}"
        logger.warning(msg)
        if not new_param or not extra.get("set_new_param", True):
            return
        head, _, leaf = new_param.rpartition(".")
        if new_param.split(".")[0] in self.model_fields_set:
            # DeepSpeed asserts here: an AssertionError that is also our DeepSpeedConfigError
            raise DeepSpeedConfigAssertionError(
                f"'{name}' is deprecated and '{new_param}' replaces it; set only one of them.")
        target = reduce(getattr, head.split("."), self) if head else self
        fn = extra.get("new_param_fn", lambda x: x)
        setattr(target, leaf, fn(value))


class pp_int(int):  # noqa: N801 - DeepSpeed's name
    """An int that prints with thousands separators in config dumps (``5,000,000``)."""

    def __new__(cls, val, custom_print_str=None):
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self):
        return self.custom_print_str or f"{self.real:,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """JSON encoder that writes large integers as ``1e+09`` (DeepSpeed's config printing)."""

    def iterencode(self, o, _one_shot=False, level=0):
        indent = self.indent if self.indent is not None else 4
        prefix_close = " " * level * indent
        level += 1
        prefix = " " * level * indent
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, float) or isinstance(o, int):
            return f"{o:e}" if o > 1e3 else str(o)
        if isinstance(o, collections.abc.Mapping):
            x = [f'\n{prefix}"{k}": {self.iterencode(v, level=level)}' for k, v in o.items()]
            return "{" + ", ".join(x) + f"\n{prefix_close}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return f"[{', '.join(map(self.iterencode, o))}]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """Base for DeepSpeed's older hand-written config objects: ``repr`` as sorted JSON."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs):
    """``object_pairs_hook`` for ``json.load`` that refuses a key given twice."""
    d = dict((k, v) for k, v in ordered_pairs)
    if len(d) != len(ordered_pairs):
        counter = collections.Counter([pair[0] for pair in ordered_pairs])
        keys = [key for key, value in counter.items() if value > 1]
        raise ValueError(f"Duplicate keys in DeepSpeed config: {keys}")
    return d
