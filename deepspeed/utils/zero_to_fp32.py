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
:func:`main`: ``python zero_to_fp32.py <checkpoint_dir> <output_file> [-t TAG]``.
``checkpoint_dir`` is either the save directory (with a ``latest`` file, or pass a
tag) or one tag's directory itself.
"""
from __future__ import annotations

import argparse
import os
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


def get_optim_files(checkpoint_dir) -> list:
    """The ``*_optim_states.pt`` files of one checkpoint tag directory, in data-parallel
    rank order (DeepSpeed's helper name); raises when there are none."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    files = list_rank_files(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    if not files:
        raise FileNotFoundError(f"can't find '*_optim_states.pt' files in directory '{checkpoint_dir}'")
    return files


def get_model_state_files(checkpoint_dir) -> list:
    """The ``*_model_states.pt`` files of one checkpoint tag directory (``mp_rank_XX_...``
    at stages 0-2, ``zero_pp_rank_R_mp_rank_XX_...`` at stage 3), sorted."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    files = sorted(os.path.join(checkpoint_dir, n) for n in os.listdir(checkpoint_dir)
                   if n.endswith("_model_states.pt")) if os.path.isdir(checkpoint_dir) else []
    if not files:
        raise FileNotFoundError(f"can't find '*_model_states.pt' files in directory '{checkpoint_dir}'")
    return files


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
        for name, t in (module.get("module") or {}).items():   # None in pipeline checkpoints (layer files)
            if idx.has(name):
                entries.append((name, "fragments"))
            elif exclude_frozen_parameters and name in frozen:
                continue
            elif torch.is_tensor(t):
                entries.append((name, t.float() if t.is_floating_point() else t))
    listed = {n for n, _ in entries}
    entries += [(n, "fragments") for n in idx.names if n not in listed]
    return idx, entries


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False) -> "OrderedDict":
    """The full fp32 state dict of a checkpoint (parameters from the fp32 masters; buffers
    and frozen parameters from the module file, floating ones as fp32)."""
    idx, entries = _plan(_resolve(checkpoint_dir, tag), exclude_frozen_parameters)
    sd = OrderedDict()
    for name, src in entries:
        sd[name] = idx.full(name, "fp32").clone() if isinstance(src, str) else src.clone()
    return sd


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_file: str, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = False, max_shard_size=None) -> str:
    """Write the consolidated fp32 state dict with ``torch.save``; returns the file written.

    ``output_file`` may be a directory (newer DeepSpeed's ``output_dir``): the file is then
    ``pytorch_model.bin`` inside it. Output is one unsharded file (``max_shard_size`` is
    accepted and ignored)."""
    if safe_serialization:
        raise ValueError("safe_serialization=True needs the 'safetensors' package, which this deepspeed does "
                         "not use; call with safe_serialization=False (torch.save format).")
    output_file = os.fspath(output_file)
    if os.path.isdir(output_file) or output_file.endswith(os.sep):
        os.makedirs(output_file, exist_ok=True)
        output_file = os.path.join(output_file, "pytorch_model.bin")
    idx, entries = _plan(_resolve(checkpoint_dir, tag), exclude_frozen_parameters)
    total = sum(idx.numel(n) for n, src in entries if isinstance(src, str))
    tmp = output_file + ".fp32-buffer.tmp"
    part = output_file + ".part"
    try:
        # One file-backed fp32 buffer receives every assembled parameter: pages go to the
        # page cache (reclaimable), not to this process's anonymous memory; its blocks are
        # allocated up front, so a full disk is an OSError here, not a SIGBUS mid-copy.
        buf = map_file(tmp, total, torch.float32, create=True)
        sd, off = OrderedDict(), 0
        for name, src in entries:
            if isinstance(src, str):
                n = idx.numel(name)
                view = buf.narrow(0, off, n)
                idx.read(name, "fp32", 0, n, out=view)
                sd[name] = view.view(idx.shape(name))
                off += n
            else:
                sd[name] = src
        torch.save(sd, part)
        os.replace(part, output_file)
    finally:
        for f in (tmp, part):
            if os.path.exists(f):
                os.remove(f)
    return output_file


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: Optional[str] = None):
    """Load the consolidated fp32 weights into ``model`` (moved to CPU, made fp32); returns it."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu().float()
    result = model.load_state_dict(sd, strict=False)
    if result.missing_keys:
        raise CheckpointError(f"The checkpoint in '{checkpoint_dir}' has no weights for {result.missing_keys}.")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Consolidate a deepspeed ZeRO checkpoint into one fp32 state dict.")
    ap.add_argument("checkpoint_dir", help="the save directory (with 'latest'), or one checkpoint tag directory")
    ap.add_argument("output_file", help="where to write the fp32 state dict (torch.save format)")
    ap.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    ap.add_argument("--exclude_frozen_parameters", action="store_true")
    ap.add_argument("--no_verify", action="store_true",
                    help="skip checking the files against the checkpoint's manifest (checksums)")
    args = ap.parse_args(argv)
    if args.no_verify:
        from ..runtime.checkpoint.manifest import set_checkpoint_verification
        set_checkpoint_verification(False)
    out = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, tag=args.tag,
                                                     exclude_frozen_parameters=args.exclude_frozen_parameters)
    print(f"Saved fp32 state dict to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
