"""Stage-3 helpers for code that runs the model outside ``engine.forward``'s usual
schedule (generation loops, evaluation) or wants gathered memory back.

* ``unwrap_model_for_generation(model)``: a context manager yielding the underlying
  module with every ZeRO-3 parameter gathered for the whole block, so a generation loop's
  many forwards reuse the full weights instead of gathering and releasing each module per
  token (TRL wraps ``model.generate`` in it). The engine's parameter hooks are off inside
  the block. On exit the parameters are partitioned again and the hooks are back.
* ``empty_partition_cache(engine)``: release every gathered (non-persistent) stage-3
  parameter the schedule still holds and return freed memory to the allocator
  (``engine.empty_partition_cache()``).
"""
from __future__ import annotations

import contextlib
import gc

from ..engine_queries import EngineConfigQueries
from .partition_parameters import GatheredParameters
from .partitioned_param import is_zero_param


def _module_of(model):
    # every engine (DeepSpeedEngine, PipelineEngine) is built on EngineConfigQueries, the
    # engine's lowest base: this helper sits below the engine and does not import it
    return model.module if isinstance(model, EngineConfigQueries) else model


@contextlib.contextmanager
def unwrap_model_for_generation(model, gather_deepspeed3_params: bool = True):
    """Yield ``model``'s module (an engine's ``.module``) with its ZeRO-3 parameters gathered.
    Collective under stage 3: every rank of the data-parallel group must enter. Without
    ZeRO-3 parameters (or with ``gather_deepspeed3_params=False``) it only unwraps."""
    module = _module_of(model)
    params = [p for p in module.parameters() if is_zero_param(p)]
    if not params or not gather_deepspeed3_params:
        yield module
        return
    # As DeepSpeed does: the engine's gather/release module hooks come off for the block (the
    # weights are already whole; each forward would only walk them) and go back on after.
    coordinator = getattr(getattr(model, "strategy", None), "coordinator", None)
    with GatheredParameters(params):
        if coordinator is not None:
            coordinator.remove()
        try:
            yield module
        finally:
            if coordinator is not None:
                coordinator._register_deepspeed_module(coordinator.module)


def empty_partition_cache(engine) -> None:
    """Release the stage-3 parameters the engine's schedule still holds gathered (those held
    by an open ``GatheredParameters`` stay) and empty the accelerator's cache."""
    coordinator = getattr(getattr(engine, "strategy", None), "coordinator", None)
    if coordinator is not None:
        coordinator.release_all()
    gc.collect()
    from ...accelerator import get_accelerator
    get_accelerator().empty_cache()
