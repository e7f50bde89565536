"""Block-wise integer quantization in plain PyTorch ops (no kernels to build).

A flat tensor is cut into blocks of ``block_size`` elements (the last block padded
with zeros); each block gets one fp32 *scale* (the quantization step) and its values
become integers:

    scale_b = max|x in block b| / qmax          qmax = 2**(bits-1) - 1  (127 for int8, 7 for int4)
    q       = round(x / scale_b)               in [-qmax, qmax]
    deq(q)  = q * scale_b

Symmetric and unclamped (``-qmax..qmax``, the value ``-2**(bits-1)`` is never used), so
every element satisfies ``|x - deq(q(x))| <= scale_b / 2`` (plus fp32 rounding of the
product). An all-zero block gets scale 0 and all-zero codes (exact). int4 codes travel packed,
two to a byte (:func:`pack_int4` / :func:`unpack_int4`).

DeepSpeed's CUDA quantizer uses 2**bits levels (``[-128, 127]`` for int8) with the step
``absmax / 2**(bits-1)``, so its largest positive value is clamped by up to one step; we
use one level fewer and keep the half-step bound everywhere.
"""
from __future__ import annotations

import math

import torch

DEFAULT_BLOCK_SIZE = 2048


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"quantizer: bits={bits} is not supported; use 8 (int8) or 4 (int4).")
    return 2 ** (bits - 1) - 1


def num_blocks(numel: int, block_size: int) -> int:
    return max(1, math.ceil(numel / block_size))


def quantize_blockwise(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, bits: int = 8):
    """Quantize ``x`` (any shape, any float dtype) -> ``(codes, scales)``.

    ``codes``: int8 of shape ``(num_blocks, block_size)`` (int4 values stay in int8 here;
    pack them with :func:`pack_int4` for the wire); ``scales``: fp32 ``(num_blocks,)``."""
    if block_size < 1:
        raise ValueError(f"quantizer: block_size must be >= 1, got {block_size}")
    qmax = _qmax(bits)
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(nb, block_size)
    absmax = blocks.abs().amax(dim=1)
    scales = absmax / qmax
    divisor = torch.where(absmax > 0, scales, torch.ones_like(scales))   # an all-zero block: codes 0, scale 0
    codes = torch.round(blocks / divisor.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int8)
    return codes, scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, numel: int = None, dtype=torch.float32,
                         out: torch.Tensor = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: the first ``numel`` values as a flat tensor of
    ``dtype`` (written into ``out`` when given)."""
    nb = scales.numel()
    vals = codes.reshape(nb, -1).float() * scales.reshape(nb, 1).float()
    flat = vals.view(-1)
    if numel is not None:
        flat = flat[:numel]
    if out is not None:
        out.view(-1).copy_(flat)
        return out
    return flat.to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in ``[-7, 7]`` (even count) -> uint8, two codes per byte (low nibble first)."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        raise ValueError(f"pack_int4: needs an even number of codes, got {flat.numel()}")
    u = (flat.contiguous().view(torch.uint8) & 0xF).view(-1, 2)   # two's complement: the low nibble
    return u[:, 0] | (u[:, 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 from :func:`pack_int4` -> int8 codes (twice as many)."""
    p = packed.reshape(-1)
    nib = torch.stack((p & 0xF, p >> 4), dim=1).reshape(-1).view(torch.int8)
    return (nib ^ 8) - 8                                           # sign-extend 4 bits


def quantization_error_bound(scales: torch.Tensor) -> torch.Tensor:
    """The documented per-element bound of each block: ``scale / 2``."""
    return scales / 2


def ds_quantizer(input, groups=1, bit_num=8, sr=False, asym=False):  # noqa: A002 - DeepSpeed's signature
    """DeepSpeed's fake quantizer: quantize ``input`` in ``groups`` equal groups to
    ``bit_num`` bits and write the dequantized values back into ``input`` (returned).

    ``asym``: per group ``scale = (max - min) / (2**bits - 1)`` with ``min`` as offset;
    ``sr``: stochastic rounding (round up with probability equal to the fraction)."""
    if bit_num < 1 or bit_num > 8:
        raise ValueError(f"ds_quantizer: bit_num must be in 1..8, got {bit_num}")
    n = input.numel()
    if groups < 1 or n % groups:
        raise ValueError(f"ds_quantizer: groups={groups} must divide input.numel()={n}")
    x = input.detach().float().reshape(groups, -1)

    def _round(v):
        if sr:
            return torch.floor(v + torch.rand_like(v))
        return torch.round(v)

    if asym:
        lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        step = (hi - lo) / (2 ** bit_num - 1)
        step = torch.where(step > 0, step, torch.ones_like(step))
        q = _round((x - lo) / step).clamp_(0, 2 ** bit_num - 1)
        deq = q * step + lo
    else:
        qmax = max(1, 2 ** (bit_num - 1) - 1)
        absmax = x.abs().amax(dim=1, keepdim=True)
        step = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
        deq = _round(x / step).clamp_(-qmax, qmax) * step
    with torch.no_grad():
        input.copy_(deq.reshape(input.shape).to(input.dtype))
    return input
