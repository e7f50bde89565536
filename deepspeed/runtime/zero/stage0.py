"""Stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Gradients are averaged once per accumulation boundary. Buckets of
``reduce_bucket_size`` elements are fixed at construction (reverse registration
order, which is roughly the order backward produces gradients); as soon as every
gradient of a bucket is ready - and every earlier bucket has been launched - the
bucket is flattened and its all-reduce is launched asynchronously from the
backward hook, so communication overlaps the rest of backward. Launch order is the
same on every rank, so collectives always match.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ... import comm as ds_comm
from ..comm.optimizer_hooks import gradient_allreduce_needed, load_rank_local_state, save_rank_local_state
from ..nonfinite import on_nonfinite
from ..strategy import StepOutcome, StrategyContext, TrainingStrategy
from ..utils import clip_coef, global_grad_norm, scale_grads_

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def comm_dtype(name):
    if name is None:
        return None
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPES:
        from ...config.errors import DeepSpeedConfigError
        raise DeepSpeedConfigError(
            f"Invalid value for 'communication_data_type': {name!r}. Allowed: fp32, fp16, bf16.")
    return _DTYPES[key]


STAGE0_DEFAULT_BUCKET = 2 ** 22  # elements


class _Bucket:
    __slots__ = ("params", "offsets", "numel", "ready", "buffer", "work")

    def __init__(self, params):
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.ready = set()
        self.buffer = None
        self.work = None


class GradientBucketer:
    """Owns the buckets and the asynchronous all-reduces of one set of parameters.

    ``reduce_op`` post-processing: gradients are divided by ``predivide`` before the
    all-reduce and by ``world/predivide`` after it, which averages them
    (``prescale_gradients`` / ``gradient_predivide_factor`` of the config). With
    ``average=False`` (``gradient_allreduce_op: "sum"``) the all-reduced sum is kept as it is.
    """

    def __init__(self, params, bucket_size: int, group, world_size: int, *, overlap: bool,
                 prescale: bool = False, predivide: float = 1.0, dtype=None, average: bool = True):
        self.group = group
        self.world_size = world_size
        self.overlap = overlap
        self._prescale, self._predivide = prescale, predivide
        self.average = average      # assignable (DeepSpeed's engine.gradient_average): the next reduction
        self.dtype = dtype
        self.buckets: list[_Bucket] = []
        cur, cur_n = [], 0
        for p in reversed(list(params)):
            cur.append(p)
            cur_n += p.numel()
            if cur_n >= bucket_size:
                self.buckets.append(_Bucket(cur))
                cur, cur_n = [], 0
        if cur:
            self.buckets.append(_Bucket(cur))
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self.launches = 0          # all-reduce launches since construction (tests count them)
        self.armed = False

    @property
    def prescale(self) -> bool:      # pre-division applies to averaging only
        return self._prescale if self.average else False

    @property
    def predivide(self) -> float:
        return self._predivide if self.average else 1.0

    # -- called from backward hooks -----------------------------------------------
    def mark_ready(self, p) -> None:
        if not self.armed:
            return
        b = self._where.get(id(p))
        if b is None:
            return
        b.ready.add(id(p))
        if self.overlap:
            self._launch_ready_in_order()

    def _launch_ready_in_order(self):
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket):
        grads = []
        for p in b.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.to_dense() if g.is_sparse else g)   # sparse (embedding) gradients: reduced dense
        dtype = self.dtype or grads[0].dtype
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        pre = self.predivide if self.prescale or self.predivide != 1.0 else 1.0
        if pre != 1.0:
            flat.div_(pre)
        b.buffer = flat
        b.work = ds_comm.all_reduce(flat, group=self.group, async_op=True) if self.world_size > 1 else None
        self.launches += 1

    # -- called at the end of backward on the boundary micro-step ------------------
    def finish(self) -> None:
        """Launch any bucket not yet launched (unused params, overlap off), wait for all,
        and write the averaged gradients back into ``p.grad``."""
        if not self.armed:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        pre = self.predivide if self.prescale or self.predivide != 1.0 else 1.0
        post = self.world_size / pre if self.average else 1.0
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            if post != 1.0:
                b.buffer.div_(post)
            for p, off in zip(b.params, b.offsets):
                src = b.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = src.to(p.dtype).clone()
                elif p.grad.is_sparse:   # stays sparse for its optimizer (e.g. SparseAdam): the rows any rank had
                    p.grad = src.to(p.dtype).to_sparse(p.grad.sparse_dim())
                else:
                    p.grad.copy_(src)
            b.buffer = None
            b.work = None
            b.ready.clear()
        self._next = 0
        self.armed = False


class DataParallelStrategy(TrainingStrategy):
    """ZeRO stage 0 in full precision: the user's optimizer updates the module's
    parameters directly; gradients are averaged across the data-parallel group."""

    stage = 0

    def __init__(self, module, ctx: StrategyContext):
        super().__init__(module, ctx)
        cfg = ctx.config
        z = cfg.zero
        self.params = [p for p in module.parameters() if p.requires_grad]
        if ctx.client_optimizer is not None:
            self.optimizer = ctx.client_optimizer
        elif ctx.optimizer_factory is not None:
            self.optimizer = ctx.optimizer_factory(ctx.param_groups)
        else:
            self.optimizer = None
        self.clip = cfg.gradient_clipping
        # DeepSpeed's reduce_bucket_size default (5e8) makes one bucket, which cannot overlap
        # with backward; unless the config sets it, stage 0 uses 4M-element buckets
        # (measured on gloo: 0.71x the step time of one 5e8 bucket, see docs/data_parallel.md).
        self.reduce_bucket_size = z.reduce_bucket_size_or(STAGE0_DEFAULT_BUCKET)
        # One bucketer per reduction group: MoE expert parameters are averaged over their
        # expert-data-parallel group, everything else over the data-parallel group.
        from ...moe.training import expert_aware_grad_norm, reduction_groups
        self._norm_fn = expert_aware_grad_norm if len(reduction_groups(self.params, None, 1)) > 1 else global_grad_norm
        self.bucketers = [GradientBucketer(
            ps, self.reduce_bucket_size, group, ctx.dp_world_size,
            overlap=z.overlap, prescale=cfg.model.prescale_gradients,
            predivide=cfg.model.gradient_predivide_factor,
            dtype=comm_dtype(cfg.model.communication_data_type),
            average=cfg.model.gradient_allreduce_op == "mean")
            # world size = the divisor: the data-parallel size for every group (an expert's
            # gradient already sums its expert-parallel group's tokens); the collective runs
            # over ``group``
            for _, group, _, _, ps in reduction_groups(self.params, ctx.dp_group, ctx.dp_world_size)]
        self.bucketer = self.bucketers[0]
        # One process: nothing to reduce, so no per-parameter hooks at all.
        self._hooks = [p.register_post_accumulate_grad_hook(b.mark_ready)
                       for b in self.bucketers if b.world_size > 1 for bk in b.buckets for p in bk.params]
        self.last_grad_norm = None

    @property
    def allreduce_launches(self) -> int:
        return sum(b.launches for b in self.bucketers)

    def begin_backward(self, sync) -> bool:
        reduce_now = sync and self._sync_enabled and self.ctx.dp_world_size > 1 \
            and gradient_allreduce_needed(self.optimizer)   # 1-bit optimizers: compressed in their step
        for b in self.bucketers:
            b.armed = reduce_now and b.world_size > 1
        return reduce_now

    def end_backward(self, reduce_now) -> None:
        if reduce_now:
            for b in self.bucketers:
                b.finish()

    def allreduce_gradients(self) -> None:
        if self.ctx.dp_world_size > 1 and gradient_allreduce_needed(self.optimizer):
            for b in self.bucketers:
                if b.world_size > 1:
                    b.armed = True
                    b.finish()

    def step(self) -> StepOutcome:
        # the global norm (DeepSpeed computes it at fp32 stage 0 only when clipping): a NaN/Inf
        # norm skips the step instead of poisoning the weights (deepspeed.runtime.nonfinite)
        norm = self._norm_fn(self.params, mpu=self.ctx.mpu)
        if not math.isfinite(norm):
            on_nonfinite(self.ctx.config, norm, "ZeRO stage 0")
            self.last_grad_norm = None
            return StepOutcome(skipped=True, grad_norm=None)
        if self.clip > 0:
            scale_grads_([p.grad for p in self.params if p.grad is not None], clip_coef(norm, self.clip))
        if self.optimizer is not None:
            self.optimizer.step()
        self.last_grad_norm = norm
        return StepOutcome(skipped=False, grad_norm=norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            super().zero_grad(set_to_none)

    # -- checkpoint state ----------------------------------------------------------------
    # The shared per-parameter fragment format (runtime/checkpoint/universal.py), so a
    # stage-0 checkpoint loads at ZeRO stages 1-3 and vice versa, at any world size.
    def save_optimizer_state(self, writer, dp_rank, mp_rank):
        if dp_rank == 0 and self.optimizer is not None:
            from ..checkpoint.universal import optim_file_name, rank_state_from_torch_optimizer
            writer.save(optim_file_name(0, mp_rank), rank_state_from_torch_optimizer(
                self.module, self.optimizer, zero_stage=0, dp_world_size=self.ctx.dp_world_size, mp_rank=mp_rank))
        if self.optimizer is not None:
            save_rank_local_state(self.optimizer, writer, dp_rank, mp_rank)   # 1-bit error buffers, per rank

    def load_optimizer_state(self, reader, load_optimizer_states=True):
        if not load_optimizer_states or self.optimizer is None:
            return
        from ..checkpoint.universal import FragmentIndex, load_torch_optimizer_from_index
        mp_rank = self.ctx.mpu.get_model_parallel_rank() if self.ctx.mpu else 0
        # a reader may merge files itself (pipeline checkpoints: one set of files per stage)
        idx = reader.fragment_index(mp_rank) if hasattr(reader, "fragment_index") else FragmentIndex(reader.path,
                                                                                                     mp_rank)
        load_torch_optimizer_from_index(self.module, self.optimizer, idx, f"loading '{reader.path}'")
        load_rank_local_state(self.optimizer, reader, self.ctx.dp_rank, mp_rank)

    def destroy(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
