"""FusedLion / DeepSpeedCPULion against the Lion update written out from its formula."""
import copy

import pytest
import torch

from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

from ._common import assert_histories_close, batches, compute_grads, flat, tiny_model, train


def lion_reference(model, steps, lr, betas, weight_decay, dtype=torch.float32):
    model = copy.deepcopy(model)
    b1, b2 = betas
    moms = {p: torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()}
    history = []
    for x, y in batches(steps, dtype):
        compute_grads(model, x, y)
        with torch.no_grad():
            for p in model.parameters():
                m, g, w = moms[p], p.grad.float(), p.float()
                c = b1 * m + (1 - b1) * g
                w = w * (1 - lr * weight_decay) - lr * torch.sign(c)
                m.mul_(b2).add_((1 - b2) * g)
                p.copy_(w.to(p.dtype))
        history.append(flat(model))
    return history


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_formula(cls, wd):
    model = tiny_model()
    _, opt, ours = train(model, lambda m: cls(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=wd))
    ref = lion_reference(model, 5, 1e-3, (0.9, 0.99), wd)
    assert_histories_close(ours, ref)
    # every weight moves by exactly lr per step (plus decay): sign updates
    delta = (ours[0] - flat(model)).abs()
    assert torch.allclose(delta[delta > 0], torch.full_like(delta[delta > 0], 1e-3), rtol=0.15)


def test_cpu_lion_bf16_params_keep_fp32_moment():
    model = tiny_model(dtype=torch.bfloat16)
    _, opt, ours = train(model, lambda m: DeepSpeedCPULion(m.parameters(), lr=1e-2), dtype=torch.bfloat16)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    ref = lion_reference(model, 5, 1e-2, (0.9, 0.999), 0.0, dtype=torch.bfloat16)
    torch.testing.assert_close(ours[0], ref[0], rtol=2 ** -7, atol=0)
    assert_histories_close(ours, ref, rtol=0, atol=1e-2)


def test_lion_rejects_bad_betas():
    with pytest.raises(ValueError, match=r"'betas\[1\]' must be in \[0, 1\)"):
        FusedLion(tiny_model().parameters(), betas=(0.9, 1.2))
