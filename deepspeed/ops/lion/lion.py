"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") on foreach kernels.

Each step, per parameter:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

Lion keeps one moment (half of Adam's optimizer state) and moves every weight by
exactly ``lr`` per step in the direction of the sign of the interpolated momentum.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..adam.fused_adam import check_adam_hyperparams, in_state_dtype


def lion_foreach(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay) -> None:
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


class FusedLion(torch.optim.Optimizer):
    """Lion with DeepSpeed's ``FusedLion`` signature; the moment has the parameter's dtype."""

    _owner = "FusedLion"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        check_adam_hyperparams(self._owner, lr, betas, 0.0, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._owner} does not support sparse gradients.")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype(p),
                                                        memory_format=torch.preserve_format)
                state["step"] += 1
                buckets.setdefault((p.device, p.dtype, state["exp_avg"].dtype), []).append(p)
            beta1, beta2 = group["betas"]
            for (_, _, sdt), params in buckets.items():
                exp_avgs = [self.state[p]["exp_avg"] for p in params]
                in_state_dtype(params, [p.grad for p in params], sdt,
                               lambda ps, gs: lion_foreach(ps, gs, exp_avgs, lr=float(group["lr"]), beta1=beta1,
                                                           beta2=beta2, weight_decay=group["weight_decay"]))
        return loss


class DeepSpeedCPULion(FusedLion):
    """Lion for CPU-resident (offloaded) parameters, DeepSpeed's ``DeepSpeedCPULion`` signature.

    ``fp32_optimizer_states=True`` keeps the moment in fp32 for bf16/fp16 parameters.
    """

    _owner = "DeepSpeedCPULion"

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay, set_grad_none=True)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.fp32_optimizer_states and p.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return p.dtype
