"""``deepspeed.zero``: the documented stage-3 API.

``deepspeed.zero.Init`` builds models already partitioned, ``GatheredParameters``
makes partitioned parameters whole inside a ``with`` block, and
``register_external_parameter`` declares a parameter a module uses but does not own.
The implementation lives in :mod:`deepspeed.runtime.zero`.
"""
from ..runtime.zero.partition_parameters import (GatheredParameters, Init, ZeroParamStatus,  # noqa: F401
                                                 register_external_parameter, unregister_external_parameter)
from ..runtime.zero.mics import MiCS_Init  # noqa: F401
from ..runtime.zero.stage3_comm import ZeroRankMismatchError  # noqa: F401

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "ZeroRankMismatchError", "MiCS_Init"]
