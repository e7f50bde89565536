"""Per-parameter access to stage-3 training state for :mod:`deepspeed.utils.tensor_fragment`
(``safe_get_full_fp32_param`` and friends).

The stage-3 strategy sets ``param._ds_state_owner`` to itself for every trainable
parameter; this mixin answers the protocol from the strategy's partitions. A rank's
*fragment* of a parameter is the elements it owns, padding excluded. ``full_*``
getters are collective (every data-parallel rank calls them for the same parameter):
one checked all-gather of the padded partition plus a presence flag.
"""
from __future__ import annotations

import torch

from .partitioned_param import ZeroParamStatus, owned_range, resident_partitions
from .stage3_comm import KIND_GATHER


class Stage3StateAccess:
    """Mixed into DeepSpeedZeroOptimizer_Stage3 (needs ``parts``, ``inner``, ``comm``, ``spec``)."""

    def _where(self, p):
        c, off, _ = self.parts.slot[id(p)]
        lo, hi = owned_range(p)
        return c, off, hi - lo, lo

    def _local(self, p, what, key=None):
        if id(p) not in self.parts.slot:
            return None
        c, off, k, _ = self._where(p)
        if k <= 0:
            # this rank owns none of the parameter (a small one at a larger world size): an empty
            # fragment, as DeepSpeed returns its (padding-only) partition, not None, which means
            # "no state for this parameter" (frozen, or optimizer state not created yet)
            k = 0
        if what != "grad" and self.parts.nvme is not None:   # offload_optimizer nvme: a copy from the swap file
            return self.parts.nvme.read_fragment(c, off, k, what, key)
        if what == "fp32":
            return c.master[off:off + k]
        if what == "grad":
            scale = self.scaler.loss_scale if self.fp16 else 1.0
            return c.grad[off:off + k].float() / scale
        st = self.inner.state.get(c.master, {}) if self.inner is not None else {}
        return st[key][off:off + k] if key in st else None

    @torch.no_grad()   # masters may require grad (optimizer leaves); the gather is plain data movement
    def _full(self, p, what, key=None):
        s = p.ds_tensor.numel()
        local = self._local(p, what, key)
        owns = id(p) in self.parts.slot and self._where(p)[2] > 0
        buf = torch.zeros(s + 1, dtype=torch.float32, device=self.spec.device)
        if local is not None:
            buf[:local.numel()].copy_(local)
        buf[s] = 0.0 if (owns and local is None) else 1.0
        ws = self.comm.world_size
        out = torch.empty(ws * (s + 1), dtype=torch.float32, device=buf.device)
        self.comm.check(KIND_GATHER, [p.ds_id], ws * (s + 1), f"safe_get_full_*({self.comm.describe([p])})")
        self.comm.all_gather_into(out, buf)
        rows = out.view(ws, s + 1)
        if bool((rows[:, s] == 0).any()):
            return None
        return rows[:, :s].reshape(-1)[:p.ds_numel].view(p.ds_shape).clone()

    def full_fp32_param(self, p):
        return self._full(p, "fp32")

    def full_grad(self, p):
        return self._full(p, "grad")

    def full_optimizer_state(self, p, key):
        return self._full(p, "state", key)

    def local_fp32_param(self, p):
        return self._local(p, "fp32")

    def local_grad(self, p):
        return self._local(p, "grad")

    def local_optimizer_state(self, p, key):
        return self._local(p, "state", key)

    # -- setters ---------------------------------------------------------------------------
    def set_local_grad(self, p, value):
        """This rank's gradient fragment, given unscaled (the loss scale is applied back); empty
        where the rank owns none of the parameter."""
        if id(p) not in self.parts.slot:
            return
        c, off, k, _ = self._where(p)
        if k > 0:
            scale = self.scaler.loss_scale if self.fp16 else 1.0
            c.grad[off:off + k].copy_(value.detach().reshape(-1)[:k].to(c.grad.dtype) * scale)

    def set_full_grad(self, p, value):
        if id(p) in self.parts.slot:
            _, _, k, lo = self._where(p)
            if k > 0:
                self.set_local_grad(p, value.detach().reshape(-1)[lo:lo + k])

    def _sync_partition(self, p) -> None:
        """After this rank's master fragment changed: the param partition follows."""
        c, off, k, _ = self._where(p)
        if c.lp is None and k > 0:   # NVMe-backed partitions (stage3_nvme_params): no flat copy
            with resident_partitions([p], write_back=True):
                p.ds_tensor[:k].copy_(c.master[off:off + k])
        elif c.lp is not c.master and k > 0:
            c.lp[off:off + k].copy_(c.master[off:off + k])

    def set_full_fp32_param(self, p, value):
        value = value.detach().reshape(-1)
        if id(p) in self.parts.slot:
            c, off, k, lo = self._where(p)
            if k > 0 and self.parts.nvme is not None:   # into the swap file and the partitions
                self.parts.nvme.write_fragment(c, off, k, "fp32", None, value[lo:lo + k])
            elif k > 0:
                c.master[off:off + k].copy_(value[lo:lo + k])
                self._sync_partition(p)
        if p.ds_persist or p.ds_status == ZeroParamStatus.AVAILABLE:
            with torch.no_grad():
                p.data.copy_(value.view(p.ds_shape))

    def set_full_optimizer_state(self, p, key, value):
        if self._nvme_write(p, "state", key, lambda lo, k: value.detach().reshape(-1)[lo:lo + k]):
            return
        local = self._require_state(p, key)
        if local is not None:
            _, _, k, lo = self._where(p)
            local.copy_(value.detach().reshape(-1)[lo:lo + k])

    def set_local_fp32_param(self, p, value):
        if not self._nvme_write(p, "fp32", None, lambda lo, k: value.reshape(-1)):
            local = self._local(p, "fp32")
            if local is None:
                return
            local.copy_(value.reshape(-1))
            self._sync_partition(p)
        if p.ds_persist:
            self._persistent_stale = True   # whole copies are re-gathered before the next forward

    def set_local_optimizer_state(self, p, key, value):
        if self._nvme_write(p, "state", key, lambda lo, k: value.reshape(-1)):
            return
        local = self._require_state(p, key)
        if local is not None:
            local.copy_(value.reshape(-1))

    def _nvme_write(self, p, what, key, value) -> bool:
        """With offload_optimizer nvme: write this rank's fragment (``value(lo, k)``) through
        the swapper and return True; otherwise False."""
        if self.parts.nvme is None:
            return False
        if id(p) in self.parts.slot:
            c, off, k, lo = self._where(p)
            if k > 0:
                self.parts.nvme.write_fragment(c, off, k, what, key, value(lo, k))
        return True

    def _require_state(self, p, key):
        if id(p) not in self.parts.slot or self._where(p)[2] <= 0:
            return None
        local = self._local(p, "state", key)
        if local is None:
            raise KeyError(f"optimizer state '{key}' does not exist (yet) for this parameter. "
                           f"Optimizer state is created by the first optimizer step.")
        return local
