"""Parts of the module state that a feature keeps in files of its own.

A checkpoint's model-states file holds the module's state dict. A feature may keep part
of it elsewhere: MoE writes each expert's weights to DeepSpeed's per-expert files
(``layer_<L>_expert_<E>_mp_rank_XX_model_states.pt``) and reads back only the experts a
rank holds. The generic checkpoint code (:mod:`.engine_checkpoint`) does not know such
features: it passes the module state dict through every registered part, and each
feature registers its part when its package is imported (``deepspeed.moe`` does at
import, before any model with MoE layers can exist).

A part is two functions:

* ``split(engine, writer, module_sd) -> module_sd``: on save, on every rank, write the
  feature's own files through ``writer`` (so they are committed atomically with the rest)
  and return the state dict without the entries they hold;
* ``merge(engine, reader, module_sd) -> module_sd``: on load, return the state dict with
  the feature's entries for this rank read back from ``reader``.
Both return ``module_sd`` unchanged when the model does not use the feature.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple


class ModulePart(NamedTuple):
    name: str
    split: Callable  # (engine, writer, module_sd) -> module_sd
    merge: Callable  # (engine, reader, module_sd) -> module_sd


_PARTS: Dict[str, ModulePart] = {}


def register_module_part(name: str, split: Callable, merge: Callable) -> None:
    """Register (or replace, by ``name``) a feature's module-state part."""
    if not (callable(split) and callable(merge)):
        raise TypeError(f"register_module_part({name!r}): split and merge must be callables")
    _PARTS[name] = ModulePart(name, split, merge)


def registered_module_parts():
    """The registered parts' names, in registration order."""
    return list(_PARTS)


def split_module_state(engine, writer, module_sd: dict) -> dict:
    """Every registered part writes its files; returns what stays in the model-states file."""
    for part in _PARTS.values():
        module_sd = part.split(engine, writer, module_sd)
    return module_sd


def merge_module_state(engine, reader, module_sd: dict) -> dict:
    """``module_sd`` from the model-states file plus every registered part's entries."""
    for part in _PARTS.values():
        module_sd = part.merge(engine, reader, module_sd)
    return module_sd
