"""Module surgery for compression: find modules by name pattern, swap in the compressible
layers (keeping the very same parameter objects), and make techniques permanent.

``recursive_getattr`` / ``recursive_setattr`` address a submodule by its dotted name
(DeepSpeed-Chat's LoRA code imports them from here). A module pattern in
``modules`` / ``related_modules`` is a regular expression searched in the module's
dotted name (``"attention.self"``, ``"layer.\\w+.output.dense"``); ``"*"`` matches every
module the technique applies to.
"""
from __future__ import annotations

import re
from typing import Iterable, List, Tuple

from torch import nn

from .basic_layer import (BNLayer_Compress, ColumnParallelLinear_Compress, Conv2dLayer_Compress, Embedding_Compress,
                          LinearLayer_Compress, RowParallelLinear_Compress)
from .constants import (ACTIVATION_QUANTIZATION, CHANNEL_PRUNING, HEAD_PRUNING, ROW_PRUNING, SPARSE_PRUNING,
                        WEIGHT_QUANTIZATION)


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name='a.b.c'`` (integer parts index containers)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name: str, module) -> None:
    """Set ``model.a.b.c = module`` for ``module_name='a.b.c'``."""
    parts = module_name.split(".")
    parent = recursive_getattr(model, ".".join(parts[:-1])) if len(parts) > 1 else model
    parent.__setattr__(parts[-1], module)


# ---------------------------------------------------------------- which modules a technique takes

_LINEAR = (nn.Linear,)
_CONV = (nn.Conv2d,)
#: Module types each technique applies to (the compressible subclasses are instances too).
TECHNIQUE_TYPES = {
    WEIGHT_QUANTIZATION: (nn.Linear, nn.Conv2d, nn.Embedding),
    ACTIVATION_QUANTIZATION: (nn.Linear, nn.Conv2d),
    SPARSE_PRUNING: (nn.Linear, nn.Conv2d),
    ROW_PRUNING: _LINEAR,
    HEAD_PRUNING: _LINEAR,
    CHANNEL_PRUNING: _CONV,
}
#: Module types that can be a related module (they lose inputs when the pruned module loses outputs).
RELATED_TYPES = {
    ROW_PRUNING: _LINEAR,
    HEAD_PRUNING: _LINEAR,
    CHANNEL_PRUNING: (nn.Conv2d, nn.BatchNorm2d),
}


def _mpu_types(mpu) -> tuple:
    if mpu is None:
        return ()
    return tuple(t for t in (getattr(mpu, "ColumnParallelLinear", None), getattr(mpu, "RowParallelLinear", None))
                 if isinstance(t, type))


def is_module_compressible(module, mpu=None) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding, nn.BatchNorm2d) + _mpu_types(mpu))


def pattern_matches(pattern: str, name: str) -> bool:
    if pattern == "*":
        return True
    try:
        return re.search(pattern, name) is not None
    except re.error as e:
        raise ValueError(f"compression_training: module pattern {pattern!r} is not a valid regular expression "
                         f"({e}); patterns are searched in module names, '*' matches all.") from None


def get_module_name(group_name, model, key_word, exist_module_name, mpu=None, verbose=True, types=None):
    """Names of the modules matching ``key_word`` (and of ``types``, default: compressible),
    skipping those already in ``exist_module_name``; a module claimed twice within one
    technique is an error when ``verbose``. Returns ``(names, exist_module_name)``."""
    names = []
    for name, module in model.named_modules():
        ok = isinstance(module, types) if types is not None else is_module_compressible(module, mpu)
        if not name or not ok or not pattern_matches(key_word, name):
            continue
        if name in exist_module_name:
            if verbose and key_word != "*":
                raise ValueError(f"compression_training group '{group_name}': module '{name}' is already claimed by "
                                 f"another group of the same technique; each module may be in one group.")
            continue
        exist_module_name.add(name)
        names.append(name)
    return names, exist_module_name


# ---------------------------------------------------------------- replacement

def _compress_copy(old, mpu=None):
    """The compressible layer that takes ``old``'s place, holding the same parameter objects."""
    if isinstance(old, (LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress, BNLayer_Compress)):
        return old
    if isinstance(old, nn.Linear):
        new = LinearLayer_Compress(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    elif isinstance(old, nn.Conv2d):
        new = Conv2dLayer_Compress(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                                   old.dilation, old.groups, old.bias is not None, old.padding_mode, device="meta")
    elif isinstance(old, nn.BatchNorm2d):
        new = BNLayer_Compress(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats,
                               device="meta")
        for b in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, b, getattr(old, b))
    elif isinstance(old, nn.Embedding):
        # _weight: no initialisation (normal_ on the meta device would pull in torch's compiler)
        new = Embedding_Compress(old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
                                 old.scale_grad_by_freq, old.sparse, _weight=old.weight.detach())
    elif mpu is not None and isinstance(old, _mpu_types(mpu)):
        if isinstance(old, getattr(mpu, "ColumnParallelLinear", ())):
            new = ColumnParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=old.bias is not None,
                                                gather_output=old.gather_output, skip_bias_add=old.skip_bias_add)
        else:
            new = RowParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=old.bias is not None,
                                             input_is_parallel=old.input_is_parallel,
                                             skip_bias_add=old.skip_bias_add)
    else:
        return None
    # the same Parameter objects: weights kept, any optimizer or hook on them still valid
    new.weight = old.weight
    if getattr(old, "bias", None) is not None:
        new.bias = old.bias
    for attr in ("start_bits", "target_bits", "q_period"):
        if not hasattr(new.weight, attr):
            setattr(new.weight, attr, None)
    new.train(old.training)
    return new


def module_replacement(model, module_name, compression_technique=None, mpu=None):
    """Put the compressible layer in ``module_name``'s place and switch on the techniques in
    ``compression_technique`` (``{technique: merged shared + group parameters}``)."""
    old = recursive_getattr(model, module_name)
    new = _compress_copy(old, mpu)
    if new is None:
        return None
    if compression_technique:
        for k, v in compression_technique.items():
            if not v.get("enabled", False):
                continue
            if k == SPARSE_PRUNING:
                new.enable_sparse_pruning(v["dense_ratio"], v["method"], v.get("block_pattern", "4x1"))
            elif k == ROW_PRUNING:
                new.enable_row_pruning(v["dense_ratio"], v["method"])
            elif k == HEAD_PRUNING:
                new.enable_head_pruning(v["dense_ratio"], v["method"], v["num_heads"])
            elif k == ACTIVATION_QUANTIZATION:
                new.enable_activation_quantization(v["bits"], v["quantization_type"], v["range_calibration"])
            elif k == WEIGHT_QUANTIZATION:
                new.enable_weight_quantization(v["start_bits"], v["target_bits"], v["quantization_period"],
                                               v["quantize_weight_in_forward"], v["quantization_type"],
                                               v["quantize_groups"], v.get("rounding", "nearest"))
            elif k == CHANNEL_PRUNING:
                new.enable_channel_pruning(v["dense_ratio"], v["method"])
            else:
                raise ValueError(f"Compression technique {k!r} is not one of weight_quantization, "
                                 f"activation_quantization, sparse_pruning, row_pruning, head_pruning, channel_pruning.")
    if new is not old:
        recursive_setattr(model, module_name, new)
    return new


def compression_preparation(model, compression_technique_list, mpu):
    """Swap every compressible module for its compressible layer (outputs unchanged), then
    configure the matched modules' techniques."""
    names = [n for n, m in model.named_modules() if n and is_module_compressible(m, mpu)]
    for name in names:
        module_replacement(model, name, mpu=mpu)
    for module_name_lists, _, compression_technique in compression_technique_list:
        for mnl in module_name_lists:
            for module_name in mnl:
                module_replacement(model, module_name, compression_technique, mpu=mpu)
    return model


def fix_compression(model, module_name, compression_technique, mask=None, dim_reduction=False):
    """Make ``compression_technique`` permanent on ``module_name``; returns the kept mask a
    related module needs (row/head/channel pruning), else ``None``."""
    module = recursive_getattr(model, module_name)
    for k, v in compression_technique.items():
        enabled = v.get("enabled", False)
        if k == WEIGHT_QUANTIZATION and enabled:
            return module.fix_weight_quantization()
        if k == SPARSE_PRUNING and enabled:
            return module.fix_sparse_pruning_helper()
        if k == ROW_PRUNING and (enabled or mask is not None):
            return module.fix_row_col_pruning_helper(mask, dim_reduction=dim_reduction)
        if k == HEAD_PRUNING and (enabled or mask is not None):
            return module.fix_head_pruning_helper(mask, v.get("num_heads"), dim_reduction=dim_reduction)
        if k == CHANNEL_PRUNING and (enabled or mask is not None):
            return module.fix_channel_pruning_helper(mask, dim_reduction=dim_reduction)
    return None


def convert_conv1d_to_linear(model, convert_type):
    """Replace every ``convert_type`` module (Hugging Face's GPT-2 ``Conv1D``, weight
    ``(in, out)``) by an equivalent ``nn.Linear`` (weight ``(out, in)``)."""
    c_model = model.module if hasattr(model, "module") else model
    for name, module in list(c_model.named_modules()):
        if isinstance(module, convert_type):
            w = module.weight.data
            new = nn.Linear(w.size(0), w.size(1), bias=module.bias is not None, device=w.device, dtype=w.dtype)
            new.weight.data = w.t().contiguous()
            if module.bias is not None:
                new.bias.data = module.bias.data.view(-1)
            recursive_setattr(c_model, name, new)
    return model


def compressed_modules(model) -> List[Tuple[str, nn.Module]]:
    kinds = (LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def excluded(name: str, patterns: Iterable[str]) -> bool:
    return any(pattern_matches(p, name) for p in patterns)

