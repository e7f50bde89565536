"""``DistributedAttention``: DeepSpeed-Ulysses attention over a sequence-parallel group.

Each of the ``P`` ranks of the group holds ``S/P`` consecutive tokens (rank order) of every
sequence. Before the local attention, one all-to-all per q/k/v scatters the head dimension
and gathers the sequence dimension, so each rank holds the *whole* sequence for ``H/P`` heads;
attention is independent per head, so the local attention computes exactly what full
attention computes for those heads. A second all-to-all after it scatters the sequence and
gathers the heads back. Both all-to-alls are differentiable: the backward of an all-to-all is
the all-to-all with scatter and gather exchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


# DeepSpeed takes a fused rotary kernel from the optional ``torchembed`` package (Triton, on an
# accelerator); here the rotary embedding is always the PyTorch expression below.
_torchembed_available = False


def _rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the two halves of the last dimension (the rotary "i * x")."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding: ``t * cos + rotate_half(t) * sin`` over the first ``rot_dim =
    freqs_cos.shape[-1]`` features of ``t`` (``[seq, ..., dim]``; the freqs broadcast against it); the
    remaining ``dim - rot_dim`` features pass through unchanged."""
    rot_dim = freqs_cos.shape[-1]
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(f"apply_rotary_pos_emb: the rotary dimension (freqs' last dim, {rot_dim}) must be even "
                         f"and at most the tensor's last dim ({t.shape[-1]})")
    head, rest = t[..., :rot_dim], t[..., rot_dim:]
    out = head * freqs_cos + _rotate_half(head) * freqs_sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def single_all_to_all(input: Tensor, scatter_idx: int, gather_idx: int, group) -> Tensor:
    """Split ``input`` into ``P`` equal chunks along ``scatter_idx``, send chunk ``j`` to rank
    ``j``, and concatenate what arrives along ``gather_idx`` in rank order."""
    ws = _group_size(group)
    if ws == 1:
        return input
    nd = input.dim()
    s, g = scatter_idx % nd, gather_idx % nd
    if s == g:
        raise ValueError(f"all-to-all: scatter_idx and gather_idx must be different dimensions, both are {s}.")
    n = input.shape[s]
    if n % ws:
        raise ValueError(f"all-to-all: dimension {s} (size {n}) must be divisible by the sequence-parallel world "
                         f"size {ws}.")
    shape = list(input.shape)
    split = shape[:s] + [ws, n // ws] + shape[s + 1:]
    chunks = input.reshape(split).movedim(s, 0).contiguous()     # [ws, ... n/ws at s ...]
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)              # out[j]: rank j's chunk for me
    out = out.movedim(0, g)                                       # rank axis just before the gather dim
    merged = list(out.shape)
    merged[g:g + 2] = [merged[g] * merged[g + 1]]
    return out.reshape(merged)


class _SeqAllToAll(torch.autograd.Function):
    """Differentiable :func:`single_all_to_all` (DeepSpeed's name)."""

    @staticmethod
    def forward(ctx: Any, group, input: Tensor, scatter_idx: int, gather_idx: int) -> Tensor:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return single_all_to_all(input, scatter_idx, gather_idx, group)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        return (None, _SeqAllToAll.apply(ctx.group, grad_output.contiguous(), ctx.gather_idx, ctx.scatter_idx),
                None, None)


class DistributedAttention(torch.nn.Module):
    """Ulysses attention: ``local_attention`` runs on the full sequence for ``H/P`` heads.

    Arguments:
        local_attention: a module or function ``(q, k, v, *args, **kwargs) -> context`` in the
            layout of its inputs (for example ``[s, b, h, d]``).
        sequence_process_group: the sequence-parallel group
            (``deepspeed.utils.groups._get_sequence_parallel_group()``).
        scatter_idx: the head dimension of q/k/v (2 for ``[s, b, h, d]`` and ``[b, s, h, d]``).
        gather_idx: the sequence dimension (0 for ``[s, b, h, d]``; 1 for ``[b, s, h, d]``).

    ``forward(query, key, value, batch_dim_idx=None, rotary_pos_emb=None, *args, **kwargs)``:
    with ``batch_dim_idx`` given (DeepSpeed's newer call), the sequence dimension is taken
    from it (``[b, s, h, d]`` when 0, ``[s, b, h, d]`` when 1) and ``gather_idx`` only
    applies when it is ``None``. The head counts of q and of k/v must be divisible by the
    group size: uneven heads are refused.
    """

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream  # accepted for DeepSpeed's signature; communication is not overlapped
        self.sp_overlap_comm = False

    def _check_heads(self, name: str, t: Tensor, seq_dim: int) -> None:
        ws = _group_size(self.spg)
        heads = t.shape[self.scatter_idx]
        if heads % ws:
            raise ValueError(f"DistributedAttention: {name} has {heads} heads (dimension scatter_idx="
                             f"{self.scatter_idx}), which the sequence-parallel world size {ws} does not divide. "
                             f"Uneven heads are not supported: use a sequence_parallel_size that divides the number "
                             f"of heads (and of key/value heads).")
        if seq_dim == self.scatter_idx % t.dim():
            raise ValueError(f"DistributedAttention: the sequence dimension ({seq_dim}) cannot be the head "
                             f"dimension scatter_idx={self.scatter_idx}.")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx=None, rotary_pos_emb=None,
                *args: Any, **kwargs: Any) -> Tensor:
        if rotary_pos_emb is not None:
            raise NotImplementedError("DistributedAttention(rotary_pos_emb=...) is not supported: apply rotary "
                                      "embeddings with each token's global position before DistributedAttention, "
                                      "or inside local_attention.")
        if batch_dim_idx is None:
            seq_dim = self.gather_idx
        elif batch_dim_idx in (0, 1):
            seq_dim = 1 - batch_dim_idx
        else:
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                             f"got {batch_dim_idx!r}.")
        for name, t in (("query", query), ("key", key), ("value", value)):
            self._check_heads(name, t, seq_dim % t.dim())
        q = _SeqAllToAll.apply(self.spg, query, self.scatter_idx, seq_dim)
        k = _SeqAllToAll.apply(self.spg, key, self.scatter_idx, seq_dim)
        v = _SeqAllToAll.apply(self.spg, value, self.scatter_idx, seq_dim)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, seq_dim, self.scatter_idx)
