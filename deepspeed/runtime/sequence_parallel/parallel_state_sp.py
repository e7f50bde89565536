"""The sequence-parallel ``mpu``: what ``UlyssesSPAttentionHF.register_with_transformers``
returns and ``deepspeed.initialize(mpu=...)`` receives (DeepSpeed's module of the same name).

The groups themselves live in :mod:`deepspeed.utils.groups` (``_create_sequence_parallel_groups``).
Unlike DeepSpeed's module, which aliases the model-parallel queries to the sequence-parallel
group, this one reports no model parallelism (size 1): in this engine the model-parallel group
means tensor parallelism (gradient norms are summed over it, checkpoint files are named by it),
which sequence parallelism is not - its ranks hold whole replicas of the weights.
"""
from __future__ import annotations

from ...utils import groups as _groups


def _state() -> dict:
    st = _groups._sequence_parallel_state()
    if st["sp_size"] <= 1:
        raise RuntimeError("sequence-parallel groups are not initialized: call "
                           "initialize_sequence_parallel(sequence_parallel_size) first (or set "
                           "'sequence_parallel_size' in the DeepSpeed config).")
    return st


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel groups (runs of ``sequence_parallel_size`` consecutive
    ranks) and the matching data-parallel groups. Collective over the world."""
    sp = int(sequence_parallel_size)
    if sp <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size!r}.")
    _groups._create_sequence_parallel_groups(sp)


def model_parallel_is_initialized() -> bool:
    return _groups._sequence_parallel_groups_created()


def get_sequence_parallel_group():
    return _state()["sp_group"]


def get_sequence_parallel_world_size() -> int:
    return _state()["sp_size"]


def get_sequence_parallel_rank() -> int:
    return _state()["sp_ranks"].index(_groups._rank())


def get_sequence_parallel_src_rank() -> int:
    return _state()["sp_ranks"][0]


def get_sequence_data_parallel_group():
    return _state()["sdp_group"]


def get_sequence_data_parallel_world_size() -> int:
    return len(_state()["sdp_ranks"])


def get_sequence_data_parallel_rank() -> int:
    return _state()["sdp_ranks"].index(_groups._rank())


def get_data_parallel_group():
    """Data parallelism without the sequence dimension: ranks that see different batches."""
    return _state()["dp_group"]


def get_data_parallel_world_size() -> int:
    return len(_state()["dp_ranks"])


def get_data_parallel_rank() -> int:
    return _state()["dp_ranks"].index(_groups._rank())


def get_model_parallel_group():
    return None


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0
