"""FusedLamb against the LAMB update written out from the paper's formula."""
import copy
import math

import pytest
import torch

from deepspeed.ops.lamb import FusedLamb

from ._common import assert_histories_close, batches, compute_grads, flat, tiny_model, train


def lamb_reference(model, steps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                   eps_inside_sqrt=False, max_grad_norm=0.0, min_coeff=0.01, max_coeff=10.0):
    """LAMB one tensor at a time; returns (per-step flat params, per-step trust ratios, grad norms)."""
    model = copy.deepcopy(model)
    b1, b2 = betas
    state = {p: [torch.zeros_like(p), torch.zeros_like(p)] for p in model.parameters()}
    history, ratios, norms = [], [], []
    for t, (x, y) in enumerate(batches(steps), start=1):
        compute_grads(model, x, y)
        grads = {p: p.grad.clone() for p in model.parameters()}
        total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        norms.append(total)
        if max_grad_norm > 0:
            clip = min(1.0, max_grad_norm / (total + 1e-6))
            grads = {p: g * clip for p, g in grads.items()}
        step_ratios = []
        with torch.no_grad():
            for p in model.parameters():
                m, v = state[p]
                g = grads[p]
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
                m_hat, v_hat = m / bc1, v / bc2
                u = m_hat / (v_hat + eps).sqrt() if eps_inside_sqrt else m_hat / (v_hat.sqrt() + eps)
                u = u + weight_decay * p
                w_norm, u_norm = float(p.norm()), float(u.norm())
                r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                r = min(max(r, min_coeff), max_coeff)
                p.sub_(lr * r * u)
                step_ratios.append(r)
        history.append(flat(model))
        ratios.append(step_ratios)
    return history, ratios, norms


def _model():
    model = tiny_model()
    with torch.no_grad():
        model[2].bias.zero_()  # ||w|| = 0: the trust ratio falls back to 1
    return model


CASES = {
    "defaults": dict(lr=1e-2),
    "weight_decay_and_upper_clamp": dict(lr=1e-2, weight_decay=0.01, max_coeff=0.3),
    "lower_clamp": dict(lr=1e-3, min_coeff=5.0, max_coeff=20.0),
    "grad_clipping": dict(lr=1e-2, max_grad_norm=0.05),
    "eps_inside_sqrt_no_bias_correction": dict(lr=1e-2, eps=1e-6, eps_inside_sqrt=True, bias_correction=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lamb_matches_formula(case):
    kw = CASES[case]
    model = _model()
    _, opt, ours = train(model, lambda m: FusedLamb(m.parameters(), **kw))
    ref, ratios, norms = lamb_reference(model, 5, **kw)
    assert_histories_close(ours, ref, rtol=2e-6, atol=2e-7)
    assert opt.get_lamb_coeffs() == pytest.approx(ratios[-1], rel=1e-5)
    flat_ratios = [r for step in ratios for r in step]
    if case == "weight_decay_and_upper_clamp":
        assert 0.3 in flat_ratios  # the bound really engaged
    if case == "lower_clamp":
        assert 5.0 in flat_ratios
    if case == "grad_clipping":
        assert min(norms) > 0.05  # clipping really engaged on every step
    if case == "defaults":
        assert 1.0 in ratios[0]  # the zero bias


def test_lamb_differs_from_adam_direction():
    """The trust ratio matters: LAMB is not Adam with another learning rate."""
    model = tiny_model()
    _, _, lamb = train(model, lambda m: FusedLamb(m.parameters(), lr=1e-2, min_coeff=0.0, max_coeff=100.0))
    _, _, adam = train(model, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    assert (lamb[0] - adam[0]).abs().max() > 1e-4


@pytest.mark.parametrize("kwargs, match", [
    (dict(amsgrad=True), "amsgrad=True is not supported"),
    (dict(min_coeff=2.0, max_coeff=1.0), "'min_coeff' .* must not exceed 'max_coeff'"),
    (dict(max_grad_norm=-1.0), "'max_grad_norm' must be a non-negative number"),
    (dict(betas=(1.5, 0.9)), r"'betas\[0\]' must be in \[0, 1\)"),
])
def test_lamb_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedLamb(tiny_model().parameters(), **kwargs)
