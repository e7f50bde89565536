"""Model-based search: measure a few random configurations, fit a cost model to them, and
run next the unmeasured configuration the model predicts best (with some random
exploration so a poor early fit cannot trap the search)."""
from __future__ import annotations

import random
from typing import List, Optional

import numpy as np

from ..constants import LOWER_IS_BETTER
from ..utils import get_tuning_keys, get_val_by_key
from .base_tuner import BaseTuner
from .cost_model import FeatureEncoder, LinearCostModel, values_per_key

INIT_NUM = 2                  # random configurations before the first fit (DeepSpeed's INIT_NUM)
RANDOM_EXPLORATION_RATIO = 0.2


class ModelBasedTuner(BaseTuner):
    """``tuning_space``: the space the experiments were expanded from (names the features)."""

    def __init__(self, exps: List[dict], resource_manager, metric, tuning_space: dict,
                 seed: Optional[int] = 0, init_num: int = INIT_NUM,
                 random_exploration_ratio: float = RANDOM_EXPLORATION_RATIO):
        super().__init__(exps, resource_manager, metric)
        self.keys = [k for k in get_tuning_keys(tuning_space)]
        self._rng = random.Random(seed)
        self.init_num = init_num
        self.random_exploration_ratio = random_exploration_ratio
        values = [{k: get_val_by_key(e["ds_config"], k) for k in self.keys} for e in self.all_exps]
        self.encoder = FeatureEncoder(self.keys, values_per_key(values, self.keys))
        self.features = {e["name"]: self.encoder.encode(v) for e, v in zip(self.all_exps, values)}
        self.measured_X: List[np.ndarray] = []
        self.measured_y: List[float] = []
        self.model = LinearCostModel()

    def _pop_random(self) -> dict:
        return self.all_exps.pop(self._rng.randrange(len(self.all_exps)))

    def next_batch(self, sample_size: int) -> List[dict]:
        batch = []
        for _ in range(min(sample_size, len(self.all_exps))):
            explore = (len(self.measured_y) < self.init_num or not self.keys
                       or self._rng.random() < self.random_exploration_ratio)
            if explore:
                batch.append(self._pop_random())
                continue
            self.model.fit(np.stack(self.measured_X), self.measured_y)
            pred = self.model.predict(np.stack([self.features[e["name"]] for e in self.all_exps]))
            best = int(np.argmin(pred) if self.metric in LOWER_IS_BETTER else np.argmax(pred))
            batch.append(self.all_exps.pop(best))
        return batch

    def update(self, finished: List[tuple]) -> None:
        for exp, val in finished:
            if val is not None and exp["name"] in self.features:
                self.measured_X.append(self.features[exp["name"]])
                self.measured_y.append(float(val))
