"""``TorchCheckpointEngine``: the default engine, over this package's checkpoint I/O."""
from __future__ import annotations

from .checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

ENGINE_NAME = "TorchCheckpointEngine"


class TorchCheckpointEngine(CheckpointEngine):
    """``save``: ``torch.save`` atomically (``path.part`` + fsync + rename;
    :func:`deepspeed.runtime.checkpoint.io.atomic_torch_save`). ``load``: weights-only
    ``torch.load`` with the package's allow-list, verified against the tag's manifest when
    there is one (:func:`deepspeed.runtime.checkpoint.io.load_file`)."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = ENGINE_NAME

    def save(self, state_dict, path: str):
        from ..checkpoint.io import atomic_torch_save
        atomic_torch_save(state_dict, path)

    def load(self, path: str, map_location=None):
        from ..checkpoint.io import load_file
        return load_file(path, map_location=map_location if map_location is not None else "cpu")

    def commit(self, info: CheckpointCommitInfo):
        return True
