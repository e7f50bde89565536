"""Progressive layer drop (PLD, https://arxiv.org/abs/2010.13369).

The keep probability of each layer at step ``t`` follows the paper's schedule

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar

starting at 1 and decaying to ``theta_bar`` (config ``progressive_layer_drop.theta``) at
rate ``gamma``. The engine passes ``progressive_layer_drop=True, pld_theta=theta`` to every
training forward (the model decides how to drop layers with it) and updates ``theta`` at
each accumulation boundary with the number of completed steps, before the optimizer
step, as DeepSpeed does; ``engine.get_pld_theta()`` reads it.
"""
from __future__ import annotations

import numpy as np

from ..utils.logging import log_dist
from .engine_features import EngineFeature, register_feature


class ProgressiveLayerDrop:
    """``theta``: the final keep probability (0 <= theta <= 1); ``gamma``: the decay rate."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"progressive_layer_drop.theta must be in [0, 1], got {theta}.")
        if gamma <= 0.0:
            raise ValueError(f"progressive_layer_drop.gamma must be > 0, got {gamma}.")
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_dist(f"Enabled progressive layer dropping (theta = {self.theta})", ranks=[0])

    def get_state(self) -> dict:
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        # numpy's exp, as DeepSpeed: math.exp differs from it in the last bit for some steps
        self.current_theta = float((1.0 - self.theta) * np.exp(-self.gamma * global_step) + self.theta)


class _PLDFeature(EngineFeature):
    name = "progressive_layer_drop"
    checkpoint_key = "progressive_layer_drop"

    def __init__(self, pld: ProgressiveLayerDrop):
        self.pld = pld

    def forward_kwargs(self, engine, kwargs):
        kwargs.update(self.pld.get_state())

    def on_boundary(self, engine):
        self.pld.update_state(engine.global_steps)

    def state_dict(self):
        return {"current_theta": self.pld.current_theta}

    def load_state_dict(self, state):
        self.pld.current_theta = state["current_theta"]


def _factory(engine):
    s = engine.config_obj.model.progressive_layer_drop
    if s is None or not s.enabled:
        engine.progressive_layer_drop = None
        return None
    engine.progressive_layer_drop = ProgressiveLayerDrop(theta=s.theta, gamma=s.gamma)
    return _PLDFeature(engine.progressive_layer_drop)


register_feature("progressive_layer_drop", _factory, _PLDFeature.checkpoint_key)
