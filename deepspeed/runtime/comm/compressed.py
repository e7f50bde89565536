"""Compressed all-reduce with error feedback (the two-stage scheme of the 1-bit Adam paper,
Tang et al. 2021, arXiv:2102.02888), on plain ``torch.distributed`` collectives.

``CompressedBackend(group).compressed_allreduce(buffer, worker_error, server_error)``
returns the average of ``buffer`` over the ranks of ``group`` as every rank reconstructs
it from 1-bit messages:

1. *worker*: ``x = pad(buffer) + worker_error``; ``s = ||x|| / sqrt(numel)``;
   ``worker_error = x - s * sign(x)``; the signs (``x >= 0`` is +1) are packed 8 per
   byte and split into ``world_size`` equal chunks; chunk ``j`` goes to rank ``j``
   (``all_to_all_single``), the scale to everyone (``all_gather``).
2. *server*: rank ``j`` averages what it received for its chunk,
   ``m = sum_i s_i * sign_i / N``, adds its ``server_error``, compresses again with one
   scale for the chunk (``server_error`` keeps the remainder), and every rank gathers
   all chunks' signs and scales (``all_gather``) and unpacks them.

Per rank and step that is ``2 * (N-1)/N * numel/8`` bytes on the wire (plus ``2N`` scales)
instead of ``2 * (N-1)/N * 4 * numel`` for a ring all-reduce in fp32: 32x less.

Buffers: ``worker_error`` has the padded length (a multiple of ``8 * world_size``,
:func:`padded_numel`), ``server_error`` one chunk of it (``padded // world_size``); both
fp32, zeros to start. Bit packing is vectorised torch (shifts and a sum over the last
dimension), big-endian within a byte like ``numpy.packbits``. Works with gloo, NCCL, or
any backend that has ``all_to_all_single`` and ``all_gather_into_tensor``.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from ... import comm as ds_comm

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)
# Eight 0/1 bytes read as one little-endian int64 times _GATHER: the top byte holds them as
# bits, first byte in the most significant bit (every partial product lands on its own bit,
# so nothing carries). One packed byte times _SPREAD puts bit 7-k at bit 8k+7 (byte k), the
# inverse. Products wrap modulo 2**64, as integer multiplication does on CPU and GPU.
_GATHER = sum(1 << (63 - 9 * k) for k in range(8)) - (1 << 64)
_SPREAD = sum(1 << (9 * k) for k in range(8)) - (1 << 64)
_LOW_BITS = 0x0101010101010101
_LITTLE = sys.byteorder == "little"


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size`` (whole bytes per chunk)."""
    unit = 8 * world_size
    return ((numel + unit - 1) // unit) * unit


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of ``x`` (``x >= 0`` -> bit 1) packed 8 per byte, first element in the most
    significant bit (``numpy.packbits`` order). ``x.numel()`` must be a multiple of 8."""
    n = x.numel()
    if n % 8:
        raise ValueError(f"pack_signs: numel {n} is not a multiple of 8 (pad with padded_numel first).")
    return _pack_bits(x.reshape(-1).ge(0))


def unpack_signs(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: +1/-1 values of ``dtype``, 8 per byte."""
    return _unpack_bits(packed).to(dtype).mul_(2).sub_(1)


def _signed_scale(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * sign`` from the bool tensor ``x >= 0``, as ``2s*bit - s``: exactly +-s
    (doubling and ``2s - s`` round nothing)."""
    return bits.view(torch.uint8).to(torch.float32).mul_(scale * 2).sub_(scale)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """:func:`pack_signs` from the bool tensor ``x >= 0``."""
    if _LITTLE:
        words = bits.view(torch.uint8).view(torch.int64)
        return (words * _GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF).to(torch.uint8)
    b = bits.to(torch.uint8).reshape(-1, 8)
    return (b << _SHIFTS.to(b.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """0/1 bytes, 8 per packed byte (inverse of :func:`_pack_bits`)."""
    if _LITTLE:
        return packed.reshape(-1).to(torch.int64).mul_(_SPREAD).bitwise_right_shift_(7).bitwise_and_(
            _LOW_BITS).view(torch.uint8)
    return ((packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1).reshape(-1)


_SIGN_LUT = None


def _sign_lut(device) -> torch.Tensor:
    """(256, 8) fp32: the +-1 signs of every byte value, most significant bit first."""
    global _SIGN_LUT
    if _SIGN_LUT is None:
        byte = torch.arange(256, dtype=torch.int64).reshape(256, 1)
        _SIGN_LUT = ((byte >> torch.arange(7, -1, -1)) & 1).to(torch.float32).mul_(2).sub_(1)
    return _SIGN_LUT.to(device)


def _scaled_signs(packed: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) fp32 of ``+-scales[row]`` from ``rows`` packed rows: one table lookup per
    byte in a per-row table of scaled signs (exact: +-1 times s)."""
    tables = (_sign_lut(packed.device).unsqueeze(0) * scales.reshape(rows, 1, 1)).reshape(rows * 256, 8)
    idx = packed.reshape(rows, cols // 8).to(torch.int64)
    idx += (torch.arange(rows, device=packed.device) * 256).reshape(rows, 1)
    return tables.index_select(0, idx.reshape(-1)).reshape(rows, cols)


def wire_bytes(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective whose per-rank input is ``nbytes``, with the
    usual algorithms (ring all-reduce / all-gather, pairwise all-to-all). Used to count
    the 1-bit collectives and the fp32 all-reduce they replace on the same terms."""
    n = world_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op == "all_gather":
        return float((n - 1) * nbytes)
    if op == "all_to_all":
        return (n - 1) / n * nbytes
    raise ValueError(f"wire_bytes: unknown op {op!r}")


class CompressedBackend:
    """1-bit compressed all-reduce over any ``torch.distributed`` process group.

    ``mpu``: an object with ``get_data_parallel_group()`` (DeepSpeed's signature); or
    ``group``: the process group itself; neither: the whole world. Counts its collective
    calls (``calls``) and the bytes it puts on the wire (``bytes_sent``, see
    :func:`wire_bytes`)."""

    name = "compressed"

    def __init__(self, mpu=None, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: torch.distributed is not initialised; call "
                               f"deepspeed.init_distributed() (or deepspeed.initialize) first.")
        if group is None and mpu is not None:
            group = mpu.get_data_parallel_group()
        self.world_group = group
        self.size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.calls: Counter = Counter()
        self.bytes_sent = 0.0
        self._check_group()

    def _check_group(self) -> None:
        """Subclasses refuse groups they cannot serve."""

    def _count(self, op: str, t: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes_sent += wire_bytes(op, t.numel() * t.element_size(), self.size)

    # -- the two collectives (MpiBackend replaces them) --------------------------------------
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._count("all_to_all", inp)
        ds_comm.all_to_all_single(out, inp, group=self.world_group)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._count("all_gather", inp)
        ds_comm.all_gather_into_tensor(out, inp, group=self.world_group)

    # -- the algorithm ----------------------------------------------------------------------
    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor,
                             server_error: torch.Tensor, local_rank: Optional[int] = None) -> torch.Tensor:
        """The average of ``buffer_m`` over the group, reconstructed from 1-bit messages.
        ``worker_error``/``server_error`` are updated in place. ``local_rank`` is accepted
        for DeepSpeed's signature (the device is the buffer's). Returns a new tensor of
        ``buffer_m``'s shape and dtype; ``buffer_m`` is not modified."""
        n, size = buffer_m.numel(), self.size
        padded = worker_error.numel()
        if padded % (8 * size) or padded < n:
            raise ValueError(f"compressed_allreduce: worker_error has {padded} elements; it needs "
                             f"padded_numel({n}, {size}) = {padded_numel(n, size)}.")
        chunk = padded // size
        if server_error.numel() != chunk:
            raise ValueError(f"compressed_allreduce: server_error has {server_error.numel()} elements; "
                             f"it needs {chunk} (worker_error's length / world size).")
        if n == 0:
            return buffer_m.clone()
        x = worker_error.clone()                      # padded tensor + worker error
        x[:n].add_(buffer_m.reshape(-1).to(torch.float32))
        # worker stage: one scale for the whole (padded) tensor, as DeepSpeed
        worker_scale = torch.linalg.vector_norm(x) / math.sqrt(padded)
        bits = x.ge(0)
        torch.sub(x, _signed_scale(bits, worker_scale), out=worker_error)   # x - s * sign
        send = _pack_bits(bits).reshape(size, chunk // 8)
        del x, bits
        recv = torch.empty_like(send)
        self._all_to_all(recv, send)
        scales = torch.empty(size, dtype=torch.float32, device=worker_error.device)
        self._all_gather(scales, worker_scale.reshape(1))
        # server stage: average the chunk this rank owns, compress it again
        server_m = _scaled_signs(recv, scales.mul(1.0 / size), size, chunk).sum(0)
        server_m.add_(server_error)
        server_scale = torch.linalg.vector_norm(server_m) / math.sqrt(chunk)
        bits = server_m.ge(0)
        torch.sub(server_m, _signed_scale(bits, server_scale), out=server_error)
        packed = _pack_bits(bits)
        all_signs = torch.empty(size * packed.numel(), dtype=torch.uint8, device=packed.device)
        self._all_gather(all_signs, packed)
        all_scales = torch.empty(size, dtype=torch.float32, device=packed.device)
        self._all_gather(all_scales, server_scale.reshape(1))
        out = _scaled_signs(all_signs, all_scales, size, chunk).reshape(-1)
        return out[:n].reshape(buffer_m.shape).to(buffer_m.dtype)

    def new_errors(self, numel: int, device=None):
        """Zeroed (worker_error, server_error) for a tensor of ``numel`` elements."""
        padded = padded_numel(numel, self.size)
        return (torch.zeros(padded, dtype=torch.float32, device=device),
                torch.zeros(padded // self.size, dtype=torch.float32, device=device))
