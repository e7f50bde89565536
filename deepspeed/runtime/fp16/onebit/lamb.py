"""1-bit LAMB (Li et al. 2021, arXiv:2104.06069) on torch.distributed.

Warm-up (the first ``freeze_step`` steps): LAMB on averaged gradients (the update of
``deepspeed.ops.lamb.FusedLamb``), while tracking an exponential average (``coeff_beta``)
of each tensor's trust ratio (``lamb_coeff_freeze``). At ``freeze_step`` the variance is
frozen and a copy keeps being updated (``exp_avg_sq_fresh``) from gradients reconstructed
from the momentum.

Compressed phase: each rank folds its local gradient into the momentum; all momenta are
scaled to a common magnitude (``scaling_coeff``, fixed at the first compressed step),
averaged in one 1-bit compressed all-reduce over one flat buffer, and scaled back. The
trust ratio is the frozen one times a factor ``max(denom_frozen / denom_fresh)``, clamped
to ``[factor_min, factor_max]`` and to ``factor_threshold`` relative change per step.

Deviations from DeepSpeed, on purpose: DeepSpeed's first ``step()`` does not move the
parameters and its update ignores ``bias_correction``; here every step updates and
``bias_correction`` (default True) is applied as in FusedLamb (the frozen variance keeps
the freeze step's correction). ``bias_correction: false`` gives DeepSpeed's update.
"""
from __future__ import annotations

import math

import torch

from .base import OnebitOptimizerBase


class OnebitLamb(OnebitOptimizerBase):
    who = "1-bit LAMB (optimizer.type 'OneBitLamb')"

    def __init__(self, params, deepspeed=None, lr=1e-3, freeze_step=100000, bias_correction=True,
                 betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0., max_grad_norm=0.,
                 max_coeff=10.0, min_coeff=0.01, amsgrad=False, cuda_aware=False, comm_backend_name=None,
                 coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1, group=None):
        if amsgrad:
            raise ValueError("1-bit LAMB does not support the AMSGrad variant (optimizer.params.amsgrad).")
        if isinstance(freeze_step, bool) or int(freeze_step) != freeze_step or freeze_step < 1:
            raise ValueError(f"optimizer.params.freeze_step must be an integer >= 1 for 1-bit LAMB "
                             f"(the warm-up sets the trust ratios), got {freeze_step!r}.")
        if min_coeff > max_coeff:
            raise ValueError(f"optimizer.params.min_coeff ({min_coeff}) must not exceed max_coeff ({max_coeff}).")
        if factor_min > factor_max:
            raise ValueError(f"optimizer.params.factor_min ({factor_min}) must not exceed factor_max ({factor_max}).")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"optimizer.params.coeff_beta must be in [0, 1), got {coeff_beta!r}.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group)
        self.freeze_step = int(freeze_step)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_freeze_key = False
        self.coeffs = {}           # key -> {"lamb_coeff_freeze", "last_factor", "scaling_coeff"}
        self.lamb_coeffs = []

    def get_lamb_coeffs(self):
        return list(self.lamb_coeffs)

    @property
    def gradient_allreduce_needed(self) -> bool:
        return not self.lamb_freeze_key

    def _phase_from_step(self) -> None:
        self.lamb_freeze_key = self._first_step() >= self.freeze_step

    def _extra_state(self) -> dict:
        return {"coeffs": {k: dict(v) for k, v in self.coeffs.items()}}

    def _load_extra_state(self, extra: dict) -> None:
        self.coeffs = {k: dict(v) for k, v in extra.get("coeffs", {}).items()}

    def _bc(self, group, step):
        if not group["bias_correction"]:
            return 1.0, 1.0
        b1, b2 = group["betas"]
        return 1 - b1 ** step, 1 - b2 ** step

    def _denom(self, group, v, bc2):
        if self.eps_mode == 0:
            return (v / bc2).add_(group["eps"]).sqrt_()
        return (v.sqrt() / bc2 ** 0.5).add_(group["eps"])

    def _coeff(self, key) -> dict:
        return self.coeffs.setdefault(key, {"lamb_coeff_freeze": 0.0, "last_factor": 1.0})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        live = [(k, g, p) for k, g, p in self._param_keys() if p.grad is not None]
        for k, g, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("1-bit LAMB does not support sparse gradients.")
            st = self.state[p]
            if len(st) == 0:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
                st["exp_avg_sq_fresh"] = torch.zeros_like(p)
            st["step"] += 1
        if not self.lamb_freeze_key:
            self._warmup_step(live)
        else:
            self._compressed_step(live)
        if live and not self.lamb_freeze_key and self.state[live[-1][2]]["step"] >= self.freeze_step:
            self.lamb_freeze_key = True
        return loss

    def _warmup_step(self, live):
        for k, g, p in live:
            st, grad = self.state[p], p.grad
            b1, b2 = g["betas"]
            st["exp_avg"].lerp_(grad, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            if st["step"] == self.freeze_step:
                st["exp_avg_sq_fresh"].copy_(st["exp_avg_sq"])
            bc1, bc2 = self._bc(g, st["step"])
            update = st["exp_avg"] / self._denom(g, st["exp_avg_sq"], bc2)
            update.div_(bc1)
            if g["weight_decay"] != 0:
                update.add_(p, alpha=g["weight_decay"])
            w_norm, u_norm = torch.linalg.vector_norm(p).item(), torch.linalg.vector_norm(update).item()
            coeff = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            coeff = min(max(coeff, g["min_coeff"]), g["max_coeff"])
            c = self._coeff(k)
            if coeff != 1.0:
                c["lamb_coeff_freeze"] = self.coeff_beta * c["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-g["lr"] * coeff)

    def _compressed_step(self, live):
        if not live:
            return
        last = {k: self.state[p]["exp_avg"].clone() for k, _, p in live}
        if any("scaling_coeff" not in self._coeff(k) for k, _, _ in live):
            # momenta of very different magnitudes share one compression: scale them alike
            scales = {k: (torch.linalg.vector_norm(self.state[p]["exp_avg"]) / math.sqrt(p.numel())).item()
                      for k, _, p in live}
            united = sum(scales.values()) / len(scales)
            for k in scales:
                self._coeff(k)["scaling_coeff"] = united / scales[k] if scales[k] > 0 else 1.0
        for k, g, p in live:
            m = self.state[p]["exp_avg"]
            m.lerp_(p.grad, 1 - g["betas"][0]).mul_(self.coeffs[k]["scaling_coeff"])
        flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for _, _, p in live])
        flat = self._compressed_average(f"flat:{flat.numel()}", flat)   # new live set, new errors
        off = 0
        for k, g, p in live:
            st = self.state[p]
            m = st["exp_avg"]
            m.copy_(flat[off:off + p.numel()].view_as(m)).div_(self.coeffs[k]["scaling_coeff"])
            off += p.numel()
            self._apply_mask(g, m)
            b1, b2 = g["betas"]
            grad_rec = (m - last[k] * b1) / (1 - b1)
            st["exp_avg_sq_fresh"].mul_(b2).addcmul_(grad_rec, grad_rec, value=1 - b2)
            bc1, _ = self._bc(g, st["step"])
            _, bc2_frozen = self._bc(g, self.freeze_step)
            _, bc2_fresh = self._bc(g, st["step"])
            denom = self._denom(g, st["exp_avg_sq"], bc2_frozen)
            update_prelim = m / denom / bc1
            update = update_prelim + g["weight_decay"] * p if g["weight_decay"] != 0 else update_prelim
            denom_real = self._denom(g, st["exp_avg_sq_fresh"], bc2_fresh)
            factor = (denom / denom_real).max().item()
            if g["weight_decay"] != 0:
                u_norm = torch.linalg.vector_norm(update).item()
                ratio = min(1.0, torch.linalg.vector_norm(update_prelim).item() / u_norm) if u_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            c = self.coeffs[k]
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(factor, c["last_factor"] * (1.0 + self.factor_threshold))
            factor = max(factor, c["last_factor"] * (1.0 - self.factor_threshold))
            c["last_factor"] = factor
            coeff = c["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-g["lr"] * coeff)
