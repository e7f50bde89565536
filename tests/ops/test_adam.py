"""FusedAdam and DeepSpeedCPUAdam against torch.optim.Adam/AdamW and a hand-written reference."""
import copy
import io

import pytest
import torch

import deepspeed.ops.adam.fused_adam as fused_adam_module
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.adam.cpu_adam import host_zeros

from ._common import assert_histories_close, batches, compute_grads, flat, tiny_model, train

CLASSES = [FusedAdam, DeepSpeedCPUAdam]


def make(cls, params, adamw=True, **kw):
    mode = {"adamw_mode": adamw} if cls is DeepSpeedCPUAdam else {"adam_w_mode": adamw}
    return cls(params, **mode, **kw)


def adam_reference(model, steps, lr, betas, eps, wd, adamw, bias_correction, dtype=torch.float32):
    """Adam written out from the formula, one parameter at a time, moments in fp32."""
    model = copy.deepcopy(model)
    b1, b2 = betas
    moments = {p: (torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
               for p in model.parameters()}
    history = []
    for t, (x, y) in enumerate(batches(steps, dtype), start=1):
        compute_grads(model, x, y)
        with torch.no_grad():
            for p in model.parameters():
                m, v = moments[p]
                w, g = p.float(), p.grad.float()
                if not adamw:
                    g = g + wd * w
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
                if adamw:
                    w = w * (1 - lr * wd)
                w = w - lr * (m / bc1) / (v.sqrt() / bc2 ** 0.5 + eps)
                p.copy_(w.to(p.dtype))
        history.append(flat(model))
    return history


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adam_step_by_step(cls, adamw, wd):
    model = tiny_model()
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    _, _, ours = train(model, lambda m: make(cls, m.parameters(), adamw, lr=1e-2, weight_decay=wd, betas=(0.8, 0.99)))
    _, _, ref = train(model, lambda m: torch_cls(m.parameters(), lr=1e-2, weight_decay=wd, betas=(0.8, 0.99)))
    assert_histories_close(ours, ref)
    assert not torch.equal(ours[-1], flat(model)), "the optimizer must have changed the parameters"


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("adamw", [True, False])
def test_without_bias_correction_matches_formula(cls, adamw):
    model = tiny_model()
    kw = dict(lr=5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    _, _, ours = train(model, lambda m: make(cls, m.parameters(), adamw, bias_correction=False, **kw))
    ref = adam_reference(model, 5, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], adamw, False)
    assert_histories_close(ours, ref, rtol=2e-6, atol=2e-7)
    # and it really differs from the bias-corrected update
    _, _, corrected = train(model, lambda m: make(cls, m.parameters(), adamw, **kw))
    assert (corrected[0] - ours[0]).abs().max() > 1e-4


@pytest.mark.parametrize("bias_correction", [True, False])
def test_foreach_fallback_path_matches_reference(monkeypatch, bias_correction):
    monkeypatch.setattr(fused_adam_module, "_fused_kernel_ok", lambda *a: False)
    model = tiny_model()
    _, _, ours = train(model, lambda m: FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                  bias_correction=bias_correction))
    ref = adam_reference(model, 5, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, bias_correction)
    assert_histories_close(ours, ref, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("cls", CLASSES)
def test_parameter_groups_keep_their_hyperparameters(cls):
    model = tiny_model()

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 3e-2, "weight_decay": 0.2},
                {"params": m[2].parameters(), "betas": (0.5, 0.9)}]

    _, opt, ours = train(model, lambda m: make(cls, groups(m), lr=1e-2))
    _, _, ref = train(model, lambda m: torch.optim.AdamW(groups(m), lr=1e-2, weight_decay=0.0))
    assert_histories_close(ours, ref)
    assert [g["lr"] for g in opt.param_groups] == [3e-2, 1e-2]


def test_cpu_adam_bf16_params_keep_fp32_moments():
    model = tiny_model(dtype=torch.bfloat16)
    _, opt, ours = train(model, lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-2, weight_decay=0.1),
                         dtype=torch.bfloat16)
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    ref = adam_reference(model, 5, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, True, dtype=torch.bfloat16)
    # Same fp32 math: after one step at most a bf16 ulp apart (an fp32 last-bit difference can
    # flip a rounding); later steps see slightly different gradients, so a bf16-sized tolerance.
    torch.testing.assert_close(ours[0], ref[0], rtol=2 ** -7, atol=0)
    assert_histories_close(ours, ref, rtol=0, atol=1e-2)


def test_fused_adam_moments_follow_param_dtype():
    model = tiny_model(dtype=torch.bfloat16)
    _, opt, _ = train(model, lambda m: FusedAdam(m.parameters(), lr=1e-2), steps=1, dtype=torch.bfloat16)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())


@pytest.mark.parametrize("cls", CLASSES)
def test_amsgrad_is_refused_clearly(cls):
    with pytest.raises(ValueError, match="amsgrad=True is not supported.*torch_adam"):
        cls(tiny_model().parameters(), amsgrad=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(betas=(0.9, 1.0)), r"'betas\[1\]' must be in \[0, 1\)"),
    (dict(betas=(0.9,)), "'betas' must be a pair"),
    (dict(lr=-1.0), "'lr' must be a non-negative number"),
    (dict(eps=-1e-8), "'eps' must be a non-negative number"),
    (dict(weight_decay=-0.1), "'weight_decay' must be a non-negative number"),
])
def test_invalid_hyperparameters_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedCPUAdam(tiny_model().parameters(), **kwargs)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(cls, dtype):
    model = tiny_model(dtype=dtype)
    data = batches(5, dtype)
    full = copy.deepcopy(model)
    opt_full = cls(full.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        compute_grads(full, x, y)
        opt_full.step()

    first = copy.deepcopy(model)
    opt_first = cls(first.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data[:3]:
        compute_grads(first, x, y)
        opt_first.step()
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    opt_resumed = cls(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    opt_resumed.load_state_dict(saved["opt"])
    for p in resumed.parameters():
        want = torch.float32 if (cls is DeepSpeedCPUAdam or dtype == torch.float32) else dtype
        assert opt_resumed.state[p]["exp_avg"].dtype == want
    for x, y in data[3:]:
        compute_grads(resumed, x, y)
        opt_resumed.step()
    assert torch.equal(flat(resumed), flat(full))


def test_zero_grad_drops_gradients_by_default():
    model = tiny_model()
    opt = FusedAdam(model.parameters())
    compute_grads(model, *batches(1)[0])
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt_keep = FusedAdam(model.parameters(), set_grad_none=False)
    compute_grads(model, *batches(1)[0])
    opt_keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_step_with_closure_returns_loss_and_skips_params_without_grad():
    model = tiny_model()
    frozen = model[0].weight
    opt = FusedAdam(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    before = frozen.detach().clone()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        frozen.grad = None
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(frozen, before) and frozen not in opt.state


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        DeepSpeedCPUAdam(emb.parameters()).step()


def test_host_zeros_large_tensor_is_zeroed_and_exact_size():
    t = host_zeros((3, 1 << 20))
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * 4  # nothing extra saved in checkpoints
    assert not t.any()
    t.add_(1.0)
    assert t.sum().item() == 3 * (1 << 20)
