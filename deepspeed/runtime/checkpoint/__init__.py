"""Checkpoint I/O: atomic writes, weights-only loads, engine save/load orchestration."""
from .errors import CheckpointError  # noqa: F401
from .io import CheckpointReader, CheckpointWriter, read_latest_tag  # noqa: F401
