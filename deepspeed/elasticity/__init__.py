"""Elastic training (``deepspeed.elasticity``, DeepSpeed's path and names).

Parts:
  * ``constants.py``  the ``elasticity`` config keys, their defaults, ``DEEPSPEED_ELASTICITY_CONFIG``.
  * ``config.py``     the errors and :class:`ElasticityConfig` (the checked section).
  * ``elasticity.py`` the batch-size search (v0.1, v0.2): :func:`compute_elastic_config`,
                      :func:`elasticity_enabled`, :func:`ensure_immutable_elastic_config`.
  * ``batch_sizes.py`` plugs the search into config batch-size resolution (registered on import).
  * ``elastic_agent.py`` :class:`DSElasticAgent`, a ``torch.distributed.elastic`` agent that adds
                      the launcher's environment to every worker (``deepspeed --elastic_training``).
"""
from .config import (ElasticityConfig, ElasticityConfigError, ElasticityError,  # noqa: F401
                     ElasticityIncompatibleWorldSize)
from .constants import ELASTICITY, ENABLED, ENABLED_DEFAULT  # noqa: F401
from .elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config  # noqa: F401
from .utils import is_torch_elastic_compatible  # noqa: F401
from . import batch_sizes as _batch_sizes  # noqa: F401,E402  (registers the config hook)


def __getattr__(name):
    # DSElasticAgent pulls in torch.distributed.elastic's agent: loaded on first use only.
    if name == "DSElasticAgent" and is_torch_elastic_compatible():
        from .elastic_agent import DSElasticAgent
        return DSElasticAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
