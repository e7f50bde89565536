"""Compressible layers: drop-in subclasses of ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding``
and ``nn.BatchNorm2d`` that ``init_compression`` puts in place of the originals (same
parameters, same outputs until a technique switches on).

Each technique is configured once (``enable_*``) and switched on by the scheduler
through a flag (``weight_quantization_enabled``, ``sparse_pruning_enabled``,
``row_pruning_enabled``, ``head_pruning_enabled``, ``channel_pruning_enabled``,
``activation_quantization_enabled``); the forward then applies, in this order:
weight fake-quantization (``quantize_weight_in_forward``), the sparse mask, the row
mask (Linear) or channel mask (Conv2d), the head mask (Linear, on the input columns of
the attention output matrix), and activation quantization of the input.

``fix_*`` methods (called by ``redundancy_clean``) make a technique permanent: quantized
values baked into the weight, pruned entries zeroed, and - where a related module takes
the pruned dimension as input - rows, heads or channels physically removed.

Masks: ``l1`` masks are computed when the technique is configured, from the weights then
(magnitudes: ``|w|`` for sparse, the L1 norm of each row / output channel); ``topk`` masks
come from learnable scores (parameters) through :class:`~.utils.TopKBinarizer`, whose
gradient flows straight through to the scores; ``snip_momentum`` masks are set by
:class:`~.snip.SnipMomentumPruner`. Masks and scores are buffers or parameters, so they are
in the state dict and resume with the model.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F, init

from .utils import (AsymQuantizer, SymQuantizer, TopKBinarizer, group_count, quantize, quantizer_for,
                    topk_mask)


class QuantAct(nn.Module):
    """Static-range activation quantizer: the range is a running average (momentum
    ``act_range_momentum``) of each training batch's min/max, kept in the buffer
    ``x_min_max`` (used as is in eval)."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric"):
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.act_function = SymQuantizer.apply if quant_mode == "symmetric" else AsymQuantizer.apply
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x, num_bits, *args):
        if self.training:
            lo, hi = x.detach().min().float(), x.detach().max().float()
            if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its range
                self.x_min_max[0], self.x_min_max[1] = lo, hi
            m = self.act_range_momentum
            self.x_min_max[0] = self.x_min_max[0] * m + lo * (1 - m)
            self.x_min_max[1] = self.x_min_max[1] * m + hi * (1 - m)
        return self.act_function(x, num_bits, self.x_min_max[0].to(x.dtype), self.x_min_max[1].to(x.dtype))


def _new_param(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(data.clone().contiguous(), requires_grad=old.requires_grad)
    for attr in ("start_bits", "target_bits", "q_period"):
        setattr(p, attr, getattr(old, attr, None))
    return p


class _WeightQuantMixin:
    """Weight quantization shared by every compressible layer."""

    def _init_weight_quant(self):
        self.weight.start_bits = None
        self.weight.target_bits = None
        self.weight.q_period = None
        self.weight_quantization_enabled_in_forward = False
        self.weight_quantization_enabled = False
        self.weight_quantize_bits = None
        self.weight_quantize_num_groups = 1
        self.weight_quantization_type = "symmetric"
        self.weight_quantize_rounding = "nearest"

    def enable_weight_quantization(self, start_bits, target_bits, quantization_period,
                                   weight_quantization_enabled_in_forward, quantization_type, num_groups,
                                   rounding="nearest"):
        if target_bits > start_bits:
            raise ValueError(f"weight_quantization: target_bits ({target_bits}) must be <= start_bits ({start_bits}).")
        quantizer_for(target_bits, quantization_type)  # 1/2 bits: symmetric only
        self.weight.start_bits = start_bits
        self.weight.target_bits = target_bits
        self.weight.q_period = quantization_period
        self.weight_quantization_enabled_in_forward = bool(weight_quantization_enabled_in_forward)
        self.weight_quantization_type = quantization_type
        self.weight_quantize_rounding = rounding
        self.weight_quantize_bits = start_bits
        self.weight_quantize_num_groups = group_count(self.weight.shape, self._default_quant_groups(num_groups))

    def _default_quant_groups(self, num_groups):
        return num_groups

    def _fake_quant_weight(self, w):
        bits = self.weight_quantize_bits
        return quantizer_for(bits, self.weight_quantization_type).apply(w, bits, None, None,
                                                                        self.weight_quantize_num_groups)

    def quantize_weight_(self, mix_ratio: float = 0.0) -> None:
        """Quantize the weight in place at the current bits (quantization in the optimizer
        step, ``quantize_weight_in_forward: false``); with ``mix_ratio`` r > 0 the weight
        becomes ``r * w + (1 - r) * q(w)`` (``fp16_mixed_quantize``)."""
        with torch.no_grad():
            w = self.weight.data
            q = quantize(w.float(), self.weight_quantize_bits, self.weight_quantization_type,
                         self.weight_quantize_num_groups, self.weight_quantize_rounding == "stochastic")
            if mix_ratio > 0:
                q = mix_ratio * w.float() + (1 - mix_ratio) * q
            w.copy_(q.to(w.dtype))

    def fix_weight_quantization(self):
        """Bake the quantized values into the weight (at the current bits). With quantization
        in the optimizer step the weight already holds them (quantized after the last step;
        re-quantizing could move an asymmetric grid)."""
        if self.weight_quantize_bits is not None and self.weight_quantization_enabled_in_forward:
            with torch.no_grad():
                self.weight.data.copy_(quantize(self.weight.data.float(), self.weight_quantize_bits,
                                                self.weight_quantization_type,
                                                self.weight_quantize_num_groups).to(self.weight.dtype))
        self.weight_quantization_enabled_in_forward = False
        self.weight_quantization_enabled = False
        return None


class _ActQuantMixin:

    def _init_act_quant(self):
        self.activation_quantization_method = None
        self.activation_quantization_enabled = False

    def enable_activation_quantization(self, bits, quantization_type, range_calibration):
        if bits < 2:
            raise ValueError(f"activation_quantization: bits must be >= 2, got {bits}.")
        self.activation_quantization_bits = bits
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quant_mode=quantization_type)
        else:
            self.activation_quantizer = SymQuantizer.apply if quantization_type == "symmetric" else AsymQuantizer.apply

    def _quantize_input(self, x, groups_fn):
        if not (self.activation_quantization_enabled and self.activation_quantization_method):
            return x
        groups = groups_fn(x) if "dynamic" in self.activation_quantization_method else 1
        return self.activation_quantizer(x, self.activation_quantization_bits, None, None, groups)


class _SparseMixin:

    def _init_sparse(self):
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False

    def enable_sparse_pruning(self, ratio, method, block_pattern="4x1"):
        self.sparse_pruning_ratio = ratio
        self.sparse_pruning_method = method
        if method == "l1":
            self.register_buffer("sparse_pruning_mask", topk_mask(self.weight.data.abs(), ratio))
        elif method == "topk":
            self.sparse_mask_scores = nn.Parameter(torch.empty_like(self.weight.data))
            init.kaiming_uniform_(self.sparse_mask_scores, a=math.sqrt(5))
        elif method == "snip_momentum":
            # the mask starts dense; SnipMomentumPruner narrows it on its schedule
            self.sparse_pruning_block_pattern = block_pattern
            self.register_buffer("sparse_pruning_mask", torch.ones_like(self.weight.data))
            self.register_buffer("snip_scores", torch.zeros_like(self.weight.data))
        else:
            raise ValueError(f"sparse_pruning.method must be 'l1', 'topk' or 'snip_momentum', got {method!r}.")

    def _sparse_mask(self):
        if self.sparse_pruning_method == "topk":
            return TopKBinarizer.apply(self.sparse_mask_scores, self.sparse_pruning_ratio, False)
        return self.sparse_pruning_mask

    def fix_sparse_pruning_helper(self):
        with torch.no_grad():
            self.weight.data.mul_(self._sparse_mask().detach().to(self.weight.dtype))
        for name in ("sparse_pruning_mask", "sparse_mask_scores", "snip_scores"):
            if hasattr(self, name):
                delattr(self, name)
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False
        return None


def _out_mask_from(method, ratio, l1_norms, scores):
    if method == "l1":
        return l1_norms
    return TopKBinarizer.apply(scores, ratio, False)


class LinearLayer_Compress(_WeightQuantMixin, _ActQuantMixin, _SparseMixin, nn.Linear):
    """``nn.Linear`` with weight/activation quantization and sparse, row and head pruning."""

    def __init__(self, *kargs, bias=True, **kwargs):
        super().__init__(*kargs, bias=bias, **kwargs)
        self._init_weight_quant()
        self._init_act_quant()
        self._init_sparse()
        self.row_pruning_method = None
        self.head_pruning_method = None
        self.row_pruning_enabled = False
        self.head_pruning_enabled = False

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparse pruning={self.sparse_pruning_method is not None}, row pruning="
                f"{self.row_pruning_method is not None}, head pruning={self.head_pruning_method is not None}, "
                f"activation quantization={self.activation_quantization_method is not None}, "
                f"weight_quantization={self.weight.target_bits}")

    # ---- row pruning (output features) -----------------------------------------------------
    def enable_row_pruning(self, ratio, method):
        self.row_pruning_ratio = ratio
        self.row_pruning_method = method
        if method == "l1":
            norms = torch.linalg.norm(self.weight.data.float(), ord=1, dim=1)
            self.register_buffer("row_pruning_mask", topk_mask(norms, ratio).view(-1, 1).to(self.weight.dtype))
        elif method == "topk":
            self.row_mask_scores = nn.Parameter(torch.empty(self.weight.size(0), 1, device=self.weight.device,
                                                            dtype=self.weight.dtype))
            init.kaiming_uniform_(self.row_mask_scores, a=math.sqrt(5))
        else:
            raise ValueError(f"row_pruning.method must be 'l1' or 'topk', got {method!r}.")

    # ---- head pruning (input columns of the attention output matrix) -----------------------
    def enable_head_pruning(self, ratio, method, num_heads):
        if method != "topk":
            raise ValueError(f"head_pruning.method must be 'topk', got {method!r}.")
        if not num_heads or self.in_features % num_heads:
            raise ValueError(f"head_pruning.shared_parameters.num_heads={num_heads} does not divide the input size "
                             f"{self.in_features} of the attention output matrix it is applied to.")
        self.num_heads = num_heads
        self.head_pruning_ratio = ratio
        self.head_pruning_method = method
        self.head_pruning_scores = nn.Parameter(torch.empty(1, num_heads, device=self.weight.device,
                                                            dtype=self.weight.dtype))
        init.kaiming_uniform_(self.head_pruning_scores, a=math.sqrt(5))

    def get_mask(self, pruning_type="row"):
        if pruning_type == "sparse":
            return self._sparse_mask()
        if pruning_type == "row":
            if self.row_pruning_method == "l1":
                return self.row_pruning_mask
            return TopKBinarizer.apply(self.row_mask_scores, self.row_pruning_ratio, False)
        if pruning_type == "head":
            return TopKBinarizer.apply(self.head_pruning_scores, self.head_pruning_ratio, False)
        raise ValueError(f"get_mask: unknown pruning_type {pruning_type!r} (sparse, row, head).")

    def head_pruning_reshape(self, w, mask):
        # columns of w grouped by head: (out, heads, head_dim) * mask over heads
        out = w.size(0)
        return (w.reshape(out, self.num_heads, -1) * mask.view(1, -1, 1)).reshape(w.shape)

    def compressed_weight_bias(self):
        """The weight and bias the forward uses, with every switched-on technique applied."""
        w, b = self.weight, self.bias
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            w = self._fake_quant_weight(w)
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            w = w * self._sparse_mask().to(w.dtype)
        if self.row_pruning_enabled and self.row_pruning_method:
            m = self.get_mask("row").to(w.dtype)
            w = w * m.view(-1, 1)
            if b is not None:
                b = b * m.view(-1)
        if self.head_pruning_enabled and self.head_pruning_method:
            w = self.head_pruning_reshape(w, self.get_mask("head").to(w.dtype))
        return w, b

    def forward(self, input, skip_bias_add=False):
        w, b = self.compressed_weight_bias()
        input = self._quantize_input(input, lambda x: x.numel() // x.size(-1))
        if skip_bias_add:
            return F.linear(input, w, None), b
        return F.linear(input, w, b)

    # ---- making it permanent ------------------------------------------------------------------
    def fix_row_col_pruning_helper(self, mask=None, dim_reduction=False):
        """Without ``mask``: apply this layer's row mask (remove the rows when
        ``dim_reduction``, else zero them) and return the kept-row mask. With ``mask`` (a
        preceding layer's kept rows): remove the matching input columns."""
        if mask is None:
            mask = self.get_mask("row").detach().view(-1).bool()
            with torch.no_grad():
                if dim_reduction:
                    self.weight = _new_param(self.weight, self.weight.data[mask, :])
                    if self.bias is not None:
                        self.bias = nn.Parameter(self.bias.data[mask].clone())
                    self.out_features = self.weight.size(0)
                else:
                    self.weight.data.mul_(mask.view(-1, 1).to(self.weight.dtype))
                    if self.bias is not None:
                        self.bias.data.mul_(mask.to(self.bias.dtype))
            for name in ("row_pruning_mask", "row_mask_scores"):
                if hasattr(self, name):
                    delattr(self, name)
            self.row_pruning_method = None
            self.row_pruning_enabled = False
            return mask
        mask = mask.view(-1).bool()
        if mask.numel() != self.in_features:
            raise ValueError(f"row_pruning related module: a related layer has {self.in_features} input features "
                             f"but the pruned layer has {mask.numel()} rows; 'related_modules' must name the layer "
                             f"that consumes the pruned layer's output.")
        self.weight = _new_param(self.weight, self.weight.data[:, mask])
        self.in_features = self.weight.size(1)
        return None

    def fix_head_pruning_helper(self, mask=None, num_heads=None, dim_reduction=False):
        """Without ``mask`` (the output matrix): apply the head mask (remove the heads' input
        columns when ``dim_reduction``) and return the kept-head mask. With ``mask`` (Q, K
        or V): remove the pruned heads' output rows and bias entries."""
        num_heads = num_heads or getattr(self, "num_heads", None)
        if mask is None:
            mask = self.get_mask("head").detach().view(-1).bool()
            with torch.no_grad():
                out = self.weight.size(0)
                w = self.weight.data.reshape(out, num_heads, -1)
                if dim_reduction:
                    self.weight = _new_param(self.weight, w[:, mask, :].reshape(out, -1))
                    self.in_features = self.weight.size(1)
                else:
                    self.weight.data.copy_((w * mask.view(1, -1, 1).to(w.dtype)).reshape(out, -1))
            del self.head_pruning_scores
            self.head_pruning_method = None
            self.head_pruning_enabled = False
            return mask
        mask = mask.view(-1).bool()
        if self.out_features % mask.numel():
            raise ValueError(f"head_pruning related module: {self.out_features} output features do not split into "
                             f"{mask.numel()} heads; 'related_modules' must name the Q/K/V projections.")
        w = self.weight.data.reshape(mask.numel(), -1, self.in_features)[mask].reshape(-1, self.in_features)
        self.weight = _new_param(self.weight, w)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.reshape(mask.numel(), -1)[mask].reshape(-1).clone())
        self.out_features = self.weight.size(0)
        return None


class Conv2dLayer_Compress(_WeightQuantMixin, _ActQuantMixin, _SparseMixin, nn.Conv2d):
    """``nn.Conv2d`` with weight/activation quantization and sparse and channel pruning."""

    def __init__(self, *kargs, **kwargs):
        super().__init__(*kargs, **kwargs)
        self._init_weight_quant()
        self._init_act_quant()
        self._init_sparse()
        self.channel_pruning_method = None
        self.channel_pruning_enabled = False

    def extra_repr(self):
        return (super().extra_repr() + f", sparse pruning={self.sparse_pruning_method is not None}, channel pruning="
                f"{self.channel_pruning_method is not None}, activation quantization="
                f"{self.activation_quantization_method is not None}, weight_quantization={self.weight.target_bits}")

    def enable_channel_pruning(self, ratio, method):
        self.channel_pruning_ratio = ratio
        self.channel_pruning_method = method
        if method == "l1":
            norms = torch.linalg.norm(self.weight.data.float().flatten(1), ord=1, dim=1)
            self.register_buffer("channel_pruning_mask",
                                 topk_mask(norms, ratio).view(-1, 1, 1, 1).to(self.weight.dtype))
        elif method == "topk":
            self.channel_mask_scores = nn.Parameter(torch.empty(self.weight.size(0), 1, 1, 1,
                                                                device=self.weight.device, dtype=self.weight.dtype))
            init.kaiming_uniform_(self.channel_mask_scores, a=math.sqrt(5))
        else:
            raise ValueError(f"channel_pruning.method must be 'l1' or 'topk', got {method!r}.")

    def get_mask(self, pruning_type="sparse"):
        if pruning_type == "sparse":
            return self._sparse_mask()
        if pruning_type == "channel":
            if self.channel_pruning_method == "l1":
                return self.channel_pruning_mask
            return TopKBinarizer.apply(self.channel_mask_scores, self.channel_pruning_ratio, False)
        raise ValueError(f"get_mask: unknown pruning_type {pruning_type!r} (sparse, channel).")

    def channel_mask_active(self):
        """The kept-output-channel mask while channel pruning is on (else ``None``)."""
        if self.channel_pruning_enabled and self.channel_pruning_method:
            return self.get_mask("channel")
        return None

    def compressed_weight_bias(self):
        w, b = self.weight, self.bias
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            w = self._fake_quant_weight(w)
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            w = w * self._sparse_mask().to(w.dtype)
        m = self.channel_mask_active()
        if m is not None:
            m = m.to(w.dtype)
            w = w * m.view(-1, 1, 1, 1)
            if b is not None:
                b = b * m.view(-1)
        return w, b

    def forward(self, input):
        w, b = self.compressed_weight_bias()
        input = self._quantize_input(input, lambda x: x.size(0))
        return self._conv_forward(input, w, b)

    def fix_channel_pruning_helper(self, mask=None, dim_reduction=False):
        """Without ``mask``: apply the channel mask (remove the output channels when
        ``dim_reduction``) and return it. With ``mask``: remove the matching input channels."""
        if mask is None:
            mask = self.get_mask("channel").detach().view(-1).bool()
            with torch.no_grad():
                if dim_reduction:
                    self.weight = _new_param(self.weight, self.weight.data[mask])
                    if self.bias is not None:
                        self.bias = nn.Parameter(self.bias.data[mask].clone())
                    self.out_channels = self.weight.size(0)
                else:
                    self.weight.data.mul_(mask.view(-1, 1, 1, 1).to(self.weight.dtype))
                    if self.bias is not None:
                        self.bias.data.mul_(mask.to(self.bias.dtype))
            for name in ("channel_pruning_mask", "channel_mask_scores"):
                if hasattr(self, name):
                    delattr(self, name)
            self.channel_pruning_method = None
            self.channel_pruning_enabled = False
            return mask
        mask = mask.view(-1).bool()
        if self.groups != 1 or mask.numel() != self.in_channels:
            raise ValueError(f"channel_pruning related module: a related conv has {self.in_channels} input channels "
                             f"(groups={self.groups}) but the pruned conv has {mask.numel()} output channels; "
                             f"'related_modules' must name the convs and batch norms that consume its output.")
        self.weight = _new_param(self.weight, self.weight.data[:, mask])
        self.in_channels = self.weight.size(1)
        return None


class BNLayer_Compress(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that follows a channel-pruned conv: while the conv's channel
    pruning is on, the pruned channels' outputs are zeroed (so the masked model computes
    exactly what the cleaned model will), and ``fix_channel_pruning_helper`` removes them."""

    def __init__(self, *kargs, **kwargs):
        super().__init__(*kargs, **kwargs)
        self._channel_source = None

    def follow_channel_mask(self, conv: "Conv2dLayer_Compress") -> None:
        object.__setattr__(self, "_channel_source", conv)  # a reference, not a submodule

    def forward(self, input):
        out = super().forward(input)
        src = self.__dict__.get("_channel_source")
        m = src.channel_mask_active() if src is not None else None
        if m is not None:
            out = out * m.view(1, -1, 1, 1).to(out.dtype)
        return out

    def fix_channel_pruning_helper(self, mask=None, dim_reduction=True):
        if mask is None:
            return None
        mask = mask.view(-1).bool()
        if mask.numel() != self.num_features:
            raise ValueError(f"channel_pruning related module: a batch norm has {self.num_features} features but the "
                             f"pruned conv has {mask.numel()} output channels.")
        if self.affine:
            self.weight = nn.Parameter(self.weight.data[mask].clone())
            self.bias = nn.Parameter(self.bias.data[mask].clone())
        if self.track_running_stats and self.running_mean is not None:
            self.running_mean = self.running_mean[mask].clone()
            self.running_var = self.running_var[mask].clone()
        self.num_features = int(mask.sum())
        object.__setattr__(self, "_channel_source", None)
        return None


class Embedding_Compress(_WeightQuantMixin, nn.Embedding):
    """``nn.Embedding`` with weight quantization (one quantization group per token row)."""

    def __init__(self, *kargs, **kwargs):
        super().__init__(*kargs, **kwargs)
        self._init_weight_quant()

    def extra_repr(self):
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"weight_quantization={self.weight.target_bits}")

    def _default_quant_groups(self, num_groups):
        return self.weight.size(0)  # token-wise, as DeepSpeed does

    def forward(self, input):
        w = self.weight
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            w = self._fake_quant_weight(w)
        return F.embedding(input, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


# ---------------------------------------------------------------- model-parallel linears

def _mp_group(mpu):
    return mpu.get_model_parallel_group()


def _mp_world(mpu):
    return mpu.get_model_parallel_world_size()


class _CopyToMP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the model-parallel group."""

    @staticmethod
    def forward(ctx, x, mpu):
        ctx.mpu = mpu
        return x

    @staticmethod
    def backward(ctx, g):
        if _mp_world(ctx.mpu) > 1:
            g = g.clone()
            torch.distributed.all_reduce(g, group=_mp_group(ctx.mpu))
        return g, None


class _ReduceFromMP(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, mpu):
        if _mp_world(mpu) > 1:
            x = x.clone()
            torch.distributed.all_reduce(x, group=_mp_group(mpu))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromMP(torch.autograd.Function):
    """All-gather along the last dimension forward; the local slice backward."""

    @staticmethod
    def forward(ctx, x, mpu):
        ctx.mpu = mpu
        n = _mp_world(mpu)
        if n == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(n)]
        torch.distributed.all_gather(parts, x.contiguous(), group=_mp_group(mpu))
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        n = _mp_world(ctx.mpu)
        if n == 1:
            return g, None
        return g.chunk(n, dim=-1)[ctx.mpu.get_model_parallel_rank()].contiguous(), None


class _ScatterToMP(torch.autograd.Function):
    """The local slice of the last dimension forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, mpu):
        ctx.mpu = mpu
        n = _mp_world(mpu)
        if n == 1:
            return x
        return x.chunk(n, dim=-1)[mpu.get_model_parallel_rank()].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _GatherFromMP.forward(None, g, ctx.mpu), None


class ColumnParallelLinear_Compress(LinearLayer_Compress):
    """Megatron's column-parallel linear (this rank holds ``output_size / mp`` rows) with
    compression. ``mpu``: ``get_model_parallel_{group,world_size,rank}``."""

    def __init__(self, mpu, input_size, output_size, bias=True, gather_output=True, skip_bias_add=False):
        n = mpu.get_model_parallel_world_size()
        if output_size % n:
            raise ValueError(f"ColumnParallelLinear_Compress: output_size {output_size} is not divisible by the "
                             f"model-parallel world size {n}.")
        super().__init__(input_size, output_size // n, bias=bias)
        self.mpu, self.input_size, self.output_size = mpu, input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add

    def forward(self, input_):
        x = _CopyToMP.apply(input_, self.mpu)
        out, bias = super().forward(x, skip_bias_add=True)
        if bias is not None and not self.skip_bias_add:
            out = out + bias
        if self.gather_output:
            out = _GatherFromMP.apply(out, self.mpu)
        return out, (bias if self.skip_bias_add else None)


class RowParallelLinear_Compress(LinearLayer_Compress):
    """Megatron's row-parallel linear (this rank holds ``input_size / mp`` columns) with
    compression; the partial products are summed over the model-parallel group."""

    def __init__(self, mpu, input_size, output_size, bias=True, input_is_parallel=False, skip_bias_add=False):
        n = mpu.get_model_parallel_world_size()
        if input_size % n:
            raise ValueError(f"RowParallelLinear_Compress: input_size {input_size} is not divisible by the "
                             f"model-parallel world size {n}.")
        super().__init__(input_size // n, output_size, bias=bias)
        self.mpu, self.input_size, self.output_size = mpu, input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add

    def forward(self, input_):
        x = input_ if self.input_is_parallel else _ScatterToMP.apply(input_, self.mpu)
        out, bias = super().forward(x, skip_bias_add=True)
        out = _ReduceFromMP.apply(out, self.mpu)
        if self.skip_bias_add:
            return out, bias
        return (out + bias if bias is not None else out), None


__all__ = ["QuantAct", "LinearLayer_Compress", "Conv2dLayer_Compress", "BNLayer_Compress", "Embedding_Compress",
           "ColumnParallelLinear_Compress", "RowParallelLinear_Compress"]
