"""Behaviours that differed from DeepSpeed (issue 12 sections 3-4), two ranks.

All cases run in one spawned group to pay process start-up once:

* ``no_sync()`` at ZeRO stages 1, 2 and 3: ours, better - DeepSpeed asserts at stages 2
  and 3 ("no_sync context manager is incompatible with gradient partitioning logic of
  ZeRO stage N", engine.no_sync). Reference: plain PyTorch - the sum over the micro-steps
  of the rank-averaged gradients, one SGD step.
* checkpoint tag validation: DeepSpeed source (engine._checkpoint_tag_validation; modes
  Ignore/Warn/Fail from runtime/constants.py): tags compared across ranks, "Fail" asserts.
* the clean-exit barrier (deepspeed.comm.shutdown.exit_barrier): waits for a late rank,
  gives up after its timeout when a rank never arrives.
"""
import time

import torch
import torch.distributed as dist

import deepspeed
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model

LR = 0.1
MB = 2


def _data(rank, micro):
    g = torch.Generator().manual_seed(100 * micro + rank)
    return torch.randn(MB, 8, generator=g), torch.randn(MB, 4, generator=g)


def _reference(world_size, n_micro):
    model = make_model()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for m in range(n_micro):
        for r in range(world_size):
            model.zero_grad()
            x, y = _data(r, m)
            torch.nn.functional.mse_loss(model(x), y).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad / world_size
    with torch.no_grad():
        for p, t in zip(model.parameters(), total):
            p -= LR * t
    return [p.detach().clone() for p in model.parameters()]


def _no_sync_case(rank, world_size, stage):
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    n_micro = 3
    for m in range(n_micro):
        x, y = _data(rank, m)
        if m < n_micro - 1:
            with engine.no_sync():
                engine.backward(engine(x, y))
        else:
            engine.backward(engine(x, y))
    engine.step()
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            got = [p.detach().clone() for p in engine.module.parameters()]
    else:
        got = [p.detach().clone() for p in engine.module.parameters()]
    for a, b in zip(got, _reference(world_size, n_micro)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if stage == 1:   # stage 1 keeps DDP's rule: stepping on local gradients is the caller's choice
        return stage
    # Stages 2/3: stepping with gradients that were never reduced is refused, not silently wrong.
    with engine.no_sync():
        engine.backward(engine(*_data(rank, 9)))
    try:
        engine.step()
        raise AssertionError(f"stage {stage}: step() after no_sync-only backward did not raise")
    except RuntimeError as e:
        assert "no_sync" in str(e)
    engine.zero_grad()
    return stage


def _tag_validation_case(rank):
    from deepspeed.runtime.checkpoint.engine_checkpoint import _check_tag
    from deepspeed.runtime.checkpoint.errors import CheckpointError
    _check_tag("same", "Fail")                    # equal tags pass in every mode
    _check_tag(f"rank{rank}", "Ignore")           # differing tags: ignored
    _check_tag(f"rank{rank}", "Warn")             # ... warned (logged), not raised
    try:
        _check_tag(f"rank{rank}", "Fail")
        raise RuntimeError("differing tags did not fail")
    except AssertionError as e:                   # DeepSpeed: assert valid, msg
        assert isinstance(e, CheckpointError) and "not consistent across all ranks" in str(e)


def _exit_barrier_case(rank):
    from deepspeed.comm.shutdown import exit_barrier
    if rank == 1:
        time.sleep(1.5)
    t0 = time.monotonic()
    assert exit_barrier(60, key="test_late_rank") is True
    waited = time.monotonic() - t0
    if rank == 0:
        assert waited > 1.0, waited               # waited for the late rank
    dist.barrier()
    if rank == 0:                                 # rank 1 never arrives: give up after the timeout
        t0 = time.monotonic()
        assert exit_barrier(0.5, key="test_missing_rank") is False
        assert 0.4 < time.monotonic() - t0 < 10
    dist.barrier()


def _body(rank, world_size):
    torch.set_num_threads(1)
    stages = [_no_sync_case(rank, world_size, stage) for stage in (1, 2, 3)]
    _tag_validation_case(rank)
    _exit_barrier_case(rank)
    return stages


def test_no_sync_tag_validation_and_exit_barrier_two_ranks():
    assert run_distributed(_body, world_size=2, timeout=300) == [[1, 2, 3], [1, 2, 3]]
