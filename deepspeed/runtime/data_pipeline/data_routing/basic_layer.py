"""``RandomLayerTokenDrop``: a wrapper that runs its layer on a random subset of tokens.

In training, with the schedule's reserved length ``r`` below the sequence length, the
wrapper keeps ``r`` tokens per sample (sampled once per forward by the first random-LTD
layer and shared by the others, a fresh draw per layer), runs the wrapped layer on them
only, and puts its outputs back at their positions; the dropped tokens pass through
unchanged. The attention mask named ``model_mask_name`` is cut to the kept tokens.
In eval, or once ``r`` reaches the sequence length, the layer runs on every token.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from ....ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens
from ..constants import RANDOM_LTD_ATTENTION_MASK, RANDOM_LTD_MAX_VALUE, RANDOM_LTD_SAMPLE_INDEX


class RandomLayerTokenDrop(Module):

    def __init__(self, layer: Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler = None
        self.max_length = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False
        self.random_ltd_layer_id = None
        self.mask_name = None

    def init_config(self, config, scheduler, random_ltd_layer_id: int) -> None:
        cfg = config.model_dump() if hasattr(config, "model_dump") else dict(config)
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state[RANDOM_LTD_MAX_VALUE]
        self.mask_name = cfg.get("model_mask_name")
        self.micro_bs = cfg.get("micro_batch_size")
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        order, self.model_type = cfg.get("hidden_state_order"), cfg.get("model_type")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"data_efficiency.data_routing.random_ltd.hidden_state_order: {order!r}; use "
                             f"'batch_seq_dim' or 'seq_batch_dim'.")
        if self.model_type not in ("decoder", "encoder"):
            raise ValueError(f"data_efficiency.data_routing.random_ltd.model_type: {self.model_type!r}; use "
                             f"'decoder' or 'encoder'.")
        self.batch_first = order == "batch_seq_dim"
        self.index_generator = gpt_sample_tokens if self.model_type == "decoder" else bert_sample_tokens

    def _shape(self, hidden_states: Tensor) -> None:
        b, s = (0, 1) if self.batch_first else (1, 0)
        self.curr_seq, self.curr_micro_batch = hidden_states.size(s), hidden_states.size(b)

    def forward(self, hidden_states: Tensor, **kwargs):
        if self.random_ltd_scheduler is None:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = self.random_ltd_scheduler.get_current_seq()
        self._shape(hidden_states)
        if not (self.training and self.reserved_length < self.curr_seq):
            return self.random_ltd_layer(hidden_states, **kwargs)
        state = self.random_ltd_scheduler.state
        mask = kwargs.get(self.mask_name) if self.mask_name is not None else None
        idx = state.get(RANDOM_LTD_SAMPLE_INDEX)
        fresh = idx is None or tuple(idx.shape[1:]) != (self.curr_micro_batch, self.reserved_length)
        if self.random_ltd_layer_id == 0 or fresh:
            # the first layer draws the kept tokens of every random-LTD layer for this forward (a later
            # layer draws them when the first was skipped, e.g. by progressive layer drop)
            idx, part_mask = self.index_generator(self.reserved_length, self.curr_seq, self.curr_micro_batch,
                                                  self.random_ltd_num_layer, hidden_states.device, mask)
            state[RANDOM_LTD_SAMPLE_INDEX], state[RANDOM_LTD_ATTENTION_MASK] = idx, part_mask
        else:
            part_mask = state[RANDOM_LTD_ATTENTION_MASK]
        layer_idx = idx[self.random_ltd_layer_id]
        hidden_states, part = GatherTokens.apply(hidden_states, layer_idx, self.batch_first)
        if self.mask_name is not None and part_mask is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(part, **kwargs)
        if isinstance(outputs, tuple):
            merged = ScatterTokens.apply(hidden_states, outputs[0], layer_idx, self.batch_first)
            return (merged,) + tuple(outputs[1:])
        if isinstance(outputs, torch.Tensor):
            return ScatterTokens.apply(hidden_states, outputs, layer_idx, self.batch_first)
        raise TypeError(f"random-LTD: the wrapped {type(self.random_ltd_layer).__name__} returned "
                        f"{type(outputs).__name__}; a tensor or a tuple whose first item is the hidden states is "
                        f"required.")
