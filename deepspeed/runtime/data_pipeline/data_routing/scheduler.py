"""``RandomLTDScheduler``: how many tokens the random-LTD layers keep at each step.

``fixed_linear`` (the one schedule DeepSpeed documents):
``v(s) = min(max_value, q(floor(s / require_steps * (max_value - min_value) + min_value)))``
with ``q(x) = x - x % seq_per_step``; once ``max_value`` is reached it stays.

``consumed_layer_tokens`` counts, once per step, ``global_batch_size * (v * random_ltd_layer_num
+ max_value * (total_layer_num - random_ltd_layer_num))``: the layer-tokens the model
processed, the figure random-LTD saves on.
"""
from __future__ import annotations

import math

from ..constants import (RANDOM_LTD_CONSUMED_LAYER_TOKENS, RANDOM_LTD_CURR_STEP, RANDOM_LTD_CURRENT_VALUE,
                         RANDOM_LTD_MAX_VALUE, RANDOM_LTD_MIN_VALUE)


def _as_dict(cfg):
    return cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)


class BaseScheduler:

    def __init__(self):
        self.state = {}

    def _fixed_root_get_value(self, global_steps, root_degree=1):
        sc = self.state["schedule_config"]
        lo, hi = self.state[RANDOM_LTD_MIN_VALUE], self.state[RANDOM_LTD_MAX_VALUE]
        v = math.floor((float(global_steps) / sc["require_steps"]) ** (1.0 / root_degree) * (hi - lo) + lo)
        v -= v % sc["seq_per_step"]
        return min(v, hi)

    def get_value(self, global_steps):
        if self.state["schedule_type"] == "fixed_linear":
            return self._fixed_root_get_value(global_steps, 1)
        raise ValueError(f"data_efficiency.data_routing.random_ltd.random_ltd_schedule.schedule_type: "
                         f"{self.state['schedule_type']!r} is not supported; use 'fixed_linear'.")


class RandomLTDScheduler(BaseScheduler):
    """``config``: the ``random_ltd`` section (dict or parsed) plus ``global_batch_size``."""

    def __init__(self, config):
        super().__init__()
        cfg = _as_dict(config)
        where = "data_efficiency.data_routing.random_ltd"
        self.model_layer_num = cfg["total_layer_num"]
        self.random_ltd_layer_num = cfg["random_ltd_layer_num"]
        self.config_schedule = _as_dict(cfg["random_ltd_schedule"])
        self.global_batch_size = cfg.get("global_batch_size", 1)
        lr = cfg.get("layer_token_lr_schedule") or {}
        if lr.get("enabled"):
            raise ValueError(f"{where}.layer_token_lr_schedule: the layer-token LR schedule is not available "
                             f"(DeepSpeed does not implement it either); remove it or set enabled false.")
        sched = self.config_schedule
        if sched["min_value"] > sched["max_value"]:
            raise ValueError(f"{where}.random_ltd_schedule: min_value ({sched['min_value']}) must not exceed "
                             f"max_value ({sched['max_value']}).")
        self.reset_to_init()

    def reset_to_init(self):
        s = self.config_schedule
        self.state[RANDOM_LTD_MIN_VALUE] = s["min_value"]
        self.state[RANDOM_LTD_MAX_VALUE] = s["max_value"]
        self.state[RANDOM_LTD_CURRENT_VALUE] = s["min_value"]
        self.state["schedule_config"] = _as_dict(s["schedule_config"])
        self.state["schedule_type"] = s.get("schedule_type", "fixed_linear")
        self.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS] = 0
        self.state[RANDOM_LTD_CURR_STEP] = -1

    def get_total_layer_tokens(self, train_iters):
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS]

    def get_current_seq(self):
        return self.state[RANDOM_LTD_CURRENT_VALUE]

    def set_current_seq(self, seq_length):
        self.state[RANDOM_LTD_CURRENT_VALUE] = seq_length

    def get_random_ltd_layer_num(self):
        return self.random_ltd_layer_num

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state

    def update_seq(self, global_steps):
        if self.state[RANDOM_LTD_CURRENT_VALUE] < self.state[RANDOM_LTD_MAX_VALUE]:
            self.state[RANDOM_LTD_CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != self.state[RANDOM_LTD_CURR_STEP]:
            v, hi = self.state[RANDOM_LTD_CURRENT_VALUE], self.state[RANDOM_LTD_MAX_VALUE]
            self.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS] += self.global_batch_size * (
                v * self.random_ltd_layer_num + hi * (self.model_layer_num - self.random_ltd_layer_num))
            self.state[RANDOM_LTD_CURR_STEP] = global_steps

    def state_dict(self):
        return {k: self.state[k] for k in (RANDOM_LTD_CONSUMED_LAYER_TOKENS, RANDOM_LTD_CURR_STEP,
                                           RANDOM_LTD_CURRENT_VALUE, RANDOM_LTD_MIN_VALUE, RANDOM_LTD_MAX_VALUE)}

    def load_state_dict(self, state_dict):
        for k, v in state_dict.items():
            self.state[k] = v
