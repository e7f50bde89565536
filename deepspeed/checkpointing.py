"""``deepspeed.checkpointing``: the documented activation-checkpointing API.

As in DeepSpeed, ``deepspeed.checkpointing`` IS the module
:mod:`deepspeed.runtime.activation_checkpointing.checkpointing` (this file puts that module in its
place), so its module-level state (``PARTITION_ACTIVATIONS``, ``CPU_CHECKPOINT``, ``mpu``, ...) is one
and the same under both names.
"""
import sys

from deepspeed.runtime.activation_checkpointing import checkpointing as _implementation

sys.modules[__name__] = _implementation
