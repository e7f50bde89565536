"""``deepspeed.monitor``: training metrics to TensorBoard, Weights & Biases, Comet and CSV.

Parts:

* :mod:`.base` - ``Monitor`` (the one-method interface: ``write_events``) and the helpers
  every backend shares (event checking, scalar conversion, the global rank).
* :mod:`.monitor` - ``MonitorMaster``, which builds every enabled backend on global rank 0
  and fans events out to them (``Monitor`` re-exported: DeepSpeed's path for it).
* one file per backend: :mod:`.tensorboard` (``TensorBoardMonitor``, through
  ``torch.utils.tensorboard``), :mod:`.wandb` (``WandbMonitor``), :mod:`.csv_monitor`
  (``csvMonitor``, one CSV file per metric), :mod:`.comet` (``CometMonitor``).
  A backend imports its package only when it is built, so a missing package is an
  error naming the ``pip install`` only for the backend that was switched on.
* :mod:`.config` - DeepSpeed's config names for the sections (the typed models
  themselves live in :mod:`deepspeed.config.monitor_sections`).

An event is a 3-tuple ``(name, value, step)``; the engine uses the global sample
count as the step (see :mod:`deepspeed.runtime.engine_monitor`).
"""
from .monitor import Monitor, MonitorMaster  # noqa: F401
from .config import DeepSpeedMonitorConfig, get_monitor_config  # noqa: F401

__all__ = ["Monitor", "MonitorMaster", "DeepSpeedMonitorConfig", "get_monitor_config"]
