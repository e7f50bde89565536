"""Checkpoint state and per-parameter access for :class:`FlatMasterOptimizer`.

Saving writes this rank's fragments in the shared format of
:mod:`deepspeed.runtime.checkpoint.universal`; loading reads whatever world size and
ZeRO stage wrote the checkpoint and copies exactly this rank's elements out of it.
The ``full_*`` / ``local_*`` methods implement the protocol
:mod:`deepspeed.utils.tensor_fragment` dispatches to (``param._ds_state_owner``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import comm as ds_comm
from ..checkpoint.universal import (FragmentIndex, load_torch_optimizer, make_rank_state, optim_file_name,
                                    split_param_state)
from ..comm.optimizer_hooks import load_rank_local_state, save_rank_local_state

ZERO_TO_FP32_SCRIPT = '''#!/usr/bin/env python
"""Consolidate the ZeRO checkpoint in this directory into one fp32 state dict.

    python zero_to_fp32.py <checkpoint_dir> <output_file> [-t TAG]

<checkpoint_dir> is this directory (or its parent with a 'latest' file). Needs deepspeed installed.
"""
import sys

from deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


class FlatStateMixin:
    """Needs the attributes FlatMasterOptimizer builds (layouts, fragments, masters, ...)."""

    # ------------------------------------------------------------------ where a fragment lives
    def _master_at(self, g, f):
        """(tensor, offset) of fragment ``f`` in the optimizer tensor that holds it."""
        k, off = self._frag_seg[id(f)]
        return self.opt_tensors[g][k], off

    def _slot_and_fragment(self, param):
        if not hasattr(self, "_by_param"):
            self._by_param = {}
            for g, (lay, frags) in enumerate(zip(self.layouts, self.fragments)):
                own = {id(f.slot): f for f in frags}
                for s in lay.slots:
                    self._by_param[id(s.param)] = (g, s, own.get(id(s)))
        if id(param) not in self._by_param:
            raise ValueError("This parameter is not trained by this engine (frozen, or not in its optimizer).")
        return self._by_param[id(param)]

    # ------------------------------------------------------------------ save
    def _rank_state(self, dp_rank: int, mp_rank: int) -> dict:
        params, groups, group_state = {}, [], []
        for g, (lay, frags) in enumerate(zip(self.layouts, self.fragments)):
            for f in frags:
                t, off = self._master_at(g, f)
                per_elem, _ = split_param_state(self.state.get(t, {}), t.shape)
                entry = params.setdefault(f.slot.name, {"shape": list(f.slot.shape), "fragments": []})
                entry["fragments"].append({
                    "offset": f.param_start, "numel": f.numel, "fp32": t.narrow(0, off, f.numel),
                    "state": {k: v.narrow(0, off, f.numel) for k, v in per_elem.items()}})
            hyper = self.param_groups[g] if self.inner is not None else {}
            groups.append(dict({k: v for k, v in hyper.items() if k != "params"}, params=[s.name for s in lay.slots]))
            first = self.opt_tensors[g][0] if self.opt_tensors[g] else None
            group_state.append(split_param_state(self.state.get(first, {}), first.shape)[1]
                               if first is not None else {})
        return make_rank_state(zero_stage=self.stage, dp_world_size=self.world, dp_rank=dp_rank, mp_rank=mp_rank,
                               dtype=self.dtype, params=params, param_groups=groups, group_state=group_state,
                               optimizer_class=type(self.inner).__name__ if self.inner is not None else None,
                               loss_scaler=self.scaler.state_dict(),
                               extra={"n_parts": self.n_parts, "grad_accum_dtype": str(self.grad_dtype),
                                      "frozen_params": [n for n, p in self.module.named_parameters()
                                                        if not p.requires_grad]})

    def state_dict(self) -> dict:
        """This rank's fragments (the content of its checkpoint file)."""
        mp = self.ctx.mpu.get_model_parallel_rank() if self.ctx.mpu is not None else 0
        return self._rank_state(self.part_rank, mp)

    def save_optimizer_state(self, writer, dp_rank, mp_rank):
        if self.partition_master or dp_rank == 0:   # unpartitioned state is identical on every rank
            writer.save(optim_file_name(dp_rank if self.partition_master else 0, mp_rank),
                        self._rank_state(dp_rank if self.partition_master else 0, mp_rank))
        if self.inner is not None:
            save_rank_local_state(self.inner, writer, dp_rank, mp_rank)   # 1-bit error buffers, per rank

    def write_checkpoint_extras(self, writer):
        writer.write_text("zero_to_fp32.py", ZERO_TO_FP32_SCRIPT, executable=True)

    # ------------------------------------------------------------------ load
    def load_state_dict(self, state_dict) -> None:
        """Accepts one rank state, or the list of every rank's states (any world size)."""
        whole = isinstance(state_dict, (list, tuple))
        states = list(state_dict) if whole else [state_dict]
        self._load_from_index(FragmentIndex("<state_dict>", states=states, complete=whole), True)

    def load_optimizer_state(self, reader, load_optimizer_states=True):
        mp = self.ctx.mpu.get_model_parallel_rank() if self.ctx.mpu is not None else 0
        # a reader may merge files itself (pipeline checkpoints: one set of files per stage)
        idx = reader.fragment_index(mp) if hasattr(reader, "fragment_index") else FragmentIndex(reader.path, mp_rank=mp)
        self._load_from_index(idx, load_optimizer_states)
        if load_optimizer_states and hasattr(self.inner, "load_rank_local_state_dict"):
            load_rank_local_state(self.inner, reader, self.rank, mp)   # 1-bit optimizers
            self.refresh_module_params()

    def _load_from_index(self, idx: FragmentIndex, load_optimizer_states: bool) -> None:
        # a whole checkpoint must know every trainable parameter; one rank's own state, its fragments
        idx.require([s.name for s in self.slots] if idx.complete
                    else sorted({f.slot.name for frags in self.fragments for f in frags}))
        for g, frags in enumerate(self.fragments):
            for f in frags:
                t, off = self._master_at(g, f)
                idx.read(f.slot.name, "fp32", f.param_start, f.numel, out=t.narrow(0, off, f.numel))
        if load_optimizer_states and self.inner is not None:
            load_torch_optimizer(self.inner, self._states_from_index(idx), idx.param_groups,
                                 f"loading '{idx.directory}'")
            saved = idx.loss_scaler
            if saved is not None and self.scaler.dynamic and saved.get("dynamic"):
                self.scaler.load_state_dict(saved)
        self.refresh_module_params()

    def _states_from_index(self, idx: FragmentIndex) -> dict:
        group_of = idx.group_of()
        states = {}
        for g, frags in enumerate(self.fragments):
            for f in frags:
                t, off = self._master_at(g, f)
                keys = idx.state_keys(f.slot.name)
                if not keys:
                    continue
                st = states.get(id(t))
                if st is None:
                    st = {k: torch.zeros_like(t) for k in keys}
                    st.update({k: (v.clone() if torch.is_tensor(v) else v)
                               for k, v in idx.group_state[group_of.get(f.slot.name, 0)].items()})
                    states[id(t)] = st
                for k in keys:
                    idx.read(f.slot.name, k, f.param_start, f.numel, out=st[k].narrow(0, off, f.numel))
        return states

    def after_module_load(self) -> None:
        """Module weights were loaded without optimizer state: masters follow the module."""
        for g, frags in enumerate(self.fragments):
            if self.masters[g] is None:
                continue
            for f in frags:
                t, off = self._master_at(g, f)
                t.narrow(0, off, f.numel).copy_(f.slot.param.detach().reshape(-1).narrow(0, f.param_start, f.numel))

    # ------------------------------------------------------------------ tensor_fragment protocol
    def _local(self, param, what: str, key: Optional[str] = None):
        g, slot, f = self._slot_and_fragment(param)
        if f is None:
            return None
        if what == "fp32":
            t, off = self._master_at(g, f)
            return t.narrow(0, off, f.numel)
        if what == "grad":
            post = self.predivide / self.average_over / self.scaler.cur_scale
            return self._fragment_grad(g, f).float() * post
        t, off = self._master_at(g, f)
        st = self.state.get(t, {})
        if key not in st:
            return None
        return st[key].narrow(0, off, f.numel)

    def _full(self, param, what: str, key: Optional[str] = None):
        g, slot, f = self._slot_and_fragment(param)
        local = self._local(param, what, key)
        present = torch.tensor([0.0 if (f is not None and local is None) else 1.0])
        out = torch.zeros(slot.numel, dtype=torch.float32, device=self.param_flats[g].device)
        if local is not None:
            out.narrow(0, f.param_start, f.numel).copy_(local)
        if self.partition_master and self.world > 1:
            out = ds_comm.to_comm_device(out, self.ctx.dp_group)
            present = ds_comm.to_comm_device(present, self.ctx.dp_group)
            dist.all_reduce(out, group=self.ctx.dp_group)
            dist.all_reduce(present, op=dist.ReduceOp.MIN, group=self.ctx.dp_group)
        if present.item() == 0:
            return None
        return out.view(slot.shape)

    def full_fp32_param(self, param):
        return self._full(param, "fp32")

    def full_grad(self, param):
        if not self._sync_enabled and param.grad is not None:
            # inside engine.no_sync() / coalesce_grad_reduction() the gradient is still the rank's own,
            # accumulated in param.grad (ZeRO-2 reduces it at the next synced backward): as DeepSpeed,
            # safe_get_full_grad returns that local, not yet reduced param.grad (no collective)
            return param.grad
        return self._full(param, "grad")

    def full_optimizer_state(self, param, key):
        return self._full(param, "state", key)

    def local_fp32_param(self, param):
        return self._local(param, "fp32")

    def local_grad(self, param):
        return self._local(param, "grad")

    def local_optimizer_state(self, param, key):
        return self._local(param, "state", key)

    def set_full_fp32_param(self, param, value):
        g, slot, f = self._slot_and_fragment(param)
        value = value.detach().reshape(-1)
        if f is not None:
            self.local_fp32_param(param).copy_(value.narrow(0, f.param_start, f.numel))
        with torch.no_grad():
            param.copy_(value.view(slot.shape))

    def set_full_optimizer_state(self, param, key, value):
        g, slot, f = self._slot_and_fragment(param)
        if f is not None:
            self._require_state(param, key).copy_(value.detach().reshape(-1).narrow(0, f.param_start, f.numel))

    def set_local_fp32_param(self, param, value):
        local = self.local_fp32_param(param)
        if local is not None:
            local.copy_(value.reshape(-1))
            g, slot, f = self._slot_and_fragment(param)
            with torch.no_grad():
                param.view(-1).narrow(0, f.param_start, f.numel).copy_(local)

    def set_local_grad(self, param, value):
        """This rank's reduced gradient fragment, given as :meth:`local_grad` returns it (averaged,
        unscaled): stored back with the reduction's scaling."""
        g, slot, f = self._slot_and_fragment(param)
        if f is None:
            return
        post = self.predivide / self.average_over / self.scaler.cur_scale
        frag = self._fragment_grad(g, f)
        frag.copy_((value.detach().reshape(-1).float() / post).to(frag.dtype))

    def set_full_grad(self, param, value):
        g, slot, f = self._slot_and_fragment(param)
        if f is not None:
            self.set_local_grad(param, value.detach().reshape(-1).narrow(0, f.param_start, f.numel))

    def set_local_optimizer_state(self, param, key, value):
        g, slot, f = self._slot_and_fragment(param)
        if f is not None:
            self._require_state(param, key).copy_(value.reshape(-1))

    def _require_state(self, param, key):
        local = self._local(param, "state", key)
        if local is None:
            raise KeyError(f"optimizer state '{key}' does not exist (yet) for this parameter. "
                           f"Optimizer state is created by the first optimizer step.")
        return local
