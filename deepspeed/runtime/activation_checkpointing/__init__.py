"""Activation checkpointing: recompute-in-backward with partitioned, CPU and contiguous storage.

The public API is re-exported as ``deepspeed.checkpointing``.
"""
from .checkpointing import (CheckpointFunction, CudaRNGStatesTracker, checkpoint, configure,  # noqa: F401
                            get_cuda_rng_tracker, is_configured, model_parallel_cuda_manual_seed,
                            model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint, reset)
