"""fp16 loss-scale fields: DeepSpeed 0.19's bounds (bool / non-finite refused, the dynamic scaler's
window and floor checked only when the dynamic scaler runs)."""
import pytest

from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_float16_config


@pytest.mark.parametrize("bad", [True, float("inf"), float("nan"), -1, [], "x"])
def test_loss_scale_refused(bad):
    with pytest.raises(ValueError, match="fp16.loss_scale must be"):
        DeepSpeedFP16Config(loss_scale=bad)


def test_window_and_floor_only_bound_the_dynamic_scaler():
    for field in ("loss_scale_window", "min_loss_scale"):
        with pytest.raises(DeepSpeedConfigError, match=f"fp16.{field} = 0"):
            get_float16_config({"fp16": {"enabled": True, field: 0}})
        with pytest.raises(ValueError, match="not a bool"):
            DeepSpeedFP16Config(enabled=True, **{field: True})
        # unused by a static scale or a disabled section: kept as given
        assert getattr(DeepSpeedFP16Config(enabled=True, loss_scale=128, **{field: 0}), field) == 0
        assert getattr(DeepSpeedFP16Config(enabled=False, **{field: -1}), field) == -1
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
