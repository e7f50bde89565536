"""Pipeline checkpoints: weights by layer, optimizer state by parameter name.

Layout of one tag directory (DeepSpeed's names where it has them)::

    layer_00-model_states.pt ...          one file per layer (``-model_XX`` with tensor slicing),
                                          written by data-parallel rank 0 of the owning stage
    mp_rank_00_model_states.pt            counters, LR scheduler, config, pipeline shape
                                          ("module" is None: weights live in the layer files)
    pipe_stage_SS-zero_pp_rank_D_mp_rank_MM_optim_states.pt
                                          the strategy's fragment files (runtime/checkpoint/universal.py)
                                          of stage SS; a tied weight is written by its owner stage only
    rng_state_rank_R.pt

Because layer files are per layer and fragments are keyed by global parameter name,
a checkpoint loads at any number of stages and any data-parallel size: each stage
reads its layers' files and a :class:`FragmentIndex` merged over every saved stage.
Saving is atomic like every other checkpoint (a temporary directory renamed at the end).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List

import torch
import torch.distributed as dist

from ...utils.logging import logger
from ..checkpoint.engine_checkpoint import (agreed_verification, begin_save, capture_rng_state, commit_or_abort,
                                            model_states_name, restore_rng_state, rng_states_name)
from ..checkpoint.contents import client_state_of, model_states
from ..checkpoint.errors import CheckpointError
from ..checkpoint.io import CheckpointReader, read_latest_tag
from ..checkpoint.universal import FragmentIndex, _load

_STAGE_FILE = re.compile(r"^pipe_stage_(\d+)-zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def stage_optim_name(stage: int, name: str) -> str:
    return f"pipe_stage_{stage:02d}-{name}"


class _StageWriter:
    """Prefixes the strategy's optimizer files with the stage and drops tied weights this
    stage does not own (their state is the owner's)."""

    def __init__(self, writer, stage: int, drop: List[str]):
        self.writer, self.stage, self.drop = writer, stage, set(drop)
        self.path = writer.path

    def save(self, name, obj):
        if isinstance(obj, dict) and "params" in obj and self.drop:
            obj = dict(obj, params={k: v for k, v in obj["params"].items() if k not in self.drop},
                       param_groups=[dict(g, params=[n for n in g["params"] if n not in self.drop])
                                     for g in obj["param_groups"]])
        self.writer.save(stage_optim_name(self.stage, name), obj)

    def write_text(self, name, text):
        self.writer.write_text(name, text)


def _not_owned_tied_names(module) -> List[str]:
    names = []
    for key, info in module._tied_info.items():
        if info["owner"] != module.stage_id:
            names += [f"tied_modules.{key}.{a}" for a in module.tied_weight_attrs[key]]
    return names


def save_pipeline_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True,
                             exclude_frozen_parameters=False) -> bool:
    tag, rank, writer = begin_save(engine, save_dir, tag)
    grid, module = engine.grid, engine.module
    error = None
    try:
        module.save_state_dict(writer.path, exclude_frozen_params=exclude_frozen_parameters)
        mp = grid.model_parallel_id
        if grid.stage_id == 0 and grid.data_parallel_id == 0:
            pipeline = {"num_stages": grid.pipe_parallel_size, "parts": list(module.parts),
                        "num_layers": module._num_layers}
            writer.save(model_states_name(mp), model_states(
                engine, None, client_state, exclude_frozen_parameters=exclude_frozen_parameters,
                extra={"pipeline": pipeline, "dp_world_size": grid.data_parallel_size,
                       "mp_world_size": grid.model_parallel_size,
                       "checkpoint_parallel_dimensions": {"pp_degree": grid.pipe_parallel_size,
                                                          "tp_degree": grid.model_parallel_size}}))
        writer.save(rng_states_name(rank), capture_rng_state())
        engine.strategy.save_optimizer_state(_StageWriter(writer, grid.stage_id, _not_owned_tied_names(module)),
                                             grid.data_parallel_id, mp)
    except Exception as err:  # noqa: BLE001 - report after telling the other ranks
        error = err
    commit_or_abort(engine, writer, rank, error, f"Saving pipeline checkpoint '{tag}'", save_latest)
    if rank == 0:
        logger.info(f"Saved pipeline checkpoint {os.path.join(save_dir, tag)}")
    return True


def merged_stage_states(path: str, mp_rank: int = 0) -> List[dict]:
    """One rank state per saved data-parallel rank, each merged over every saved stage
    (parameters united, parameter groups concatenated by index)."""
    by_dp: Dict[int, List[tuple]] = {}
    for n in os.listdir(path):
        m = _STAGE_FILE.match(n)
        if m and int(m.group(3)) == mp_rank:
            by_dp.setdefault(int(m.group(2)), []).append((int(m.group(1)), os.path.join(path, n)))
    merged = []
    for dp in sorted(by_dp):
        states = [_load(p) for _, p in sorted(by_dp[dp])]
        first = states[0]
        out = dict(first, params={}, param_groups=[dict(g, params=[]) for g in first["param_groups"]])
        for st in states:
            out["params"].update(st["params"])
            if len(st["param_groups"]) != len(out["param_groups"]):
                raise CheckpointError(f"'{path}': stages saved different numbers of optimizer parameter groups.")
            for g, sg in zip(out["param_groups"], st["param_groups"]):
                g["params"] = g["params"] + list(sg["params"])
        merged.append(out)
    return merged


def pipeline_fragment_index(path: str, mp_rank: int = 0):
    """A :class:`FragmentIndex` over every stage of a pipeline checkpoint, or None when
    ``path`` is not one."""
    states = merged_stage_states(path, mp_rank)
    return FragmentIndex(path, states=states) if states else None


class _MergedReader(CheckpointReader):
    def fragment_index(self, mp_rank: int = 0):
        idx = pipeline_fragment_index(self.path, mp_rank)
        if idx is None:
            raise CheckpointError(f"'{self.path}' has no pipeline optimizer files "
                                  f"'pipe_stage_*-zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt'. Pass "
                                  f"load_optimizer_states=False to load the weights only.")
        return idx


def load_pipeline_checkpoint(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                             load_lr_scheduler_states=True, load_module_only=False):
    if tag is None:
        tag = read_latest_tag(load_dir)
        if tag is None:
            logger.warning(f"Unable to find a 'latest' file in '{load_dir}'; nothing was loaded.")
            return None, None
    reader = _MergedReader(load_dir, str(tag))
    with agreed_verification(reader.path):   # every rank raises if any rank read a damaged file
        return _load_pipeline_checkpoint(engine, reader, load_module_strict, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only)


def _load_pipeline_checkpoint(engine, reader, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                              load_module_only):
    grid = engine.grid
    state = reader.load(model_states_name(grid.model_parallel_id))
    if state.get("mp_world_size", 1) != grid.model_parallel_size:
        raise CheckpointError(f"'{reader.path}' was saved with tensor (model) parallel size "
                              f"{state.get('mp_world_size')} but this run uses {grid.model_parallel_size}; "
                              f"only the number of pipeline stages and data-parallel ranks may change.")
    saved_layers = state.get("pipeline", {}).get("num_layers")
    if saved_layers is not None and saved_layers != engine.module._num_layers:
        raise CheckpointError(f"'{reader.path}' holds a pipeline of {saved_layers} layers; this model has "
                              f"{engine.module._num_layers}.")
    engine.module.load_state_dir(reader.path, strict=load_module_strict)
    if load_module_only or not load_optimizer_states:
        engine.strategy.after_module_load()
        engine.module.synchronize_tied_weights()
        if load_module_only:
            return reader.path, client_state_of(state)
    else:
        engine.strategy.load_optimizer_state(reader, load_optimizer_states=True)
        engine.module.synchronize_tied_weights()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.micro_steps = state.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps())
    engine.skipped_steps = state.get("skipped_steps", 0)
    rank = dist.get_rank()
    if reader.exists(rng_states_name(rank)):
        restore_rng_state(reader.load(rng_states_name(rank)))
    return reader.path, client_state_of(state)


def get_fp32_state_dict_from_pipeline_checkpoint(path: str, mp_rank: int = 0) -> Dict[str, torch.Tensor]:
    """Consolidate the fp32 master weights of every stage of a pipeline checkpoint tag
    directory into one plain state dict keyed by the pipeline's parameter names."""
    idx = pipeline_fragment_index(path, mp_rank)
    if idx is None:
        raise CheckpointError(f"'{path}' is not a pipeline checkpoint (no pipe_stage_*_optim_states.pt files).")
    return {name: idx.full(name, "fp32").clone() for name in sorted(idx.names, key=_layer_order)}


def _layer_order(name: str):
    head = name.split(".", 1)[0]
    return (0, int(head), name) if head.isdigit() else (1, 0, name)
