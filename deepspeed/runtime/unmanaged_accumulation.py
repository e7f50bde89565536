"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19): the caller owns the accumulation boundary.

With the default (``true``) the engine counts micro-steps and every
``gradient_accumulation_steps``-th ``step()`` is the boundary: it reduces the window's gradients
and updates; the other ``step()`` calls only count. With ``false`` there is no counter:

* ``backward()`` (``engine.backward(loss)`` or a user-driven ``loss.backward()``) never is a
  boundary, so it only accumulates: at ZeRO stage 0/1 the full gradients stay local in
  ``p.grad`` / the flat gradient buffer; at stage 2/3 they are reduce-scattered into the
  partitions in every backward, exactly as in a managed window's non-boundary micro-steps.
* every ``step()`` is the boundary: :func:`open_step` reduces whatever the window left local
  (the strategy's ``end_backward(begin_backward(True))``, the flush ``coalesce_grad_reduction``
  uses on exit), then the engine applies one update, and :func:`window_samples` advances
  ``global_samples`` by the micro-batches actually run (``backward`` calls since the last step
  times ``train_micro_batch_size_per_gpu x data-parallel ranks``), not ``train_batch_size``.
* ``is_gradient_accumulation_boundary()`` is True only while ``step()`` runs.

The update is the one a managed window of the same backward passes gives: the sum of every
backward's gradients, averaged over the data-parallel ranks. ``engine.backward`` still divides
the loss by ``gradient_accumulation_steps`` unless ``scale_wrt_gas=False``: when the number of
backward passes per step varies, pass ``scale_wrt_gas=False`` and divide the loss yourself.

Refused, as DeepSpeed refuses them (``AssertionError``): the pipeline engine (its schedule owns
the boundary), ``zero_optimization.overlap_comm`` at stage 0/1 (checked with the config,
deepspeed/config/ds_config.py), ``set_gradient_accumulation_boundary()`` and
``coalesce_grad_reduction()`` (both would own the boundary too), and ``step()`` inside
``engine.no_sync()``. (DeepCompile and Apex AMP, which DeepSpeed also refuses here, are not
built: their config sections are refused whatever this key says.)
"""
from __future__ import annotations

from ..config.errors import DeepSpeedConfigAssertionError

KEY = "managed_gradient_accumulation"


def check_supported(engine) -> None:
    """At ``initialize``: refuse what cannot run with ``managed_gradient_accumulation: false``."""
    if getattr(engine, "pipeline_parallelism", False):
        raise DeepSpeedConfigAssertionError(
            f"{KEY}=False is not supported with pipeline parallelism: the pipeline schedule "
            f"(train_batch) runs gradient_accumulation_steps micro-batches and steps itself. Set {KEY} true "
            f"(or remove it), or train a model that is not a PipelineModule.")


def refuse(what: str) -> None:
    """``set_gradient_accumulation_boundary`` / ``coalesce_grad_reduction`` under ``false``."""
    raise AssertionError(
        f"{what} is not supported with {KEY}=False: the caller owns the accumulation boundary, and every "
        f"step() reduces the gradients of all backward passes since the previous step() and updates. Call "
        f"backward() as often as needed, then step(); or set {KEY} true to use {what}.")


def count_backward(engine) -> None:
    """One backward pass (one micro-batch) of the current window."""
    engine._unmanaged_backward_count += 1
    engine._running_engine_step = False   # a step() that raised must not leave the boundary open


def open_step(engine) -> None:
    """Start ``step()``: it is the boundary; reduce the gradients the window left local."""
    strategy = engine.strategy
    parts = getattr(strategy, "subs", None) or [strategy]   # the MoE composite: its sub-strategies
    if not all(getattr(s, "_sync_enabled", True) for s in parts):
        raise AssertionError(
            f"engine.step() cannot be called inside engine.no_sync() with {KEY}=False: step() reduces the "
            f"accumulated gradients across ranks, which no_sync() forbids. Leave the no_sync() block first.")
    engine._running_engine_step = True
    strategy.end_backward(strategy.begin_backward(True))
    engine._unreduced_grads = False


def close_step(engine) -> None:
    engine._running_engine_step = False


def window_samples(engine) -> int:
    """Samples the finished window trained on (and start the next window's count)."""
    per_micro = engine.train_batch_size() // engine.gradient_accumulation_steps()
    n, engine._unmanaged_backward_count = engine._unmanaged_backward_count, 0
    return per_micro * n
