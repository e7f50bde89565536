"""Module hooks that gather partitioned parameters just before they are used and release
them after (ZeRO stage 3's parameter schedule).

* forward: a pre-forward hook gathers the module's own partitioned parameters (plus
  external ones registered on it); a post-forward hook releases them unless the
  recorded trace says they are reused within ``stage3_max_reuse_distance`` elements
  (and ``stage3_max_live_parameters`` allows keeping them).
* backward: the post-forward hook puts a gradient hook on the module's outputs; when
  backward reaches them the parameters are gathered again. Trainable parameters are
  released as soon as their gradient has been accumulated (the strategy's grad hook
  calls :meth:`ParameterCoordinator.release_after_backward`); frozen ones when the
  gradient of the module's inputs is ready; whatever is left at the end of backward.
* prefetch: every gather is recorded. The next step follows the previous step's
  trace: while it matches, each gather also starts the asynchronous gathers of the
  next modules' parameters, up to ``stage3_prefetch_bucket_size`` elements. When the
  order differs (a data-dependent branch) prediction stops for the rest of the step
  and the new order is recorded; correctness never depends on the trace.
* NVMe (``offload_param.device: nvme``): the same prediction also submits the swap-in
  reads of the upcoming partitions (up to ``stage3_prefetch_bucket_size`` elements, into
  free swap buffers) without waiting; a prefetch gather takes only partitions already in
  memory or read earlier, and the gather that needs a partition waits for its read.

Forward run again inside backward (activation checkpointing) re-gathers through the
same pre-forward hook and does not release (backward does).

Parameters used outside their own module's forward (a parent reading a child's weight,
TRL's fused LM-head loss reading ``lm_head.weight`` inside the model's forward, shared
heads): every module's ``_parameters`` is a :class:`ZeROOrderedDict`, whose
``__getitem__`` (the lookup behind ``module.weight``) gathers a parameter that is not
available while a forward is running and registers it as an external parameter of the
innermost module being run (:data:`FWD_MODULE_STACK`). That module's post-forward hook
releases it, its backward hook gathers it again, and from the next step on its pre-forward
hook gathers it with its own. While that module runs, the parameter is pinned: the owner's
own post-forward (if the owner runs inside) does not release it. On the normal path (every
read inside the owner's forward, so the parameter is available) the cost is one Python
``__getitem__`` and one attribute check per read (``benchmarks/zero3_param_access.py``).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict

import torch

from .partitioned_param import (ZeroParamStatus, gather_params, invalidate_fetch_lists, module_params_to_fetch,
                                register_external_parameter, release_param, wait_available)

FWD, BWD = 0, 1
_WINDOW = 64            # trace events looked ahead for prefetching
_MAX_TRACE = 100_000    # events; longer recordings (no engine step boundary) are dropped


_AVAILABLE = ZeroParamStatus.AVAILABLE

#: the modules whose forward is running, innermost last, each with the coordinator that
#: hooked it: ``[(module, coordinator)]`` (DeepSpeed's name; its entries are the modules)
FWD_MODULE_STACK: list = []


class ZeROOrderedDict(OrderedDict):
    """A module's ``_parameters`` under ZeRO-3 (DeepSpeed's class): reading a parameter that is
    not available while a forward runs gathers it for the innermost running module, which
    takes it as an external parameter (see the module docstring). Outside any forward a
    read returns the parameter as it is (partitioned: use ``GatheredParameters``).
    ``_in_forward`` is kept for code that sets it; the running-forward stack decides."""

    def __init__(self, parent_module=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self):   # copy/pickle: same class, same parent module (DeepSpeed's contract)
        r0, _, *rest = super().__reduce__()
        return (r0, (self._parent_module,)) + tuple(rest)

    def __getitem__(self, key):
        param = dict.__getitem__(self, key)
        if FWD_MODULE_STACK and param is not None and getattr(param, "ds_status", _AVAILABLE) is not _AVAILABLE:
            _fetch_for_running_module(param)
        return param

    # what a module fetches is cached (module_params_to_fetch): any change of its parameters
    # invalidates the cached lists
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        invalidate_fetch_lists()

    def __delitem__(self, key):
        super().__delitem__(key)
        invalidate_fetch_lists()

    def pop(self, *args):
        invalidate_fetch_lists()
        return super().pop(*args)

    def popitem(self, last=True):
        invalidate_fetch_lists()
        return super().popitem(last)

    def clear(self):
        invalidate_fetch_lists()
        super().clear()


def _fetch_for_running_module(param) -> None:
    if torch.compiler.is_compiling():
        return
    i = len(FWD_MODULE_STACK) - 1   # inside a ZeRO-3 leaf module, the leaf fetches for its subtree
    while i > 0 and FWD_MODULE_STACK[i][0].__dict__.get("_z3_inside_leaf"):
        i -= 1
    module, coordinator = FWD_MODULE_STACK[i]
    coordinator.fetch_external(module, param)


def ensure_zero_ordered_dict(module: torch.nn.Module) -> None:
    """Make ``module._parameters`` a :class:`ZeROOrderedDict` (idempotent; DeepSpeed's helper).
    The container it replaces is kept as ``module._original_parameters`` on the first wrap."""
    params = module.__dict__.get("_parameters")
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if "_original_parameters" not in module.__dict__:
        module.__dict__["_original_parameters"] = params
    module.__dict__["_parameters"] = ZeROOrderedDict(module, params)
    invalidate_fetch_lists()


def _wrap_new_submodules(root: torch.nn.Module) -> None:
    """:func:`ensure_zero_ordered_dict` on every module under ``root`` that lacks it. Runs at
    every top-level forward, so it walks the ``_modules`` dicts directly (no generator per
    module, as ``modules()`` has)."""
    stack, seen = [root], set()
    while stack:
        m = stack.pop()
        d = m.__dict__
        if type(d.get("_parameters")) is not ZeROOrderedDict:
            ensure_zero_ordered_dict(m)
        for c in d.get("_modules", {}).values():
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                stack.append(c)


def _restore_parameters_dict(module: torch.nn.Module) -> None:
    params = module.__dict__.get("_parameters")
    if isinstance(params, ZeROOrderedDict):
        module.__dict__["_parameters"] = dict(params.items())
        module.__dict__.pop("_original_parameters", None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _iter_tensors(obj, depth=0):
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_tensors(v, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _iter_tensors(getattr(obj, f.name, None), depth + 1)


class ParameterCoordinator:
    """Installs the hooks on every submodule of ``module`` and owns the gather schedule."""

    def __init__(self, module: torch.nn.Module, prefetch_bucket_size: int, max_live_parameters: int,
                 max_reuse_distance: int):
        self.module = module
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live = int(max_live_parameters)
        self.max_reuse = int(max_reuse_distance)
        self.live = {}            # id(p) -> p gathered (or in flight) by this coordinator
        self.trace = []           # [(module, phase, params)] recorded in the previous step
        self.recording = []
        self.cursor = 0
        self.predicting = False
        self.positions = {}       # id(p) -> trace positions using p
        self.prefix = [0]         # prefix[i]: elements gathered by trace events before i
        self._fwd_pos = {}
        self.prefetch_handles = []
        self.gathers = 0          # synchronous gathers issued (tests/benchmarks read these)
        self.prefetches = 0
        self.peak_live_numel = 0  # most gathered elements alive at once (transient memory)
        self.hooks = []
        self.names = {}
        self.pinned = {}          # id(p) -> running modules that read p as an external parameter
        self.nvme = any(getattr(getattr(p, "_z3", None), "swapper", None) is not None for p in module.parameters())
        self._register_deepspeed_module(module)

    def _register_deepspeed_module(self, module) -> None:
        """Install the gather/release hooks on every submodule of ``module`` (DeepSpeed's
        ``DeepSpeedZeRoOffload`` method name: ``unwrap_model_for_generation`` re-registers
        the hooks it removed through it)."""
        for name, m in module.named_modules():
            self.names[id(m)] = name or type(m).__name__
            ensure_zero_ordered_dict(m)
            self.hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self.hooks.append(m.register_forward_hook(self._post_forward))

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for m in self.module.modules():
            _restore_parameters_dict(m)
        FWD_MODULE_STACK[:] = [e for e in FWD_MODULE_STACK if e[1] is not self]
        self.pinned.clear()

    _remove_module_hooks = remove   # DeepSpeed's name

    # DeepSpeed's DeepSpeedZeRoOffload attributes, read by tools and tests: the module hook
    # handles. Backward gathers hang off forward outputs per step, so there are no standing
    # backward module hooks to list.
    @property
    def forward_hooks(self) -> list:
        return self.hooks

    @forward_hooks.setter
    def forward_hooks(self, handles) -> None:
        self.hooks = list(handles)

    @property
    def backward_hooks(self) -> list:
        return []

    @backward_hooks.setter
    def backward_hooks(self, handles) -> None:
        for h in handles:
            h.remove()

    # -- step boundaries -------------------------------------------------------------------
    def new_step(self) -> None:
        """Start of a top-level forward: adopt what was recorded since the last one as the trace."""
        if self.recording and not self._same_as_trace(self.recording):
            self.trace = self.recording
            self.positions, self.prefix = {}, [0]
            for i, (_, _, params) in enumerate(self.trace):
                for p in params:
                    self.positions.setdefault(id(p), []).append(i)
                self.prefix.append(self.prefix[-1] + sum(p.ds_numel for p in params))
        self.recording = []
        self.cursor = 0
        self.predicting = bool(self.trace)
        self._fwd_pos.clear()
        if any(e[1] is self for e in FWD_MODULE_STACK):   # left by a forward that raised
            FWD_MODULE_STACK[:] = [e for e in FWD_MODULE_STACK if e[1] is not self]
        self.pinned.clear()

    def _same_as_trace(self, rec) -> bool:
        """The step just recorded ran the same gathers as the trace (the usual case): the trace's
        positions and prefix sums stand, nothing is rebuilt. Parameter lists are compared by
        identity (module_params_to_fetch hands out one cached list per module)."""
        t = self.trace
        if len(rec) != len(t):
            return False
        for a, b in zip(rec, t):
            if a[0] is not b[0] or a[1] != b[1]:
                return False
            if a[2] is not b[2] and (len(a[2]) != len(b[2]) or any(x is not y for x, y in zip(a[2], b[2]))):
                return False
        return True

    def end_backward(self) -> None:
        self.release_all()

    def release_all(self) -> None:
        for h in self.prefetch_handles:
            h.wait()
        self.prefetch_handles = []
        for p in list(self.live.values()):
            release_param(p)
        self.live = {id(p): p for p in self.live.values() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE}

    def live_numel(self) -> int:
        """Elements of this module's partitioned parameters gathered right now (each spec keeps
        the count as parameters are gathered and released; views of partitions cost nothing)."""
        specs = self._specs()
        return specs[0].gathered if len(specs) == 1 else sum(spec.gathered for spec in specs)

    def _specs(self):
        specs = self.__dict__.get("_spec_cache")
        if specs is None:
            specs = self._spec_cache = list({id(p._z3): p._z3 for p in self.module.parameters()
                                             if getattr(p, "_z3", None) is not None}.values())
        return specs

    def _nothing_to_prefetch(self) -> bool:
        """One rank, every partition on the compute device: gathers are views, prefetch is moot."""
        v = self.__dict__.get("_no_prefetch")
        if v is None:
            v = self._no_prefetch = all(
                s.world_size == 1 and s.swapper is None and s.partition_device == s.device for s in self._specs())
        return v

    # -- gathering -------------------------------------------------------------------------
    def fetch(self, module, phase: int, params) -> None:
        if len(self.recording) < _MAX_TRACE:
            self.recording.append((module, phase, params))   # not changed after: a cached list or a new one
        else:
            self.recording, self.trace, self.predicting = [], [], False
        pos = None
        if self.predicting:
            t = self.trace[self.cursor] if self.cursor < len(self.trace) else None
            if t is not None and t[0] is module and t[1] == phase:
                pos = self.cursor
                self.cursor += 1
            else:
                self.predicting = False
        if phase == FWD:
            self._fwd_pos[id(module)] = pos
        wait_available(params)
        if gather_params(params, what=lambda: f"module '{self.names.get(id(module), type(module).__name__)}' "
                         f"({'forward' if phase == FWD else 'backward'})", alias=True, secondary=True):
            self.gathers += 1
        for p in params:
            self.live[id(p)] = p
        if self.predicting:
            self._prefetch()
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel())

    def fetch_external(self, module, p) -> None:
        """``module``'s forward read ``p``, which it does not hold: gather ``p`` now, register
        it as ``module``'s external parameter (gathered with the module's own from now on,
        for its backward too) and pin it until ``module``'s forward ends."""
        ext = module.__dict__.get("_external_params")
        if not (ext and id(p) in ext) and all(q is not p for q in dict.values(module._parameters)):
            register_external_parameter(module, p)
            self.pinned[id(p)] = self.pinned.get(id(p), 0) + 1
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            name = self.names.get(id(module), type(module).__name__)
            if gather_params([p], what=f"a parameter read in module '{name}' outside its own module's forward",
                             alias=True, secondary=True):
                self.gathers += 1
        wait_available([p])
        self.live[id(p)] = p

    def _prefetch(self) -> None:
        if self._nothing_to_prefetch():
            return
        budget = min(self.prefetch_bucket_size, self.max_live - self.live_numel())
        if budget > 0:
            self._prefetch_gather(budget)
        if self.nvme:
            self._read_ahead()

    def _read_ahead(self) -> None:
        """Submit NVMe reads of the partitions the next modules need (no waiting)."""
        n, budget = 0, self.prefetch_bucket_size
        for j in range(self.cursor, min(len(self.trace), self.cursor + _WINDOW)):
            for p in self.trace[j][2]:
                sw = getattr(p._z3, "swapper", None)
                if sw is None or p.ds_status != ZeroParamStatus.NOT_AVAILABLE or sw.is_available(p):
                    continue
                n += p.ds_tensor.numel()
                if n > budget or sw.prefetch([p]) == 0:
                    return

    def _prefetch_gather(self, budget) -> None:
        todo, seen, n = [], set(), 0
        # every fetch rescans the trace from the cursor, so a parameter released after a scan
        # passed over one of its later uses is prefetched again by a later scan: nothing is
        # kept beyond stage3_max_reuse_distance for that (DeepSpeed keeps it: its prefetch
        # queue is consumed once per step)
        for j in range(self.cursor, min(len(self.trace), self.cursor + _WINDOW)):
            fits = True
            for p in self.trace[j][2]:
                if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or id(p) in seen:
                    continue
                if n + p.ds_numel > budget:
                    fits = False
                    break
                seen.add(id(p))
                todo.append(p)
                n += p.ds_numel
            if not fits:
                break
        if self.nvme:   # partitions still on NVMe are read ahead (_read_ahead) and gathered when needed
            todo = [p for p in todo if getattr(p._z3, "swapper", None) is None or p._z3.swapper.is_available(p)]
        if todo:
            h = gather_params(todo, async_op=True, what="prefetch of upcoming modules", alias=True, secondary=True)
            self.prefetch_handles = [x for x in self.prefetch_handles if not x.done] + ([h] if h is not None else [])
            self.prefetches += 1
            for p in todo:
                self.live[id(p)] = p

    def _keep_for_reuse(self, p, pos) -> bool:
        if pos is None or not self.predicting:
            return False
        where = self.positions.get(id(p))
        if not where:
            return False
        k = bisect.bisect_right(where, pos)
        if k >= len(where):
            return False
        # elements gathered until the reuse, the reused parameter's own included: with
        # stage3_max_reuse_distance 0 nothing is kept, even for the very next use (DeepSpeed's
        # unit tests pin a layer's parameters NOT_AVAILABLE right after its forward then)
        distance = self.prefix[where[k]] - self.prefix[pos + 1] + p.ds_numel
        return distance <= self.max_reuse and self.live_numel() <= self.max_live

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        if module is self.module and not _in_backward():
            self.new_step()   # also a step boundary for forwards that bypass the engine (generation)
            _wrap_new_submodules(module)   # submodules attached after initialize: DeepSpeed's prologue
            if self.predicting and not module_params_to_fetch(module):
                self._prefetch()   # the first modules' parameters are in flight before they run
        FWD_MODULE_STACK.append((module, self))
        ext = module.__dict__.get("_external_params")
        if ext:   # read by this module: kept while it runs, whoever else releases in between
            for k in ext:
                self.pinned[k] = self.pinned.get(k, 0) + 1
        params = module_params_to_fetch(module)
        if not params:
            return None
        self.fetch(module, FWD, params)
        if torch.is_grad_enabled():
            frozen = [p for p in params if not p.requires_grad]
            if frozen:
                self._release_frozen_after_input_grads(frozen, args)
        return None

    def _post_forward(self, module, args, output):
        self._pop_running(module)
        params = module_params_to_fetch(module)
        if not params:
            if module is self.module and not torch.is_grad_enabled() and not _in_backward():
                self.release_all()   # end of an inference forward
            return None
        if torch.is_grad_enabled():
            self._gather_before_backward(module, output)
        if not _in_backward():  # recomputation inside backward keeps them for the backward that follows
            pos = self._fwd_pos.pop(id(module), None)
            returned = {id(t) for t in _iter_tensors(output)}
            pinned = self.pinned
            for p in params:
                if id(p) not in returned and not (pinned and id(p) in pinned) and not self._keep_for_reuse(p, pos):
                    release_param(p)
            if module is self.module and not torch.is_grad_enabled():
                self.release_all()
        return None

    def _pop_running(self, module) -> None:
        for i in range(len(FWD_MODULE_STACK) - 1, -1, -1):
            if FWD_MODULE_STACK[i][0] is module and FWD_MODULE_STACK[i][1] is self:
                del FWD_MODULE_STACK[i:]   # entries above it belong to forwards that raised
                break
        ext = module.__dict__.get("_external_params")
        if ext:
            for k in ext:
                n = self.pinned.get(k, 0) - 1
                if n > 0:
                    self.pinned[k] = n
                else:
                    self.pinned.pop(k, None)

    def _gather_before_backward(self, module, output) -> None:
        outs = [t for t in _iter_tensors(output) if t.requires_grad and t.grad_fn is not None]
        if not outs:
            return
        state = [False]

        def hook(_grad):
            if not state[0]:
                state[0] = True
                self.fetch(module, BWD, module_params_to_fetch(module))
            return None

        for t in outs:
            t.register_hook(hook)

    def _release_frozen_after_input_grads(self, frozen, args) -> None:
        ins = [t for t in _iter_tensors(args) if t.requires_grad and t.grad_fn is not None]
        if not ins:
            return
        left = [len(ins)]

        def hook(_grad):
            left[0] -= 1
            if left[0] == 0:
                for p in frozen:
                    release_param(p)
            return None

        for t in ins:
            t.register_hook(hook)

    def release_after_backward(self, p) -> None:
        """A trainable parameter's gradient was accumulated: backward is done with it."""
        release_param(p)
