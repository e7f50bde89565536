"""Stage-3 optimizer checkpoints in the shared fragment format
(:mod:`deepspeed.runtime.checkpoint.universal`).

Each rank writes, per trainable parameter name, the elements of the flattened
parameter it owns (``[rank * part, min(numel, (rank + 1) * part))``, padding never
written) with their fp32 master values and Adam moments. Loading reads exactly the
range the loading rank owns from whichever files hold it, so a stage-3 checkpoint
loads at any world size and at any stage, and stage 0/1/2 checkpoints load here.
"""
from __future__ import annotations

import torch

from ..checkpoint.errors import CheckpointError
from ..checkpoint.universal import (FragmentIndex, apply_group_hyperparameters, load_state_keeping_groups,
                                    make_rank_state, optim_file_name, share_saved_tensors)
from .partitioned_param import owned_range


def _names(module):
    out = {}
    for name, p in module.named_parameters():
        out.setdefault(id(p), name)
    return out


def save_stage3_optimizer_state(strategy, writer, dp_rank: int, mp_rank: int) -> None:
    name = optim_file_name(dp_rank, mp_rank)
    if strategy.parts.nvme is None:
        writer.save(name, stage3_rank_state(strategy, dp_rank, mp_rank))
        return
    # offload_optimizer nvme: the fragments are views of memory-mapped swap files, saved
    # without a copy, so torch.save streams the state from the page cache (file-backed
    # pages the kernel can drop) instead of holding it in anonymous memory
    with share_saved_tensors():
        writer.save(name, stage3_rank_state(strategy, dp_rank, mp_rank, mapped=True))


def stage3_rank_state(strategy, dp_rank: int, mp_rank: int, mapped: bool = False) -> dict:
    """This rank's optimizer-side state in the shared fragment format (``mapped``: with NVMe,
    views of the memory-mapped swap files, to be saved at once and dropped)."""
    names = _names(strategy.module)
    opt = strategy.inner
    parts = strategy.parts
    params, group_scalars = {}, [dict() for _ in parts.group_hparams]
    # MiCS: the replicas hold the same partitions; the first shard group writes the fragments
    replica = getattr(strategy, "replica_comm", None)
    writes = replica is None or replica.rank == 0
    for ci, c in enumerate(parts.chunks):
        master, per_elem, scalars = parts.chunk_state(ci, opt, mapped=mapped)   # from the swap files with NVMe
        if scalars and not group_scalars[c.group]:
            group_scalars[c.group] = scalars
        for p, off in zip(c.params, c.offsets):
            lo, hi = owned_range(p)
            k = hi - lo
            if k <= 0 or not writes:
                continue
            params[names[id(p)]] = {"shape": list(p.ds_shape), "fragments": [{
                "offset": lo, "numel": k, "fp32": master[off:off + k],
                "state": {key: v[off:off + k] for key, v in per_elem.items()}}]}
    groups = []
    live_groups = opt.param_groups if opt is not None else [dict(h) for h in parts.group_hparams]
    for gi, g in enumerate(live_groups):
        hp = {k: v for k, v in g.items() if k != "params"}
        hp["params"] = [names[id(p)] for c in parts.chunks if c.group == gi for p in c.params]
        groups.append(hp)
    rank_state = make_rank_state(
        zero_stage=3, dp_world_size=strategy.ctx.dp_world_size, dp_rank=dp_rank, mp_rank=mp_rank,
        dtype=strategy.dtype, params=params, param_groups=groups, group_state=group_scalars,
        optimizer_class=type(opt).__name__ if opt is not None else None,
        loss_scaler=strategy.scaler.state_dict() if strategy.fp16 else None,
        extra={"persistence_threshold": strategy.ctx.config.zero.param_persistence_threshold})
    return rank_state


def load_stage3_optimizer_state(strategy, reader, load_optimizer_states: bool = True) -> None:
    if not load_optimizer_states:
        strategy.after_module_load()
        return
    mp_rank = strategy.ctx.mpu.get_model_parallel_rank() if strategy.ctx.mpu is not None else 0
    load_stage3_from_index(strategy, FragmentIndex(reader.path, mp_rank), f"Checkpoint '{reader.path}'")


def _read_chunk(idx, names, c, master, per_elem, keys, from_fp32: bool, where: str) -> None:
    """The elements this rank owns of chunk ``c``'s parameters, from the checkpoint into
    ``master`` and ``per_elem`` (chunk-indexed; read in place, no temporaries)."""
    for p, off in zip(c.params, c.offsets):
        name = names[id(p)]
        lo, hi = owned_range(p)
        k = hi - lo
        if from_fp32 and k > 0:
            idx.read(name, "fp32", lo, k, out=master[off:off + k])
        if set(idx.state_keys(name)) != set(keys):
            raise CheckpointError(f"{where}: parameter '{name}' has optimizer state "
                                  f"{sorted(idx.state_keys(name))}, its neighbours {sorted(keys)}.")
        for key in keys:
            if k > 0:
                idx.read(name, key, lo, k, out=per_elem[key][off:off + k])


def load_stage3_from_index(strategy, idx: FragmentIndex, where: str) -> None:
    """Restore masters, optimizer state and hyperparameters (into the live group dicts)
    from fragments of any stage and world size."""
    names = _names(strategy.module)
    parts = strategy.parts
    idx.require([names[id(p)] for c in parts.chunks for p in c.params
                 if idx.complete or owned_range(p)[1] > owned_range(p)[0]])
    from_fp32 = strategy.ctx.config.zero.load_from_fp32_weights
    opt = strategy.inner
    sd_state = {}
    for index, c in enumerate(parts.chunks):
        keys = idx.state_keys(names[id(c.params[0])])
        if parts.nvme is not None:
            # straight into a swap buffer (written to the chunk's file on exit): per-element
            # state to the swap files, scalars to the optimizer below
            with parts.nvme.chunk_for_load(index, keys, where) as (master, per_elem):
                _read_chunk(idx, names, c, master, per_elem, keys, from_fp32, where)
            st = {}
        else:
            master = parts.master_for_load(index)
            per_elem = {key: torch.zeros(c.numel, dtype=torch.float32) for key in keys}
            _read_chunk(idx, names, c, master, per_elem, keys, from_fp32, where)
            st = dict(per_elem)
        if keys:
            for key, v in idx.group_state[c.group].items():
                st[key] = v.clone() if torch.is_tensor(v) else torch.tensor(float(v))
            sd_state[index] = st
    if not from_fp32:
        parts.refresh_master_from_partitions()
    if opt is not None:
        saved = idx.param_groups
        groups = []
        for gi, g in enumerate(opt.param_groups):
            n = len(g["params"])
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(sum(len(x["params"]) for x in opt.param_groups[:gi]),
                                                 sum(len(x["params"]) for x in opt.param_groups[:gi]) + n))))
        apply_group_hyperparameters(saved, groups, where)
        load_state_keeping_groups(opt, {"state": sd_state, "param_groups": groups})
    if strategy.fp16 and idx.loss_scaler:
        strategy.scaler.load_state_dict(idx.loss_scaler)
    parts.copy_master_to_partitions()
    strategy.coordinator.release_all()
    strategy.refresh_persistent()
