"""``deepspeed.checkpoint.ds_to_universal``: what this package has of DeepSpeed's offline
converter to a universal checkpoint.

The conversion itself (``main``, the ``ds_to_universal.py`` script) is not built: every checkpoint
this package writes is already universal (optimizer state keyed by parameter name,
``deepspeed/runtime/checkpoint/universal.py``), so it loads at any world size and ZeRO stage as it
is, and checkpoints written by DeepSpeed itself load through ``engine.load_checkpoint`` directly
(``deepspeed/runtime/checkpoint/deepspeed_native.py``). Importing ``main`` raises an ImportError
saying so.

What is here is the converter's first step on a ZeRO-1/2 checkpoint, which needs no conversion
machinery: :func:`_aggregate_autoep_zero12_metadata` checks and gathers the metadata of the
model-states files that :class:`~deepspeed.checkpoint.DeepSpeedCheckpoint` summarized
(``model_state_metadata``) - each file's parameter shapes, the AutoEP layer entries a DeepSpeed
checkpoint of an AutoEP model carries (expert parallelism by automatic sharding, which this package
does not build; the entries are read, checked and merged, never acted on) and the
``use_data_before_expert_parallelism`` flag, which must agree across files.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .constants import AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, PARAM_SHAPES, USE_DATA_BEFORE_EXPERT_PARALLELISM

_NOT_BUILT = ("main", "parse_arguments")


def _aggregate_autoep_zero12_metadata(model_state_metadata) -> Tuple[List[dict], Optional[List[dict]], bool]:
    """``(slice_shapes_by_tp, autoep_metadata, use_data_before_expert_parallelism)`` from
    ``[(model_file, summary), ...]`` (``DeepSpeedCheckpoint.model_state_metadata``):

    * ``slice_shapes_by_tp``: each file's ``{parameter name: shape}``, in file order;
    * ``autoep_metadata``: the AutoEP layer entries of all files, one per ``expert_key_prefix``
      (the same prefix must carry the same entry in every file), or ``None`` without any;
    * the files' common ``use_data_before_expert_parallelism`` (False when unset).

    Raises RuntimeError naming the file for anything malformed or inconsistent."""
    shapes_by_file: List[dict] = []
    by_prefix: Dict[str, dict] = {}
    first_file: Dict[str, str] = {}
    flags: Dict[str, bool] = {}
    for path, summary in model_state_metadata:
        shapes = summary.get(PARAM_SHAPES)
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {path}, got "
                               f"{shapes!r}.")
        shapes_by_file.append(shapes)

        layers = summary.get(AUTOEP_LAYERS_KEY)
        if layers is not None:
            if not isinstance(layers, list):
                raise RuntimeError(f"AutoEP metadata must be a list in {path} (its {AUTOEP_LAYERS_KEY} entry is "
                                   f"{layers!r}).")
            for entry in layers:
                if not isinstance(entry, dict):
                    raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {path}, got {entry!r}.")
                prefix = entry.get(AUTOEP_EXPERT_KEY_PREFIX)
                if not isinstance(prefix, str) or not prefix:
                    raise RuntimeError(f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {path}, "
                                       f"got {prefix!r}.")
                seen = by_prefix.get(prefix)
                if seen is None:
                    by_prefix[prefix], first_file[prefix] = entry, path
                elif seen != entry:
                    raise RuntimeError(f"Conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} in "
                                       f"{first_file[prefix]} and {path}: {seen} != {entry}.")

        ds_config = summary.get("ds_config")
        if not isinstance(ds_config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}, got {ds_config!r}.")
        flag = ds_config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(flag, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in "
                               f"{path}, got {flag!r}.")
        flags[path] = flag
    if len(set(flags.values())) != 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across "
                           f"model-state files: {flags}" if flags else
                           "No model-state files to read the checkpoint metadata from.")
    return shapes_by_file, (list(by_prefix.values()) or None), next(iter(flags.values()))


def __getattr__(name):
    if name in _NOT_BUILT:
        from .._unbuilt import FeatureNotAvailableError
        from .._version import __version__
        raise FeatureNotAvailableError(
            f"'deepspeed.checkpoint.ds_to_universal.{name}' is not available in this version of deepspeed "
            f"({__version__}): the offline conversion to a universal checkpoint is not built, because every "
            f"checkpoint this package writes is already universal (it loads at any world size and ZeRO stage with "
            f"engine.load_checkpoint; 'checkpoint': {{'load_universal': true}} is accepted), and a checkpoint "
            f"written by DeepSpeed loads with engine.load_checkpoint directly.", name=f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
