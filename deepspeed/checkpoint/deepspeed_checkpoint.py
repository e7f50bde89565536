"""``DeepSpeedCheckpoint``: a description of one 3-D (tensor x pipeline x data parallel)
checkpoint tag directory, for tools that inspect or convert checkpoints (Megatron-style
``checkpoint_util``, ``ds_to_universal``-like scripts).

It reads the directory this package writes (``mp_rank_XX_model_states.pt`` with the
counters and client state; ``layer_XX[-model_YY]-model_states.pt`` per pipeline layer;
``[pipe_stage_SS-]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` per data-parallel rank) and
reports the original degrees, the layer files of each stage and tensor-parallel rank, and
the optimizer files of each (stage, tp, dp) coordinate.

Target degrees: our optimizer files are keyed by parameter name and layer files by layer,
so a checkpoint loads at any pipeline and data-parallel size; ``pp_degree``/``dp_degree``
different from the original just re-split the layers (``partition_uniform``, as
DeepSpeed does). Tensor-parallel re-slicing is not supported: ``tp_degree`` must equal
the original (a ValueError says so).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from ..runtime.checkpoint.io import load_file
from ..runtime.checkpoint.manifest import check_complete
from ..runtime.utils import partition_uniform
from .constants import ARGS_KEY, CHECKPOINT_INFO_KEY, CLIENT_STATE, GLOBAL_STEPS, ITERATION_KEY

_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_MODEL_Z3 = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")  # stage 3: one per rank
_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_OPTIM = re.compile(r"^(?:pipe_stage_(\d+)-)?(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _load(path):
    """Through the package's one reader: weights-only (a pickle naming anything but tensors,
    plain containers and the allow-listed DeepSpeed types is refused before it runs),
    verified against the tag's manifest."""
    return load_file(path)


class DeepSpeedCheckpoint:
    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None):
        if not os.path.isdir(dir):
            raise FileNotFoundError(f"DeepSpeedCheckpoint: {dir!r} is not a directory (pass a checkpoint tag "
                                    f"directory, e.g. <save_dir>/global_step100)")
        self.dir = dir
        check_complete(dir)   # a file the tag's manifest lists is missing: name it, its rank, the world size
        names = sorted(os.listdir(dir))
        self.mp_rank_files = [os.path.join(dir, n) for n in names if _MODEL.match(n)] or \
            [os.path.join(dir, n) for n in names if _MODEL_Z3.match(n)]
        if not self.mp_rank_files:
            raise ValueError(f"DeepSpeedCheckpoint: {dir!r} has no mp_rank_XX_model_states.pt (or, at ZeRO stage 3, "
                             f"zero_pp_rank_0_mp_rank_XX_model_states.pt) file; not a deepspeed checkpoint tag directory")
        self.layer_files = [os.path.join(dir, n) for n in names if _LAYER.match(n)]
        self.zero_files = [os.path.join(dir, n) for n in names if _OPTIM.match(n)]
        self._layer_map: Dict[int, Dict[int, str]] = {}
        for n in names:
            m = _LAYER.match(n)
            if m:
                self._layer_map.setdefault(int(m.group(1)), {})[int(m.group(2) or 0)] = os.path.join(dir, n)
        self._optim_map: Dict[tuple, str] = {}
        for n in names:
            m = _OPTIM.match(n)
            if m:
                self._optim_map[(int(m.group(1) or 0), int(m.group(3)), int(m.group(2)))] = os.path.join(dir, n)
        self._model_states = _load(self.mp_rank_files[0])
        pipe = self._model_states.get("pipeline") or {}
        self.original_tp_degree = len(self.mp_rank_files)
        self.original_pp_degree = int(pipe.get("num_stages", 1))
        self.original_dp_degree = int(self._model_states.get("dp_world_size", 1))
        self.tp_degree = self.original_tp_degree if tp_degree is None else int(tp_degree)
        self.pp_degree = self.original_pp_degree if pp_degree is None else int(pp_degree)
        self.dp_degree = self.original_dp_degree if dp_degree is None else int(dp_degree)
        if self.tp_degree != self.original_tp_degree:
            raise ValueError(f"DeepSpeedCheckpoint: tp_degree {self.tp_degree} differs from the checkpoint's "
                             f"{self.original_tp_degree}; re-slicing tensor-parallel weights is not supported")
        for name, v in (("pp_degree", self.pp_degree), ("dp_degree", self.dp_degree)):
            if v < 1:
                raise ValueError(f"DeepSpeedCheckpoint: {name} must be >= 1, got {v}")
        self.layer_keys = [f"layer_{i:02d}" for i in sorted(self._layer_map)]
        self.global_state = {"iteration": self.get_iteration(), "args": self.get_args()}

    # -- degrees ---------------------------------------------------------------------
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.original_tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.original_pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.original_dp_degree

    # -- global state ------------------------------------------------------------------
    def _client_state(self) -> dict:
        return self._model_states.get(CLIENT_STATE) or {}

    def get_iteration(self) -> int:
        cs = self._client_state()
        fallback = self._model_states.get(ITERATION_KEY, self._model_states.get(GLOBAL_STEPS, 0))
        return int(cs.get(ITERATION_KEY, fallback))

    def get_args(self):
        return self._client_state().get(ARGS_KEY, self._model_states.get(ARGS_KEY))

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY):
        return self._client_state().get(info_key, self._model_states.get(info_key))

    def get_2d_parallel_state(self, tp_index: int, pp_index: int = 0) -> dict:
        """The ``mp_rank`` model-states file of tensor-parallel rank ``tp_index`` (counters,
        scheduler, client state; weights are in the layer files for pipeline checkpoints)."""
        self._check(tp_index=tp_index, pp_index=pp_index)
        return _load(self.mp_rank_files[tp_index])

    # -- layers ------------------------------------------------------------------------
    def _layer_ids(self) -> List[int]:
        return sorted(self._layer_map)

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[0]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[-1]

    def _layer_state(self, layer: int, tp_index: int) -> dict:
        files = self._layer_map[layer]
        if tp_index not in files:
            raise ValueError(f"layer_{layer:02d} has no file for tensor-parallel rank {tp_index} "
                             f"(has {sorted(files)})")
        return _load(files[tp_index])

    def get_embedding_state(self, tp_index: int = 0) -> dict:
        return self._layer_state(self._layer_ids()[0], tp_index)

    def get_final_norm_state(self, tp_index: int = 0) -> dict:
        return self._layer_state(self._layer_ids()[-1], tp_index)

    def get_pp_transformer_map(self, pp_index: int) -> List[str]:
        """The layer ids of the transformer layers (all but the first and last layer) that
        stage ``pp_index`` of ``pp_degree`` holds (``partition_uniform`` split)."""
        self._check(pp_index=pp_index)
        middle = self.layer_keys[1:-1]
        parts = partition_uniform(len(middle), self.pp_degree)
        return middle[parts[pp_index]:parts[pp_index + 1]]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> List[dict]:
        self._check(tp_index=tp_index, pp_index=pp_index)
        return [self._layer_state(int(k.split("_")[1]), tp_index) for k in self.get_pp_transformer_map(pp_index)]

    # -- optimizer files --------------------------------------------------------------
    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> List[str]:
        path = self._optim_map.get((pp_index, tp_index, dp_index))
        return [path] if path is not None else []

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int) -> dict:
        files = self.get_zero_files(pp_index, tp_index, dp_index)
        if not files:
            raise ValueError(f"no optimizer file for pipeline stage {pp_index}, tensor rank {tp_index}, data rank "
                             f"{dp_index} in {self.dir!r} (have {sorted(self._optim_map)})")
        return _load(files[0])

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

    def _check(self, tp_index: Optional[int] = None, pp_index: Optional[int] = None) -> None:
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise ValueError(f"tp_index {tp_index} is outside 0..{self.tp_degree - 1}")
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise ValueError(f"pp_index {pp_index} is outside 0..{self.pp_degree - 1}")
