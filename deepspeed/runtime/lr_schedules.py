"""Learning-rate schedules: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR.

Each schedule is a function of ``last_batch_iteration`` (``it``), which starts at -1
and is advanced by ``step()`` once per optimizer step (the engine calls it after each
update). The values set at construction are those for ``it = -1``, so the first update
uses the schedule's starting value. Formulas (``w`` = warmup_num_steps, ``T`` =
total_num_steps):

* LRRangeTest: ``lr = min_lr * (1 + step_rate * (it + 1) / step_size)``; with
  ``staircase`` the fraction is floored.
* OneCycle: with ``k = (it + 1) mod (first + second)``, the scale rises ``k / first``
  then falls ``(first + second - k) / second``; ``lr = min_lr + (max_lr - min_lr) * scale``
  and momentum (``betas[0]`` or SGD ``momentum``) ``= max_mom - (max_mom - min_mom) * scale``.
  A stair count ``n > 0`` floors the scale to multiples of ``1/n``. After the cycle
  (``it >= first + second``), with ``d = it - first - second + 1``:
  ``lr = min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and
  ``mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)`` (no decay when
  ``decay_step_size`` or the rate is 0).
* WarmupLR: ``lr = min_lr + (max_lr - min_lr) * gamma``; during warm-up (``it < w``)
  ``gamma = log(it + 1) / log(w)`` ('log') or ``it / w`` ('linear'), then 1.
* WarmupDecayLR: the same warm-up, then ``gamma = max(0, (T - it) / max(1, T - w))``,
  reaching 0 at ``it = T``.
* WarmupCosineLR: ``lr = base_lr * ratio``; during warm-up ``ratio = warmup_min_ratio +
  (1 - warmup_min_ratio) * gamma``; then with ``q = min(1, (it - w + 1) / max(1, T - w))``
  ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * q)) / 2``.

As in DeepSpeed, a warm-up length ``w >= 1`` is raised to at least 2 (``log(1) = 0``);
``w = 0`` means no warm-up.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Optional

import torch

from ..config.errors import DeepSpeedConfigError, did_you_mean
from ..utils import logger
# DeepSpeed's schedule names and params keys live in a leaf (lr_schedule_args reads them too);
# clients import them from here
from .lr_schedule_names import (  # noqa: F401
    LR_SCHEDULE, LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR, VALID_LR_SCHEDULES,
    WARMUP_LOG_RATE, WARMUP_LINEAR_RATE, LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE,
    LR_RANGE_TEST_STAIRCASE, EDGE_VALUE, MID_VALUE, CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT,
    CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT, DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR,
    DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE, WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS,
    WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS)

_REQUIRED = object()
# name -> {param: (kind, default)}; kinds are checked by _check_param.
_WARMUP = {"warmup_min_lr": ("lrs", 0.0), "warmup_max_lr": ("lrs_or_none", 0.001),
           "warmup_num_steps": ("nonneg_int", 1000), "warmup_type": ("warmup_type", WARMUP_LOG_RATE)}
_SPECS: Dict[str, Dict[str, tuple]] = {
    LR_RANGE_TEST: {"lr_range_test_min_lr": ("lrs", 1e-3), "lr_range_test_step_size": ("pos_number", 2000),
                    "lr_range_test_step_rate": ("nonneg", 1.0), "lr_range_test_staircase": ("bool", False)},
    ONE_CYCLE: {"cycle_min_lr": ("lrs", _REQUIRED), "cycle_max_lr": ("lrs", _REQUIRED),
                "decay_lr_rate": ("nonneg", 0.0), "cycle_first_step_size": ("pos_number", 2000),
                "cycle_second_step_size": ("nonneg_or_none", None), "cycle_first_stair_count": ("int", 0),
                "cycle_second_stair_count": ("int_or_none", None), "decay_step_size": ("nonneg", 0),
                "cycle_momentum": ("bool", True), "cycle_min_mom": ("units", 0.8), "cycle_max_mom": ("units", 0.9),
                "decay_mom_rate": ("number", 0.0)},
    # DeepSpeed 0.19: WarmupLR without warmup_max_lr warms up to each group's own lr
    WARMUP_LR: {**_WARMUP, "warmup_max_lr": ("lrs_or_none", None)},
    WARMUP_DECAY_LR: {"total_num_steps": ("pos_int", _REQUIRED), **_WARMUP},
    WARMUP_COSINE_LR: {"total_num_steps": ("pos_int", _REQUIRED), "warmup_min_ratio": ("nonneg", 0.0),
                       "warmup_num_steps": ("nonneg_int", 1000), "cos_min_ratio": ("nonneg", 1e-4),
                       "warmup_type": ("warmup_type", WARMUP_LOG_RATE)},
}
_KIND_TEXT = {"lrs": "a non-negative number or a list of them (one per parameter group)",
              "lrs_or_none": "a non-negative number, a list of them (one per parameter group), or null",
              "nonneg_int": "a non-negative integer", "pos_int": "a positive integer", "int": "an integer",
              "int_or_none": "an integer or null", "pos_number": "a positive number",
              "pos_number_or_none": "a positive number or null", "nonneg_or_none": "a non-negative number or null",
              "nonneg": "a non-negative number",
              "number": "a number", "bool": "true or false", "unit": "a number in [0, 1]",
              "units": "a number in [0, 1] or a list of them (one per parameter group)",
              "warmup_type": "'log' or 'linear'", "iteration": "an integer >= -1"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind_ok(kind: str, v) -> bool:
    if kind.endswith("_or_none"):
        return v is None or _kind_ok(kind[:-len("_or_none")], v)
    checks = {
        "lrs": lambda: (_is_num(v) and v >= 0) or (isinstance(v, (list, tuple)) and len(v) > 0
                                                   and all(_is_num(x) and x >= 0 for x in v)),
        "nonneg_int": lambda: _is_int(v) and v >= 0, "pos_int": lambda: _is_int(v) and v > 0,
        "int": lambda: _is_int(v), "pos_number": lambda: _is_num(v) and v > 0,
        "nonneg": lambda: _is_num(v) and v >= 0, "number": lambda: _is_num(v),
        "bool": lambda: isinstance(v, bool), "unit": lambda: _is_num(v) and 0 <= v <= 1,
        "units": lambda: (_is_num(v) and 0 <= v <= 1) or (isinstance(v, (list, tuple)) and len(v) > 0
                                                         and all(_is_num(x) and 0 <= x <= 1 for x in v)),
        "warmup_type": lambda: v in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE),
        "iteration": lambda: _is_int(v) and v >= -1,
    }
    return checks[kind]()


def check_scheduler_params(name: str, params: Dict[str, Any]) -> None:
    """Check ``scheduler.params`` for schedule ``name``: unknown keys, missing required
    keys and bad values raise DeepSpeedConfigError naming ``scheduler.params.<key>``."""
    spec = dict(_SPECS[name], last_batch_iteration=("iteration", -1))
    for key, value in params.items():
        if key not in spec:
            raise DeepSpeedConfigError(
                f"scheduler.params.{key} is not a parameter of scheduler '{name}'. Valid keys: "
                f"{', '.join(sorted(spec))}.{did_you_mean(key, sorted(spec))}")
        kind = spec[key][0]
        if not _kind_ok(kind, value):
            raise DeepSpeedConfigError(
                f"scheduler.params.{key} = {value!r} (scheduler '{name}'): must be {_KIND_TEXT[kind]}.")
    missing = [k for k, (_, default) in spec.items() if default is _REQUIRED and k not in params]
    if missing:
        raise DeepSpeedConfigError(f"scheduler.params.{missing[0]} is required by scheduler '{name}' "
                                   f"(required: {', '.join(missing)}).")
    if name == ONE_CYCLE:
        lo, hi = params.get("cycle_min_mom", 0.8), params.get("cycle_max_mom", 0.9)
        los, his = (list(lo) if isinstance(lo, (list, tuple)) else [lo]), (list(hi) if isinstance(hi, (list, tuple))
                                                                           else [hi])
        n = max(len(los), len(his))   # a number pairs with every group's value (lengths are checked later)
        los, his = (los * n if len(los) == 1 else los), (his * n if len(his) == 1 else his)
        if params.get("cycle_momentum", True) and any(a > b for a, b in zip(los, his)):
            raise DeepSpeedConfigError(f"scheduler.params.cycle_min_mom ({lo}) must not exceed "
                                       f"scheduler.params.cycle_max_mom ({hi}) (scheduler 'OneCycle').")


# ---------------------------------------------------------------- helpers

def get_torch_optimizer(optimizer):
    """The object whose ``param_groups`` a schedule drives: a torch optimizer, the
    ``.optimizer`` a wrapper holds, or any object exposing ``param_groups``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"LR schedule: {type(optimizer).__name__} is not a torch.optim.Optimizer "
                    f"(and wraps none); a schedule needs an optimizer with param_groups.")


def update_lr(param_groups, lrs) -> List[float]:
    """Set each group's lr (in place for tensor lrs, so captured graphs stay valid)."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(g["lr"]) for g in param_groups]


def _per_group(value, n: int, key: str, owner: str) -> List[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise DeepSpeedConfigError(f"scheduler.params.{key} ({owner}) has {len(value)} values but the "
                                       f"optimizer has {n} parameter group(s); give one value or one per group.")
        return [float(v) for v in value]
    return [float(value)] * n


class _Schedule:
    """Shared mechanics: the iteration counter, stepping, applying values, state."""

    name = ""

    def __init__(self, optimizer, params: Dict[str, Any], last_batch_iteration: int):
        check_scheduler_params(self.name, dict(params, last_batch_iteration=last_batch_iteration))
        self.optimizer = get_torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[List[float]] = None

    def _groups(self, key, value) -> List[float]:
        return _per_group(value, len(self.optimizer.param_groups), key, self.name)

    def _apply(self) -> None:
        """Write the current iteration's values into the optimizer (subclasses define get_lr)."""
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def step(self, last_batch_iteration: Optional[int] = None, batch_iteration: Optional[int] = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and set the values.
        ``batch_iteration`` is the same argument under the name LRRangeTest/OneCycle use."""
        if batch_iteration is not None:
            if last_batch_iteration is not None:
                raise TypeError(f"{self.name}.step: pass last_batch_iteration or batch_iteration, not both.")
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def get_last_lr(self) -> List[float]:
        """Learning rates set by the last ``step()`` (or by construction)."""
        if self._last_lr is None:
            raise RuntimeError(f"{self.name}.get_last_lr(): call step() first.")
        return list(self._last_lr)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore the iteration and re-apply that iteration's values to the optimizer."""
        if not isinstance(sd, dict) or not _is_int(sd.get("last_batch_iteration")):
            raise ValueError(f"{self.name}.load_state_dict: expected a dict with an integer "
                             f"'last_batch_iteration' (from state_dict()), got {sd!r}.")
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._apply()


class LRRangeTest(_Schedule):
    """Learning-rate range test: grow the lr linearly from ``lr_range_test_min_lr`` by
    ``lr_range_test_step_rate`` every ``lr_range_test_step_size`` steps (continuously,
    or in stairs with ``lr_range_test_staircase``), to find the largest usable lr."""

    name = LR_RANGE_TEST

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        super().__init__(optimizer, dict(lr_range_test_min_lr=lr_range_test_min_lr,
                                         lr_range_test_step_size=lr_range_test_step_size,
                                         lr_range_test_step_rate=lr_range_test_step_rate,
                                         lr_range_test_staircase=lr_range_test_staircase), last_batch_iteration)
        self.min_lr = self._groups("lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._apply()

    def _interval(self) -> float:
        fraction = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(fraction)) if self.staircase else fraction

    def get_lr(self) -> List[float]:
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: one triangular lr cycle between ``cycle_min_lr`` and ``cycle_max_lr``
    (momentum cycling inversely), then decay. See the module docstring for formulas.

    Momentum cycling drives ``betas[0]`` (Adam-style groups; ``betas[1]`` is kept) or
    ``momentum`` (SGD-style); with neither it is turned off with a warning.
    """

    name = ONE_CYCLE

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        params = {k: v for k, v in locals().items() if k not in ("self", "optimizer", "last_batch_iteration",
                                                                  "__class__")}
        super().__init__(optimizer, params, last_batch_iteration)
        self.first_step_size = float(cycle_first_step_size)
        # None: as long as the first half; 0 is allowed (the cycle ends at the peak)
        self.second_step_size = float(cycle_first_step_size if cycle_second_step_size is None
                                      else cycle_second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.min_lrs = self._groups("cycle_min_lr", cycle_min_lr)
        self.max_lrs = self._groups("cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.decay_step_size = decay_step_size
        # a number, or one per parameter group (DeepSpeed 0.19)
        self.min_moms = self._groups("cycle_min_mom", cycle_min_mom)
        self.max_moms = self._groups("cycle_max_mom", cycle_max_mom)
        self.min_mom, self.max_mom = self.min_moms[0], self.max_moms[0]
        self.cycle_momentum, self._mom_key = cycle_momentum, None
        if cycle_momentum:
            groups = self.optimizer.param_groups
            if all("betas" in g for g in groups):
                self._mom_key = "betas"
            elif all("momentum" in g for g in groups):
                self._mom_key = "momentum"
            else:
                logger.warning(f"OneCycle: cycle_momentum disabled; optimizer {type(self.optimizer).__name__} "
                               f"has neither 'betas' nor 'momentum' in its parameter groups.")
                self.cycle_momentum = False
        self._apply()
        if self.cycle_momentum and self.last_batch_iteration == -1:
            # DeepSpeed 0.19 starts every group at its cycle_min_mom (the first step() moves it onto the
            # cycle, near cycle_max_mom)
            self._write_moms(self.min_moms)

    def _write_moms(self, moms) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            if self._mom_key == "betas":
                group["betas"] = (mom, group["betas"][1])
            else:
                group["momentum"] = mom

    def _scale(self) -> float:
        k = (self.last_batch_iteration + 1) % self.total_size
        if k <= self.first_step_size:
            fraction, stairs = k / self.first_step_size, self.first_stair_count
        else:
            fraction, stairs = (self.total_size - k) / self.second_step_size, self.second_stair_count
        if stairs > 0:
            return math.floor(fraction * stairs + 1e-9) / stairs
        return fraction

    def _decay_interval(self, rate: float) -> float:
        if rate == 0 or self.decay_step_size == 0:
            return 0.0
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _in_cycle(self) -> bool:
        return self.last_batch_iteration < self.total_size

    def get_lr(self) -> List[float]:
        if self._in_cycle():
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(self.decay_lr_rate)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self):
        """The momentum per group for the current iteration, shaped as DeepSpeed's: a
        ``(beta1, beta2)`` tuple per group for Adam-style optimizers (DeepSpeed's OneCycle
        returns the ``betas`` it writes; ``beta2`` here is the group's own, where DeepSpeed
        substitutes 0.99), a float per group for SGD-style ``momentum``; None when off."""
        if not self.cycle_momentum:
            return None
        moms = self._mom_values()
        if self._mom_key == "betas":
            return [(m, g["betas"][1]) for m, g in zip(moms, self.optimizer.param_groups)]
        return moms

    def _mom_values(self) -> List[float]:
        if self._in_cycle():
            s = self._scale()
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(self.decay_mom_rate)
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        self._write_moms(self._mom_values())


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    ('log' or 'linear'), then hold it. ``warmup_max_lr=None`` (the default, as DeepSpeed 0.19) uses
    each parameter group's own lr."""

    name = WARMUP_LR

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        self._init_warmup(optimizer, dict(warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                                          warmup_num_steps=warmup_num_steps, warmup_type=warmup_type),
                          last_batch_iteration)
        self._apply()

    def _init_warmup(self, optimizer, params, last_batch_iteration) -> None:
        _Schedule.__init__(self, optimizer, params, last_batch_iteration)
        max_lr = params["warmup_max_lr"]
        if max_lr is None:
            max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = self._groups("warmup_min_lr", params["warmup_min_lr"])
        self.max_lrs = self._groups("warmup_max_lr", max_lr)
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = _warmup_length(params["warmup_num_steps"])
        self.warmup_type = params["warmup_type"]

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if 0 < self.warmup_num_steps and it < self.warmup_num_steps:
            return _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
        return self._after_warmup_gamma()

    def _after_warmup_gamma(self) -> float:
        return 1.0

    def get_lr(self) -> List[float]:
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


def _warmup_length(steps: int) -> int:
    return 0 if steps == 0 else max(2, steps)


def _warmup_gamma(it: int, steps: int, kind: str) -> float:
    if it < 0:
        return 0.0
    if kind == WARMUP_LOG_RATE:
        return math.log(it + 1) / math.log(steps)
    return it / steps


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay of the lr to 0 at ``total_num_steps``."""

    name = WARMUP_DECAY_LR

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        self._init_warmup(optimizer, dict(total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr,
                                          warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
                                          warmup_type=warmup_type), last_batch_iteration)
        self.total_num_steps = total_num_steps
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                           f"{self.warmup_num_steps}.")
        self._apply()

    def _after_warmup_gamma(self) -> float:
        remaining = self.total_num_steps - self.last_batch_iteration
        return min(1.0, max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Warm the lr up from ``warmup_min_ratio`` to 1 times the optimizer's lr, then follow
    a cosine down to ``cos_min_ratio`` times it at ``total_num_steps``."""

    name = WARMUP_COSINE_LR

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, dict(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                                         warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio,
                                         warmup_type=warmup_type), last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.warmup_num_steps = _warmup_length(warmup_num_steps)
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                           f"{self.warmup_num_steps}.")
        # The base lr is remembered in the group (as torch schedulers do) so a schedule
        # rebuilt over an optimizer whose lr it already changed still scales the original.
        for g in self.optimizer.param_groups:
            g.setdefault("initial_lr", float(g["lr"]))
        self.org_lrs = [float(g["initial_lr"]) for g in self.optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if 0 < self.warmup_num_steps and it < self.warmup_num_steps:
            gamma = _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


_CLASSES = {LR_RANGE_TEST: LRRangeTest, ONE_CYCLE: OneCycle, WARMUP_LR: WarmupLR, WARMUP_DECAY_LR: WarmupDecayLR,
            WARMUP_COSINE_LR: WarmupCosineLR}


# ---------------------------------------------------------------- config entry points

def _torch_schedulers() -> Dict[str, type]:
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", torch.optim.lr_scheduler._LRScheduler)
    out = {}
    for name in dir(torch.optim.lr_scheduler):
        obj = getattr(torch.optim.lr_scheduler, name)
        if isinstance(obj, type) and issubclass(obj, base) and not name.startswith("_") and obj is not base:
            out[name] = obj
    return out


def resolve_scheduler_type(type_name: Any) -> str:
    """Canonical name of a DeepSpeed schedule or a ``torch.optim.lr_scheduler`` class."""
    choices = VALID_LR_SCHEDULES + sorted(_torch_schedulers())
    if isinstance(type_name, str):
        for name in choices:
            if name.lower() == type_name.strip().lower():
                return name
    hint = did_you_mean(str(type_name), choices)
    raise DeepSpeedConfigError(f"scheduler.type {type_name!r} is not a known LR schedule. DeepSpeed schedules: "
                               f"{', '.join(VALID_LR_SCHEDULES)}; any torch.optim.lr_scheduler class also works "
                               f"({', '.join(sorted(_torch_schedulers()))}).{hint}")


def _check_torch_scheduler_params(name: str, params: Dict[str, Any]) -> None:
    sig = list(inspect.signature(_torch_schedulers()[name].__init__).parameters.values())[2:]
    keys = {p.name for p in sig if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key in params:
        if key not in keys:
            raise DeepSpeedConfigError(f"scheduler.params.{key} is not a parameter of torch.optim.lr_scheduler."
                                       f"{name}. Valid keys: {', '.join(sorted(keys))}.{did_you_mean(key, keys)}")


def validate_scheduler_config(type_name: Any, params: Any) -> str:
    """Validate the ``scheduler`` section at ``initialize`` (before an optimizer exists).
    Returns the canonical schedule name."""
    name = resolve_scheduler_type(type_name)
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise DeepSpeedConfigError(f"scheduler.params must be a dictionary, got {type(params).__name__}.")
    if name in _CLASSES:
        check_scheduler_params(name, params)
        return name
    if name == "ReduceLROnPlateau":
        raise DeepSpeedConfigError("scheduler.type 'ReduceLROnPlateau' needs a metric at every step, which the "
                                   "engine cannot supply; create it yourself and call step(metric) in your loop.")
    _check_torch_scheduler_params(name, params)
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3, momentum=0.9)
    try:
        _torch_schedulers()[name](dummy, **params)
    except (TypeError, ValueError) as e:
        raise DeepSpeedConfigError(f"scheduler '{name}' rejected scheduler.params {params!r}: {e}") from e
    return name


def build_lr_scheduler(type_name: str, params: Dict[str, Any], optimizer):
    """The schedule named by the config, driving ``optimizer``'s parameter groups."""
    name = validate_scheduler_config(type_name, params)
    params = dict(params or {})
    if name in _CLASSES:
        return _CLASSES[name](optimizer, **params)
    return _torch_schedulers()[name](get_torch_optimizer(optimizer), **params)


# DeepSpeed's command-line route to a schedule (--lr_schedule ...), kept in its own file.
from .lr_schedule_args import (add_tuning_arguments, get_config_from_args, get_lr_from_config,  # noqa: E402,F401
                               override_1cycle_params, override_lr_range_test_params, override_params,
                               override_warmupLR_params, parse_arguments)
