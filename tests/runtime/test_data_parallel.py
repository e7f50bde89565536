"""Data parallelism (stage 0) on 2 and 4 gloo processes against single-process PyTorch."""
import datetime
import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches, make_model, micro_slice, reference_train


def _dp_train(rank, world_size, gas, clip, n_steps, mb, bucket, extra):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
           "gradient_clipping": clip, "steps_per_print": 0,
           "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket}, **extra}
    # Different init per rank: the engine must broadcast rank 0's weights.
    model = make_model(seed=rank)
    engine, *_ = deepspeed.initialize(
        model=model, config=cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    batches = global_batches(n_steps, mb * gas * world_size)
    for batch in batches:
        for m in range(gas):
            x, y = micro_slice(batch, rank, world_size, m, mb)
            engine.backward(engine(x, y))
            engine.step()
    return {"params": [p.detach().clone() for p in engine.module.parameters()],
            "launches": engine.strategy.allreduce_launches,
            "n_buckets": len(engine.strategy.bucketer.buckets)}


def _reference(world_size, gas, clip, n_steps, mb):
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_train(model, opt, global_batches(n_steps, mb * gas * world_size), clip=clip)
    return list(model.parameters())


@pytest.mark.parametrize("world_size,gas", [(2, 1), (2, 4), (4, 1), (4, 4)])
def test_dp_matches_single_process(world_size, gas):
    n_steps, mb, clip = 3, 2, 0.5
    # 50-element buckets: (4+64) and (16+128) elements -> two buckets
    res = run_distributed(_dp_train, world_size, args=(gas, clip, n_steps, mb, 50, {}), timeout=240)
    ref = _reference(world_size, gas, clip, n_steps, mb)
    for r in res:
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # all ranks identical
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))
    # one launch per bucket per optimizer step, never per micro-step
    n_buckets = res[0]["n_buckets"]
    assert n_buckets > 1
    assert res[0]["launches"] == n_buckets * n_steps


def test_dp_options_prescale_and_comm_dtype():
    n_steps, mb, gas = 2, 2, 2
    extra = {"prescale_gradients": True, "gradient_predivide_factor": 2.0,
             "communication_data_type": "fp32"}
    res = run_distributed(_dp_train, 2, args=(gas, 0.0, n_steps, mb, 10**9, extra), timeout=240)
    ref = _reference(2, gas, 0.0, n_steps, mb)
    for p, q in zip(res[0]["params"], ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert res[0]["launches"] == 1 * n_steps  # one bucket holds everything


def _no_sync_body(rank, world_size):
    import deepspeed
    engine, *_ = deepspeed.initialize(model=make_model(seed=0), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0},
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randn(2, 8) + rank  # different data per rank
    y = torch.zeros(2, 4)
    # allreduce_gradients=False keeps local gradients
    engine.backward(engine(x, y), allreduce_gradients=False)
    local = [p.grad.clone() for p in engine.module.parameters()]
    engine.zero_grad()
    with engine.no_sync():
        engine.backward(engine(x, y))
    no_sync = [p.grad.clone() for p in engine.module.parameters()]
    engine.zero_grad()
    engine.backward(engine(x, y))
    synced = [p.grad.clone() for p in engine.module.parameters()]
    return local, no_sync, synced, engine.strategy.allreduce_launches


def test_allreduce_false_and_no_sync_keep_local_grads():
    res = run_distributed(_no_sync_body, 2, timeout=120)
    (l0, n0, s0, c0), (l1, n1, s1, c1) = res
    for a, b in zip(l0, n0):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(l0, l1))  # local grads differ by rank
    for a, b, sa, sb in zip(l0, l1, s0, s1):
        torch.testing.assert_close(sa, (a + b) / 2)
        assert torch.equal(sa, sb)
    assert c0 == c1 == 1  # only the synced backward launched (one bucket)


def _mpu_clip_body(rank, world_size):
    """Two model-parallel ranks each hold half of a split layer; clipping uses the norm
    across both halves (replicated params counted once)."""
    import torch.distributed as dist
    import deepspeed

    class MPU:
        def get_model_parallel_rank(self): return dist.get_rank()
        def get_model_parallel_world_size(self): return 2
        def get_model_parallel_group(self): return dist.group.WORLD
        def get_data_parallel_rank(self): return 0
        def get_data_parallel_world_size(self): return 1
        def get_data_parallel_group(self): return dist.new_group([dist.get_rank()])

    torch.manual_seed(0)
    full_w = torch.randn(4, 6)
    shared_b = torch.randn(4)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(full_w[:, rank * 3:(rank + 1) * 3].clone())
    m.w.model_parallel = True
    m.b = torch.nn.Parameter(shared_b.clone())
    m.forward = None
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = m.w
            self.b = m.b
        def forward(self, x):
            part = x[:, rank * 3:(rank + 1) * 3] @ self.w.t()
            return part, self.b
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, mpu=MPU(), config={
        "train_batch_size": 1, "gradient_clipping": 0.1, "steps_per_print": 0},
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    x = torch.ones(1, 6)
    part, b = engine(x)
    # loss = sum(w x) (split) + sum(b) (replicated, counted once)
    loss = part.sum() + b.sum() / 2 * 2
    engine.backward(loss)
    engine.step()
    return engine.get_global_grad_norm()


def test_clipping_norm_across_model_parallel_ranks():
    norms = run_distributed(_mpu_clip_body, 2, timeout=120)
    # grad of w: ones(4,6) split over ranks (24 entries); grad of b: ones(4), counted once
    expected = (24 + 4) ** 0.5
    for n in norms:
        assert abs(n - expected) < 1e-6


def _never_joins(rank, world_size):
    import deepspeed
    if rank == 1:
        import time
        time.sleep(60)  # never reaches the collective
        return None
    import deepspeed.comm as dscomm
    t = torch.ones(1)
    dscomm.all_reduce(t)
    return t.item()


def test_rank_that_never_joins_times_out_instead_of_hanging():
    import time
    t0 = time.time()
    with pytest.raises(AssertionError) as err:
        run_distributed(_never_joins, 2, timeout=50, pg_timeout=5)
    assert time.time() - t0 < 45
    msg = str(err.value)
    assert "rank 0" in msg and ("timed out" in msg.lower() or "timeout" in msg.lower())


def _loader_body(rank, world_size):
    import deepspeed
    data = torch.utils.data.TensorDataset(torch.arange(16, dtype=torch.float32).unsqueeze(1))
    eng, _, loader, _ = deepspeed.initialize(model=torch.nn.Linear(1, 1), training_data=data,
                                             config={"train_micro_batch_size_per_gpu": 2})
    return sorted(int(v) for (b,) in loader for v in b.flatten())


def test_dataloader_shards_by_rank():
    a, b = run_distributed(_loader_body, 2, timeout=120)
    assert len(a) == len(b) == 8
    assert sorted(a + b) == list(range(16))
