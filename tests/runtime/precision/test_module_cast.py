"""DeepSpeed 0.19.5's module cast for 16-bit training: parameters take the training dtype,
floating buffers keep theirs unless data_types.buffer_dtype names one, data_types.param_dtype
must agree with fp16/bf16; normalisation running statistics follow their weights (ours: torch's
batch_norm refuses bf16 weights with fp32 statistics)."""
import pytest
import torch

import deepspeed


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32) / 7)

    def forward(self, x):
        return (self.bn(self.lin(x)) * self.inv_freq.to(x.dtype)).sum()


def _engine(stage, **data_types):
    model = Net()
    cfg = {"train_batch_size": 2, "steps_per_print": 0, "bf16": {"enabled": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "data_types": data_types}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_kept_unless_buffer_dtype_and_running_stats_follow_weights(stage):
    eng = _engine(stage)
    m = eng.module
    assert m.inv_freq.dtype == torch.float32
    assert m.bn.running_mean.dtype == torch.bfloat16 and m.bn.running_var.dtype == torch.bfloat16
    assert torch.equal(m.inv_freq, torch.arange(4, dtype=torch.float32) / 7)   # not rounded through bf16
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    eng.backward(eng(x))     # BatchNorm runs: its statistics match its weights
    eng.step()
    assert eng._mixed_precision_dtypes() == (torch.bfloat16, None)
    eng = _engine(stage, buffer_dtype="bf16")
    assert eng.module.inv_freq.dtype == torch.bfloat16 and eng._config.buffer_dtype == "bf16"


def test_param_dtype_must_match_the_precision():
    _engine(0, param_dtype="bf16")
    with pytest.raises(AssertionError, match="data_types.param_dtype = 'fp16' conflicts"):
        _engine(0, param_dtype="fp16")
