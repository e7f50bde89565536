"""``csvMonitor``: DeepSpeed's CSV layout, one file per metric.

``output_path/job_name/<name with '/' and ' ' as '_'>.csv``, a header row
``step,<last part of the name>`` and one ``step,value`` row per event.
"""
from __future__ import annotations

import csv
import os

from .config import section_of
from .base import Monitor, _scalar, check_events, global_rank


def csv_filename(name: str) -> str:
    return name.replace("/", "_").replace(" ", "_") + ".csv"


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's name
    def __init__(self, csv_config):
        section = section_of(csv_config, "csv_monitor")
        super().__init__(section)
        self.enabled = section.enabled
        self.output_path = section.output_path
        self.job_name = section.job_name
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self, base=None) -> str:
        log_dir = os.path.join(base or self.output_path or os.getcwd(), self.job_name)
        if self.enabled and global_rank() == 0:
            os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def write_events(self, event_list):
        if not self.enabled:
            return
        for name, value, step in check_events(event_list):
            path = os.path.join(self.log_dir, csv_filename(name))
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", name.split("/")[-1]])
                w.writerow([int(step), _scalar(value)])
