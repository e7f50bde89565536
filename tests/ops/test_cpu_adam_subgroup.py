"""DeepSpeedCPUAdam.step_subgroup / rollback_subgroup (DeepSpeed 0.19): a sub-group step is
the same update as step(), and a rollback returns parameter and moments to where they were."""
import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw,wd,bc", [(True, 0.1, True), (False, 0.05, True), (True, 0.0, False)])
def test_step_subgroup_equals_step_and_rollback_restores(dtype, adamw, wd, bc):
    torch.manual_seed(0)
    n = 777
    base = torch.randn(n).to(dtype)
    a = torch.nn.Parameter(base.clone())
    b = torch.nn.Parameter(base.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, adamw_mode=adamw, bias_correction=bc)
    ref = DeepSpeedCPUAdam([a], **kw)
    opt = DeepSpeedCPUAdam([b], **kw)
    history = []
    for _ in range(3):
        g = torch.randn(n).to(dtype)
        a.grad, b.grad = g.clone(), g.clone()
        history.append((b.detach().clone(), {k: t.clone() for k, t in opt.state[7].items() if k != "step"}))
        ref.step()
        opt.step_subgroup(7)
        # bit-identical to the whole step, moments included
        assert torch.equal(a, b)
        assert torch.equal(ref.state[a]["exp_avg"], opt.state[7]["exp_avg"])
        assert torch.equal(ref.state[a]["exp_avg_sq"], opt.state[7]["exp_avg_sq"])
    assert int(opt.state[7]["step"]) == 3
    assert opt.state[7]["exp_avg"].dtype == torch.float32   # fp32_optimizer_states for bf16 params
    # roll back the last step with the gradient it used: parameter and moments as before it
    before, moments = history[-1]
    opt.rollback_subgroup(7)
    assert int(opt.state[7]["step"]) == 2
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    # bf16: the parameter before the step is recovered to bf16 rounding, which (Adam/L2) feeds the moments
    m_atol = 1e-7 if dtype == torch.float32 else 1e-5
    torch.testing.assert_close(b.detach().float(), before.float(), rtol=0, atol=atol)
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[7][k], moments[k], rtol=1e-5, atol=m_atol)
    # stepping again with the same gradient gives the same result as before the rollback
    opt.step_subgroup(7)
    torch.testing.assert_close(b.detach().float(), a.detach().float(), rtol=0, atol=atol)


def test_subgroup_errors_name_the_cause():
    p, q = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = DeepSpeedCPUAdam([p, q])
    p.grad, q.grad = torch.randn(8), torch.randn(8)
    with pytest.raises(ValueError, match="exactly one parameter may have a gradient; got 2"):
        opt.step_subgroup(0)
    with pytest.raises(RuntimeError, match="sub_group_id 0 as it has not been initialized"):
        opt.rollback_subgroup(0)
    q.grad = None
    opt.step_subgroup(0)
    opt.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 0: step count is 0"):
        opt.rollback_subgroup(0)
    # sub-group state and per-parameter state are independent
    opt.step()
    assert int(opt.state[p]["step"]) == 1 and int(opt.state[0]["step"]) == 0
