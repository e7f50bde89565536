"""``MonitorMaster`` (all enabled backends); ``Monitor``, the backend interface, is defined in
:mod:`.base` (which the backends import) and re-exported here, DeepSpeed's path for it."""
from __future__ import annotations

from typing import List, Sequence

from .base import Event, Monitor, _scalar, check_events, global_rank  # noqa: F401  (DeepSpeed's home of Monitor)
from .config import section_of


class MonitorMaster(Monitor):
    """Builds every enabled backend (on global rank 0 only, as DeepSpeed does) and writes
    each event list to all of them. ``monitor_config``: ``ds_config.monitor_config``, a
    :class:`~deepspeed.monitor.config.DeepSpeedMonitorConfig`, a ``DeepSpeedConfig`` or a
    raw config dict."""

    def __init__(self, monitor_config):
        super().__init__(monitor_config)
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        sections = {k: section_of(monitor_config, k) for k in ("tensorboard", "wandb", "csv_monitor", "comet")}
        self.enabled = any(s is not None and s.enabled for s in sections.values())
        if not self.enabled or global_rank() != 0:
            return
        if sections["tensorboard"] is not None and sections["tensorboard"].enabled:
            from .tensorboard import TensorBoardMonitor
            self.tb_monitor = TensorBoardMonitor(sections["tensorboard"])
        if sections["wandb"] is not None and sections["wandb"].enabled:
            from .wandb import WandbMonitor
            self.wandb_monitor = WandbMonitor(sections["wandb"])
        if sections["csv_monitor"] is not None and sections["csv_monitor"].enabled:
            from .csv_monitor import csvMonitor
            self.csv_monitor = csvMonitor(sections["csv_monitor"])
        if sections["comet"] is not None and sections["comet"].enabled:
            from .comet import CometMonitor
            self.comet_monitor = CometMonitor(sections["comet"])

    @property
    def backends(self) -> List[Monitor]:
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
                if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        if not self.enabled or global_rank() != 0:
            return
        events = [(n, _scalar(v), int(s)) for n, v, s in check_events(event_list)]
        for m in self.backends:
            m.write_events(events)

    def flush(self) -> None:
        for m in self.backends:
            m.flush()

    def close(self) -> None:
        for m in self.backends:
            m.close()
