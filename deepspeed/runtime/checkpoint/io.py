"""Atomic checkpoint file I/O.

A save writes every file into ``<save_dir>/.tmp-<tag>``; only after every rank has
written successfully is that directory renamed to ``<save_dir>/<tag>`` and the
``latest`` file replaced (write to a temporary file, fsync, ``os.replace``). A crash
or exception at any point leaves the previous checkpoint and ``latest`` untouched.
Loading uses ``torch.load(weights_only=True)``: a checkpoint file cannot run code.
"""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from .errors import CheckpointError

LATEST = "latest"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str) -> None:
    part = path + ".part"
    with open(part, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def atomic_write_text(path: str, text: str) -> None:
    part = path + ".part"
    with open(part, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_dir(os.path.dirname(path) or ".")


class CheckpointWriter:
    """Writes the files of one checkpoint tag into a temporary directory."""

    def __init__(self, save_dir: str, tag: str):
        self.save_dir = save_dir
        self.tag = tag
        self.final_path = os.path.join(save_dir, tag)
        self.path = os.path.join(save_dir, f".tmp-{tag}")

    def prepare(self) -> None:
        """Rank 0: start from an empty temporary directory."""
        if os.path.isdir(self.path):
            shutil.rmtree(self.path)
        os.makedirs(self.path, exist_ok=True)

    def save(self, name: str, obj) -> None:
        atomic_torch_save(obj, os.path.join(self.path, name))

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(os.path.join(self.path, name), text)

    def commit(self, save_latest: bool) -> None:
        """Rank 0, after every rank wrote successfully: move into place, then move ``latest``."""
        _fsync_dir(self.path)
        old = None
        if os.path.exists(self.final_path):
            old = os.path.join(self.save_dir, f".old-{self.tag}")
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(self.final_path, old)
        os.replace(self.path, self.final_path)
        _fsync_dir(self.save_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            atomic_write_text(os.path.join(self.save_dir, LATEST), self.tag)

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class CheckpointReader:
    """Reads the files of one saved checkpoint tag."""

    def __init__(self, load_dir: str, tag: str):
        self.load_dir = load_dir
        self.tag = tag
        self.path = os.path.join(load_dir, tag)
        if not os.path.isdir(self.path):
            raise CheckpointError(
                f"Checkpoint directory '{self.path}' does not exist (load_dir='{load_dir}', tag='{tag}').")

    def exists(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.path, name))

    def list(self, prefix: str = "", suffix: str = "") -> list[str]:
        return sorted(n for n in os.listdir(self.path) if n.startswith(prefix) and n.endswith(suffix))

    def load(self, name: str, map_location="cpu"):
        path = os.path.join(self.path, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"Checkpoint file '{path}' is missing; the checkpoint is incomplete.")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"Could not load checkpoint file '{path}' with torch.load(weights_only=True): {err}. "
                f"Checkpoint files may only hold tensors and plain Python containers/numbers/strings "
                f"(client_state included).") from None


def read_latest_tag(load_dir: str):
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        tag = f.read().strip()
    return tag or None
