"""``deepspeed.checkpointing``: activation checkpointing with DeepSpeed's memory options.

``checkpoint(function, *args)`` runs ``function`` without keeping its internal
activations; backward runs it again (with every RNG stream replayed, so dropout
masks match) and backpropagates through the recomputed graph. Only the inputs
are kept, and :mod:`.storage` decides how (partitioned across the
model-parallel group, in host memory, in a contiguous buffer).

Two modes:

* reentrant (default, the documented API): a ``torch.autograd.Function`` whose
  backward recomputes and calls ``torch.autograd.backward`` itself. Works with
  ``loss.backward()``; not with ``torch.autograd.grad``.
* non-reentrant (``use_reentrant=False`` or :func:`non_reentrant_checkpoint`):
  built on ``torch.utils.checkpoint``'s saved-tensor-hook machinery, so it works
  with ``torch.autograd.grad``, keyword arguments and inputs that do not require
  grad. It supports ``checkpoint_in_cpu``, ``synchronize`` and ``profile``; the
  partitioned and contiguous options apply to the reentrant mode only.
"""
from __future__ import annotations

import contextlib
import sys
import time
import types
from typing import Any, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import logger

from . import settings as _settings
from .rng import (CudaRNGStatesTracker, RNGSnapshot, _MODEL_PARALLEL_RNG_TRACKER_NAME,  # noqa: F401
                  _set_cuda_rng_state, get_cuda_rng_tracker, model_parallel_cuda_manual_seed,
                  model_parallel_reconfigure_tp_seed, rng_replay)
from .settings import is_configured  # noqa: F401
from .storage import CONTIGUOUS_BUFFERS, KeptInputs, is_activation

# A leaf that requires grad, passed to the reentrant Function when no real input
# does, so the output still joins the graph and backward reaches the parameters
# inside the checkpointed function (e.g. frozen embeddings feeding trainable layers).
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)
_warned_reentrant_only = False


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Configure activation checkpointing (documented signature).

    ``deepspeed_config`` may be a JSON/hjson path, a dict or a ``DeepSpeedConfig``;
    its ``activation_checkpointing`` section gives the defaults and every explicit
    argument that is not None overrides the matching key. ``mpu_`` supplies the
    model-parallel group used by ``partition_activations`` (None: no model parallelism).
    """
    resolved = _settings.resolve(deepspeed_config, partition_activations, contiguous_checkpointing,
                                 num_checkpoints, checkpoint_in_cpu, synchronize, profile)
    _settings.apply(mpu_, resolved)
    CONTIGUOUS_BUFFERS.reset()


def reset() -> None:
    """Free the contiguous checkpoint buffers.

    Call between forwards that are not followed by backward (evaluation with grad
    enabled); backward gives the slots back on its own.
    """
    CONTIGUOUS_BUFFERS.reset()


def _sync_if(enabled: bool) -> None:
    if enabled:
        get_accelerator().synchronize()


def _fn_name(function) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


class _Timed:
    """Time a phase of one checkpointed call and log it when ``profile`` is on."""

    def __init__(self, cfg: _settings.CheckpointSettings, name: str, phase: str):
        self.cfg, self.name, self.phase = cfg, name, phase

    def __enter__(self):
        _sync_if(self.cfg.synchronize or self.cfg.profile)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync_if(self.cfg.synchronize or self.cfg.profile)
        if self.cfg.profile and exc[0] is None:
            ms = (time.perf_counter() - self.t0) * 1e3
            logger.info(f"activation checkpoint {self.name}: {self.phase} {ms:.3f} ms")
        return False


def _autocast_state():
    """Autocast settings of the forward, replayed in the recompute."""
    states = []
    for device_type in {"cpu", get_accelerator().device_name()}:
        if torch.is_autocast_enabled(device_type):
            states.append((device_type, torch.get_autocast_dtype(device_type)))
    return states


@contextlib.contextmanager
def _autocast_replay(states):
    with contextlib.ExitStack() as stack:
        for device_type, dtype in states:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
        yield


def _as_tuple(x) -> Tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


class CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint: ``CheckpointFunction.apply(function, *args)``.

    Like ``torch.utils.checkpoint``'s reentrant function, plus: the RNG tracker's
    streams are replayed too, inputs are kept per the memory options
    (partition / CPU / contiguous), and the forward and recompute can be
    synchronized and profiled.
    """

    @staticmethod
    def forward(ctx, function, *args):
        cfg = _settings.current()
        if args and args[0] is _GRAD_ANCHOR:
            ctx.anchored, args = True, args[1:]
        else:
            ctx.anchored = False
        ctx.function, ctx.cfg, ctx.name = function, cfg, _fn_name(function)
        ctx.rng = RNGSnapshot.capture()
        ctx.autocast = _autocast_state()
        with _Timed(cfg, ctx.name, "forward"):
            outputs = function(*args)
        kept = KeptInputs(cfg, _settings.current_mpu())
        ctx.save_for_backward(*kept.keep(args))
        ctx.kept = kept
        non_diff = [o for o in _as_tuple(outputs) if torch.is_tensor(o) and not o.is_floating_point()
                    and not o.is_complex()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "deepspeed.checkpointing.checkpoint (reentrant mode) works with loss.backward() / "
                "torch.autograd.backward, not torch.autograd.grad. Use checkpoint(fn, *args, "
                "use_reentrant=False) or deepspeed.checkpointing.non_reentrant_checkpoint for autograd.grad.")
        cfg = ctx.cfg
        inputs = ctx.kept.restore(ctx.saved_tensors)
        with _Timed(cfg, ctx.name, "recompute"):
            with rng_replay(ctx.rng), torch.enable_grad(), _autocast_replay(ctx.autocast):
                outputs = _as_tuple(ctx.function(*inputs))
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            with _Timed(cfg, ctx.name, "backward"):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs)
        anchor = (None,) if ctx.anchored else ()
        return (None,) + anchor + grads


def _warn_reentrant_only(cfg) -> None:
    global _warned_reentrant_only
    if (cfg.partition_activations or cfg.contiguous_checkpointing) and not _warned_reentrant_only:
        _warned_reentrant_only = True
        logger.warning("activation_checkpointing.partition_activations / contiguous_memory_optimization "
                       "apply to the reentrant checkpoint only; non-reentrant calls keep full activations.")


def non_reentrant_checkpoint(function, *args, **kwargs):
    """Checkpoint via ``torch.utils.checkpoint``'s non-reentrant machinery.

    Works with ``torch.autograd.grad``, keyword arguments and inputs that do not
    require grad. All RNG streams (CPU, accelerator, tracker) are replayed in the
    recompute; ``checkpoint_in_cpu`` keeps the inputs in host memory through
    differentiable copies; ``synchronize``/``profile`` wrap forward and recompute.
    """
    cfg = _settings.current()
    _warn_reentrant_only(cfg)
    name = _fn_name(function)
    snapshot = {}

    @contextlib.contextmanager
    def forward_ctx():
        snapshot["rng"] = RNGSnapshot.capture()
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        with _Timed(cfg, name, "recompute"), rng_replay(snapshot["rng"]):
            yield

    run, run_args = function, args
    if cfg.checkpoint_in_cpu:
        devices = [a.device if is_activation(a) else None for a in args]
        run_args = tuple(a.to("cpu", copy=True) if is_activation(a) else a for a in args)

        def run(*host_args, **kw):
            back = (a.to(d) if d is not None else a for a, d in zip(host_args, devices))
            return function(*back, **kw)

    with _Timed(cfg, name, "forward"):
        return torch_checkpoint.checkpoint(run, *run_args, use_reentrant=False, preserve_rng_state=False,
                                           context_fn=lambda: (forward_ctx(), recompute_ctx()), **kwargs)


def checkpoint(function, *args, use_reentrant: bool = True, **kwargs):
    """Checkpoint ``function(*args)`` (documented API; reentrant unless ``use_reentrant=False``).

    Non-tensor arguments pass through; outputs may be a tensor or a tuple mixing
    tensors (with or without grad) and other objects. Keyword arguments are passed to
    ``function`` (tensors among them get gradients, in both modes).
    """
    if not callable(function):
        raise TypeError(f"deepspeed.checkpointing.checkpoint: function must be callable, got {function!r}")
    if not use_reentrant:
        return non_reentrant_checkpoint(function, *args, **kwargs)
    if kwargs:
        # As DeepSpeed 0.19: keyword arguments travel as trailing positional inputs of the Function (a tensor
        # passed by keyword gets its gradient like a positional one) and are handed back by name.
        names, n_pos, inner = tuple(kwargs), len(args), function

        def function(*all_args):
            return inner(*all_args[:n_pos], **dict(zip(names, all_args[n_pos:])))

        function.__qualname__ = _fn_name(inner)
        args = args + tuple(kwargs.values())
    if not torch.is_grad_enabled():
        # Nothing will run backward: no need to keep inputs or claim buffers.
        cfg = _settings.current()
        with _Timed(cfg, _fn_name(function), "forward"):
            return function(*args)
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return CheckpointFunction.apply(function, _GRAD_ANCHOR, *args)
    return CheckpointFunction.apply(function, *args)


# DeepSpeed keeps the configuration in module globals that clients (and its tests) read and assign:
# ``PARTITION_ACTIVATIONS``, ``CONTIGUOUS_CHECKPOINTING``, ``num_layers``, ``CPU_CHECKPOINT``, ``SYNCHRONIZE``,
# ``PROFILE_TIME``, ``mpu``, ``deepspeed_checkpointing_enabled``. Here they are properties of this module
# over the installed settings (settings.py), so reading one gives what ``configure`` decided and assigning
# one changes what the next checkpointed call does, as there.
_GLOBAL_FIELDS = {"PARTITION_ACTIVATIONS": "partition_activations",
                  "CONTIGUOUS_CHECKPOINTING": "contiguous_checkpointing", "num_layers": "num_checkpoints",
                  "CPU_CHECKPOINT": "checkpoint_in_cpu", "SYNCHRONIZE": "synchronize", "PROFILE_TIME": "profile"}


def _settings_property(field: str) -> property:
    return property(lambda mod: getattr(_settings.current(), field),
                    lambda mod, value: _settings.override(**{field: value}))


class _CheckpointingModule(types.ModuleType):
    mpu = property(lambda mod: _settings._mpu, lambda mod, value: _settings.set_mpu(value))
    deepspeed_checkpointing_enabled = property(lambda mod: _settings.is_configured(),
                                               lambda mod, value: _settings.set_configured(value))


for _name, _field in _GLOBAL_FIELDS.items():
    setattr(_CheckpointingModule, _name, _settings_property(_field))
sys.modules[__name__].__class__ = _CheckpointingModule

__all__ = [
    "configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "CheckpointFunction",
    "CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
]
