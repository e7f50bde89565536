"""Cross-entropy of sequence-sharded logits (DeepSpeed's ``vocab_sequence_parallel_cross_entropy``).

Each rank of the sequence-parallel group holds logits ``[S/P, B, V]`` and targets ``[S/P, B]``
of its own tokens. The per-token losses are all-gathered into ``[S, B]`` (the same on every
rank of the group, in rank order), so any reduction of them is the full-sequence loss. The
backward keeps only this rank's slice of the incoming gradient: each rank back-propagates its
own tokens' share, and the engine sums gradients over the sequence ranks. Targets equal to
``ignore_index`` (-100) have zero loss and zero gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabSequenceParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, sp_group, ignore_index=-100):
        if logits.dim() != 3 or target.shape != logits.shape[:2]:
            raise ValueError(f"vocab_sequence_parallel_cross_entropy: logits must be [S/P, B, V] and target [S/P, B]; "
                             f"got logits {tuple(logits.shape)} and target {tuple(target.shape)}.")
        logp = torch.log_softmax(logits.float(), dim=-1)
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target))
        loss = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid
        ws = dist.get_world_size(sp_group) if dist.is_initialized() else 1
        rank = dist.get_rank(sp_group) if dist.is_initialized() else 0
        if ws > 1:
            full = torch.empty((loss.shape[0] * ws,) + tuple(loss.shape[1:]), dtype=loss.dtype, device=loss.device)
            dist.all_gather_into_tensor(full, loss.contiguous(), group=sp_group)
        else:
            full = loss
        ctx.save_for_backward(logp, safe, valid)
        ctx.rank, ctx.local = rank, loss.shape[0]
        ctx.logits_dtype = logits.dtype
        return full.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        logp, safe, valid = ctx.saved_tensors
        g = grad_output[ctx.rank * ctx.local:(ctx.rank + 1) * ctx.local].float() * valid
        grad = logp.exp()
        grad.scatter_add_(-1, safe.unsqueeze(-1), -torch.ones_like(safe, dtype=grad.dtype).unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_sequence_parallel_cross_entropy(vocab_parallel_logits, target, sp_group, ignore_index: int = -100):
    """Per-token losses ``[S, B]`` of sequence-sharded logits ``[S/P, B, V]`` (see the module docstring)."""
    return _VocabSequenceParallelCrossEntropy.apply(vocab_parallel_logits, target, sp_group, ignore_index)
