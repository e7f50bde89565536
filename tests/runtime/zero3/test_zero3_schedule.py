"""The parameter schedule: parameters are partitioned outside their module's use, the
forward order may change between steps, external parameters, fp16 overflow skips the
step on every rank; deepspeed.utils.safe_get_*/safe_set_* on partitioned state."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import DIM, TinyLM, lm_batches, make_lm, plain_reference, shard, stage3_config

LR = 0.02


class ReorderLM(TinyLM):
    """Runs its blocks in reverse order on odd steps (identically on every rank)."""

    def __init__(self):
        super().__init__(n_layers=3)
        self.calls = 0

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        order = list(self.blocks) if self.calls % 2 == 0 else list(self.blocks)[::-1]
        self.calls += 1
        for b in order:
            x = b(x)
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, 16), targets.reshape(-1))


class ExternalUser(nn.Module):
    """Uses ``owner.weight`` (another module's parameter) in its forward."""

    def __init__(self, owner, register):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self._owner = (owner,)  # a tuple: not registered as a submodule
        if register:
            import deepspeed
            deepspeed.zero.register_external_parameter(self, owner.weight)

    def forward(self, x):
        return self.lin(x) + x @ self._owner[0].weight.t()


class ExternalLM(TinyLM):
    def __init__(self, register=True):
        super().__init__(n_layers=1)
        self.proj = nn.Linear(DIM, DIM)
        self.user = ExternalUser(self.proj, register)

    def forward(self, idx, targets=None):
        x = self.user(self.proj(self.embed(idx)))
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, 16), targets.reshape(-1))


def _engine(model, **zero):
    import deepspeed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    cfg = stage3_config(gas=1, mb=2, **zero)
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]


def _body(rank, ws):
    out = {}
    # 1. Outside a module's forward its parameters are 1/N slices; inside they are whole.
    eng = _engine(make_lm(seed=0, n_layers=3), stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    m = eng.module
    seen = {}
    # taken outside the forward: a read through the module inside another module's forward
    # gathers it (ZeROOrderedDict, as in DeepSpeed; tests/runtime/zero3/test_zero3_external_access.py)
    w0 = m.blocks[0].fc1.weight

    def probe(mod, args):
        seen["block0_status"] = w0.ds_status.name
        seen["block0_shape"] = tuple(w0.shape)

    def probe_fc1(mod, args):
        seen["fc1_shape_in_forward"] = tuple(mod.weight.shape)

    h1 = m.blocks[2].register_forward_pre_hook(probe)
    h2 = m.blocks[2].fc1.register_forward_pre_hook(probe_fc1)
    x, y = shard(lm_batches(1, 2 * ws)[0], rank, ws, 0, 2)
    eng.backward(eng(x, y))
    eng.step()
    h1.remove()
    h2.remove()
    w = m.blocks[0].fc1.weight
    eng.eval()
    with torch.no_grad():    # inference: gathered per module, everything released afterwards
        out["eval_logits"] = eng(x)
    out["eval_released"] = all(p.ds_status.name == "NOT_AVAILABLE" for p in m.parameters())
    out["after_one_step"] = eng.module_state_dict()
    out["schedule"] = dict(seen, after_status=w.ds_status.name, after_shape=tuple(w.shape),
                           ds_shape=tuple(w.ds_shape), ds_numel=w.ds_numel, part=w.ds_tensor.numel(),
                           ds_id=w.ds_id)
    eng.destroy()

    # 2. Forward order that changes every step trains like plain PyTorch.
    torch.manual_seed(0)
    eng = _engine(ReorderLM(), stage3_prefetch_bucket_size=200)
    for b in lm_batches(4, 2 * ws):
        x, y = shard(b, rank, ws, 0, 2)
        eng.backward(eng(x, y))
        eng.step()
    out["reorder"] = eng.module_state_dict()
    out["reorder_prefetches"] = eng.strategy.coordinator.prefetches
    eng.destroy()

    # 3. A module using another module's parameter (registered as external).
    torch.manual_seed(0)
    eng = _engine(ExternalLM(register=True), stage3_max_reuse_distance=0)
    for b in lm_batches(3, 2 * ws):
        x, y = shard(b, rank, ws, 0, 2)
        eng.backward(eng(x, y))
        eng.step()
    out["external"] = eng.module_state_dict()
    eng.destroy()

    # 4. fp16: an overflow on one rank skips the step on every rank and halves the scale.
    import deepspeed
    model = make_lm(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    cfg = stage3_config(gas=1, mb=2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}
    eng = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
    x, y = shard(lm_batches(1, 2 * ws)[0], rank, ws, 0, 2)
    before = eng.strategy.parts.chunks[0].master.clone()
    loss = eng(x, y)
    if rank == 1:
        loss = loss * float("inf")
    eng.backward(loss)
    eng.step()
    out["fp16"] = {"unchanged": torch.equal(before, eng.strategy.parts.chunks[0].master),
                   "scale": eng.loss_scale, "skipped": eng.skipped_steps}
    eng.destroy()

    # 5. deepspeed.utils.safe_get_* / safe_set_* on partitioned state (collective getters)
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_set_full_fp32_param)
    eng = _engine(make_lm(seed=0), stage3_param_persistence_threshold=20)
    w, bias = eng.module.blocks[0].fc1.weight, eng.module.blocks[0].fc1.bias   # bias is kept whole
    x, y = shard(lm_batches(1, 2 * ws)[0], rank, ws, 0, 2)
    eng.backward(eng(x, y))
    frag = {"grad": safe_get_full_grad(w), "bias_grad": safe_get_full_grad(bias)}
    eng.step()
    frag.update(param=safe_get_full_fp32_param(w), exp_avg=safe_get_full_optimizer_state(w, "exp_avg"),
                local=safe_get_local_fp32_param(w).clone())
    safe_set_full_fp32_param(bias, torch.full((16,), 3.0))
    safe_set_full_fp32_param(w, torch.zeros(16, 8))
    frag["bias_after_set"] = bias.detach().clone()
    with deepspeed.zero.GatheredParameters([w]):
        frag["w_after_set"] = w.detach().clone()
    out["fragments"] = frag
    eng.destroy()

    # 6. Prefetching with stage3_max_reuse_distance 0 (DeepSpeed's TestZero3ParamPartitioningBase::
    # test_prefetching): once a trace exists, the root's forward puts the first module's
    # parameters in flight before that module runs.
    eng = _engine(make_lm(seed=0, n_layers=3), stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=10 ** 6)
    m, probe6 = eng.module, {}
    def status(mod, name):   # read past ZeROOrderedDict, whose __getitem__ would gather the parameter
        return dict.__getitem__(mod._parameters, name).ds_status.name

    def before_embed(mod, args):   # prepended: runs before the gather hook
        probe6.setdefault("embed_before", status(mod, "weight"))

    h = [m.embed.register_forward_pre_hook(before_embed, prepend=True)]
    for i in range(2):
        probe6.clear()
        x, y = shard(lm_batches(1, 2 * ws, seed=i)[0], rank, ws, 0, 2)
        eng.backward(eng(x, y))
        eng.step()
        out[f"prefetch_step{i}"] = dict(probe6)
    for hh in h:
        hh.remove()
    out["prefetch_all_released"] = all(p.ds_status.name == "NOT_AVAILABLE" for p in m.parameters())
    eng.destroy()
    return out


def test_partitioned_outside_use_reorder_external_and_fp16_overflow():
    res = run_distributed(_body, 2, timeout=120)
    s = res[0]["schedule"]
    assert s["block0_status"] == "NOT_AVAILABLE" and s["block0_shape"] == (0,)
    assert s["fc1_shape_in_forward"] == (2 * DIM, DIM)
    assert s["after_status"] == "NOT_AVAILABLE" and s["after_shape"] == (0,)
    assert s["ds_shape"] == (2 * DIM, DIM) and s["ds_numel"] == 2 * DIM * DIM and s["part"] == DIM * DIM
    assert res[1]["schedule"]["ds_id"] == s["ds_id"]
    for r in res:   # 6: no trace in the first step, then the root-level prefetch
        assert r["prefetch_step0"] == {"embed_before": "NOT_AVAILABLE"}, r["prefetch_step0"]
        assert r["prefetch_step1"]["embed_before"] in ("INFLIGHT", "AVAILABLE"), r["prefetch_step1"]
        assert r["prefetch_all_released"]
    plain = make_lm(seed=0, n_layers=3)
    plain.load_state_dict(res[0]["after_one_step"])
    x, _ = shard(lm_batches(1, 4)[0], 0, 2, 0, 2)
    with torch.no_grad():
        torch.testing.assert_close(res[0]["eval_logits"], plain(x))
    assert res[0]["eval_released"] and res[1]["eval_released"]

    torch.manual_seed(0)
    ref = plain_reference(ReorderLM(), lm_batches(4, 4), LR)
    for k, v in ref.items():
        torch.testing.assert_close(res[0]["reorder"][k].float(), v, rtol=1e-5, atol=2e-6, msg=k)
    assert res[0]["reorder_prefetches"] > 0

    torch.manual_seed(0)
    ref = plain_reference(ExternalLM(register=False), lm_batches(3, 4), LR)
    for k, v in ref.items():
        torch.testing.assert_close(res[0]["external"][k].float(), v, rtol=1e-5, atol=2e-6, msg=k)

    for r in res:
        assert r["fp16"]["unchanged"] and r["fp16"]["skipped"] == 1
        assert r["fp16"]["scale"] == 2.0 ** 9

    ref = make_lm(seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    x, y = lm_batches(1, 4)[0]
    ref(x, y).backward()
    fc1 = ref.blocks[0].fc1
    for rank, r in enumerate(res):
        f = r["fragments"]
        torch.testing.assert_close(f["grad"], fc1.weight.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(f["bias_grad"], fc1.bias.grad, rtol=1e-5, atol=1e-7)
        if rank == 0:
            opt.step()
        torch.testing.assert_close(f["param"], fc1.weight.detach())
        torch.testing.assert_close(f["exp_avg"], opt.state[fc1.weight]["exp_avg"])
        torch.testing.assert_close(f["local"], fc1.weight.detach().reshape(-1)[rank * 64:(rank + 1) * 64])
        assert torch.equal(f["bias_after_set"], torch.full((16,), 3.0))
        assert torch.equal(f["w_after_set"], torch.zeros(16, 8))
