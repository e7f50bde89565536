"""Offload the hidden states that non-reentrant checkpointing saves, to host memory.

``torch.utils.checkpoint(..., use_reentrant=False)`` (Hugging Face's default) keeps
only each checkpointed layer's inputs for backward, through autograd's saved-tensor
machinery. :class:`CheckpointHiddenStatesOffload` is a context manager that installs
saved-tensor hooks: a saved tensor that was *marked* (by :meth:`~CheckpointHiddenStatesOffload.mark`,
or automatically for a Transformers ``GradientCheckpointingLayer``'s hidden states,
see :mod:`.hidden_states_marker`) is handed to :class:`~.offload_engine.HostOffloadEngine`,
which moves it to (pinned) host memory and brings it back when backward unpacks it.
Every other saved tensor passes through untouched.

Use one manager for the whole run and wrap each step's forward *and* backward in it::

    offload = get_checkpoint_hidden_states_offloading_ctx_manager()
    for batch in loader:
        with offload:
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()

The options are constructor arguments (DeepSpeed reads no config key for this); each
is validated and a bad value raises ``ValueError`` naming it.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import hidden_states_marker as _marker
from .hidden_states_marker import patch_gradient_checkpointing_layer_marker  # noqa: F401 (public name)
from .offload_engine import CheckpointActivationOffloadStats, HostOffloadEngine  # noqa: F401 (public name)

# DeepSpeed's name for the engine class.
_ActivationOffloadEngine = HostOffloadEngine


class _OffloadedTensorRef:
    """What autograd holds instead of an offloaded tensor: the engine's id for it."""
    __slots__ = ("tensor_id", )

    def __init__(self, tensor_id: int):
        self.tensor_id = tensor_id


class CheckpointHiddenStatesOffload(HostOffloadEngine):
    """Context manager: saved tensors that were marked go to host memory until backward.

    Arguments (all validated; see :mod:`.offload_engine` for what each does):
    ``use_pin_memory`` (pin host buffers through the accelerator), ``use_streams``
    (copy on a side stream where the accelerator has streams), ``min_offload_bytes``
    (smaller tensors stay), ``max_fwd_stash_count`` (device tensors held while their
    copy may still be running), ``max_cpu_buffer_pool_count`` (idle host buffers kept),
    ``keep_last_count`` (newest marked tensors not moved). Peak extra device memory held
    is ``max_fwd_stash_count + keep_last_count`` marked tensors.

    Backward must run inside the same ``with`` block as the forward; leaving the block
    releases what is held. A manager is not re-entrant (nest a second instance instead).
    """

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1):
        super().__init__(use_pin_memory=use_pin_memory, use_streams=use_streams,
                         min_offload_bytes=min_offload_bytes, max_fwd_stash_count=max_fwd_stash_count,
                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count, keep_last_count=keep_last_count)
        self._allowed: Dict[int, int] = {}  # id(tensor) -> marks not yet consumed by a save
        self._hooks = saved_tensors_hooks(self._pack_tensor, self._unpack_tensor)
        self._uses_marker = False

    # -- marks --------------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` the next time autograd saves it (once per mark)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        key = id(tensor)
        left = self._allowed.get(key, 0)
        if left <= 0:
            return False
        if left == 1:
            del self._allowed[key]
        else:
            self._allowed[key] = left - 1
        return True

    # -- saved-tensor hooks --------------------------------------------------------------------------
    def _pack_tensor(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed):
        if isinstance(packed, _OffloadedTensorRef):
            # Cached until the block exits, so a retained graph can run backward twice.
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    # -- lifetime --------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    def __enter__(self):
        stack = _marker.manager_stack()
        if self in stack:
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: this manager is already active; "
                               "use a separate instance for a nested block")
        self._uses_marker = _marker.acquire()
        try:
            self.reset()
            stack.append(self)
            self._hooks.__enter__()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._sync_and_clear()
        finally:
            try:
                self._leave()
            finally:
                self._hooks.__exit__(*exc)
        return False

    def _leave(self) -> None:
        stack = _marker.manager_stack()
        if self in stack:
            stack.remove(self)
        if self._uses_marker:
            self._uses_marker = False
            _marker.release()


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` with these options (DeepSpeed's factory)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)


__all__ = ["CheckpointHiddenStatesOffload", "CheckpointActivationOffloadStats",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"]
