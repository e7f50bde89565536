"""0/1 Adam (Lu et al. 2022, arXiv:2202.06009) on torch.distributed.

Two mechanisms on top of 1-bit compression:

* *adaptive variance freezing* (steps up to ``var_freeze_step``): the variance is updated
  only on steps ``t`` with ``t % var_interval == 0``; on those the training strategy
  averages the gradients in full precision. On every other step the gradient is averaged
  by the 1-bit compressed all-reduce and only the momentum moves. ``var_interval`` starts
  at 1 and doubles after every ``var_update_scaler`` variance updates.
* *local steps* (after ``var_freeze_step``): ranks update with their local gradient and
  communicate only every ``local_step_interval`` steps, then averaging (in 1 bit) the
  accumulated parameter change and rebuilding the momentum from it. Steps in between use no
  collective at all. The interval starts at 1 and doubles every ``local_step_scaler`` steps,
  up to ``local_step_clipper``.

The counters are a function of the step (recomputed on load); the momentum accumulator
and, between synchronisations, the parameters themselves differ per rank and are saved in
the rank's own checkpoint file. As in DeepSpeed, the error buffers are zeroed when the
local-step phase starts. Deviation: DeepSpeed's first ``step()`` only allocates buffers;
here every step updates, and ``bias_correction`` (default True) is applied with the count
of variance updates (``false``: DeepSpeed's update).
"""
from __future__ import annotations

import torch

from .base import OnebitOptimizerBase


class ZeroOneAdam(OnebitOptimizerBase):
    who = "0/1 Adam (optimizer.type 'ZeroOneAdam')"

    def __init__(self, params, deepspeed=None, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0., max_grad_norm=0., var_freeze_step=100000,
                 var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16, amsgrad=False,
                 cuda_aware=False, comm_backend_name=None, group=None):
        if amsgrad:
            raise ValueError("0/1 Adam does not support the AMSGrad variant (optimizer.params.amsgrad).")
        for k, v, lo in (("var_freeze_step", var_freeze_step, 0), ("var_update_scaler", var_update_scaler, 1),
                         ("local_step_scaler", local_step_scaler, 1), ("local_step_clipper", local_step_clipper, 1)):
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise ValueError(f"optimizer.params.{k} must be an integer >= {lo}, got {v!r}.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self._reset_counters()
        self.momentum_accumulator = {}     # key -> accumulated parameter change since the last sync
        self.lrs = {}                      # group index -> sum of step sizes since the last sync

    def _reset_counters(self):
        self.global_step = 0
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.freeze_key = False

    def _advance_counters(self, step: int) -> None:
        """The schedule after step ``step`` (1-based): DeepSpeed's counter rules."""
        if not self.freeze_key:
            if step % self.var_interval == 0:
                self.var_updates += 1
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
        self.global_step = step
        if not self.freeze_key and step > self.var_freeze_step:
            self.freeze_key = True
            self.reset_errors()            # DeepSpeed re-initialises the error buffers here

    @property
    def gradient_allreduce_needed(self) -> bool:
        return not self.freeze_key and (self.global_step + 1) % self.var_interval == 0

    @property
    def communicates_next_step(self) -> bool:
        """Whether the next step uses any collective (False on 0/1 Adam's local steps)."""
        if not self.freeze_key:
            return True
        return (self.global_step + 1) % self.local_step_interval == 0

    def _phase_from_step(self) -> None:
        target = self._first_step()
        self._reset_counters()
        for t in range(1, target + 1):
            self._advance_counters(t)

    def _extra_state(self) -> dict:
        return {"lrs": {str(k): v for k, v in self.lrs.items()}}

    def _load_extra_state(self, extra: dict) -> None:
        self.lrs = {int(k): float(v) for k, v in extra.get("lrs", {}).items()}

    def _rank_tensors(self) -> dict:
        out = {f"acc.{k}": v for k, v in self.momentum_accumulator.items()}
        if self.freeze_key and any(self.lrs.values()):   # between syncs parameters and momenta differ per rank
            out.update({f"param.{k}": p.detach() for k, _, p in self._param_keys()})
            out.update({f"exp_avg.{k}": self.state[p]["exp_avg"] for k, _, p in self._param_keys()
                        if "exp_avg" in self.state.get(p, {})})
        return out

    def _load_rank_tensors(self, tensors: dict) -> None:
        self.momentum_accumulator = {k[4:]: v.clone() for k, v in tensors.items() if k.startswith("acc.")}
        if not self.momentum_accumulator:
            self.lrs = {}   # nothing accumulated since the last sync (or another world size): start afresh
        with torch.no_grad():
            for k, _, p in self._param_keys():
                if f"param.{k}" in tensors:
                    p.copy_(tensors[f"param.{k}"])
                if f"exp_avg.{k}" in tensors:
                    self.state[p]["exp_avg"].copy_(tensors[f"exp_avg.{k}"])

    def _denom(self, group, exp_avg_sq, bc2):
        if self.eps_mode == 0:
            return (exp_avg_sq / bc2).add_(group["eps"]).sqrt_()
        return (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(group["eps"])

    def _step_group(self, gi, group, live, step, full, sync, var_updates, lrs):
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** max(var_updates, 1)
        else:
            bc1 = bc2 = 1.0
        states = []
        for _, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("0/1 Adam does not support sparse gradients.")
            state = self.state[p]
            if len(state) == 0:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = step
            states.append(state)
        if not self.freeze_key and not full:
            # gradients averaged in 1 bit (one message for the group); the variance stays
            grads = self._group_average(gi, [p.grad for _, p in live])
            for st, g1 in zip(states, grads):
                self._apply_mask(group, g1)
                st["exp_avg"].lerp_(g1, 1 - beta1)
        else:
            for (_, p), st in zip(live, states):
                if full:               # averaged by the strategy: the variance is updated too
                    st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                st["exp_avg"].lerp_(p.grad, 1 - beta1)   # phase B: the local gradient
        denoms, accs = [], []
        for (key, p), st in zip(live, states):
            denom = self._denom(group, st["exp_avg_sq"], bc2)
            update = st["exp_avg"] / denom / bc1
            if group["weight_decay"] != 0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
            if self.freeze_key:
                acc = self.momentum_accumulator.get(key)
                if acc is None:
                    acc = self.momentum_accumulator[key] = torch.zeros_like(p)
                acc.add_(update, alpha=-group["lr"])
                if sync:
                    p.sub_(acc)        # undo the local updates since the last sync ...
                    acc.mul_(denom)    # ... and average the momentum they amount to instead
                    denoms.append(denom)
                    accs.append(acc)
        if accs:
            for (_, p), st, acc, denom, avg in zip(live, states, accs, denoms, self._group_average(gi, accs)):
                self._apply_mask(group, avg)
                # the step-size-weighted mean of the ranks' momenta over the interval
                st["exp_avg"].copy_(avg).div_(-lrs[gi])
                p.add_(avg / denom)
                acc.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        full = not self.freeze_key and step % self.var_interval == 0   # grads averaged by the strategy
        sync = self.freeze_key and step % self.local_step_interval == 0
        var_updates = self.var_updates + (1 if full else 0)
        lrs = {}
        if self.freeze_key:
            for gi, g in enumerate(self.param_groups):
                bc1 = (1 - g["betas"][0] ** step) if g["bias_correction"] else 1.0
                lrs[gi] = self.lrs.get(gi, 0.0) + g["lr"] / bc1
        for gi, group in enumerate(self.param_groups):
            live = [(f"{gi}.{pi}", p) for pi, p in enumerate(group["params"]) if p.grad is not None]
            if live:
                self._step_group(gi, group, live, step, full, sync, var_updates, lrs)
        if self.freeze_key:
            self.lrs = {} if sync else lrs
        self._advance_counters(step)
        return loss
