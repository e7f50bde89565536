"""Base pydantic model for every config section, and translation of pydantic's
errors into messages that name the key path, the value and what is allowed."""
from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import DeepSpeedConfigError, did_you_mean


class DSConfigModel(BaseModel):
    """A config section. Unknown keys are errors (with a 'did you mean' hint)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              arbitrary_types_allowed=True, protected_namespaces=(), defer_build=True)

    # Dict-style access, which DeepSpeed users and integrations rely on.
    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def to_dict(self) -> dict:
        return self.model_dump(by_alias=True)


def _field_names(model_cls) -> list[str]:
    names = []
    for name, f in model_cls.model_fields.items():
        names.append(f.alias or name)
    return names


def _submodel(ann):
    """``(model class, container keys to skip)`` for a field annotation: a model,
    ``Optional[model]``, ``Dict[str, model]`` or ``List[model]`` (the dict key or list
    index appears in the error location before the model's own keys)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, 0
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (dict, list, tuple) and args:
        cls, skip = _submodel(args[-1] if origin is dict else args[0])
        return (cls, skip + 1) if cls is not None else (None, 0)
    for cand in args:
        cls, skip = _submodel(cand)
        if cls is not None:
            return cls, skip
    return None, 0


def _resolve_model_at(root_cls, loc: tuple):
    """Walk the model classes along an error location to find the model owning the last key."""
    cls, skip = root_cls, 0
    for part in loc[:-1]:
        if skip:
            skip -= 1
            continue
        if not isinstance(part, str) or cls is None:
            return None
        fld = None
        for name, f in cls.model_fields.items():
            if part in (name, f.alias):
                fld = f
                break
        if fld is None:
            return None
        cls, skip = _submodel(fld.annotation)
    return cls if not skip else None


def format_validation_error(err: ValidationError, root_cls, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        path = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc) or "<config>"
        typ = e["type"]
        if typ == "extra_forbidden":
            owner = _resolve_model_at(root_cls, loc)
            hint = did_you_mean(str(loc[-1]), _field_names(owner)) if owner is not None else ""
            valid = f" Valid keys here: {', '.join(sorted(_field_names(owner)))}." if owner is not None and not hint else ""
            lines.append(f"Unknown config key '{path}'.{hint}{valid}")
        elif typ == "missing":
            lines.append(f"Missing required config key '{path}'.")
        else:
            val = e.get("input")
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            lines.append(f"Invalid value for '{path}': {val!r}. {msg}.")
    return "DeepSpeed config error:\n  " + "\n  ".join(lines)


def parse_section(model_cls, data: Any, prefix: str = ""):
    """Validate ``data`` into ``model_cls`` raising DeepSpeedConfigError with readable messages."""
    if data is None:
        data = {}
    if isinstance(data, model_cls):
        return data
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            f"Config '{prefix or '<config>'}' must be a JSON object (dict), got {type(data).__name__}: {data!r}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        raise DeepSpeedConfigError(format_validation_error(err, model_cls, prefix)) from None
