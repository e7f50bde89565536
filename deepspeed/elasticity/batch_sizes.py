"""The elastic section decides the batch sizes: a provider for config batch-size resolution.

With ``elasticity.enabled``, :class:`~deepspeed.config.DeepSpeedConfig` takes
``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
``gradient_accumulation_steps`` from :func:`compute_elastic_config` at the current
data-parallel world size (``gas = batch // (micro * world_size)``), as DeepSpeed's
config does. Batch keys given outside the section are refused unless
``ignore_non_elastic_batch_info`` is true (then they are overridden, with a warning).
The scheduler's copy of the section (``$DEEPSPEED_ELASTICITY_CONFIG``) must match.
"""
from __future__ import annotations

from .._version import __version__
from ..config.ds_config import BATCH_SIZE_PROVIDERS
from ..utils.logging import logger
from .config import ElasticityConfig, ElasticityConfigError
from .constants import ELASTICITY
from .elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def elastic_batch_sizes(raw_config: dict, world_size: int):
    """``(train_batch_size, micro_batch, gradient_accumulation_steps)`` from the elastic
    section at ``world_size``, or None when elasticity is off."""
    if not elasticity_enabled(raw_config):
        return None
    logger.info("DeepSpeed elasticity support enabled")
    final_batch, valid_gpus, micro = compute_elastic_config(raw_config, __version__, world_size=world_size)
    section = raw_config[ELASTICITY]
    ensure_immutable_elastic_config(section)
    given = [k for k in BATCH_KEYS if k in raw_config]
    if given and not ElasticityConfig(section).ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"Batch parameters {given} are in the config, but elastic training is enabled and sets them itself "
            f"(they would not be used). Remove them, or set 'elasticity.ignore_non_elastic_batch_info' to true "
            f"to have them ignored.")
    gas = final_batch // (micro * world_size)
    for key, new in zip(BATCH_KEYS, (final_batch, micro, gas)):
        if key in raw_config and raw_config[key] != new:
            logger.warning(f"[Elasticity] overriding {key}: {raw_config[key]} -> {new}")
    logger.info(f"[Elasticity] valid GPU counts: {valid_gpus}")
    return final_batch, micro, gas


if elastic_batch_sizes not in BATCH_SIZE_PROVIDERS:
    BATCH_SIZE_PROVIDERS.append(elastic_batch_sizes)
