"""``FusedAdam``: Adam / AdamW over PyTorch's multi-tensor fused kernels.

The update is the one ``torch.optim.Adam`` (L2 mode, ``adam_w_mode=False``) and
``torch.optim.AdamW`` (decoupled weight decay, ``adam_w_mode=True``) apply, plus
DeepSpeed's ``bias_correction`` switch:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)      bc = 1 - beta**step
                                                             (bc = 1 without bias correction)

Weight decay is either added to the gradient (``g += wd * p``, Adam/L2) or applied
to the parameter before the update (``p *= 1 - lr * wd``, AdamW).

The heavy lifting is one call to ``torch._fused_adam_`` / ``torch._fused_adamw_``
per (device, dtype) bucket of a parameter group: a single pass over memory that
reads p, g, m, v and writes p, m, v (28 bytes per fp32 parameter). Where that
kernel cannot be used (old torch, mixed dtypes, ``beta == 1`` without bias
correction) a ``torch._foreach_*`` implementation of the same formula runs.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch

# Without bias correction we still call the fused kernel (which always divides by
# 1 - beta**step) but hand it a step so large that beta**step underflows to exactly
# 0.0 in double precision, making both corrections exactly 1.0. Valid for beta < 1.
_NO_BIAS_CORRECTION_STEP = float(2 ** 60)

_FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")


def check_adam_hyperparams(owner: str, lr, betas, eps, weight_decay) -> None:
    """Reject invalid hyperparameters up front, naming the argument and the valid range."""
    if not isinstance(lr, (int, float, torch.Tensor)) or isinstance(lr, bool) or float(lr) < 0.0:
        raise ValueError(f"{owner}: 'lr' must be a non-negative number, got {lr!r}.")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
        raise ValueError(f"{owner}: 'betas' must be a pair of numbers in [0, 1), got {betas!r}.")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"{owner}: 'betas[{i}]' must be in [0, 1), got {b!r}.")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0.0:
        raise ValueError(f"{owner}: 'eps' must be a non-negative number, got {eps!r}.")
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0.0:
        raise ValueError(f"{owner}: 'weight_decay' must be a non-negative number, got {weight_decay!r}.")


def refuse_amsgrad(owner: str, amsgrad) -> None:
    if amsgrad:
        raise ValueError(
            f"{owner}: amsgrad=True is not supported (DeepSpeed's fused and CPU Adam kernels do not "
            f"implement it). Use 'torch_adam': true in the optimizer params to get torch.optim.Adam/AdamW "
            f"with amsgrad, or set amsgrad to false.")


def _fused_kernel_ok(p: torch.Tensor) -> bool:
    return (hasattr(torch, "_fused_adamw_") and p.device.type in _FUSED_DEVICES
            and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64))


def adam_foreach(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                 adam_w_mode, bias_correction) -> None:
    """The same update with ``torch._foreach_*`` ops (fallback path and mixed precision path).

    ``steps`` are the already-incremented per-parameter step counts (Python numbers).
    """
    if weight_decay != 0.0:
        if adam_w_mode:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if bias_correction:
        bc2_sqrt = [(1.0 - beta2 ** s) ** 0.5 for s in steps]
        step_sizes = [-lr / (1.0 - beta1 ** s) for s in steps]
        torch._foreach_div_(denom, bc2_sqrt)
    else:
        step_sizes = [-lr] * len(params)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def in_state_dtype(params, grads, state_dtype, update: Callable[[list, list], None]) -> None:
    """Run ``update(params, grads)`` in ``state_dtype``: directly when the parameters already
    have it, else on upcast copies that are written back (fp32 moments for bf16/fp16 params)."""
    grads = [g if g.dtype == state_dtype else g.to(state_dtype) for g in grads]
    if all(p.dtype == state_dtype for p in params):
        update(params, grads)
        return
    master = [p.to(state_dtype) for p in params]
    update(master, grads)
    torch._foreach_copy_(params, master)


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with DeepSpeed's ``FusedAdam`` signature, on PyTorch fused kernels.

    ``set_grad_none=True`` makes :meth:`zero_grad` drop gradients (saves memory and a
    memset), as DeepSpeed's FusedAdam does. ``amsgrad`` is refused: the DeepSpeed
    kernels never implemented it.
    """

    _owner = "FusedAdam"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        refuse_amsgrad(self._owner, amsgrad)
        check_adam_hyperparams(self._owner, lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # -- state -------------------------------------------------------------------------
    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """Moments live in the parameter's dtype (DeepSpeed's FusedAdam does the same)."""
        return p.dtype

    def _new_state_tensor(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            dtype = self._state_dtype(p)
            # A float32 scalar step, like torch.optim.Adam, so checkpoints interchange.
            # (kept on the parameter's device, where the fused kernels read it)
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = self._new_state_tensor(p, dtype)
            state["exp_avg_sq"] = self._new_state_tensor(p, dtype)
        return state

    # -- step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _buckets(self, group) -> Dict[Tuple, List[torch.Tensor]]:
        buckets: Dict[Tuple, List[torch.Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._owner} does not support sparse gradients; "
                                   f"use torch.optim.SparseAdam for sparse embeddings.")
            buckets[(p.device, p.dtype)].append(p)
        return buckets

    def _step_group(self, group) -> None:
        beta1, beta2 = group["betas"]
        for params in self._buckets(group).values():
            states = [self._init_state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            args = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                        weight_decay=float(group["weight_decay"]), bias_correction=group["bias_correction"])
            self._update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                         [s["exp_avg_sq"] for s in states], steps, **args)

    def supports_streamed_step(self) -> bool:
        """Whether :meth:`step_streamed` applies: 1-D parameters whose moments share their
        dtype (the flat fp32 masters of the mixed-precision strategies)."""
        return all(p.dim() == 1 and p.is_contiguous() and self._state_dtype(p) == p.dtype
                   for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step_streamed(self, fill_grad: Callable, staging: torch.Tensor, after_chunk: Optional[Callable] = None,
                      grad_mult: float = 1.0, params: Optional[list] = None):
        """The same update as :meth:`step`, one cache-sized chunk at a time, with gradients
        that are never materialised whole: ``fill_grad(p, lo, hi, out)`` writes the
        gradient of ``p[lo:hi]`` into ``out`` (a prefix of ``staging``), the chunk is
        updated with the gradient times ``grad_mult`` (inside the fused kernel, no extra
        pass), then ``after_chunk(p, lo, hi)`` runs while it is still in cache. Adam is
        elementwise, so the result equals one whole-tensor step. ``p.grad`` is not read.
        ``params``: step only these (by identity; default every parameter).
        """
        chunk = staging.numel()
        only = None if params is None else {id(p) for p in params}
        # the fused kernel divides the gradients by this as it reads them
        grad_scale = None if grad_mult == 1.0 else \
            torch.full((), 1.0 / grad_mult, dtype=torch.float32, device=staging.device)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hp = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                      weight_decay=float(group["weight_decay"]), bias_correction=group["bias_correction"])
            for p in group["params"]:
                n = p.numel()
                if n == 0 or (only is not None and id(p) not in only):
                    continue
                state = self._init_state(p)
                state["step"].add_(1.0)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                for lo in range(0, n, chunk):
                    hi = min(n, lo + chunk)
                    g = staging.narrow(0, 0, hi - lo)
                    fill_grad(p, lo, hi, g)
                    self._update_same_dtype([p.narrow(0, lo, hi - lo)], [g], [m.narrow(0, lo, hi - lo)],
                                            [v.narrow(0, lo, hi - lo)], [state["step"]], grad_scale=grad_scale,
                                            **hp)
                    if after_chunk is not None:
                        after_chunk(p, lo, hi)

    def _update(self, params, grads, exp_avgs, exp_avg_sqs, steps, **hp) -> None:
        """One bucket of same-device, same-dtype parameters; moments may be wider (fp32)."""
        in_state_dtype(params, grads, exp_avgs[0].dtype,
                       lambda ps, gs: self._update_same_dtype(ps, gs, exp_avgs, exp_avg_sqs, steps, **hp))

    def _update_same_dtype(self, params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                           weight_decay, bias_correction, grad_scale: Optional[torch.Tensor] = None) -> None:
        """``grad_scale`` (a scalar tensor): the gradients are used divided by it, without
        being modified."""
        device = params[0].device
        if _fused_kernel_ok(params[0]) and (bias_correction or max(beta1, beta2) < 1.0):
            if bias_correction:
                kernel_steps = [s if s.device == device else s.to(device) for s in steps]
            else:
                fake = torch.full((), _NO_BIAS_CORRECTION_STEP, dtype=torch.float32, device=device)
                kernel_steps = [fake] * len(params)
            kernel = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
            kernel(params, grads, exp_avgs, exp_avg_sqs, [], kernel_steps, lr=lr, beta1=beta1, beta2=beta2,
                   weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale)
            return
        if grad_scale is not None:
            grads = [g / grad_scale for g in grads]
        adam_foreach(params, grads, exp_avgs, exp_avg_sqs, [float(s) for s in steps], lr=lr, beta1=beta1,
                     beta2=beta2, eps=eps, weight_decay=weight_decay, adam_w_mode=self.adam_w_mode,
                     bias_correction=bias_correction)
