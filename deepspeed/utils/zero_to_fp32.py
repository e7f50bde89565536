"""Consolidate a ZeRO checkpoint (any stage, any world size) into one fp32 state dict.

Why: ZeRO checkpoints keep the fp32 master weights split across one file per rank
(see :mod:`deepspeed.runtime.checkpoint.universal`). These functions put them back
together by parameter name, with no deepspeed engine and no process group:

* :func:`get_fp32_state_dict_from_zero_checkpoint` - a state dict in memory;
* :func:`convert_zero_checkpoint_to_fp32_state_dict` - written to a file. It streams:
  each parameter is assembled straight into a file-backed buffer from the
  memory-mapped rank files, so resident memory stays near one tensor, not the model;
* :func:`load_state_dict_from_zero_checkpoint` - loaded into a model.

Each checkpoint directory also holds a ``zero_to_fp32.py`` script that calls
:func:`main`: ``python zero_to_fp32.py <checkpoint_dir> <output_dir> [-t TAG] [--max_shard_size 5GB]
[--safe_serialization]``.
``checkpoint_dir`` is either the save directory (with a ``latest`` file, or pass a
tag) or one tag's directory itself.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
from collections import OrderedDict
from typing import Optional

import torch

from ..runtime.checkpoint.errors import CheckpointError
from ..runtime.checkpoint.io import load_file, read_latest_tag
from ..runtime.checkpoint.universal import FragmentIndex, list_rank_files
from ..runtime.swap_tensor.utils import map_file

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "get_optim_files", "get_model_state_files",
           "get_model_state_file", "main"]


def _natural_key(path: str):
    """Sort key that orders embedded numbers by value (``zero_2_`` before ``zero_12_``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _checkpoint_files(checkpoint_dir, suffix: str) -> list:
    checkpoint_dir = os.fspath(checkpoint_dir)
    files = sorted(glob.glob(os.path.join(glob.escape(checkpoint_dir), "*" + suffix)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find '*{suffix}' files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir) -> list:
    """Every ``*_optim_states.pt`` file of one checkpoint tag directory, in natural order of the
    numbers in their names (so data-parallel rank order for DeepSpeed's names), as DeepSpeed's
    helper globs them; raises FileNotFoundError when there are none."""
    return _checkpoint_files(checkpoint_dir, "_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list:
    """Every ``*_model_states.pt`` file of one checkpoint tag directory (``mp_rank_XX_...`` at
    stages 0-2, ``zero_pp_rank_R_mp_rank_XX_...`` at stage 3), in natural order."""
    return _checkpoint_files(checkpoint_dir, "_model_states.pt")


def get_model_state_file(checkpoint_dir, zero_stage: int = 0) -> str:
    """The model-states file holding the module weights (DeepSpeed's helper name)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        path = os.path.join(checkpoint_dir, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"can't find model states file at '{checkpoint_dir}'")


def _resolve(checkpoint_dir, tag: Optional[str]) -> str:
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Checkpoint directory '{checkpoint_dir}' does not exist.")
    if tag is not None:
        path = os.path.join(checkpoint_dir, str(tag))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"No checkpoint tag '{tag}' in '{checkpoint_dir}' (no directory '{path}').")
        return path
    latest = read_latest_tag(checkpoint_dir)   # an empty or unreadable 'latest' raises CheckpointError
    if latest is not None:
        return _resolve(checkpoint_dir, latest)
    if list_rank_files(checkpoint_dir):
        return checkpoint_dir  # a tag directory itself
    raise FileNotFoundError(
        f"'{checkpoint_dir}' has no 'latest' file and no ZeRO optimizer files; pass tag=... or the "
        f"directory of one checkpoint tag.")


def _module_states(path: str):
    try:
        name = get_model_state_file(path)
    except FileNotFoundError:
        return None
    return load_file(name, mmap=True)   # the package's one verified weights-only reader


class _Tied(str):
    """A plan entry naming the parameter this one is tied to (same tensor in the module file)."""


def _plan(path: str, exclude_frozen_parameters: bool):
    """(index, ordered [(name, "fragments" | tensor)]): trainable parameters come from the
    fp32 fragments; buffers and frozen parameters from the module file."""
    from ..runtime.pipe.checkpoint import pipeline_fragment_index
    idx = pipeline_fragment_index(path) or FragmentIndex(path, mp_rank=0)  # pipelines: one file set per stage
    from ..moe.checkpoint import index_with_experts
    idx = index_with_experts(path, idx)  # MoE: expert fragments live in their own files
    frozen = set()
    for st in idx.states:
        frozen.update(st.get("extra", {}).get("frozen_params", []))
    module = _module_states(path)
    entries = []
    if module is not None:
        # Tied parameters are one tensor in the output: DeepSpeed's "shared_params" ({name: the name
        # it is tied to}) when the file has it, else tensors sharing storage in the module state.
        shared = module.get("shared_params") if isinstance(module.get("shared_params"), dict) else {}
        first_of = {}   # storage identity -> first name
        for name, t in (module.get("module") or {}).items():   # None in pipeline checkpoints (layer files)
            if shared.get(name) is not None and shared[name] != name:
                entries.append((name, _Tied(shared[name])))
                continue
            if torch.is_tensor(t) and t.numel() > 0:
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                if key in first_of:
                    entries.append((name, _Tied(first_of[key])))
                    continue
                first_of.setdefault(key, name)
            if idx.has(name):
                entries.append((name, "fragments"))
            elif exclude_frozen_parameters and name in frozen:
                continue
            elif torch.is_tensor(t):
                entries.append((name, t.float() if t.is_floating_point() else t))
    listed = {n for n, _ in entries}
    entries += [(n, "fragments") for n in idx.names if n not in listed]
    present = {n for n, src in entries if not isinstance(src, _Tied)}
    return idx, [(n, src) for n, src in entries if not isinstance(src, _Tied) or src in present]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False) -> "OrderedDict":
    """The full fp32 state dict of a checkpoint (parameters from the fp32 masters; buffers
    and frozen parameters from the module file, floating ones as fp32)."""
    idx, entries = _plan(_resolve(checkpoint_dir, tag), exclude_frozen_parameters)
    sd = OrderedDict()
    for name, src in entries:
        if isinstance(src, _Tied):
            sd[name] = sd[src]
        else:
            sd[name] = idx.full(name, "fp32").clone() if isinstance(src, str) else src.clone()
    return sd


_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def _parse_size(max_shard_size) -> Optional[int]:
    """``"5GB"``/``"500MB"``/``"10KiB"``/an int of bytes -> bytes; None -> no sharding."""
    if max_shard_size is None:
        return None
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool) and max_shard_size > 0:
        return max_shard_size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*", str(max_shard_size).upper())
    if not m:
        raise ValueError(
            f"convert_zero_checkpoint_to_fp32_state_dict: max_shard_size={max_shard_size!r} is not a size; give bytes "
            "(int) or a string like '5GB' / '500MB', or None for one file. (Since DeepSpeed 0.16 the third positional "
            "argument is max_shard_size: pass the checkpoint tag as tag=...)")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def _shards(entries, nbytes, limit: Optional[int]):
    """Split the names, in order, into shards of at most ``limit`` bytes (a tensor larger than
    the limit gets a shard of its own); tensors that share storage count once."""
    if limit is None:
        return [[name for name, _ in entries]]
    shards, current, size = [], [], 0
    for name, _ in entries:
        n = nbytes(name)
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str = None, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False, *, output_file=None) -> str:
    """Write the consolidated fp32 state dict into ``output_dir`` (DeepSpeed's signature since 0.16).

    The files are Hugging Face's: ``pytorch_model.bin`` (``model.safetensors`` with
    ``safe_serialization=True``), or, when the weights exceed ``max_shard_size`` (``"5GB"``;
    None for one file), ``pytorch_model-00001-of-0000N.bin`` ... plus
    ``pytorch_model.bin.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``).
    Tied parameters are one tensor in the output. Returns the directory (or file) written.

    The pre-0.16 form is kept: ``output_file=`` or an ``output_dir`` that ends in a weights-file
    suffix (``.bin``, ``.pt``, ``.pth``, ``.safetensors``) and is not a directory writes that
    one file, unsharded."""
    if output_dir is None:
        output_dir = output_file
    if output_dir is None:
        raise TypeError("convert_zero_checkpoint_to_fp32_state_dict() needs output_dir (a directory to write to)")
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("safe_serialization=True needs the 'safetensors' package (pip install safetensors); "
                              "or call with safe_serialization=False (torch.save format).") from None
    limit = _parse_size(max_shard_size)
    output_dir = os.fspath(output_dir)
    single_file = output_file is not None or (output_dir.endswith(_WEIGHT_SUFFIXES) and not os.path.isdir(output_dir))
    idx, entries = _plan(_resolve(checkpoint_dir, tag), exclude_frozen_parameters)
    aliases = {n: str(src) for n, src in entries if isinstance(src, _Tied)}
    entries = [(n, src) for n, src in entries if n not in aliases]
    total = sum(idx.numel(n) for n, src in entries if isinstance(src, str))

    sources = dict(entries)

    def nbytes(name):
        src = sources[name]
        return idx.numel(name) * 4 if isinstance(src, str) else src.numel() * src.element_size()

    if single_file:
        parent = os.path.dirname(output_dir) or "."
        os.makedirs(parent, exist_ok=True)
        plan = [(output_dir, [n for n, _ in entries])]
        out, index_file = output_dir, None
    else:
        os.makedirs(output_dir, exist_ok=True)
        weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        shards = _shards(entries, nbytes, limit)
        if len(shards) == 1:
            plan, index_file = [(os.path.join(output_dir, weights), shards[0])], None
        else:
            stem, ext = os.path.splitext(weights)
            plan = [(os.path.join(output_dir, f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"), names)
                    for i, names in enumerate(shards)]
            index_file = os.path.join(output_dir, weights + ".index.json")
        out = output_dir
    buffer_file = os.path.join(os.path.dirname(plan[0][0]) or ".", f".{os.path.basename(plan[0][0])}.{os.getpid()}.fp32-buffer.tmp")
    written = []
    try:
        # One file-backed fp32 buffer receives every assembled parameter: pages go to the
        # page cache (reclaimable), not to this process's anonymous memory; its blocks are
        # allocated up front, so a full disk is an OSError here, not a SIGBUS mid-copy.
        buf = map_file(buffer_file, max(total, 1), torch.float32, create=True)
        off = 0
        tensors = OrderedDict()
        for name, src in entries:
            if isinstance(src, str):
                n = idx.numel(name)
                view = buf.narrow(0, off, n)
                idx.read(name, "fp32", 0, n, out=view)
                tensors[name] = view.view(idx.shape(name))
                off += n
            else:
                tensors[name] = sources[name]
        weight_map = {}
        for path, names in plan:
            shard = OrderedDict((n, tensors[n]) for n in names)
            for alias, target in aliases.items():   # a tied name travels with its tensor
                if target in shard:
                    shard[alias] = shard[target]
            # per-process temporary name: every rank may convert the same checkpoint at once (DeepSpeed's
            # own tests call it on each rank); each renames its complete file over the same final path
            part = f"{path}.{os.getpid()}.part"
            written.append(part)
            if safe_serialization and not single_file:
                # safetensors refuses shared storage: each tied name gets its own copy there
                save_file({k: v.contiguous().clone() if k in aliases else v.contiguous() for k, v in shard.items()},
                          part, metadata={"format": "pt"})
            else:
                torch.save(shard, part)
            os.replace(part, path)
            weight_map.update({n: os.path.basename(path) for n in shard})
        if index_file is not None:
            import json
            size = sum(nbytes(n) for n, _ in entries)
            index_part = f"{index_file}.{os.getpid()}.part"
            written.append(index_part)
            with open(index_part, "w", encoding="utf-8") as f:
                f.write(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map},
                                   indent=2, sort_keys=True) + "\n")
            os.replace(index_part, index_file)
    finally:
        for f in [buffer_file] + written:
            if os.path.exists(f):
                os.remove(f)
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: Optional[str] = None):
    """Load the consolidated fp32 weights into ``model`` (moved to CPU); returns it.

    As in DeepSpeed, the model keeps its dtype: ``load_state_dict`` copies the fp32 values into
    its parameters (an fp16 module stays fp16, its weights rounded from the fp32 masters)."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(sd, strict=False)
    if result.missing_keys:
        raise CheckpointError(f"The checkpoint in '{checkpoint_dir}' has no weights for {result.missing_keys}.")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Consolidate a deepspeed ZeRO checkpoint into one fp32 state dict.")
    ap.add_argument("checkpoint_dir", help="the save directory (with 'latest'), or one checkpoint tag directory")
    ap.add_argument("output_dir", help="directory for the fp32 weights (pytorch_model.bin, or shards and an index); "
                    "a path ending in .bin/.pt/.pth/.safetensors writes that one file")
    ap.add_argument("--max_shard_size", default="5GB", help="largest shard before splitting (default 5GB)")
    ap.add_argument("--safe_serialization", action="store_true", help="write safetensors files")
    ap.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    ap.add_argument("--exclude_frozen_parameters", action="store_true")
    ap.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = ap.parse_args(argv)
    out = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                     max_shard_size=args.max_shard_size,
                                                     safe_serialization=args.safe_serialization, tag=args.tag,
                                                     exclude_frozen_parameters=args.exclude_frozen_parameters)
    print(f"Saved fp32 state dict to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
