"""DeepSpeed's command-line route to an LR schedule (``deepspeed.runtime.lr_schedules``'s
``add_tuning_arguments``, ``parse_arguments``, ``override_params``, ``get_config_from_args``,
``get_lr_from_config``): ``--lr_schedule WarmupLR --warmup_max_lr 0.01 ...`` becomes the
``scheduler`` config section ``{"type": ..., "params": {...}}`` that
:func:`deepspeed.runtime.lr_schedules.build_lr_scheduler` validates and builds.

The ``get_*`` helpers return ``(value, error_message)`` pairs, as DeepSpeed's do.
"""
from __future__ import annotations

import argparse

from . import lr_schedule_names as L

# (flag, type, default) per schedule family, DeepSpeed's flags and defaults.
_LRRT = [(L.LR_RANGE_TEST_MIN_LR, float, 0.001), (L.LR_RANGE_TEST_STEP_RATE, float, 1.0),
         (L.LR_RANGE_TEST_STEP_SIZE, int, 1000), (L.LR_RANGE_TEST_STAIRCASE, bool, False)]
_ONE_CYCLE = [(L.CYCLE_FIRST_STEP_SIZE, int, 1000), (L.CYCLE_FIRST_STAIR_COUNT, int, -1),
              (L.CYCLE_SECOND_STEP_SIZE, int, -1), (L.CYCLE_SECOND_STAIR_COUNT, int, -1),
              (L.DECAY_STEP_SIZE, int, 1000), (L.CYCLE_MIN_LR, float, 0.01), (L.CYCLE_MAX_LR, float, 0.1),
              (L.DECAY_LR_RATE, float, 0.0), (L.CYCLE_MIN_MOM, float, 0.8), (L.CYCLE_MAX_MOM, float, 0.9),
              (L.DECAY_MOM_RATE, float, 0.0)]
_WARMUP = [(L.WARMUP_MIN_LR, float, 0.0), (L.WARMUP_MAX_LR, float, 0.001), (L.WARMUP_NUM_STEPS, int, 1000),
           (L.WARMUP_TYPE, str, L.WARMUP_LOG_RATE)]


def _bool(text):
    if isinstance(text, bool):
        return text
    if str(text).lower() in ("1", "true", "yes"):
        return True
    if str(text).lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument(f"--{L.LR_SCHEDULE}", type=str, default=None,
                       help=f"LR schedule for training: one of {', '.join(L.VALID_LR_SCHEDULES)}")
    for flag, typ, default in _LRRT + _ONE_CYCLE + _WARMUP:
        group.add_argument(f"--{flag}", type=_bool if typ is bool else typ, default=default)
    return parser


def parse_arguments(args=None):
    """``(schedule args, the other command-line arguments)``."""
    parser = add_tuning_arguments(argparse.ArgumentParser())
    return parser.parse_known_args(args)


def _override(args, params: dict, flags) -> None:
    for flag, _, _ in flags:
        value = getattr(args, flag, None)
        if value is not None:
            params[flag] = value


def override_lr_range_test_params(args, params: dict) -> None:
    _override(args, params, _LRRT)


def override_1cycle_params(args, params: dict) -> None:
    _override(args, params, _ONE_CYCLE)


def override_warmupLR_params(args, params: dict) -> None:  # noqa: N802 - DeepSpeed's name
    _override(args, params, _WARMUP)


def override_params(args, params: dict) -> None:
    override_lr_range_test_params(args, params)
    override_1cycle_params(args, params)
    override_warmupLR_params(args, params)


def get_config_from_args(args):
    """``({"type": schedule, "params": {...}}, None)`` from parsed arguments, or ``(None, why)``."""
    schedule = getattr(args, L.LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{L.LR_SCHEDULE} not specified on command line"
    if schedule not in L.VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a supported LR schedule (valid: {', '.join(L.VALID_LR_SCHEDULES)})"
    config = {"type": schedule, "params": {}}
    if schedule == L.LR_RANGE_TEST:
        override_lr_range_test_params(args, config["params"])
    elif schedule == L.ONE_CYCLE:
        override_1cycle_params(args, config["params"])
    else:
        override_warmupLR_params(args, config["params"])
        if schedule in (L.WARMUP_DECAY_LR, L.WARMUP_COSINE_LR):
            return None, f"{schedule} needs {L.TOTAL_NUM_STEPS}, which has no command-line flag; set it in the config"
    return config, None


def get_lr_from_config(config):
    """The schedule's peak learning rate, or ``(None, why)``."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in L.VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    key = {L.LR_RANGE_TEST: L.LR_RANGE_TEST_MIN_LR, L.ONE_CYCLE: L.CYCLE_MAX_LR}.get(schedule, L.WARMUP_MAX_LR)
    if key not in params:
        return None, f"{key} not defined in the {schedule} params"
    return params[key], ""
