"""``init_compression`` and ``redundancy_clean``: the two calls of DeepSpeed's compression
workflow.

1. ``model = init_compression(model, ds_config, teacher_model=None, mpu=None)`` before
   ``deepspeed.initialize``: with ``layer_reduction`` on, the student's layers are first
   initialised from the named teacher layers; then every Linear / Conv2d / Embedding /
   BatchNorm2d is swapped in place for its compressible layer (same parameter objects)
   and each enabled technique is configured on the modules its groups match. New
   learnable scores (``topk`` methods) are parameters of the model, so build the optimizer
   (or call ``deepspeed.initialize``) after this call.
2. Train: the engine switches techniques on at their ``schedule_offset`` (see
   :mod:`.scheduler`).
3. ``model = redundancy_clean(model, ds_config, mpu=None)``: quantized weights are baked,
   pruned entries zeroed, and pruned rows / heads / channels physically removed from the
   module and its ``related_modules``: a smaller model with the masked model's outputs.
"""
from __future__ import annotations

from typing import List

import torch

from ..utils.logging import logger
from .config import _raw_config, get_compression_config, parse_compression_section
from .constants import (CHANNEL_PRUNING, DIFFERENT_GROUPS, DIFFERENT_GROUPS_MODULE_SCOPE,
                        DIFFERENT_GROUPS_PARAMETERS, DIFFERENT_GROUPS_RELATED_MODULE_SCOPE, SHARED_PARAMETERS,
                        SPARSE_PRUNING, TECHNIQUES)
from .helper import (RELATED_TYPES, TECHNIQUE_TYPES, compression_preparation, excluded, fix_compression,
                     get_module_name, pattern_matches, recursive_getattr)
from .snip import SnipMomentumPruner


def check_deepspeed_config(config):
    """The DeepSpeed config as a dict (from a dict, a JSON path or a DeepSpeedConfig)."""
    return _raw_config(config)


def _unwrap(model):
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


def _no_match(technique, group_name, model, patterns, types, what="modules"):
    candidates = [n for n, m in model.named_modules() if n and isinstance(m, types)][:8]
    shown = patterns[0] if len(patterns) == 1 else patterns
    return ValueError(f"compression_training.{technique}.different_groups.{group_name}.{what}: pattern "
                      f"{shown!r} matches no {'/'.join(t.__name__ for t in types)} module of the model (some "
                      f"that would: {candidates}). Patterns are regular expressions searched in module names; "
                      f"'*' matches all.")


def _match(technique, group_name, model, pattern, seen, mpu, types, what="modules"):
    """Modules of ``types`` matching ``pattern``. A pattern that matches no module name at all
    is an error (a typo); one that matches only modules the technique does not apply to (a
    custom layer, a container) is logged and skipped, as DeepSpeed skips it. A related
    pattern must match."""
    names, seen = get_module_name(group_name, model, pattern, seen, mpu=mpu, types=types)
    if names or pattern == "*":
        return names, seen
    if what != "modules" or not any(pattern_matches(pattern, n) for n, _ in model.named_modules() if n):
        raise _no_match(technique, group_name, model, [pattern], types, what)
    logger.warning(f"compression_training.{technique}.different_groups.{group_name}.{what}: pattern {pattern!r} "
                   f"matches only modules that are not {'/'.join(t.__name__ for t in types)}; skipped.")
    return names, seen


def get_compress_methods(model, compress_methods, mpu=None):
    """``[[module_name_lists, related_module_name_lists, {technique: params}], ...]``, one entry
    per configured group of each enabled technique (``snip_momentum`` is handled apart).

    ``module_name_lists[i]``: the modules matched by the group's i-th pattern;
    ``related_module_name_lists[i][j]``: those matched by the j-th related pattern of the
    i-th module pattern, paired one-to-one (in model order) with ``module_name_lists[i]``.
    """
    out = []
    for technique in TECHNIQUES:
        content = compress_methods.get(technique)
        if content is None:
            continue
        shared = content[SHARED_PARAMETERS]
        if not shared.get("enabled", False):
            continue
        if technique == SPARSE_PRUNING and shared.get("method") == "snip_momentum":
            continue
        seen = set()
        for group_name, group in content[DIFFERENT_GROUPS].items():
            patterns = group[DIFFERENT_GROUPS_MODULE_SCOPE]
            related = group.get(DIFFERENT_GROUPS_RELATED_MODULE_SCOPE)
            if related is not None and len(related) != len(patterns):
                raise ValueError(f"compression_training.{technique}.different_groups.{group_name}: related_modules "
                                 f"has {len(related)} entries but modules has {len(patterns)}; give one list of "
                                 f"related patterns per module pattern.")
            module_lists, related_lists = [], []
            for i, pattern in enumerate(patterns):
                names, seen = _match(technique, group_name, model, pattern, seen, mpu, TECHNIQUE_TYPES[technique])
                module_lists.append(names)
                if related is None:
                    continue
                if not names:  # nothing to prune for this pattern, so nothing related either
                    related_lists.append([[] for _ in related[i]])
                    continue
                if technique not in RELATED_TYPES:
                    raise ValueError(f"compression_training.{technique}: related_modules applies only to row, head "
                                     f"and channel pruning.")
                per = []
                for rp in related[i]:
                    rnames, _ = _match(technique, group_name, model, rp, set(), mpu, RELATED_TYPES[technique],
                                       "related_modules")
                    if len(rnames) != len(names):
                        raise ValueError(
                            f"compression_training.{technique}.different_groups.{group_name}.related_modules: "
                            f"pattern {rp!r} matches {len(rnames)} modules ({rnames[:4]}...) but module pattern "
                            f"{pattern!r} matches {len(names)} ({names[:4]}...); each pruned module needs exactly "
                            f"one related module per related pattern, paired in model order.")
                    per.append(rnames)
                related_lists.append(per)
            if any(module_lists):
                params = {**shared, **group[DIFFERENT_GROUPS_PARAMETERS]}  # the group's dense_ratio wins
                out.append([module_lists, related_lists, {technique: params}])
    return out


def _snip_targets(model, sp, mpu):
    shared = sp[SHARED_PARAMETERS]
    types = TECHNIQUE_TYPES[SPARSE_PRUNING]
    if sp[DIFFERENT_GROUPS]:
        names, seen = [], set()
        for group_name, group in sp[DIFFERENT_GROUPS].items():
            group_names = []
            for pattern in group[DIFFERENT_GROUPS_MODULE_SCOPE]:
                got, seen = _match(SPARSE_PRUNING, group_name, model, pattern, seen, mpu, types)
                group_names += got
            names += group_names
    else:
        names = [n for n, m in model.named_modules() if n and isinstance(m, types)]
    names = [n for n in names if not excluded(n, shared["excluded_modules"])]
    if not names:
        raise ValueError("compression_training.sparse_pruning (snip_momentum): no Linear/Conv2d module is left to "
                         "prune after 'excluded_modules'.")
    return names


def init_compression(model, deepspeed_config, teacher_model=None, mpu=None):
    """Prepare ``model`` for compression training as ``deepspeed_config``'s
    ``compression_training`` section says (see the module docstring); returns ``model``."""
    section = parse_compression_section(deepspeed_config)
    compress_methods = get_compression_config(deepspeed_config)
    c_model = _unwrap(model)

    if section.layer_reduction is not None and section.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError("compression_training.layer_reduction is enabled: pass the teacher model "
                             "(init_compression(model, config, teacher_model=teacher)) to initialise the student.")
        student_initialization(c_model, _unwrap(teacher_model), deepspeed_config)

    methods = get_compress_methods(c_model, compress_methods, mpu=mpu)
    compression_preparation(c_model, methods, mpu)

    # a batch norm related to a channel-pruned conv zeroes the pruned channels too
    for module_lists, related_lists, technique in methods:
        if CHANNEL_PRUNING not in technique:
            continue
        for names, per in zip(module_lists, related_lists):
            for rnames in per:
                for conv_name, rn in zip(names, rnames):
                    r = recursive_getattr(c_model, rn)
                    if hasattr(r, "follow_channel_mask"):
                        r.follow_channel_mask(recursive_getattr(c_model, conv_name))

    sp = compress_methods[SPARSE_PRUNING]
    shared = sp[SHARED_PARAMETERS]
    if shared["enabled"] and shared["method"] == "snip_momentum":
        names = _snip_targets(c_model, sp, mpu)
        modules = [recursive_getattr(c_model, n) for n in names]
        for m in modules:
            m.enable_sparse_pruning(shared["dense_ratio"], "snip_momentum", shared["block_pattern"])
        c_model._ds_snip_pruner = SnipMomentumPruner(
            modules, names, shared["dense_ratio"], shared["block_pattern"], shared["schedule_offset"],
            shared["schedule_offset_end"], shared["schedule_offset_stride"])

    if section.enabled and not methods and not getattr(c_model, "_ds_snip_pruner", None) and \
            section.enabling_keys() != ["layer_reduction.enabled"]:
        logger.warning("init_compression: compression_training is enabled but no group names any module "
                       "(add 'different_groups' with 'modules' patterns).")
    c_model._ds_compression_section = section
    return model


def redundancy_clean(model, deepspeed_config, mpu=None):
    """Make the compression permanent and remove what pruning made redundant; returns ``model``.

    Order: weight quantization (baked at the current bits), sparse pruning (zeros), row,
    head and channel pruning (rows / heads / channels removed from the module when it has
    ``related_modules``, whose matching inputs are removed too; zeroed otherwise).
    Activation quantization stays (it is part of the cleaned model's forward)."""
    compress_methods = get_compression_config(deepspeed_config)
    c_model = _unwrap(model)
    pruner = getattr(c_model, "_ds_snip_pruner", None)
    if pruner is not None:
        pruner.remove()
        for m in pruner.modules:
            if getattr(m, "sparse_pruning_method", None):
                m.fix_sparse_pruning_helper()
        c_model._ds_snip_pruner = None
    methods = get_compress_methods(c_model, compress_methods, mpu=mpu)
    for module_lists, related_lists, technique in methods:
        need_reduction = bool(related_lists)
        for i, names in enumerate(module_lists):
            masks = [fix_compression(c_model, n, technique, dim_reduction=need_reduction) for n in names]
            if not need_reduction:
                continue
            for rnames in related_lists[i]:
                for j, rn in enumerate(rnames):
                    fix_compression(c_model, rn, technique, mask=masks[j], dim_reduction=True)
    return model


def student_initialization(student_model, teacher_model, deepspeed_config):
    """Copy the teacher's layers ``teacher_layer`` (under ``module_name_prefix``) into the
    student's layers 0..k-1, and the modules ``other_module_name`` one to one."""
    lr = parse_compression_section(deepspeed_config).layer_reduction
    pairs: List = []
    if lr.module_name_prefix and lr.teacher_layer:
        pairs += [(f"{lr.module_name_prefix}.{s}", f"{lr.module_name_prefix}.{t}")
                  for s, t in enumerate(lr.teacher_layer)]
    elif lr.teacher_layer:
        raise ValueError("compression_training.layer_reduction.teacher_layer needs module_name_prefix "
                         "(e.g. 'bert.encoder.layer').")
    pairs += [(n, n) for n in lr.other_module_name]
    if lr.module_name_prefix:
        try:
            container = recursive_getattr(student_model, lr.module_name_prefix)
            if hasattr(container, "__len__") and len(container) != lr.keep_number_layer:
                raise ValueError(f"compression_training.layer_reduction.keep_number_layer is {lr.keep_number_layer} "
                                 f"but the student's '{lr.module_name_prefix}' has {len(container)} layers; build "
                                 f"the student with keep_number_layer layers.")
        except AttributeError:
            raise ValueError(f"compression_training.layer_reduction.module_name_prefix "
                             f"{lr.module_name_prefix!r} is not a module of the student model.") from None
    for s_name, t_name in pairs:
        try:
            s_mod = recursive_getattr(student_model, s_name)
        except AttributeError:
            raise ValueError(f"compression_training.layer_reduction: the student has no module '{s_name}'.") from None
        try:
            t_mod = recursive_getattr(teacher_model, t_name)
        except AttributeError:
            raise ValueError(f"compression_training.layer_reduction: the teacher has no module '{t_name}' "
                             f"(teacher_layer / other_module_name).") from None
        s_state, t_state = s_mod.state_dict(), t_mod.state_dict()
        if s_state.keys() != t_state.keys() or any(s_state[k].shape != t_state[k].shape for k in s_state):
            raise ValueError(f"compression_training.layer_reduction: student module '{s_name}' and teacher module "
                             f"'{t_name}' differ in structure or shapes; they must be the same kind of layer.")
        with torch.no_grad():
            for k, v in t_state.items():
                s_state[k].copy_(v)
    return student_model
