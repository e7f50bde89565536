"""What training needs to know about expert parameters.

Expert parameters (``allreduce = False``, ``group_name = "ep_size_<N>"``) are different
on every rank of an expert-parallel group and equal across its expert-data-parallel
group, so their gradients are averaged over the expert-data-parallel group, not over
the whole data-parallel group. Everything else follows from that:

* :func:`reduction_groups` - parameters grouped by the group that reduces them (dense
  first). Stage 0 in fp32 keeps one optimizer and one gradient bucketer per group.
* :class:`MoEFlatStrategy` - for the flat strategies (fp16/bf16 at stage 0, ZeRO 1 and
  2): one sub-strategy of the configured class per reduction group, each partitioning
  (ZeRO) and reducing over its own group. One autograd pass drives them all
  (``begin_backward``/``end_backward``); at the step one all-reduce over the
  data-parallel group decides overflow (any rank, any expert: every rank skips) and the
  global gradient norm, in which each expert is counted once (ZeRO partitions and
  expert-data-parallel replicas are de-duplicated before the sum); then every
  sub-strategy clips by that norm and steps (``prepare_step``/``finish_step``).
* :func:`expert_aware_grad_norm` - the same norm for stage 0 in fp32.
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import replace
from typing import List

import torch
import torch.distributed as dist

from .. import comm as ds_comm
from ..config.errors import DeepSpeedConfigError
from ..runtime.strategy import StepOutcome, TrainingStrategy
from ..runtime.utils import global_grad_norm, local_grad_sq_norm
from ..utils import groups
from .utils import is_moe_param


def has_expert_params(module: torch.nn.Module) -> bool:
    return any(is_moe_param(p) for p in module.parameters())


def reduction_groups(params, dp_group, dp_world_size: int, dp_rank: int = 0):
    """``[(name, group, world_size, rank, params)]``: ``"dense"`` over the data-parallel
    group first, then one entry per expert group name (over its expert-data-parallel
    group). Without expert parameters: just the dense entry."""
    dense, by_name = [], OrderedDict()
    for p in params:
        if is_moe_param(p):
            if not isinstance(getattr(p, "group_name", None), str):
                raise ValueError(f"A parameter of shape {tuple(p.shape)} is marked allreduce=False (an expert "
                                 f"parameter) but has no 'group_name' naming its expert group (e.g. 'ep_size_2'); "
                                 f"build experts with deepspeed.moe.layer.MoE, or set param.group_name.")
            by_name.setdefault(p.group_name, []).append(p)
        else:
            dense.append(p)
    out = [("dense", dp_group, dp_world_size, dp_rank, dense)]
    for name, ps in by_name.items():
        if not groups.get_expert_data_parallel_group_dict():
            raise RuntimeError(f"Expert parameters of group {name!r} but no expert groups exist: build the "
                               f"MoE model after deepspeed.init_distributed().")
        out.append((name, groups.get_expert_data_parallel_group(name),
                    groups.get_expert_data_parallel_world_size(name), groups.get_expert_data_parallel_rank(name), ps))
    return out


def expert_aware_grad_norm(params, mpu=None) -> float:
    """Global L2 norm of the (already reduced) gradients: dense parameters counted once,
    each expert counted once (its squared norm summed over its expert-parallel group)."""
    dense = [p for p in params if not is_moe_param(p)]
    total = global_grad_norm(dense, mpu=mpu) ** 2
    by_name = OrderedDict()
    for p in params:
        if is_moe_param(p) and p.grad is not None:
            by_name.setdefault(p.group_name, []).append(p.grad)
    for name, grads in by_name.items():
        sq = local_grad_sq_norm(grads).reshape(1)
        if groups.get_expert_parallel_world_size(name) > 1:
            group = groups.get_expert_parallel_group(name)
            sq = ds_comm.to_comm_device(sq, group)
            dist.all_reduce(sq, group=group)
        total += sq.item()
    return math.sqrt(total) if total >= 0 else float("nan")


def _split_user_groups(param_groups: List[dict]):
    """User groups -> (dense groups, {expert group name: groups}); hyperparameters kept."""
    dense, experts = [], OrderedDict()
    for g in param_groups:
        d = [p for p in g["params"] if not is_moe_param(p)]
        if d:
            dense.append(dict(g, params=d))
        by_name = OrderedDict()
        for p in g["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        for name, ps in by_name.items():
            experts.setdefault(name, []).append(dict({k: v for k, v in g.items() if k not in ("moe", "name")},
                                                     params=ps))
    return dense, experts


def ensure_expert_groups(module) -> None:
    """Create the expert groups of MoE layers built before torch.distributed was
    initialised (DeepSpeed's engine does this too). Collective: every rank calls it."""
    from .layer import MoE
    for m in module.modules():
        if isinstance(m, MoE) and not m._groups_ready:
            m.set_deepspeed_parallelism()


def broadcast_expert_params(module) -> None:
    """Start every expert replica from rank 0 of its expert-data-parallel group."""
    from .layer import MoE
    ensure_expert_groups(module)
    for layer in (m for m in module.modules() if isinstance(m, MoE)):
        name = layer.expert_group_name
        if name not in groups.get_expert_data_parallel_group_dict():
            continue
        if groups.get_expert_data_parallel_world_size(name) <= 1:
            continue
        src = groups._get_expert_broadcast_src_rank(name)
        for p in layer.deepspeed_moe.experts.parameters():
            dist.broadcast(p.data, src=src, group=groups.get_expert_data_parallel_group(name))


def build_moe_strategy(module, ctx, cls):
    """The strategy for a model with expert parameters (``strategy_factory`` calls this)."""
    ensure_expert_groups(module)
    stage = ctx.config.zero_optimization_stage
    mixed = ctx.config.fp16_enabled or ctx.config.bfloat16_enabled
    if stage == 3:
        raise DeepSpeedConfigError("Mixture of Experts with zero_optimization.stage 3 is not supported in this "
                                   "version; use stage 0, 1 or 2 (expert parameters are partitioned over their "
                                   "expert-data-parallel group at stages 1 and 2).")
    mpu = ctx.mpu
    if mpu is not None and mpu.get_model_parallel_world_size() > 1 and (stage > 0 or mixed):
        raise DeepSpeedConfigError("Mixture of Experts with model parallelism is supported at zero_optimization."
                                   "stage 0 in fp32 only in this version.")
    if stage == 0 and not mixed:
        # stage 0 fp32 reduces per group itself (runtime/zero/stage0.py); checkpoints split experts out
        from .checkpoint import load_stage0_moe_optimizer, save_stage0_moe_optimizer

        class MoEDataParallelStrategy(cls):
            def save_optimizer_state(self, writer, dp_rank, mp_rank):
                save_stage0_moe_optimizer(self, writer, dp_rank, mp_rank)

            def load_optimizer_state(self, reader, load_optimizer_states=True):
                load_stage0_moe_optimizer(self, reader, load_optimizer_states)

        return MoEDataParallelStrategy(module, ctx)
    return MoEFlatStrategy(module, ctx, cls)


class MoEFlatStrategy(TrainingStrategy, torch.optim.Optimizer):
    """One flat strategy per reduction group, stepped together (see the module docstring).
    It is both the engine's strategy and ``engine.optimizer``."""

    def __init__(self, module, ctx, cls):
        TrainingStrategy.__init__(self, module, ctx)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self.stage = ctx.config.zero_optimization_stage
        from ..runtime.precision.inner_optimizer import _constructor_kwargs, user_param_groups
        dense_groups, expert_groups = _split_user_groups(user_param_groups(ctx))
        factory = ctx.optimizer_factory
        if ctx.client_optimizer is not None:
            ocls, defaults = type(ctx.client_optimizer), dict(getattr(ctx.client_optimizer, "defaults", {}) or {})
            factory = lambda gs: ocls(gs, **_constructor_kwargs(ocls, defaults))  # noqa: E731
        fp32 = {id(p): p.detach().float().clone() for p in module.parameters() if p.requires_grad}
        base = replace(ctx, client_optimizer=None, optimizer_factory=factory)
        self.parts = [("dense", cls(module, replace(base, param_groups=dense_groups)))]
        for name, gs in expert_groups.items():
            sub = replace(base, param_groups=gs, dp_group=groups.get_expert_data_parallel_group(name),
                          dp_world_size=groups.get_expert_data_parallel_world_size(name),
                          dp_rank=groups.get_expert_data_parallel_rank(name))
            self.parts.append((name, cls(module, sub)))
        from .checkpoint import globalize_slot_names
        for _, s in self.parts[1:]:
            # an expert's gradient already sums the tokens of its whole expert-parallel group:
            # average over the data-parallel size, as for the same model without parallelism
            s.average_over = ctx.dp_world_size
            globalize_slot_names(s, module)   # checkpoint keys independent of the ep layout
        if any(getattr(s, "mixed", False) for _, s in self.parts):
            # the first sub-strategy cast the whole module to 16 bits: masters from the fp32 originals
            for _, s in self.parts:
                for slot in s.slots:
                    s.set_full_fp32_param(slot.param, fp32[id(slot.param)])
        self.subs = [s for _, s in self.parts]
        self.optimizer = self if all(s.inner is not None for s in self.subs) else None
        self.overflow = False
        self.last_grad_norm = None

    # ------------------------------------------------------------------ optimizer face
    @property
    def param_groups(self):
        return [g for s in self.subs for g in s.param_groups]

    @param_groups.setter
    def param_groups(self, value):
        value = list(value)
        for s in self.subs:
            n = len(s.param_groups)
            s.param_groups, value = value[:n], value[n:]

    @property
    def state(self):
        out = {}
        for s in self.subs:
            out.update(s.state)
        return out

    @property
    def defaults(self):
        return self.subs[0].defaults

    @property
    def loss_scale(self) -> float:
        return self.subs[0].loss_scale

    @property
    def cur_scale(self) -> float:
        return self.subs[0].loss_scale

    @property
    def loss_scaler(self):
        return self.subs[0].scaler

    def __repr__(self):
        return f"MoEFlatStrategy({', '.join(f'{n}: {s!r}' for n, s in self.parts)})"

    # ------------------------------------------------------------------ backward / step
    def scale_loss(self, loss):
        return self.subs[0].scale_loss(loss)

    # backward = begin_backward; loss.backward(); end_backward (TrainingStrategy.backward)
    def begin_backward(self, sync):
        return [s.begin_backward(sync) for s in self.subs]

    def end_backward(self, boundaries) -> None:
        for s, b in zip(self.subs, boundaries):
            s.end_backward(b)

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for s in self.subs:
                stack.enter_context(s.no_sync())
            yield

    def step(self, closure=None) -> StepOutcome:
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure) is not supported: the step runs after engine.backward().")
        if self.optimizer is None:
            return StepOutcome()
        preps = [s.prepare_step() for s in self.subs]
        local = [p[2].item() if torch.is_tensor(p[2]) else float(p[2]) for p in preps]
        flag = 0.0 if all(math.isfinite(v) for v in local) else 1.0
        # count each element once over the data-parallel group: partitions are disjoint,
        # replicated (unpartitioned) gradients are counted on their group's rank 0 only
        counted = [v if (s.partition_master or s.rank == 0) else 0.0 for s, v in zip(self.subs, local)]
        packed = torch.tensor([flag] + counted, dtype=torch.float64)
        if self.ctx.dp_world_size > 1:
            packed = ds_comm.to_comm_device(packed, self.ctx.dp_group)
            dist.all_reduce(packed, group=self.ctx.dp_group)
        overflow = packed[0].item() > 0
        sq = sum(packed[i + 1].item() * s.grad_norm_factor() ** 2 for i, s in enumerate(self.subs))
        norm = math.sqrt(sq) if math.isfinite(sq) else float(sq)
        outcomes = [s.finish_step(p, overflow, norm) for s, p in zip(self.subs, preps)]
        skipped = any(o.skipped for o in outcomes)
        self.overflow = skipped
        self.last_grad_norm = None if skipped else norm
        return StepOutcome(skipped=skipped, grad_norm=None if skipped else norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.subs:
            s.zero_grad(set_to_none)

    # ------------------------------------------------------------------ state
    def module_state_dict(self) -> dict:
        return self.subs[0].module_state_dict()

    def after_module_load(self) -> None:
        for s in self.subs:
            s.after_module_load()

    def state_dict(self) -> dict:
        """This rank's state of every sub-strategy (fragments; expert names global)."""
        return {"moe_parts": {name: s.state_dict() for name, s in self.parts}}

    def load_state_dict(self, state_dict) -> None:
        """Accepts what state_dict() returns on every rank, as a list (any world size and
        ep size: experts are matched by global name), or this rank's own at one rank."""
        states = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict]
        names = [n for n, _ in self.parts]
        for st in states:
            parts = st.get("moe_parts") if isinstance(st, dict) else None
            if parts is None or "dense" not in parts:
                raise ValueError(f"MoE optimizer load_state_dict: expected the dicts state_dict() returns, with "
                                 f"'moe_parts' for {names}; got {type(st).__name__}.")
        from .checkpoint import merged_index
        self.parts[0][1].load_state_dict([st["moe_parts"]["dense"] for st in states])
        experts = [v for st in states for n, v in st["moe_parts"].items() if n != "dense"]
        if len(self.parts) > 1:
            idx = merged_index(experts, "<state_dict>")
            for _, s in self.parts[1:]:
                s._load_from_index(idx, True)

    def save_optimizer_state(self, writer, dp_rank, mp_rank):
        from .checkpoint import save_moe_optimizer_state
        save_moe_optimizer_state(self, writer, dp_rank, mp_rank)

    def load_optimizer_state(self, reader, load_optimizer_states=True):
        from .checkpoint import load_moe_optimizer_state
        load_moe_optimizer_state(self, reader, load_optimizer_states)

    def destroy(self) -> None:
        for s in self.subs:
            s.destroy()
