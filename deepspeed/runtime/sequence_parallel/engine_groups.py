"""What the engine asks about sequence parallelism, once, at construction.

DeepSpeed's rule (``engine._reduce_non_expert_gradients``, ``stage_1_and_2``, ``stage3``):
ZeRO partitions and reduces over the *sequence-data-parallel* group (every rank holding a
replica of the weights, sequence-parallel x data-parallel), and gradients are divided by the
data-parallel size only, ``world(sdp) / sequence_parallel_size``: **summed over the
sequence-parallel ranks, averaged over the data-parallel ones**. Each sequence-parallel rank
back-propagates its share of the full-sequence loss (its tokens), so the sum over the
sequence ranks is the gradient of the whole sequence.

The strategies here average over the group they reduce over; the engine multiplies the loss it
back-propagates by :attr:`SequenceParallelLayout.grad_factor` (``sequence_parallel_size``),
which gives the same sum-over-sequence, mean-over-data result for every ZeRO stage without a
second divisor inside each strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...utils import groups

CONFIG_KEY = "sequence_parallel_size"


def _positive(key, val) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        from ...config.errors import DeepSpeedConfigError
        raise DeepSpeedConfigError(f"Invalid value for '{key}': {val!r}. It must be a positive integer; "
                                   f"data_parallel_size x sequence_parallel_size must equal the world size.")
    return val


def _config_sizes(config):
    """(``sequence_parallel_size``, ``data_parallel_size`` or None) from a config dict, path or
    DeepSpeedConfig."""
    if config is None:
        return 1, None
    raw = getattr(config, "raw", None)
    if raw is None:
        from ...config.ds_config import load_config_source
        raw = load_config_source(config) if not isinstance(config, dict) else config
    if not isinstance(raw, dict):
        return 1, None
    sp = _positive(CONFIG_KEY, raw.get(CONFIG_KEY, 1))
    dp = raw.get("data_parallel_size")
    return sp, (_positive("data_parallel_size", dp) if dp is not None else None)


def resolve_sequence_parallel_mpu(mpu, config, mesh_param=None):
    """The mpu the engine should use. With ``sequence_parallel_size`` > 1 in the config (or
    ``deepspeed.initialize(mesh_param=(data_parallel_size, sequence_parallel_size))``, DeepSpeed's
    device-mesh form) and no mpu, the sequence-parallel groups are created and DeepSpeed's
    ``parallel_state_sp`` mpu is returned; an mpu that already provides sequence parallelism (the
    one ``UlyssesSPAttentionHF.register_with_transformers`` returns) must agree with the config."""
    sp, dp = _config_sizes(config)
    if mesh_param is not None:
        try:
            m_dp, m_sp = (int(v) for v in mesh_param)
        except (TypeError, ValueError):
            raise ValueError(f"deepspeed.initialize: mesh_param must be (data_parallel_size, sequence_parallel_size), "
                             f"got {mesh_param!r}.") from None
        if sp > 1 and sp != m_sp:
            raise ValueError(f"deepspeed.initialize: mesh_param {tuple(mesh_param)} has sequence_parallel_size {m_sp} "
                             f"but the config's '{CONFIG_KEY}' is {sp}.")
        sp, dp = m_sp, m_dp
    if dp is not None and mpu is None:
        world = groups._world()
        if dp * sp != world:
            from ...config.errors import DeepSpeedConfigError
            raise DeepSpeedConfigError(f"data_parallel_size {dp} x sequence_parallel_size {sp} = {dp * sp} must equal "
                                       f"the world size {world}.")
    has_sp = mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size")
    if has_sp:
        have = int(mpu.get_sequence_parallel_world_size())
        if sp > 1 and sp != have:
            from ...config.errors import DeepSpeedConfigError
            raise DeepSpeedConfigError(f"'{CONFIG_KEY}' is {sp} but the mpu passed to deepspeed.initialize has "
                                       f"sequence-parallel groups of size {have}; make them agree.")
        return mpu
    if sp <= 1:
        return mpu
    if mpu is not None:
        raise ValueError(f"'{CONFIG_KEY}': {sp} cannot be combined with an mpu that has no sequence-parallel groups "
                         f"({type(mpu).__name__}, e.g. pipeline or tensor parallelism); pass an mpu that provides "
                         f"get_sequence_parallel_group/_world_size/_rank, or drop '{CONFIG_KEY}'.")
    from . import parallel_state_sp
    parallel_state_sp.initialize_sequence_parallel(sp)
    return parallel_state_sp


@dataclass
class SequenceParallelLayout:
    sp_group: Any            # this rank's sequence-parallel group (None without SP)
    sp_size: int
    sdp_group: Any           # ZeRO's partition/reduction group: sequence x data parallel
    sdp_world_size: int
    sdp_rank: int
    grad_factor: float       # multiplies the back-propagated loss (see the module docstring)


def sequence_parallel_layout(module, dp_group, dp_world_size: int, dp_rank: int) -> SequenceParallelLayout:
    """The layout for an engine whose mpu is already set in :mod:`deepspeed.comm.groups`. Only an
    mpu with sequence-parallel groups turns it on (groups created earlier in the process for
    another engine do not)."""
    from ...comm import groups as comm_groups
    mpu = comm_groups.get_mpu()
    sp = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
    if sp <= 1:
        return SequenceParallelLayout(None, 1, dp_group, dp_world_size, dp_rank, 1.0)
    if any(getattr(p, "allreduce", True) is False for p in module.parameters()):
        raise ValueError("sequence parallelism (sequence_parallel_size > 1) is not supported together with "
                         "Mixture-of-Experts layers in this version.")
    return SequenceParallelLayout(groups.get_sequence_parallel_group(), sp,
                                  groups.get_sequence_data_parallel_group(),
                                  int(groups.get_sequence_data_parallel_world_size()),
                                  int(groups.get_sequence_data_parallel_rank()), float(sp))
