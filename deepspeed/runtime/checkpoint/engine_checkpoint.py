"""Save and load a whole engine: module, optimizer side (via the strategy), scheduler,
counters, RNG states and client state."""
from __future__ import annotations

import contextlib
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist

from ... import comm as ds_comm
from ...utils.logging import logger
from . import manifest as _manifest
from .errors import CheckpointAssertionError, CheckpointError
from .contents import client_state_of, model_states, optim_states
from .io import CheckpointReader, CheckpointWriter, read_latest_tag
from .universal import FORMAT
from .module_parts import merge_module_state, split_module_state
from ..engine_features import checkpoint_state as feature_checkpoint_state
from ..engine_features import load_checkpoint_state as load_feature_checkpoint_state


_DENSE_OPTIM_RE = re.compile(r"(?:^|-)zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


def model_states_name(mp_rank: int, dp_rank=None) -> str:
    """DeepSpeed's names: ``mp_rank_XX_model_states.pt`` (stages 0-2, written by data-parallel
    rank 0), ``zero_pp_rank_R_mp_rank_XX_model_states.pt`` at stage 3 (one per rank; here
    rank 0's holds the whole gathered module, so the checkpoint loads at any world size)."""
    if dp_rank is None:
        return f"mp_rank_{mp_rank:02d}_model_states.pt"
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def find_model_states(reader, mp_rank: int) -> str:
    for name in (model_states_name(mp_rank), model_states_name(mp_rank, 0)):
        if reader.exists(name):
            return name
    raise CheckpointError(f"'{reader.path}' has no model states file ({model_states_name(mp_rank)} or "
                          f"{model_states_name(mp_rank, 0)}): not a deepspeed checkpoint, or incomplete.")


class _EngineWriter(CheckpointWriter):
    """The engine's writer: optimizer files go out in DeepSpeed's envelope
    (``{"optimizer_state_dict": ..., "ds_config": ..., "ds_version": ...}``, see
    :mod:`.contents`) whichever strategy wrote them, and the parameter groups of this rank's
    dense optimizer file are kept for the model-states file's ``param_shapes``."""

    def __init__(self, save_dir: str, tag: str, engine):
        super().__init__(save_dir, tag)
        self._config, self._version = engine.config, engine.ds_version
        self.zero_groups = None

    def save(self, name: str, obj) -> None:
        if name.endswith("_optim_states.pt") and isinstance(obj, dict) and obj.get("format") == FORMAT:
            if self.zero_groups is None and _DENSE_OPTIM_RE.search(name):
                self.zero_groups = [list(g["params"]) for g in obj["param_groups"]]
            obj = optim_states(obj, self._config, self._version)
        super().save(name, obj)


def rng_states_name(rank: int) -> str:
    return f"rng_state_rank_{rank}.pt"


def capture_rng_state() -> dict:
    from ...accelerator import get_accelerator
    acc = get_accelerator()
    np_state = np.random.get_state()
    st = {
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if acc.device_name() != "cpu":
        st["accelerator"] = acc.get_rng_state()
    return st


def restore_rng_state(st: dict) -> None:
    from ...accelerator import get_accelerator
    py = st["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    n = st["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(st["torch"])
    if "accelerator" in st and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(st["accelerator"])


def _all_ok(ok: bool) -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = ds_comm.to_comm_device(torch.tensor([1 if ok else 0], dtype=torch.int32))
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())
    return ok


def _barrier():
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _check_tag(tag: str, mode: str) -> str:
    """The tag every rank saves under. Ranks passing different tags: ``Fail`` raises; ``Warn``
    warns and ``Ignore`` does not, and both save under rank 0's tag (one complete checkpoint;
    DeepSpeed would scatter each rank's files over its own tag directory)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tag
    tags = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        msg = (f"The checkpoint tag name '{tag}' is not consistent across all ranks: {tags}. Pass the same tag "
               f"on every rank (checkpoint.tag_validation is '{mode}').")
        if mode == "Fail":  # DeepSpeed: assert valid, msg
            raise CheckpointAssertionError(msg)
        if mode != "Ignore":
            logger.warning(msg + f" Saving under rank 0's tag '{tags[0]}'.")
    return tags[0]


def begin_save(engine, save_dir: str, tag):
    """The first phase of a save, on every rank: the tag (default ``global_step<N>``)
    checked and validated across ranks, rank 0 preparing the temporary directory.
    Returns ``(tag, rank, writer)``; :func:`commit_or_abort` ends the save."""
    if save_dir is None or not os.fspath(save_dir):   # on every rank, before any collective
        raise ValueError(f"save_checkpoint: save_dir must be a directory path, got {save_dir!r}.")
    save_dir = os.fspath(save_dir)
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    tag = str(tag)
    if not tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"Invalid checkpoint tag {tag!r}: it must be a plain, non-empty directory name.")
    tag = _check_tag(tag, engine.config_obj.model.checkpoint.tag_validation)
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = _EngineWriter(save_dir, tag, engine)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        writer.prepare()
    _barrier()
    return tag, rank, writer


def save_engine_checkpoint(engine, save_dir: str, tag=None, client_state=None, save_latest=True,
                           exclude_frozen_parameters=False) -> bool:
    tag, rank, writer = begin_save(engine, save_dir, tag)
    module_sd = engine.strategy.module_state_dict()  # collective at stage 3: every rank calls it
    error = None
    try:
        # ZeRO's rank: with sequence parallelism every sequence x data rank holds its own partition
        dp_rank, mp_rank = getattr(engine, "seq_dp_rank", engine.dp_rank), engine.mp_rank
        if exclude_frozen_parameters:
            frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
            module_sd = {k: v for k, v in module_sd.items() if k not in frozen}
        module_sd = split_module_state(engine, writer, module_sd)  # registered parts (MoE: per-expert files)
        # the optimizer files first: the model-states file lists their parameter groups (param_shapes)
        engine.strategy.save_optimizer_state(writer, dp_rank, mp_rank)
        stage3 = engine.zero_optimization_partition_weights()
        if dp_rank == 0 or stage3:
            state = model_states(engine, module_sd, client_state, zero_groups=writer.zero_groups,
                                 exclude_frozen_parameters=exclude_frozen_parameters,
                                 extra=feature_checkpoint_state(engine))  # data_sampler, random_ltd, ...
            writer.save(model_states_name(mp_rank, dp_rank if stage3 else None), state)
        writer.save(rng_states_name(rank), capture_rng_state())
    except Exception as err:  # noqa: BLE001 - report after telling the other ranks
        error = err
    commit_or_abort(engine, writer, rank, error, f"Saving checkpoint '{tag}'", save_latest,
                    script_dir=save_dir)
    logger.info(f"Saved checkpoint {os.path.join(save_dir, tag)}") if rank == 0 else None
    return True


def commit_or_abort(engine, writer, rank: int, error, what: str, save_latest: bool, script_dir=None) -> None:
    """The second phase of a save, on every rank: if any rank failed, rank 0 drops the
    temporary directory and every rank raises (its own error, or a CheckpointError);
    else rank 0 writes the strategy's extras, commits (moving ``latest``) and, with
    ``script_dir``, puts DeepSpeed's ``zero_to_fp32.py`` beside the tags."""
    if not _all_ok(error is None):
        if rank == 0:
            writer.abort()
        writer._unregister()
        _barrier()
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on another rank; nothing was committed.")
    commit_error = None
    if rank == 0:
        extra = getattr(engine.strategy, "write_checkpoint_extras", None)
        try:
            if extra is not None:
                extra(writer)
            writer.commit(save_latest)   # the 'latest' update is the commit point; rolls back on failure
        except Exception as err:  # noqa: BLE001 - every rank raises, rank 0 with the cause
            writer.abort()
            commit_error = err
        if commit_error is None and extra is not None and script_dir is not None:
            from ..precision.flat_state import ZERO_TO_FP32_SCRIPT   # DeepSpeed puts the recovery script there
            from .io import atomic_write_text
            try:   # after the commit point: the checkpoint is saved whatever happens here
                atomic_write_text(os.path.join(script_dir, "zero_to_fp32.py"), ZERO_TO_FP32_SCRIPT, executable=True)
            except CheckpointError as err:
                logger.warning(f"Checkpoint '{writer.tag}' is saved, but {err}")
    writer._unregister()
    if not _all_ok(commit_error is None):
        if commit_error is not None:
            raise commit_error
        raise CheckpointError(f"{what}: rank 0 could not commit it (its error says why); nothing was committed.")


@contextlib.contextmanager
def agreed_verification(path: str, share=None):
    """Load a tag's files inside this block: each rank checks what it reads (tensor
    mismatches collected, not raised, so no rank leaves a collective its peers are in),
    then one small collective (an int all-reduce; the messages are gathered only when one
    failed) makes every rank raise the same :class:`CheckpointError`, naming each damaged
    file and tensor, including ranks that never read the damaged file. An exception from
    the body propagates as it is, without the collective. ``share=(rank, world_size)``:
    every rank reads the same files (no model parallelism), so each checks its share of
    them (:func:`.manifest.deferred_failures`)."""
    with _manifest.deferred_failures(share) as failures:
        yield
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if multi and not _all_ok(not failures):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(failures))
        failures = [f"rank {r}: {m}" for r, ms in enumerate(gathered) for m in (ms or [])]
    if failures:
        raise CheckpointError(f"Checkpoint '{path}' failed verification on load: {' | '.join(failures)} The engine's "
                              f"state is partly overwritten with the damaged data: load another tag (or a repaired "
                              f"copy of this one) before training.")


def load_engine_checkpoint(engine, load_dir: str, tag=None, load_module_strict=True,
                           load_optimizer_states=True, load_lr_scheduler_states=True,
                           load_module_only=False, custom_load_fn=None):
    if tag is None:
        tag = read_latest_tag(load_dir)
        if tag is None:
            logger.warning(f"Unable to find a 'latest' file in '{load_dir}'; nothing was loaded. "
                           f"Pass tag=... to load a specific checkpoint.")
            return None, None
    reader = CheckpointReader(load_dir, str(tag))
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    # without model parallelism every rank reads the same files: each checks its share
    share = (dist.get_rank(), dist.get_world_size()) if multi and engine.mpu is None else None
    with agreed_verification(reader.path, share):
        if load_optimizer_states and not load_module_only:
            # the optimizer files are memory-mapped (checked by a pass before loading): this
            # rank's share of them is checked in the background while the module loads
            from .universal import list_rank_files
            from .io import _load_unverified
            with contextlib.suppress(CheckpointError, OSError):
                files = list_rank_files(reader.path, engine.mp_rank)
                _manifest.prefetch([p for i, p in enumerate(files) if share is None or i % share[1] == share[0]],
                                   _load_unverified)
        return _load_engine_checkpoint(engine, reader, load_module_strict, load_optimizer_states,
                                       load_lr_scheduler_states, load_module_only, custom_load_fn)


def _merged_sparse_names(engine, saved: set, saved_params: set, strict: bool) -> set:
    """DeepSpeed's rule for ``sparse_tensor_module_names`` after a load: a strict load takes the
    checkpoint's set; a non-strict one keeps this engine's names except parameters the
    checkpoint holds as dense, and adds the checkpoint's sparse names this model has."""
    if strict:
        return saved
    mine = set(engine.sparse_tensor_module_names)
    own_params = {n for n, _ in engine.module.named_parameters()}
    return {n for n in mine if n in saved or n not in saved_params} | (saved & own_params)


def _load_engine_checkpoint(engine, reader, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                            load_module_only, custom_load_fn):
    state = reader.load(find_model_states(reader, engine.mp_rank), share=True)
    missing = {"module", "global_steps"} - set(state)
    if missing:
        raise CheckpointError(f"'{reader.path}' is not a deepspeed checkpoint: missing {sorted(missing)}.")
    client_state = client_state_of(state)  # top-level keys that are not deepspeed's (older ours: nested)
    from .deepspeed_native import full_module_state, is_native_dir
    if is_native_dir(reader.path):  # written by DeepSpeed itself (its layout; see deepspeed_native)
        state = dict(state, module=full_module_state(reader.path, engine.mp_rank))
    module_sd = merge_module_state(engine, reader, state["module"])  # registered parts (MoE: this rank's experts)
    engine._load_module_weights(module_sd, strict=load_module_strict, custom_load_fn=custom_load_fn)
    if load_module_only:
        engine.strategy.after_module_load()
        return reader.path, client_state
    if load_optimizer_states:
        engine.strategy.load_optimizer_state(reader, load_optimizer_states=True)
    else:
        engine.strategy.after_module_load()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
    # micro_steps places the next accumulation boundary: keep the saved count only where it is a
    # position inside the current accumulation window (same gradient_accumulation_steps); a job
    # resumed with another accumulation count (elastic, another world size) starts a window
    gas = engine.gradient_accumulation_steps()
    at_boundary = engine.global_steps * gas
    saved = state.get("micro_steps", at_boundary)
    engine.micro_steps = saved if 0 <= saved - at_boundary < gas else at_boundary
    engine.skipped_steps = state.get("skipped_steps", 0)
    saved_sparse = state.get("sparse_tensor_module_names", state.get("csr_tensor_module_names"))
    if saved_sparse is not None:
        engine.sparse_tensor_module_names = _merged_sparse_names(
            engine, set(saved_sparse), set(module_sd), load_module_strict)
    load_feature_checkpoint_state(engine, state)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if reader.exists(rng_states_name(rank)):
        restore_rng_state(reader.load(rng_states_name(rank)))
    else:
        logger.warning(f"No RNG state for rank {rank} in '{reader.path}' (saved at another world size); "
                       f"RNG streams continue from their current state.")
    return reader.path, client_state
