"""``deepspeed.zero.Init``, ``GatheredParameters`` and external-parameter registration.

``Init`` lets a model larger than one rank's memory be built: while the context is
active, every ``torch.nn.Module`` subclass's ``__init__`` is wrapped so that, as soon
as the outermost ``__init__`` of an instance returns, that module's new parameters
are made identical on every rank (broadcast from rank 0, so ranks need not share a
seed) and partitioned. Peak memory during construction is therefore one module's
parameters, not the model's. ``Module.apply`` is wrapped too, so weight-init
functions applied after construction (Hugging Face's ``post_init``) see gathered
weights and their effect is kept (rank 0's result is broadcast).

``GatheredParameters`` makes partitioned parameters whole inside a ``with`` block;
with ``modifier_rank`` the changes that rank made are broadcast and re-partitioned
on exit, otherwise they are discarded.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from .partitioned_param import (PartitionSpec, ZeroParamStatus, broadcast_and_repartition, convert_param,  # noqa: F401
                                gather_params, is_zero_param, partitioned_param_data_shape,
                                register_external_parameter, release_param, unregister_external_parameter,
                                wait_available)
from .stage3_comm import KIND_INIT, ZeroRankMismatchError, comm_for, digest  # noqa: F401

_DTYPE_NAMES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------- configuration helpers

def _compute_device():
    from ...accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    from ... import comm
    return acc.device(comm.get_local_rank())


def _read_config(config_dict_or_path, config):
    """(zero section, fp16 enabled, bf16 enabled, aio section) from a DeepSpeed config, or Nones."""
    src = config_dict_or_path if config_dict_or_path is not None else config
    if src is None:
        return None, False, False, None
    from ...config import DeepSpeedConfig
    if isinstance(src, DeepSpeedConfig):
        return src.zero, src.fp16_enabled, src.bfloat16_enabled, src.model.aio
    from ...config.base import parse_section
    from ...config.ds_config import load_config_source
    from ...config.sections import BF16Section, FP16Section, ZeroSection
    raw = load_config_source(src)
    zero = parse_section(ZeroSection, _resolved(raw.get("zero_optimization")), "zero_optimization")
    fp16 = parse_section(FP16Section, _resolved(raw.get("fp16")), "fp16")
    bf16 = parse_section(BF16Section, _resolved(raw.get("bf16") or raw.get("bfloat16")), "bf16")
    return zero, fp16.enabled, bf16.enabled, _resolved(raw.get("aio"))


def _resolved(section):
    """A config section without the "auto" values Hugging Face leaves for keys it fills in
    later (none of them matter to zero.Init); "auto" then means the key's default."""
    if not isinstance(section, dict):
        return section or {}
    return {k: _resolved(v) if isinstance(v, dict) else v for k, v in section.items() if v != "auto"}


def _nvme_swapper(zero, aio, dtype):
    key = "zero_optimization.offload_param.nvme_path"
    if zero is None or zero.offload_param is None or not zero.offload_param.nvme_path:
        raise ValueError(f"zero.Init(remote_device='nvme') needs {key}: pass config_dict_or_path with "
                         f"zero_optimization.offload_param {{'device': 'nvme', 'nvme_path': <a writable directory>}}.")
    from ..swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    return AsyncPartitionedParameterSwapper.from_config(zero.offload_param, aio, dtype=dtype)


def _ensure_dist():
    if dist.is_available() and not dist.is_initialized() and all(
            k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        from ... import comm
        comm.init_distributed(verbose=False)


# ---------------------------------------------------------------- tensor constructors under zero.Init
# While zero.Init is active, torch's tensor constructors make tensors on the compute
# device and, when no dtype is asked for, floating tensors in the Init dtype, so tensors
# a model constructor makes (buffers, initial values) land where its parameters do. The
# originals are kept under DeepSpeed's names (Transformers compares against
# ``_orig_torch_arange``), and the wrapper is looked up by its module-level name at each
# entry, so a client may replace ``zero_wrapper_for_fp_tensor_constructor`` (Transformers
# does, to keep RoPE ``arange`` buffers in fp32).
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


def get_accelerator():
    """The accelerator (DeepSpeed's module-level name; Transformers reads it from here)."""
    from ...accelerator import get_accelerator as _get
    return _get()


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """``fn`` (a torch tensor constructor) made to default ``device`` to ``target_device``
    and to cast a floating result to ``target_fp_dtype`` when the caller gave no dtype
    (an explicit ``dtype=`` is kept; DeepSpeed casts it too, which is why Transformers
    replaces this wrapper for ``arange``)."""

    @functools.wraps(fn)
    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        explicit_dtype = kwargs.get("dtype") is not None
        tensor = fn(*args, **kwargs)
        if (target_fp_dtype is not None and not explicit_dtype and tensor.is_floating_point()
                and tensor.dtype != target_fp_dtype):
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    wrapped_fn._z3_constructor_wrapper = True
    return wrapped_fn


def _patch_tensor_constructors(dtype, device):
    target_device = device if device is not None and torch.device(device).type != "cpu" else None
    wrapper = globals()["zero_wrapper_for_fp_tensor_constructor"]   # the current one (clients may replace it)
    for name in _CONSTRUCTORS:
        setattr(torch, name, wrapper(globals()[f"_orig_torch_{name}"], target_fp_dtype=dtype,
                                     target_device=target_device))


def _unpatch_tensor_constructors():
    for name in _CONSTRUCTORS:
        setattr(torch, name, globals()[f"_orig_torch_{name}"])


# ---------------------------------------------------------------- zero.Init

_active = []          # stack of active Init contexts
_patched = []         # (class, original __init__) pairs
_orig_apply = None
_orig_init_subclass = None


def _wrap_init(cls):
    orig = cls.__dict__["__init__"]
    if getattr(orig, "_z3_wrapped", False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        d = self.__dict__
        d["_z3_init_depth"] = d.get("_z3_init_depth", 0) + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            d["_z3_init_depth"] -= 1
        if d["_z3_init_depth"] == 0:
            del d["_z3_init_depth"]
            if _active:
                _active[-1]._partition_module(self)

    __init__._z3_wrapped = True
    cls.__init__ = __init__
    _patched.append((cls, orig))


def _all_module_classes():
    seen, todo = set(), [torch.nn.Module]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        todo.extend(c.__subclasses__())
    return seen


def _init_subclass(cls, **kwargs):
    if "__init__" in cls.__dict__:
        _wrap_init(cls)


def _apply_gathered(self, fn):
    """``Module.apply`` under zero.Init: run ``fn`` on each module with its own partitioned
    parameters gathered; rank 0's result is kept on every rank."""
    for m in self.children():
        m.apply(fn)
    params = [p for p in self._parameters.values() if p is not None and is_zero_param(p)]
    if params:
        with GatheredParameters(params, modifier_rank=0):
            fn(self)
    else:
        fn(self)
    return self


def _patch():
    global _orig_apply, _orig_init_subclass
    for cls in _all_module_classes():
        if "__init__" in cls.__dict__:
            _wrap_init(cls)
    _orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
    torch.nn.Module.__init_subclass__ = classmethod(_init_subclass)
    _orig_apply = torch.nn.Module.apply
    torch.nn.Module.apply = _apply_gathered


def _unpatch():
    global _orig_apply, _orig_init_subclass
    while _patched:
        cls, orig = _patched.pop()
        cls.__init__ = orig
    if _orig_init_subclass is not None:
        torch.nn.Module.__init_subclass__ = _orig_init_subclass
        _orig_init_subclass = None
    elif "__init_subclass__" in torch.nn.Module.__dict__:
        del torch.nn.Module.__init_subclass__
    if _orig_apply is not None:
        torch.nn.Module.apply = _orig_apply
        _orig_apply = None


def _contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None):
    """The error message for zero.Init resolving a one-rank group while the launcher started several
    processes (``WORLD_SIZE`` > 1 in ``env``, default ``os.environ``), else None. That happens when
    something initialized a one-process group before zero.Init (e.g. ``from_pretrained`` ahead of
    ``deepspeed.init_distributed()``): nothing would be partitioned and every rank would build the
    whole model. A group the caller passed explicitly is taken as meant; an unreadable WORLD_SIZE is
    ignored (DeepSpeed 0.19's check)."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init: the process group has 1 rank but the launcher set WORLD_SIZE={launched}, so the "
            "parameters would not be partitioned (every rank would hold the whole model). A one-process group "
            "was probably initialized before zero.Init (e.g. a model's from_pretrained ran before "
            "deepspeed.init_distributed()): call deepspeed.init_distributed() first, or pass "
            "data_parallel_group= if a one-rank group is intended.")


class Init:
    """Construct modules already partitioned across the data-parallel group.

    ``remote_device``: where partitions live (``"cpu"`` keeps them in host memory, ``"nvme"``
    writes each module's partitions to swap files under ``offload_param.nvme_path`` as soon
    as it is built, so the whole model never exists in memory; default:
    ``zero_optimization.offload_param.device`` from the config, else the accelerator).
    ``param_swapper``: an ``AsyncPartitionedParameterSwapper`` to put the partitions in
    (implies NVMe).
    ``dtype``: cast floating-point parameters (default: fp16/bf16 when the config enables
    it, else unchanged). ``mem_efficient_linear`` is accepted for compatibility: gathered
    parameters keep their storage object across release/regather, so ``F.linear`` needs no
    replacement. Also usable on an existing module: ``zero.Init(module=model)``.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None,
                 param_swapper=None):
        self.enabled = bool(enabled)
        if not self.enabled:
            return
        if zero_param_parallel_group is not None:
            raise ValueError("zero.Init: zero_param_parallel_group (hpZ) is not supported by this deepspeed; "
                             "leave it None.")
        if dtype is not None and dtype not in _DTYPE_NAMES:
            raise ValueError(f"zero.Init: 'dtype' must be one of torch.float16, torch.bfloat16, torch.float32, "
                             f"got {dtype!r}.")
        zero, fp16, bf16, aio = _read_config(config_dict_or_path, config)
        _ensure_dist()
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        if data_parallel_group is None and sequence_data_parallel_group is not None:
            data_parallel_group = sequence_data_parallel_group
        contradiction = _contradicting_single_rank_pg_error(
            dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1, data_parallel_group)
        if contradiction is not None:
            raise RuntimeError(contradiction)
        self.dtype = dtype if dtype is not None else (torch.float16 if fp16 else torch.bfloat16 if bf16 else None)
        off_dev = zero.offload_param_device if zero is not None else "none"
        if remote_device in (None, "none"):
            remote_device = off_dev if off_dev in ("cpu", "nvme") else None
        nvme = str(remote_device) == "nvme" or param_swapper is not None
        if zero is not None and zero.offload_param is not None and zero.offload_param.pin_memory:
            pin_memory = True
        self.device = _compute_device()
        part_dev = torch.device("cpu") if str(remote_device) in ("cpu", "nvme") or nvme else self.device
        self.spec = PartitionSpec(comm_for(data_parallel_group), self.device, part_dev, pin_memory)
        # ZeRO++ flags: zero.Init's own gathers (while building) stay full precision; the engine
        # applies qwZ to every later gather and keeps frozen weights quantized (it also reads
        # both keys from its config)
        self.spec.quantized_weights = bool(zero_quantized_weights)
        self.spec.quantize_frozen = bool(zero_quantized_nontrainable_weights)
        if nvme:   # ZeRO-Infinity: each module's partitions go to swap files as it is built
            self.spec.swapper = param_swapper if param_swapper is not None else \
                _nvme_swapper(zero, aio, self.dtype or torch.float32)
        self._device_ctx = None
        if module is not None:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"zero.Init: 'module' must be a torch.nn.Module, got {type(module).__name__}.")
            self._partition_module(module)

    def __enter__(self):
        if not self.enabled:
            return self
        if not _active:
            _patch()
            _patch_tensor_constructors(self.dtype, self.device)
        _active.append(self)
        if self.device.type != "cpu":
            self._device_ctx = torch.device(self.device)
            self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        if self._device_ctx is not None:
            self._device_ctx.__exit__(*exc)
            self._device_ctx = None
        _active.remove(self)
        if not _active:
            _unpatch_tensor_constructors()
            _unpatch()
        return False

    def _partition_module(self, module: torch.nn.Module) -> None:
        """Make ``module``'s not-yet-partitioned parameters identical on all ranks, then partition them."""
        _materialize_meta(module, self.device)
        new, seen = [], set()
        for p in module.parameters():
            if not is_zero_param(p) and id(p) not in seen:
                seen.add(id(p))
                new.append(p)
        for b in module.buffers():  # dtype: set at construction (the wrapped constructors), kept here
            if b.device != self.device:
                b.data = b.data.to(self.device)
        if not new:
            return
        for p in new:
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            if p.device != self.device:
                p.data = p.data.to(self.device)
        comm = self.spec.comm
        comm.check(KIND_INIT, [p.numel() for p in new], sum(p.numel() for p in new),
                   f"{type(module).__name__} ({len(new)} new parameters)")
        for p in new:
            comm.broadcast(p.data, 0)  # ranks need not share a seed: rank 0's init wins
            convert_param(p, self.spec)


def _materialize_meta(module: torch.nn.Module, device: torch.device) -> None:
    """Give meta-device parameters and buffers (``with torch.device("meta")``, ``init_empty_weights``)
    real storage on ``device`` before partitioning. DeepSpeed's zero.Init fails here with "Cannot copy
    out of meta tensor"; we initialise instead: a submodule whose own tensors were all on meta gets
    its ``reset_parameters()`` (the values its constructor would have drawn; rank 0's are broadcast),
    anything else starts at zero with a warning to load weights. Tied tensors stay tied."""
    replaced = {}
    for sub in module.modules():
        own = [(d, n, t) for d in (sub._parameters, sub._buffers) for n, t in d.items() if t is not None]
        if not any(t.is_meta for _, _, t in own):
            continue
        for d, n, t in own:
            if not t.is_meta:
                continue
            if id(t) not in replaced:
                data = torch.zeros(t.shape, dtype=t.dtype, device=device)
                replaced[id(t)] = (torch.nn.Parameter(data, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else data)
            d[n] = replaced[id(t)]
        reset = getattr(sub, "reset_parameters", None)
        if all(t.is_meta for _, _, t in own) and callable(reset):
            with torch.no_grad():
                reset()
        elif any(isinstance(t, torch.nn.Parameter) and t.is_meta for _, _, t in own):
            from ...utils.logging import logger
            logger.warning(f"zero.Init: {type(sub).__name__} had meta-device parameters and no "
                           f"reset_parameters(); they start at zero: load the weights before training.")


# ---------------------------------------------------------------- GatheredParameters

class GatheredParameters:
    """Gather partitioned parameters for the duration of a ``with`` block (collective: call it
    on every rank of the group).

    ``modifier_rank`` (a global rank): changes that rank makes inside the block are broadcast
    to every rank and re-partitioned on exit; with None, changes are discarded. ``fwd_module``:
    also register the parameters as external parameters of that module. Parameters that are
    not partitioned are left alone.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None:
            params = []
        else:
            params = list(params)
        self.params, seen = [], set()
        for p in params:
            if is_zero_param(p) and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.enabled = bool(enabled) and bool(self.params)
        if modifier_rank is not None and not isinstance(modifier_rank, int):
            raise TypeError(f"GatheredParameters: 'modifier_rank' must be an int rank or None, got {modifier_rank!r}.")
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._was_available = ()

    def __enter__(self):
        if not self.enabled:
            return None
        wait_available(self.params)
        self._was_available = [p.ds_status == ZeroParamStatus.AVAILABLE for p in self.params]
        for p in self.params:
            p._z3_holds += 1
        try:
            gather_params(self.params, what=f"GatheredParameters({self.params[0]._z3.comm.describe(self.params)})")
        except BaseException:
            for p in self.params:
                p._z3_holds -= 1
            raise
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        return None

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        try:
            if self.modifier_rank is not None and exc_type is None:
                comm = self.params[0]._z3.comm
                src = self.modifier_rank
                if comm.active and comm.group is not None:
                    try:
                        src = dist.get_group_rank(comm.group, self.modifier_rank)
                    except ValueError:
                        src = -1
                    if src < 0:
                        raise ValueError(
                            f"GatheredParameters: modifier_rank {self.modifier_rank} (a global rank) is not in the "
                            f"parameters' data-parallel group {dist.get_process_group_ranks(comm.group)}.")
                broadcast_and_repartition(self.params, src)
        finally:
            for p, was in zip(self.params, self._was_available):
                p._z3_holds -= 1
                if not was and p._z3_holds == 0:
                    release_param(p, rebind=True)   # a p.detach() taken inside stays valid
        return False
