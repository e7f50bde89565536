"""``deepspeed.comm.comm_device`` / ``to_comm_device``, the collectives that send host-side
values (flags, counts, norms), and completed work handles from short-circuited async ops.

NCCL reduces device tensors only: a CPU tensor handed to a collective on an NCCL group
fails ("No backend type associated with device type cpu"), even in a world of one. Every
place that builds such a value on the host must move it with ``to_comm_device(t, group)``
first. There is no NCCL here, so the checks fake it:

* :class:`Spy` replaces ``deepspeed.comm.to_comm_device`` with a version that returns a
  *tagged* clone (the tag is the group it was placed for), and wraps torch.distributed's
  collectives so that a call made directly from one of the watched functions (``SITES``)
  is recorded, with a failure when its tensor did not come through ``to_comm_device`` for
  that same group - exactly the tensors NCCL would reject. The real gloo collective then
  runs on the tensor, so each site runs to the end and its result is checked too.
* The sites run at world size 2 (several return early in a world of one), in one spawned
  group; each ``test_site_*`` case checks that its site's collective really ran (at least
  one recorded call) and that none of its calls failed.
"""
from __future__ import annotations

import math
import os
import sys
import traceback
from collections import defaultdict

import pytest
import torch

from tests.helpers.dist import run_distributed

_TAG = "_ds_test_comm_group"
_MISSING = object()

# site name -> (file under deepspeed/, function that calls torch.distributed directly)
SITES = {
    "check_overflow": ("runtime/utils.py", "_reduce"),
    "grad_norm_mpu": ("runtime/utils.py", "_norm_of"),
    "global_grad_norm": ("runtime/utils.py", "global_grad_norm"),
    "partitioned_tensor_full": ("runtime/utils.py", "full"),
    "checkpoint_all_ok": ("runtime/checkpoint/engine_checkpoint.py", "_all_ok"),
    "flat_state_full": ("runtime/precision/flat_state.py", "_full"),
    "engine_broadcast_model": ("runtime/engine.py", "_broadcast_model"),
    "moe_step": ("moe/training.py", "step"),
    "moe_expert_norm": ("moe/training.py", "expert_aware_grad_norm"),
    "moe_capacity": ("moe/sharded_moe.py", "_max_over_group"),
    "comms_log_straggler": ("comm/comms_logging.py", "log_summary"),
    "zero_lst_from_rank0": ("runtime/zero/utils.py", "get_lst_from_rank0"),
    "sparse_attention_layout": ("ops/sparse_attention/sparse_self_attention.py", "get_layout"),
}
# torch.distributed collective -> the argument that must be on the communication device
_OPS = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
        "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input"}


def _ds_root() -> str:
    import deepspeed
    return os.path.dirname(os.path.abspath(deepspeed.__file__))


class Spy:
    """Fake "NCCL" placement check over gloo (see the module docstring)."""

    def __init__(self):
        self.calls = defaultdict(list)   # site -> [(op, failure or None)]
        self.placed = 0
        root = _ds_root()
        self._where = {(os.path.join(root, *path.split("/")), fn): name for name, (path, fn) in SITES.items()}

    def watch(self, name: str, filename: str, function: str) -> None:
        self._where[(os.path.abspath(filename), function)] = name

    @staticmethod
    def _norm(group):
        import torch.distributed as dist
        return dist.group.WORLD if group is None else group

    def install(self) -> "Spy":
        import inspect

        import torch.distributed as dist

        import deepspeed.comm as dc
        import deepspeed.comm.comm as dcc
        real_to = dcc.to_comm_device

        def to_comm_device(tensor, group=None):
            same = real_to(tensor, group)      # the real helper runs too (gloo: the CPU, no copy)
            assert same.device == tensor.device
            out = tensor.clone()
            setattr(out, _TAG, self._norm(group))
            self.placed += 1
            return out

        dc.to_comm_device = dcc.to_comm_device = to_comm_device
        for op, arg in _OPS.items():
            real = getattr(dist, op)
            setattr(dist, op, self._wrap(op, arg, real, inspect.signature(real)))
        return self

    def _wrap(self, op, arg, real, sig):
        def collective(*args, **kwargs):
            code = sys._getframe(1).f_code
            site = self._where.get((os.path.abspath(code.co_filename), code.co_name))
            if site is not None:
                bound = sig.bind(*args, **kwargs).arguments
                t, group = bound[arg], self._norm(bound.get("group"))
                placed = getattr(t, _TAG, _MISSING)
                if placed is _MISSING:
                    why = f"{op}: a {t.device.type} tensor that never went through to_comm_device"
                elif placed is not group:
                    why = f"{op}: placed with to_comm_device for another group than the collective's"
                else:
                    why = None
                self.calls[site].append((op, why))
            return real(*args, **kwargs)
        return collective

    def report(self, site: str, error=None) -> dict:
        return {"calls": list(self.calls.get(site, [])), "error": error}


# ============================================================================ helper
def test_comm_device_without_process_group_is_cpu(monkeypatch):
    import deepspeed.comm as dc
    import deepspeed.comm.comm as dcc
    # an earlier test in this process may have left a (gloo) group: look as if there were none
    monkeypatch.setattr(dcc, "is_initialized", lambda: False)
    assert dc.comm_device() == torch.device("cpu")
    t = torch.ones(2)
    assert dc.to_comm_device(t) is t


@pytest.mark.parametrize("backend,want", [
    ("nccl", torch.device("cuda", 3)),
    ("gloo", torch.device("cpu")),
    ("mpi", torch.device("cpu")),
    ("ccl", torch.device("cpu")),
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),
    ("cuda:nccl", torch.device("cuda", 3)),
    ("hccl", torch.device("hpu", 1)),
])
def test_comm_device_follows_the_group_backend(monkeypatch, backend, want):
    import torch.distributed as dist

    import deepspeed.accelerator as acc_mod
    import deepspeed.comm as dc
    import deepspeed.comm.comm as dcc

    class _Acc:  # an accelerator whose current device is hpu:1 (for backends other than nccl)
        def current_device_name(self):
            return "hpu:1"

    seen = []
    monkeypatch.setattr(dcc, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: seen.append(group) or backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(acc_mod, "get_accelerator", lambda: _Acc())
    g = object()
    assert dc.comm_device(g) == want
    assert seen == [g]                     # the backend of the group asked about, not the default one
    assert dc.comm_device() == want and seen[-1] is None


def test_to_comm_device_moves_only_when_needed(monkeypatch):
    import deepspeed.comm as dc
    import deepspeed.comm.comm as dcc
    t = torch.arange(3)
    monkeypatch.setattr(dcc, "comm_device", lambda group=None: torch.device("cpu"))
    assert dc.to_comm_device(t) is t
    monkeypatch.setattr(dcc, "comm_device", lambda group=None: torch.device("meta"))
    m = dc.to_comm_device(t)
    assert m.device.type == "meta" and m.shape == t.shape and t.device.type == "cpu"


# ============================================================================ async handles, world of one
def test_async_ops_without_process_group_return_completed_work(monkeypatch):
    import deepspeed.comm as dc
    import deepspeed.comm.comm as dcc
    monkeypatch.setattr(dcc, "is_initialized", lambda: False)   # whatever earlier tests left behind
    t = torch.ones(3)
    w = dc.all_reduce(t, async_op=True)
    assert w is not None and w.is_completed() and w.wait() in (True, None)
    assert dc.barrier(async_op=True).is_completed()
    assert dc.all_reduce(t) is None
    assert torch.equal(t, torch.ones(3))


def _async_body(rank, world):
    import torch.distributed as dist

    import deepspeed.comm as dc
    assert dist.get_world_size() == 1
    base = torch.arange(4, dtype=torch.float32)
    ops = {
        "all_reduce": lambda a: dc.all_reduce(base.clone(), async_op=a),
        "reduce": lambda a: dc.reduce(base.clone(), 0, async_op=a),
        "broadcast": lambda a: dc.broadcast(base.clone(), 0, async_op=a),
        "all_gather": lambda a: dc.all_gather([torch.empty(4)], base, async_op=a),
        "all_gather_into_tensor": lambda a: dc.all_gather_into_tensor(torch.empty(4), base, async_op=a),
        "reduce_scatter": lambda a: dc.reduce_scatter(torch.empty(4), [base], async_op=a),
        "reduce_scatter_tensor": lambda a: dc.reduce_scatter_tensor(torch.empty(4), base, async_op=a),
        "barrier": lambda a: dc.barrier(async_op=a),
    }
    out = {}
    for name, call in ops.items():
        w = call(True)
        assert w is not None, f"{name}(async_op=True) returned None"
        w.wait()
        assert w.is_completed(), name
        out[name] = type(w).__name__
        if name != "barrier":
            assert call(False) is None, name
    # the values still land (a world of one: the input itself)
    got = torch.empty(4)
    w = dc.all_gather_into_tensor(got, base, async_op=True)
    w.wait()
    assert torch.equal(got, base)
    # with the communication logger on, the handle is wrapped and wait() records the op
    dc.configure(enabled=True, prof_all=True)
    try:
        w = dc.all_reduce(base.clone(), async_op=True)
        w.wait()
        assert w.is_completed()
        recorded = "all_reduce" in dc.comms_logger.comms_dict
    finally:
        dc.configure(enabled=False)
    assert recorded
    return out


def test_async_ops_in_a_world_of_one_return_waitable_work():
    res = run_distributed(_async_body, 1, timeout=120)[0]
    assert set(res) >= {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"}


# ============================================================================ the sites, world of two
def _bare_cpu_all_reduce(group=None):   # what the old code did: a CPU tensor straight to the collective
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def _placed_all_reduce(group=None):
    import torch.distributed as dist

    import deepspeed.comm as dc
    t = dc.to_comm_device(torch.ones(1), group)
    dist.all_reduce(t, group=group)
    return t.item()


class _MPU:
    """A Megatron-style mpu whose model-parallel group is ``group`` (the whole world)."""

    def __init__(self, group, rank, world):
        self.group, self.rank, self.world = group, rank, world

    def get_model_parallel_world_size(self):
        return self.world

    def get_model_parallel_rank(self):
        return self.rank

    def get_model_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0


def _site_bodies(rank, world, spy, mp_group):
    import torch.distributed as dist
    import torch.nn as nn

    import deepspeed

    def check_overflow():
        from deepspeed.runtime.utils import CheckOverflow
        assert CheckOverflow().check_using_norm([1.0]) is False
        assert CheckOverflow(mpu=_MPU(mp_group, rank, world)).check_using_norm(
            [1.0 if rank == 0 else float("inf")]) is True

    def grad_norm_mpu():
        from deepspeed.runtime.utils import clip_grad_norm_, get_grad_norm
        p = nn.Parameter(torch.zeros(4))
        p.model_parallel = True
        p.grad = torch.full((4,), float(rank + 1))
        mpu = _MPU(mp_group, rank, world)
        assert math.isclose(get_grad_norm([p], mpu=mpu), math.sqrt(4 * 1 + 4 * 4))
        assert get_grad_norm([p], norm_type=float("inf"), mpu=mpu) == 2.0
        assert math.isclose(clip_grad_norm_([p], 100.0, mpu=mpu), math.sqrt(20))

    def global_grad_norm():
        from deepspeed.runtime.utils import global_grad_norm as ggn
        p = nn.Parameter(torch.zeros(4))
        p.model_parallel = True
        if rank == 0:
            p.grad = torch.full((4,), 2.0)
        # rank 1 holds no gradient: its local sum of squares is a CPU zero
        assert ggn([p], extra_group=mp_group) == 4.0
        assert ggn([p], mpu=_MPU(mp_group, rank, world)) == 4.0

    def partitioned_tensor_full():
        from deepspeed.runtime.utils import PartitionedTensor
        t = torch.arange(10, dtype=torch.float32).view(2, 5)
        pt = PartitionedTensor(t, group=None)
        assert pt.local_size() == 5
        assert torch.equal(pt.full(), t)

    def checkpoint_all_ok():
        from deepspeed.runtime.checkpoint.engine_checkpoint import _all_ok
        assert _all_ok(True) is True
        assert _all_ok(rank == 0) is False

    def zero_lst_from_rank0():
        from deepspeed.runtime.zero.utils import get_lst_from_rank0
        assert get_lst_from_rank0([rank, 7]) == [0, 7]

    def sparse_attention_layout():
        from deepspeed.ops.sparse_attention import DenseSparsityConfig, SparseSelfAttention
        attn = SparseSelfAttention(DenseSparsityConfig(num_heads=2, block=16), max_seq_length=64)
        if rank == 1:
            attn.master_layout.zero_()
        layout = attn.get_layout(64)
        assert int(layout.sum()) == 2 * 4 * 4   # rank 0's dense layout reached rank 1's buffer
        assert int(attn.master_layout.sum()) == 2 * 4 * 4

    def comms_log_straggler():
        import deepspeed.comm as dc
        dc.configure(enabled=True, prof_all=True)
        try:
            dc.all_reduce(torch.ones(8))
            text = dc.log_summary(show_straggler=True)
        finally:
            dc.configure(enabled=False)
        assert "straggler" in text and "all_reduce" in text

    def zero1_engine():   # engine_broadcast_model and flat_state_full
        from deepspeed.utils import safe_get_full_fp32_param
        torch.manual_seed(rank)   # different weights per rank: the engine broadcasts rank 0's
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config={"train_micro_batch_size_per_gpu": 2,
                                                  "zero_optimization": {"stage": 1}})
        every = [None] * world
        dist.all_gather_object(every, [p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(every[0], every[1]))
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x).square().mean())
        engine.step()
        for p in model.parameters():
            assert torch.equal(safe_get_full_fp32_param(p), p.detach().float())

    def moe_engine():     # moe_step and moe_capacity
        from tests.moe._model import TinyMoEGPT, batches
        model = TinyMoEGPT(ep_size=2, k=1, drop_tokens=False)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config={"train_micro_batch_size_per_gpu": 2,
                                                  "zero_optimization": {"stage": 1}})
        idx, lab = batches(1, world, 2, seed=3)[0]
        engine.backward(engine(idx[rank], lab[rank]))
        engine.step()
        norm = engine.get_global_grad_norm()
        every = [None] * world
        dist.all_gather_object(every, norm)
        assert norm is not None and math.isfinite(norm) and every[0] == every[1]

    def moe_expert_norm():
        from deepspeed.moe.training import ensure_expert_groups, expert_aware_grad_norm
        from tests.moe._model import TinyMoEGPT, batches
        model = TinyMoEGPT(ep_size=2, k=1)
        ensure_expert_groups(model)
        idx, lab = batches(1, 1, 2, seed=4)[0]      # the same tokens on both ranks
        model(idx[0], lab[0]).backward()
        norm = expert_aware_grad_norm(list(model.parameters()))
        every = [None] * world
        dist.all_gather_object(every, norm)
        assert math.isfinite(norm) and every[0] == every[1]

    return [("check_overflow", check_overflow), ("grad_norm_mpu", grad_norm_mpu),
            ("global_grad_norm", global_grad_norm), ("partitioned_tensor_full", partitioned_tensor_full),
            ("checkpoint_all_ok", checkpoint_all_ok), ("zero_lst_from_rank0", zero_lst_from_rank0),
            ("sparse_attention_layout", sparse_attention_layout), ("comms_log_straggler", comms_log_straggler),
            ("zero1_engine", zero1_engine), ("moe_engine", moe_engine), ("moe_expert_norm", moe_expert_norm)]


_RUNS = {"zero1_engine": ("engine_broadcast_model", "flat_state_full"),
         "moe_engine": ("moe_step", "moe_capacity")}


def _world2_body(rank, world):
    import torch.distributed as dist
    spy = Spy().install()
    # the harness itself: a bare CPU tensor is caught, a placed one passes
    spy.watch("selftest_bare", __file__, "_bare_cpu_all_reduce")
    spy.watch("selftest_placed", __file__, "_placed_all_reduce")
    mp_group = dist.new_group([0, 1])
    assert _bare_cpu_all_reduce() == 2.0 and _placed_all_reduce(mp_group) == 2.0
    errors = {}
    for name, body in _site_bodies(rank, world, spy, mp_group):
        try:
            body()
        except Exception:  # noqa: BLE001 - reported per site
            errors[name] = traceback.format_exc()
    out = {}
    for name in list(SITES) + ["selftest_bare", "selftest_placed"]:
        run = next((r for r, sites in _RUNS.items() if name in sites), name)
        out[name] = spy.report(name, errors.get(run))
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2_body, 2, timeout=300, pg_timeout=90)


def test_spy_catches_a_cpu_tensor_and_passes_a_placed_one(world2):
    for res in world2:
        bare, placed = res["selftest_bare"], res["selftest_placed"]
        assert len(bare["calls"]) == 1 and "never went through to_comm_device" in bare["calls"][0][1]
        assert placed["calls"] == [("all_reduce", None)]


@pytest.mark.parametrize("site", sorted(SITES))
def test_site_puts_its_tensor_on_the_comm_device(world2, site):
    for rank, res in enumerate(world2):
        got = res[site]
        assert got["error"] is None, f"rank {rank}: {site} failed:\n{got['error']}"
        assert got["calls"], f"rank {rank}: {site}'s collective never ran ({SITES[site]})"
        bad = [why for _, why in got["calls"] if why]
        assert not bad, f"rank {rank}: {site} ({SITES[site][0]}:{SITES[site][1]}): {bad}"
