"""Small helpers of the elasticity package."""
from __future__ import annotations


def is_torch_elastic_compatible() -> bool:
    """True when this torch has ``torch.distributed.elastic`` (added in torch 1.11)."""
    try:
        import torch.distributed.elastic.agent.server  # noqa: F401
    except ImportError:
        return False
    return True
