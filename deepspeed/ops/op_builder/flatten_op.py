"""The ``utils`` op (``UtilsBuilder().load()``): flatten a list of tensors into one
contiguous buffer and split it back, as DeepSpeed's C++ ``flatten``/``unflatten`` do."""
from __future__ import annotations

from typing import List, Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding ``tensors`` back to back (dtype and device of the first)."""
    if len(tensors) == 0:
        raise ValueError("flatten needs at least one tensor")
    return torch.cat([t.detach().reshape(-1) if t.requires_grad else t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (which it must have come from)."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"unflatten: the flat buffer has {flat.numel()} elements, "
                         f"the tensors need {total}")
    out, offset = [], 0
    for t in tensors:
        out.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return out


def cast_to_byte_tensor(src):
    """A ``uint8`` view of each tensor's bytes (same storage, ``numel * element_size`` elements), for
    one tensor or a list of them, as DeepSpeed's ``utils`` op ``cast_to_byte_tensor``."""
    if isinstance(src, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in src]
    if not torch.is_tensor(src):
        raise TypeError(f"cast_to_byte_tensor takes a tensor or a list of tensors, got {type(src).__name__}")
    if not src.is_contiguous():
        raise ValueError("cast_to_byte_tensor needs a contiguous tensor (its bytes are viewed in place): "
                         "call .contiguous() first")
    return src.detach().reshape(-1).view(torch.uint8)
