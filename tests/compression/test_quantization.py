"""Quantizers against hand-computed values, straight-through gradients, the bit schedule,
and the 2**bits bound on distinct values once the schedule reaches its target."""
import pytest
import torch

from deepspeed.compression import compression_scheduler, init_compression
from deepspeed.compression.basic_layer import LinearLayer_Compress, QuantAct
from deepspeed.compression.utils import (AsymQuantizer, BinaryQuantizer, SymQuantizer, TernaryQuantizer,
                                         scheduled_bits)


def test_symmetric_matches_formula():
    # q = 2**3 = 8, scale = 2 * max|x| / q = 0.25; round(x / 0.25) = [-4, -1, 1, 4] clamped to [-4, 3]
    x = torch.tensor([-1.0, -0.3, 0.2, 0.9])
    torch.testing.assert_close(SymQuantizer.apply(x, 3, None, None, 1), torch.tensor([-1.0, -0.25, 0.25, 0.75]))


def test_asymmetric_matches_formula():
    # scale = (1.85 - 0.25) / 8 = 0.2; zero_point = round(0.25 / 0.2) * 0.2 = 0.2;
    # round((x - 0.2) / 0.2) = [0, 2, 4, 8] clamped to [0, 7] -> [0, 2, 4, 7] * 0.2 + 0.2
    x = torch.tensor([0.25, 0.55, 0.95, 1.85])
    torch.testing.assert_close(AsymQuantizer.apply(x, 3, None, None, 1), torch.tensor([0.2, 0.6, 1.0, 1.6]))


def test_groups_have_their_own_scale():
    x = torch.tensor([[-1.0, -0.3, 0.2, 0.9], [-10.0, -3.0, 2.0, 9.0]])
    out = SymQuantizer.apply(x, 3, None, None, 2)
    torch.testing.assert_close(out[0], torch.tensor([-1.0, -0.25, 0.25, 0.75]))
    torch.testing.assert_close(out[1], torch.tensor([-10.0, -2.5, 2.5, 7.5]))


def test_static_range_and_ternary_binary():
    # fixed range [-2, 2], 3 bits: scale = 0.5
    x = torch.tensor([-1.0, -0.3, 0.2, 0.9])
    torch.testing.assert_close(SymQuantizer.apply(x, 3, torch.tensor(-2.0), torch.tensor(2.0), 1),
                               torch.tensor([-1.0, -0.5, 0.0, 1.0]))
    # ternary: threshold 0.7 * mean|x| = 0.385; kept [1.0, -0.8], alpha = 0.9
    t = TernaryQuantizer.apply(torch.tensor([1.0, -0.1, -0.8, 0.3]), 2, None, None, 1)
    torch.testing.assert_close(t, torch.tensor([0.9, 0.0, -0.9, 0.0]))
    # binary: sign(x) * mean|x| = +-1
    b = BinaryQuantizer.apply(torch.tensor([1.0, -0.5, 2.0, -0.5]), 1, None, None, 1)
    torch.testing.assert_close(b, torch.tensor([1.0, -1.0, 1.0, -1.0]))


@pytest.mark.parametrize("q", [SymQuantizer, AsymQuantizer, TernaryQuantizer, BinaryQuantizer])
def test_straight_through_gradient(q):
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    (q.apply(x, 4, None, None, 2) * g).sum().backward()
    torch.testing.assert_close(x.grad, g)


def test_bit_schedule_halves_its_pace():
    # period 2: one bit fewer at steps 2, 4, 8, 16 (the period doubles after each drop)
    bits = [scheduled_bits(8, 4, 2, s) for s in range(18)]
    assert bits[:2] == [8, 8] and bits[2:4] == [7, 7] and bits[4:8] == [6] * 4
    assert bits[8:16] == [5] * 8 and bits[16:] == [4, 4]


def _wq_config(in_forward, qtype="symmetric", groups=2, offset=3):
    return {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": offset, "quantize_groups": groups,
                              "quantization_type": qtype, "quantize_weight_in_forward": in_forward},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 3, "quantization_period": 1},
                                     "modules": ["fc"]}}}}}


@pytest.mark.parametrize("in_forward,qtype", [(True, "symmetric"), (True, "asymmetric"), (False, "symmetric")])
def test_at_target_step_at_most_2_pow_bits_values_per_group(in_forward, qtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(16, 8))
    cfg = _wq_config(in_forward, qtype)
    init_compression(model, cfg)
    fc = model.fc
    assert isinstance(fc, LinearLayer_Compress)
    sched = compression_scheduler(model, cfg)
    sched.step(step_zero_check=True)
    assert not fc.weight_quantization_enabled  # offset 3 not reached
    for _ in range(3):
        sched.step()
    assert fc.weight_quantization_enabled and fc.weight_quantize_bits == 8
    for _ in range(16):  # drops at 1, 2, 4, 8, 16 steps after the offset: 8 -> 3
        sched.step()
    assert fc.weight_quantize_bits == 3
    w = fc.compressed_weight_bias()[0] if in_forward else fc.weight
    for group in w.detach().reshape(2, -1):
        assert group.unique().numel() <= 2 ** 3
    if in_forward:  # the stored weight stays full precision; only the forward is quantized
        assert fc.weight.detach().reshape(2, -1)[0].unique().numel() > 8


def test_activation_quantization_dynamic_and_static():
    layer = LinearLayer_Compress(8, 4)
    layer.enable_activation_quantization(4, "symmetric", "dynamic")
    layer.activation_quantization_enabled = True
    x = torch.randn(3, 5, 8)
    # per token: each of the 15 tokens its own scale, at most 16 values
    q = torch.stack([SymQuantizer.apply(row, 4, None, None, 1) for row in x.reshape(-1, 8)]).reshape(3, 5, 8)
    assert all(row.unique().numel() <= 16 for row in q.reshape(-1, 8))
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(q, layer.weight, layer.bias))
    # static: the range is a running average of batch min/max with momentum 0.95
    qa = QuantAct(quant_mode="symmetric")
    qa(torch.tensor([-1.0, 2.0]), 8)
    torch.testing.assert_close(qa.x_min_max, torch.tensor([-1.0, 2.0]))
    qa(torch.tensor([-3.0, 4.0]), 8)
    torch.testing.assert_close(qa.x_min_max, torch.tensor([-1.0 * 0.95 - 3.0 * 0.05, 2.0 * 0.95 + 4.0 * 0.05]))


def test_fp16_mixed_quantize_blends_towards_the_quantized_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(8, 4))
    cfg = _wq_config(False, groups=1, offset=0)
    cfg["compression_training"]["weight_quantization"]["shared_parameters"]["fp16_mixed_quantize"] = {
        "enabled": True, "quantize_change_ratio": 0.25}
    cfg["compression_training"]["weight_quantization"]["different_groups"]["wq1"]["params"] = {
        "start_bits": 4, "target_bits": 4, "quantization_period": 1}
    init_compression(model, cfg)
    w0 = model.fc.weight.detach().clone()
    sched = compression_scheduler(model, cfg)
    sched.step(step_zero_check=True)  # first quantized step: 0.75 * w + 0.25 * q(w)
    torch.testing.assert_close(model.fc.weight.detach(), 0.75 * w0 + 0.25 * SymQuantizer.apply(w0, 4, None, None, 1))
    w1 = model.fc.weight.detach().clone()
    sched.step()  # the quantized share grows by the change ratio each step
    torch.testing.assert_close(model.fc.weight.detach(), 0.5 * w1 + 0.5 * SymQuantizer.apply(w1, 4, None, None, 1))
    for _ in range(3):
        sched.step()
    assert model.fc.weight.unique().numel() <= 16  # fully quantized once the share reaches 1
