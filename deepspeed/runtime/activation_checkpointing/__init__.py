"""Activation checkpointing: recompute-in-backward with partitioned, CPU and contiguous storage.

The public API is re-exported as ``deepspeed.checkpointing``. Parts:

* ``checkpointing``: ``checkpoint`` (reentrant and non-reentrant), ``configure``, DeepSpeed's module globals;
* ``settings``: the validated options; ``storage``: how a checkpointed call keeps its inputs
  (partitioned, in host memory, in a contiguous buffer); ``rng``: the RNG streams replayed in the recompute;
* ``offload_activations``: ``CheckpointHiddenStatesOffload``, saved-tensor hooks that move the marked
  checkpoint inputs of non-reentrant checkpointing to host memory until backward, over
  ``offload_engine`` (host buffer pool, side-stream copies) and ``hidden_states_marker`` (marks a
  Transformers ``GradientCheckpointingLayer``'s hidden states). Imported on demand, not from here.
"""
from .checkpointing import (CheckpointFunction, CudaRNGStatesTracker, checkpoint, configure,  # noqa: F401
                            get_cuda_rng_tracker, is_configured, model_parallel_cuda_manual_seed,
                            model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint, reset)
