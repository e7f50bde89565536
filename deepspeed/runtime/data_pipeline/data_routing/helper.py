"""``convert_to_random_ltd`` and the state-dict helpers of DeepSpeed's random-LTD."""
from __future__ import annotations

from collections import OrderedDict

from .basic_layer import RandomLayerTokenDrop


def _set_submodule(root, name: str, module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)


def convert_to_random_ltd(model, convert_type):
    """Wrap every ``convert_type`` layer of ``model`` (an engine or a module) in
    :class:`RandomLayerTokenDrop`, then hand the schedule to the layers the config's
    ``random_ltd_layer_id`` lists (``model.random_ltd_initialize()``; an engine does it).
    The layers are numbered in module order from 0."""
    inner = model.module if hasattr(model, "module") else model
    names = [n for n, m in inner.named_modules() if isinstance(m, convert_type) and n]
    if not names:
        raise ValueError(f"convert_to_random_ltd: the model has no {convert_type.__name__} layer to convert.")
    for n in names:
        _set_submodule(inner, n, RandomLayerTokenDrop(inner.get_submodule(n)))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict):
    """The state dict with the wrapper's ``.random_ltd_layer`` level removed from the keys."""
    out = OrderedDict()
    for key, value in state_dict.items():
        out["".join(key.split(".random_ltd_layer")) if ".random_ltd_layer" in key else key] = value
    return out


def save_without_random_ltd(model):
    inner = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(inner.state_dict())
