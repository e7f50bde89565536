"""Config errors that name the key path, the bad value and what is allowed."""
from __future__ import annotations

import difflib


class DeepSpeedConfigError(ValueError):
    """Raised for any invalid DeepSpeed configuration. Subclasses ValueError so
    callers that catch ValueError keep working."""


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


class DeepSpeedConfigAssertionError(DeepSpeedConfigError, AssertionError):
    """A config error where DeepSpeed itself fails with ``assert`` (its clients and tests catch
    ``AssertionError``); also a :class:`DeepSpeedConfigError`, hence a ``ValueError``."""


class DeepSpeedConfigNotImplementedError(DeepSpeedConfigError, NotImplementedError):
    """A combination DeepSpeed refuses with ``NotImplementedError`` (e.g. an unsupported mix of model
    and gradient-accumulation dtypes without ZeRO); also a :class:`DeepSpeedConfigError`."""


class FeatureNotAvailableError(DeepSpeedConfigError):
    """A config section that is parsed and valid but whose feature is not built."""

    def __init__(self, key: str, feature: str):
        super().__init__(
            f"Config '{key}' enables {feature}, which is not available in this version of "
            f"deepspeed. Remove the section or set '{key}.enabled' to false.")
        self.key = key
        self.feature = feature
