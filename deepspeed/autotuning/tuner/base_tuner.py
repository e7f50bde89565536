"""The loop every tuner shares: pick, run, keep the best, stop early."""
from __future__ import annotations

from typing import List, Optional

from ...utils.logging import logger
from ..constants import AUTOTUNING_METRIC_DEFAULT
from ..scheduler import metric_is_better
from ..utils import write_experiments


class BaseTuner:
    """``exps``: the experiment descriptions to choose from; ``resource_manager`` runs them."""

    def __init__(self, exps: List[dict], resource_manager, metric: Optional[str]):
        self.all_exps = list(exps)
        self.rm = resource_manager
        self.metric = metric or AUTOTUNING_METRIC_DEFAULT
        self.best_iter = 0
        self.best_exp = None
        self.best_metric_val = None
        #: every experiment this tuner ran, in order: (name, metric value or None, error or None)
        self.history: List[tuple] = []
        logger.info(f"autotuning: {type(self).__name__} over {len(self.all_exps)} configurations")

    def has_next(self) -> bool:
        return len(self.all_exps) > 0

    def next_batch(self, sample_size: int) -> List[dict]:
        raise NotImplementedError

    def update(self, finished: List[tuple]) -> None:
        """Learn from the batch just run: ``finished`` holds (exp, metric value or None)."""

    def tune(self, sample_size: int = 1, n_trials: int = 1000, early_stopping: Optional[int] = None) -> int:
        """Run up to ``n_trials`` experiments; stop when ``early_stopping`` experiments in a row
        did not beat the best. Returns the number of experiments run."""
        i = 0
        while i < n_trials and self.has_next():
            batch = self.next_batch(min(sample_size, n_trials - i))
            if not batch:
                break
            self.rm.schedule_experiments(write_experiments(batch, self.rm.exps_dir))
            self.rm.run()
            finished = []
            for exp, err in self.rm.finished_experiments.values():
                results = exp.get("results") or {}
                val = None if err else results.get(self.metric)
                finished.append((exp, val))
                self.history.append((exp["name"], val, err))
                if metric_is_better(val, self.best_metric_val, self.metric):
                    self.best_exp, self.best_metric_val, self.best_iter = exp, val, i
                i += 1
            self.update(finished)
            self.rm.clear()
            if early_stopping and i >= self.best_iter + 1 + early_stopping:
                logger.info(f"autotuning: early stop after {i} experiments: none of the last {early_stopping} "
                            f"beat the best (experiment {self.best_iter + 1})")
                break
        return i
