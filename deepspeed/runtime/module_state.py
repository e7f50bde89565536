"""Loading a full state dict into a module, with an error that names every key involved.

Used by the strategies (``TrainingStrategy.load_module_state_dict``, which checkpoint loads
go through); it sits below them and below the checkpoint code, so a strategy does not
depend on checkpoint I/O."""
from __future__ import annotations

import torch

from .checkpoint.errors import CheckpointError


def load_module_checked(module: torch.nn.Module, sd: dict, strict: bool) -> None:
    """Load ``sd`` into ``module``; on a mismatch raise an error naming every key involved."""
    own = module.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} (checkpoint {tuple(sd[k].shape)}, model {tuple(own[k].shape)})"
              for k in own if k in sd and torch.is_tensor(sd[k]) and sd[k].shape != own[k].shape]
    if shapes or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if shapes:
            parts.append(f"shape mismatches {shapes}")
        raise CheckpointError("Checkpoint does not match the model: " + "; ".join(parts)
                              + (". Pass load_module_strict=False to load the matching keys only."
                                 if not shapes else "."))
    module.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=False)
