"""Memory estimators for ZeRO stages 2 and 3 (``estimate_zero2_model_states_mem_needs_all_live``,
``estimate_zero3_model_states_mem_needs_all_live`` and their ``_all_cold`` forms).

They print, for a model (or a parameter count) and a cluster shape, the bytes of
model state - parameters, gradients, fp32 master weights and Adam's two moments -
each rank needs on the device and in host memory, for each offload option. The
figures follow what this implementation allocates (checked against a live engine in
``tests/runtime/zero3/test_estimators.py``), per data-parallel rank, with Ψ the
trainable parameter count and N the number of ranks:

stage 3, mixed precision (fp16/bf16 params and gradients, fp32 master + Adam):
    2Ψ/N params + 2Ψ/N grads + 12Ψ/N master and moments = 16Ψ/N;
stage 3, fp32 (the partition is the master): 4 + 4 + 8 = 16Ψ/N;
stage 2, mixed: 2Ψ (full 16-bit params) + 14Ψ/N; fp32: 4Ψ + 12Ψ/N.

Offloading moves the optimizer side (master, moments, gradient partitions) or the
parameter partitions to host memory. Stage 3 also needs the largest layer gathered
(its parameters and gradient) as transient device memory. ``additional_buffer_factor``
scales host figures for allocator slack and pinned staging, as DeepSpeed's do.
"""
from __future__ import annotations

from typing import List

import torch

_GB = 2 ** 30


def _bytes(precision: str):
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"estimators: 'precision' must be 'mixed' (fp16/bf16) or 'fp32', got {precision!r}.")
    return (2, 2) if precision == "mixed" else (4, 4)   # (param bytes, grad bytes)


def _model_counts(model: torch.nn.Module):
    total, largest, seen = 0, 0, set()
    for m in model.modules():
        layer = 0
        for p in m._parameters.values():
            if p is None:
                continue
            n = getattr(p, "ds_numel", p.numel())
            layer += n
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                total += n
        largest = max(largest, layer)
    return total, largest


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5, *, precision="mixed"):
    """(host bytes per node, device bytes per rank, largest-layer transient bytes) for stage 3.

    ``zero_init=False`` adds the full model each rank builds in host memory before
    partitioning (the model is constructed outside ``deepspeed.zero.Init``)."""
    pb, gb = _bytes(precision)
    ranks = num_gpus_per_node * num_nodes
    per = total_params / ranks
    largest = (pb + gb) * largest_layer_params           # one layer gathered + its full gradient
    # device: params(pb) grads(gb) master(4, fp32 shares the partition) moments(8)
    master = 4 if precision == "mixed" else 0
    if cpu_offload and cpu_offload_params:
        device = largest
        host_rank = per * (pb + gb + 8 + (4 if precision == "mixed" else 0))
    elif cpu_offload:
        device = largest + per * pb
        host_rank = per * (gb + 4 + 8)
    elif cpu_offload_params:
        device = largest + per * (gb + 4 + 8)
        host_rank = per * pb
    else:
        device = largest + per * (pb + gb + master + 8)
        host_rank = 0
    host = host_rank * num_gpus_per_node
    if not zero_init:
        host += total_params * 4 * num_gpus_per_node
    return int(host * additional_buffer_factor), int(device), int(largest)


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5, *, precision="mixed"):
    """(host bytes per node, device bytes per rank) for stage 2 (and, for the optimizer side, stage 1)."""
    pb, gb = _bytes(precision)
    ranks = num_gpus_per_node * num_nodes
    per = total_params / ranks
    if cpu_offload:
        device = total_params * pb
        host = per * (4 + 8 + 4) * num_gpus_per_node      # fp32 master, moments, fp32 gradient partition
    else:
        device = total_params * pb + per * (gb + (4 if precision == "mixed" else 0) + 8)
        host = 0
    return int(host * additional_buffer_factor), int(device)


def _fmt(b):
    return f"{b / _GB:8.2f}GB"


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5, *,
                                                   precision="mixed") -> List[dict]:
    rows = []
    for off_p, off_o in ((True, True), (False, True), (False, False)):
        for zi in (True, False):
            host, dev, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload=off_o,
                cpu_offload_params=off_p, zero_init=zi, additional_buffer_factor=additional_buffer_factor,
                precision=precision)
            rows.append({"offload_param": "cpu" if off_p else "none",
                         "offload_optimizer": "cpu" if off_o else "none", "zero_init": zi,
                         "host_bytes_per_node": host, "device_bytes_per_rank": dev})
    print(f"Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} "
          f"device{'s' if num_gpus_per_node > 1 else ''} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params, {int(largest_layer_params / 1e6)}M largest "
          f"layer params ({precision} precision).\n"
          f"  per CPU  |  per GPU |   Options")
    for r in rows:
        print(f"  {_fmt(r['host_bytes_per_node'])} | {_fmt(r['device_bytes_per_rank'])} | "
              f"offload_param={r['offload_param']}, offload_optimizer={r['offload_optimizer']}, "
              f"zero_init={int(r['zero_init'])}")
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, *, precision="mixed") -> List[dict]:
    """Print (and return) stage-3 memory needs for ``model`` (partitioned or not)."""
    total, largest = _model_counts(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor, precision=precision)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, *, precision="mixed") -> List[dict]:
    rows = []
    for off in (True, False):
        host, dev = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, off,
                                                          additional_buffer_factor, precision=precision)
        rows.append({"offload_optimizer": "cpu" if off else "none", "host_bytes_per_node": host,
                     "device_bytes_per_rank": dev})
    print(f"Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} "
          f"device{'s' if num_gpus_per_node > 1 else ''} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params ({precision} precision).\n"
          f"  per CPU  |  per GPU |   Options")
    for r in rows:
        print(f"  {_fmt(r['host_bytes_per_node'])} | {_fmt(r['device_bytes_per_rank'])} | "
              f"offload_optimizer={r['offload_optimizer']}")
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, *, precision="mixed") -> List[dict]:
    """Print (and return) stage-2 memory needs for ``model``."""
    total, _ = _model_counts(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor, precision=precision)
