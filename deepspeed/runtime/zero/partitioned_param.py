"""Partitioned parameters: the per-parameter state and operations of ZeRO stage 3.

A partitioned parameter stays the same ``torch.nn.Parameter`` object the model
registered (optimizers, hooks and user code keep working), but outside the
forward/backward of its module its ``.data`` is an empty placeholder and the
rank's 1/N slice lives in ``param.ds_tensor`` (a flat tensor of
``ceil(numel / N)`` elements, zero-padded on the last rank).

What lives here: :class:`PartitionSpec` (how a group of parameters is partitioned),
:func:`convert_param` (a full parameter made partitioned), :func:`release_param` (the full copy
dropped again), :func:`broadcast_and_repartition` and :func:`set_partition_from_full` (a
partition rewritten from a full value), :func:`owned_range`, :func:`resident_partitions`
(NVMe-backed partitions brought in for a block), ``ds_summary``, ``partitioned_param_data_shape``,
and the fetch lists (:func:`module_params_to_fetch`, :func:`invalidate_fetch_lists`,
:func:`fetch_lists_version`, :func:`register_external_parameter`,
:func:`unregister_external_parameter`). This module owns the module-level state: the ``ds_id``
counter, the released-parameter placeholders and the fetch-list version.

Gathering (:func:`gather_params`, its handles, flat/quantized/hpZ gathers) and
:class:`ZeroParamStatus` are in :mod:`.partitioned_gather`; they are re-exported here, so every
name importable from this module before the split still is. A test that replaces a gather
helper (``_flat_input``) patches ``partitioned_gather``, where ``gather_params`` looks it up.

Attributes DeepSpeed's ecosystem reads: ``ds_id``, ``ds_shape``, ``ds_numel``,
``ds_tensor`` (with ``ds_tensor.ds_numel``), ``ds_status``, ``ds_persist``,
``ds_process_group``.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch

from ...accelerator import get_accelerator
from ...utils.pin_memory import native_pinning
from .partitioned_gather import (FLAT_GATHER_ELEMENTS, QUANT_BLOCK, GatherHandle, ZeroParamStatus,  # noqa: F401
                                 _alias_partitions, _flat_input, _full_buffer, _gather_quantized,
                                 _gather_secondary, _keep_secondary, _MultiHandle, _pieces, _pool_batches,
                                 _release_swapped, _render, _runs, _secondary_size, _secondary_valid,
                                 _set_inflight, _swapper_groups, dequantize_blockwise, gather_params,
                                 is_quantized, partition_size, quantize_blockwise, quantize_partition,
                                 wait_available)
from .stage3_comm import KIND_BROADCAST, KIND_GATHER, CheckedComm  # noqa: F401


_next_id = itertools.count()
_placeholders: dict = {}


class PartitionSpec:
    """How a group of parameters is partitioned: the communicator, the device the full
    parameter is gathered on, the device the partitions live on (host memory with
    ``offload_param``), and listeners told when a partition was rewritten."""

    def __init__(self, comm: CheckedComm, device, partition_device=None, pin_memory: bool = False):
        self.comm = comm
        self.device = torch.device(device)
        self.partition_device = torch.device(partition_device) if partition_device is not None else self.device
        # pinned host partitions: asked for, in host memory, and something can pin them - a device
        # runtime (the compute device is not the CPU) or DS_PIN_MEMORY_BACKEND=native (page-locked
        # memory with or without a device)
        self.pin_memory = bool(pin_memory) and self.partition_device.type == "cpu" and (
            self.device.type != "cpu" or native_pinning())
        self.listeners = []   # callables(param) after GatheredParameters re-partitions a modified param
        # AsyncPartitionedParameterSwapper when partitions live on NVMe (offload_param.device: nvme);
        # convert_param hands new partitions to it, gather_params/resident_partitions bring them in.
        self.swapper = None
        # hpZ (zero_hpz_partition_size): a CheckedComm over this rank's node-sized group. Each
        # primary gather also leaves the rank its 1/h slice of the parameter (the secondary
        # partition); later gathers in the same forward/backward read those inside the group.
        # ``version`` moves at every forward start: secondaries of an older version are stale.
        self.sec_comm = None
        self.version = 0
        self.gathered = 0   # elements of this spec's parameters gathered (in flight or whole) right now

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def __deepcopy__(self, memo):
        return self


def is_zero_param(p) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "_z3")



# The shape a partitioned parameter's ``.data`` has outside its use (DeepSpeed's name).
partitioned_param_data_shape = [0]


def _placeholder(dtype, device) -> torch.Tensor:
    key = (dtype, device)
    t = _placeholders.get(key)
    if t is None:
        t = _placeholders[key] = torch.empty(partitioned_param_data_shape, dtype=dtype, device=device)
    return t


def _alloc_partition(n: int, dtype, spec: PartitionSpec) -> torch.Tensor:
    t = torch.zeros(n, dtype=dtype, device=spec.partition_device)
    # through the accelerator: its pinning backend and deepspeed.utils.pin_memory_tracker see it,
    # and the strategy's destroy() can unpin it (on CUDA's default backend: t.pin_memory())
    return get_accelerator().pin_memory(t) if spec.pin_memory else t


def ds_summary(p, use_debug_name: bool = False) -> dict:
    """``param.ds_summary()`` (DeepSpeed's name): the partitioned parameter's state in one dict,
    for messages and debugging. ``use_debug_name`` is accepted; the id is the ``ds_id``."""
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(), "ds_numel": p.ds_numel,
            "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape), "requires_grad": p.requires_grad,
            "grad_shape": tuple(p.grad.shape) if p.grad is not None else None, "persist": p.ds_persist,
            "active_sub_modules": set(), "ds_tensor.shape": p.ds_tensor.shape if p.ds_tensor is not None else None}


class _Summary:
    """``p.ds_summary()``, holding ``p`` weakly: a bound method stored on the parameter would be a
    reference cycle that keeps dropped parameters (and their swap-file space) alive until a GC."""
    __slots__ = ("ref",)

    def __init__(self, p):
        self.ref = weakref.ref(p)

    def __call__(self, use_debug_name: bool = False) -> dict:
        return ds_summary(self.ref(), use_debug_name)


def convert_param(p: torch.nn.Parameter, spec: PartitionSpec, persist: bool = False, ds_id=None) -> None:
    """Turn ``p`` (holding its full value, identical on every rank) into a partitioned parameter."""
    full = p.data
    n, ws = full.numel(), spec.world_size
    s = partition_size(n, ws)
    p.ds_summary = _Summary(p)
    p.ds_id = next(_next_id) if ds_id is None else ds_id
    p.ds_shape = full.shape
    p.ds_numel = n
    p.ds_process_group = spec.comm.group
    p._z3 = spec
    p._z3_full = None
    p._z3_handle = None
    p._z3_holds = 0
    part = _alloc_partition(s, full.dtype, spec)
    lo, hi = spec.rank * s, min(n, (spec.rank + 1) * s)
    if hi > lo:
        part[:hi - lo].copy_(full.reshape(-1)[lo:hi])
    part.ds_numel = s
    p.ds_tensor = part
    p.ds_persist = bool(persist) or n == 0
    invalidate_fetch_lists()
    if p.ds_persist:
        p.ds_status = ZeroParamStatus.AVAILABLE
        if full.device != spec.device:
            p.data = full.to(spec.device)
    else:
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        p.data = _placeholder(full.dtype, spec.device)
        if spec.swapper is not None:   # written to NVMe now; p.ds_tensor becomes a storage-less placeholder
            spec.swapper.add_params([p])


@contextlib.contextmanager
def resident_partitions(params, write_back: bool = False, overwrite: bool = False):
    """Inside the block every parameter's ``ds_tensor`` holds its partition's data.

    The one entry point for code that reads or writes partitions outside a gather (the
    stage-3 master build and the copy of updated masters back into the partitions):
    NVMe-backed partitions (``offload_param.device: nvme``) are read in on entry and, with
    ``write_back``, written out again on exit, after which they may be evicted. Partitions
    in memory (GPU, CPU) are untouched: then this is a no-op. With ``overwrite`` the block
    writes every element of the partitions, so their old contents are not read from NVMe
    (it implies ``write_back``).
    """
    params = list(params)
    hooks = {id(p._z3.swapper): p._z3.swapper for p in params
             if is_zero_param(p) and getattr(p._z3, "swapper", None) is not None}
    held = []
    try:
        for sw in hooks.values():
            mine = [p for p in params if getattr(p._z3, "swapper", None) is sw]
            sw.make_resident(mine, read=not overwrite)
            held.append((sw, mine))
        yield
    finally:
        for sw, mine in held:
            sw.release_resident(mine, write_back or overwrite)


def owned_range(p):
    """(lo, hi) element range of the full flattened parameter owned by this rank."""
    s = p.ds_tensor.numel()
    lo = p._z3.rank * s
    return lo, max(lo, min(p.ds_numel, lo + s))


def set_partition_from_full(p, full: torch.Tensor) -> None:
    """Write this rank's slice of ``full`` (the whole parameter) into ``p.ds_tensor``."""
    lo, hi = owned_range(p)
    flat = full.reshape(-1)
    if is_quantized(p):   # a frozen weight kept quantized: quantize the new slice
        s = p.ds_tensor.numel()
        part = torch.zeros(s, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
        if hi > lo:
            part[:hi - lo].copy_(flat[lo:hi])
        block = p._z3_q[0].shape[1]
        p.ds_tensor = part
        quantize_partition(p, block)
        return
    with resident_partitions([p], overwrite=True):
        if hi > lo:
            p.ds_tensor[:hi - lo].copy_(flat[lo:hi])
        p.ds_tensor[hi - lo:].zero_()


def release_param(p, force: bool = False, rebind: bool = False) -> bool:
    """Drop the full copy of ``p`` (kept if persistent or held by GatheredParameters).

    The schedule's release frees the gathered storage in place, and the next gather refills
    that same storage, so views of it that autograd saved in forward are whole again in
    backward. ``rebind=True`` (GatheredParameters' exit, as DeepSpeed does it) only rebinds
    ``p.data``: a tensor the user took inside the block (``p.detach()``, ``p.data``) keeps
    its values, and the memory goes when the last such reference does."""
    if p.ds_persist or p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
        return False
    if p._z3_holds > 0 and not force:
        return False
    if p.ds_status == ZeroParamStatus.INFLIGHT:
        p._z3_handle.wait()
    p.data = _placeholder(p.ds_tensor.dtype, p._z3.device)
    if p.__dict__.get("_z3_alias"):      # a view of the partition (one rank): nothing to free
        p._z3_alias = False
    else:
        p._z3.gathered -= p.ds_numel
        if rebind:
            p._z3_full = None
        else:
            p._z3_full.untyped_storage().resize_(0)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    return True


def broadcast_and_repartition(params, src_rank: int) -> None:
    """After ``src_rank`` changed the (gathered) ``params``, give every rank its value and
    rewrite each rank's partition from it. Collective."""
    params = [p for p in params if is_zero_param(p)]
    if not params:
        return
    comm = params[0]._z3.comm
    comm.check(KIND_BROADCAST, [p.ds_id for p in params], sum(p.ds_numel for p in params),
               comm.describe(params))
    for p in params:
        data = p.data
        if tuple(data.shape) != tuple(p.ds_shape):
            raise RuntimeError(f"GatheredParameters: parameter {comm.describe([p])} changed shape from "
                               f"{tuple(p.ds_shape)} to {tuple(data.shape)} inside the block; "
                               f"a partitioned parameter's shape cannot change.")
        buf = data if data.is_contiguous() and data.device == p._z3.device else data.to(p._z3.device).contiguous()
        comm.broadcast(buf, src_rank)
        if buf is not data:
            data.copy_(buf)
        set_partition_from_full(p, buf)
        for fn in p._z3.listeners:
            fn(p)


# ---------------------------------------------------------------- module-level helpers

#: bumped whenever what a module fetches may change (a module's parameters set or deleted, a
#: parameter partitioned or made persistent, an external parameter registered): the cached
#: lists of :func:`module_params_to_fetch` are rebuilt after it moves
_FETCH_VERSION = [0]


def invalidate_fetch_lists() -> None:
    _FETCH_VERSION[0] += 1


def fetch_lists_version() -> int:
    """Moves whenever a module's parameters may have changed (caches of parameter lists key on it)."""
    return _FETCH_VERSION[0]


def module_params_to_fetch(module) -> list:
    """The partitioned, non-persistent params a module's forward needs: its own and the
    external ones registered on it. A ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``)
    fetches its whole subtree at once; the modules inside it fetch nothing themselves.
    The list is cached on the module (the hooks ask for it three times per module per step) and
    is shared: callers must not change it."""
    d = module.__dict__
    key = (_FETCH_VERSION[0], d.get("_z3_leaf"), d.get("_z3_inside_leaf"))
    cached = d.get("_z3_fetch_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    if d.get("_z3_inside_leaf"):
        out = []
    else:
        own = module.parameters() if d.get("_z3_leaf") else module._parameters.values()
        out = [p for p in own if p is not None and is_zero_param(p) and not p.ds_persist]
        ext = d.get("_external_params")
        if ext:
            out.extend(p for p in ext.values()
                       if is_zero_param(p) and not p.ds_persist and all(p is not q for q in out))
    d["_z3_fetch_cache"] = (key, out)
    return out


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Tell ZeRO-3 that ``module``'s forward uses ``parameter``, which belongs to another module,
    so it is gathered before ``module`` runs (and before its backward). May be called before
    the parameter is partitioned (in ``__init__``)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter: 'module' must be a torch.nn.Module, "
                        f"got {type(module).__name__}.")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: 'parameter' must be a torch.nn.Parameter, "
                        f"got {type(parameter).__name__}.")
    module.__dict__.setdefault("_external_params", {})[id(parameter)] = parameter
    invalidate_fetch_lists()


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    ext = module.__dict__.get("_external_params")
    if not ext or id(parameter) not in ext:
        raise ValueError("unregister_external_parameter: the parameter was not registered as external "
                         f"on {type(module).__name__}.")
    del ext[id(parameter)]
    invalidate_fetch_lists()
