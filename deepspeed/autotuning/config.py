"""The ``autotuning`` section, read from a DeepSpeed config (DeepSpeed's ``DeepSpeedAutotuningConfig``).

The typed model is :class:`deepspeed.config.extra_sections.AutotuningSection` (one model for
the engine and the autotuner); this class reads it out of a whole config dict, so a bad
value fails here, before any experiment starts, with the key and the valid values named.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..config.base import parse_section
from ..config.errors import DeepSpeedConfigError
from ..config.extra_sections import AutotuningSection
from .constants import AUTOTUNING


class DeepSpeedAutotuningConfig:
    """Every key of the ``autotuning`` section as an attribute (``enabled``, ``results_dir``,
    ``exps_dir``, ``overwrite``, ``metric``, ``start_profile_step``, ``end_profile_step``,
    ``fast``, ``num_tuning_micro_batch_sizes``, ``tuner_type``, ``tuner_early_stopping``,
    ``tuner_num_trials``, ``arg_mappings``, ``max_train_batch_size``,
    ``min/max_train_micro_batch_size_per_gpu``, ``mp_size``, ``model_info``,
    ``model_info_path``, ``metric_path``)."""

    def __init__(self, param_dict: Optional[Dict[str, Any]] = None):
        param_dict = param_dict or {}
        if not isinstance(param_dict, dict):
            raise DeepSpeedConfigError(f"the DeepSpeed config must be a JSON object, got {type(param_dict).__name__}")
        section = param_dict.get(AUTOTUNING)
        self.section: AutotuningSection = parse_section(AutotuningSection, section, AUTOTUNING)
        for name in AutotuningSection.model_fields:
            setattr(self, name, getattr(self.section, name))
        # DeepSpeed's documented default of results_dir/exps_dir is null: the default folders
        if not self.results_dir:
            self.results_dir = "autotuning_results"
        if not self.exps_dir:
            self.exps_dir = "autotuning_exps"
        if self.arg_mappings is not None:
            bad = {k: v for k, v in self.arg_mappings.items() if not str(v).strip()}
            if bad:
                raise DeepSpeedConfigError(f"autotuning.arg_mappings: each DeepSpeed key must map to a script "
                                           f"argument such as '--per_device_train_batch_size'; empty for {sorted(bad)}")

    def __repr__(self):
        return f"DeepSpeedAutotuningConfig({self.section.model_dump()})"
