"""Loss scalers against hand-computed sequences of DeepSpeed's documented rules."""
import pytest
import torch

from deepspeed.config.sections import FP16Section
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler, create_loss_scaler


def _run(scaler, overflows):
    out = []
    for ov in overflows:
        scaler.update_scale(ov)
        out.append(scaler.cur_scale)
    return out


def test_hysteresis_delays_the_halving():
    s = DynamicLossScaler(init_scale=2.0 ** 10, scale_window=1000, delayed_shift=2)
    # 1st overflow uses up the hysteresis (scale kept), 2nd halves, and without a refill every
    # further overflow halves again
    assert _run(s, [True, True, True]) == [1024.0, 512.0, 256.0]


def test_hysteresis_one_halves_immediately_and_respects_min_scale():
    s = DynamicLossScaler(init_scale=8.0, scale_window=1000, delayed_shift=1, min_scale=2.0)
    assert _run(s, [True, True, True, True]) == [4.0, 2.0, 2.0, 2.0]
    assert s.overflows_at_min_scale == 2   # the 3rd and 4th overflow hit the floor


def test_scale_doubles_after_window_of_clean_steps():
    # DeepSpeed 0.19: a clean step doubles the scale when the clean steps before it (since the start
    # or the last overflow) are a positive multiple of the window: the 4th and the 7th step here
    s = DynamicLossScaler(init_scale=16.0, scale_window=3, delayed_shift=2)
    assert _run(s, [False] * 7) == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]
    # an overflow restarts the count: 3 clean steps after it, the 4th doubles
    s2 = DynamicLossScaler(init_scale=16.0, scale_window=3, delayed_shift=1)
    assert _run(s2, [False, True, False, False, False, False]) == [16.0, 8.0, 8.0, 8.0, 8.0, 16.0]
    assert (s2.cur_iter, s2.last_overflow_iter, s2.dynamic_loss_scale, s2.min_loss_scale) == (6, 1, True, 1.0)


def test_hysteresis_refill_window_vs_consecutive():
    # not consecutive: hysteresis comes back only when the window completes
    s = DynamicLossScaler(init_scale=64.0, scale_window=1000, delayed_shift=2)
    assert _run(s, [True, False, True]) == [64.0, 64.0, 32.0]
    # consecutive_hysteresis: any clean step refills it
    c = DynamicLossScaler(init_scale=64.0, scale_window=1000, delayed_shift=2, consecutive_hysteresis=True)
    assert _run(c, [True, False, True, False, True]) == [64.0, 64.0, 64.0, 64.0, 64.0]


def test_static_scale_never_changes():
    s = LossScaler(128.0)
    assert _run(s, [True, False, True]) == [128.0] * 3
    loss = torch.tensor(0.5)
    assert s.scale_loss(loss).item() == 64.0


def test_create_from_config_and_state_round_trip():
    dyn = create_loss_scaler(FP16Section(enabled=True, initial_scale_power=5, loss_scale_window=7, hysteresis=3,
                                         min_loss_scale=0.5), enabled=True)
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.cur_scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale) == (32.0, 7, 3, 0.5)
    static = create_loss_scaler(FP16Section(enabled=True, loss_scale=4.0), enabled=True)
    assert type(static) is LossScaler and static.cur_scale == 4.0
    assert create_loss_scaler(FP16Section(), enabled=False).cur_scale == 1.0
    _run(dyn, [True, False, True])
    other = create_loss_scaler(FP16Section(enabled=True, initial_scale_power=5, loss_scale_window=7, hysteresis=3,
                                           min_loss_scale=0.5), enabled=True)
    other.load_state_dict(dyn.state_dict())
    for ov in [False, True, True, False]:
        dyn.update_scale(ov)
        other.update_scale(ov)
        assert dyn.state_dict() == other.state_dict()


@pytest.mark.parametrize("bad", [{"loss_scale": -1}, {"hysteresis": 0}, {"loss_scale_window": 0}])
def test_bad_fp16_values_are_refused(bad):
    from deepspeed.config.errors import DeepSpeedConfigError
    from deepspeed.runtime.config import DeepSpeedConfig
    with pytest.raises((DeepSpeedConfigError, ValueError), match="|".join(bad)):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, **bad}}, world_size=1)
