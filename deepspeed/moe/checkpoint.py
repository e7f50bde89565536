"""MoE checkpoints: expert weights in DeepSpeed's per-expert files, reloadable at any ep size.

Layout of one tag directory (beside the usual files)::

    mp_rank_00_model_states.pt                         dense weights only (experts removed)
    layer_<L>_expert_<E>_mp_rank_00_model_states.pt    one per global expert E of MoE layer L:
                                                       its weights, keys with the *global* expert id
    expp_rank_<r>_edp_rank_<d>_<group>_mp_rank_00_optim_states.pt
                                                       expert optimizer fragments (fp32 masters +
                                                       state), parameter names with global expert ids

Global ids make a checkpoint independent of the expert-parallel layout: on load each
rank reads the files of the experts it now holds (``ep_rank * num_local + j``), and the
optimizer fragments are matched by global name, so a checkpoint saved at ep=2 x dp=2
loads at ep=4 or ep=1 (any data-parallel size, any ZeRO stage 0-2). The files are
written through the checkpoint writer, so they are committed atomically with the rest.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, List, Tuple

import torch.distributed as dist

from ..runtime.checkpoint.errors import CheckpointError
from ..runtime.checkpoint.module_parts import register_module_part
from ..runtime.checkpoint.universal import FORMAT, VERSION, FragmentIndex, _load
from ..utils import groups
from .utils import is_moe_param

_EXPERT_OPTIM_RE = re.compile(r"^expp_rank_(\d+)_edp_rank_(\d+)_(.+)_mp_rank_(\d+)_optim_states\.pt$")


def _moe_layers(module) -> List[Tuple[str, object]]:
    from .layer import MoE
    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoE)]


def _ep_rank(layer) -> int:
    if layer.ep_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return 0
    return groups.get_expert_parallel_rank(layer.expert_group_name)


def expert_names(module) -> Dict[str, Tuple[int, int, str]]:
    """local parameter/buffer name -> (moe layer id, global expert id, global name)."""
    out = {}
    for layer_id, (prefix, layer) in enumerate(_moe_layers(module)):
        base = "deepspeed_moe.experts.deepspeed_experts"
        base = f"{prefix}.{base}" if prefix else base
        first = _ep_rank(layer) * layer.num_local_experts
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for n, _ in list(expert.named_parameters()) + list(expert.named_buffers()):
                out[f"{base}.{j}.{n}"] = (layer_id, first + j, f"{base}.{first + j}.{n}")
    return out


def global_param_names(module) -> Dict[int, str]:
    """id(expert parameter) -> its name with the global expert id."""
    names = expert_names(module)
    return {id(p): names[n][2] for n, p in module.named_parameters() if n in names}


def expert_file_name(layer_id: int, expert_id: int, mp_rank: int) -> str:
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_optim_file_name(ep_rank: int, edp_rank: int, group_name: str, mp_rank: int) -> str:
    return f"expp_rank_{ep_rank}_edp_rank_{edp_rank}_{group_name}_mp_rank_{mp_rank:02d}_optim_states.pt"


# ---------------------------------------------------------------- module weights
def split_and_save_experts(engine, writer, module_sd: dict) -> dict:
    """Write this rank's experts (expert-data-parallel rank 0 only) into per-expert files
    and return the dense part of ``module_sd``."""
    names = expert_names(engine.module)
    if not names:
        return module_sd
    per_file: Dict[Tuple[int, int], OrderedDict] = {}
    for local, (layer_id, expert_id, glob) in names.items():
        if local in module_sd:
            per_file.setdefault((layer_id, expert_id), OrderedDict())[glob] = module_sd[local]
    layers = _moe_layers(engine.module)
    for (layer_id, expert_id), sd in per_file.items():
        layer = layers[layer_id][1]
        edp_rank = (groups.get_expert_data_parallel_rank(layer.expert_group_name)
                    if dist.is_available() and dist.is_initialized() else 0)
        if edp_rank == 0:
            writer.save(expert_file_name(layer_id, expert_id, engine.mp_rank),
                        {k: v.detach().cpu().clone() for k, v in sd.items()})
    return OrderedDict((k, v) for k, v in module_sd.items() if k not in names)


def merge_local_experts(engine, reader, module_sd: dict) -> dict:
    """``module_sd`` (dense weights) plus this rank's experts read from their files."""
    names = expert_names(engine.module)
    if not names or all(k in module_sd for k in names):
        return module_sd
    out = OrderedDict(module_sd)
    cache = {}
    for local, (layer_id, expert_id, glob) in names.items():
        fname = expert_file_name(layer_id, expert_id, engine.mp_rank)
        if fname not in cache:
            if not reader.exists(fname):
                saved = reader.list(prefix=f"layer_{layer_id}_expert_", suffix="_model_states.pt")
                raise CheckpointError(
                    f"MoE checkpoint '{reader.path}' has no file '{fname}' for global expert {expert_id} of MoE "
                    f"layer {layer_id} ({len(saved)} expert files for that layer were saved). The model must have "
                    f"the same total num_experts per layer as the saved one (ep_size may differ).")
            cache[fname] = reader.load(fname)
        out[local] = cache[fname][glob]
    return out


# ---------------------------------------------------------------- optimizer fragments
def _rename_state(st: dict, rename: Dict[str, str], keep) -> dict:
    """A rank state restricted to names for which ``keep(name)`` holds, renamed."""
    params = {rename.get(n, n): e for n, e in st["params"].items() if keep(n)}
    groups_ = [dict(g, params=[rename.get(n, n) for n in g["params"] if keep(n)]) for g in st["param_groups"]]
    return dict(st, params=params, param_groups=groups_)


def merged_index(states: List[dict], where: str) -> FragmentIndex:
    """One FragmentIndex over rank states of different files (expert-parallel ranks, the
    dense file): fragments and group parameter lists are unioned by group position."""
    if not states:
        raise CheckpointError(f"'{where}' holds no optimizer files to load.")
    first = states[0]
    params, group_lists = {}, []
    for st in states:
        for n, e in st["params"].items():
            params.setdefault(n, {"shape": e["shape"], "fragments": []})["fragments"].extend(e["fragments"])
        for i, g in enumerate(st["param_groups"]):
            while len(group_lists) <= i:
                group_lists.append(dict(g, params=[]))
            group_lists[i]["params"] += [n for n in g["params"] if n not in group_lists[i]["params"]]
    merged = dict(first, format=FORMAT, version=VERSION, zero_stage=0, dp_world_size=1, dp_rank=0,
                  params=params, param_groups=group_lists)
    return FragmentIndex(where, states=[merged])


def expert_optim_states(path: str, mp_rank: int = 0) -> List[dict]:
    import os
    found = []
    for n in sorted(os.listdir(path)):
        m = _EXPERT_OPTIM_RE.match(n)
        if m and int(m.group(4)) == mp_rank:
            found.append(_load(os.path.join(path, n)))
    return found


def _expert_group_rank(name: str):
    if dist.is_available() and dist.is_initialized():
        return groups.get_expert_parallel_rank(name), groups.get_expert_data_parallel_rank(name)
    return 0, 0


def save_moe_optimizer_state(strategy, writer, dp_rank, mp_rank) -> None:
    """Dense fragments as usual; expert fragments, with global names, in expert files."""
    dense = strategy.parts[0][1]
    dense.save_optimizer_state(writer, dp_rank, mp_rank)
    for name, sub in strategy.parts[1:]:
        if sub.partition_master or sub.rank == 0:
            ep_rank, edp_rank = _expert_group_rank(name)
            st = sub._rank_state(sub.part_rank, mp_rank)
            writer.save(expert_optim_file_name(ep_rank, edp_rank, name, mp_rank), st)


def load_moe_optimizer_state(strategy, reader, load_optimizer_states=True) -> None:
    dense = strategy.parts[0][1]
    dense.load_optimizer_state(reader, load_optimizer_states)
    mp = strategy.ctx.mpu.get_model_parallel_rank() if strategy.ctx.mpu is not None else 0
    idx = merged_index(expert_optim_states(reader.path, mp), reader.path)
    for _, sub in strategy.parts[1:]:
        sub._load_from_index(idx, load_optimizer_states)


def globalize_slot_names(strategy_sub, module) -> None:
    """Expert sub-strategies name their slots with global expert ids (checkpoint keys)."""
    glob = global_param_names(module)
    for s in strategy_sub.slots:
        s.name = glob.get(id(s.param), s.name)


# ---- stage 0 in fp32: one torch optimizer over dense and expert parameters ----------
class _NamedAs:
    """A stand-in module whose named_parameters() use global expert names."""

    def __init__(self, module):
        self._m = module
        self._glob = global_param_names(module)

    def named_parameters(self):
        for n, p in self._m.named_parameters():
            yield self._glob.get(id(p), n), p

    def parameters(self):
        return self._m.parameters()


def save_stage0_moe_optimizer(strategy, writer, dp_rank, mp_rank) -> None:
    from ..runtime.checkpoint.universal import optim_file_name, rank_state_from_torch_optimizer
    if strategy.optimizer is None:
        return
    named = _NamedAs(strategy.module)
    expert_ids = {id(p) for p in strategy.module.parameters() if is_moe_param(p)}
    expert_name_set = {named._glob[i] for i in expert_ids}
    st = rank_state_from_torch_optimizer(named, strategy.optimizer, zero_stage=0,
                                         dp_world_size=strategy.ctx.dp_world_size, mp_rank=mp_rank)
    if dp_rank == 0:
        writer.save(optim_file_name(0, mp_rank), _rename_state(st, {}, lambda n: n not in expert_name_set))
    by_group = OrderedDict()
    for p in strategy.module.parameters():
        if is_moe_param(p):
            by_group.setdefault(p.group_name, set()).add(named._glob[id(p)])
    for name, gnames in by_group.items():
        ep_rank, edp_rank = _expert_group_rank(name)
        if edp_rank == 0:
            writer.save(expert_optim_file_name(ep_rank, 0, name, mp_rank),
                        _rename_state(st, {}, lambda n, g=gnames: n in g))


def load_stage0_moe_optimizer(strategy, reader, load_optimizer_states=True) -> None:
    from ..runtime.checkpoint.universal import load_torch_optimizer_from_index
    if not load_optimizer_states or strategy.optimizer is None:
        return
    mp = strategy.ctx.mpu.get_model_parallel_rank() if strategy.ctx.mpu is not None else 0
    dense = FragmentIndex(reader.path, mp_rank=mp)
    idx = merged_index(list(dense.states) + expert_optim_states(reader.path, mp), reader.path)
    load_torch_optimizer_from_index(_NamedAs(strategy.module), strategy.optimizer, idx, f"loading '{reader.path}'")


def index_with_experts(path: str, idx: FragmentIndex, mp_rank: int = 0) -> FragmentIndex:
    """``idx`` (dense fragments) extended by the expert optimizer files of ``path``, if any
    (zero_to_fp32 consolidates MoE checkpoints through this)."""
    extra = expert_optim_states(path, mp_rank)
    if not extra:
        return idx
    return merged_index(list(idx.states) + extra, path)


# the engine's checkpoint code writes and reads expert files through this part
register_module_part("moe_experts", split=split_and_save_experts, merge=merge_local_experts)
