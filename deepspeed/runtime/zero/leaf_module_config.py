"""``deepspeed.runtime.zero.leaf_module_config``: DeepSpeed's import path for the
``zero_optimization.leaf_module`` section (the model lives with the other config sections in
:mod:`deepspeed.config.sections`; :func:`deepspeed.utils.z3_leaf_module.apply_zero_leaf_module_config`
applies it at ``deepspeed.initialize``)."""
from ...config.sections import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,  # noqa: F401
                                DEFAULT_LEAF_MODULE_NAMES)
from ...config.sections import LeafModuleSection as DeepSpeedZeroLeafModuleConfig  # noqa: F401

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
