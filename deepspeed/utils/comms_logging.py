"""``deepspeed.utils.comms_logging``: DeepSpeed's import path for the communication logger.
The code lives in :mod:`deepspeed.comm.comms_logging`."""
from ..comm.comms_logging import CommsLogger, bandwidths_gbps, convert_size  # noqa: F401

__all__ = ["CommsLogger", "bandwidths_gbps", "convert_size"]
