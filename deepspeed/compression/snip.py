"""``snip_momentum`` sparse pruning: structured (block) pruning driven by SNIP scores.

A weight's importance is ``|w * dL/dw|`` (SNIP), accumulated over backward passes as a
momentum average (``score = 0.9 * score + |w * grad|``) in the layer's ``snip_scores``
buffer. From ``schedule_offset`` to ``schedule_offset_end``, every
``schedule_offset_stride`` steps, each pruned layer's mask is recomputed from its scores:

* ``NxM`` block patterns (``4x1``: 4 output rows by 1 input column): blocks are scored by
  the sum of their scores and the best ``1 - sparsity`` of them kept, the sparsity rising
  from 0 to ``1 - dense_ratio`` along a cubic schedule (reached at ``schedule_offset_end``);
* ``N:M`` patterns (``2:4``): in every M consecutive input weights of a row the N
  lowest-scored are pruned; the pattern fixes the density, ``dense_ratio`` is not used.

After ``schedule_offset_end`` the mask is frozen. Under data parallelism the scores are
averaged over the data-parallel group before each mask update, so every rank prunes the
same weights. DeepSpeed delegates this method to Intel Neural Compressor; this is a
PyTorch implementation of the same recipe (scores, patterns, gradual schedule).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .utils import block_mask, check_pattern_fits, cubic_sparsity

MOMENTUM = 0.9


class SnipMomentumPruner:

    def __init__(self, modules: List[torch.nn.Module], names: List[str], dense_ratio: float, block_pattern: str,
                 start: int, end: int, stride: int, group=None):
        self.modules, self.names = list(modules), list(names)
        self.dense_ratio, self.block_pattern = dense_ratio, block_pattern
        self.start, self.end, self.stride = start, end, max(1, stride)
        self.group = group
        self.accumulating = False
        self._handles = []
        for m, n in zip(self.modules, self.names):
            check_pattern_fits(block_pattern, m.weight.shape, n)
            self._handles.append(m.weight.register_hook(self._score_hook(m)))

    @staticmethod
    def _accumulate(module, grad):
        with torch.no_grad():
            s = module.snip_scores
            s.mul_(MOMENTUM).add_((module.weight.detach() * grad.detach()).abs().to(s.dtype))

    def _score_hook(self, module):
        def hook(grad):
            if self.accumulating and getattr(module, "snip_scores", None) is not None:
                self._accumulate(module, grad)
            return grad
        return hook

    def sparsity(self, step: int) -> float:
        return cubic_sparsity(1.0 - self.dense_ratio, self.start, self.end, step)

    def is_update_step(self, step: int) -> bool:
        return self.start <= step <= self.end and (step - self.start) % self.stride == 0

    def update(self, step: int) -> None:
        """Called with the number of applied optimizer steps: scores accumulate until
        ``schedule_offset_end`` (warm-up included, so the first update has scores), masks
        move on update steps."""
        self.accumulating = step < self.end
        if not self.is_update_step(step):
            return
        keep = 1.0 - self.sparsity(step)
        for m in self.modules:
            if getattr(m, "snip_scores", None) is None:
                continue
            scores = self._synced(m.snip_scores)
            if not torch.any(scores):
                continue  # no gradient seen yet (offset 0): the layer stays dense until scores exist
            m.sparse_pruning_mask.copy_(block_mask(scores, self.block_pattern, keep).to(m.sparse_pruning_mask.dtype))

    def _synced(self, scores: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            scores = scores.clone()
            dist.all_reduce(scores, group=self.group)
            scores /= dist.get_world_size(self.group)
        return scores

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def find_pruner(model) -> Optional[SnipMomentumPruner]:
    return getattr(model, "_ds_snip_pruner", None)
