"""Sequence parallelism (DeepSpeed-Ulysses) wiring, and ALST for Hugging Face models.

Parts:

* ``parallel_state_sp`` - the ``mpu`` object DeepSpeed hands to ``deepspeed.initialize``
  (``initialize_sequence_parallel`` and the ``get_sequence_parallel_*`` /
  ``get_sequence_data_parallel_*`` / ``get_data_parallel_*`` queries) over the groups that
  :mod:`deepspeed.utils.groups` creates.
* ``engine_groups`` - what the engine asks once at construction: the mpu to use (one is
  made from the config's ``sequence_parallel_size``), and the group ZeRO partitions and
  reduces over (sequence x data parallel) with the factor that sums gradients over the
  sequence dimension and averages them over the data dimension.
* ``ulysses_sp`` - ALST: ``UlyssesSPAttentionHF`` (Ulysses attention behind Transformers'
  attention-function registry), ``UlyssesSPDataLoaderAdapter`` (shards batches on the
  sequence dimension), and the tiled computations ``TiledMLP``, ``TiledFusedLogitsLoss``,
  ``SequenceTiledCompute`` / ``sequence_tiled_compute``, ``TiledLoss``.

The all-to-all itself and ``DistributedAttention`` live in :mod:`deepspeed.sequence.layer`.
"""
