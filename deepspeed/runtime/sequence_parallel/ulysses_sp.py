"""ALST (Arctic Long Sequence Training) for Hugging Face Transformers models.

* :class:`UlyssesSPAttentionHF` - Ulysses attention as a Transformers attention function:
  ``register_with_transformers`` replaces the model's attention implementation (``"sdpa"``,
  ``"flash_attention_2"``, ...) in ``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS`` with
  a wrapper that all-to-alls q/k/v from sequence-sharded ``[b, h, s/P, d]`` to head-sharded
  ``[b, h/P, s, d]``, calls the original function on the whole sequence, and all-to-alls the
  result back. It returns the sequence-parallel ``mpu`` to pass to ``deepspeed.initialize``.
* :class:`UlyssesSPDataLoaderAdapter` - wraps a DataLoader: each step, the ranks of a
  sequence-parallel group exchange their batches and each takes its slice of the sequence of
  one of them (``labels`` become pre-shifted ``shift_labels``, so no label is lost at a shard
  boundary).
* Tiled computations that trade a re-computation for memory, for long sequences:
  :class:`TiledMLP`, :class:`TiledFusedLogitsLoss`, :class:`SequenceTiledCompute` /
  :func:`sequence_tiled_compute`, :class:`TiledLoss`.

Loss over a sharded sequence: each rank holds ``S/P`` tokens. The engine sums gradients over
the sequence ranks (DeepSpeed's rule, see ``engine_groups``), so each rank should back-propagate
*its share* of the full-sequence loss: ``sum(local token losses) / total_tokens_of_the_sequence``
(with the token count all-reduced over the group, without gradient). Its value summed over the
group is the full-sequence mean. DeepSpeed's tutorial instead averages the per-rank losses with a
*differentiable* ``torch.distributed.nn.functional.all_gather``: the loss value is the
full-sequence mean on every rank, but the all-gather's backward sums the P identical copies,
so with DeepSpeed's reduction the gradients come out P times the full-sequence gradient (Adam
is almost insensitive to that scale; gradient clipping and reported norms are not).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from typing import Any, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ...sequence.layer import single_all_to_all, _SeqAllToAll
from ...utils.logging import logger

_TRANSFORMERS_MIN = "4.51.3"


class UlyssesSPAttentionHF(torch.nn.Module):
    """Ulysses attention around a Transformers attention function ``attn``.

    ``forward(module, query, key, value, attention_mask, *args, **kwargs)`` takes q/k/v as
    Transformers passes them, ``[batch, heads, local_seq, head_dim]``, and returns
    ``(attn_output [batch, local_seq, heads, head_dim], attn_weights)``. ``position_ids`` must
    be in ``kwargs`` (this rank's global positions); they are gathered so the attention sees
    the positions of the whole sequence. Heads must divide evenly: ``attn_head_count`` by the
    group size, and ``kv_head_count`` by it or it by ``kv_head_count`` (then k/v heads are
    replicated).
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int = None, global_seq_length: int = None, disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation = None
        ws = self.world_size
        if attn_head_count % ws:
            raise ValueError(f"UlyssesSPAttentionHF: the attention head count {attn_head_count} is not divisible by the "
                             f"sequence-parallel size {ws}; choose a sequence_parallel_size that divides it.")
        if kv_head_count % ws and ws % kv_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: the key/value head count {kv_head_count} and the sequence-parallel "
                             f"size {ws} must divide one another.")
        self.kv_replication_factor = ws // kv_head_count if kv_head_count < ws else 1
        self.local_q_head_count = attn_head_count // ws
        self.local_kv_head_count = 1 if self.kv_replication_factor > 1 else kv_head_count // ws
        from importlib.metadata import version as _version
        from packaging.version import Version
        have = _version("transformers")
        if Version(have) < Version(_TRANSFORMERS_MIN):
            raise ValueError(f"transformers>={_TRANSFORMERS_MIN} is required, but you have transformers=={have}")

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                *args: Any, **kwargs: Any) -> Tuple[Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if query.dim() != 4 or query.shape[1] != self.attn_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: query must be [batch, {self.attn_head_count} heads, local_seq, "
                             f"head_dim], got {tuple(query.shape)}.")
        local = query.shape[2]
        if not self.seq_length_is_variable and local != self.local_seq_length:
            raise ValueError(f"UlyssesSPAttentionHF: local sequence length {local} differs from the registered "
                             f"{self.local_seq_length} (seq_length_is_variable=False).")
        self.local_seq_length, self.global_seq_length = local, local * self.world_size
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every forward: each rank's global "
                             "token positions (UlyssesSPDataLoaderAdapter puts them in the batch). Without them each "
                             "rank would number its shard from 0 and the gathered sequence would read as packed "
                             "documents.")
        pos = kwargs["position_ids"].contiguous()
        parts = [torch.empty_like(pos) for _ in range(self.world_size)]
        dist.all_gather(parts, pos, group=self.process_group)
        kwargs["position_ids"] = torch.cat(parts, dim=-1)
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        g = self.process_group
        q = _SeqAllToAll.apply(g, query.contiguous(), 1, 2)       # [b, h/P, s, d]
        k = _SeqAllToAll.apply(g, key.contiguous(), 1, 2)
        v = _SeqAllToAll.apply(g, value.contiguous(), 1, 2)
        if self.kv_replication_factor > 1:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        out, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [b, s, h/P, d]
        out = _SeqAllToAll.apply(g, out.contiguous(), 1, 2)      # [b, s/P, h, d]
        return out, weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None):
        """Put Ulysses attention behind ``core_attn_implementation`` in Transformers and return
        the sequence-parallel mpu for ``deepspeed.initialize(mpu=...)``; ``None`` when
        ``sequence_parallel_size`` is 1. Call it before the model's first forward (before
        ``from_pretrained``/``from_config`` when passing a name). ``model_name_or_path``: a
        model (anything with ``.config``) or a name/path for ``AutoConfig``."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: 'max_length' is deprecated, use 'seq_length'.")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: pass seq_length (the fixed sequence length) or "
                             "seq_length_is_variable=True.")
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise ValueError(f"register_with_transformers: seq_length {seq_length} must be divisible by "
                             f"sequence_parallel_size {sequence_parallel_size}.")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from . import parallel_state_sp as mpu
        mpu.initialize_sequence_parallel(sequence_parallel_size)
        if hasattr(model_name_or_path, "config"):
            hf_config = model_name_or_path.config
        else:
            hf_config = AutoConfig.from_pretrained(model_name_or_path)
        have = getattr(hf_config, "_attn_implementation", None)
        if have is not None and have != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                             f"attn_implementation='{have}'. Set both to the same value so the sequence-parallel "
                             f"wrapper intercepts the attention the model uses.")
        if core_attn_implementation in ("eager", "paged|eager"):
            raise ValueError(f"{core_attn_implementation} attn_implementation is not supported by Ulysses sequence "
                             f"parallelism: it needs a 4D attention_mask (O(n^2) memory). Use 'sdpa', "
                             f"'flex_attention' or a flash attention variant.")
        if isinstance(core_attn_implementation, str) and \
                re.search(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$", core_attn_implementation):
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
            lazy_import_flash_attention(core_attn_implementation)   # hub kernels register lazily
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation} is not a valid attn_implementation. The choices are "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        core = getattr(core, "_ulysses_core", core)   # registering twice wraps the original once
        arch = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        sp = mpu.get_sequence_parallel_world_size()
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=arch.num_attention_heads,
                    attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads,
                    kv_head_count=getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads,
                    num_hidden_layers=arch.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length_is_variable else seq_length // sp,
                    global_seq_length=None if seq_length_is_variable else seq_length,
                    disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            # Transformers built attention_mask for the local shard; after the all-to-all it would be
            # wrong (and a full 4D mask is O(n^2)): causality comes from is_causal / position_ids.
            keep = False
            if core_attn_implementation == "flex_attention":
                from torch.nn.attention.flex_attention import BlockMask
                keep = isinstance(attention_mask, BlockMask)
            return uattn(module, query, key, value, attention_mask if keep else None, *args, **kwargs)

        uattn_wrapper._ulysses_core = core
        uattn_wrapper._ulysses_attention = uattn
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return mpu


class UlyssesSPDataLoaderAdapter:
    """Shards the batches of ``dl`` on the sequence dimension for a sequence-parallel group.

    Each refill takes one batch from this rank's ``dl`` and exchanges batches inside the group;
    then the next ``sp_world_size`` steps return, on rank ``r``, slice ``r`` of the group's
    batch 0, 1, ... in turn, so every rank's batch is processed by the whole group. Tensors are
    ``[batch, seq, ...]`` and are sliced on dim 1 (non-tensors are copied); ``labels`` are
    replaced by ``shift_labels`` (shifted left over the *whole* sequence, -100 at the end);
    ``position_ids`` are required. The sequence length must be divisible by the group size.
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self):
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self):
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)   # the next epoch starts afresh
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses sequence parallelism needs 'position_ids' in every dataloader batch so that "
                             "each token keeps its global position after sequence sharding (non-packed: "
                             "torch.arange(seq_len) per sample; packed: reset at document boundaries).")
        ws, group = self.sp_world_size, self.sp_group
        seqlen = batch["input_ids"].shape[1]
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(ws)]
        dist.all_gather(lens, torch.tensor([seqlen], dtype=torch.int64), group=group)
        lens = [int(t.item()) for t in lens]
        per_rank = defaultdict(dict)
        for k, v in batch.items():
            if torch.is_tensor(v):
                if v.shape[1] != seqlen:
                    raise ValueError(f"{k}'s shape {tuple(v.shape)} must match input_ids's shape "
                                     f"{tuple(batch['input_ids'].shape)} in the sequence dimension.")
                v = v.contiguous()
                parts = [torch.empty((v.shape[0], lens[i]) + tuple(v.shape[2:]), dtype=v.dtype) for i in range(ws)]
                dist.all_gather(parts, v.cpu(), group=group)
            else:
                parts = [None] * ws
                dist.all_gather_object(parts, v, group=group)
            for r, t in enumerate(parts):
                per_rank[r][k] = t
        for r in range(ws):
            b = per_rank[r]
            n = b["input_ids"].shape[1]
            if n % ws:
                raise ValueError(f"batch's seqlen={n} isn't divisible by sp-size={ws}")
            chunk = n // ws
            if "labels" in b:
                labels = torch.nn.functional.pad(b.pop("labels"), (0, 1), value=-100)
                b["shift_labels"] = labels[..., 1:].contiguous()
            for k, v in b.items():
                if torch.is_tensor(v):
                    b[k] = v[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)].contiguous()
            self.micro_batches.append(b)


# ---------------------------------------------------------------- tiled computation
def _mark_grad_ready(params, ready: bool) -> None:
    """DeepSpeed's ``ds_grad_is_ready`` flag on the parameters a tiled backward touches once per
    tile (DeepSpeed's ZeRO reduces a gradient only after its last tile)."""
    for p in params or ():
        p.ds_grad_is_ready = ready


class _TileGrads:
    """Back-propagates tile after tile so that each of ``compute_params`` receives its gradient
    **once**: the tiles before the last use ``torch.autograd.grad`` and keep the parameter
    gradients here; before the last tile's ``backward`` they are added to ``.grad``, so the
    post-accumulate hooks ZeRO reduces on fire once, with the whole gradient (reducing a
    bucket after the first tile would miss the others). Without ``compute_params`` every tile
    is an ordinary ``backward``."""

    def __init__(self, params):
        self.params = [p for p in (params or []) if p.requires_grad]
        self.acc = [None] * len(self.params)

    def backward(self, out, grad, inputs, last: bool):
        """Back-propagate ``grad`` through ``out``; returns the gradients of ``inputs``."""
        inputs = [t for t in inputs if t is not None and t.requires_grad]
        if not self.params or last:
            if last:
                for p, a in zip(self.params, self.acc):
                    if a is not None:
                        p.grad = a if p.grad is None else p.grad.add_(a)
                self.acc = [None] * len(self.params)
            torch.autograd.backward(out, grad)
            return [t.grad for t in inputs]
        gs = torch.autograd.grad(out, inputs + self.params, grad, allow_unused=True)
        for j, g in enumerate(gs[len(inputs):]):
            if g is not None:
                self.acc[j] = g if self.acc[j] is None else self.acc[j].add_(g)
        return list(gs[:len(inputs)])


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` computed in
    ``shards`` slices of ``x`` along the second-to-last (sequence) dimension. The forward keeps
    no intermediate activations (only ``x``); the backward recomputes each slice and
    back-propagates it, so peak memory holds one slice's intermediates."""

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params) -> Tensor:
        ctx.fn, ctx.self, ctx.shards = fn, self, shards
        ctx.compute_params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.save_for_backward(x)
        with torch.no_grad():
            out = [fn(self, xs) for xs in torch.chunk(x, chunks=shards, dim=-2)]
        return torch.cat(out, dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach()
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        xs = torch.chunk(x, chunks=ctx.shards, dim=-2)
        gs = torch.chunk(grad_out, chunks=ctx.shards, dim=-2)
        off, sink = 0, _TileGrads(ctx.compute_params)
        for i, (x_i, g_i) in enumerate(zip(xs, gs)):
            last = i + 1 == len(xs)
            _mark_grad_ready(ctx.compute_params, last)
            x_i = x_i.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.self, x_i)
            got = sink.backward(out, g_i, [x_i], last)
            if x_grad is not None:
                x_grad.narrow(-2, off, x_i.shape[-2]).copy_(got[0])
            off += x_i.shape[-2]
        return None, None, x_grad, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``:
    the loss ``fn(self, x_shard, y_shard[, mask_shard])`` over ``shards`` slices of the flattened
    ``[batch*seq]`` tokens, never holding the full logits. The backward of each slice runs inside
    the forward (the loss is the last op), scaled for ``output_reduction`` ("mean" of the slice
    losses, or "sum"); the returned gradient of ``x`` is multiplied by the incoming one."""

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction) -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must be at least 2D [batch_size, seq_len, ...]")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError("x and y batch/seq dims must match")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError("mask must be [batch_size, seq_len], matching x and y")
        params = [p for p in (compute_params or []) if p.requires_grad]
        need_x = x.requires_grad
        bs, seqlen = x.shape[:2]
        xf = x.detach().reshape(-1, *x.shape[2:])
        yf = y.reshape(-1, *y.shape[2:])
        mf = mask.reshape(-1) if mask is not None else None
        scale = 1.0 / shards if output_reduction == "mean" else 1.0
        x_grad = torch.zeros_like(xf) if need_x else None
        xs, ys = torch.chunk(xf, shards, dim=0), torch.chunk(yf, shards, dim=0)
        ms = torch.chunk(mf, shards, dim=0) if mf is not None else [None] * len(xs)
        losses, off, sink = [], 0, _TileGrads(params)
        for i, (x_i, y_i, m_i) in enumerate(zip(xs, ys, ms)):
            last = i + 1 == len(xs)
            _mark_grad_ready(params, last)
            x_i = x_i.detach().requires_grad_(need_x)
            args = (self, x_i, y_i) + ((m_i,) if m_i is not None else ())
            with torch.enable_grad():
                loss_i = fn(*args)
            if need_x or params:
                got = sink.backward(loss_i, torch.full_like(loss_i, scale), [x_i], last)
                if need_x:
                    x_grad.narrow(0, off, x_i.shape[0]).copy_(got[0])
            off += x_i.shape[0]
            losses.append(loss_i.detach())
        stacked = torch.stack(losses)
        if need_x:
            ctx.save_for_backward(x_grad.view(bs, seqlen, *x.shape[2:]))
        else:
            ctx.save_for_backward(None)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, grad):
        (x_grad,) = ctx.saved_tensors
        if x_grad is not None:
            x_grad = x_grad * grad
        return None, None, x_grad, None, None, None, None, None


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """Call ``fn(**shard_of(kwargs_to_shard), **kwargs_to_pass)`` on ``shards`` slices of the
    sequence (dim 1 of every ``kwargs_to_shard`` value), concatenate the outputs on
    ``output_unshard_dimension`` (0: scalar outputs are stacked) and reduce them
    (``None``, ``"mean"`` or ``"sum"``). Only ``kwargs_to_shard[grad_requiring_tensor_key]``
    receives a gradient (plus any parameters ``fn`` uses); the backward recomputes each slice."""
    keys_to_shard, keys_to_pass = list(kwargs_to_shard), list(kwargs_to_pass)
    return SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction,
                                      *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (DeepSpeed's name)."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, *args) -> Tensor:
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
        keys = list(keys_to_shard) + list(keys_to_pass)
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} must be one of kwargs_to_shard "
                             f"({list(keys_to_shard)}).")
        ctx.fn, ctx.shards, ctx.key = fn, shards, grad_requiring_tensor_key
        ctx.params = [p for p in (compute_params or []) if p.requires_grad]
        ctx.unshard_dim, ctx.reduction = output_unshard_dimension, output_reduction
        ctx.total_args, ctx.key_index = len(args), keys.index(grad_requiring_tensor_key)
        ctx.to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        ctx.to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        ctx.step = step
        outs = []
        with torch.no_grad():
            for i in range(shards):
                sl = {k: v[:, i * step:(i + 1) * step] for k, v in ctx.to_shard.items()}
                outs.append(fn(**sl, **ctx.to_pass))
        if output_unshard_dimension == 0:
            out = torch.stack([o.reshape(()) if o.numel() == 1 else o for o in outs], dim=0)
        else:
            out = torch.cat(outs, dim=output_unshard_dimension)
        ctx.n_out = len(outs)
        if output_reduction == "mean":
            return out.mean()
        if output_reduction == "sum":
            return out.sum()
        return out

    @staticmethod
    def backward(ctx, grad):
        src = ctx.to_shard[ctx.key]
        need = src.requires_grad
        src_grad = torch.zeros_like(src) if need else None
        if ctx.reduction == "mean":
            grad = grad / ctx.n_out
        step = ctx.step
        n = src.shape[1]
        sink = _TileGrads(ctx.params)
        for i in range(ctx.n_out):
            last = i + 1 == ctx.n_out
            _mark_grad_ready(ctx.params, last)
            lo, hi = i * step, min((i + 1) * step, n)
            sl = {k: v[:, lo:hi] for k, v in ctx.to_shard.items()}
            sl[ctx.key] = sl[ctx.key].detach().requires_grad_(need)
            with torch.enable_grad():
                out = ctx.fn(**sl, **ctx.to_pass)
            if ctx.reduction is not None:
                g = grad.expand_as(out) if out.dim() else grad
            elif ctx.unshard_dim == 0:
                g = grad[i].reshape(out.shape)
            else:
                g = grad.narrow(ctx.unshard_dim, lo, hi - lo).reshape(out.shape)
            got = sink.backward(out, g, [sl[ctx.key]], last)
            if need:
                src_grad[:, lo:hi].copy_(got[0])
        outs = [None] * 9 + [None] * ctx.total_args
        outs[9 + ctx.key_index] = src_grad
        return tuple(outs)


class TiledLoss(torch.autograd.Function):
    """``TiledLoss.apply(loss_fn, logits, vocab_size, shift_labels, shards)``: a Transformers
    ``loss_function(logits=, labels=None, vocab_size=, shift_labels=)`` computed over
    ``shards`` slices of the sequence and combined as the mean over the labelled tokens (slices
    whose labels are all -100 are skipped). The backward recomputes each slice."""

    @staticmethod
    def forward(ctx, loss_fn, logits, vocab_size, shift_labels, shards) -> Tensor:
        ctx.save_for_backward(logits, shift_labels)
        ctx.loss_fn, ctx.vocab_size, ctx.shards = loss_fn, vocab_size, shards
        total, count = logits.new_zeros((), dtype=torch.float32), 0
        with torch.no_grad():
            for lg, lb in zip(torch.chunk(logits, shards, dim=1), torch.chunk(shift_labels, shards, dim=1)):
                good = int((lb != -100).sum())
                if good == 0:
                    continue
                total = total + loss_fn(logits=lg, labels=None, vocab_size=vocab_size, shift_labels=lb).float() * good
                count += good
        ctx.count = count
        return (total / max(count, 1)).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, shift_labels = ctx.saved_tensors
        out = torch.zeros_like(logits)
        off = 0
        for lg, lb in zip(torch.chunk(logits, ctx.shards, dim=1), torch.chunk(shift_labels, ctx.shards, dim=1)):
            good = int((lb != -100).sum())
            if good:
                lg = lg.detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = ctx.loss_fn(logits=lg, labels=None, vocab_size=ctx.vocab_size, shift_labels=lb)
                torch.autograd.backward(loss, grad * good / max(ctx.count, 1))
                out[:, off:off + lg.shape[1]] = lg.grad
            off += lb.shape[1]
        return None, out, None, None, None
