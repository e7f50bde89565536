"""Helpers and the model-parallel layers at model-parallel size 1."""
import torch

from deepspeed.compression.basic_layer import ColumnParallelLinear_Compress, RowParallelLinear_Compress
from deepspeed.compression.helper import convert_conv1d_to_linear, recursive_getattr, recursive_setattr


class _MPU:  # one model-parallel rank
    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return None


def test_recursive_get_and_set():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = torch.nn.Linear(2, 3)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new


class Conv1D(torch.nn.Module):
    """Hugging Face GPT-2's Conv1D: a linear layer with its weight stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


def test_conv1d_to_linear_computes_the_same():
    model = torch.nn.Sequential(Conv1D(6, 4))  # nf=6 outputs, nx=4 inputs, weight (4, 6)
    x = torch.randn(3, 4)
    ref = model(x)
    convert_conv1d_to_linear(model, Conv1D)
    assert isinstance(model[0], torch.nn.Linear) and model[0].weight.shape == (6, 4)
    torch.testing.assert_close(model(x), ref)


def test_model_parallel_linears_at_size_one():
    mpu = _MPU()
    col = ColumnParallelLinear_Compress(mpu, 4, 6, gather_output=True)
    row = RowParallelLinear_Compress(mpu, 6, 3, input_is_parallel=False)
    x = torch.randn(2, 4)
    h, _ = col(x)
    out, _ = row(h)
    ref = torch.nn.functional.linear(torch.nn.functional.linear(x, col.weight, col.bias), row.weight, row.bias)
    torch.testing.assert_close(out, ref)
    col.enable_row_pruning(0.5, "l1")
    col.row_pruning_enabled = True
    h, _ = col(x)
    assert int((h.abs().sum(0) == 0).sum()) == 3  # half of the 6 output rows masked
