"""DeepSpeed's ``deepspeed.runtime.comm.coalesced_collectives``: the coalesced
collectives (which live in ``deepspeed/comm/coalesced.py``) and ZeRO++'s quantized
gradient reduction (qgZ).

qgZ replaces a reduce-scatter by an all-to-all of block-quantized values: each rank
cuts its full gradient into one chunk per destination rank, quantizes every chunk
(int4 by default, packed two codes per byte, one fp32 scale per block), sends chunk
``r`` to rank ``r`` and sums what it receives after dequantizing. With node groups
(DeepSpeed's ``{'local_<node>': group, 'global_<local index>': group}`` dict) the
reduction is hierarchical: an all-to-all inside the node, a local sum, one
re-quantization, then an all-to-all across nodes among the ranks with the same local
index - so only the partial sums cross nodes.

Error bound: a dequantized value differs from the sent one by at most half its block's
scale, so a reduced element is off by at most the sum of those half-scales over the
values added into it (plus, hierarchically, the re-quantization's half-scale). Every
call computes that bound per element from the scales it received and records its
maximum in :data:`last_reduce_stats` (with the bytes this rank sent).
"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist

from ...comm.coalesced import all_gather_coalesced, all_reduce_coalesced, reduce_scatter_coalesced  # noqa: F401
from ...ops.quantizer.quantizer import pack_int4, quantize_blockwise, unpack_int4

QGZ_DEFAULT_BITS = 4
QGZ_DEFAULT_BLOCK = 512

# {"sent_bytes": int, "error_bound": float} of the most recent quantized reduction on this rank.
last_reduce_stats: dict = {}


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    from ... import comm as ds_comm
    ds_comm.all_to_all_single(out, inp, group=group)


def _encode(rows: torch.Tensor, bits: int, block: int):
    """rows (k, n) -> (payload (k, m) int8/uint8, scales (k, nb) fp32); each row padded to whole blocks."""
    k, n = rows.shape
    nb = max(1, math.ceil(n / block))
    padded = torch.nn.functional.pad(rows.float(), (0, nb * block - n)) if nb * block != n else rows.float()
    codes, scales = quantize_blockwise(padded.reshape(-1), block_size=block, bits=bits)
    codes = codes.view(k, nb * block)
    if bits == 4:
        codes = pack_int4(codes).view(k, nb * block // 2)
    return codes, scales.view(k, nb)


def _decode(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """(k, m) payload + (k, nb) scales -> (k, nb*block) fp32."""
    k, nb = scales.shape
    codes = unpack_int4(payload).view(k, nb, block) if bits == 4 else payload.view(k, nb, block)
    return (codes.float() * scales.unsqueeze(2)).view(k, nb * block)


def _exchange(rows: torch.Tensor, group, bits: int, block: int, extra: torch.Tensor = None):
    """Quantize row r of ``rows`` (k, n) and send it to group rank r; returns the received
    dequantized rows (k, nb*block), their per-block half-scale bound (k, nb), the block used and the
    received ``extra`` rows (k, nb) (a per-block value that travels with the scales)."""
    k, n = rows.shape
    block = min(block, max(2, n + n % 2))    # a short row is one block, not padded to a full one
    payload, scales = _encode(rows, bits, block)
    nb = scales.shape[1]
    side = scales if extra is None else torch.cat((scales, extra.float()), dim=1)
    got_payload, got_side = torch.empty_like(payload), torch.empty_like(side)
    _all_to_all(got_payload, payload, group)
    _all_to_all(got_side, side, group)
    sent = payload.numel() * payload.element_size() + side.numel() * side.element_size()
    got_scales = got_side[:, :nb].contiguous()
    vals = _decode(got_payload, got_scales, bits, block)
    half = got_scales / 2
    got_extra = got_side[:, nb:] if extra is not None else None
    return vals, half, block, got_extra, sent


def quantized_reduce_scatter_rows(out: torch.Tensor, rows: torch.Tensor, group=None, bits: int = QGZ_DEFAULT_BITS,
                                  block_size: int = QGZ_DEFAULT_BLOCK) -> dict:
    """``out`` (n,) on group rank r receives the SUM over ranks of their ``rows[r]``
    (``rows``: (world_size, n)), sent quantized through one all-to-all. Returns (and
    records in :data:`last_reduce_stats`) the bytes sent and the error bound."""
    n = rows.shape[1]
    vals, half, _, _, sent = _exchange(rows, group, bits, block_size)
    out.copy_(vals.sum(dim=0)[:n])
    stats = {"sent_bytes": sent, "error_bound": float(half.sum(dim=0).max()) if n else 0.0}   # every block holds real elements
    last_reduce_stats.clear()
    last_reduce_stats.update(stats)
    return stats


def _hierarchical_sum(flat: torch.Tensor, chunk: int, local_group, global_group, L: int, N: int,
                      bits: int, block: int):
    """Sum over all ranks of chunk (node*L + local) of every rank's ``flat``, for this rank."""
    ws = L * N
    padded = torch.nn.functional.pad(flat.float(), (0, ws * chunk - flat.numel()))
    grid = padded.view(N, L, chunk)                         # [node n, local l] -> chunk for rank n*L+l
    # 1) inside the node: local peer l gets every node's chunk for local index l
    intra = grid.transpose(0, 1).reshape(L, N * chunk)
    vals, half, blk1, _, sent1 = _exchange(intra, local_group, bits, block)
    partial = vals.sum(dim=0)[:N * chunk].view(N, chunk)    # summed over this node's ranks
    local_bound = half.sum(dim=0).repeat_interleave(blk1)[:N * chunk].view(N, chunk)
    # 2) across nodes: node n gets this node's partial sum of its chunk (+ its bound, per block)
    block2 = min(block, max(2, chunk + chunk % 2))    # the block _exchange uses for rows of `chunk`
    nb = max(1, math.ceil(chunk / block2))
    lb = torch.nn.functional.pad(local_bound, (0, nb * block2 - chunk)).view(N, nb, block2).amax(dim=2)
    vals2, half2, _, got_lb, sent2 = _exchange(partial, global_group, bits, block, extra=lb)
    total = vals2.sum(dim=0)[:chunk]
    bound = (half2 + got_lb).sum(dim=0)       # per block of my chunk
    return total, float(bound.max()) if chunk else 0.0, sent1 + sent2


def _node_groups(groups: dict):
    """(local_group, global_group, L, N) for this rank from DeepSpeed's groups dict."""
    me = dist.get_rank()
    local = [g for k, g in groups.items() if k.startswith("local_") and dist.get_rank(g) >= 0]
    glob = [g for k, g in groups.items() if k.startswith("global_") and dist.get_rank(g) >= 0]
    if len(local) != 1 or len(glob) != 1:
        raise ValueError(f"all_to_all_quant_reduce: rank {me} must belong to exactly one 'local_<i>' and one "
                         f"'global_<j>' group of the groups dict (got keys {sorted(groups)}).")
    L, N = dist.get_world_size(local[0]), dist.get_world_size(glob[0])
    if L * N != dist.get_world_size():
        raise ValueError(f"all_to_all_quant_reduce: node size {L} x nodes {N} != world size {dist.get_world_size()}")
    return local[0], glob[0], L, N


@torch.no_grad()
def all_to_all_quant_reduce(tensors: List[torch.Tensor], groups=None, bits: int = QGZ_DEFAULT_BITS,
                            block_size: int = QGZ_DEFAULT_BLOCK) -> List[torch.Tensor]:
    """qgZ: for each full gradient in ``tensors``, this rank's partition of the AVERAGE over
    ranks (the same partition :func:`reduce_scatter_coalesced` returns: ``ceil(numel/world)``
    elements per rank, the last rank's narrowed), reduced through quantized all-to-all.

    ``groups``: ``None`` (the world), a process group (one level), or DeepSpeed's dict of
    ``'local_<node>'`` / ``'global_<local index>'`` groups (hierarchical, two levels; one node
    is one level). Error bound and bytes sent: :data:`last_reduce_stats`."""
    if isinstance(groups, dict):
        local_g, global_g, L, N = _node_groups(groups)
        ws = L * N
        me = dist.get_rank(local_g) + L * dist.get_rank(global_g)
    else:
        ws = dist.get_world_size(groups) if dist.is_initialized() else 1
        me = dist.get_rank(groups) if dist.is_initialized() else 0
        local_g, N = groups, 1
    outs, bound, sent = [], 0.0, 0
    for t in tensors:
        flat = t.reshape(-1)
        chunk = math.ceil(flat.numel() / ws)
        mine = max(0, min(chunk, flat.numel() - me * chunk))
        if ws == 1:
            outs.append(flat.clone())
            continue
        if N == 1:
            rows = torch.nn.functional.pad(flat.float(), (0, ws * chunk - flat.numel())).view(ws, chunk)
            res = torch.empty(chunk, dtype=torch.float32, device=t.device)
            st = quantized_reduce_scatter_rows(res, rows, local_g, bits, block_size)
            b, s = st["error_bound"], st["sent_bytes"]
        else:
            res, b, s = _hierarchical_sum(flat, chunk, local_g, global_g, L, N, bits, block_size)
        outs.append((res[:mine] / ws).to(t.dtype))
        bound, sent = max(bound, b / ws), sent + s
    last_reduce_stats.clear()
    last_reduce_stats.update({"sent_bytes": sent, "error_bound": bound})
    return outs
