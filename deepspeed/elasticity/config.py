"""The elasticity errors and :class:`ElasticityConfig`, the checked ``elasticity`` section.

``ElasticityConfig`` reads a plain dict (the section alone), as DeepSpeed's does: a
scheduler can call :func:`~deepspeed.elasticity.compute_elastic_config` on a JSON file
without building a whole DeepSpeed config. Every rule raises
:class:`ElasticityConfigError` naming the key, the value given and what is valid.
"""
from __future__ import annotations

import json

from .constants import (ENABLED, ENABLED_DEFAULT, IGNORE_NON_ELASTIC_BATCH_INFO,
                        IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT, MAX_ACCEPTABLE_BATCH_SIZE,
                        MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT, MAX_GPUS, MAX_GPUS_DEFAULT, MICRO_BATCHES,
                        MICRO_BATCHES_DEFAULT, MIN_GPUS, MIN_GPUS_DEFAULT, MIN_TIME, MIN_TIME_DEFAULT,
                        MODEL_PARALLEL_SIZE, MODEL_PARALLEL_SIZE_DEFAULT, NUM_GPUS_PER_NODE,
                        NUM_GPUS_PER_NODE_DEFAULT, PREFER_LARGE_BATCH_DOCUMENTED, PREFER_LARGER_BATCH,
                        PREFER_LARGER_BATCH_DEFAULT, VERSION, VERSION_DEFAULT)


class ElasticityError(Exception):
    """Base class of every elasticity error."""


class ElasticityConfigError(ElasticityError, ValueError):
    """The ``elasticity`` section is missing, disabled or holds an invalid value (also a
    ``ValueError``, which DeepSpeed raises for a micro batch above the maximum batch)."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The job runs at a world size the elastic config cannot serve with its batch size."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class ElasticityConfig:
    """The ``elasticity`` section, checked. Attribute names are DeepSpeed's
    (``max_acceptable_batch_size``, ``micro_batches``, ``prefer_larger_batch_size`` ...).

    When ``enabled`` is true, ``max_train_batch_size`` and ``micro_batch_sizes`` are required.
    """

    def __init__(self, param_dict: dict):
        if not isinstance(param_dict, dict):
            raise ElasticityConfigError(
                f"The 'elasticity' config must be a dict, got {type(param_dict).__name__}: {param_dict!r}")
        self.enabled = param_dict.get(ENABLED, ENABLED_DEFAULT)
        if self.enabled:
            for key in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES):
                if key not in param_dict:
                    raise ElasticityConfigError(
                        f"Elasticity config missing 'elasticity.{key}': with 'elasticity.enabled' true, "
                        f"both '{MAX_ACCEPTABLE_BATCH_SIZE}' and '{MICRO_BATCHES}' must be given.")
        self.max_acceptable_batch_size = param_dict.get(MAX_ACCEPTABLE_BATCH_SIZE, MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT)
        self.micro_batches = param_dict.get(MICRO_BATCHES, list(MICRO_BATCHES_DEFAULT))

        if not _is_int(self.max_acceptable_batch_size) or self.max_acceptable_batch_size < 1:
            raise ElasticityConfigError(
                f"'elasticity.{MAX_ACCEPTABLE_BATCH_SIZE}' must be a positive integer, "
                f"got {self.max_acceptable_batch_size!r}")
        if not isinstance(self.micro_batches, list):
            raise ElasticityConfigError(
                f"'elasticity.{MICRO_BATCHES}' must be a list of positive integers (e.g. [2, 4, 6]), "
                f"got {type(self.micro_batches).__name__}: {self.micro_batches!r}")
        if not self.micro_batches or not all(_is_int(m) and m > 0 for m in self.micro_batches):
            raise ElasticityConfigError(
                f"'elasticity.{MICRO_BATCHES}' must be a non-empty list of positive integers, "
                f"got {self.micro_batches!r}")

        self.min_gpus = param_dict.get(MIN_GPUS, MIN_GPUS_DEFAULT)
        self.max_gpus = param_dict.get(MAX_GPUS, MAX_GPUS_DEFAULT)
        if not (_is_int(self.min_gpus) and _is_int(self.max_gpus)) or self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(
                f"'elasticity.{MIN_GPUS}' and 'elasticity.{MAX_GPUS}' must be integers >= 1, "
                f"given min_gpus: {self.min_gpus!r}, max_gpus: {self.max_gpus!r}")
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(
                f"'elasticity.{MIN_GPUS}' ({self.min_gpus}) must not exceed 'elasticity.{MAX_GPUS}' "
                f"({self.max_gpus})")

        self.model_parallel_size = param_dict.get(MODEL_PARALLEL_SIZE, MODEL_PARALLEL_SIZE_DEFAULT)
        if not _is_int(self.model_parallel_size) or self.model_parallel_size < 1:
            raise ElasticityConfigError(
                f"'elasticity.{MODEL_PARALLEL_SIZE}' must be an integer >= 1, given {self.model_parallel_size!r}")
        self.num_gpus_per_node = param_dict.get(NUM_GPUS_PER_NODE, NUM_GPUS_PER_NODE_DEFAULT)
        if not _is_int(self.num_gpus_per_node) or self.num_gpus_per_node < 1:
            raise ElasticityConfigError(
                f"'elasticity.{NUM_GPUS_PER_NODE}' must be an integer >= 1, given {self.num_gpus_per_node!r}")

        self.min_time = param_dict.get(MIN_TIME, MIN_TIME_DEFAULT)
        if not isinstance(self.min_time, (int, float)) or self.min_time < 0:
            raise ElasticityConfigError(f"'elasticity.{MIN_TIME}' (minutes) must be >= 0, given {self.min_time!r}")

        self.version = param_dict.get(VERSION, VERSION_DEFAULT)
        try:
            float(self.version)
        except (TypeError, ValueError):
            raise ElasticityConfigError(
                f"'elasticity.{VERSION}' must be 0.1 or 0.2, given {self.version!r}") from None
        prefer = param_dict.get(PREFER_LARGER_BATCH,
                                param_dict.get(PREFER_LARGE_BATCH_DOCUMENTED, PREFER_LARGER_BATCH_DEFAULT))
        self.prefer_larger_batch_size = bool(prefer)
        self.ignore_non_elastic_batch_info = bool(
            param_dict.get(IGNORE_NON_ELASTIC_BATCH_INFO, IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT))

    def repr(self):
        return self.__dict__

    def __repr__(self):
        return json.dumps(self.__dict__, sort_keys=True, indent=4)
