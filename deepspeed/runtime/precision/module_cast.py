"""How the module is cast for 16-bit training (DeepSpeed 0.19.5's ``data_types.param_dtype`` /
``buffer_dtype``).

Parameters take the training dtype (fp16 or bf16). Floating-point buffers keep the dtype they
were built with (a rotary ``inv_freq`` stays fp32) unless ``data_types.buffer_dtype`` names one;
``data_types.param_dtype``, when given, must name the dtype the fp16/bf16 flags select.

One rule of our own: the running statistics of normalisation layers (BatchNorm, InstanceNorm
with ``track_running_stats``) follow their module's weights, because torch's kernels refuse
16-bit weights with fp32 running statistics (DeepSpeed leaves them fp32, and such a model then
fails in its first forward unless ``buffer_dtype`` is set).

The strategies cast the parameters; the engine then casts the buffers once (:func:`cast_buffers`).
The functions taking ``engine`` (anything with ``_config``, ``fp16_enabled()``, ``bfloat16_enabled()``
and ``module``) are exposed on the engine under DeepSpeed's method names.
"""
from __future__ import annotations

import torch

from ...config.errors import DeepSpeedConfigAssertionError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _training_dtype(engine):
    if engine.fp16_enabled():
        return torch.float16
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return None


def assert_valid_mixed_precision_config(engine) -> None:
    """``data_types.param_dtype``, when set, must be the dtype the fp16/bf16 flags select."""
    requested = engine._config.param_dtype
    if requested is None:
        return
    model = _training_dtype(engine) or torch.float32
    if DTYPES[requested] != model:
        raise DeepSpeedConfigAssertionError(
            f"data_types.param_dtype = '{requested}' conflicts with the enabled precision (parameters train in "
            f"{model}): enable the matching fp16/bf16 section or leave data_types.param_dtype out.")


def mixed_precision_dtypes(engine):
    """(parameter dtype or None, buffer dtype or None): the training dtype when fp16/bf16 is on;
    buffers are cast only when ``data_types.buffer_dtype`` names a dtype."""
    buf = engine._config.buffer_dtype
    return _training_dtype(engine), (DTYPES[buf] if buf is not None else None)


def configured_buffer_dtype(config):
    """``data_types.buffer_dtype`` of a DeepSpeedConfig as a torch dtype (None: not set)."""
    name = getattr(config, "buffer_dtype", None)
    return DTYPES[name] if name else None


def cast_buffers(module, buffer_dtype) -> None:
    """Floating buffers to ``buffer_dtype`` when given; otherwise only normalisation running
    statistics move, to their module's weight dtype (run after the parameters are cast)."""
    stats = {}
    if buffer_dtype is None:
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats \
                    and m.weight is not None:
                for b in (m.running_mean, m.running_var):
                    if b is not None:
                        stats[id(b)] = m.weight.dtype
        if not stats:
            return
    for b in module.buffers():
        target = buffer_dtype if buffer_dtype is not None else stats.get(id(b))
        if target is not None and b.is_floating_point() and b.dtype != target:
            b.data = b.data.to(target)


def cast_module_mixed_precision(engine, param_dtype, buffer_dtype, is_zero_init_model) -> None:
    """Cast the floating parameters to ``param_dtype`` (not when zero.Init made them: they
    already have their dtype), then the buffers (:func:`cast_buffers`)."""
    module = engine.module
    if param_dtype is not None and not is_zero_init_model:
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
    cast_buffers(module, buffer_dtype)
