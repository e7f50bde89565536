"""ZeRO++ hpZ (``zero_hpz_partition_size``) at world size 4 as 2 simulated nodes of 2 ranks:
training equals plain stage 3 exactly (fp32), backward's all-gathers run entirely inside the
node group (counted at the collective layer), the secondary partitions' memory is reported,
and a size that does not divide the world is refused naming the key."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 31),
                               torch.nn.Tanh(), torch.nn.Linear(31, 4))


def _run(rank, world_size, extra):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           # nothing kept between forward and backward: backward gathers every layer again
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                 "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0, **extra},
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    model = _model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(2 * world_size, 16, generator=g), torch.randn(2 * world_size, 4, generator=g))
            for _ in range(STEPS * 2)]
    st = eng.strategy
    sec = st.spec.sec_comm
    losses, bwd = [], []
    for x, y in data:
        xs, ys = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
        loss = torch.nn.functional.mse_loss(eng(xs), ys)
        before = (st.comm.gather_calls, sec.gather_calls if sec is not None else 0)
        eng.backward(loss)
        after = (st.comm.gather_calls, sec.gather_calls if sec is not None else 0)
        bwd.append((after[0] - before[0], after[1] - before[1]))
        eng.step()
        losses.append(float(loss.detach()))
    sd = {k: v.clone() for k, v in eng.module_state_dict().items()}
    acct = st.model_state_bytes()
    out = {"losses": losses, "sd": sd, "bwd_gathers": bwd, "acct": acct,
           "sec_size": sec.world_size if sec is not None else None}
    eng.destroy()
    return out


def _body(rank, world_size):
    from deepspeed.config.errors import DeepSpeedConfigError
    res = {"plain": _run(rank, world_size, {}), "hpz": _run(rank, world_size, {"zero_hpz_partition_size": 2})}
    try:
        _run(rank, world_size, {"zero_hpz_partition_size": 3})
        res["bad"] = None
    except DeepSpeedConfigError as e:
        res["bad"] = str(e)
    return res


@pytest.mark.slow
def test_hpz_equals_stage3_and_backward_gathers_stay_in_the_node_group():
    results = run_distributed(_body, world_size=4, timeout=180)
    for rank, r in enumerate(results):
        plain, hpz = r["plain"], r["hpz"]
        assert hpz["sec_size"] == 2
        assert hpz["losses"] == plain["losses"], (rank, hpz["losses"], plain["losses"])
        for k, v in plain["sd"].items():
            assert torch.equal(hpz["sd"][k], v), k
        # plain stage 3 gathers every layer again in backward over the whole group; hpZ never
        # does: every backward gather reads the secondary partitions inside the node group
        assert all(p > 0 and s == 0 for p, s in plain["bwd_gathers"]), plain["bwd_gathers"]
        assert all(p == 0 and s > 0 for p, s in hpz["bwd_gathers"]), hpz["bwd_gathers"]
        # memory: 1/2 of every (partitioned) parameter in fp32, ceil-divided per parameter
        m = _model()
        want = sum(-(-p.numel() // 2) * 4 for p in m.parameters())
        assert hpz["acct"]["hpz_secondary_partitions"] == want
        assert "hpz_secondary_partitions" not in plain["acct"]
        assert r["bad"] is not None and "zero_hpz_partition_size=3" in r["bad"] and "divide" in r["bad"]
