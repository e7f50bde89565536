"""Search strategies over one tuning space (DeepSpeed's ``deepspeed.autotuning.tuner``).

* :class:`GridSearchTuner` - every configuration, in order;
* :class:`RandomTuner` - configurations in a random order (seeded);
* :class:`ModelBasedTuner` - a few random configurations, then the one a cost model
  fitted to the measured ones predicts best (``cost_model.LinearCostModel``).

All share :class:`BaseTuner.tune`: run a batch, keep the best by the metric, stop after
``n_trials`` experiments or ``early_stopping`` experiments without improvement.
"""
from .base_tuner import BaseTuner
from .index_based_tuner import GridSearchTuner, RandomTuner
from .model_based_tuner import ModelBasedTuner

__all__ = ["BaseTuner", "GridSearchTuner", "RandomTuner", "ModelBasedTuner"]
