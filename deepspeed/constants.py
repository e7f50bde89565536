"""``deepspeed.constants``: process-group defaults DeepSpeed exposes at the package level."""
from __future__ import annotations

import datetime
import os

from .launcher.constants import TORCH_DISTRIBUTED_DEFAULT_PORT  # noqa: F401

# Environment variables the launcher sets for cross-node rank information.
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"

# The default collective timeout (DEEPSPEED_TIMEOUT minutes, 10 by default as in DeepSpeed 0.19),
# as deepspeed.comm uses it.
default_pg_timeout = datetime.timedelta(minutes=float(os.environ.get("DEEPSPEED_TIMEOUT", "10")))
