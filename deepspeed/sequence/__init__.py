"""DeepSpeed-Ulysses sequence parallelism.

Parts:

* ``layer`` - ``DistributedAttention``: the all-to-all that turns sequence-sharded
  q/k/v into head-sharded full-sequence q/k/v before a local attention, and back after it
  (``_SeqAllToAll``, differentiable; ``single_all_to_all``).
* ``cross_entropy`` - ``vocab_sequence_parallel_cross_entropy``: per-token losses of
  sequence-sharded logits gathered over the sequence-parallel group, with the backward that
  keeps each rank's own tokens.

The groups (``deepspeed.utils.groups._get_sequence_parallel_*``), the engine wiring and ALST
for Hugging Face models live in :mod:`deepspeed.runtime.sequence_parallel`.
"""
from .layer import DistributedAttention  # noqa: F401
