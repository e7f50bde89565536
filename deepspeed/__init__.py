"""A PyTorch-native implementation of the DeepSpeed training API.

``deepspeed.initialize`` wraps a model into a :class:`DeepSpeedEngine` driven by a
JSON config; the ``deepspeed`` launcher starts the processes.
"""
from __future__ import annotations

from ._version import __version__, __version_major__, __version_minor__, __version_patch__  # noqa: F401
__git_hash__ = None
__git_branch__ = None

# Documented modules not built yet: a clear ImportError instead of a bare one (see _unbuilt).
from . import _unbuilt  # noqa: E402
_unbuilt.install()

from . import comm  # noqa: E402,F401
from .accelerator import get_accelerator  # noqa: E402,F401
from .comm import init_distributed  # noqa: E402,F401
from .utils.logging import logger, log_dist  # noqa: E402,F401
from .runtime.entry import initialize, add_config_arguments, add_tuning_arguments  # noqa: E402,F401
# DeepSpeedEngine (and the engine's own parts: monitors, checkpoint save/load, strategy
# factory) load on first use: ``deepspeed.DeepSpeedEngine`` through __getattr__ below, and
# ``deepspeed.runtime.engine`` is a lazy module (see _lazy_submodule); initialize() imports it.
from .config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: E402,F401
from .utils.init_on_device import OnDevice  # noqa: E402,F401
from .runtime.dataloader import DeepSpeedDataLoader  # noqa: E402,F401
from .runtime.config import ADAM_OPTIMIZER, LAMB_OPTIMIZER  # noqa: E402,F401
from .git_version_info import version, git_hash, git_branch  # noqa: E402,F401
__git_hash__, __git_branch__ = git_hash, git_branch

# Submodules that clients reach as attributes right after a plain ``import deepspeed``
# (as DeepSpeed's own __init__ loads them): Accelerate reads
# ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``, Transformers
# ``deepspeed.runtime.zero.partition_parameters``, ``deepspeed.zero``, ``deepspeed.utils``, ...
from . import checkpoint, checkpointing, ops, runtime, utils, zero  # noqa: E402,F401
# Training techniques that plug into the engine (each registers with runtime/engine_features):
from .runtime import data_pipeline, eigenvalue, progressive_layer_drop  # noqa: E402,F401
from . import compression  # noqa: E402,F401  (compression_training; DeepSpeed's engine imports it too)
from . import elasticity  # noqa: E402,F401  (registers the elastic batch sizes with config resolution)
from .autotuning import engine_hook as _autotuning_hook  # noqa: E402,F401  (an experiment's metric/stop hook)
from .runtime import config as _rt_config, dataloader as _rt_dataloader, lr_schedules as _rt_lr  # noqa: E402,F401
from .runtime import utils as _rt_utils  # noqa: E402,F401
from .runtime.fp16 import loss_scaler as _rt_loss_scaler  # noqa: E402,F401
from .runtime.zero import partition_parameters as _rt_pp, stage3 as _rt_stage3  # noqa: E402,F401
from .runtime.zero import stage_1_and_2 as _rt_stage12  # noqa: E402,F401
from .checkpoint import utils as _ckpt_utils  # noqa: E402,F401
from .utils import groups as _utils_groups  # noqa: E402,F401  (deepspeed.utils.groups, as in DeepSpeed)


def _lazy_submodule(name: str):
    """Put ``name`` in sys.modules and on its parent package as a module whose body runs on
    its first attribute access (importlib.util.LazyLoader, the standard library's recipe), so
    that ``deepspeed.runtime.engine.DeepSpeedEngine`` keeps working right after a plain
    ``import deepspeed`` without paying for the engine's imports in every process."""
    import importlib.util
    import sys
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


_lazy_submodule(f"{__name__}.runtime.engine")


# Names of ``deepspeed`` that live in a feature package, imported on first use: they work
# as soon as the package exists and raise _unbuilt's clear "not available" error until then.
_LAZY_NAMES = {"DeepSpeedEngine": "runtime.engine", "PipelineModule": "pipe", "LayerSpec": "pipe", "TiedLayerSpec": "pipe",
               "PipelineEngine": "runtime.pipe.engine", "init_inference": "inference",
               "InferenceEngine": "inference.engine",
               "DeepSpeedTransformerLayer": "ops.transformer", "DeepSpeedTransformerConfig": "ops.transformer"}


def __getattr__(name):
    # Submodules that pull in more code load on first use; documented-but-unbuilt ones
    # (deepspeed._unbuilt.UNBUILT) raise FeatureNotAvailableError from the import hook.
    import importlib
    if name in ("zero", "checkpointing", "ops", "launcher", "moe", "pipe", "sequence") \
            or f"{__name__}.{name}" in _unbuilt.UNBUILT:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'deepspeed' has no attribute '{name}'")


def __dir__():
    # the lazy names that always resolve (the pipe/inference ones may be unbuilt: not listed)
    return sorted(set(globals()) | {"DeepSpeedEngine"})
