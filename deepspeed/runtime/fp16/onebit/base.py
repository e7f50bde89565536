"""What the three 1-bit optimizers share: the communication backend, the error-feedback
buffers, the warm-up/compressed switch the training strategy reads, and the rank-local
part of their checkpoint state.

The protocol with the training strategy (``runtime/zero/stage0.py``, the 16-bit flat
master in ``runtime/precision/``), read through :mod:`deepspeed.runtime.comm.optimizer_hooks`:

* ``gradient_allreduce_needed`` (bool, read before each accumulation boundary's backward):
  True while the strategy must average gradients itself (warm-up); False once the
  optimizer communicates in its own ``step()`` (compressed phase; 0/1 Adam's local steps
  communicate nothing at all).
* ``rank_local_state_dict()`` / ``load_rank_local_state_dict(sd)``: the state that differs
  between ranks (worker and server errors, 0/1 Adam's momentum accumulator and the
  parameters between synchronisations) plus the optimizer's own counters, written by every
  rank into its own checkpoint file.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ....config.errors import DeepSpeedConfigError
from ....utils.logging import logger

# comm_backend_name -> (module, class). 'hccl' (Ascend NPUs) has no implementation here.
BACKENDS = {
    "nccl": ("deepspeed.runtime.comm.nccl", "NcclBackend"),
    "compressed": ("deepspeed.runtime.comm.compressed", "CompressedBackend"),
    "mpi": ("deepspeed.runtime.comm.mpi", "MpiBackend"),
}


def make_backend(name: Optional[str], cuda_aware: bool, group, who: str):
    """The compressed-communication backend ``name`` over ``group``. ``None`` picks
    'nccl' when the group runs NCCL, else 'compressed'."""
    if not dist.is_available() or not dist.is_initialized():
        raise DeepSpeedConfigError(
            f"{who} needs torch.distributed initialised (deepspeed.initialize or deepspeed.init_distributed) "
            f"with at least 2 data-parallel ranks.")
    if name is None:
        name = "nccl" if "nccl" in str(dist.get_backend(group)).lower() else "compressed"
    key = str(name).lower()
    if key not in BACKENDS:
        raise DeepSpeedConfigError(
            f"optimizer.params.comm_backend_name {name!r} is not available ({who}). Valid: 'nccl' (NCCL groups), "
            f"'compressed' (any torch.distributed backend, gloo included), 'mpi' (needs mpi4py); "
            f"'hccl' (Ascend) is not built here.")
    mod_name, cls_name = BACKENDS[key]
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except ImportError as err:
        raise DeepSpeedConfigError(f"optimizer.params.comm_backend_name '{key}': {err}") from None
    return cls(cuda_aware) if key == "mpi" else cls(group=group)


class OnebitOptimizerBase(torch.optim.Optimizer):
    """Base of OnebitAdam, ZeroOneAdam, OnebitLamb (see the module docstring)."""

    owns_gradient_communication = True
    who = "1-bit optimizer"

    def __init__(self, params, defaults: dict, *, deepspeed=None, cuda_aware=False, comm_backend_name=None,
                 group=None):
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self.cuda_aware = cuda_aware
        if group is None and getattr(deepspeed, "mpu", None) is not None:
            group = deepspeed.mpu.get_data_parallel_group()
        self.comm_backend_handle = make_backend(comm_backend_name, cuda_aware, group, self.who)
        self.comm_backend_name = self.comm_backend_handle.name
        self.size = self.comm_backend_handle.size
        if self.size < 2:
            raise DeepSpeedConfigError(
                f"{self.who} compresses communication between data-parallel ranks, but the data-parallel world "
                f"has {self.size} rank. Launch at least 2 ranks, or use optimizer.type 'Adam' / 'Lamb' for "
                f"single-process training.")
        self.errors: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}

    # -- the protocol ----------------------------------------------------------------------
    @property
    def gradient_allreduce_needed(self) -> bool:
        raise NotImplementedError

    def _error_buffers(self, key: str, numel: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        buf = self.errors.get(key)
        if buf is None:
            buf = self.comm_backend_handle.new_errors(numel, device)
            self.errors[key] = buf
        return buf

    def reset_errors(self) -> None:
        for w, s in self.errors.values():
            w.zero_()
            s.zero_()

    def _compressed_average(self, key: str, t: torch.Tensor) -> torch.Tensor:
        w, s = self._error_buffers(key, t.numel(), t.device)
        return self.comm_backend_handle.compressed_allreduce(t, w, s)

    def _group_average(self, gi: int, tensors) -> list:
        """The compressed average of ``tensors`` (one group's), as one flat message: one
        compressed all-reduce per group and step, not per tensor. Returns views per tensor."""
        if len(tensors) == 1:
            flat = tensors[0].reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        key = f"group{gi}:{len(tensors)}:{flat.numel()}"   # a new set of live tensors gets new errors
        avg = self._compressed_average(key, flat)
        out, off = [], 0
        for t in tensors:
            out.append(avg[off:off + t.numel()].view_as(t))
            off += t.numel()
        return out

    def _param_keys(self):
        """(key, group, param) for every parameter, key stable across save/load."""
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                yield f"{gi}.{pi}", g, p

    # -- state ---------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        """Counters and flags of the subclass (same on every rank)."""
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def _rank_tensors(self) -> dict:
        """Rank-local tensors besides the errors (0/1 Adam)."""
        return {}

    def _load_rank_tensors(self, tensors: dict) -> None:
        pass

    def _phase_from_step(self) -> None:
        """Recompute the phase flags from the per-parameter step after a load."""

    def rank_local_state_dict(self) -> dict:
        return {"world_size": self.size, "rank": self.comm_backend_handle.rank, "optimizer": type(self).__name__,
                "errors": {k: [w.clone(), s.clone()] for k, (w, s) in self.errors.items()},
                "tensors": {k: v.clone() for k, v in self._rank_tensors().items()},
                "extra": self._extra_state()}

    def load_rank_local_state_dict(self, sd: Optional[dict], where: str = "") -> None:
        """Restore what :meth:`rank_local_state_dict` saved. ``None`` or a different world
        size: the counters are kept/recomputed, the errors start from zero (logged)."""
        self._phase_from_step()
        if sd is None:
            self.errors.clear()
            logger.warning(f"{self.who}: no compression state for this rank{where}; the error-feedback "
                           f"buffers start from zero.")
            return
        self._load_extra_state(sd.get("extra", {}))
        if sd.get("world_size") != self.size:
            self.errors.clear()
            self._load_rank_tensors({})   # rank-local tensors of another world do not apply
            logger.warning(f"{self.who}: checkpoint saved at data-parallel world size {sd.get('world_size')}, "
                           f"loading at {self.size}{where}: the error-feedback buffers are reset to zero.")
            return
        self.errors = {k: (w.to(self._device()).clone(), s.to(self._device()).clone())
                       for k, (w, s) in sd.get("errors", {}).items()}
        self._load_rank_tensors(sd.get("tensors", {}))

    def _device(self):
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def state_dict(self):
        sd = super().state_dict()
        sd["onebit"] = self.rank_local_state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        local = state_dict.pop("onebit", None)
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        super().load_state_dict(state_dict)
        # exp_avg_mask stays the one the training script gave (as DeepSpeed)
        for g, m in zip(self.param_groups, masks):
            if m is None:
                g.pop("exp_avg_mask", None)
            else:
                g["exp_avg_mask"] = m
        if local is not None:
            self.load_rank_local_state_dict(local)
        else:
            self._phase_from_step()
            self.errors.clear()

    def _first_step(self) -> int:
        for _, _, p in self._param_keys():
            st = self.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    @staticmethod
    def _apply_mask(group, t: torch.Tensor) -> None:
        mask = group.get("exp_avg_mask")
        if mask is not None:
            if mask.device != t.device:
                group["exp_avg_mask"] = mask = mask.to(t.device)
            t.mul_(mask)
