"""Checks on the model ``deepspeed.initialize`` is given, before anything is built.

Why: a model with no parameters (a wrapper whose layers were never registered, e.g. kept in
a plain list) or with none requiring gradients used to be accepted at every ZeRO stage and
"trained" nothing, silently. Both are refused here with what was found and the likely fix.
Counts are summed over every rank (one small all-reduce, like the rest of ``initialize``
a collective): one pipeline stage may well hold only parameter-free layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _global(counts):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from .. import comm as ds_comm
        t = ds_comm.to_comm_device(torch.tensor(counts, dtype=torch.int64))
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]
    return list(counts)


def check_model_trainable(model: torch.nn.Module, model_parameters, has_optimizer: bool) -> None:
    params = list(model.parameters())
    given = None
    if model_parameters is not None:
        given = []
        for item in list(model_parameters):
            given.extend(item["params"] if isinstance(item, dict) else [item])
        given = [p for p in given if isinstance(p, torch.Tensor)]
    trainable = given if given is not None else params
    n_params, n_given, n_trainable = _global([len(params), len(trainable), sum(p.requires_grad for p in trainable)])
    if n_params == 0:
        buffers = sum(1 for _ in model.buffers())
        raise ValueError(
            f"deepspeed.initialize: the model ({type(model).__name__}) has no parameters"
            f"{f' (only {buffers} buffers)' if buffers else ''}, so there is nothing to train or shard. Register "
            f"its layers as attributes or in nn.ModuleList/nn.ModuleDict (a plain Python list hides them from "
            f"model.parameters()).")
    if not has_optimizer or n_trainable:
        return
    if given is not None:
        raise ValueError(
            f"deepspeed.initialize: none of the {n_given} tensors passed as model_parameters requires a "
            f"gradient, so the optimizer would update nothing. Pass the trainable parameters "
            f"(e.g. [p for p in model.parameters() if p.requires_grad]) or unfreeze some.")
    raise ValueError(
        f"deepspeed.initialize: all {n_params} parameters of the model ({type(model).__name__}) are frozen "
        f"(requires_grad=False), so the optimizer would update nothing. Unfreeze the parameters to train, or "
        f"initialize without an optimizer (no 'optimizer' section and optimizer=None) for inference.")
