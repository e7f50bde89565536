"""Full module state dicts of a partitioned model, gathered and loaded layer by layer.

Gathering walks the module tree and gathers one module's own parameters at a time
(a collective every rank joins), copies them to host memory on the keeping rank
only, and releases them before moving on: device memory stays at one module's
parameters whatever the model size. Loading needs no communication: every rank
reads the full tensors and keeps its own slice.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..checkpoint.errors import CheckpointError
from .partition_parameters import GatheredParameters
from .partitioned_param import ZeroParamStatus, is_zero_param, set_partition_from_full


def gather_module_state_dict(module: torch.nn.Module, keep: bool) -> "OrderedDict[str, torch.Tensor]":
    """The full state dict of ``module`` (host tensors) on ranks with ``keep``; an empty dict
    elsewhere. Collective: every rank of the parameters' group must call it."""
    sd = OrderedDict()
    copies = {}

    def visit(m, prefix):
        params = [p for p in m._parameters.values() if p is not None and is_zero_param(p) and not p.ds_persist]
        with GatheredParameters(params):
            if keep:
                local = OrderedDict()
                m._save_to_state_dict(local, prefix, False)
                full = {}
                for name, p in m._parameters.items():
                    if p is not None:
                        if id(p) not in copies:  # tied weights: one host copy, like state_dict()
                            copies[id(p)] = p.detach().to("cpu", copy=True)
                        full[prefix + name] = copies[id(p)]
                for k, v in local.items():
                    sd[k] = full[k] if k in full else (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return sd


def load_full_state_dict(module: torch.nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load full tensors into a partitioned ``module``: each rank keeps its slice."""
    expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            "Checkpoint does not match the model:"
            + (f" missing keys {missing};" if missing else "")
            + (f" unexpected keys {unexpected};" if unexpected else "")
            + " pass load_module_strict=False to load the matching keys only.")
    param_keys = set()
    for prefix, m in module.named_modules(remove_duplicate=False):
        prefix = prefix + "." if prefix else ""
        for name, p in m._parameters.items():
            if p is None:
                continue
            key = prefix + name
            param_keys.add(key)
            if key not in state_dict:
                continue
            t = state_dict[key]
            shape = tuple(p.ds_shape) if is_zero_param(p) else tuple(p.shape)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"Checkpoint does not match the model: size mismatch for '{key}': "
                                      f"checkpoint has {tuple(t.shape)}, the model has {shape}.")
            with torch.no_grad():
                if is_zero_param(p):
                    set_partition_from_full(p, t.to(p.ds_tensor.dtype))
                    if p.ds_status == ZeroParamStatus.AVAILABLE:
                        p.data.copy_(t)
                else:
                    p.data.copy_(t)
    rest = {k: v for k, v in state_dict.items() if k not in param_keys}
    if rest:
        try:
            module.load_state_dict(rest, strict=False)
        except RuntimeError as err:
            raise CheckpointError(f"Checkpoint does not match the model: {err}") from None
