"""The arithmetic of compression: fake quantizers with straight-through gradients, the
top-k binarizer that turns scores into masks, the bit schedule, and block masks.

Quantizers (``Quantizer.apply(x, num_bits, min_value=None, max_value=None, num_groups=1)``)
return ``x`` rounded onto a grid of at most ``2**num_bits`` values per group (``x`` is
viewed as ``num_groups`` rows); the backward passes the gradient straight through.

* symmetric: ``scale = 2 * max|x| / 2**b``, ``q = clamp(round(x / scale), -2**(b-1), 2**(b-1) - 1)``,
  output ``q * scale``;
* asymmetric: ``scale = (max - min) / 2**b``, ``zero_point = round(min / scale) * scale``,
  ``q = clamp(round((x - zero_point) / scale), 0, 2**b - 1)``, output ``q * scale + zero_point``;
* ternary (2 bits): ``t = 0.7 * mean|x|``; values above ``t`` in magnitude become
  ``+-alpha`` (``alpha`` their mean magnitude), the rest 0;
* binary (1 bit): ``sign(x) * mean|x|``.

``min_value``/``max_value`` fix the range (static activation ranges); otherwise each
group's own range is used. ``stochastic=True`` adds uniform noise in [-0.5, 0.5) before
rounding (stochastic rounding).
"""
from __future__ import annotations

import math
import re
from typing import Optional, Tuple

import torch
from torch import autograd


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # an all-zero group has scale 0: any positive scale maps it to 0 exactly
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _noise(x: torch.Tensor, stochastic: bool):
    return torch.empty_like(x).uniform_(-0.5, 0.5) if stochastic else 0.0


def sym_quantize(x: torch.Tensor, num_bits: int, min_value=None, max_value=None, num_groups: int = 1,
                 stochastic: bool = False) -> torch.Tensor:
    q = 2 ** num_bits
    shape = x.shape
    if min_value is None:
        xg = x.reshape(num_groups, -1)
        max_abs = xg.abs().amax(dim=-1, keepdim=True)
    else:
        xg = x.reshape(1, -1)
        max_abs = torch.maximum(torch.as_tensor(min_value).abs(), torch.as_tensor(max_value).abs()).reshape(1, 1)
    scale = _safe(2 * max_abs / q).to(xg.dtype)
    out = (xg / scale + _noise(xg, stochastic)).round().clamp(-(q // 2), q // 2 - 1) * scale
    return out.reshape(shape)


def asym_quantize(x: torch.Tensor, num_bits: int, min_value=None, max_value=None, num_groups: int = 1,
                  stochastic: bool = False) -> torch.Tensor:
    q = 2 ** num_bits
    shape = x.shape
    if min_value is None:
        xg = x.reshape(num_groups, -1)
        lo = xg.amin(dim=-1, keepdim=True)
        hi = xg.amax(dim=-1, keepdim=True)
    else:
        xg = x.reshape(1, -1)
        lo = torch.as_tensor(min_value).reshape(1, 1).to(xg)
        hi = torch.as_tensor(max_value).reshape(1, 1).to(xg)
    scale = _safe((hi - lo) / q).to(xg.dtype)
    zero_point = (lo / scale).round() * scale
    out = ((xg - zero_point) / scale + _noise(xg, stochastic)).round().clamp(0, q - 1) * scale + zero_point
    return out.reshape(shape)


def ternary_quantize(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    xg = x.reshape(num_groups, -1)
    thres = 0.7 * xg.abs().mean(dim=1, keepdim=True)
    keep = (xg.abs() > thres).to(xg.dtype)
    alpha = (keep * xg).abs().sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
    return (alpha * torch.sign(xg) * keep).reshape(x.shape)


def binary_quantize(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    xg = x.reshape(num_groups, -1)
    return (torch.sign(xg) * xg.abs().mean(dim=1, keepdim=True)).reshape(x.shape)


class _STE(autograd.Function):
    """Base: forward is ``_quantize``; backward passes the gradient through unchanged."""

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None, None


class SymQuantizer(_STE):
    """Symmetric quantization (straight-through gradient)."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        return sym_quantize(input, num_bits, min_value, max_value, num_groups)


class AsymQuantizer(_STE):
    """Asymmetric quantization (straight-through gradient)."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        return asym_quantize(input, num_bits, min_value, max_value, num_groups)


class TernaryQuantizer(_STE):
    """Ternary (2-bit) quantization (straight-through gradient); symmetric only."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        if min_value is not None or max_value is not None:
            raise ValueError("TernaryQuantizer: a fixed range (min_value/max_value) is not supported.")
        return ternary_quantize(input, num_groups)


class BinaryQuantizer(_STE):
    """Binary (1-bit) quantization (straight-through gradient); symmetric only."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        if min_value is not None or max_value is not None:
            raise ValueError("BinaryQuantizer: a fixed range (min_value/max_value) is not supported.")
        return binary_quantize(input, num_groups)


def quantizer_for(bits: int, quantization_type: str):
    """The quantizer class for ``bits`` (1: binary, 2: ternary, >=3: sym/asym)."""
    if bits >= 3:
        return SymQuantizer if quantization_type == "symmetric" else AsymQuantizer
    if quantization_type != "symmetric":
        raise ValueError(f"weight_quantization: {bits}-bit quantization is symmetric only; set "
                         f"'quantization_type' to 'symmetric' or 'target_bits' >= 3.")
    return TernaryQuantizer if bits == 2 else BinaryQuantizer


def quantize(x: torch.Tensor, bits: int, quantization_type: str = "symmetric", num_groups: int = 1,
             stochastic: bool = False) -> torch.Tensor:
    """Quantize without autograd (in-place weight quantization, baking)."""
    if bits >= 3:
        fn = sym_quantize if quantization_type == "symmetric" else asym_quantize
        return fn(x, bits, None, None, num_groups, stochastic)
    quantizer_for(bits, quantization_type)  # the symmetric-only check
    return ternary_quantize(x, num_groups) if bits == 2 else binary_quantize(x, num_groups)


def scheduled_bits(start_bits: int, target_bits: int, period: int, steps: int) -> int:
    """Bits after ``steps`` steps of quantization: one bit fewer each time ``steps`` reaches
    the period, which then doubles (DeepSpeed's MoQ schedule: with period P, the bits drop
    at steps P, 2P, 4P, ... until ``target_bits``)."""
    bits, p = start_bits, period
    while bits > target_bits and steps >= p:
        bits -= 1
        p *= 2
    return bits


class TopKBinarizer(autograd.Function):
    """Mask keeping the ``ceil(threshold * numel)`` largest entries of ``inputs`` (1 kept, 0
    pruned); the gradient flows straight through to the scores. With ``sigmoid=True``,
    ``threshold`` is a learnable logit (``sigmoid(threshold)`` is the kept fraction)."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, threshold, sigmoid: bool = False):
        if sigmoid:
            threshold = torch.sigmoid(threshold).item()
        ctx.sigmoid = sigmoid
        mask = topk_mask(inputs, threshold)
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx, grad_output):
        mask, = ctx.saved_tensors
        if ctx.sigmoid:
            return grad_output.clone(), (grad_output * mask).sum().view(-1), None
        return grad_output.clone(), None, None


def topk_mask(scores: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """1 for the ``ceil(keep_ratio * numel)`` largest scores (ties: the earlier index), else 0."""
    flat = scores.detach().flatten()
    k = math.ceil(keep_ratio * flat.numel())
    mask = torch.zeros_like(flat)
    if k > 0:
        idx = torch.argsort(flat, descending=True, stable=True)[:k]
        mask[idx] = 1
    return mask.view_as(scores)


# ---------------------------------------------------------------- block patterns

def parse_block_pattern(pattern: str) -> Tuple[str, int, int]:
    """``'4x1'`` -> ``('NxM', 4, 1)``; ``'2:4'`` -> ``('N:M', 2, 4)``."""
    m = re.fullmatch(r"(\d+)([x:])(\d+)", pattern)
    if m is None:
        raise ValueError(f"sparse_pruning.shared_parameters.block_pattern {pattern!r} must look like 'NxM' "
                         f"(e.g. '4x1') or 'N:M' (e.g. '2:4').")
    n, kind, mm = int(m.group(1)), m.group(2), int(m.group(3))
    if n < 1 or mm < 1 or (kind == ":" and n >= mm):
        raise ValueError(f"sparse_pruning.shared_parameters.block_pattern {pattern!r}: N and M must be >= 1 "
                         f"(and N < M for 'N:M').")
    return ("NxM" if kind == "x" else "N:M"), n, mm


def check_pattern_fits(pattern: str, shape, name: str) -> None:
    kind, n, m = parse_block_pattern(pattern)
    rows, cols = shape[0], int(math.prod(shape[1:]))
    if kind == "NxM" and (rows % n or cols % m):
        raise ValueError(f"sparse_pruning block_pattern {pattern!r} does not tile module '{name}' "
                         f"(weight {tuple(shape)} seen as {rows}x{cols}): {rows} must be a multiple of {n} and "
                         f"{cols} of {m}. Exclude it ('excluded_modules') or pick another pattern.")
    if kind == "N:M" and cols % m:
        raise ValueError(f"sparse_pruning block_pattern {pattern!r} does not tile module '{name}': its input size "
                         f"{cols} is not a multiple of {m}. Exclude it ('excluded_modules') or pick another pattern.")


def block_mask(scores: torch.Tensor, pattern: str, keep_ratio: float) -> torch.Tensor:
    """A mask of ``scores``' shape (seen as rows x the rest) that keeps whole blocks.

    * ``NxM``: blocks of N rows by M columns are scored by the sum of their scores; the
      ``ceil(keep_ratio * blocks)`` best blocks are kept.
    * ``N:M``: in every run of M consecutive columns of a row, the N lowest scores are
      pruned (Intel Neural Compressor's meaning; ``2:4`` keeps 2 of every 4);
      ``keep_ratio`` is not used, the pattern fixes the density at ``(M - N) / M``.
    """
    kind, n, m = parse_block_pattern(pattern)
    shape = scores.shape
    s = scores.detach().reshape(shape[0], -1).float()
    rows, cols = s.shape
    if kind == "NxM":
        blocks = s.reshape(rows // n, n, cols // m, m).sum(dim=(1, 3))
        keep = topk_mask(blocks, keep_ratio)
        mask = keep[:, None, :, None].expand(rows // n, n, cols // m, m).reshape(rows, cols)
    else:
        groups = s.reshape(rows, cols // m, m)
        order = torch.argsort(groups, dim=-1, stable=True)  # ascending: the first n are pruned
        mask = torch.ones_like(groups)
        mask.scatter_(-1, order[..., :n], 0.0)
        mask = mask.reshape(rows, cols)
    return mask.reshape(shape).to(scores.dtype)


def cubic_sparsity(target: float, start: int, end: int, step: int) -> float:
    """Sparsity at ``step`` rising from 0 at ``start`` to ``target`` at ``end`` along
    ``target * (1 - (1 - progress)**3)`` (Zhu & Gupta's gradual pruning)."""
    if end <= start or step >= end:
        return target if step >= start else 0.0
    if step < start:
        return 0.0
    progress = (step - start) / (end - start)
    return target * (1.0 - (1.0 - progress) ** 3)


def group_count(weight_shape, requested: Optional[int]) -> int:
    """Quantization groups for a weight: ``requested`` when it divides the weight."""
    numel = int(math.prod(weight_shape))
    g = requested or 1
    if numel % g:
        raise ValueError(f"weight_quantization.shared_parameters.quantize_groups={g} does not divide a weight of "
                         f"shape {tuple(weight_shape)} ({numel} elements).")
    return g
