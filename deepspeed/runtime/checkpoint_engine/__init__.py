"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's checkpoint-engine interface.

A checkpoint engine is the object DeepSpeed saves and loads each checkpoint file through
(``save(state_dict, path)``, ``load(path, map_location)``, with ``create``/``commit`` around a
tag). This package provides the interface (:class:`CheckpointEngine`,
:class:`CheckpointCommitInfo`) and the default :class:`TorchCheckpointEngine`, which writes
atomically and reads weights-only through this package's checkpoint I/O
(:mod:`deepspeed.runtime.checkpoint.io`). The asynchronous engines DeepSpeed also ships
(Nebula, fast/decoupled writers, DataStates) are not built.
"""
from .checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: F401
from .torch_checkpoint_engine import TorchCheckpointEngine  # noqa: F401

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
