"""``clone_tensors_for_torch_save``: make tensors safe to ``torch.save`` one by one.

Why: ``torch.save`` writes a tensor's whole *storage*. Parameters that are views into
a flat buffer (fp16/bf16 and ZeRO keep them that way) would each drag the entire
buffer into the file. Cloning gives every tensor its own storage of its own size.
"""
from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """Recursively clone the tensors in ``item`` (dicts, lists, tuples) onto ``device``
    (``None``: where each tensor already is), each into its own compact storage; other
    values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().to(device=device if device is not None else item.device, copy=True).contiguous()
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items()) \
            if not hasattr(item, "_metadata") else _with_metadata(item, device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def _with_metadata(sd, device):
    out = type(sd)((k, clone_tensors_for_torch_save(v, device)) for k, v in sd.items())
    out._metadata = getattr(sd, "_metadata")
    return out
