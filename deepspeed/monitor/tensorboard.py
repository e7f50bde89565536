"""``TensorBoardMonitor``: scalars through ``torch.utils.tensorboard.SummaryWriter``
into ``output_path/job_name`` (``output_path`` unset: the current directory)."""
from __future__ import annotations

import os

from .config import section_of
from .base import Monitor, _scalar, check_events, global_rank


def _log_dir(section) -> str:
    return os.path.join(section.output_path or os.getcwd(), section.job_name)


class TensorBoardMonitor(Monitor):
    def __init__(self, tensorboard_config):
        section = section_of(tensorboard_config, "tensorboard")
        super().__init__(section)
        self.enabled = section.enabled
        self.output_path = section.output_path
        self.job_name = section.job_name
        self.summary_writer = None
        if self.enabled and global_rank() == 0:
            self.get_summary_writer()

    def get_summary_writer(self, base=None):
        """The ``SummaryWriter`` (made on first call) writing under ``output_path/job_name``."""
        if self.summary_writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("The 'tensorboard' monitor needs the tensorboard package: "
                                  "pip install tensorboard") from e
            self.log_dir = _log_dir(self.monitor_config) if base is None else os.path.join(base, self.job_name)
            os.makedirs(self.log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=self.log_dir)
        return self.summary_writer

    def write_events(self, event_list, flush=True):
        if not self.enabled or self.summary_writer is None:
            return
        for name, value, step in check_events(event_list):
            self.summary_writer.add_scalar(name, _scalar(value), int(step))
        if flush:
            self.summary_writer.flush()

    def flush(self):
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self):
        if self.summary_writer is not None:
            self.summary_writer.close()
