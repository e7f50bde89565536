"""Loss scaling for fp16 (``deepspeed.runtime.fp16.loss_scaler`` re-exports these).

Dynamic scaling, as DeepSpeed documents it: the loss is multiplied by ``cur_scale``
in backward. When any gradient on any rank overflowed (the caller reduces the flag
across ranks first), the step is skipped; if hysteresis is used up the scale is
halved (never below ``min_scale``), otherwise one unit of hysteresis is consumed.
The scale doubles on a clean step when the clean steps before it since the last overflow (or
the start) are a positive multiple of ``scale_window`` (DeepSpeed 0.19's rule: with a window
of 2 and no overflow the scale doubles at the 3rd step, the 5th, ...); with
``consecutive_hysteresis`` hysteresis is refilled on every clean step. DeepSpeed's stage-0
fp16 optimizers have no hysteresis (``create_loss_scaler(..., hysteresis=False)``).

Every scaler is also DeepSpeed 0.19's ``optimizer.loss_scale_config`` (``cur_scale``,
``cur_iter``, ``dynamic_loss_scale``, ``scale_window``, ``min_loss_scale``, ...).
"""
from __future__ import annotations

import math

import torch

from ...utils.logging import logger


class LossScalerBase:
    dynamic = False
    scale_factor = None
    scale_window = None
    min_scale = None
    last_overflow_iter = None
    use_grad_scaling = False   # True for fp16 (set by create_loss_scaler)

    def __init__(self, cur_scale: float):
        self.cur_scale = float(cur_scale)
        self.cur_iter = 0

    # DeepSpeed 0.19's LossScaleConfig names
    @property
    def dynamic_loss_scale(self) -> bool:
        return self.dynamic

    @property
    def min_loss_scale(self):
        return self.min_scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale if self.cur_scale != 1.0 else loss

    def backward(self, loss, retain_graph=False):
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        """Static scaler: the scale never changes; the step count does."""
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "dynamic": self.dynamic}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = float(sd["cur_scale"])


class LossScaler(LossScalerBase):
    """A static loss scale (``fp16.loss_scale`` > 0)."""

    def __init__(self, scale: float = 1.0):
        super().__init__(scale)


class DynamicLossScaler(LossScalerBase):
    dynamic = True
    use_grad_scaling = True

    def __init__(self, init_scale: float = 2.0 ** 16, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = False, dtype=torch.float16):
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.overflows_at_min_scale = 0

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale:
                    self.overflows_at_min_scale += 1
                    if self.raise_error_at_min_scale:
                        raise RuntimeError(
                            f"fp16 gradients overflowed at the minimum loss scale {self.min_scale}; "
                            f"training cannot make progress.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            self.overflows_at_min_scale = 0
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_steps = self.cur_iter - self.last_overflow_iter - 1
            if stable_steps > 0 and stable_steps % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "dynamic": True, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis,
                "scale_factor": self.scale_factor, "scale_window": self.scale_window,
                "min_scale": self.min_scale, "delayed_shift": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = float(sd["cur_scale"])
        for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if k in sd:
                setattr(self, k, int(sd[k]))


def create_loss_scaler(fp16_section, enabled: bool, hysteresis: bool = True):
    """Build the scaler for an ``fp16`` config section (a scale of 1 when fp16 is off).
    ``hysteresis=False``: every overflow halves the scale (DeepSpeed's stage-0 FP16_Optimizer /
    FP16_UnfusedOptimizer do not read ``fp16.hysteresis``)."""
    if not enabled:
        return LossScaler(1.0)
    if fp16_section.loss_scale and fp16_section.loss_scale > 0:
        static = LossScaler(fp16_section.loss_scale)
        static.use_grad_scaling = True
        return static
    return DynamicLossScaler(init_scale=2.0 ** fp16_section.initial_scale_power,
                             scale_window=fp16_section.loss_scale_window,
                             min_scale=fp16_section.min_loss_scale,
                             delayed_shift=fp16_section.hysteresis if hysteresis else 1,
                             consecutive_hysteresis=fp16_section.consecutive_hysteresis)


def has_inf_or_nan(x: torch.Tensor) -> bool:
    s = float(x.float().sum())
    return not math.isfinite(s)


def warn_stuck_at_min_scale(scaler, overflowed_param_names) -> None:
    if getattr(scaler, "overflows_at_min_scale", 0) >= 2:
        logger.warning(
            f"fp16 loss scale is at its minimum ({scaler.min_scale}) and steps keep overflowing "
            f"({scaler.overflows_at_min_scale} in a row). Gradients overflowed in: "
            f"{', '.join(overflowed_param_names[:10]) or 'unknown'}"
            f"{' ...' if len(overflowed_param_names) > 10 else ''}. Consider bf16, a lower LR, or gradient clipping.")
