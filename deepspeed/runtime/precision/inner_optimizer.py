"""Build the optimizer that updates the flat fp32 master tensors.

Strategies that own master weights never step the user's optimizer over the module's
(16-bit) parameters: the optimizer steps their flat master tensors, so the update is
one fused/foreach kernel per group over contiguous memory. A client optimizer object
is kept (its param-group dicts now hold the master tensors), so a client LR scheduler
bound to it changes the LR the update uses, as with DeepSpeed.
"""
from __future__ import annotations

import inspect
from typing import List, Optional

import torch

from ...config.errors import DeepSpeedConfigError


class InnerOptimizerFace:
    """The ``torch.optim.Optimizer`` face of a strategy that is ``engine.optimizer``:
    ``param_groups``/``state``/``defaults`` are those of the optimizer that really steps
    (``self.inner``), so a client scheduler bound to them drives the update."""

    @property
    def param_groups(self):
        return self.inner.param_groups if self.inner is not None else []

    @param_groups.setter
    def param_groups(self, value):
        if self.inner is not None:
            self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    @property
    def defaults(self):
        return self.inner.defaults if self.inner is not None else {}


def user_param_groups(ctx) -> List[dict]:
    """The user's parameter groups: a client optimizer's own groups when one was passed
    (that is where the user put the hyperparameters), else ``model_parameters``."""
    if ctx.client_optimizer is not None:
        return [dict(g, params=list(g["params"])) for g in ctx.client_optimizer.param_groups]
    return [dict(g, params=list(g["params"])) for g in ctx.param_groups]


def _constructor_kwargs(cls, defaults: dict) -> dict:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in sig.parameters}


def build_inner_optimizer(ctx, groups: List[dict]) -> Optional[torch.optim.Optimizer]:
    """``groups``: the user's groups with ``params`` replaced by master tensors."""
    cfg = ctx.config
    offload = cfg.zero.offload_optimizer_device in ("cpu", "nvme")   # nvme: the update runs on the host too
    if offload and ctx.client_optimizer is None and cfg.optimizer is not None:
        # the engine's factory for the config 'optimizer' section: with offload, DeepSpeed's CPU optimizers
        from ..optimizers import build_optimizer
        opt = build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups, cpu_offload=True)
        where = f"the config 'optimizer' section (with offload_optimizer.device {cfg.zero.offload_optimizer_device})"
    elif ctx.optimizer_factory is not None:
        opt = ctx.optimizer_factory(groups)
        where = "the optimizer factory (config 'optimizer' section or callable passed to initialize)"
    elif ctx.client_optimizer is not None:
        opt = adopt_client_optimizer(ctx.client_optimizer, groups)
        where = f"the client optimizer {type(opt).__name__}"
    else:
        return None
    if not hasattr(opt, "param_groups") or not hasattr(opt, "step"):
        raise TypeError(f"{where} returned {type(opt).__name__}, which is not a torch optimizer "
                        f"(it needs param_groups and step()).")
    check_zero_tested_optimizer(ctx, ctx.client_optimizer if ctx.client_optimizer is not None else opt)
    _check_groups(opt, groups, where)
    return opt


def check_zero_tested_optimizer(ctx, optimizer) -> None:
    """DeepSpeed's rule: with ZeRO (stage >= 1) an optimizer class ZeRO is not tested with
    (``deepspeed.runtime.zero.utils.is_zero_supported_optimizer``) needs ``zero_allow_untested_optimizer:
    true``, else ``AssertionError``. (Here the key defaults to true.)"""
    cfg = ctx.config
    if cfg.zero_optimization_stage == 0 or cfg.model.zero_allow_untested_optimizer:
        return
    from ..zero.utils import is_zero_supported_optimizer
    if not is_zero_supported_optimizer(optimizer):
        from ...config.errors import DeepSpeedConfigAssertionError
        raise DeepSpeedConfigAssertionError(
            f"You are using an untested ZeRO Optimizer ({type(optimizer).__name__}). Please add "
            f"<\"zero_allow_untested_optimizer\": true> in the configuration file to use it.")


def adopt_client_optimizer(client, groups: List[dict]):
    """Make the client's own optimizer object step the master tensors: each of its
    param-group dicts (the very dicts a client LR scheduler writes ``lr`` into) gets the
    master tensors of the matching group as ``"params"``; its per-tensor state starts
    empty. So the hyperparameters the client changes are the ones the update reads."""
    if len(client.param_groups) != len(groups):
        raise DeepSpeedConfigError(
            f"the client optimizer {type(client).__name__} has {len(client.param_groups)} parameter groups but "
            f"{len(groups)} were derived from it; pass the optimizer unchanged to deepspeed.initialize.")
    if any(len(st) for st in client.state.values()):
        from ...utils.logging import logger
        logger.warning(f"deepspeed.initialize: the client optimizer {type(client).__name__} already has state; "
                       f"it is dropped (the update runs over new fp32 master tensors). Load optimizer state "
                       f"through engine.load_checkpoint instead.")
    client.state.clear()
    for cg, g in zip(client.param_groups, groups):
        cg["params"] = list(g["params"])
    return client


def _check_groups(opt, groups: List[dict], where: str) -> None:
    built = [[id(p) for p in g["params"]] for g in opt.param_groups]
    wanted = [[id(p) for p in g["params"]] for g in groups]
    if built != wanted:
        raise DeepSpeedConfigError(
            f"{where} did not keep the parameter groups it was given ({len(groups)} groups of flat "
            f"master tensors; got {len(opt.param_groups)}). With fp16/bf16 or ZeRO the optimizer is built "
            f"over flat master weights: the factory must pass its argument through as the params "
            f"(e.g. `lambda params: torch.optim.AdamW(params, lr=1e-3)`).")
