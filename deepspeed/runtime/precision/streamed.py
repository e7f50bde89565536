"""Pieces of the *streamed* optimizer step shared by the flat strategies
(:mod:`.flat_master`, stages 0-2) and ZeRO stage 3 (:mod:`..zero.stage3_master`).

With fp32 master weights in host memory and 16-bit gradients, a whole fp32 copy of the
gradients would be written, read for the norm, scaled and read again by the update, and
on the host each fresh multi-MiB buffer is page-faulted in every step. The streamed step
instead casts the gradients one cache-sized slice at a time into a small staging buffer:
once for the norm (:func:`sliced_norms`), once more for the update
(``FusedAdam.step_streamed``). On CUDA the whole-copy path stays: one kernel per op beats
thousands of small launches, and the caching allocator has no page faults.
"""
from __future__ import annotations

from typing import Callable, List

import torch

STREAM_CHUNK = 1 << 18  # elements per slice: a 1 MiB fp32 staging buffer, about one core's L2


def staging_buffer(max_numel: int, chunk: int = STREAM_CHUNK, device="cpu") -> torch.Tensor:
    """The fp32 staging buffer for slices of at most ``min(chunk, max_numel)`` elements."""
    return torch.empty(max(1, min(chunk, max_numel)), dtype=torch.float32, device=device)


def sliced_norms(numel: int, fill: Callable[[int, int, torch.Tensor], None],
                 staging: torch.Tensor) -> List[torch.Tensor]:
    """L2 norms of the slices of a gradient of ``numel`` elements; ``fill(lo, hi, out)``
    writes elements ``[lo, hi)`` of it (in fp32) into ``out``, a prefix of ``staging``."""
    c = staging.numel()
    norms = []
    for lo in range(0, numel, c):
        hi = min(numel, lo + c)
        out = staging.narrow(0, 0, hi - lo)
        fill(lo, hi, out)
        norms.append(torch.linalg.vector_norm(out))
    return norms


def sum_of_squares(norms: List[torch.Tensor]) -> torch.Tensor:
    """Sum of the squared norms, in float64 (a float64 zero for none)."""
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(norms).double().pow(2).sum()
