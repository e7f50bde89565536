"""Tuners that walk the list of configurations: in order, or shuffled."""
from __future__ import annotations

import random
from typing import List, Optional

from .base_tuner import BaseTuner


class GridSearchTuner(BaseTuner):
    """Every configuration, in the order given."""

    def next_batch(self, sample_size: int) -> List[dict]:
        batch, self.all_exps = self.all_exps[:sample_size], self.all_exps[sample_size:]
        return batch


class RandomTuner(BaseTuner):
    """Configurations drawn without replacement in a random order (``seed`` makes it repeatable)."""

    def __init__(self, exps, resource_manager, metric, seed: Optional[int] = None):
        super().__init__(exps, resource_manager, metric)
        self._rng = random.Random(seed)

    def next_batch(self, sample_size: int) -> List[dict]:
        batch = []
        for _ in range(min(sample_size, len(self.all_exps))):
            batch.append(self.all_exps.pop(self._rng.randrange(len(self.all_exps))))
        return batch
