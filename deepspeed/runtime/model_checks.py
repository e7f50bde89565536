"""Checks on the model ``deepspeed.initialize`` is given, before anything is built.

Why: a model with no parameters (a wrapper whose layers were never registered, e.g. kept in
a plain list) or with none requiring gradients used to be accepted at every ZeRO stage and
"trained" nothing, silently. Both are refused here with what was found and the likely fix.
"""
from __future__ import annotations

import torch


def check_model_trainable(model: torch.nn.Module, model_parameters, has_optimizer: bool) -> None:
    params = list(model.parameters())
    if not params:
        buffers = sum(1 for _ in model.buffers())
        raise ValueError(
            f"deepspeed.initialize: the model ({type(model).__name__}) has no parameters"
            f"{f' (only {buffers} buffers)' if buffers else ''}, so there is nothing to train or shard. Register "
            f"its layers as attributes or in nn.ModuleList/nn.ModuleDict (a plain Python list hides them from "
            f"model.parameters()).")
    if not has_optimizer:
        return
    if model_parameters is not None:
        given = []
        for item in list(model_parameters):
            given.extend(item["params"] if isinstance(item, dict) else [item])
        given = [p for p in given if isinstance(p, torch.Tensor)]
        if not any(p.requires_grad for p in given):
            raise ValueError(
                f"deepspeed.initialize: none of the {len(given)} tensors passed as model_parameters requires a "
                f"gradient, so the optimizer would update nothing. Pass the trainable parameters "
                f"(e.g. [p for p in model.parameters() if p.requires_grad]) or unfreeze some.")
        return
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"deepspeed.initialize: all {len(params)} parameters of the model ({type(model).__name__}) are frozen "
            f"(requires_grad=False), so the optimizer would update nothing. Unfreeze the parameters to train, or "
            f"initialize without an optimizer (no 'optimizer' section and optimizer=None) for inference.")
