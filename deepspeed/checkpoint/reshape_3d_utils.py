"""A Megatron-style checkpoint's (pipeline, tensor, data)-parallel shape and how its rank files
map onto a smaller shape (DeepSpeed's ``deepspeed.checkpoint.reshape_3d_utils`` names).

Old rank files are numbered ``dp_index * (pp * tp) + pp_index * tp + tp_index``.
:meth:`model_3d_desc.reshape` returns one :class:`meg_2d_parallel_map` per new data-parallel
rank: cell (pp, tp) lists the old files that merge into that new rank. Only shrinking is
supported (each old degree a multiple of the new one)."""
from __future__ import annotations

from .constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, LAYER_FILE_PREFIX,
                        MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, PIPELINE_KEY, ZERO_FILE_PREFIX)
from .reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from .reshape_utils import get_files, get_files_with_prefix, get_top_level_files, get_zero_files, partition_data

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


class model_3d_desc:  # noqa: N801 - DeepSpeed's class name
    def __init__(self, pp_degree=1, tp_degree=1, dp_degree=1):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index, tp_index, dp_index):
        errors = [f"{name} indexing error: index {i} >= degree {d}"
                  for i, d, name in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                     (dp_index, self.dp_degree, DP_DIM)) if i >= d]
        return not errors, errors

    def can_reshape(self, target):
        """(ok, reasons): a target may not be larger than this shape in any dimension."""
        errors = [f"Expansion reshape not supported - {name}: {old} ---> {new}"
                  for old, new, name in ((self.pp_degree, target.pp_degree, PP_DIM),
                                         (self.tp_degree, target.tp_degree, TP_DIM),
                                         (self.dp_degree, target.dp_degree, DP_DIM)) if new > old]
        return not errors, errors

    def reshape(self, target, verbose=False) -> list:
        ok, errors = self.can_reshape(target)
        if not ok:
            raise ValueError(", ".join(errors))
        two_d = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target.pp_degree, target.tp_degree,
                                        verbose=verbose)
        flat = flatten_dp_dimension(two_d, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target.dp_degree)

    def __repr__(self):
        return f"model_3d_desc(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, dp_degree={self.dp_degree})"


def flatten_dp_dimension(meg_2d_map, src_2d_size, dp_degree):
    """Each old (pp, tp) rank followed by its copies on the other data-parallel ranks."""
    out = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for p in range(meg_2d_map.pp_degree):
        for t in range(meg_2d_map.tp_degree):
            for r in meg_2d_map.get_data(p, t):
                out.add_data(p, t, [r + d * src_2d_size for d in range(dp_degree)])
    return out


def unflatten_dp_dimension(meg_2d_map, dp_degree) -> list:
    """Split every cell's list into ``dp_degree`` contiguous parts: one map per new dp rank."""
    maps = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for p in range(meg_2d_map.pp_degree):
        for t in range(meg_2d_map.tp_degree):
            for d, part in enumerate(partition_data(meg_2d_map.get_data(p, t), dp_degree)):
                maps[d].add_data(p, t, part)
    return maps


def _stage_count(meta):
    """This package's pipeline checkpoints: the stage count of the ``pipeline`` entry (stage 0 writes
    one model-states file per tensor rank; DeepSpeed writes one per stage and tensor rank)."""
    v = (meta or {}).get(PIPELINE_KEY)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def get_model_3d_descriptor_from_metadata(file_list, zero_file_list, model_state_metadata):
    """The shape from each model-states file's ``checkpoint_parallel_dimensions`` (all files must
    carry the same one), else from the file counts (layer files of stage 1 give the tp degree).
    ``model_state_metadata``: ``[(model_file, {checkpoint_parallel_dimensions: ..., ...}), ...]``."""
    model_files = [f for f, _ in model_state_metadata]
    stages = [_stage_count(meta) for _, meta in model_state_metadata]
    own_pipeline = bool(stages) and all(s is not None for s in stages)
    dims, missing = [], []
    for f, meta in model_state_metadata:
        d = (meta or {}).get(CHECKPOINT_PARALLEL_DIMS)
        if d is None:
            missing.append(f)
            continue
        if not isinstance(d, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {f}.")
        vals = []
        for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RuntimeError(f"Checkpoint {key} must be a positive integer in {f}, got {v!r}.")
            vals.append(v)
        dims.append(tuple(vals))
    if dims:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(dims)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {dims}")
        pp, tp = dims[0]
        expected = tp if own_pipeline else pp * tp
        if len(model_files) != expected:
            layout = (f"{CHECKPOINT_TP_DEGREE}={tp} (a pipeline checkpoint of this package: one per tensor rank)"
                      if own_pipeline else f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}")
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match {layout}.")
        if len(zero_file_list) % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    if own_pipeline:
        tp, pp = len(model_files), stages[0]
    else:
        stage1_layers = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
        if stage1_layers:
            tp = stage1_layers
            pp = max(1, len(model_files) // tp)
        else:
            tp, pp = max(1, len(model_files)), 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def model_state_files(file_list) -> list:
    """The model-states files that describe the checkpoint, one per (pipeline stage, tensor rank):
    ``mp_rank_XX_model_states.pt``, or at ZeRO stage 3 (no such file) data rank 0's
    ``zero_pp_rank_0_mp_rank_XX_model_states.pt``, sorted."""
    files = [f for f in get_files_with_prefix(file_list, MODEL_FILE_PREFIX) if f.endswith(MODEL_FILE_SUFFIX)]
    if files:
        return files
    return [f for f in get_files_with_prefix(file_list, f"{ZERO_FILE_PREFIX}0_{MODEL_FILE_PREFIX}")
            if f.endswith(MODEL_FILE_SUFFIX)]


def read_model_state(path):
    """One model-states file through the package's reader (weights-only, verified against the
    tag's manifest when it has one), memory-mapped: the module weights it holds are not read
    into memory for the few entries a descriptor needs."""
    from ..runtime.checkpoint.io import load_file
    return load_file(path, mmap=True)


def get_model_3d_descriptor(dir):  # noqa: A002 - DeepSpeed's parameter name
    """The (pp, tp, dp) shape of the checkpoint tag directory ``dir``."""
    files = get_files(dir)
    meta = []
    for f in model_state_files(get_top_level_files(dir)):
        state = read_model_state(f)
        pipe = state.get(PIPELINE_KEY)
        meta.append((f, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS),
                         PIPELINE_KEY: pipe.get("num_stages") if isinstance(pipe, dict) else None}))
        del state
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), meta)
