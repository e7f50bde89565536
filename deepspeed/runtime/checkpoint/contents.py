"""What goes into a checkpoint's files, key by key, as DeepSpeed writes them.

Why: tools read DeepSpeed's checkpoint files directly, not through ``load_checkpoint``
(PyTorch Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` and its
``DeepSpeedStrategy``, Megatron-style converters, users' scripts). They expect the
keys where DeepSpeed puts them (facts from DeepSpeed's ``runtime/engine.py``,
``_common_checkpoint_state`` / ``_save_checkpoint`` / ``_save_zero_checkpoint``):

* model-states file (``mp_rank_XX_model_states.pt``; at stage 3 one
  ``zero_pp_rank_R_mp_rank_XX_model_states.pt`` per rank): ``module``,
  ``buffer_names``, ``optimizer`` (``None`` under ZeRO), ``param_shapes`` (per optimizer
  group, name -> shape; ZeRO only), ``frozen_param_shapes`` / ``frozen_param_fragments``
  (stage >= 2), ``shared_params`` (tied name -> the name holding the data; ZeRO only),
  ``lr_scheduler``, ``data_sampler``, ``random_ltd``, ``sparse_tensor_module_names``,
  ``skipped_steps``, ``global_steps``, ``global_samples``, ``dp_world_size``,
  ``mp_world_size``, ``checkpoint_parallel_dimensions``, ``ds_config``, ``ds_version``,
  and **the client state merged at the top level** (``state.update(client_state)``);
* optimizer-states file (``zero_pp_rank_R_mp_rank_XX_optim_states.pt``):
  ``{"optimizer_state_dict": ..., "ds_config": ..., "ds_version": ...}``, where
  ``optimizer_state_dict`` carries ``zero_stage`` and ``partition_count`` (what tools
  read) and, here, the rank's fragments (:mod:`.universal`) - keyed by parameter name,
  so a checkpoint loads at any world size and stage - instead of DeepSpeed's flat
  partitions.

Differences, on purpose: ``module`` is the whole module at every stage (rank 0's file at
stage 3; DeepSpeed writes placeholders there), and stage 0 keeps its optimizer state in
the fragments file (``optimizer`` is ``None``), so every stage's checkpoint loads at every
other stage. Two keys of ours sit beside DeepSpeed's: ``micro_steps`` (exact resume
inside a gradient-accumulation window) and ``pipeline`` (pipeline checkpoints: stage
count and layer parts); like DeepSpeed's own keys they are never handed back as client
state.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Optional

import torch

from ...utils.logging import logger
from ..engine_features import feature_checkpoint_keys
from ..engine_queries import _checkpoint_parallel_metadata

# Keys DeepSpeed writes into a model-states file itself (0.9 to 0.19); every other top-level
# key is the client_state the user passed to save_checkpoint.
DEEPSPEED_MODEL_STATE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "compression_training", "data_efficiency", "num_experts",
    "ds_autoep_layers", "universal_checkpoint_info", "csr_tensor_module_names",
})
#: keys this package adds beside DeepSpeed's (see the module docstring)
OWN_MODEL_STATE_KEYS = frozenset({"micro_steps", "pipeline"})
#: the one key of this package's checkpoints before 0.19 (client state nested, not merged)
LEGACY_CLIENT_STATE_KEY = "client_state"


# ---------------------------------------------------------------- model-states file
def buffer_names(module: torch.nn.Module) -> List[str]:
    """Persistent buffers, by state-dict name (DeepSpeed's ``_get_buffer_names``)."""
    out = []

    def walk(mod, prefix):
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append(prefix + name)
        for name, child in mod.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out


def _shape(p) -> torch.Size:
    return torch.Size(getattr(p, "ds_shape", p.shape))


def param_shapes(module: torch.nn.Module, groups: Iterable[Iterable[str]]) -> List["OrderedDict"]:
    """Per optimizer parameter group, ``name -> full shape`` in the group's order."""
    params = dict(module.named_parameters())
    return [OrderedDict((n, _shape(params[n])) for n in g if n in params) for g in groups]


def shared_params(module: torch.nn.Module) -> dict:
    """``{tied name: the name that holds the data}`` for parameters reachable under two
    names (tied embeddings), as DeepSpeed's ``_get_shared_params``."""
    first, shared = {}, {}

    def walk(mod, prefix):
        for name, p in mod.named_parameters(recurse=False):
            if p is None:
                continue
            if id(p) in first:
                shared[prefix + name] = first[id(p)]
            else:
                first[id(p)] = prefix + name
        for name, child in mod.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return shared


def _frozen(module, attr):
    out = OrderedDict()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            out[name] = attr(p)
    return out


def _frozen_fragment(p) -> torch.Tensor:
    part = getattr(p, "ds_tensor", None)   # stage 3: this rank's partition, as DeepSpeed stores it
    src = part if torch.is_tensor(part) and part.numel() > 0 else p
    return src.detach().to("cpu", copy=True)


def model_states(engine, module_sd, client_state: Optional[dict], *, zero_groups=None,
                 exclude_frozen_parameters: bool = False, extra: Optional[dict] = None) -> dict:
    """The model-states dict of ``engine``: DeepSpeed's keys, then the client state merged
    at the top level. ``zero_groups``: the optimizer's parameter groups as name lists
    (from this rank's optimizer file), for ``param_shapes``; None without an optimizer.
    ``extra``: more top-level entries (engine features' ``data_sampler``, ...; ``pipeline``),
    set before the client state is merged."""
    module = engine.module
    stage = engine.zero_optimization_stage()
    zero = stage > 0 and zero_groups is not None
    frozen = stage >= 2 and not exclude_frozen_parameters
    sched = engine.lr_scheduler
    state = {
        "module": module_sd,
        "buffer_names": buffer_names(module),
        "optimizer": None,
        "param_shapes": param_shapes(module, zero_groups) if zero else None,
        "frozen_param_shapes": _frozen(module, _shape) if frozen else None,
        "shared_params": shared_params(module) if zero else None,
        "frozen_param_fragments": _frozen(module, _frozen_fragment) if frozen else None,
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(getattr(engine, "sparse_tensor_module_names", ()) or ()),
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        # DeepSpeed writes the sequence-data-parallel size (dp x sp) here (its engine: seq_dp_world_size)
        "dp_world_size": getattr(engine, "seq_dp_world_size", engine.dp_world_size),
        "mp_world_size": engine.mp_world_size,
        # the pipeline and tensor-parallel degrees, read from the mpu in DeepSpeed's order
        **_checkpoint_parallel_metadata(getattr(engine, "mpu", None)),
        "ds_config": engine.config,
        "ds_version": engine.ds_version,
        "micro_steps": engine.micro_steps,
    }
    state.update(extra or {})
    merge_client_state(state, client_state)
    return state


def merge_client_state(state: dict, client_state: Optional[dict]) -> dict:
    """``state.update(client_state)`` as DeepSpeed does (the client's value wins), with a
    warning naming any key that replaces one of DeepSpeed's own."""
    client_state = dict(client_state or {})
    clash = sorted(k for k in client_state if k in DEEPSPEED_MODEL_STATE_KEYS or k in OWN_MODEL_STATE_KEYS)
    if clash:
        logger.warning(f"save_checkpoint: client_state keys {clash} replace deepspeed's own entries of the same "
                       f"name in the model-states file (DeepSpeed merges client_state at the top level); rename "
                       f"them to keep deepspeed's values.")
    state.update(client_state)
    return state


def client_state_of(state: dict) -> dict:
    """The client state saved with a model-states dict: its top-level keys that are not
    DeepSpeed's (or ours), or - in this package's checkpoints before 0.19 - the nested
    ``client_state`` dict."""
    if LEGACY_CLIENT_STATE_KEY in state and "buffer_names" not in state:
        return dict(state[LEGACY_CLIENT_STATE_KEY] or {})
    own = OWN_MODEL_STATE_KEYS | feature_checkpoint_keys()  # + engine features' entries (engine_features)
    return {k: v for k, v in state.items() if k not in DEEPSPEED_MODEL_STATE_KEYS and k not in own}


# ---------------------------------------------------------------- optimizer-states file
def optim_states(rank_state: dict, ds_config, ds_version: str) -> dict:
    """An optimizer-states file's dict: DeepSpeed's envelope around one rank's fragments,
    with DeepSpeed's ``zero_stage`` and ``partition_count`` inside (a view: no copy)."""
    osd = dict(rank_state)
    stage = int(rank_state["zero_stage"])
    world = int(rank_state["dp_world_size"]) if stage > 0 else 1
    # DeepSpeed: one count per parameter group at stages 1/2, one int at stage 3
    osd.setdefault("partition_count", world if stage in (0, 3) else [world] * len(rank_state["param_groups"]))
    osd.setdefault("ds_version", ds_version)
    return {"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version}
