"""A clear error for documented DeepSpeed modules this version does not build yet.

``from deepspeed.pipe import PipelineModule`` on a version without pipeline
parallelism would fail with a bare ``ModuleNotFoundError: No module named
'deepspeed.pipe'``, which reads like a broken install. Instead, a small import
hook, placed *last* on ``sys.meta_path``, answers only for the module paths in
``UNBUILT`` and only when no real module was found by the ordinary finders: it
raises :class:`FeatureNotAvailableError` naming the feature. The moment a real
``deepspeed/pipe/`` package exists, the ordinary finder finds it first and this
hook never runs for it: nothing to remove when a feature lands.

``FeatureNotAvailableError`` subclasses ``ModuleNotFoundError`` (so ``ImportError``
too): code that probes optional parts with ``try/except ImportError`` keeps working.
"""
from __future__ import annotations

import importlib.abc
import sys

# Documented (or widely imported) DeepSpeed module paths -> the feature they belong to.
# A path also covers its submodules (deepspeed.moe covers deepspeed.moe.layer).
UNBUILT = {
    "deepspeed.moe": "mixture of experts",
    "deepspeed.inference": "the inference engine (deepspeed.init_inference)",
    "deepspeed.module_inject": "kernel injection for inference",
    "deepspeed.model_implementations": "the inference model implementations",
    "deepspeed.runtime.swap_tensor": "ZeRO-Infinity NVMe swapping",
    "deepspeed.nvme": "NVMe performance tools",
    "deepspeed.runtime.hybrid_engine": "the hybrid (RLHF) engine",
    "deepspeed.runtime.domino": "Domino tensor-parallel overlap",
    "deepspeed.compile": "DeepCompile",
}


class FeatureNotAvailableError(ModuleNotFoundError):
    """A documented DeepSpeed module that this version does not build."""


def feature_for(fullname: str):
    """The (module path, feature) entry covering ``fullname``, or None."""
    parts = fullname.split(".")
    for i in range(len(parts), 1, -1):
        prefix = ".".join(parts[:i])
        if prefix in UNBUILT:
            return prefix, UNBUILT[prefix]
    return None


def not_available(fullname: str, entry) -> FeatureNotAvailableError:
    from ._version import __version__
    prefix, feature = entry
    return FeatureNotAvailableError(
        f"'{fullname}' is not available in this version of deepspeed ({__version__}): it belongs to "
        f"{feature} ({prefix}), documented DeepSpeed API that is not built yet. See README.md for "
        f"what is built.", name=fullname)


class _UnbuiltFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: reached only when no real module was found."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        entry = feature_for(fullname)
        if entry is None:
            return None
        raise not_available(fullname, entry)


_FINDER = _UnbuiltFinder()


def install() -> None:
    if not any(isinstance(f, _UnbuiltFinder) for f in sys.meta_path):
        sys.meta_path.append(_FINDER)
