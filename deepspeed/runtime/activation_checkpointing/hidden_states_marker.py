"""Find the hidden states a Hugging Face layer checkpoints, so only those are offloaded.

Transformers' ``GradientCheckpointingLayer`` checkpoints ``forward`` with its first
positional argument (the hidden states) as the checkpoint input. While an offload
manager is active on this thread, :func:`patch_gradient_checkpointing_layer_marker`'s
wrapper around ``GradientCheckpointingLayer.__call__`` marks that argument with the
manager before the call (when the layer is training with gradient checkpointing on
and grad is enabled) and drops an unused mark after it. Every other saved tensor is
left alone.

The wrapper is installed when the first manager is entered and removed when the last
one exits, so a model outside any manager (generation, a HybridEngine rollout) runs
the untouched class. Transformers is never imported here: a model built from its
layers has imported it already; if it is not loaded there is nothing to mark.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, List, Optional

import torch

_LOCK = threading.Lock()
_TLS = threading.local()


class _Install:
    wrapper: Optional[Callable] = None      # our __call__ while installed
    owned_original: Optional[Callable] = None  # the class's own __call__ (None: inherited from nn.Module)
    by_managers = False                     # installed by entering a manager (removed by the last exit)
    users = 0                               # managers active with the wrapper installed


def manager_stack() -> List:
    stack = getattr(_TLS, "stack", None)
    if stack is None:
        stack = _TLS.stack = []
    return stack


def current_manager():
    stack = manager_stack()
    return stack[-1] if stack else None


def _layer_class():
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return getattr(transformers, "GradientCheckpointingLayer", None)


def patch_gradient_checkpointing_layer_marker() -> None:
    """Install the marking wrapper on ``transformers.GradientCheckpointingLayer.__call__`` (idempotent).

    Installed this way (not by a manager) it stays until the process ends.
    """
    if _Install.wrapper is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as e:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (the release that "
                           "added GradientCheckpointingLayer): pip install transformers") from e
    _install(GradientCheckpointingLayer)


def _install(layer_cls) -> None:
    owned = layer_cls.__dict__.get("__call__")
    call = layer_cls.__call__

    def _marking_call(self, *args, **kwargs):
        manager = current_manager()
        marked = None
        if (manager is not None and args and torch.is_tensor(args[0]) and self.training
                and torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False)):
            # The layer checkpoints its positional arguments; hidden states passed by keyword are
            # bound into the checkpointed function and never saved as its input.
            marked = args[0]
            manager.mark(marked)
        try:
            return call(self, *args, **kwargs)
        finally:
            if marked is not None:
                manager._consume_mark(marked)  # ids are reused: never leave a stale mark behind

    layer_cls.__call__ = _marking_call
    _Install.wrapper, _Install.owned_original = _marking_call, owned


def _uninstall() -> None:
    wrapper, owned = _Install.wrapper, _Install.owned_original
    _Install.wrapper = _Install.owned_original = None
    layer_cls = _layer_class()
    if wrapper is None or layer_cls is None or layer_cls.__dict__.get("__call__") is not wrapper:
        return  # someone patched over us: leave theirs in place
    if owned is None:
        delattr(layer_cls, "__call__")
    else:
        layer_cls.__call__ = owned


def acquire() -> bool:
    """A manager is being entered: install the wrapper if transformers is loaded. True when the
    manager now counts as a user of the wrapper (it must then :func:`release` it on exit)."""
    with _LOCK:
        if _Install.wrapper is None:
            layer_cls = _layer_class()
            if layer_cls is not None:
                _install(layer_cls)
                _Install.by_managers = True
        if _Install.wrapper is None:
            return False
        _Install.users += 1
        return True


def release() -> None:
    """A user of the wrapper exited: remove it once none is left (if a manager installed it)."""
    with _LOCK:
        _Install.users -= 1
        if _Install.users == 0 and _Install.by_managers:
            _uninstall()
            _Install.by_managers = False
