"""Config sections whose features are not built in this version.

They are parsed into typed models like every other section (so a typo or a bad
value is still caught), and when one is switched on, ``check_unbuilt`` refuses it
with a :class:`FeatureNotAvailableError` naming the feature and the exact key
that switched it on. ``UNBUILT_FEATURES`` maps top-level key to a human name;
when a feature is built, its key leaves this table and nothing else changes.

Each feature section derives from :class:`FeatureSection`, whose
``enabling_keys()`` says which of its keys switch the feature on: by default its
own ``enabled`` flag; sections without one (``sparse_attention``) count as on
whenever present; composite sections (``compression_training``) list each
technique's flag.
"""
from __future__ import annotations

from typing import Any, List

from .base import DSConfigModel
from .errors import DeepSpeedConfigError, FeatureNotAvailableError

# key -> feature name.
UNBUILT_FEATURES: dict[str, str] = {
    "quantize_training": "quantization-aware training",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "nebula": "Nebula checkpointing",
    "weight_quantization": "weight quantization",
}

#: Sections that configure something but switch no feature on; they are parsed
#: and kept, never refused (``aio`` tunes NVMe I/O, ``pipeline`` the pipeline engine).
ACCEPTED_SECTIONS = ("aio", "pipeline")

#: The marker ``enabling_keys`` returns for a section that is on by being present.
WHOLE_SECTION = ""


class FeatureSection(DSConfigModel):
    """A section whose feature is switched on by its own ``enabled`` flag."""

    enabled: bool = False

    def enabling_keys(self) -> List[str]:
        """Key paths (relative to the section) that switch the feature on; empty when off."""
        return ["enabled"] if self.enabled else []


class PresenceFeatureSection(DSConfigModel):
    """A section with no ``enabled`` flag: being present in the config switches it on."""

    def enabling_keys(self) -> List[str]:
        return [WHOLE_SECTION]


class UnbuiltFeatureError(FeatureNotAvailableError):
    """``FeatureNotAvailableError`` naming the exact key that switched the feature on."""

    def __init__(self, section: str, feature: str, enabling_key: str):
        key = f"{section}.{enabling_key}" if enabling_key else section
        if enabling_key.endswith("enabled"):
            fix = f"Set '{key}' to false or remove the '{section}' section."
        else:
            fix = f"Remove the '{section}' section."
        DeepSpeedConfigError.__init__(
            self, f"Config '{key}' turns on {feature}, which is not available in this version of "
                  f"deepspeed. {fix}")
        self.key = key
        self.section = section
        self.feature = feature


def enabling_keys(value: Any) -> List[str]:
    """The keys of a parsed section that switch its feature on (raw dicts are judged by 'enabled')."""
    if value is None:
        return []
    if hasattr(value, "enabling_keys"):
        return list(value.enabling_keys())
    if isinstance(value, dict):
        return ["enabled"] if value.get("enabled") else []
    return [WHOLE_SECTION] if value else []


def section_enabled(value: Any) -> bool:
    return bool(enabling_keys(value))


def check_unbuilt(model) -> None:
    """Raise for the first unbuilt feature the config switches on."""
    for key, feature in UNBUILT_FEATURES.items():
        keys = enabling_keys(getattr(model, key, None))
        if keys:
            raise UnbuiltFeatureError(key, feature, keys[0])


def unbuilt_sections_markdown() -> str:
    """The table of parsed-but-not-built sections, as docs/config.md shows it."""
    rows = ["| config key | feature |", "| --- | --- |"]
    rows += [f"| `{k}` | {v} |" for k, v in UNBUILT_FEATURES.items()]
    return "\n".join(rows)
