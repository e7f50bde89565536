"""``CurriculumScheduler``: the difficulty at each step, from DeepSpeed's pacing functions.

Schedules (``schedule_type``; parameters in ``schedule_config``):

* ``fixed_linear``: ``d(s) = min(max, q(floor(s / total_curriculum_step * (max - min) + min)))``
* ``fixed_root``:   ``d(s) = min(max, q(floor((s / total_curriculum_step) ** (1 / root_degree) * (max - min) + min)))``
* ``fixed_discrete``: ``difficulty[i]`` while ``s <= max_step[i]``; the last level afterwards
* ``custom``: ``fn(s)`` set with :meth:`set_custom_get_difficulty`
  (``engine.set_custom_curriculum_learning_schedule``)

where ``q(x) = x - x % difficulty_step`` rounds down to a multiple of ``difficulty_step``.
Once the difficulty reaches ``max_difficulty`` it stays there (``update_difficulty``
stops asking the schedule), as in DeepSpeed.
"""
from __future__ import annotations

import math

from ...utils.logging import logger
from .constants import (CURRICULUM_LEARNING_CURRENT_DIFFICULTY, CURRICULUM_LEARNING_MAX_DIFFICULTY,
                        CURRICULUM_LEARNING_MIN_DIFFICULTY, CURRICULUM_LEARNING_SCHEDULE_CONFIG,
                        CURRICULUM_LEARNING_SCHEDULE_CUSTOM, CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE,
                        CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR, CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT,
                        CURRICULUM_LEARNING_SCHEDULE_TYPE)

SCHEDULE_TYPES = (CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR, CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT,
                  CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE, CURRICULUM_LEARNING_SCHEDULE_CUSTOM)
_NEEDS = {CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR: ("total_curriculum_step", "difficulty_step"),
          CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT: ("total_curriculum_step", "difficulty_step", "root_degree"),
          CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE: ("difficulty", "max_step"),
          CURRICULUM_LEARNING_SCHEDULE_CUSTOM: ()}


def _as_dict(config) -> dict:
    if hasattr(config, "model_dump"):
        config = config.model_dump()
    return {k: v for k, v in dict(config).items() if v is not None}


class CurriculumScheduler:
    """Difficulty per step for one curriculum (a dict or a parsed config section).

    ``where`` names the config section in error messages.
    """

    def __init__(self, config, where: str = "curriculum_learning"):
        cfg = _as_dict(config)
        for key in (CURRICULUM_LEARNING_MIN_DIFFICULTY, CURRICULUM_LEARNING_MAX_DIFFICULTY,
                    CURRICULUM_LEARNING_SCHEDULE_TYPE):
            if key not in cfg:
                raise ValueError(f"{where}: curriculum learning requires '{key}'.")
        lo, hi = cfg[CURRICULUM_LEARNING_MIN_DIFFICULTY], cfg[CURRICULUM_LEARNING_MAX_DIFFICULTY]
        if lo > hi:
            raise ValueError(f"{where}: min_difficulty ({lo}) must not exceed max_difficulty ({hi}).")
        stype = cfg[CURRICULUM_LEARNING_SCHEDULE_TYPE]
        if stype not in SCHEDULE_TYPES:
            raise ValueError(f"{where}.schedule_type: {stype!r} is not one of {list(SCHEDULE_TYPES)}.")
        sched = _as_dict(cfg.get(CURRICULUM_LEARNING_SCHEDULE_CONFIG) or {})
        missing = [k for k in _NEEDS[stype] if k not in sched]
        if missing:
            raise ValueError(f"{where}.schedule_config: schedule_type '{stype}' requires {missing}.")
        if stype == CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
            if not sched["max_step"] or len(sched["difficulty"]) != len(sched["max_step"]) + 1:
                raise ValueError(f"{where}.schedule_config: 'difficulty' needs exactly one more entry than "
                                 f"'max_step' (got {len(sched['difficulty'])} and {len(sched['max_step'])}).")
        if stype in (CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR, CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT) \
                and sched["difficulty_step"] % 8 != 0:
            logger.debug(f"{where}: difficulty_step {sched['difficulty_step']} is not a multiple of 8; sequence "
                         f"lengths that are multiples of 8 use tensor cores best.")
        self.state = {
            CURRICULUM_LEARNING_MIN_DIFFICULTY: lo,
            CURRICULUM_LEARNING_MAX_DIFFICULTY: hi,
            CURRICULUM_LEARNING_CURRENT_DIFFICULTY: lo,
            CURRICULUM_LEARNING_SCHEDULE_TYPE: stype,
            CURRICULUM_LEARNING_SCHEDULE_CONFIG: sched,
        }
        self.where = where
        self.custom_get_difficulty = None

    # ---- DeepSpeed's accessors
    def get_current_difficulty(self):
        return self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty) -> None:
        self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = difficulty

    def set_custom_get_difficulty(self, schedule_function) -> None:
        if not callable(schedule_function):
            raise TypeError(f"{self.where}: the custom schedule must be a callable fn(global_step) -> difficulty, "
                            f"got {type(schedule_function).__name__}.")
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return {CURRICULUM_LEARNING_CURRENT_DIFFICULTY: self.get_current_difficulty(),
                CURRICULUM_LEARNING_MIN_DIFFICULTY: self.state[CURRICULUM_LEARNING_MIN_DIFFICULTY],
                CURRICULUM_LEARNING_MAX_DIFFICULTY: self.state[CURRICULUM_LEARNING_MAX_DIFFICULTY]}

    def load_state_dict(self, state: dict) -> None:
        self.set_current_difficulty(state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY])

    # ---- the pacing functions
    def _fixed_discrete(self, step: int):
        sc = self.state[CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        for level, last_step in zip(sc["difficulty"], sc["max_step"]):
            if step <= last_step:
                return level
        return sc["difficulty"][-1]

    def _fixed_root(self, step: int, root_degree: int):
        sc = self.state[CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        lo, hi = self.state[CURRICULUM_LEARNING_MIN_DIFFICULTY], self.state[CURRICULUM_LEARNING_MAX_DIFFICULTY]
        frac = (float(step) / sc["total_curriculum_step"]) ** (1.0 / root_degree)
        d = math.floor(frac * (hi - lo) + lo)
        d -= d % sc["difficulty_step"]
        return min(d, hi)

    def get_difficulty(self, global_steps: int):
        stype = self.state[CURRICULUM_LEARNING_SCHEDULE_TYPE]
        if stype == CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
            return self._fixed_discrete(global_steps)
        if stype == CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR:
            return self._fixed_root(global_steps, 1)
        if stype == CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT:
            return self._fixed_root(global_steps, self.state[CURRICULUM_LEARNING_SCHEDULE_CONFIG]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError(f"{self.where}: schedule_type 'custom' needs a schedule function; call "
                               f"engine.set_custom_curriculum_learning_schedule(fn) before training.")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int):
        if self.get_current_difficulty() < self.state[CURRICULUM_LEARNING_MAX_DIFFICULTY]:
            self.set_current_difficulty(self.get_difficulty(global_steps))
        return self.get_current_difficulty()
