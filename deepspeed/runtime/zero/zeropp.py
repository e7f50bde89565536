"""ZeRO++ communication for stage 3: quantized weight all-gather (qwZ) and quantized
gradient reduction (qgZ), on PyTorch ops and ``torch.distributed`` (gloo and NCCL).

Stage 3 issues its model-state collectives through one :class:`~.stage3_comm.CheckedComm`
per data-parallel group (``all_gather_into`` for parameters, ``reduce_scatter_rows`` for
gradient buckets). :func:`wrap_comm` is called once when the strategy is built: with
``zero_quantized_weights`` / ``zero_quantized_gradients`` set, it returns a
:class:`QuantizedComm` that shares everything with the checked communicator (headers,
sequence numbers, names) and replaces exactly those two collectives - the choice is
made once, here, not on every call.

* qwZ: each rank quantizes its partition to int8 blocks (``weight_block_size`` elements,
  one fp32 scale each), all-gathers codes and scales, and dequantizes into the full
  parameter on arrival (in ``wait()`` when the gather is asynchronous). Wire bytes:
  1 byte per element + 4 per block, vs 4 (fp32) or 2 (bf16/fp16).
* qgZ: gradient buckets reduced by an all-to-all of int4 blocks
  (:func:`deepspeed.runtime.comm.coalesced_collectives.quantized_reduce_scatter_rows`).

Full-precision gathers are kept where exactness matters: :func:`exact_gathers` switches a
communicator back to the plain all-gather for its duration (the engine uses it for the
16-bit state dict and for the parameters kept whole).
"""
from __future__ import annotations

import contextlib

import torch

from ... import comm as ds_comm
from ...ops.quantizer.quantizer import quantize_blockwise
from ..comm.coalesced_collectives import QGZ_DEFAULT_BITS, QGZ_DEFAULT_BLOCK, quantized_reduce_scatter_rows

QWZ_DEFAULT_BLOCK = 2048


class ZeroPPStats:
    """Bytes this rank put into the model-state collectives, and the largest error bounds."""

    def __init__(self):
        self.gather_bytes = 0          # qwZ: codes + scales
        self.gather_full_bytes = 0     # what the same gathers would have sent unquantized
        self.reduce_bytes = 0          # qgZ: codes + scales
        self.reduce_full_bytes = 0
        self.weight_error_bound = 0.0  # max over gathered blocks of scale/2
        self.grad_error_bound = 0.0    # max over reduced elements of the summed half-scales

    def as_dict(self) -> dict:
        return dict(vars(self))


class _DequantizeOnWait:
    """The handle of an asynchronous quantized gather: wait() finishes it and dequantizes."""

    def __init__(self, works, finish):
        self.works, self.finish = works, finish

    def wait(self):
        for w in self.works:
            if w is not None:
                w.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self):
        return self.finish is None


class QuantizedComm:
    """A :class:`CheckedComm` whose parameter gather and/or gradient reduce are quantized;
    every other attribute is the wrapped communicator's."""

    def __init__(self, base, weights: bool, gradients: bool, weight_block: int = QWZ_DEFAULT_BLOCK,
                 grad_bits: int = QGZ_DEFAULT_BITS, grad_block: int = QGZ_DEFAULT_BLOCK):
        object.__setattr__(self, "_base", base)
        self.stats = ZeroPPStats()
        self.weight_block, self.grad_bits, self.grad_block = weight_block, grad_bits, grad_block
        self._quant_gather = self._quantized_all_gather_into if weights else base.all_gather_into
        self.all_gather_into = self._quant_gather
        self.reduce_scatter_rows = self._quantized_reduce_scatter_rows if gradients else base.reduce_scatter_rows
        self.reduce_in_place = base.reduce_in_place and not gradients   # qgZ has its own reduce

    def reduce_rows(self, rows: torch.Tensor, async_op: bool = False):
        """:meth:`CheckedComm.reduce_rows`, through the quantized reduce-scatter with qgZ."""
        if self.reduce_in_place:
            return self._base.reduce_rows(rows, async_op)
        out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        return out, self.reduce_scatter_rows(out, rows, async_op=async_op)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_base"), name)

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self):
        return self._base.__getstate__()

    # -- qwZ ---------------------------------------------------------------------------
    def _quantized_all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        base = self._base
        if not base.active:
            out.copy_(inp.reshape(out.shape))
            return None
        ws, s = base.world_size, inp.numel()
        codes, scales = quantize_blockwise(inp, min(self.weight_block, max(1, s)), bits=8)
        nb, blk = codes.shape
        all_codes = torch.empty((ws * nb, blk), dtype=torch.int8, device=inp.device)
        all_scales = torch.empty(ws * nb, dtype=torch.float32, device=inp.device)
        w1 = ds_comm.all_gather_into_tensor(all_codes, codes, group=base.group, async_op=async_op)
        w2 = ds_comm.all_gather_into_tensor(all_scales, scales, group=base.group, async_op=async_op)
        st = self.stats
        st.gather_bytes += codes.numel() + scales.numel() * 4
        st.gather_full_bytes += s * inp.element_size()

        def finish():
            deq = (all_codes.view(ws, nb, blk).float() * all_scales.view(ws, nb, 1)).view(ws, nb * blk)[:, :s]
            out.view(ws, s).copy_(deq)
            st.weight_error_bound = max(st.weight_error_bound, float(all_scales.max()) / 2)

        if async_op:
            return _DequantizeOnWait([w1, w2], finish)
        finish()
        return None

    @contextlib.contextmanager
    def exact(self):
        """Plain (unquantized) parameter gathers inside the block."""
        self.all_gather_into = self._base.all_gather_into
        try:
            yield
        finally:
            self.all_gather_into = self._quant_gather

    # -- qgZ ---------------------------------------------------------------------------
    def _quantized_reduce_scatter_rows(self, out: torch.Tensor, rows: torch.Tensor, async_op: bool = False):
        base = self._base
        if not base.active:
            out.copy_(rows[0])
            return None
        res = torch.empty(out.numel(), dtype=torch.float32, device=out.device)
        info = quantized_reduce_scatter_rows(res, rows, base.group, self.grad_bits, self.grad_block)
        out.copy_(res)
        st = self.stats
        st.reduce_bytes += info["sent_bytes"]
        st.reduce_full_bytes += rows.numel() * rows.element_size()
        st.grad_error_bound = max(st.grad_error_bound, info["error_bound"])
        return None


def wrap_comm(comm, zero_config, weights: bool = False):
    """The communicator stage 3 uses: ``comm`` itself, or a :class:`QuantizedComm` over it
    when the config (or ``weights``: ``zero.Init(zero_quantized_weights=True)``) asks for qwZ
    and/or qgZ."""
    w = bool(zero_config.zero_quantized_weights) or bool(weights)
    g = bool(zero_config.zero_quantized_gradients)
    if not (w or g):
        return comm
    return QuantizedComm(comm, weights=w, gradients=g)


def exact_gathers(comm):
    """A context in which ``comm``'s parameter gathers are full precision (a no-op for an
    unquantized communicator)."""
    return comm.exact() if isinstance(comm, QuantizedComm) else contextlib.nullcontext()


def zeropp_stats(comm):
    """The :class:`ZeroPPStats` of a quantized communicator, else None."""
    return comm.stats if isinstance(comm, QuantizedComm) else None



def local_all_to_all_groups(node_size: int) -> dict:
    """DeepSpeed's qgZ group dict (``deepspeed.utils.groups._get_local_all_to_all_group``):
    ``'local_<i>'`` = the ranks of node ``i`` (``node_size`` consecutive ranks) and
    ``'global_<j>'`` = the ranks with local index ``j`` on every node. Collective: every rank
    creates every group, in the same order."""
    import torch.distributed as dist
    ws = dist.get_world_size()
    if node_size < 1 or ws % node_size:
        raise ValueError(f"local_all_to_all_groups: node_size={node_size} must divide the world size {ws}")
    nodes = ws // node_size
    groups = {}
    for i in range(nodes):
        groups[f"local_{i}"] = dist.new_group(list(range(i * node_size, (i + 1) * node_size)))
    for j in range(node_size):
        groups[f"global_{j}"] = dist.new_group([n * node_size + j for n in range(nodes)])
    return groups
