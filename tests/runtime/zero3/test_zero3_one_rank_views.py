"""ZeRO-3 on one rank: a partition is the whole parameter, so the schedule's gather makes the
parameter a view of it (no copy). The view is made once and reused while the partition is the
same memory; a partition replaced by other memory is seen by the next forward."""
from __future__ import annotations

import math

import torch

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import lm_batches, make_lm, plain_reference, stage3_config, train_engine

LR = 0.02


def _body(rank, ws):
    batches = lm_batches(3, 2)
    eng = train_engine(make_lm(seed=0), stage3_config(gas=1, mb=2), batches, rank, ws, LR)
    m = eng.module
    fc1 = m.blocks[0].fc1
    seen = {}

    def probe(mod, args):
        w = mod.weight
        seen.setdefault("ptrs", []).append(w.data_ptr() == w.ds_tensor.data_ptr())
        seen.setdefault("values", []).append(w.detach().clone())
    h = fc1.register_forward_pre_hook(probe)
    x, y = batches[0]
    trained = {k: v.detach().clone() for k, v in _full_state(m).items()}
    with torch.no_grad():
        eng(x, y)
        eng(x, y)
        # the partition replaced by other memory (as a load or a move may do): the cached view is stale
        fc1.weight.ds_tensor.data = torch.full_like(fc1.weight.ds_tensor, 0.5)
        eng(x, y)
    h.remove()
    out = {"ptrs": seen["ptrs"], "last": seen["values"][-1], "first": seen["values"][0],
           "state": trained,
           "status_after": fc1.weight.ds_status.name, "shape_after": tuple(fc1.weight.shape)}
    eng.destroy()
    return out


def _full_state(m):
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_one_rank_parameters_are_views_of_partitions_and_follow_a_replaced_partition():
    res = run_distributed(_body, 1, timeout=120)[0]
    ref = plain_reference(make_lm(seed=0), lm_batches(3, 2), LR)
    for n, v in res["state"].items():
        if n in ref:
            torch.testing.assert_close(v, ref[n], rtol=1e-5, atol=1e-6)
    assert res["ptrs"] == [True, True, True]   # a view of the partition in every forward, no copy
    assert torch.equal(res["last"], torch.full_like(res["last"], 0.5))
    assert not torch.equal(res["first"], res["last"])
    assert res["status_after"] == "NOT_AVAILABLE" and res["shape_after"] == (0,)


def _direct_body(rank, ws):
    """One rank: gradients go straight into the partitions' gradients (no bucket), with
    accumulation over micro-batches and bf16; the per-module fetch lists are cached and follow
    changes of a module's parameters."""
    from deepspeed.runtime.zero.partitioned_param import (module_params_to_fetch, register_external_parameter,
                                                          unregister_external_parameter)
    out = {}
    batches = lm_batches(2, 4)
    eng = train_engine(make_lm(seed=0), stage3_config(gas=2, mb=2), batches, rank, ws, LR)
    out["direct"], out["launches"] = eng.optimizer.reducer.direct, eng.optimizer.reducer.launches
    out["state_gas2"] = _full_state(eng.module)
    # the profiler sees the gradient adds as a named range; without a profiler none is opened
    x, y = batches[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.backward(eng(x[:2], y[:2]))
    out["range_seen"] = any(e.key == "offload.grad_to_host" for e in prof.key_averages())
    eng.optimizer.zero_grad()
    # fetch lists: cached, and rebuilt when a module's parameters or external parameters change
    m = eng.module
    fc1, fc2 = m.blocks[0].fc1, m.blocks[0].fc2
    first = module_params_to_fetch(fc1)
    out["cached"] = module_params_to_fetch(fc1) is first
    out["own"] = [p is fc1.weight for p in first]
    register_external_parameter(fc1, fc2.weight)
    out["with_external"] = any(p is fc2.weight for p in module_params_to_fetch(fc1))
    unregister_external_parameter(fc1, fc2.weight)
    out["external_gone"] = not any(p is fc2.weight for p in module_params_to_fetch(fc1))
    w = fc1._parameters.pop("weight")
    out["popped"] = not any(p is w for p in module_params_to_fetch(fc1))
    fc1._parameters["weight"] = w
    out["restored"] = any(p is w for p in module_params_to_fetch(fc1))
    with torch.no_grad():
        out["loss_after"] = float(eng(x[:2], y[:2]))   # the schedule still gathers what it needs
    eng.destroy()
    return out


def test_one_rank_gradients_skip_the_bucket_and_fetch_lists_follow_parameter_changes():
    res = run_distributed(_direct_body, 1, timeout=120)[0]
    assert res["direct"] is True and res["launches"] == 0
    ref = plain_reference(make_lm(seed=0), lm_batches(2, 4), LR)   # two micro-batches of 2 per step
    for n, v in res["state_gas2"].items():
        if n in ref:
            torch.testing.assert_close(v, ref[n], rtol=1e-5, atol=1e-6)
    assert res["range_seen"]
    assert res["cached"] and any(res["own"])
    assert res["with_external"] and res["external_gone"]
    assert res["popped"] and res["restored"]
    assert math.isfinite(res["loss_after"]) and res["loss_after"] > 0   # cross-entropy of a working forward
