"""File listing and state merging helpers for reshaping Megatron-style 3-D checkpoints
(DeepSpeed's ``deepspeed.checkpoint.reshape_utils`` names)."""
from __future__ import annotations

import os
import re
from collections import OrderedDict

import torch

from .constants import (BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, MODEL_FILE_PREFIX, OPTIM_FILE_SUFFIX,
                        PIPE_STAGE_FILE_PREFIX, ZERO_FILE_PREFIX)


def basic_folder_validation(dir):  # noqa: A002 - DeepSpeed's parameter name
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"checkpoint folder '{dir}' does not exist or is not a directory")


def get_files(dir) -> list:  # noqa: A002
    """Every file under ``dir`` (recursively)."""
    return [os.path.join(root, f) for root, _, files in os.walk(dir) for f in files]


def get_top_level_files(dir) -> list:  # noqa: A002
    """The files directly in ``dir`` (a checkpoint tag keeps all its files there), sorted."""
    return sorted(os.path.join(dir, f) for f in os.listdir(dir) if os.path.isfile(os.path.join(dir, f)))


def get_files_with_prefix(all_files, prefix) -> list:
    """The files whose base name starts with ``prefix``, sorted."""
    return sorted(p for p in all_files if os.path.basename(p).startswith(prefix))


def validate_files(file_list) -> list:
    """The paths in ``file_list`` that are not files (empty when all exist)."""
    return [f for f in file_list if not os.path.isfile(f)]


def sort_zero_files(files, prefix) -> list:
    """ZeRO optimizer files ordered by (data-parallel rank, model-parallel rank)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)_" + re.escape(MODEL_FILE_PREFIX) + r"(\d+)")
    keyed = []
    for f in files:
        m = pattern.search(os.path.basename(f))
        if not m:
            raise ValueError(f"Cannot read the data-parallel and model-parallel ranks from the file name '{f}'")
        keyed.append((int(m.group(1)), int(m.group(2)), f))
    return [f for _, _, f in sorted(keyed)]


# this package's pipeline checkpoints: one optimizer file per (stage, data rank, tensor rank)
_PIPE_STAGE_ZERO = re.compile(r"^" + re.escape(PIPE_STAGE_FILE_PREFIX) + r"(\d+)-" + re.escape(ZERO_FILE_PREFIX)
                              + r"(\d+)_" + re.escape(MODEL_FILE_PREFIX) + r"(\d+)"
                              + re.escape(OPTIM_FILE_SUFFIX) + "$")


def get_zero_files(dir) -> list:  # noqa: A002
    """The ZeRO optimizer files under ``dir`` (plain, ``fp16_`` or ``bf16_`` prefixed; only
    ``*_optim_states.pt``, not ZeRO-3's per-rank model-states files), in rank order:
    data-parallel rank major, then model-parallel rank. A pipeline checkpoint of this package
    (``pipe_stage_SS-zero_pp_rank_D_mp_rank_TT_optim_states.pt``) is listed in the order DeepSpeed's
    layout has, where the model-parallel rank of stage ``s``, tensor rank ``t`` is ``s * tp + t``:
    by (data rank, stage, tensor rank). Only the files directly in ``dir`` (a tag directory), not
    those of tags below it when ``dir`` is a save directory."""
    files = [f for f in get_top_level_files(dir) if f.endswith(OPTIM_FILE_SUFFIX)]
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    staged = []
    for f in files:
        m = _PIPE_STAGE_ZERO.match(os.path.basename(f))
        if m:
            staged.append((int(m.group(2)), int(m.group(1)), int(m.group(3)), f))
    return [f for *_, f in sorted(staged)]


def partition_data(data_list, num_partitions) -> list:
    """Split ``data_list`` into ``num_partitions`` contiguous equal parts."""
    n = len(data_list)
    if num_partitions < 1 or n % num_partitions:
        raise ValueError(f"partition_data: {n} items cannot be split into {num_partitions} equal parts")
    size = n // num_partitions
    return [data_list[i:i + size] for i in range(0, n, size)]


def merge_state(state_a, state_b, key_list=()):
    """Merge two states of the same structure: dicts key by key (keys only ``b`` has are taken too),
    lists/tuples element-wise, tensors concatenated along dim 0, anything else (numbers, strings,
    named tuples, other objects) from ``a``."""
    where = ".".join(map(str, key_list)) or "<root>"
    if type(state_a) is not type(state_b):
        raise ValueError(f"merge_state: cannot merge {type(state_a).__name__} with {type(state_b).__name__} "
                         f"at {where}")
    if type(state_a) in (dict, OrderedDict):
        out = type(state_a)()
        for k, v in state_b.items():
            out[k] = merge_state(state_a[k], v, [*key_list, k]) if k in state_a else v
        return out
    if type(state_a) in (list, tuple):
        if len(state_a) != len(state_b):
            raise ValueError(f"merge_state: lists of lengths {len(state_a)} and {len(state_b)} at {where}")
        return type(state_a)(merge_state(a, b, [*key_list, i]) for i, (a, b) in enumerate(zip(state_a, state_b)))
    if torch.is_tensor(state_a):
        return torch.cat([state_a, state_b], 0)
    return state_a
