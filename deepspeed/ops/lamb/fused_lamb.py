"""``FusedLamb``: the LAMB update (You et al., 2019, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes") on PyTorch foreach kernels.

Per parameter tensor, each step:

    g  = grad * clip                      clip = min(1, max_grad_norm / (||all grads of the group|| + 1e-6))
                                          (only when max_grad_norm > 0)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    u  = (m / bc1) / (sqrt(v / bc2) + eps)        bc = 1 - beta**step, or 1 without bias correction
         (m / bc1) / sqrt(v / bc2 + eps)          with eps_inside_sqrt
    u += weight_decay * p
    r  = ||p|| / ||u||   if both norms are > 0, else 1
    r  = clamp(r, min_coeff, max_coeff)           the trust ratio ("lamb coefficient")
    p -= lr * r * u

The trust ratios of the last step are available from :meth:`FusedLamb.get_lamb_coeffs`.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..adam.fused_adam import check_adam_hyperparams


class FusedLamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed's ``FusedLamb`` signature. ``amsgrad`` is refused."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01,
                 amsgrad=False):
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True is not supported by LAMB; set amsgrad to false.")
        check_adam_hyperparams("FusedLamb", lr, betas, eps, weight_decay)
        for name, value in (("max_grad_norm", max_grad_norm), ("max_coeff", max_coeff), ("min_coeff", min_coeff)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FusedLamb: '{name}' must be a non-negative number, got {value!r}.")
        if min_coeff > max_coeff:
            raise ValueError(f"FusedLamb: 'min_coeff' ({min_coeff}) must not exceed 'max_coeff' ({max_coeff}).")
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=bool(eps_inside_sqrt), weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.lamb_coeffs: List[float] = []

    def get_lamb_coeffs(self) -> List[float]:
        """Trust ratios applied in the last step, one per updated parameter tensor."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("FusedLamb does not support sparse gradients.")
            coeffs = self._step_group(group, params)
            self.lamb_coeffs.extend(coeffs.tolist())
        return loss

    def _clipped_grads(self, group, params) -> List[torch.Tensor]:
        grads = [p.grad for p in params]
        max_norm = group["max_grad_norm"]
        if max_norm > 0:
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
            clip = (max_norm / (total + 1e-6)).clamp(max=1.0)
            grads = torch._foreach_mul(grads, clip.to(grads[0].dtype))
        return grads

    def _step_group(self, group, params) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        grads = self._clipped_grads(group, params)
        states = []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states.append(state)
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            bc1 = [1.0 - beta1 ** float(s) for s in steps]
            bc2 = [1.0 - beta2 ** float(s) for s in steps]
        else:
            bc1 = bc2 = [1.0] * len(params)
        if group["eps_inside_sqrt"]:
            denom = torch._foreach_div(exp_avg_sqs, bc2)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, [b ** 0.5 for b in bc2])
            torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        torch._foreach_div_(updates, bc1)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        w_norm = torch.stack(torch._foreach_norm(params)).float()
        u_norm = torch.stack(torch._foreach_norm(updates)).float()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        ratio = ratio.clamp(min=group["min_coeff"], max=group["max_coeff"])
        scale = (ratio * -group["lr"]).to(params[0].dtype)
        torch._foreach_mul_(updates, list(scale.unbind()))
        torch._foreach_add_(params, updates)
        return ratio
