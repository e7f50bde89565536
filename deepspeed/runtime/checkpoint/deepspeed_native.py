"""Read checkpoints written by DeepSpeed itself (its own on-disk format, stages 0-3).

Why: users move to this package with checkpoints DeepSpeed saved. Those files keep the
fp32 master weights and optimizer state as each rank's slice of flat buffers, laid out
by the saving world size; this module turns them into the shared fragment format
(:mod:`.universal`), keyed by parameter name, so every strategy loads them at any world
size exactly like its own checkpoints.

The layouts read (as DeepSpeed writes them, 0.9 to 0.19):

* stage 0: ``mp_rank_XX_model_states.pt`` holds the module and, under ``"optimizer"``,
  the torch optimizer's ``state_dict()`` over the module's parameters (in order);
* stages 1/2: ``zero_pp_rank_R_..._optim_states.pt`` per rank, with
  ``optimizer_state_dict.single_partition_of_fp32_groups[g]`` and the base optimizer's
  flat state: per group, the parameters listed in the model file's ``param_shapes[g]``
  lie back to back in one flat buffer, split into equal partitions, rank ``R`` holding
  elements ``[R * P, R * P + P)`` (the last one padded);
* stage 3: per rank ``fp32_flat_groups[g]`` and the nested ``optimizer_state_dict``:
  every parameter is partitioned on its own, rank ``R`` holding elements
  ``[R * ceil(n / W), ...)`` of each, padded to ``ceil(n / W)``, back to back in the
  ``param_shapes[g]`` order; the module entries in ``zero_pp_rank_R_..._model_states.pt``
  are empty.

Loading stays ``weights_only``: the only non-tensor types DeepSpeed pickles into these
files - its ``LossScaler``, ``ZeroStageEnum`` and ``fragment_address`` - are allow-listed
as the inert stand-ins below (data only, no behaviour), and nothing else.
"""
from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional

import torch

from .allowlist import SAFE_GLOBALS, _DynamicLossScaler, _FragmentAddress, _LossScaler, _ZeroStageEnum  # noqa: F401
from .errors import CheckpointError
from .io import load_file
from .universal import register_rank_state_reader

_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

# Keys DeepSpeed writes into a model-states file itself; every other top-level key is the
# client_state the user passed to save_checkpoint (DeepSpeed merges it into the dict).
from .contents import DEEPSPEED_MODEL_STATE_KEYS, client_state_of  # noqa: E402,F401  (one list, in .contents)


# ---------------------------------------------------------------- allow-listed stand-ins
# defined in .allowlist (imported above): the one allow-list every checkpoint reader uses


def load_native(path: str, mmap: bool = False):
    """``torch.load(weights_only=True)`` of a DeepSpeed-written file (through :func:`.io.load_file`)."""
    return load_file(path, map_location="cpu", mmap=mmap)


# ---------------------------------------------------------------- detection
def is_native_model_state(state) -> bool:
    """A model-states dict in DeepSpeed's layout (DeepSpeed's, or this package's since 0.19:
    :func:`is_native_dir` tells them apart)."""
    return isinstance(state, dict) and "buffer_names" in state and "param_shapes" in state


def _written_here(directory: str, names, state) -> bool:
    """This package's checkpoints carry the fragments format in their optimizer files (or,
    with none, the ``micro_steps`` key DeepSpeed never writes)."""
    from .universal import FORMAT, unwrap_rank_state
    optim = sorted(n for n in names if n.endswith("_optim_states.pt"))
    if not optim:
        return "micro_steps" in state
    try:
        st = load_file(os.path.join(directory, optim[0]), mmap=True, verify=False)
    except Exception:  # noqa: BLE001 - not ours to judge here; the real load reports it
        return False
    st = unwrap_rank_state(st)
    return isinstance(st, dict) and st.get("format") == FORMAT


def is_native_dir(directory: str) -> bool:
    """Whether a checkpoint tag directory was written by DeepSpeed itself."""
    if not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    model = [n for n in names if _MODEL_RE.match(n)]
    if not model:
        return False
    try:
        st = load_file(os.path.join(directory, sorted(model)[0]), mmap=True, verify=False)
    except Exception:  # noqa: BLE001 - not ours to judge here; the real load reports it
        return False
    return is_native_model_state(st) and not _written_here(directory, names, st)


def _model_files(directory, mp_rank):
    out = {}
    for n in os.listdir(directory):
        m = _MODEL_RE.match(n)
        if m and int(m.group(2)) == mp_rank:
            out[int(m.group(1)) if m.group(1) is not None else -1] = os.path.join(directory, n)
    return out


def _optim_files(directory, mp_rank):
    out = {}
    for n in os.listdir(directory):
        m = _OPTIM_RE.match(n)
        if m and int(m.group(2)) == mp_rank:
            out[int(m.group(1))] = os.path.join(directory, n)
    return [out[r] for r in sorted(out)]


def model_state(directory: str, mp_rank: int = 0) -> dict:
    """The model-states dict (stage 0-2 file, or data-parallel rank 0's file at stage 3)."""
    files = _model_files(directory, mp_rank)
    path = files.get(-1, files.get(0))
    if path is None:
        raise CheckpointError(f"'{directory}' has no DeepSpeed model-states file for mp rank {mp_rank:02d}.")
    return load_native(path)


# ---------------------------------------------------------------- conversion
def _param_names(ms: dict) -> List[List[str]]:
    shapes = ms.get("param_shapes")
    if shapes:
        return [list(g.keys()) for g in shapes]
    buffers = set(ms.get("buffer_names") or [])
    return [[n for n in ms["module"] if n not in buffers]]


def _shape_of(ms: dict, name: str):
    for g in ms.get("param_shapes") or []:
        if name in g:
            return [int(s) for s in g[name]]
    return list(ms["module"][name].shape)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "step")}


def _scalars(st: dict) -> dict:
    return {k: v for k, v in st.items() if not (torch.is_tensor(v) and v.numel() > 1)}


def _rank_state(stage, world, rank, params, groups, group_state, loss_scaler):
    from .universal import FORMAT, VERSION
    return {"format": FORMAT, "version": VERSION, "zero_stage": stage, "dp_world_size": world, "dp_rank": rank,
            "mp_rank": 0, "dtype": "fp32", "params": params, "param_groups": groups, "group_state": group_state,
            "optimizer_class": None, "loss_scaler": loss_scaler, "extra": {"converted_from": "deepspeed"}}


def _scaler_state(osd: dict) -> Optional[dict]:
    ls = osd.get("loss_scaler")
    if ls is None:
        return None
    d = dict(getattr(ls, "__dict__", {}))
    dynamic = bool(osd.get("dynamic_loss_scale", d.get("dynamic", False)))
    out = {"cur_scale": float(d.get("cur_scale", 1.0)), "dynamic": dynamic}
    for ours, theirs in (("cur_iter", "cur_iter"), ("last_overflow_iter", "last_overflow_iter"),
                         ("scale_factor", "scale_factor"), ("scale_window", "scale_window"),
                         ("min_scale", "min_scale"), ("cur_hysteresis", "cur_hysteresis")):
        if theirs in d:
            out[ours] = d[theirs]
    return out


def rank_states(directory: str, mp_rank: int = 0) -> List[dict]:
    """DeepSpeed's files of one tag, as fragment-format rank states (see module docstring)."""
    ms = model_state(directory, mp_rank)
    names = _param_names(ms)
    optim = _optim_files(directory, mp_rank)
    if not optim:  # stage 0: the torch optimizer's state dict sits in the model file
        return [_stage0(ms, names)]
    raw = [load_native(p) for p in optim]
    osd0 = raw[0].get("optimizer_state_dict", {})
    stage = int(osd0.get("zero_stage", 3 if "fp32_flat_groups" in osd0 else 2))
    world = len(raw)
    out = []
    for r, f in enumerate(raw):
        osd = f["optimizer_state_dict"]
        if stage == 3:
            out.append(_stage3(ms, names, osd, r, world))
        else:
            out.append(_stage12(ms, names, osd, r, world, stage, raw))
    return out


def _stage0(ms, names):
    opt = ms.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt:
        raise CheckpointError("DeepSpeed stage-0 checkpoint without an optimizer state dict in its model file "
                              "(saved with fp16/bf16 or no optimizer?); load it with load_optimizer_states=False.")
    flat_names = [n for g in names for n in g]
    params, groups, gstate = {}, [], []
    idx = 0
    for gi, g in enumerate(opt["param_groups"]):
        gnames = []
        scal = {}
        for pid in g["params"]:
            name = flat_names[idx]
            idx += 1
            gnames.append(name)
            st = opt["state"].get(pid, {})
            per = {k: v.reshape(-1).float() for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1}
            for k, v in _scalars(st).items():
                if k == "step":
                    scal["step"] = max(float(v), float(scal.get("step", 0)))
            w = ms["module"][name]
            params[name] = {"shape": list(w.shape), "fragments": [
                {"offset": 0, "numel": w.numel(), "fp32": w.reshape(-1).float(), "state": per}]}
        groups.append(dict(_hyper(g), params=gnames))
        if scal:
            scal["step"] = torch.tensor(scal["step"])
        gstate.append(scal)
    return _rank_state(0, int(ms.get("dp_world_size", 1)), 0, params, groups, gstate, None)


def _base_state(osd):
    base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict")
    if isinstance(base, list):  # older layouts: a list of per-group states
        base = {"state": {i: s for i, s in enumerate(base)}, "param_groups": osd.get("param_groups", [])}
    return base or {"state": {}, "param_groups": []}


def _groups_and_state(base, names):
    groups, gstate = [], []
    for gi, gnames in enumerate(names):
        pg = base["param_groups"][gi] if gi < len(base["param_groups"]) else {}
        groups.append(dict(_hyper(pg), params=list(gnames)))
        sc = _scalars(base["state"].get(gi, {}))
        gstate.append({k: (v if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in sc.items()})
    return groups, gstate


def _stage12(ms, names, osd, rank, world, stage, raw):
    base = _base_state(osd)
    params = {}
    for gi, gnames in enumerate(names):
        part = osd["single_partition_of_fp32_groups"][gi].reshape(-1)
        # every rank's partition has the same length P; the last one is stored without its padding
        P = raw[0]["optimizer_state_dict"]["single_partition_of_fp32_groups"][gi].numel()
        lo = rank * P
        st = {k: v.reshape(-1) for k, v in base["state"].get(gi, {}).items() if torch.is_tensor(v) and v.numel() > 1}
        pad = osd.get("param_alignment_paddings")
        if pad and any(int(x) for x in pad[gi]):
            raise CheckpointError("DeepSpeed checkpoint with parameter alignment padding inside a flat group is not "
                                  "supported; load it with load_optimizer_states=False.")
        off = 0
        for name in gnames:
            shape = _shape_of(ms, name)
            n = math.prod(shape)
            a, b = max(off, lo), min(off + n, lo + part.numel())
            if a < b:
                params[name] = {"shape": shape, "fragments": [{
                    "offset": a - off, "numel": b - a, "fp32": part[a - lo:b - lo].float(),
                    "state": {k: v[a - lo:b - lo].float() for k, v in st.items()}}]}
            off += n
    groups, gstate = _groups_and_state(base, names)
    return _rank_state(stage, world, rank, params, groups, gstate, _scaler_state(osd))


def _stage3(ms, names, osd, rank, world):
    base = _base_state(osd)
    params = {}
    for gi, gnames in enumerate(names):
        flat = osd["fp32_flat_groups"][gi].reshape(-1)
        st = {k: v.reshape(-1) for k, v in base["state"].get(gi, {}).items() if torch.is_tensor(v) and v.numel() > 1}
        off = 0
        for name in gnames:
            shape = _shape_of(ms, name)
            n = math.prod(shape)
            ps = math.ceil(n / world)
            a, b = rank * ps, min(n, (rank + 1) * ps)
            if a < b:
                params[name] = {"shape": shape, "fragments": [{
                    "offset": a, "numel": b - a, "fp32": flat[off:off + b - a].float(),
                    "state": {k: v[off:off + b - a].float() for k, v in st.items()}}]}
            off += ps
        if off != flat.numel():
            raise CheckpointError(f"DeepSpeed stage-3 checkpoint: group {gi} of rank {rank} holds {flat.numel()} "
                                  f"elements but its parameters need {off}; unsupported layout.")
    groups, gstate = _groups_and_state(base, names)
    return _rank_state(3, world, rank, params, groups, gstate, _scaler_state(osd))


def full_module_state(directory: str, mp_rank: int = 0) -> Dict[str, torch.Tensor]:
    """The module state dict of a DeepSpeed checkpoint; at stage 3 (empty module entries)
    the parameters are assembled from the fp32 partitions."""
    ms = model_state(directory, mp_rank)
    module = dict(ms["module"])
    shapes = {n: _shape_of(ms, n) for g in _param_names(ms) for n in g}
    if any(module.get(n) is None or list(module[n].shape) != s for n, s in shapes.items()):
        from .universal import FragmentIndex
        idx = FragmentIndex(directory, mp_rank, states=rank_states(directory, mp_rank))
        for n in shapes:
            dtype = module[n].dtype if torch.is_tensor(module.get(n)) else torch.float32
            module[n] = idx.full(n, "fp32").to(dtype)
    return module


def _rank_states_if_native(directory: str, mp_rank: int):
    """The fragment index's reader for this layout: ``None`` for any other directory."""
    return rank_states(directory, mp_rank) if is_native_dir(directory) else None


register_rank_state_reader(_rank_states_if_native)
