"""DeepSpeed 0.19's top-level ``log_level`` key (the DeepSpeed logger's level, set when the engine
is built), the ``deepspeed.runtime.config`` getters for it and ``gradient_clipping``, and
``engine._config``."""
import logging

import pytest
import torch

import deepspeed
from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.runtime.config import get_gradient_clipping, get_log_level
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT
from deepspeed.utils.logging import logger


def _engine(**extra):
    cfg = {"train_batch_size": 1, "steps_per_print": 0, **extra}
    return deepspeed.initialize(model=torch.nn.Linear(2, 2), config=cfg)[0]


def test_getters_read_the_dict_with_deepspeeds_defaults():
    assert get_gradient_clipping({}) == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is None and LOG_LEVEL_DEFAULT is None
    assert get_log_level({"log_level": "ERROR"}) == "ERROR"


def test_log_level_sets_the_logger_and_bad_names_are_refused():
    saved = (logger.level, [h.level for h in logger.handlers])
    try:
        logger.setLevel(logging.DEBUG)
        eng = _engine(log_level="ERROR")
        assert eng.log_level() == "ERROR" and logger.getEffectiveLevel() == logging.ERROR
        assert eng._config is eng.config_obj and eng.gradient_clipping() == 1.0
        logger.setLevel(logging.WARNING)
        eng = _engine()
        assert eng.log_level() is None and logger.getEffectiveLevel() == logging.WARNING
        with pytest.raises(DeepSpeedConfigError, match="log_level must be one of DEBUG, INFO"):
            _engine(log_level="loud")
    finally:
        logger.setLevel(saved[0])
        for h, lv in zip(logger.handlers, saved[1]):
            h.setLevel(lv)
