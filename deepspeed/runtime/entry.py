"""``deepspeed.initialize`` and the command-line helpers."""
from __future__ import annotations

import argparse

import torch

from ..config import DeepSpeedConfig
from ..config.errors import DeepSpeedConfigError


def _config_source(args, config, config_params):
    sources = []
    if args is not None:
        for attr in ("deepspeed_config", "deepscale_config"):
            val = getattr(args, attr, None)
            if val is not None:
                sources.append((f"args.{attr}", val))
                break
    if config is not None:
        sources.append(("config", config))
    if config_params is not None:
        sources.append(("config_params", config_params))
    if not sources:
        raise DeepSpeedConfigError(
            "deepspeed.initialize needs a config: pass config=<dict or path>, or args with "
            "--deepspeed_config <path> (see deepspeed.add_config_arguments).")
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise DeepSpeedConfigError(
            f"deepspeed.initialize was given more than one config source ({names}); give exactly one.")
    return sources[0][1]


class MissingModelError(TypeError, AssertionError):
    """``deepspeed.initialize`` without a model (DeepSpeed asserts it: an ``AssertionError`` too)."""


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Wrap ``model`` for training as configured.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``: the engine, the
    optimizer that performs the update (``None`` if none was configured), a
    ``DeepSpeedDataLoader`` over ``training_data`` (or ``None``), and the LR scheduler
    (or ``None``).
    """
    from .. import comm
    from .engine import DeepSpeedEngine
    source = _config_source(args, config, config_params)
    if model is None:
        hint = (" (a torch.nn.Module was passed as the first positional argument, which is 'args': pass it "
                "as model=...)" if isinstance(args, torch.nn.Module) else "")
        raise MissingModelError(f"deepspeed.initialize requires a model: pass model=<torch.nn.Module>{hint}.")
    comm.init_distributed(dist_init_required=dist_init_required, verbose=False,
                          distributed_port=distributed_port or 29500)
    engine_cls = DeepSpeedEngine
    from .pipe.module import PipelineModule
    if isinstance(model, PipelineModule):  # pipeline parallelism: the module's grid is the mpu
        if mpu is not None:
            raise ValueError("deepspeed.initialize: pass no 'mpu' with a PipelineModule; its topology "
                             "(PipelineModule(topology=...)) provides the model-parallel groups.")
        from .pipe.engine import PipelineEngine
        from .pipe.topology import StageMpu
        engine_cls, mpu = PipelineEngine, StageMpu(model.mpu())
    from ..comm import groups
    from .sequence_parallel.engine_groups import resolve_sequence_parallel_mpu
    # "sequence_parallel_size" (or mesh_param=(dp, sp)): the batch counts dp ranks only
    mpu = resolve_sequence_parallel_mpu(mpu, source, mesh_param=mesh_param)
    ds_config = DeepSpeedConfig(source, mpu=mpu, world_size=groups.get_data_parallel_world_size(mpu))
    if ds_config.optimizer is not None:
        from .optimizers import validate_optimizer_config
        validate_optimizer_config(ds_config.optimizer.type, ds_config.optimizer.params)
    if ds_config.scheduler is not None:
        from .lr_schedules import validate_scheduler_config
        validate_scheduler_config(ds_config.scheduler.type, ds_config.scheduler.params)
    engine = engine_cls(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                        training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                        dist_init_required=dist_init_required, collate_fn=collate_fn,
                        config_class=ds_config)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` and the older ``--deepscale*`` flags."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--gpt_precision", default=None, type=str, help="unused (kept for compatibility)")
    return parser
