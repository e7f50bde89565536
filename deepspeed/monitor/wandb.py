"""``WandbMonitor``: events logged through ``wandb`` with the sample count as the step.

``team``/``group``/``project`` map to ``wandb.init(entity=, group=, project=)``. With
no W&B account configured (no ``WANDB_API_KEY``, no ``wandb login``) and no
``WANDB_MODE`` set, the run is written offline (``wandb sync`` uploads it later), so
training never waits on a login prompt or the network.
"""
from __future__ import annotations

import os

from ..utils.logging import logger
from .config import section_of
from .base import Monitor, _scalar, check_events, global_rank


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc) as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


class WandbMonitor(Monitor):
    def __init__(self, wandb_config):
        section = section_of(wandb_config, "wandb")
        super().__init__(section)
        self.enabled = section.enabled
        self.team, self.group, self.project = section.team, section.group, section.project
        self.run = None
        if not (self.enabled and global_rank() == 0):
            return
        try:
            import wandb
        except ImportError as e:
            raise ImportError("The 'wandb' monitor needs the wandb package: pip install wandb") from e
        mode = os.environ.get("WANDB_MODE")
        if mode is None and not _has_credentials():
            mode = "offline"
            logger.info("wandb: no W&B credentials found; writing the run offline (upload later with `wandb sync`).")
        self.run = wandb.init(project=self.project, group=self.group, entity=self.team, mode=mode)

    def write_events(self, event_list):
        if self.run is None:
            return
        for name, value, step in check_events(event_list):
            self.run.log({name: _scalar(value)}, step=int(step))

    def close(self):
        if self.run is not None:
            self.run.finish()
            self.run = None
