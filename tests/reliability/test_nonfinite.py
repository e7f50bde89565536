"""A NaN loss at fp32 (and bf16 without overflow checking) skips the step instead of turning
every weight into NaN: weights and optimizer state stay as they were, a warning names the step,
``skipped_steps`` counts it, and training goes on exactly like plain PyTorch that never saw the
bad batch; ``"nonfinite_gradients": "raise"`` stops instead. A model with no parameters, or
with none trainable, is refused at initialize."""
from __future__ import annotations

import logging

import pytest
import torch

import deepspeed
from deepspeed.runtime.nonfinite import NonFiniteGradientError
from tests.helpers.models import make_model


def _cfg(stage, **extra):
    cfg = {"train_batch_size": 4, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": stage}}
    cfg.update(extra)
    return cfg


def _batches():
    g = torch.Generator().manual_seed(5)
    good = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(2)]
    bad = (torch.full((4, 8), float("nan")), torch.randn(4, 4, generator=g))
    return good[0], bad, good[1]


def _step(eng, batch):
    loss = eng(*batch)
    eng.backward(loss)
    eng.step()


def _params(eng):
    return {n: p.detach().clone().float() for n, p in eng.module_state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nan_loss_at_fp32_skips_the_step(stage, caplog):
    b1, bad, b3 = _batches()
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(stage))
    _step(eng, b1)
    after1 = _params(eng)
    with caplog.at_level(logging.WARNING):
        _step(eng, bad)
    assert eng.skipped_steps == 1 and eng.global_steps == 2
    assert any("global step 1" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    after2 = _params(eng)
    assert all(torch.equal(after1[k], after2[k]) for k in after1)   # untouched, finite
    _step(eng, b3)
    # plain PyTorch on the good batches only (same SGD with momentum: its state was not touched either)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in (b1, b3):
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    got = _params(eng)
    for n, p in ref.state_dict().items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6)
    eng.destroy()


def test_nan_loss_bf16_without_overflow_check_and_raise_policy():
    b1, bad, _ = _batches()
    # bf16.check_grad_overflow defaults to true (DeepSpeed 0.19): the NaN step is an overflow skip
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(2, bf16={"enabled": True}))
    assert eng.config_obj.bf16.check_grad_overflow is True and eng.strategy.skip_on_overflow
    _step(eng, tuple(t.bfloat16() for t in b1))
    before = _params(eng)
    _step(eng, tuple(t.bfloat16() for t in bad))
    assert eng.skipped_steps == 1 and all(torch.equal(before[k], v) for k, v in _params(eng).items())
    eng.destroy()
    # without the check, the nonfinite_gradients policy ("skip") keeps the weights finite too
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(2, bf16={"enabled": True,
                                                                           "check_grad_overflow": False}))
    assert not eng.strategy.skip_on_overflow
    _step(eng, tuple(t.bfloat16() for t in b1))
    before = _params(eng)
    _step(eng, tuple(t.bfloat16() for t in bad))
    assert eng.skipped_steps == 1 and all(torch.isfinite(p).all() for p in _params(eng).values())
    assert all(torch.equal(before[k], v) for k, v in _params(eng).items())
    eng.destroy()
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(0, nonfinite_gradients="raise"))
    _step(eng, b1)
    with pytest.raises(NonFiniteGradientError, match="global step 1"):
        _step(eng, bad)
    eng.destroy()
    with pytest.raises(Exception, match="nonfinite_gradients"):
        deepspeed.initialize(model=make_model(), config=_cfg(0, nonfinite_gradients="ignore"))


class _NoParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [torch.nn.Linear(2, 2)]   # a plain list: not registered
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.layers[0](x) * self.scale


@pytest.mark.parametrize("stage", [0, 3])
def test_model_without_parameters_is_refused(stage):
    with pytest.raises(ValueError, match="has no parameters.*ModuleList"):
        deepspeed.initialize(model=_NoParams(), config=_cfg(stage))
    frozen = make_model()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        deepspeed.initialize(model=frozen, config=_cfg(stage))
    with pytest.raises(ValueError, match="requires a gradient"):
        deepspeed.initialize(model=frozen, model_parameters=frozen.parameters(), config=_cfg(stage))
