"""``DeepSpeedCheckpoint``: a description of one 3-D (tensor x pipeline x data parallel)
checkpoint tag directory, for tools that inspect or convert checkpoints (Megatron-style
``checkpoint_util``, ``ds_to_universal``-like scripts).

It reads both layouts: DeepSpeed's (one ``mp_rank_XX_model_states.pt`` per pipeline stage and
tensor rank, ``XX = stage * tp + tensor rank``; ``[bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``
per rank) and this package's (the same names for engine checkpoints; pipeline checkpoints write one
``mp_rank_XX`` file per tensor rank, ``layer_XX[-model_YY]-model_states.pt`` per layer and
``pipe_stage_SS-zero_pp_rank_D_mp_rank_XX_optim_states.pt``; at ZeRO stage 3 data rank 0's
``zero_pp_rank_0_mp_rank_XX_model_states.pt`` stands for the ``mp_rank`` file).

Every model-states file is read once, on construction, keeping only what descriptors and
converters need (``model_state_metadata``: per file its ``checkpoint_parallel_dimensions``,
parameter shapes, AutoEP layer entries and expert-order flag; ``global_state``: iteration,
args, checkpoint info). The original degrees come from ``checkpoint_parallel_dimensions``
(else from file counts, as DeepSpeed does); the optimizer files are described by a
:class:`.zero_checkpoint.ZeROCheckpoint`.

Target degrees: a smaller ``pp_degree``/``dp_degree`` merges the optimizer files onto it
(``get_zero_files`` / ``get_zero_checkpoint_state`` take target coordinates); a larger one only
re-splits the layers (``partition_uniform``), the optimizer files staying per original rank (this
package's ``load_checkpoint`` loads any checkpoint at any pipeline and data-parallel size).
Tensor-parallel re-slicing is not supported: ``tp_degree`` must equal the original (a ValueError
says so).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from ..runtime.checkpoint.manifest import check_complete
from ..runtime.utils import partition_uniform
from .constants import (ARGS_KEY, AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY,
                        AUTOEP_ZERO12_REQUIRED_FIELDS, CHECKPOINT_INFO_KEY, CHECKPOINT_PARALLEL_DIMS,
                        CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, CLIENT_STATE, FINAL_LAYER_NORM_INDEX, GLOBAL_STEPS,
                        ITERATION_KEY, PARAM_SHAPES, PIPELINE_KEY, UNIVERSAL_CHECKPOINT_INFO,
                        USE_DATA_BEFORE_EXPERT_PARALLELISM)
from .reshape_3d_utils import get_model_3d_descriptor_from_metadata, model_3d_desc, model_state_files, \
    read_model_state
from .reshape_meg_2d import reshape_meg_2d_parallel
from .reshape_utils import get_files, get_top_level_files, get_zero_files, merge_state
from .zero_checkpoint import ZeROCheckpoint

_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_OPTIM = re.compile(r"^(?:pipe_stage_(\d+)-)?(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# the AutoEP layer entries a converter needs (DeepSpeed's model-states ``ds_autoep_layers``)
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path") + AUTOEP_ZERO12_REQUIRED_FIELDS
_GLOBAL_KEYS = (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)


def _load(path):
    """Through the package's one reader: weights-only (a pickle naming anything but tensors,
    plain containers and the allow-listed DeepSpeed types is refused before it runs),
    verified against the tag's manifest."""
    from ..runtime.checkpoint.io import load_file
    return load_file(path)


def _lookup(state: dict, key, default=None):
    """A client-state key: nested under ``client_state`` (this package's checkpoints before 0.19)
    or at the top level, where DeepSpeed merges it."""
    nested = state.get(CLIENT_STATE)
    if isinstance(nested, dict) and key in nested:
        return nested[key]
    return state.get(key, default)


def _type_name(v):
    return type(v).__name__


def summarize_model_state(state: dict) -> dict:
    """The few entries of one model-states dict that descriptors and converters use; a malformed
    entry is kept as its type name, for the consumer to report."""
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict):
        dims = {k: dims.get(k) for k in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    elif dims is not None:
        dims = _type_name(dims)
    shapes = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(g, dict) for g in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    elif shapes is not None:
        shapes = _type_name(shapes)
    autoep = state.get(AUTOEP_LAYERS_KEY, state.get(AUTOEP_LAYERS_KEY_LEGACY))
    if isinstance(autoep, list):
        autoep = [{k: e[k] for k in AUTOEP_METADATA_FIELDS if k in e} if isinstance(e, dict) else _type_name(e)
                  for e in autoep]
    elif autoep is not None:
        autoep = _type_name(autoep)
    ds_config = state.get("ds_config", {})
    if isinstance(ds_config, dict):
        flag = ds_config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        ds_config = {USE_DATA_BEFORE_EXPERT_PARALLELISM: flag if isinstance(flag, bool) else _type_name(flag)}
    else:
        ds_config = _type_name(ds_config)
    pipe = state.get(PIPELINE_KEY)
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: autoep, "ds_config": ds_config,
            PIPELINE_KEY: pipe.get("num_stages") if isinstance(pipe, dict) else None}


class DeepSpeedCheckpoint:
    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX):
        if not os.path.isdir(dir):
            raise FileNotFoundError(f"DeepSpeedCheckpoint: {dir!r} is not a directory (pass a checkpoint tag "
                                    f"directory, e.g. <save_dir>/global_step100)")
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        check_complete(dir)   # a file the tag's manifest lists is missing: name it, its rank, the world size
        self.file_list = get_files(dir)
        self.mp_rank_files = model_state_files(get_top_level_files(dir))
        if not self.mp_rank_files:
            raise ValueError(f"DeepSpeedCheckpoint: {dir!r} has no mp_rank_XX_model_states.pt (or, at ZeRO stage 3, "
                             f"zero_pp_rank_0_mp_rank_XX_model_states.pt) file; not a deepspeed checkpoint tag "
                             f"directory")
        names = sorted(os.listdir(dir))
        self.layer_files = [os.path.join(dir, n) for n in names if _LAYER.match(n)]
        self._layer_map: Dict[int, Dict[int, str]] = {}
        for n in names:
            m = _LAYER.match(n)
            if m:
                self._layer_map.setdefault(int(m.group(1)), {})[int(m.group(2) or 0)] = os.path.join(dir, n)
        self.zero_files = get_zero_files(dir)
        self._optim_names = sorted(os.path.basename(f) for f in self.zero_files if _OPTIM.match(os.path.basename(f)))

        self.model_state_metadata, self.global_state = self._discover_model_state_metadata()
        src = get_model_3d_descriptor_from_metadata(self.file_list, self.zero_files, self.model_state_metadata)
        # this package's pipeline checkpoints: one model-states file per tensor rank, shared by the stages
        self._files_per_tp_only = src.pp_degree > 1 and len(self.mp_rank_files) == src.tp_degree
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=src) if self.zero_files else None

        self.original_tp_degree, self.original_pp_degree, self.original_dp_degree = \
            src.tp_degree, src.pp_degree, src.dp_degree
        self.tp_degree = self.original_tp_degree if tp_degree is None else int(tp_degree)
        self.pp_degree = self.original_pp_degree if pp_degree is None else int(pp_degree)
        self.dp_degree = self.original_dp_degree if dp_degree is None else int(dp_degree)
        if self.tp_degree != self.original_tp_degree:
            raise ValueError(f"DeepSpeedCheckpoint: tp_degree {self.tp_degree} differs from the checkpoint's "
                             f"{self.original_tp_degree}; re-slicing tensor-parallel weights is not supported")
        for name, v in (("pp_degree", self.pp_degree), ("dp_degree", self.dp_degree)):
            if v < 1:
                raise ValueError(f"DeepSpeedCheckpoint: {name} must be >= 1, got {v}")
        self.original_world_size = src.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        target = model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree)
        self._merging = src.can_reshape(target)[0]
        if self.zero_checkpoint is not None and self._merging:
            self.zero_checkpoint.reshape(target)
        self.layer_keys = [f"layer_{i:02d}" for i in sorted(self._layer_map)]
        self.layer_count = len(self.layer_keys)

    def _discover_model_state_metadata(self):
        """Each model-states file read once (memory-mapped): its summary, and file 0's global state."""
        metadata, global_state = [], {}
        for i, path in enumerate(self.mp_rank_files):
            state = read_model_state(path)
            metadata.append((path, summarize_model_state(state)))
            if i == 0:
                global_state[ITERATION_KEY] = int(_lookup(state, ITERATION_KEY, state.get(GLOBAL_STEPS, 0)) or 0)
                for key in _GLOBAL_KEYS:
                    global_state[key] = _lookup(state, key)
            del state
        return metadata, global_state

    # -- degrees ---------------------------------------------------------------------
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.original_tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.original_pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.original_dp_degree

    # -- global state ------------------------------------------------------------------
    def _get_checkpoint_value(self, key):
        if key not in self.global_state:
            self.global_state[key] = _lookup(_load(self.mp_rank_files[0]), key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        return self.global_state[ITERATION_KEY]

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int = 0) -> List[str]:
        """The model-states files that make up (pp_index, tp_index) of the target shape."""
        self._check(tp_index=tp_index, pp_index=pp_index)
        if self._files_per_tp_only:
            return [self.mp_rank_files[tp_index]]
        if self.pp_degree > self.original_pp_degree:
            raise ValueError(f"DeepSpeedCheckpoint: the model-states files hold one pipeline stage each; they can be "
                             f"merged onto fewer stages, not split onto pp_degree {self.pp_degree} > "
                             f"{self.original_pp_degree}")
        cells = reshape_meg_2d_parallel(self.original_pp_degree, self.original_tp_degree, self.pp_degree,
                                        self.tp_degree)
        return [self.mp_rank_files[i] for i in cells.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int = 0) -> dict:
        """The model-states dict of (pp_index, tp_index): counters, scheduler, client state (weights
        are in the layer files for pipeline checkpoints); several files merged (``merge_state``)."""
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            sd = _load(path)
            merged = sd if merged is None else merge_state(merged, sd)
        return merged

    # -- layers ------------------------------------------------------------------------
    def _layer_ids(self) -> List[int]:
        return sorted(self._layer_map)

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[0]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def _layer_file(self, layer: int, tp_index: int) -> str:
        files = self._layer_map[layer]
        if tp_index not in files:
            raise ValueError(f"layer_{layer:02d} has no file for tensor-parallel rank {tp_index} "
                             f"(has {sorted(files)})")
        return files[tp_index]

    def get_embedding_files(self, tp_index: int = 0) -> List[str]:
        return [self._layer_file(self._layer_ids()[0], tp_index)]

    def get_final_norm_files(self, tp_index: int = 0) -> List[str]:
        return [self._layer_file(self._layer_ids()[self.final_layer_norm_idx], tp_index)]

    def get_embedding_state(self, tp_index: int = 0) -> dict:
        return _load(self.get_embedding_files(tp_index)[0])

    def get_final_norm_state(self, tp_index: int = 0) -> dict:
        return _load(self.get_final_norm_files(tp_index)[0])

    def _transformer_keys(self) -> List[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def get_pp_transformer_map(self, pp_index: int) -> List[str]:
        """The layer ids of the transformer layers (all but the first and the final-norm layer) that
        stage ``pp_index`` of ``pp_degree`` holds (``partition_uniform`` split)."""
        self._check(pp_index=pp_index)
        middle = self._transformer_keys()
        parts = partition_uniform(len(middle), self.pp_degree)
        return middle[parts[pp_index]:parts[pp_index + 1]]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> List[dict]:
        self._check(tp_index=tp_index, pp_index=pp_index)
        return [_load(self._layer_file(int(k.split("_")[1]), tp_index)) for k in self.get_pp_transformer_map(pp_index)]

    # -- optimizer files --------------------------------------------------------------
    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> List[str]:
        """The optimizer files that make up rank (pp, tp, dp): of the target shape when it merges
        the original one, else of the original shape; ``[]`` for a rank outside it."""
        if self.zero_checkpoint is None:
            return []
        try:
            return self.zero_checkpoint.get_files_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)
        except ValueError:
            return []

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict:
        """The optimizer state of rank (pp, tp, dp), its files merged (:class:`ZeROCheckpoint`)."""
        if not self.get_zero_files(pp_index, tp_index, dp_index):
            raise ValueError(f"no optimizer file for pipeline stage {pp_index}, tensor rank {tp_index}, data rank "
                             f"{dp_index} in {self.dir!r} (have {self._optim_names})")
        return self.zero_checkpoint.get_state_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index,
                                                       keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    # -- summaries ---------------------------------------------------------------------
    def layer_map(self) -> "OrderedDict[str, List[str]]":
        return OrderedDict((f"layer_{i:02d}", [os.path.basename(p) for _, p in sorted(self._layer_map[i].items())])
                           for i in self._layer_ids())

    def show_layer_map(self) -> None:
        for k, files in self.layer_map().items():
            print(f"{k}: {files}")

    def show_pp_transformer_map(self) -> None:
        for pp in range(self.pp_degree):
            print(f"pp {pp}: {self.get_pp_transformer_map(pp)}")

    def show_2d_mapping(self) -> None:
        for pp in range(self.pp_degree):
            for tp in range(self.tp_degree):
                print(f"[{pp}, {tp}] = {[os.path.basename(f) for f in self.get_2d_parallel_files(tp, pp)]}")

    def validate_files(self) -> List[str]:
        """The listed files that no longer exist (empty when all do)."""
        return [f for f in self.file_list if not os.path.isfile(f)]

    def _check(self, tp_index: Optional[int] = None, pp_index: Optional[int] = None) -> None:
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise ValueError(f"tp_index {tp_index} is outside 0..{self.tp_degree - 1}")
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise ValueError(f"pp_index {pp_index} is outside 0..{self.pp_degree - 1}")
