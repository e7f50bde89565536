"""The documented configuration classes: ``deepspeed.config.Config``,
``TrainingConfig``, ``BatchConfig`` and ``FP16Config``.

``Config`` is a small struct: built from keyword arguments or a dict, read by
attribute or by item, and able to ``resolve()`` missing values and say whether it
``is_valid()``. Subclasses group arguments by topic; their fields are the class
attributes they declare (documented defaults are ``None``), and a key they do not
declare is an error with a "did you mean" hint. A field may hold a nested
sub-config (``TrainingConfig.batch`` is a ``BatchConfig``); dicts given for it are
turned into that class.

The real work is shared with the engine's config: batch sizes resolve through
:func:`deepspeed.config.ds_config.resolve_batch_sizes` and fp16 values validate
through the same model as the ``fp16`` config section, so both give the same
answers and the same error messages.
"""
from __future__ import annotations

import copy
from typing import Any, ClassVar, Dict, Mapping, Optional

from .base import parse_section
from .ds_config import resolve_batch_sizes
from .errors import DeepSpeedConfigError, did_you_mean
from .sections import FP16Section


def _reserved_names(cls) -> set:
    """Public method and property names, which a config key may not shadow."""
    return {n for n in dir(cls) if not n.startswith("_")
            and (callable(getattr(cls, n, None)) or isinstance(getattr(cls, n, None), property))}


class Config:
    """Base class for DeepSpeed configurations: a struct with subclassing.

    >>> c = Config(verbose=True)
    >>> c.verbose, c['verbose']
    (True, True)
    """

    #: field name -> default, collected from the class attributes a subclass declares.
    _fields: ClassVar[Optional[Dict[str, Any]]] = None
    #: field name -> Config subclass, for fields holding a nested sub-config.
    _sub_configs: ClassVar[Dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fields = dict(cls._fields or {})
        for name, value in vars(cls).items():
            if name.startswith("_") or callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                continue
            fields[name] = value
        cls._fields = fields or None  # a subclass declaring no fields stays free-form, like Config

    def __init__(self, **kwargs):
        reserved = _reserved_names(type(self)) & set(kwargs)
        if reserved:
            raise DeepSpeedConfigError(
                f"{type(self).__name__}: {', '.join(sorted(reserved))} is a method or property name "
                f"and cannot be a config key.")
        if self._fields is not None:
            self._check_known(kwargs)
            for name, default in self._fields.items():
                object.__setattr__(self, name, copy.deepcopy(default))
        for key, value in kwargs.items():
            setattr(self, key, value)

    def _check_known(self, kwargs) -> None:
        for key in kwargs:
            if key not in self._fields:
                hint = did_you_mean(str(key), self._fields)
                valid = "" if hint else f" Valid keys: {', '.join(self._fields)}."
                raise DeepSpeedConfigError(f"Unknown {type(self).__name__} key '{key}'.{hint}{valid}")

    def __setattr__(self, key, value):
        if self._fields is not None and not key.startswith("_"):
            self._check_known({key: value})
        sub = self._sub_configs.get(key)
        if sub is not None and isinstance(value, Mapping):
            value = sub.from_dict(value, _where=f"{type(self).__name__}.{key}")
        object.__setattr__(self, key, value)

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_dict(cls, config: Mapping, _where: Optional[str] = None):
        """Build from a dict; nested dicts become the declared sub-configs."""
        where = _where or cls.__name__
        if not isinstance(config, Mapping):
            raise DeepSpeedConfigError(
                f"{where} must be built from a dict, got {type(config).__name__}: {config!r}")
        bad = [k for k in config if not isinstance(k, str)]
        if bad:
            raise DeepSpeedConfigError(f"{where} keys must be strings, got {bad!r}")
        return cls(**dict(config))

    # -- access --------------------------------------------------------------------
    def __getitem__(self, key):
        if not isinstance(key, str) or key.startswith("_") or key not in vars(self):
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and not key.startswith("_") and key in vars(self)

    def keys(self):
        return [k for k in vars(self) if not k.startswith("_")]

    def get(self, key, default=None):
        return self[key] if key in self else default

    def to_dict(self) -> dict:
        """A plain dict, sub-configs included."""
        return {k: (v.to_dict() if isinstance(v, Config) else copy.deepcopy(v)) for k, v in
                ((k, getattr(self, k)) for k in self.keys())}

    def __eq__(self, other):
        return type(self) is type(other) and self.to_dict() == other.to_dict()

    def __repr__(self):
        inner = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.keys())
        return f"{type(self).__name__}({inner})"

    # -- resolution and validity ----------------------------------------------------
    def _sub_config_items(self):
        return [(k, v) for k, v in ((k, getattr(self, k)) for k in self.keys()) if isinstance(v, Config)]

    def resolve(self, **kwargs):
        """Infer any missing arguments, if possible (here: in every sub-config). Returns self."""
        for _, sub in self._sub_config_items():
            sub.resolve(**kwargs)
        return self

    def validate(self) -> None:
        """Raise :class:`DeepSpeedConfigError` saying what is wrong, if anything."""
        for _, sub in self._sub_config_items():
            sub.validate()

    def is_valid(self, **kwargs) -> bool:
        """Resolve any missing configurations and say whether this config and all of
        its sub-configs are valid. The reason for ``False`` is kept in ``invalid_reason``."""
        try:
            self.resolve(**kwargs)
            self.validate()
        except DeepSpeedConfigError as err:
            object.__setattr__(self, "_invalid_reason", str(err))
            return False
        object.__setattr__(self, "_invalid_reason", None)
        return True

    @property
    def invalid_reason(self) -> Optional[str]:
        """Why the last ``is_valid()`` returned False (None if it returned True or was not called)."""
        return getattr(self, "_invalid_reason", None)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _default_world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class BatchConfig(Config):
    """Batch size related parameters: any two of the three determine the third
    through ``train_batch_size = train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * world_size``."""

    train_batch_size = None
    train_micro_batch_size_per_gpu = None
    gradient_accumulation_steps = None

    def _check_types(self) -> None:
        for key in BATCH_KEYS:
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DeepSpeedConfigError(f"BatchConfig.{key} must be a positive integer, got {value!r}.")

    def resolve(self, world_size: Optional[int] = None, **kwargs):
        """Complete the batch configuration from the values given. ``world_size`` is the
        data-parallel world size: by default the one an earlier ``resolve`` used, else
        torch.distributed's if it is initialised, else 1. Raises
        :class:`DeepSpeedConfigError` (showing the arithmetic) when the values disagree or
        too few are given."""
        self._check_types()
        if world_size is None:
            world_size = self._resolved_world_size()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DeepSpeedConfigError(
                f"BatchConfig.resolve: world_size must be a positive integer, got {world_size!r}.")
        values = resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                     self.gradient_accumulation_steps, world_size)
        for key, value in zip(BATCH_KEYS, values):
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_world_size", world_size)
        return self

    def validate(self) -> None:
        self._check_types()
        missing = [k for k in BATCH_KEYS if getattr(self, k) is None]
        if missing:
            raise DeepSpeedConfigError(f"BatchConfig is incomplete: {', '.join(missing)} not set; give two of "
                                       f"{', '.join(BATCH_KEYS)} and call resolve().")
        resolve_batch_sizes(*(getattr(self, k) for k in BATCH_KEYS), self._resolved_world_size())

    def _resolved_world_size(self) -> int:
        return getattr(self, "_world_size", None) or _default_world_size()


class FP16Config(Config):
    """FP16 training: ``enabled``, ``clip`` (gradient clipping by global norm, 0 = off)
    and the keys of the ``fp16`` config section (loss scaling and friends)."""

    enabled = None
    clip = None
    auto_cast = None
    loss_scale = None
    initial_scale_power = None
    loss_scale_window = None
    hysteresis = None
    consecutive_hysteresis = None
    min_loss_scale = None
    fp16_master_weights_and_grads = None

    def _section_keys(self):
        return [k for k in self._fields if k != "clip"]

    def _section_values(self) -> dict:
        return {k: getattr(self, k) for k in self._section_keys() if getattr(self, k) is not None}

    def resolve(self, **kwargs):
        """Fill every unset value with the documented default."""
        self.validate()
        section = parse_section(FP16Section, self._section_values(), prefix="FP16Config")
        for key in self._section_keys():
            object.__setattr__(self, key, getattr(section, key))
        if self.clip is None:
            object.__setattr__(self, "clip", 0.0)
        return self

    def validate(self) -> None:
        clip = self.clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
            raise DeepSpeedConfigError(f"FP16Config.clip must be a number >= 0 (0 turns clipping off), got {clip!r}.")
        parse_section(FP16Section, self._section_values(), prefix="FP16Config")

    def to_ds_section(self) -> dict:
        """The ``fp16`` section of a DeepSpeed config (``clip`` goes to ``gradient_clipping``)."""
        return self._section_values()


class TrainingConfig(Config):
    """Top-level configuration for training: ``batch`` (a :class:`BatchConfig`) and
    ``fp16`` (an :class:`FP16Config`)."""

    batch = None
    fp16 = None
    _sub_configs = {"batch": BatchConfig, "fp16": FP16Config}

    def validate(self) -> None:
        for key, cls in self._sub_configs.items():
            value = getattr(self, key)
            if value is not None and not isinstance(value, cls):
                raise DeepSpeedConfigError(
                    f"TrainingConfig.{key} must be a {cls.__name__} or a dict, got {type(value).__name__}.")
        if self.batch is None:
            raise DeepSpeedConfigError("TrainingConfig.batch is required: give a BatchConfig (or dict) with two "
                                       f"of {', '.join(BATCH_KEYS)}.")
        super().validate()

    def to_ds_config(self) -> dict:
        """The equivalent DeepSpeed config dict, for ``deepspeed.initialize(config=...)``."""
        out: dict = {}
        if self.batch is not None:
            out.update({k: getattr(self.batch, k) for k in BATCH_KEYS if getattr(self.batch, k) is not None})
        if self.fp16 is not None:
            out["fp16"] = self.fp16.to_ds_section()
            if self.fp16.clip is not None:
                out["gradient_clipping"] = self.fp16.clip
        return out
