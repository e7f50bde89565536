"""The checkpoint-engine interface (DeepSpeed's ``CheckpointEngine`` ABC and its commit info)."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod


class CheckpointCommitInfo:
    """What ``create``/``commit`` are told about the checkpoint being written."""

    def __init__(self, tag, save_dir, save_latest):
        self.tag = tag
        self.save_dir = save_dir
        self.save_latest = save_latest


class CheckpointEngine(ABC):
    """Saves and loads checkpoint files. ``create(info)`` is called before the files of a tag
    are written, ``save`` per file, ``commit(info)`` once they all are (True: the tag is complete)."""

    def __init__(self, config_params=None):
        self.name = None
        self._commit_info = None

    def create(self, info: CheckpointCommitInfo):
        """A checkpoint ``info.tag`` is about to be written."""

    @abstractmethod
    def save(self, state_dict, path: str):
        ...

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    @abstractmethod
    def load(self, path: str, map_location=None):
        ...

    def commit(self, info: CheckpointCommitInfo):
        """Every file of ``info.tag`` is written; True when the checkpoint is complete."""
        return True

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def is_decoupled(self):
        """True for engines that write in the background (none here)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo):
        self._commit_info = info

    def get_commit_info(self):
        return self._commit_info

    def cleanup(self):
        """Release what the engine holds (nothing for synchronous engines)."""

    def preserves_storage_sharing(self):
        """True: tensors sharing storage are saved once (torch.save keeps views together)."""
        return True
