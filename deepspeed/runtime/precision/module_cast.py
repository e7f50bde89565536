"""How the module is cast for 16-bit training (DeepSpeed 0.19.5's ``data_types.param_dtype`` /
``buffer_dtype``).

Parameters take the training dtype (fp16 or bf16). Floating-point buffers keep the dtype they
were built with (a rotary ``inv_freq`` stays fp32) unless ``data_types.buffer_dtype`` names one;
``data_types.param_dtype``, when given, must name the dtype the fp16/bf16 flags select.

One rule of our own: the running statistics of normalisation layers (BatchNorm, InstanceNorm
with ``track_running_stats``) follow their module's weights, because torch's kernels refuse
16-bit weights with fp32 running statistics (DeepSpeed leaves them fp32, and such a model then
fails in its first forward unless ``buffer_dtype`` is set).

The three functions take the engine (anything with ``_config``, ``fp16_enabled()``,
``bfloat16_enabled()`` and ``module``); the engine exposes them under DeepSpeed's method names.
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


def _running_stats(module):
    """Buffers whose dtype must follow their module's weights (normalisation running statistics)."""
    out = {}
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in ("running_mean", "running_var"):
                b = getattr(m, name, None)
                if b is not None:
                    out[id(b)] = m
    return out


def cast_module_mixed_precision(engine, param_dtype, buffer_dtype, is_zero_init_model) -> None:
    """Cast the floating parameters to ``param_dtype`` (not when zero.Init made them: they
    already have their dtype) and the floating buffers to ``buffer_dtype`` when given; running
    statistics follow their module's weight dtype."""
    module = engine.module
    if param_dtype is not None and not is_zero_init_model:
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
    stats = _running_stats(module)
    for b in module.buffers():
        if not b.is_floating_point():
            continue
        owner = stats.get(id(b))
        target = buffer_dtype
        if owner is not None and buffer_dtype is None and owner.weight is not None:
            target = owner.weight.dtype
        if target is not None and b.dtype != target:
            b.data = b.data.to(target)


def cast_buffers(module, buffer_dtype, param_dtype) -> None:
    """The buffer half of :func:`cast_module_mixed_precision` for strategies that cast their
    parameters themselves (running statistics follow ``param_dtype`` unless ``buffer_dtype``)."""
    stats = _running_stats(module)
    for b in module.buffers():
        if not b.is_floating_point():
            continue
        target = buffer_dtype if buffer_dtype is not None else (param_dtype if id(b) in stats else None)
        if target is not None and b.dtype != target:
            b.data = b.data.to(target)
