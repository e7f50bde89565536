"""Checkpoint I/O: atomic writes, weights-only loads, engine save/load orchestration."""
from .errors import CheckpointError  # noqa: F401
from .io import CheckpointReader, CheckpointWriter, read_latest_tag  # noqa: F401
# DeepSpeed's own layout registers its reader with the fragment index (universal)
from . import deepspeed_native  # noqa: F401,E402
