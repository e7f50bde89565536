"""1-bit Adam (Tang et al. 2021, arXiv:2102.02888) on torch.distributed.

Warm-up (the first ``freeze_step`` steps): the training strategy averages gradients
and this is Adam (the same update as ``torch.optim.Adam``; ``AdamW`` with weight decay).
Compressed phase: the variance ``exp_avg_sq`` is frozen; each rank folds its *local*
gradient into the momentum, and the momenta are averaged by the 1-bit compressed
all-reduce with error feedback (:mod:`deepspeed.runtime.comm.compressed`), one
compressed all-reduce per parameter group over the group's momenta laid end to end.
The strategy does no gradient all-reduce in this phase.

Deviations from DeepSpeed's class, on purpose: DeepSpeed's first ``step()`` only
allocates buffers and does not move the parameters, and it ignores
``bias_correction``; here every step updates and ``bias_correction`` (default True) is
applied (after the freeze, the variance's correction stays that of the freeze step).
``bias_correction: false`` gives DeepSpeed's update.
"""
from __future__ import annotations

import torch

from .base import OnebitOptimizerBase


class OnebitAdam(OnebitOptimizerBase):
    """1-bit Adam with DeepSpeed's signature (``deepspeed``: an object with ``mpu``, or
    None; ``group``: the data-parallel process group, an addition)."""

    who = "1-bit Adam (optimizer.type 'OneBitAdam')"

    def __init__(self, params, deepspeed=None, lr=1e-3, freeze_step=100000, bias_correction=True,
                 betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0., max_grad_norm=0.,
                 amsgrad=False, cuda_aware=False, comm_backend_name=None, group=None):
        if amsgrad:
            raise ValueError("1-bit Adam does not support the AMSGrad variant (optimizer.params.amsgrad).")
        if isinstance(freeze_step, bool) or int(freeze_step) != freeze_step or freeze_step < 1:
            raise ValueError(f"optimizer.params.freeze_step must be an integer >= 1 (the warm-up steps that "
                             f"estimate the variance the compressed phase freezes), got {freeze_step!r}.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group)
        self.freeze_step = int(freeze_step)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.adam_freeze_key = False

    @property
    def gradient_allreduce_needed(self) -> bool:
        return not self.adam_freeze_key

    def _phase_from_step(self) -> None:
        self.adam_freeze_key = self._first_step() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.adam_freeze_key
        last = 0
        for gi, group in enumerate(self.param_groups):
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            beta1, beta2 = group["betas"]
            for p in live:
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("1-bit Adam does not support sparse gradients.")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if not compressed:           # grad is already the average over ranks
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if compressed:                   # local grads: the momenta are averaged in 1 bit
                momenta = [self.state[p]["exp_avg"] for p in live]
                for m, avg in zip(momenta, self._group_average(gi, momenta)):
                    m.copy_(avg)
                    self._apply_mask(group, m)
            for p in live:
                state = self.state[p]
                last = step = state["step"]
                if group["bias_correction"]:
                    bc1 = 1 - beta1 ** step
                    bc2 = 1 - beta2 ** (step if not compressed else max(self.freeze_step, 1))
                else:
                    bc1 = bc2 = 1.0
                if group["weight_decay"] != 0:   # decoupled, as DeepSpeed's update += wd * p
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                if self.eps_mode == 0:
                    denom = (state["exp_avg_sq"] / bc2).add_(group["eps"]).sqrt_()
                else:
                    denom = (state["exp_avg_sq"].sqrt() / bc2 ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)
        if not self.adam_freeze_key and last >= self.freeze_step:
            self.adam_freeze_key = True      # from the next step on: compressed momentum
        return loss
