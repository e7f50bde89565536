"""Small runtime helpers shared by strategies: global gradient norm and clipping."""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from .. import comm as ds_comm


def is_model_parallel_parameter(p) -> bool:
    """Parameters split across model-parallel ranks (Megatron marks them)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def local_grad_sq_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar, computed with foreach kernels."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]   # sparse embedding gradients
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2.0)
    return torch.stack(norms).double().pow(2).sum()


def global_grad_norm(params: Iterable[torch.nn.Parameter], mpu=None, extra_group=None,
                     sq_norm: Optional[torch.Tensor] = None) -> float:
    """L2 norm of all gradients, across model-parallel ranks when an ``mpu`` is given.

    Parameters not split by model parallelism are counted once (on model-parallel rank 0),
    split ones on every rank. ``extra_group`` (a process group) sums partial norms across it
    (ZeRO partitions). ``sq_norm`` lets a caller pass a precomputed local sum of squares.
    Returns inf/nan when any gradient is non-finite.
    """
    if sq_norm is None:
        params = [p for p in params if p.grad is not None]
        if mpu is not None and mpu.get_model_parallel_world_size() > 1 and mpu.get_model_parallel_rank() != 0:
            params = [p for p in params if is_model_parallel_parameter(p)]
        sq_norm = local_grad_sq_norm([p.grad for p in params])
    total = sq_norm.detach().clone().double().reshape(1)  # a CPU zero when this rank holds no gradient
    if dist.is_available() and dist.is_initialized():
        if mpu is not None and mpu.get_model_parallel_world_size() > 1:
            group = mpu.get_model_parallel_group()
            total = ds_comm.to_comm_device(total, group)
            dist.all_reduce(total, group=group)
        if extra_group is not None and dist.get_world_size(extra_group) > 1:
            total = ds_comm.to_comm_device(total, extra_group)
            dist.all_reduce(total, group=extra_group)
    return math.sqrt(total.item()) if total.item() >= 0 else float("nan")


def clip_coef(total_norm: float, max_norm: float) -> float:
    """Multiplier that brings ``total_norm`` down to ``max_norm`` (1.0 when already below)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    c = max_norm / (total_norm + 1e-6)
    return min(c, 1.0)


def scale_grads_(grads: List[torch.Tensor], factor: float) -> None:
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)


# ---------------------------------------------------------------------------------------
# DeepSpeed's ``deepspeed.runtime.utils`` names that client code imports (Megatron-style
# trainers, pipeline code, Accelerate's tests): partitioning arithmetic, norms and
# clipping, memory reports, nested-structure moves, and a tensor split across a group.
# ---------------------------------------------------------------------------------------
def noop_decorator(func):
    """A decorator that changes nothing (DeepSpeed swaps it in where a real one is optional)."""
    return func


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename``."""
    import os
    dirname = os.path.dirname(filename)
    if dirname:
        os.makedirs(dirname, exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's generators (all devices) with ``seed``."""
    import random
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)


def call_to_str(base: str, *args, **kwargs) -> str:
    """``call_to_str('f', 1, b=2)`` -> ``"f(1, b=2)"`` (used to print pipeline instructions)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def get_only_unique_item(items):
    """The one distinct value in ``items``; a ValueError naming them when there are several."""
    unique = set(items)
    if len(unique) != 1:
        raise ValueError(f"expected exactly one unique item, found {len(unique)}: {sorted(map(repr, unique))}")
    return unique.pop()


def move_to_device(item, device, criterion_func=None):
    """Move the tensors in a nested list/tuple/dict ``item`` to ``device`` (only those for
    which ``criterion_func(tensor)`` is true, when given); other values are returned as they are."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        moved = [move_to_device(v, device, criterion_func) for v in item]
        return type(item)(*moved) if hasattr(item, "_fields") else tuple(moved)
    if isinstance(item, dict):
        return type(item)((k, move_to_device(v, device, criterion_func)) for k, v in item.items())
    return item


def bwc_tensor_model_parallel_rank(mpu=None) -> int:
    """The tensor-model-parallel rank from an ``mpu`` of any Megatron generation (0 without one)."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    raise AttributeError("the mpu object has none of get_tensor_model_parallel_rank / get_slice_parallel_rank / "
                         "get_model_parallel_rank")


def get_global_norm(norm_list) -> float:
    """The L2 norm of several partial L2 norms: ``sqrt(sum(n**2))``."""
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def _norm_of(tensors, norm_type: float, mpu) -> float:
    norm_type = float(norm_type)
    tensors = [t for t in tensors if t is not None]
    if norm_type == math.inf:
        local = max((t.detach().abs().max().item() for t in tensors if t.numel()), default=0.0)
        total = torch.tensor([local], dtype=torch.float64)
        if mpu is not None and dist.is_available() and dist.is_initialized() \
                and mpu.get_model_parallel_world_size() > 1:
            group = mpu.get_model_parallel_group()
            total = ds_comm.to_comm_device(total, group)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total.item()
    local = sum(t.detach().double().norm(norm_type).item() ** norm_type for t in tensors)
    total = torch.tensor([local], dtype=torch.float64)
    if mpu is not None and dist.is_available() and dist.is_initialized() and mpu.get_model_parallel_world_size() > 1:
        group = mpu.get_model_parallel_group()
        total = ds_comm.to_comm_device(total, group)
        dist.all_reduce(total, group=group)
    return total.item() ** (1.0 / norm_type)


def _counted_params(parameters, mpu):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if mpu is not None and mpu.get_model_parallel_world_size() > 1 and bwc_tensor_model_parallel_rank(mpu) != 0:
        params = [p for p in params if is_model_parallel_parameter(p)]  # shared ones counted on rank 0 only
    return params


def get_grad_norm(parameters, norm_type=2, mpu=None) -> float:
    """Norm of the parameters' gradients (across model-parallel ranks with an ``mpu``);
    ``-1`` when it is inf or NaN, as DeepSpeed reports it."""
    total = _norm_of([p.grad for p in _counted_params(parameters, mpu)], norm_type, mpu)
    return -1.0 if not math.isfinite(total) else total


def get_weight_norm(parameters, norm_type=2, mpu=None) -> float:
    """Norm of the parameters themselves; ``-1`` when it is inf or NaN."""
    total = _norm_of([p.data for p in _counted_params(parameters, mpu)], norm_type, mpu)
    return -1.0 if not math.isfinite(total) else total


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None) -> float:
    """Scale the gradients in place so their total norm is at most ``max_norm``; returns the
    total norm before clipping (as ``torch.nn.utils.clip_grad_norm_``, across model-parallel
    ranks with an ``mpu``).

    As in DeepSpeed, the norm is then averaged over the data-parallel group (collective: every
    rank calls it): expert (MoE) gradients differ between ranks, so each rank's own norm
    would differ and the ranks would clip by different factors; with the same gradients on
    every rank the average is that norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    total = _norm_of([p.grad for p in _counted_params(params, mpu)], norm_type, mpu)
    total = _mean_over_data_parallel(total)
    coef = float(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return total


def _mean_over_data_parallel(value: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    from ..utils import groups
    group = groups._get_data_parallel_group()
    size = dist.get_world_size(group=group)
    if size == 1:
        return value
    t = ds_comm.to_comm_device(torch.tensor([value / size], dtype=torch.float64), group)
    dist.all_reduce(t, group=group)
    return float(t.item())


def _is_expert_param(p) -> bool:
    """DeepSpeed's is_moe_param: expert parameters carry ``allreduce = False``."""
    return getattr(p, "allreduce", True) is False


def prefix_sum_inc(weights) -> list:
    """Inclusive prefix sum: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    out, acc = [], 0
    for w in weights:
        acc = acc + w
        out.append(acc)
    return out


def partition_uniform(num_items: int, num_parts: int) -> list:
    """Boundaries (``num_parts + 1`` of them) splitting ``num_items`` into ``num_parts``
    contiguous runs whose sizes differ by at most one, the larger runs first; with fewer
    items than parts the trailing parts are empty."""
    if num_parts < 1:
        raise ValueError(f"partition_uniform: num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if p < residual else 0))
    return parts


def partition_balanced(weights, num_parts: int, eps: float = 1e-3) -> list:
    """Boundaries splitting ``weights`` into ``num_parts`` contiguous runs so the heaviest
    run is as light as possible (the linear partition problem, solved exactly by dynamic
    programming over prefix sums; among equally light splits the most even one is taken).
    ``eps`` is accepted for DeepSpeed's signature; the answer is exact."""
    import numpy as np
    weights = [float(w) for w in weights]
    if any(w < 0 for w in weights):
        raise ValueError("partition_balanced: weights must be non-negative")
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    INF = float("inf")
    # best[j][i]: (heaviest, spread) of the best split of the first i items into j runs
    heavy = np.full((num_parts + 1, n + 1), INF)
    light = np.full((num_parts + 1, n + 1), INF)
    cut = np.zeros((num_parts + 1, n + 1), dtype=np.int64)
    heavy[0, 0] = 0.0
    light[0, 0] = INF
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            ks = np.arange(j - 1, i)  # the previous j-1 runs cover items [0, k)
            run = prefix[i] - prefix[ks]
            h = np.maximum(heavy[j - 1, ks], run)
            lo = np.minimum(light[j - 1, ks], run)
            spread = h - lo
            best_h = h.min()
            cand = np.nonzero(h <= best_h + 1e-12 * max(1.0, abs(best_h)))[0]
            pick = cand[np.argmin(spread[cand])]
            heavy[j, i], light[j, i], cut[j, i] = h[pick], lo[pick], ks[pick]
    parts = [n]
    i = n
    for j in range(num_parts, 0, -1):
        i = int(cut[j, i])
        parts.append(i)
    return parts[::-1]


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated / peak memory and the host's virtual-memory use,
    on rank 0, when ``force`` is true (DeepSpeed keeps these calls in code and turns
    them on with ``force``)."""
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    import gc
    import psutil
    from ..accelerator import get_accelerator
    from ..utils.logging import logger
    gc.collect()
    acc = get_accelerator()
    gib = 1024 ** 3
    vm = psutil.virtual_memory()
    logger.info(message)
    logger.info(f"MA {acc.memory_allocated() / gib:.2f} GB         Max_MA {acc.max_memory_allocated() / gib:.2f} GB")
    logger.info(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


class PartitionedTensor:
    """A tensor split evenly (``partition_uniform`` over its elements) across the ranks of
    ``group``; each rank keeps its slice in ``local_data``. ``to_meta()`` describes the split
    as a 1-D long tensor (``[ndim, *shape, num_parts, *boundaries]``) so a peer can rebuild
    the object with ``from_meta``; ``full()`` all-gathers the whole tensor."""

    def __init__(self, tensor: torch.Tensor, group=None, partition_meta=None):
        self.group = group
        self.num_parts = dist.get_world_size(group=group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:stop].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group=None, device=None):
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a long tensor, got {meta.dtype}")
        obj = cls.__new__(cls)
        vals = meta.tolist()
        ndim = vals[0]
        obj.group = group
        obj.orig_size = vals[1:1 + ndim]
        obj.num_parts = vals[1 + ndim]
        obj.partition = vals[2 + ndim:]
        obj.rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        obj.orig_device = torch.device(device) if device is not None else local_part.device
        expected = obj.partition[obj.rank + 1] - obj.partition[obj.rank]
        if local_part.numel() != expected:
            raise ValueError(f"PartitionedTensor.from_meta: rank {obj.rank}'s part has {local_part.numel()} "
                             f"elements, the meta says {expected}")
        obj.local_data = local_part
        return obj

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> int:
        return self.local_data.numel()

    def to_meta(self) -> torch.Tensor:
        return torch.tensor([len(self.orig_size), *self.orig_size, self.num_parts, *self.partition], dtype=torch.long)

    def full(self, device=None) -> torch.Tensor:
        device = device if device is not None else self.orig_device
        total = self.partition[-1]
        if self.num_parts == 1:
            return self.local_data.to(device).reshape(self.orig_size)
        # Pad every part to the largest so one all_gather_into_tensor moves them all.
        width = max(self.partition[i + 1] - self.partition[i] for i in range(self.num_parts))
        padded = torch.zeros(width, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[:self.local_data.numel()] = self.local_data
        padded = ds_comm.to_comm_device(padded, self.group)  # a host-side part, NCCL group: to the device
        gathered = torch.empty(width * self.num_parts, dtype=padded.dtype, device=padded.device)
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        pieces = [gathered[i * width:i * width + self.partition[i + 1] - self.partition[i]]
                  for i in range(self.num_parts)]
        return torch.cat(pieces)[:total].to(device).reshape(self.orig_size)


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """Replace every NaN/inf element of ``input`` with ``val``, in place."""
    bad = ~torch.isfinite(input)
    if bad.any():
        input.masked_fill_(bad, val)


def __getattr__(name):  # names that live elsewhere, under DeepSpeed's older runtime.utils path
    if name == "has_inf_or_nan":
        from .precision.loss_scaler import has_inf_or_nan
        return has_inf_or_nan
    if name == "required_torch_version":
        from ..utils.torch import required_torch_version
        return required_torch_version
    raise AttributeError(f"module 'deepspeed.runtime.utils' has no attribute '{name}'")


class CheckOverflow:
    """Whether any gradient of ``param_groups`` is inf/NaN on any rank (the world, and the
    model-parallel group of an ``mpu``): DeepSpeed's overflow check for custom loops."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None):
        self.mpu = mpu
        self.params = [p for g in (param_groups or []) for p in g] if param_groups else None
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.has_moe_params = any(_is_expert_param(p) for p in (self.params or []))

    def _reduce_experts(self, overflow: bool, has_moe_params: bool) -> bool:
        """With expert parameters, an overflow in one rank's experts is every rank's overflow:
        reduced over the largest expert-parallel group (as DeepSpeed does), even when the
        caller asks for no other reduction."""
        if not (has_moe_params and dist.is_available() and dist.is_initialized()):
            return overflow
        from ..utils import groups
        group = groups._get_max_expert_parallel_group()
        if group is None:
            return overflow
        flag = ds_comm.to_comm_device(torch.tensor([1.0 if overflow else 0.0]), group)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def _reduce(self, overflow: bool) -> bool:
        flag = torch.tensor([1.0 if overflow else 0.0])
        if dist.is_available() and dist.is_initialized():
            flag = ds_comm.to_comm_device(flag)  # NCCL reduces device tensors only, even in a world of one
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if self.mpu is not None and self.mpu.get_model_parallel_world_size() > 1:
                group = self.mpu.get_model_parallel_group()
                flag = ds_comm.to_comm_device(flag, group)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        params = list(params)
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        return self._reduce(self._reduce_experts(self.has_overflow_serial(params), has_moe_params))

    def check_using_norm(self, norm_group, reduce_overflow=True) -> bool:
        overflow = any(not math.isfinite(float(n)) or float(n) == -1 for n in norm_group)
        overflow = self._reduce_experts(overflow, self.has_moe_params)
        return self._reduce(overflow) if reduce_overflow else overflow

    def check(self, param_groups=None) -> bool:
        params = [p for g in param_groups for p in g] if param_groups is not None else (self.params or [])
        return self.has_overflow(params, any(_is_expert_param(p) for p in params))


# ---------------------------------------------------------------------------------------------
# DeepSpeed 0.19's helpers for code running inside a backward pass (its ZeRO optimizers count the
# parameters a pass will reach; ours queue the end of a user-driven pass on autograd's engine,
# runtime/torch_backward.py, but clients and hooks call these).
def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this PyTorch has the autograd internals :func:`count_used_parameters_in_backward` reads."""
    return (hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc")
            and hasattr(torch._C, "_current_graph_task_id") and hasattr(torch._C, "_will_engine_execute_node"))


def count_used_parameters_in_backward(parameters) -> int:
    """How many of ``parameters`` the backward pass running now will produce a gradient for.

    Call it from inside a backward (a tensor or module hook). Parameters that do not require
    grad, or that this pass does not reach, are not counted; parameters sharing one gradient
    accumulator (the same tensor twice) count once."""
    if not check_internal_apis_for_count_used_parameters():
        raise RuntimeError("count_used_parameters_in_backward needs torch.autograd.graph._get_grad_fn_or_grad_acc, "
                           "torch._C._current_graph_task_id and torch._C._will_engine_execute_node; this PyTorch "
                           f"({torch.__version__}) lacks one of them.")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution "
                           "(from a hook), not outside a backward pass.")
    from torch.autograd.graph import _get_grad_fn_or_grad_acc
    nodes = {}
    with torch.enable_grad():   # hooks run with grad disabled; the accumulator lookup needs it on
        for p in parameters:
            if isinstance(p, torch.Tensor) and p.requires_grad:
                node = _get_grad_fn_or_grad_acc(p)
                if node is not None:
                    nodes[id(node)] = node
    will_run = torch._C._will_engine_execute_node
    return sum(1 for node in nodes.values() if will_run(node))
