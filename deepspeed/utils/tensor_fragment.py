"""Read and write the full or local fp32 master weights, gradients and optimizer state
of one parameter, whatever the ZeRO stage.

Why: under ZeRO a parameter's fp32 master, gradient and optimizer state are split
across ranks and live in flat buffers; ``param.grad`` is usually None. Code that
inspects or edits them (gradient logging, weight surgery, optimizer-state resets)
calls these functions instead.

Protocol. A strategy that owns such state sets ``param._ds_state_owner`` to an
object with these methods (``deepspeed.runtime.precision.flat_state.FlatStateMixin``
implements them for stage 0 in 16-bit and stages 1/2; stage 3 provides its own)::

    full_fp32_param(p) / full_grad(p) / full_optimizer_state(p, key)          # collective
    local_fp32_param(p) / local_grad(p) / local_optimizer_state(p, key)       # this rank's fragment
    set_full_fp32_param(p, value) / set_full_optimizer_state(p, key, value) / set_full_grad(p, value)
    set_local_fp32_param(p, value) / set_local_optimizer_state(p, key, value) / set_local_grad(p, value)

``full_*`` getters are collective at stages 1-3: every data-parallel rank must call
them for the same parameter. Gradients are the averaged, unscaled gradients of the
last accumulation boundary (valid between ``engine.backward`` and ``engine.step``).
A parameter without an owner (fp32 training at stage 0) is its own master; its
optimizer state is not reachable from the parameter, so those getters return None.
"""
from __future__ import annotations

import torch


def _owner(param):
    return getattr(param, "_ds_state_owner", None)


def _frozen(param) -> bool:
    """A parameter that does not require grad has no optimizer-held state: DeepSpeed's getters
    return None for it (fp32 master, gradient, optimizer state; full and local)."""
    return not param.requires_grad


def safe_get_full_fp32_param(param):
    """The full fp32 master weights of ``param`` (shape of the parameter)."""
    if _frozen(param):
        return None
    o = _owner(param)
    if o is None:
        return param.detach().float().clone()
    return o.full_fp32_param(param)


def safe_get_full_grad(param):
    """The full averaged gradient of ``param`` in fp32, or None if it has none. Inside
    ``engine.no_sync()`` / ``coalesce_grad_reduction()`` at ZeRO stages 0-2 it is the rank's local,
    not yet reduced ``param.grad`` itself, as DeepSpeed returns it."""
    if _frozen(param):
        return None
    o = _owner(param)
    if o is None:
        return None if param.grad is None else param.grad.detach().float().clone()
    return o.full_grad(param)


def safe_get_full_optimizer_state(param, optim_state_key):
    """The full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``, or None."""
    if _frozen(param):
        return None
    o = _owner(param)
    if o is None:
        return None
    return o.full_optimizer_state(param, optim_state_key)


def safe_set_full_fp32_param(param, value):
    """Set the fp32 master (and the module's parameter) of ``param`` from a full tensor;
    every rank passes the same value."""
    o = _owner(param)
    if o is None:
        with torch.no_grad():
            param.copy_(value)
        return
    o.set_full_fp32_param(param, value)


def safe_set_full_optimizer_state(param, value, optim_state_key):
    o = _owner(param)
    if o is None:
        raise ValueError("This parameter's optimizer state is not held by a deepspeed strategy "
                         "(fp32 at ZeRO stage 0): set it on engine.optimizer.state directly.")
    o.set_full_optimizer_state(param, optim_state_key, value)


def safe_get_local_fp32_param(param):
    """This rank's fragment of the fp32 master (1-D), or None if it owns none of it."""
    if _frozen(param):
        return None
    o = _owner(param)
    return param.detach().float().reshape(-1) if o is None else o.local_fp32_param(param)


def safe_get_local_grad(param):
    if _frozen(param):
        return None
    o = _owner(param)
    if o is None:
        return None if param.grad is None else param.grad.detach().float().reshape(-1)
    return o.local_grad(param)


def safe_get_local_optimizer_state(param, optim_state_key):
    if _frozen(param):
        return None
    o = _owner(param)
    return None if o is None else o.local_optimizer_state(param, optim_state_key)


def safe_set_local_fp32_param(param, value):
    o = _owner(param)
    if o is None:
        with torch.no_grad():
            param.view(-1).copy_(value.reshape(-1))
        return
    o.set_local_fp32_param(param, value)


def safe_set_local_optimizer_state(param, value, optim_state_key):
    o = _owner(param)
    if o is None:
        raise ValueError("This parameter's optimizer state is not held by a deepspeed strategy "
                         "(fp32 at ZeRO stage 0): set it on engine.optimizer.state directly.")
    o.set_local_optimizer_state(param, optim_state_key, value)


def safe_set_full_grad(param, value):
    """Replace the gradient of ``param`` (a full tensor, the averaged unscaled gradient that
    :func:`safe_get_full_grad` returns; every rank passes the same value). Valid between
    ``engine.backward`` and ``engine.step``: the step uses it (clipping included)."""
    o = _owner(param)
    if o is None:
        param.grad = value.detach().to(dtype=param.dtype, device=param.device).view_as(param).clone()
        return
    _setter(o, "set_full_grad")(param, value)


def safe_set_local_grad(param, value):
    """Replace this rank's fragment of the gradient of ``param`` (the shape
    :func:`safe_get_local_grad` returns)."""
    o = _owner(param)
    if o is None:
        param.grad = value.detach().to(dtype=param.dtype, device=param.device).reshape(param.shape).clone()
        return
    _setter(o, "set_local_grad")(param, value)


def safe_update_full_grad_vectorized(param_list, update_func):
    """Replace the full gradient of each parameter in ``param_list`` by
    ``update_func(current_full_grad, param)`` (the averaged, unscaled gradient that
    :func:`safe_get_full_grad` returns; collective at ZeRO stages 1-3 like the getters: every rank
    passes the same list). Parameters without a gradient are left alone. Valid between
    ``engine.backward`` and ``engine.step``."""
    for p in param_list:
        if _owner(p) is None:
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.copy_(update_func(p.grad, p))
            continue
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def _setter(owner, name):
    fn = getattr(owner, name, None)
    if fn is None:
        raise NotImplementedError(f"{type(owner).__name__} does not support {name.replace('set_', 'safe_set_')}() "
                                  f"(the gradients of this configuration are not held where it can write them).")
    return fn
