"""MiCS: ZeRO-3 sharded within groups of ``mics_shard_size`` ranks, replicated across them.

``zero_optimization.mics_shard_size = m`` splits the data-parallel group (``N`` ranks) into
``N / m`` *shard groups* of ``m`` consecutive ranks. Parameters, gradients and optimizer state
are partitioned over a shard group only (each rank holds ``1/m``, not ``1/N``), so every
parameter gather stays inside one group - one node, when ``m`` is the ranks per node - and the
groups hold identical replicas. Gradients are reduce-scattered inside the shard group, then the
reduced slices are all-reduced across the *replica group* (the ranks with the same position in
every shard group) and averaged over all ``N`` ranks: the update, and so training, is the same
as plain stage 3 over ``N`` ranks. Checkpoints are written in the shared fragment format by the
first shard group (the others write their rank files without fragments), so they load without
MiCS, at any world size, and the other way round.

``mics_hierarchical_params_gather`` is accepted: it changes how DeepSpeed routes a gather that
spans nodes, not what is gathered; here a gather is one collective over the shard group.

:class:`MiCS_Init` is ``zero.Init`` partitioning over the shard group the config names.
"""
from __future__ import annotations

import torch.distributed as dist

from .partition_parameters import Init
from .stage3_comm import _group_ranks

_cache: dict = {}


def shard_and_replica_groups(group, size: int, key: str = "mics_shard_size"):
    """(shard group, replica group) of this rank for shard groups of ``size`` consecutive
    ranks of ``group`` (None, None when ``size`` is the whole group). Collective the first
    time: every rank creates every group, in the same order; later calls reuse them."""
    from ...config.errors import DeepSpeedConfigError
    ranks = _group_ranks(group)
    ws = len(ranks)
    if size <= 0 or ws % size:
        raise DeepSpeedConfigError(f"zero_optimization.{key}={size} must divide the data-parallel world size {ws} "
                                   f"(valid: a divisor of {ws}, typically the number of ranks per node).")
    if size >= ws:
        return None, None
    ck = (tuple(ranks), size)
    if ck not in _cache:
        me = dist.get_rank()
        shard = replica = None
        for i in range(ws // size):
            members = ranks[i * size:(i + 1) * size]
            g = dist.new_group(ranks=members)
            if me in members:
                shard = g
        for j in range(size):
            members = ranks[j::size]
            g = dist.new_group(ranks=members)
            if me in members:
                replica = g
        _cache[ck] = (shard, replica)
    return _cache[ck]


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """``deepspeed.zero.MiCS_Init``: ``zero.Init`` that partitions each parameter over this
    rank's MiCS shard group (``zero_optimization.mics_shard_size`` of the config passed as
    ``config_dict_or_path``/``config``) instead of the whole data-parallel group."""

    def __init__(self, module=None, data_parallel_group=None, sequence_data_parallel_group=None,
                 mem_efficient_linear=True, remote_device=None, pin_memory=False, config_dict_or_path=None,
                 config=None, enabled=True, dtype=None, mpu=None):
        from .partition_parameters import _ensure_dist, _read_config
        shard = data_parallel_group
        if enabled:
            zero = _read_config(config_dict_or_path, config)[0]
            size = zero.mics_shard_size if zero is not None else -1
            if size is None or size <= 0:
                raise ValueError("MiCS_Init: the config must set zero_optimization.mics_shard_size > 0 "
                                 "(pass it as config_dict_or_path).")
            _ensure_dist()
            base = data_parallel_group
            if base is None and mpu is not None:
                base = mpu.get_data_parallel_group()
            if base is None and sequence_data_parallel_group is not None:
                base = sequence_data_parallel_group
            got, _ = shard_and_replica_groups(base, size)
            shard = got if got is not None else base
        super().__init__(module=module, data_parallel_group=shard, mem_efficient_linear=mem_efficient_linear,
                         remote_device=remote_device, pin_memory=pin_memory, config_dict_or_path=config_dict_or_path,
                         config=config, enabled=enabled, dtype=dtype)
