"""Where every element of a parameter group lives in the flat buffers.

Why buckets define the layout: gradients are reduced bucket by bucket while backward
runs, and a reduce-scatter needs its input to be ``N`` equal contiguous chunks, one
per rank. So each bucket's region of the flat buffer *is* such an input: the
bucket's parameters, concatenated in backward order and zero-padded to a multiple of
``N``, split into ``N`` chunks of ``chunk`` elements. Rank ``r`` owns chunk ``r`` of
every bucket; its partition (master weights, optimizer state, stage-2 gradients) is
those chunks concatenated, one contiguous buffer of ``1/N`` of the group. With that
layout

* the 16-bit parameters (views into the flat parameter buffer) are refreshed by one
  in-place ``all_gather_into_tensor`` per bucket, straight into the module's storage;
* stage 1 reduce-scatters each bucket region of the flat gradient buffer in place;
* stage 2 reduce-scatters a bucket's staging buffer into the partition;
* stage 0 (``N == 1``) degenerates to one unpadded buffer and one all-reduce per bucket.

Padding is at most ``N - 1`` elements per bucket and is never checkpointed: the
checkpoint stores per-parameter fragments (:meth:`GroupLayout.fragments`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch


@dataclass(eq=False)
class Slot:
    """One parameter inside its bucket."""
    param: torch.nn.Parameter
    name: str
    group: int
    numel: int
    shape: torch.Size
    bucket: "Bucket" = None
    bucket_offset: int = 0     # element offset inside the bucket region
    flat_offset: int = 0       # element offset inside the group's flat buffer


@dataclass(eq=False)
class Bucket:
    """A run of parameters reduced together; its region is ``n_parts * chunk`` elements."""
    group: int
    index: int                 # position within the group
    slots: List[Slot] = field(default_factory=list)
    numel: int = 0             # real elements (no padding)
    chunk: int = 0             # elements each rank owns
    flat_start: int = 0        # start of the region in the group's flat buffer
    part_start: int = 0        # start of this bucket's chunk in a rank's partition
    order: int = 0             # launch order across all groups (same on every rank)

    def region_numel(self, n_parts: int) -> int:
        return self.chunk * n_parts

    def chunk_range(self, rank: int):
        """Flat-buffer range of ``rank``'s chunk."""
        lo = self.flat_start + rank * self.chunk
        return lo, lo + self.chunk


@dataclass
class Fragment:
    """The part of one parameter that one rank owns."""
    slot: Slot
    param_start: int           # element offset inside the flattened parameter
    numel: int
    part_offset: int           # element offset inside the rank's partition


class GroupLayout:
    """Bucketed flat layout of one parameter group split across ``n_parts`` ranks."""

    def __init__(self, group_index: int, params: List[torch.nn.Parameter], names: List[str],
                 n_parts: int, bucket_size: int):
        if n_parts < 1:
            raise ValueError(f"n_parts must be >= 1, got {n_parts}")
        self.group = group_index
        self.n_parts = n_parts
        self.slots = [Slot(p, n, group_index, p.numel(), p.shape) for p, n in zip(params, names) if p.numel()]
        self.buckets: List[Bucket] = []
        cur: List[Slot] = []
        cur_n = 0
        for s in reversed(self.slots):  # backward produces gradients roughly in reverse order
            cur.append(s)
            cur_n += s.numel
            if cur_n >= bucket_size:
                self._close(cur, cur_n)
                cur, cur_n = [], 0
        if cur:
            self._close(cur, cur_n)
        self.numel = sum(b.region_numel(n_parts) for b in self.buckets)    # padded flat size
        self.part_numel = sum(b.chunk for b in self.buckets)               # one rank's partition
        self.real_numel = sum(s.numel for s in self.slots)

    def _close(self, slots: List[Slot], numel: int) -> None:
        flat_start = self.buckets[-1].flat_start + self.buckets[-1].region_numel(self.n_parts) if self.buckets else 0
        part_start = self.buckets[-1].part_start + self.buckets[-1].chunk if self.buckets else 0
        b = Bucket(group=self.group, index=len(self.buckets), numel=numel,
                   chunk=-(-numel // self.n_parts), flat_start=flat_start, part_start=part_start)
        off = 0
        for s in slots:
            s.bucket, s.bucket_offset, s.flat_offset = b, off, flat_start + off
            off += s.numel
        b.slots = list(slots)
        self.buckets.append(b)

    def fragments(self, rank: int) -> List[Fragment]:
        """What ``rank`` owns, parameter by parameter (padding excluded)."""
        out = []
        for b in self.buckets:
            own_lo, own_hi = rank * b.chunk, (rank + 1) * b.chunk
            for s in b.slots:
                lo, hi = max(s.bucket_offset, own_lo), min(s.bucket_offset + s.numel, own_hi)
                if lo < hi:
                    out.append(Fragment(s, lo - s.bucket_offset, hi - lo, b.part_start + lo - own_lo))
        return out


def order_buckets(layouts: List[GroupLayout], module_index: Dict[int, int]) -> List[Bucket]:
    """All buckets in launch order: the bucket holding the latest-registered parameter first
    (backward reaches it first). Deterministic, so every rank launches the same sequence."""
    buckets = [b for lay in layouts for b in lay.buckets]
    buckets.sort(key=lambda b: (-max(module_index.get(id(s.param), 0) for s in b.slots), b.group, b.index))
    for i, b in enumerate(buckets):
        b.order = i
    return buckets
