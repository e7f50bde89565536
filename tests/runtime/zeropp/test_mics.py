"""MiCS (``mics_shard_size``) at world size 4 as 2 shard groups of 2 ranks, against plain
stage 3 on the same 4 ranks: partitions are 1/2 (not 1/4), parameter gathers stay inside the
shard group, training equals stage 3 (bit for bit where one rank alone has a non-zero gradient,
so both summation orders are exact - a missing cross-replica reduce would leave one shard group
without it; within fp32 rounding otherwise), checkpoints cross between
MiCS and plain stage 3 in both directions, ``MiCS_Init`` partitions over the shard group, and a
size that does not divide the world is refused naming the key."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 31),
                               torch.nn.Tanh(), torch.nn.Linear(31, 4))


def _cfg(extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **extra},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


def _engine(extra, init=False):
    import deepspeed
    if init:
        with deepspeed.zero.MiCS_Init(config_dict_or_path=_cfg(extra)):
            model = _model()
    else:
        model = _model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_cfg(extra))
    return eng


def _train(eng, rank, world_size, same, steps=STEPS, seed=7):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2 * world_size, 16, generator=g), torch.randn(2 * world_size, 4, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2])
        # "same": only one rank's gradient is non-zero, so every summation order is exact
        eng.backward(loss * (1.0 if rank == 0 else 0.0) if same else loss)
        eng.step()
        losses.append(float(loss.detach()))
    return losses


def _state(eng):
    return {k: v.clone() for k, v in eng.module_state_dict().items()}


def _body(rank, world_size, tmp):
    from deepspeed.config.errors import DeepSpeedConfigError
    mics = {"mics_shard_size": 2}
    res = {}
    for same in (True, False):
        plain = _engine({})
        lp = _train(plain, rank, world_size, same)
        res[("plain", same)] = (lp, _state(plain))
        plain.destroy()
        m = _engine(mics, init=same)     # MiCS_Init builds the model in the first round
        res["part_numel"] = sorted({p.ds_tensor.numel() / p.ds_numel for p in m.module.parameters()})
        gathers_before = m.strategy.comm.gather_calls
        lm = _train(m, rank, world_size, same)
        res["shard_gathers"] = m.strategy.comm.gather_calls - gathers_before
        res["shard_group_size"] = m.strategy.comm.world_size
        res[("mics", same)] = (lm, _state(m))
        if not same:   # checkpoint: MiCS -> plain stage 3, and plain -> MiCS
            m.save_checkpoint(tmp, tag="mics")
            ref_loss = _train(m, rank, world_size, same, steps=1, seed=99)
            p2 = _engine({})
            p2.load_checkpoint(tmp, tag="mics")
            res["mics_to_plain"] = (_train(p2, rank, world_size, same, steps=1, seed=99), ref_loss,
                                    _state(p2), _state(m))
            p2.save_checkpoint(tmp, tag="plain")
            m2 = _engine(mics)
            m2.load_checkpoint(tmp, tag="plain")
            res["plain_to_mics"] = (_state(m2), _state(p2))
            p2.destroy()
            m2.destroy()
        m.destroy()
    try:
        _engine({"mics_shard_size": 3})
        res["bad"] = None
    except DeepSpeedConfigError as e:
        res["bad"] = str(e)
    return res


@pytest.mark.slow
def test_mics_trains_as_stage3_and_checkpoints_cross(tmp_path):
    results = run_distributed(_body, world_size=4, args=(str(tmp_path),), timeout=240)
    for rank, r in enumerate(results):
        assert r["shard_group_size"] == 2 and r["shard_gathers"] > 0
        assert all(abs(f - 0.5) < 0.05 for f in r["part_numel"]), r["part_numel"]   # ceil(n/2)/n
        lp, sp = r[("plain", True)]
        lm, sm = r[("mics", True)]
        assert lm == lp
        assert all(torch.equal(sm[k], v) for k, v in sp.items())
        lp, sp = r[("plain", False)]
        lm, sm = r[("mics", False)]
        assert lm == pytest.approx(lp, rel=1e-5)
        for k, v in sp.items():
            torch.testing.assert_close(sm[k], v, rtol=1e-5, atol=1e-6)
        got, want, s_plain, s_mics = r["mics_to_plain"]
        assert got == pytest.approx(want, rel=1e-5)
        s_plain_loaded, s_plain_saved = r["plain_to_mics"]
        for k, v in s_plain_saved.items():
            assert torch.equal(s_plain_loaded[k], v), k
        assert r["bad"] is not None and "mics_shard_size=3" in r["bad"] and "divide" in r["bad"]
