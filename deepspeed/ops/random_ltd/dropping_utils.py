"""Token sampling, gather and scatter for random layerwise token dropping, in PyTorch ops.

DeepSpeed ships CUDA kernels for these (``token_sort_``, ``token_gather``,
``token_scatter_``); here ``torch.multinomial``/``sort``/``gather``/``scatter`` do the same
on any device, with the same shapes:

* ``sampled_indices``: ``[layers, batch, reserved_length]`` int32, ascending per row;
* decoder (``gpt_sample_tokens``) mask: ``attn_mask[:, :, :reserved, :reserved]``;
* encoder (``bert_sample_tokens``) mask: per layer ``[batch, 1, reserved, reserved]``, the
  rows and columns of the kept tokens.
"""
from __future__ import annotations

import torch


def _sample(reserved_length: int, seq_length: int, batch_size: int, layers: int, device) -> torch.Tensor:
    if not 0 < reserved_length <= seq_length:
        raise ValueError(f"random-LTD: reserved_length {reserved_length} must be in 1..{seq_length} (the sequence "
                         f"length).")
    prob = torch.ones((layers * batch_size, seq_length), device=device)
    idx = torch.multinomial(prob, reserved_length)  # without replacement: distinct tokens
    idx = idx.sort(dim=-1).values  # keep the kept tokens in their original order
    return idx.reshape(layers, batch_size, reserved_length).to(torch.int32)


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device="cpu",
                      attn_mask: torch.Tensor = None):
    idx = _sample(reserved_length, seq_length, batch_size, layers, device)
    new_mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return idx, new_mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device="cpu",
                       attn_mask: torch.Tensor = None):
    if attn_mask is None:
        raise ValueError("random-LTD (model_type 'encoder'): the attention mask named by model_mask_name is required.")
    idx = _sample(reserved_length, seq_length, batch_size, layers, device)
    long_idx = idx.long()
    new_mask = []
    for layer in range(layers):
        per_sample = []
        for b in range(batch_size):
            keep = long_idx[layer, b]
            m = attn_mask[b:b + 1]
            per_sample.append(m[:, :, keep, :][:, :, :, keep])
        new_mask.append(torch.cat(per_sample, dim=0))
    return idx, new_mask


def _expand(indices: torch.Tensor, like: torch.Tensor, batch_first: bool) -> torch.Tensor:
    idx = indices.long()  # [batch, reserved]
    if not batch_first:
        idx = idx.t()  # [reserved, batch]
    return idx.unsqueeze(-1).expand(*idx.shape, like.shape[-1])


class GatherTokens(torch.autograd.Function):
    """``(activations, kept)``: ``kept`` holds the tokens at ``sorted_indices`` of each sample."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool):
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        dim = 1 if batch_first else 0
        return activations, activations.gather(dim, _expand(sorted_indices, activations, batch_first))

    @staticmethod
    def backward(ctx, a_gradients: torch.Tensor, g_gradients: torch.Tensor):
        sorted_indices, = ctx.saved_tensors
        dim = 1 if ctx.batch_first else 0
        # the kept positions' gradient is the one that came through the layer
        grad = a_gradients.scatter(dim, _expand(sorted_indices, a_gradients, ctx.batch_first), g_gradients)
        return grad, None, None


class ScatterTokens(torch.autograd.Function):
    """All tokens, with those at ``sorted_indices`` replaced by the layer's outputs."""

    @staticmethod
    def forward(ctx, all_activations: torch.Tensor, layer_activations: torch.Tensor, sorted_indices: torch.Tensor,
                batch_first: bool):
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        dim = 1 if batch_first else 0
        return all_activations.scatter(dim, _expand(sorted_indices, all_activations, batch_first),
                                       layer_activations.to(all_activations.dtype))

    @staticmethod
    def backward(ctx, out_gradients: torch.Tensor):
        sorted_indices, = ctx.saved_tensors
        dim = 1 if ctx.batch_first else 0
        kept = out_gradients.gather(dim, _expand(sorted_indices, out_gradients, ctx.batch_first))
        # all_activations: passed through unchanged (GatherTokens' backward overwrites the kept positions)
        return out_gradients, kept, None, None


# ---- the kernel entry points of DeepSpeed's RandomLTDBuilder().load(), in PyTorch ops
def token_sort_(indices: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Sort each row of sampled token indices ascending, in place."""
    indices.copy_(indices.sort(dim=-1).values)
    return indices


def token_gather(activations: torch.Tensor, sorted_indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The tokens at ``sorted_indices`` ([batch, kept]) of each sample."""
    return activations.gather(1 if batch_first else 0, _expand(sorted_indices, activations, batch_first))


def token_scatter_(all_activations: torch.Tensor, layer_activations: torch.Tensor, sorted_indices: torch.Tensor,
                   batch_first: bool) -> torch.Tensor:
    """Write ``layer_activations`` back at ``sorted_indices`` of ``all_activations``, in place."""
    return all_activations.scatter_(1 if batch_first else 0, _expand(sorted_indices, all_activations, batch_first),
                                    layer_activations.to(all_activations.dtype))


def mask_gather_gpt(attn_mask: torch.Tensor, reserved_length: int) -> torch.Tensor:
    return attn_mask[:, :, :reserved_length, :reserved_length]
