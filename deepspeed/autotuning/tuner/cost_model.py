"""The model-based tuner's cost model: ridge regression on encoded configuration features.

DeepSpeed fits XGBoost to the measured configurations. Here the model is deliberately
small and dependency-free: each tuning knob becomes one feature (booleans 0/1, numbers
on a log2 scale, other values one-hot), and a ridge regression (least squares with a
small L2 penalty, closed form) is fitted to the measured metric values. With the few
dozen configurations of a ZeRO stage's space, a knob's effect on speed is roughly
monotonic, which a linear model on these features captures; the tuner's random
exploration covers the rest.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import numpy as np


class FeatureEncoder:
    """Maps the values of the tuning keys to a numeric vector."""

    def __init__(self, keys: Sequence[str], values_per_key: Dict[str, list]):
        self.keys = list(keys)
        self.columns = []   # (key, kind, extra)
        for k in self.keys:
            vals = values_per_key[k]
            if all(isinstance(v, bool) for v in vals):
                self.columns.append((k, "bool", None))
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                self.columns.append((k, "log", None))
            else:
                for v in vals:
                    self.columns.append((k, "onehot", v))

    def encode(self, values: Dict[str, object]) -> np.ndarray:
        out = []
        for k, kind, extra in self.columns:
            v = values[k]
            if kind == "bool":
                out.append(1.0 if v else 0.0)
            elif kind == "log":
                out.append(math.log2(float(v)) if v and v > 0 else 0.0)
            else:
                out.append(1.0 if v == extra else 0.0)
        return np.asarray(out, dtype=np.float64)


class LinearCostModel:
    """``fit(X, y)`` then ``predict(X)``; features are standardised before the ridge fit."""

    def __init__(self, l2: float = 1e-3):
        self.l2 = l2
        self.w = None

    def fit(self, X: np.ndarray, y: Sequence[float]) -> "LinearCostModel":
        X = np.atleast_2d(np.asarray(X, dtype=np.float64))
        y = np.asarray(y, dtype=np.float64)
        self.mu, self.sd = X.mean(axis=0), X.std(axis=0)
        self.sd[self.sd == 0] = 1.0
        self.y_mu, self.y_sd = y.mean(), (y.std() or 1.0)
        Z = np.hstack([(X - self.mu) / self.sd, np.ones((len(X), 1))])
        reg = self.l2 * np.eye(Z.shape[1])
        reg[-1, -1] = 0.0   # no penalty on the intercept
        self.w = np.linalg.solve(Z.T @ Z + reg, Z.T @ ((y - self.y_mu) / self.y_sd))
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(np.asarray(X, dtype=np.float64))
        Z = np.hstack([(X - self.mu) / self.sd, np.ones((len(X), 1))])
        return Z @ self.w * self.y_sd + self.y_mu


def values_per_key(configs: List[Dict[str, object]], keys: Sequence[str]) -> Dict[str, list]:
    out = {}
    for k in keys:
        seen = []
        for c in configs:
            if c[k] not in seen:
                seen.append(c[k])
        out[k] = seen
    return out
