"""Parallel process groups, under the names DeepSpeed's ecosystem imports them by.

Two kinds live here:

* the plain data / model (tensor) / sequence-parallel queries - these delegate to
  :mod:`deepspeed.comm.groups`, which takes them from an ``mpu`` when one is given;
* the **expert** groups of Mixture of Experts (``deepspeed.moe``). Per model-parallel
  slot, the data-parallel ranks are split into *expert-parallel* groups of ``ep_size``
  consecutive data-parallel ranks (the ranks whose experts together make up all
  experts of a layer; tokens are exchanged inside one with all-to-all) and
  *expert-data-parallel* groups of the ranks that hold the same experts (their
  gradients are averaged over it). Groups are named ``"ep_size_<N>"``, so layers with
  different ``ep_size`` can coexist.

Example, 8 ranks, tensor-parallel 2, ep_size 2 (data-parallel ranks of tp slot 0 are
0,2,4,6)::

    expert-parallel groups      [0,2] [4,6] [1,3] [5,7]
    expert-data-parallel groups [0,4] [2,6] [1,5] [3,7]
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch.distributed as dist

from ..comm import groups as _cg

_EXPERT_PARALLEL_GROUP: Dict[str, object] = {}
_EXPERT_DATA_PARALLEL_GROUP: Dict[str, object] = {}
_EXPERT_PARALLEL_RANKS: Dict[str, List[int]] = {}
_EXPERT_DATA_PARALLEL_RANKS: Dict[str, List[int]] = {}
_MAX_EXPERT_SIZE = None
_MAX_EXPERT_SIZE_NAME = None


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world() -> int:
    return dist.get_world_size() if _initialized() else 1


def _rank() -> int:
    return dist.get_rank() if _initialized() else 0


# ---------------------------------------------------------------- data / model / sequence parallel
def get_data_parallel_group(mpu=None):
    return _cg.get_data_parallel_group(mpu)


def get_data_parallel_world_size(mpu=None) -> int:
    return _cg.get_data_parallel_world_size(mpu)


def get_data_parallel_rank(mpu=None) -> int:
    return _cg.get_data_parallel_rank(mpu)


def get_model_parallel_group(mpu=None):
    return _cg.get_model_parallel_group(mpu)


def get_model_parallel_world_size(mpu=None) -> int:
    return _cg.get_model_parallel_world_size(mpu)


def get_model_parallel_rank(mpu=None) -> int:
    return _cg.get_model_parallel_rank(mpu)


def _mpu_call(name, default):
    mpu = _cg.get_mpu()
    fn = getattr(mpu, name, None) if mpu is not None else None
    return fn() if fn is not None else default


def get_tensor_model_parallel_group():
    return _mpu_call("get_tensor_model_parallel_group", get_model_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    return _mpu_call("get_tensor_model_parallel_world_size", get_model_parallel_world_size())


def get_tensor_model_parallel_rank() -> int:
    return _mpu_call("get_tensor_model_parallel_rank", get_model_parallel_rank())


def get_sequence_parallel_group():
    """The sequence-parallel (Ulysses) group: from an mpu that provides one, else the groups
    made by :func:`_create_sequence_parallel_groups` (``sequence_parallel_size`` in the config,
    or ``UlyssesSPAttentionHF.register_with_transformers``); without either, None (size 1)."""
    return _mpu_call("get_sequence_parallel_group", _SP_STATE["sp_group"])


def get_sequence_parallel_world_size() -> int:
    return _mpu_call("get_sequence_parallel_world_size", _SP_STATE["sp_size"])


def get_sequence_parallel_rank() -> int:
    return _mpu_call("get_sequence_parallel_rank", _sp_rank_in(_SP_STATE["sp_ranks"]))


def get_sequence_data_parallel_group():
    """The group ZeRO partitions over and reduces gradients over: every rank that holds a
    replica of the weights, sequence-parallel x data-parallel."""
    if _SP_STATE["sp_size"] > 1 and _cg.get_mpu() is None:
        return _SP_STATE["sdp_group"]
    return _mpu_call("get_sequence_data_parallel_group", get_data_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    if _SP_STATE["sp_size"] > 1 and _cg.get_mpu() is None:
        return len(_SP_STATE["sdp_ranks"])
    return _mpu_call("get_sequence_data_parallel_world_size", get_data_parallel_world_size())


def get_sequence_data_parallel_rank() -> int:
    if _SP_STATE["sp_size"] > 1 and _cg.get_mpu() is None:
        return _sp_rank_in(_SP_STATE["sdp_ranks"])
    return _mpu_call("get_sequence_data_parallel_rank", get_data_parallel_rank())


# ---------------------------------------------------------------- sequence parallel groups
# Layout (DeepSpeed's parallel_state_sp and its (data, sequence) device mesh): sequence-parallel
# groups are runs of ``sp`` consecutive ranks; the data-parallel groups take one rank from each
# run (stride ``sp``); the sequence-data-parallel group is every rank. World 4, sp 2:
#     sequence-parallel [0,1] [2,3]    data-parallel [0,2] [1,3]    sequence-data-parallel [0,1,2,3]
_SP_STATE: Dict[str, object] = {"sp_size": 1, "sp_group": None, "sp_ranks": None, "dp_group": None,
                                "dp_ranks": None, "sdp_group": None, "sdp_ranks": None}


def _sp_rank_in(ranks) -> int:
    return ranks.index(_rank()) if ranks else 0


def _get_sequence_parallel_ranks(world_size: int, sequence_parallel_size: int
                                 ) -> Tuple[List[List[int]], List[List[int]], List[int]]:
    """(sequence-parallel groups, data-parallel groups, sequence-data-parallel ranks)."""
    ws, sp = int(world_size), int(sequence_parallel_size)
    if sp < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sp}.")
    if ws % sp:
        raise ValueError(f"sequence_parallel_size {sp} must divide the world size {ws}; valid values: "
                         f"{[d for d in range(1, ws + 1) if ws % d == 0]}.")
    sp_groups = [list(range(i, i + sp)) for i in range(0, ws, sp)]
    dp_groups = [list(range(j, ws, sp)) for j in range(sp)]
    return sp_groups, dp_groups, list(range(ws))


def _create_sequence_parallel_groups(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel, data-parallel (excluding the sequence dimension) and
    sequence-data-parallel groups. Collective: every rank calls it. A second call with the
    same size is a no-op; a different size is refused (call ``_reset_sequence_parallel_groups``)."""
    sp = int(sequence_parallel_size)
    if _SP_STATE["sp_size"] > 1:
        if _SP_STATE["sp_size"] == sp:
            return
        raise RuntimeError(f"sequence-parallel groups of size {_SP_STATE['sp_size']} already exist; cannot "
                           f"create groups of size {sp} in the same process.")
    if sp == 1:
        return
    if not _initialized():
        raise RuntimeError("sequence parallelism needs torch.distributed: call deepspeed.init_distributed() "
                           "before creating sequence-parallel groups.")
    sp_groups, dp_groups, sdp = _get_sequence_parallel_ranks(_world(), sp)
    me = _rank()
    state = {"sp_size": sp, "sdp_ranks": sdp, "sdp_group": dist.group.WORLD}
    for ranks in sp_groups:  # new_group is collective over the world: every rank creates every group
        g = dist.new_group(ranks)
        if me in ranks:
            state["sp_group"], state["sp_ranks"] = g, ranks
    for ranks in dp_groups:
        g = dist.new_group(ranks)
        if me in ranks:
            state["dp_group"], state["dp_ranks"] = g, ranks
    _SP_STATE.update(state)


def _sequence_parallel_groups_created() -> bool:
    return _SP_STATE["sp_size"] > 1


def _sequence_parallel_state() -> dict:
    """The created layout (a copy): sp_size, and for this rank sp_group/sp_ranks (its
    sequence-parallel group), dp_group/dp_ranks (its data-parallel group, excluding the sequence
    dimension), sdp_group/sdp_ranks (sequence-data-parallel: every rank)."""
    return dict(_SP_STATE)


def _reset_sequence_parallel_groups() -> None:
    """Forget the sequence-parallel groups (tests that re-initialise torch.distributed in-process)."""
    _SP_STATE.update({"sp_size": 1, "sp_group": None, "sp_ranks": None, "dp_group": None, "dp_ranks": None,
                      "sdp_group": None, "sdp_ranks": None})


def _get_broadcast_src_rank() -> int:
    """Global rank of data-parallel rank 0 of this rank's data-parallel group."""
    grp = get_data_parallel_group()
    if grp is None or grp is dist.group.WORLD:
        return 0
    return dist.get_global_rank(grp, 0)


def _clone_world_group():
    if not _initialized():
        raise RuntimeError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() first.")
    return dist.new_group(ranks=list(range(_world())))


# DeepSpeed's underscore spellings
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_group = get_model_parallel_group
_get_model_parallel_world_size = get_model_parallel_world_size
_get_model_parallel_rank = get_model_parallel_rank
_get_sequence_parallel_group = get_sequence_parallel_group
_get_sequence_parallel_world_size = get_sequence_parallel_world_size
_get_sequence_parallel_rank = get_sequence_parallel_rank
_get_sequence_data_parallel_group = get_sequence_data_parallel_group
_get_sequence_data_parallel_world_size = get_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = get_sequence_data_parallel_rank


# ---------------------------------------------------------------- expert parallel
def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False
                               ) -> Tuple[List[List[int]], List[List[int]]]:
    """Rank lists of the expert-parallel and expert-data-parallel groups (see the module
    docstring). Ranks are laid out tensor-parallel fastest, then data, then pipeline;
    ``use_data_before_expert_parallel_`` makes the expert-data-parallel dimension the
    faster one inside a data-parallel group."""
    tp, ep, pp = int(tensor_parallel_size_), int(expert_parallel_size_), int(pipeline_parallel_size_)
    if tp < 1 or ep < 1 or pp < 1:
        raise ValueError(f"_get_expert_parallel_ranks: sizes must be >= 1 (tensor {tp}, expert {ep}, pipeline {pp}).")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor-parallel {tp} x pipeline {pp}.")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(f"ep_size {ep} must divide the data-parallel world size {dp} "
                         f"(world {world_size} / tensor-parallel {tp} / pipeline {pp}).")
    stage_size = world_size // pp
    dp_groups = []
    for s in range(pp):
        for t in range(tp):
            dp_groups.append([s * stage_size + t + d * tp for d in range(dp)])
    ep_groups, edp_groups = [], []
    edp = dp // ep
    for g in dp_groups:
        if use_data_before_expert_parallel_:
            for i in range(edp):
                ep_groups.append(g[i::edp])
            for j in range(ep):
                edp_groups.append(g[j * edp:(j + 1) * edp])
        else:
            for j in range(edp):
                ep_groups.append(g[j * ep:(j + 1) * ep])
            for i in range(ep):
                edp_groups.append(g[i::ep])
    return ep_groups, edp_groups


def _group_name(ep_size: int) -> str:
    return f"ep_size_{int(ep_size)}"


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False):
    """Create the ``ep_size_<N>`` expert-parallel and expert-data-parallel groups (once;
    a second call with the same size is a no-op). Collective: every rank must call it."""
    _create_expert_data_and_model_parallel(expert_parallel_size_, mpu=_cg.get_mpu(),
                                           use_data_before_expert_parallel_=use_data_before_expert_parallel_)


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, mpu=None,
                                           use_data_before_expert_parallel_: bool = False):
    """As :func:`_create_expert_and_data_parallel`, composed with a model-parallel ``mpu``."""
    ep = int(expert_parallel_size_)
    name = _group_name(ep)
    if name in _EXPERT_PARALLEL_GROUP:
        return
    world = _world()
    tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
    pp = mpu.get_pipeline_model_parallel_world_size() if mpu is not None and hasattr(
        mpu, "get_pipeline_model_parallel_world_size") else 1
    dp = world // (tp * pp)
    if ep < 1 or dp % ep:
        raise ValueError(f"MoE ep_size={ep} must divide the data-parallel world size {dp} "
                         f"(world {world}, model-parallel {tp}, pipeline {pp}).")
    ep_groups, edp_groups = _get_expert_parallel_ranks(world, tp, ep, pp, use_data_before_expert_parallel_)
    me = _rank()
    # new_group is collective over the whole world: every rank creates every group in order.
    for ranks in ep_groups:
        g = dist.new_group(ranks) if _initialized() else None
        if me in ranks:
            _EXPERT_PARALLEL_GROUP[name], _EXPERT_PARALLEL_RANKS[name] = g, list(ranks)
    for ranks in edp_groups:
        g = dist.new_group(ranks) if _initialized() else None
        if me in ranks:
            _EXPERT_DATA_PARALLEL_GROUP[name], _EXPERT_DATA_PARALLEL_RANKS[name] = g, list(ranks)


def _require(name, table):
    if name not in table:
        have = sorted(table) or "none"
        raise KeyError(f"No expert group named {name!r} (created: {have}). Groups are created when an MoE "
                       f"layer is built with that ep_size, or by _create_expert_and_data_parallel(ep_size).")
    return table[name]


def get_expert_parallel_group(group_name: str):
    return _require(group_name, _EXPERT_PARALLEL_GROUP)


def get_expert_parallel_group_dict() -> dict:
    return _EXPERT_PARALLEL_GROUP


def get_expert_data_parallel_group(group_name: str):
    return _require(group_name, _EXPERT_DATA_PARALLEL_GROUP)


def get_expert_data_parallel_group_dict() -> dict:
    return _EXPERT_DATA_PARALLEL_GROUP


def get_expert_parallel_ranks(group_name: str) -> List[int]:
    return list(_require(group_name, _EXPERT_PARALLEL_RANKS))


def get_expert_data_parallel_ranks(group_name: str) -> List[int]:
    return list(_require(group_name, _EXPERT_DATA_PARALLEL_RANKS))


def get_expert_parallel_world_size(group_name: str) -> int:
    return len(_require(group_name, _EXPERT_PARALLEL_RANKS))


def get_expert_parallel_rank(group_name: str) -> int:
    return _require(group_name, _EXPERT_PARALLEL_RANKS).index(_rank())


def get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of expert-parallel rank 0 of this rank's group."""
    return _require(group_name, _EXPERT_PARALLEL_RANKS)[0]


def get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_require(group_name, _EXPERT_DATA_PARALLEL_RANKS))


def get_expert_data_parallel_rank(group_name: str) -> int:
    return _require(group_name, _EXPERT_DATA_PARALLEL_RANKS).index(_rank())


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return _require(group_name, _EXPERT_DATA_PARALLEL_RANKS)[0]


def _get_expert_parallel_group(group_name):
    return get_expert_parallel_group(group_name)


def _get_expert_data_parallel_group(group_name):
    return get_expert_data_parallel_group(group_name)


def _get_max_expert_size():
    """Largest ep_size among the created expert groups (DeepSpeed uses it for the
    optimizer's group of largest expert parallelism)."""
    sizes = [int(n.split("_")[-1]) for n in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name():
    size = _get_max_expert_size()
    return _group_name(size) if size is not None else None


def get_max_expert_size():
    return _get_max_expert_size()


def _get_max_expert_parallel_group():
    """The expert-parallel group of the largest ep_size (None before any expert group exists):
    where DeepSpeed reduces an overflow seen in expert gradients."""
    name = _get_max_expert_size_name()
    return _EXPERT_PARALLEL_GROUP.get(name) if name is not None else None


def get_max_expert_size_name():
    return _get_max_expert_size_name()


def _reset_expert_groups() -> None:
    """Forget the expert groups (tests that re-initialise torch.distributed in-process)."""
    for t in (_EXPERT_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_PARALLEL_RANKS,
              _EXPERT_DATA_PARALLEL_RANKS):
        t.clear()
