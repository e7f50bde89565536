"""The interface every gradient/parameter strategy implements (one per ZeRO stage).

The engine picks one strategy from the config at ``initialize`` and never branches
on the ZeRO stage again. A strategy owns: how gradients are synchronised across
data-parallel ranks, the optimizer the update runs in (and the master weights
when precision is mixed), clipping, and the optimizer-side checkpoint state.

Life cycle per optimizer step (``gas`` micro-steps)::

    for micro in range(gas):
        loss = engine(batch)                          # strategy.pre_forward() (stage 3 gathers here)
        engine.backward(loss)                         # strategy.backward(loss_scaled_for_gas, sync=boundary)
                                                      # = begin_backward; loss.backward(); end_backward
        engine.step()                                 # at the boundary: strategy.step() -> StepOutcome
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from .module_state import load_module_checked


@dataclass
class StepOutcome:
    """What one optimizer step did. ``skipped`` is True when fp16 overflow skipped it."""
    skipped: bool = False
    grad_norm: Optional[float] = None


@dataclass
class StrategyContext:
    """What a strategy needs from the engine, so strategies are testable without one."""
    config: Any                      # deepspeed.config.DeepSpeedConfig
    dp_group: Any = None             # torch.distributed group (None: WORLD or single process)
    dp_world_size: int = 1
    dp_rank: int = 0
    mpu: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timers: Any = None
    # The user's parameter groups (dicts with "params" and per-group hyperparameters),
    # from ``model_parameters`` or the module's trainable parameters.
    param_groups: List[dict] = field(default_factory=list)
    # Builds the optimizer for a list of param groups shaped like ``param_groups``
    # (the strategy may substitute flat master tensors for "params"); None: no optimizer.
    optimizer_factory: Optional[Callable[[List[dict]], torch.optim.Optimizer]] = None
    # A client optimizer object passed to initialize (strategies that own master weights
    # rebuild it over their own tensors with the same class and hyperparameters).
    client_optimizer: Optional[torch.optim.Optimizer] = None


class TrainingStrategy(ABC):
    """Base class. Subclasses override what differs; see stage0.DataParallelStrategy."""

    #: ZeRO stage this strategy implements
    stage: int = 0

    def __init__(self, module: torch.nn.Module, ctx: StrategyContext):
        self.module = module
        self.ctx = ctx
        self.optimizer = None       # the object returned to the user as ``engine.optimizer``
        self._sync_enabled = True   # engine.no_sync() turns gradient reduction off

    # -- forward / backward --------------------------------------------------------
    def pre_forward(self) -> None:
        """Called before each forward (stage 3 uses module hooks instead)."""

    def backward(self, loss: torch.Tensor, *, sync: bool, retain_graph: bool = False) -> None:
        """Run backward on ``loss`` (already divided by gas). When ``sync`` is True this is
        the accumulation boundary and gradients must be reduced across ranks by the time
        :meth:`step` runs."""
        token = self.begin_backward(sync)
        loss.backward(retain_graph=retain_graph)
        self.end_backward(token)

    # begin/end are separate so one autograd pass can serve several strategies (the MoE
    # composite) and so a backward the user drives (``loss.backward()``, runtime/torch_backward.py)
    # is bracketed from autograd hooks. ``end_backward`` also reduces gradients that a backward
    # outside any bracket left in ``p.grad`` (``engine._backward_epilogue()``, the exit of
    # ``engine.coalesce_grad_reduction()``).
    def begin_backward(self, sync: bool):
        """Before the autograd pass; returns the token :meth:`end_backward` takes."""
        return sync

    def end_backward(self, token) -> None:
        """After the autograd pass: finish (at the boundary: reduce) what the pass produced."""

    def allreduce_gradients(self) -> None:
        """Reduce, now, the gradients a boundary ``backward(sync=False)`` left local to this rank
        (``engine.allreduce_gradients()``). Strategies that reduce in every backward (ZeRO-2/3)
        have nothing left to do."""

    @abstractmethod
    def step(self) -> StepOutcome:
        """Apply one optimizer update at the accumulation boundary (clip, update, zero grads)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.module.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @contextlib.contextmanager
    def no_sync(self):
        prev = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = prev

    # -- precision -----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def needs_scaler(self) -> bool:
        """Whether a backward needs the loss scaled first (fp16): DeepSpeed 0.19's optimizer method;
        a user-driven ``loss.backward()`` without ``engine.scale(loss)`` is refused then."""
        return bool(self.ctx.config.fp16_enabled)

    # -- state ------------------------------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full (unpartitioned) module state dict. Every rank must call it (collective at
        stage 3, where only data-parallel rank 0 receives the tensors and the others get an
        empty dict, to avoid one host copy of the model per rank)."""
        return self.module.state_dict()

    def load_module_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Load full module weights (stage 3 overrides to re-partition)."""
        load_module_checked(self.module, state_dict, strict)

    @abstractmethod
    def save_optimizer_state(self, writer, dp_rank: int, mp_rank: int) -> None:
        """Write this rank's optimizer-side state through ``writer.save(name, obj)``."""

    @abstractmethod
    def load_optimizer_state(self, reader, load_optimizer_states: bool = True) -> None:
        """Restore optimizer-side state from ``reader`` (any saved world size / stage the
        strategy supports). With ``load_optimizer_states=False`` only master weights are
        refreshed from the loaded module."""

    def after_module_load(self) -> None:
        """Called after module weights were loaded from a checkpoint (refresh master copies)."""

    def destroy(self) -> None:
        """Remove hooks and free buffers."""
