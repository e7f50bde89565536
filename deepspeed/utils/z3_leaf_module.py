"""ZeRO-3 leaf modules: a module whose whole subtree's parameters are gathered at once.

ZeRO stage 3 normally gathers each module's own parameters just before that module runs.
Some modules call their children in data-dependent ways (a mixture-of-experts block runs
only the experts its tokens pick), which breaks the recorded gather order and makes every
child a separate gather. Marking the block a *leaf* makes stage 3 treat the subtree as
one unit: the leaf's pre-forward hook gathers every parameter below it in one collective,
its post-forward hook releases them, and the hooks of the modules inside it do nothing.

``set_z3_leaf_modules(model, classes)`` marks every module that is an instance of one of
``classes`` (a class, subclasses included, or a class name: ``__name__`` or the fully qualified
``module.QualName``, exact class), as DeepSpeed 0.19 does; ``unset_z3_leaf_modules`` undoes it.
``set_z3_leaf_modules_by_name`` / ``_by_suffix`` pick modules by their ``named_modules()`` name.
The config's ``zero_optimization.leaf_module`` section (classes, names, name_suffixes; by default
the Mixtral/Qwen-MoE sparse blocks) is applied at ``deepspeed.initialize``
(:func:`apply_zero_leaf_module_config`). Marking may happen before or after
``deepspeed.initialize``: the stage-3 hooks consult the flags at each call.

Limits: a module inside a leaf must only run within the leaf's forward (its own hooks no
longer gather). The leaf fixes the *gather* order; stage 3 still reduces gradients in the
order they arrive, so children run in a different order on different ranks (data-dependent
routing) are not yet supported by the gradient reduction.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Type, Union

import torch

_LEAF = "_z3_leaf"
_INSIDE = "_z3_inside_leaf"   # read by stage 3's module_params_to_fetch


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when ``model`` is marked a ZeRO-3 leaf."""
    return bool(getattr(model, _LEAF, False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """True when ``param`` lies in the subtree of a ZeRO-3 leaf module."""
    return getattr(param, "ds_z3_leaf_module", None) is not None


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module of ``model`` marked a leaf."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Mark or unmark ``model`` itself (then refresh the flags of its subtree)."""
    model._z3_leaf = bool(flag)
    _refresh(model)


def _refresh(model: torch.nn.Module) -> None:
    """Recompute which modules sit inside a leaf and which parameters belong to one."""
    for m in model.modules():
        m.__dict__.pop(_INSIDE, None)
    for p in model.parameters():
        if hasattr(p, "ds_z3_leaf_module"):
            del p.ds_z3_leaf_module
    for leaf in get_z3_leaf_modules(model):
        if getattr(leaf, _INSIDE, False):
            continue  # a leaf inside another leaf: the outer one gathers for it
        for m in leaf.modules():
            if m is not leaf:
                m.__dict__[_INSIDE] = True
        for p in leaf.parameters():
            p.ds_z3_leaf_module = leaf


def _qualified_name(module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module, classes) -> bool:
    for c in classes:
        if isinstance(c, type) and isinstance(module, c):
            return True
        if isinstance(c, str) and c in (type(module).__name__, _qualified_name(module)):
            return True
    return False


def _set(model, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> List[torch.nn.Module]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"set_z3_leaf_modules: 'model' must be a torch.nn.Module, got {type(model).__name__}")
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"No modules of type {names} found in model {type(model).__name__}")
    for m in found:
        m._z3_leaf = flag
    _refresh(model)
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[Type, str]],
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Mark every module of ``model`` whose class is exactly one of ``leaf_module_classes``
    (classes or class names) a ZeRO-3 leaf; returns the marked modules. ValueError when
    none matches (unless ``raise_if_not_found=False``)."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[Type, str]],
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the unmarked modules."""
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def _set_by(model, keys, flag, raise_if_not_found, what, match):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"'model' must be a torch.nn.Module, got {type(model).__name__}")
    keys = [keys] if isinstance(keys, str) else list(keys)
    found, seen, missing = [], set(), []
    named = list(model.named_modules())
    for key in keys:
        hits = [m for name, m in named if match(name, key)]
        if not hits:
            missing.append(key)
        for m in hits:
            m._z3_leaf = bool(flag)
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules {what} {missing} found in model {type(model).__name__} "
                         f"(names as model.named_modules() gives them)")
    _refresh(model)
    return found, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Set (or with ``flag=False`` clear) the leaf flag of the modules named exactly as in
    ``model.named_modules()``; returns ``(matched modules, names not found)``. ValueError for a
    name not found unless ``raise_if_not_found=False``."""
    return _set_by(model, module_names, flag, raise_if_not_found, "named", lambda name, key: name == key)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """As :func:`set_z3_leaf_modules_by_name` for every module whose name ends with a suffix."""
    return _set_by(model, module_name_suffixes, flag, raise_if_not_found, "matching suffixes",
                   lambda name, key: name.endswith(key))


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_cfg) -> List[torch.nn.Module]:
    """Mark the leaves ``zero_optimization.leaf_module`` selects (classes, names, name suffixes);
    nothing matching is not an error (the default classes are absent from most models), but
    entries the user set that match nothing are logged. Returns the marked modules."""
    if leaf_cfg is None:
        return []
    from ..config.sections import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
                                   DEFAULT_LEAF_MODULE_NAMES)
    marked, seen = [], set()

    def keep(mods):
        for m in mods:
            if id(m) not in seen:
                seen.add(id(m))
                marked.append(m)
    if leaf_cfg.classes:
        keep(set_z3_leaf_modules(model, leaf_cfg.classes, raise_if_not_found=False))
    unmatched = []
    if leaf_cfg.names:
        mods, missing = set_z3_leaf_modules_by_name(model, leaf_cfg.names, raise_if_not_found=False)
        keep(mods)
        unmatched += missing if leaf_cfg.names != DEFAULT_LEAF_MODULE_NAMES else []
    if leaf_cfg.name_suffixes:
        mods, missing = set_z3_leaf_modules_by_suffix(model, leaf_cfg.name_suffixes, raise_if_not_found=False)
        keep(mods)
        unmatched += missing if leaf_cfg.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES else []
    customized = (leaf_cfg.classes != DEFAULT_LEAF_MODULE_CLASSES or leaf_cfg.names != DEFAULT_LEAF_MODULE_NAMES
                  or leaf_cfg.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    if unmatched or (customized and not marked):
        from .logging import logger
        logger.warning(f"zero_optimization.leaf_module: entries matched no module of the model: "
                       f"{unmatched or 'all of them'}")
    return marked
