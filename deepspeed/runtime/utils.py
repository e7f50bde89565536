"""Small runtime helpers shared by strategies: global gradient norm and clipping."""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist


def is_model_parallel_parameter(p) -> bool:
    """Parameters split across model-parallel ranks (Megatron marks them)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def local_grad_sq_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar, computed with foreach kernels."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2.0)
    return torch.stack(norms).double().pow(2).sum()


def global_grad_norm(params: Iterable[torch.nn.Parameter], mpu=None, extra_group=None,
                     sq_norm: Optional[torch.Tensor] = None) -> float:
    """L2 norm of all gradients, across model-parallel ranks when an ``mpu`` is given.

    Parameters not split by model parallelism are counted once (on model-parallel rank 0),
    split ones on every rank. ``extra_group`` (a process group) sums partial norms across it
    (ZeRO partitions). ``sq_norm`` lets a caller pass a precomputed local sum of squares.
    Returns inf/nan when any gradient is non-finite.
    """
    if sq_norm is None:
        params = [p for p in params if p.grad is not None]
        if mpu is not None and mpu.get_model_parallel_world_size() > 1 and mpu.get_model_parallel_rank() != 0:
            params = [p for p in params if is_model_parallel_parameter(p)]
        sq_norm = local_grad_sq_norm([p.grad for p in params])
    total = sq_norm.detach().clone().double().reshape(1)
    if dist.is_available() and dist.is_initialized():
        if mpu is not None and mpu.get_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=mpu.get_model_parallel_group())
        if extra_group is not None and dist.get_world_size(extra_group) > 1:
            dist.all_reduce(total, group=extra_group)
    return math.sqrt(total.item()) if total.item() >= 0 else float("nan")


def clip_coef(total_norm: float, max_norm: float) -> float:
    """Multiplier that brings ``total_norm`` down to ``max_norm`` (1.0 when already below)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    c = max_norm / (total_norm + 1e-6)
    return min(c, 1.0)


def scale_grads_(grads: List[torch.Tensor], factor: float) -> None:
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)
