"""ZeRO 1/2 on one process: the flat layout's invariants, the optimizer face, and the
errors a user can run into (each names its cause)."""
import pytest
import torch

import deepspeed
from deepspeed.runtime.precision.flat_layout import GroupLayout
from tests.helpers.models import make_model
from tests.runtime.zero._common import build_engine, ds_config, run_steps


@pytest.mark.parametrize("n_parts", [1, 3, 4])
def test_layout_fragments_cover_every_element_once(n_parts):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in (7, 1, 13, 40, 5)]
    lay = GroupLayout(0, params, [f"p{i}" for i in range(5)], n_parts, bucket_size=16)
    assert lay.numel == sum(b.chunk * n_parts for b in lay.buckets)
    assert all(b.chunk * n_parts - b.numel < n_parts for b in lay.buckets)   # padding < N per bucket
    seen = {f"p{i}": torch.zeros(p.numel(), dtype=torch.int32) for i, p in enumerate(params)}
    for r in range(n_parts):
        part_used = torch.zeros(lay.part_numel, dtype=torch.int32)
        for f in lay.fragments(r):
            seen[f.slot.name][f.param_start:f.param_start + f.numel] += 1
            part_used[f.part_offset:f.part_offset + f.numel] += 1
        assert int(part_used.max()) <= 1
    assert all(bool((v == 1).all()) for v in seen.values())
    # backward order: the last parameter opens the first bucket
    assert lay.buckets[0].slots[0].name == "p4"


def test_optimizer_face_works_with_torch_schedulers():
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # noqa: E731
    engine = build_engine(ds_config(2, 1, 4, dtype="bf16"), opt_name="adamw", lr_scheduler=sched)
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.inner.param_groups
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    assert isinstance(opt, DeepSpeedZeroOptimizer)
    from tests.helpers.models import global_batches
    run_steps(engine, 0, 1, global_batches(2, 4), "bf16")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / 3)
    sd = opt.state_dict()
    assert sd["zero_stage"] == 2 and set(sd["params"]) == {n for n, p in engine.module.named_parameters()
                                                           if p.requires_grad}
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    run_steps(engine, 0, 1, global_batches(1, 4), "bf16")
    opt.load_state_dict(sd)                         # back to the saved masters and moments
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_unused_parameter_is_named_when_not_ignored():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 2)
            self.unused = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x).pow(2).mean()
    for ignore in (True, False):
        cfg = ds_config(1, 1, 2, ignore_unused_parameters=ignore)
        engine, *_ = deepspeed.initialize(model=TwoHeads(), config=cfg,
                                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        if ignore:
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
        else:
            # DeepSpeed asserts (its tests catch AssertionError); ours is also a RuntimeError
            with pytest.raises(AssertionError, match=r"unused\.weight.*ignore_unused_parameters") as err:
                engine.backward(engine(torch.randn(2, 4)))
            assert isinstance(err.value, RuntimeError)


def test_user_errors_are_clear():
    # no_sync() is supported at stages 1 and 2 (DeepSpeed refuses stage 2; issue 12 -
    # tests/behaviours/test_distributed_behaviours.py checks the gradients it produces).
    with build_engine(ds_config(2, 1, 2)).no_sync():
        pass
    with build_engine(ds_config(1, 1, 2)).no_sync():   # fine at stage 1
        pass
    model = make_model()
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        deepspeed.initialize(model=model, config=ds_config(1, 1, 2), model_parameters=[stray],
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(Exception, match="did not keep the parameter groups"):
        deepspeed.initialize(model=make_model(), config=ds_config(2, 1, 2),
                             optimizer=lambda ps: torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
