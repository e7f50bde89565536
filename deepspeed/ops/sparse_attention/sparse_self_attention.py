"""``SparseSelfAttention``: DeepSpeed's block-sparse self-attention module.

It builds the layout once for ``max_seq_length`` (and, under ``torch.distributed``,
broadcasts it from rank 0 so random blocks agree), slices it for shorter inputs,
and runs the block-gather kernel of ``block_sparse.py``. Unlike DeepSpeed's Triton
version it is not limited to fp16 on a GPU: fp32, bf16 and fp16 run on CPU and GPU.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .block_sparse import BlockSparsePlan, block_sparse_attention
from .sparsity_config import SparsityConfig

_MODES = ("add", "mul")


def _as_additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """'add': used as is; 'mul': 0 means masked out (-inf), anything else kept."""
    if mode == "add":
        return mask.float()
    return torch.where(mask == 0, float("-inf"), 0.0).float()


class SparseSelfAttention(nn.Module):
    """Block-sparse ``softmax(q k^T / sqrt(d) + masks) v`` for q, k, v of shape [B, H, L, D].

    ``key_padding_mask_mode`` / ``attn_mask_mode``: 'add' (the mask is added to the
    scores) or 'mul' (0 masks the position out).
    """

    def __init__(self, sparsity_config: Optional[SparsityConfig] = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        if sparsity_config is None:
            sparsity_config = SparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length), persistent=False)
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self._plans: Dict[Tuple[int, int], BlockSparsePlan] = {}

    def get_layout(self, L: int) -> torch.Tensor:
        """The layout for sequence length ``L`` (a slice of the master layout)."""
        if self._need_layout_synchronization and torch.distributed.is_available() \
                and torch.distributed.is_initialized():
            from ... import comm as ds_comm
            layout = ds_comm.to_comm_device(self.master_layout)  # the module may still be on the host
            torch.distributed.broadcast(layout, src=0)
            if layout is not self.master_layout:
                self.master_layout.copy_(layout)
            self._plans.clear()
        self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"Sequence length {L} must be divisible by the block size {block} "
                             f"(pad it with SparseAttentionUtils.pad_to_block_size)")
        if L > self.max_seq_length:
            raise ValueError(f"Sequence length {L} exceeds max_seq_length={self.max_seq_length} given to "
                             f"SparseSelfAttention; build it with a larger max_seq_length")
        n = L // block
        return self.master_layout[..., :n, :n].cpu()

    def get_plan(self, H: int, L: int) -> BlockSparsePlan:
        if H != self.sparsity_config.num_heads:
            raise ValueError(f"query has {H} heads but the sparsity config was built for "
                             f"num_heads={self.sparsity_config.num_heads}")
        layout = self.get_layout(L)
        key = (H, L)
        if key not in self._plans:
            self._plans[key] = BlockSparsePlan(layout, self.sparsity_config.block)
        return self._plans[key]

    @staticmethod
    def transpose_key_for_scores(x: torch.Tensor, L: int) -> torch.Tensor:
        """Keys given as [B, H, D, L] are turned back into [B, H, L, D]."""
        return x.permute(0, 1, 3, 2) if x.size(2) != L else x

    @staticmethod
    def transpose_mask_for_sparse(qtype, x: torch.Tensor, is_key_padding_mask: bool = False) -> torch.Tensor:
        x = x.type(qtype)
        if is_key_padding_mask:
            while x.dim() > 2 and any(s == 1 for s in x.shape[1:]):
                x = x.squeeze(next(d for d in range(x.dim() - 1, 0, -1) if x.shape[d] == 1))
            return x
        return x.squeeze()

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        bsz, num_heads, tgt_len, head_dim = query.size()
        key = self.transpose_key_for_scores(key, tgt_len)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        kp = am = None
        if key_padding_mask is not None:
            kp = self.transpose_mask_for_sparse(torch.float32, key_padding_mask, is_key_padding_mask=True)
            if kp.dim() == 1:
                kp = kp.unsqueeze(0)
            if tuple(kp.shape) not in ((bsz, tgt_len), (1, tgt_len)):
                raise ValueError(f"key_padding_mask must squeeze to [batch, seq] = [{bsz}, {tgt_len}], got "
                                 f"{tuple(key_padding_mask.shape)}")
            kp = _as_additive(kp, self.key_padding_mask_mode).expand(bsz, tgt_len)
        if attn_mask is not None:
            am = self.transpose_mask_for_sparse(torch.float32, attn_mask)
            if tuple(am.shape) != (tgt_len, tgt_len):
                raise ValueError(f"attn_mask must squeeze to [seq, seq] = [{tgt_len}, {tgt_len}], got "
                                 f"{tuple(attn_mask.shape)}")
            am = _as_additive(am, self.attn_mask_mode)
        plan = self.get_plan(num_heads, tgt_len)
        return block_sparse_attention(query, key, value, plan, scale=float(head_dim) ** -0.5, rpe=rpe,
                                      key_padding_mask=kp, attn_mask=am)


def layout_to_element_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """The [H, L, L] boolean element mask equivalent to a block layout (for references and tests)."""
    ones = torch.ones(block, block, dtype=torch.bool)
    return torch.stack([torch.kron(layout[h] != 0, ones) for h in range(layout.shape[0])])
