"""``CometMonitor``: events logged to a Comet experiment through ``comet_ml``.

The section's keys map to ``comet_ml.start(api_key=, project=, workspace=,
experiment_key=, mode=, online=)`` (each passed, None included, as DeepSpeed does) and
``experiment.set_name(experiment_name)``; events are logged with
``log_metric(name, value, step=step)`` at most once per ``samples_log_interval``
samples per metric. ``comet_ml`` is optional: enabling the section without it is an
error naming ``pip install comet_ml``. (Not exercised in this repository's tests
beyond that error: ``comet_ml`` is not installed here.)
"""
from __future__ import annotations

from .config import section_of
from .base import Monitor, _scalar, check_events, global_rank


class CometMonitor(Monitor):
    def __init__(self, comet_config):
        section = section_of(comet_config, "comet")
        super().__init__(section)
        self.enabled = section.enabled
        self.samples_log_interval = section.samples_log_interval
        self._last_logged = {}
        self.experiment = None
        if not (self.enabled and global_rank() == 0):
            return
        try:
            import comet_ml
        except ImportError as e:
            raise ImportError("The 'comet' monitor (config section 'comet') needs the comet_ml package: "
                              "pip install comet_ml") from e
        # As DeepSpeed: the six keys go to start() as given (None: comet_ml's own default, from its
        # config file or COMET_* environment variables); the name is set on the experiment.
        self.experiment = comet_ml.start(**{k: getattr(section, k) for k in ("api_key", "project", "workspace",
                                                                           "experiment_key", "mode", "online")})
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)

    def write_events(self, event_list):
        if self.experiment is None:
            return
        for name, value, step in check_events(event_list):
            last = self._last_logged.get(name)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self._last_logged[name] = step
            self.experiment.log_metric(name, _scalar(value), step=int(step))

    def close(self):
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None
