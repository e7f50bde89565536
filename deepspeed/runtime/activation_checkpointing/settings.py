"""What ``deepspeed.checkpointing.configure`` decided, validated once.

The settings come from the ``activation_checkpointing`` config section, and any
explicit argument to ``configure`` overrides the matching key (documented
precedence). ``checkpoint`` reads them at every call, so re-configuring takes
effect for the next checkpointed call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from deepspeed.config.base import parse_section
from deepspeed.config.errors import DeepSpeedConfigAssertionError, DeepSpeedConfigError
from deepspeed.config.sections import ActivationCheckpointingSection

_SECTION = "activation_checkpointing"
_REQUIRED_MPU_METHODS = ("get_model_parallel_rank", "get_model_parallel_group", "get_model_parallel_world_size")


@dataclass(frozen=True)
class CheckpointSettings:
    """Resolved activation-checkpointing options (argument names of ``configure``)."""
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = CheckpointSettings()
_mpu = None
_configured = False


def current() -> CheckpointSettings:
    return _settings


def current_mpu():
    """The mpu given to ``configure``, else the one registered with ``deepspeed.comm.groups``."""
    if _mpu is not None:
        return _mpu
    from deepspeed.comm import groups
    return groups.get_mpu()


def is_configured() -> bool:
    """True once ``configure`` has been called (and not undone by ``_reset_settings``)."""
    return _configured


def _section_from(deepspeed_config) -> ActivationCheckpointingSection:
    """The typed section from a path, a dict or a DeepSpeedConfig; batch-size keys are not needed."""
    from deepspeed.config import DeepSpeedConfig
    from deepspeed.config.ds_config import load_config_source
    if deepspeed_config is None:
        return ActivationCheckpointingSection()
    if isinstance(deepspeed_config, DeepSpeedConfig):
        return deepspeed_config.activation_checkpointing_config
    if isinstance(deepspeed_config, ActivationCheckpointingSection):
        return deepspeed_config
    raw = load_config_source(deepspeed_config)  # raises naming the file / the wrong type
    return parse_section(ActivationCheckpointingSection, raw.get(_SECTION), _SECTION)


def _check_bool(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise DeepSpeedConfigError(f"deepspeed.checkpointing.configure: {name} must be True, False or None, "
                                   f"got {value!r}")


def _check_mpu(mpu) -> None:
    if mpu is None:
        return
    missing = [m for m in _REQUIRED_MPU_METHODS if not callable(getattr(mpu, m, None))]
    if missing:
        raise DeepSpeedConfigError(
            f"deepspeed.checkpointing.configure: mpu_ ({type(mpu).__name__}) lacks {', '.join(missing)}; "
            f"an mpu must implement {', '.join(_REQUIRED_MPU_METHODS)} (and the data-parallel equivalents), "
            "or pass mpu_=None for no model parallelism")


def resolve(deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
            num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> CheckpointSettings:
    """Merge the config section with explicit arguments (arguments win) and validate."""
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("checkpoint_in_cpu", checkpoint_in_cpu), ("synchronize", synchronize),
                        ("profile", profile)):
        _check_bool(name, value)
    if num_checkpoints is not None and (isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int)
                                        or num_checkpoints < 1):
        raise DeepSpeedConfigError(f"deepspeed.checkpointing.configure: num_checkpoints must be a positive int "
                                   f"(the number of checkpointed calls per forward), got {num_checkpoints!r}")
    section = _section_from(deepspeed_config)
    base = CheckpointSettings(
        partition_activations=section.partition_activations,
        contiguous_checkpointing=section.contiguous_memory_optimization,
        num_checkpoints=section.number_checkpoints,
        checkpoint_in_cpu=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile)
    overrides = {k: v for k, v in dict(
        partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
        profile=profile).items() if v is not None}
    settings = replace(base, **overrides)
    _validate(settings)
    return settings


def _validate(s: CheckpointSettings) -> None:
    # Both are AssertionErrors too (DeepSpeedConfigAssertionError), as DeepSpeed's configure asserts them.
    if s.contiguous_checkpointing and s.num_checkpoints is None:
        raise DeepSpeedConfigAssertionError(
            "Contiguous activation checkpointing (contiguous_checkpointing / "
            "activation_checkpointing.contiguous_memory_optimization) needs the number of checkpoints (the number "
            "of layers checkpointed per forward) to size its buffer: pass num_checkpoints=N or set "
            "activation_checkpointing.number_checkpoints")
    if s.contiguous_checkpointing and not s.partition_activations:
        raise DeepSpeedConfigAssertionError(
            "Contiguous activation checkpointing (contiguous_checkpointing / "
            "activation_checkpointing.contiguous_memory_optimization) copies the partitioned activations into "
            "one buffer, so it requires partition_activations=True "
            "(activation_checkpointing.partition_activations)")


def apply(mpu_, settings: CheckpointSettings) -> None:
    """Install resolved settings and the mpu (module state read by ``checkpoint``)."""
    global _settings, _mpu, _configured
    _check_mpu(mpu_)
    _settings, _mpu, _configured = settings, mpu_, True


def override(**fields) -> None:
    """Replace single fields of the installed settings (DeepSpeed's module globals are assigned
    directly, e.g. ``deepspeed.checkpointing.PARTITION_ACTIVATIONS = False``; no validation, as there)."""
    global _settings
    _settings = replace(_settings, **fields)


def set_mpu(mpu_) -> None:
    global _mpu
    _mpu = mpu_


def set_configured(flag: bool) -> None:
    global _configured
    _configured = bool(flag)


def _reset_settings() -> None:
    """Back to the unconfigured defaults (tests use this between cases)."""
    global _settings, _mpu, _configured
    _settings, _mpu, _configured = CheckpointSettings(), None, False
