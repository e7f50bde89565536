"""``deepspeed.checkpointing``: the documented activation-checkpointing API.

The implementation lives in :mod:`deepspeed.runtime.activation_checkpointing`.
"""
from deepspeed.runtime.activation_checkpointing.checkpointing import (  # noqa: F401
    CheckpointFunction, CudaRNGStatesTracker, _MODEL_PARALLEL_RNG_TRACKER_NAME, _set_cuda_rng_state, checkpoint,
    configure, get_cuda_rng_tracker, is_configured, model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint, reset)

__all__ = [
    "configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "CheckpointFunction",
    "CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
]
