"""DeepSpeedCPUAdagrad against torch.optim.Adagrad and the written-out formula."""
import copy

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

from ._common import assert_histories_close, batches, compute_grads, flat, tiny_model, train


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adagrad_matches_torch(wd):
    model = tiny_model()
    _, _, ours = train(model, lambda m: DeepSpeedCPUAdagrad(m.parameters(), lr=0.1, weight_decay=wd))
    _, _, ref = train(model, lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, weight_decay=wd, eps=1e-10))
    assert_histories_close(ours, ref)


def test_adagrad_bf16_params_fp32_accumulator_matches_formula():
    model = tiny_model(dtype=torch.bfloat16)
    _, opt, ours = train(model, lambda m: DeepSpeedCPUAdagrad(m.parameters(), lr=0.05, weight_decay=0.1),
                         dtype=torch.bfloat16)
    assert all(s["sum"].dtype == torch.float32 for s in opt.state.values())
    ref_model = copy.deepcopy(model)
    sums = {p: torch.zeros_like(p, dtype=torch.float32) for p in ref_model.parameters()}
    ref = []
    for x, y in batches(5, torch.bfloat16):
        compute_grads(ref_model, x, y)
        with torch.no_grad():
            for p in ref_model.parameters():
                w = p.float()
                g = p.grad.float() + 0.1 * w
                sums[p].add_(g * g)
                p.copy_((w - 0.05 * g / (sums[p].sqrt() + 1e-10)).to(p.dtype))
        ref.append(flat(ref_model))
    torch.testing.assert_close(ours[0], ref[0], rtol=2 ** -7, atol=0)
    assert_histories_close(ours, ref, rtol=0, atol=1e-2)


def test_adagrad_refuses_amsgrad_and_negative_lr():
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        DeepSpeedCPUAdagrad(tiny_model().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="'lr' must be a non-negative number"):
        DeepSpeedCPUAdagrad(tiny_model().parameters(), lr=-0.1)
