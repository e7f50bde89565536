"""``ZeROCheckpoint``: the ZeRO optimizer files of one checkpoint tag directory, laid out on its
(pipeline, tensor, data)-parallel shape, and merged onto a smaller shape (DeepSpeed's
``deepspeed.checkpoint.zero_checkpoint`` names).

Files are numbered as :func:`.reshape_utils.get_zero_files` lists them, data-parallel rank major:
``dp_index * (pp * tp) + pp_index * tp + tp_index``. :meth:`ZeROCheckpoint.reshape` picks a
smaller target shape; :meth:`ZeROCheckpoint.get_files_for_rank` names the old files that merge
into one target rank and :meth:`ZeROCheckpoint.get_state_for_rank` merges them.

Two file formats are merged:

* DeepSpeed's flat partitions (a checkpoint written by DeepSpeed itself, ZeRO stage 1/2): the
  per-group optimizer tensors of each file lose their alignment padding (``group_paddings``),
  then the files' tensors are concatenated in rank order, so the merged flat tensors are the
  unpartitioned ones; ``partition_count`` becomes the target data-parallel degree and
  ``group_paddings`` zero.
* this package's fragments (``deepspeed/runtime/checkpoint/universal.py``): the fragments of each
  parameter are united by name and offset (adjacent ones joined), so merging every data rank gives
  one fragment per parameter covering all its elements. Fragments of one parameter that overlap
  (two tensor-parallel slices of it) are refused: re-slicing tensor-parallel weights is not built.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from .constants import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, OPTIM_FILE_SUFFIX,
                        PARTITION_COUNT, ZERO_FILE_PREFIX)
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from .reshape_utils import basic_folder_validation, get_zero_files, merge_state

GROUP_STATE_KEY = "state"
_FRAGMENTS_FORMAT = "deepspeed-fragments"  # runtime/checkpoint/universal.py FORMAT


def _load(path: str):
    """Through the package's one reader: weights-only, verified against the tag's manifest."""
    from ..runtime.checkpoint.io import load_file
    return load_file(path)


class ZeROCheckpoint:
    def __init__(self, dir: str, source_3d: Optional[model_3d_desc] = None):  # noqa: A002 - DeepSpeed's name
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.num_files:
            raise FileNotFoundError(f"ZeROCheckpoint: no ZeRO optimizer files "
                                    f"([bf16_|fp16_]{ZERO_FILE_PREFIX}D_mp_rank_XX{OPTIM_FILE_SUFFIX}) in {dir!r}; "
                                    f"pass a checkpoint tag directory")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        if self.src_3d.world_size() != self.num_files:
            raise ValueError(f"ZeROCheckpoint: {dir!r} holds {self.num_files} ZeRO optimizer files, but its shape "
                             f"{self.src_3d.get_desc()} needs {self.src_3d.world_size()} (one per rank)")
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    # -- the source shape --------------------------------------------------------------------
    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    # -- the target shape --------------------------------------------------------------------
    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Merge onto ``target_3d_desc`` (each degree at most the source's and dividing it; a
        ValueError names the degree that grows)."""
        file_map = self.src_3d.reshape(target_3d_desc)
        self.target_3d, self._3d_file_map = target_3d_desc, file_map

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> List[int]:
        ok, errors = self.target_3d.is_valid(pp_index, tp_index, dp_index)
        if not ok:
            raise ValueError(f"ZeROCheckpoint: rank (pp={pp_index}, tp={tp_index}, dp={dp_index}) is outside the "
                             f"target shape {self.target_3d.get_desc()}: {', '.join(errors)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> List[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore=(),
                           strip_tensor_paddings: bool = True) -> dict:
        """The optimizer-states dict of target rank (pp, tp, dp): its old files' states merged (see
        the module docstring), top-level ``keys_to_ignore`` dropped from each."""
        files = self.get_files_for_rank(pp_index, tp_index, dp_index)
        merged = None
        for path in files:
            sd = _load(path)
            for key in keys_to_ignore:
                sd.pop(key, None)
            if _is_fragments(sd):
                merged = sd if merged is None else _merge_fragment_files(merged, sd, path)
                continue
            if strip_tensor_paddings:
                self._strip_tensor_paddings(sd)
            merged = sd if merged is None else merge_state(merged, sd)
        if _is_fragments(merged):
            self._retarget_fragments(merged, pp_index, tp_index, dp_index)
        else:
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    # -- printing ------------------------------------------------------------------------------
    def print_3d_index_map(self, tag=None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            two_d.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag=None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            for pp_index in range(two_d.pp_degree):
                for tp_index in range(two_d.tp_degree):
                    names = [os.path.basename(self.file_list[i]) for i in two_d.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {names}")

    # -- DeepSpeed's flat partitions ----------------------------------------------------------
    @staticmethod
    def _get_optimizer_state(sd, key):
        osd = sd.get(OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
        return osd.get(key) if isinstance(osd, dict) else None

    def _get_param_group_states(self, sd):
        base = self._get_optimizer_state(sd, BASE_OPTIMIZER_STATE)
        return base.get(GROUP_STATE_KEY) if isinstance(base, dict) else None

    def _strip_tensor_paddings(self, sd) -> None:
        """Cut each group's alignment padding off the end of its per-element optimizer tensors
        (``step`` and scalars stay)."""
        groups = self._get_param_group_states(sd)
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if groups is None or paddings is None:
            return
        for key, group_state in groups.items():
            pad = paddings[key]
            if not pad:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = value.narrow(0, 0, value.numel() - pad).clone()

    def _clear_group_paddings(self, sd) -> None:
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if paddings:
            sd[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _update_partition_count(self, sd) -> None:
        counts = self._get_optimizer_state(sd, PARTITION_COUNT)
        if isinstance(counts, (list, tuple)) and counts:
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
        elif isinstance(counts, int) and not isinstance(counts, bool):
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = self.target_3d.dp_degree

    # -- this package's fragments ---------------------------------------------------------------
    def _retarget_fragments(self, sd, pp_index, tp_index, dp_index) -> None:
        rs = _rank_state(sd)
        dp = self.target_3d.dp_degree
        rs["dp_world_size"], rs["dp_rank"] = dp, dp_index
        rs["mp_rank"] = pp_index * self.target_3d.tp_degree + tp_index
        count = rs.get(PARTITION_COUNT)
        if isinstance(count, (list, tuple)):
            rs[PARTITION_COUNT] = [dp] * len(count)
        elif count is not None:
            rs[PARTITION_COUNT] = dp


def _rank_state(sd) -> dict:
    inner = sd.get(OPTIMIZER_STATE_DICT) if isinstance(sd, dict) else None
    return inner if isinstance(inner, dict) and inner.get("format") == _FRAGMENTS_FORMAT else sd


def _is_fragments(sd) -> bool:
    return isinstance(sd, dict) and _rank_state(sd).get("format") == _FRAGMENTS_FORMAT


def _join(fragments: list, name: str, where: str) -> list:
    """Fragments sorted by offset, adjacent ones (same state keys) joined into one; overlap refused."""
    out = []
    for f in sorted(fragments, key=lambda f: int(f["offset"])):
        if out:
            last = out[-1]
            end = int(last["offset"]) + int(last["numel"])
            if int(f["offset"]) < end:
                raise ValueError(f"ZeROCheckpoint: fragments of '{name}' overlap when merging {where} (elements "
                                 f"{f['offset']}.. and {last['offset']}..{end}): these files hold different "
                                 f"tensor-parallel slices of one parameter, and re-slicing tensor-parallel weights "
                                 f"is not supported; merge data-parallel or pipeline ranks only")
            state_a, state_b = last.get("state", {}), f.get("state", {})
            if int(f["offset"]) == end and set(state_a) == set(state_b):
                out[-1] = {"offset": int(last["offset"]), "numel": int(last["numel"]) + int(f["numel"]),
                           "fp32": torch.cat([last["fp32"].reshape(-1), f["fp32"].reshape(-1)]),
                           "state": {k: torch.cat([state_a[k].reshape(-1), state_b[k].reshape(-1)])
                                     for k in state_a}}
                continue
        out.append(f)
    return out


def _merge_fragment_files(a: dict, b: dict, where: str) -> dict:
    """Two optimizer files of this package's format as one: parameters united by name (their
    fragments by offset), each group's parameter names united in order; everything else from ``a``."""
    ra, rb = _rank_state(a), _rank_state(b)
    params = dict(ra["params"])
    for name, pb in rb["params"].items():
        pa = params.get(name)
        if pa is None:
            params[name] = pb
            continue
        if list(pa["shape"]) != list(pb["shape"]):
            raise ValueError(f"ZeROCheckpoint: '{name}' has shape {list(pa['shape'])} in one file and "
                             f"{list(pb['shape'])} in {where}")
        merged = dict(pa)
        merged["fragments"] = _join(list(pa["fragments"]) + list(pb["fragments"]), name, where)
        if not merged.get("scalars") and pb.get("scalars"):
            merged["scalars"] = pb["scalars"]
        params[name] = merged
    ga, gb = ra.get("param_groups") or [], rb.get("param_groups") or []
    if len(ga) != len(gb):
        raise ValueError(f"ZeROCheckpoint: {len(ga)} parameter groups in one file, {len(gb)} in {where}")
    groups = []
    for x, y in zip(ga, gb):
        g = dict(x)
        g["params"] = list(x["params"]) + [n for n in y["params"] if n not in set(x["params"])]
        groups.append(g)
    rs = dict(ra, params=params, param_groups=groups)
    return dict(a, **{OPTIMIZER_STATE_DICT: rs}) if ra is not a else rs
