"""zero_allow_untested_optimizer: false refuses, with DeepSpeed's AssertionError, a ZeRO-1/2 client
optimizer whose class ZeRO is not tested with (stages 1-3); a tested class (torch SGD) passes."""
import pytest
import torch


class _PlainSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-g["lr"])


@pytest.mark.parametrize("stage", [1, 3])
def test_untested_optimizer_refused_only_when_not_allowed(stage):
    import deepspeed
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": False}
    model = torch.nn.Linear(3, 2)
    with pytest.raises(AssertionError, match="zero_allow_untested_optimizer"):
        deepspeed.initialize(config=cfg, model=model, optimizer=_PlainSGD(model.parameters()))
    model = torch.nn.Linear(3, 2)
    deepspeed.initialize(config=cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model = torch.nn.Linear(3, 2)
    deepspeed.initialize(config=dict(cfg, zero_allow_untested_optimizer=True), model=model,
                         optimizer=_PlainSGD(model.parameters()))
