"""The autotuner (``deepspeed --autotuning tune|run``): finds the fastest ZeRO stage,
micro-batch size and ZeRO knobs that fit, by short measured runs of the user's script.

Parts:

* ``autotuner.Autotuner`` - the search: model info, memory pruning, micro-batch sizes,
  knobs; writes ``ds_config_optimal.json``, ``cmd_optimal.txt`` and ``summary.txt``;
* ``config.DeepSpeedAutotuningConfig`` - the ``autotuning`` section (typed model in
  ``deepspeed/config/extra_sections.py``);
* ``scheduler.ResourceManager`` - runs each experiment through the launcher, with a time
  limit, and records it (``results_dir/<experiment>/``);
* ``tuner`` - ``GridSearchTuner``, ``RandomTuner``, ``ModelBasedTuner`` (cost model in
  ``tuner/cost_model.py``);
* ``engine_hook`` - inside an experiment, the engine feature that measures the steps
  between ``start_profile_step`` and ``end_profile_step``, writes the metric file and
  stops the run (registered with ``runtime/engine_features.py``);
* ``utils``, ``constants``.
"""
from . import engine_hook  # noqa: F401  (registers the engine feature)
from .autotuner import Autotuner, run_autotuning  # noqa: F401
from .config import DeepSpeedAutotuningConfig  # noqa: F401

__all__ = ["Autotuner", "DeepSpeedAutotuningConfig", "run_autotuning"]
