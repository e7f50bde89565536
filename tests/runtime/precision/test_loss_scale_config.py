"""Stage-0 fp16 (DeepSpeed's FP16_Optimizer): optimizer.loss_scale_config, no hysteresis, and a
p.grad assigned by hand before engine.step() is the gradient the step uses."""
import torch


def test_stage0_scale_config_and_assigned_grads():
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    cfg = {"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2,
                                           "hysteresis": 2}}
    engine, opt, _, _ = deepspeed.initialize(config=cfg, model=model,
                                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    lsc = opt.loss_scale_config
    assert (lsc.dynamic_loss_scale, lsc.cur_scale, lsc.scale_window, lsc.cur_iter) == (True, 64.0, 2, 0)
    scales = []
    for value in (float("inf"), float("nan"), 0.25, 0.25, 0.25):
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        scale = lsc.cur_scale   # the step reads the gradient as scaled by this
        grads = []
        for p in engine.module.parameters():
            p.grad = torch.full_like(p, value)
            grads.append(torch.full(p.shape, value))
        engine.step()
        scales.append(lsc.cur_scale)
        for p, b, g in zip(engine.module.parameters(), before, grads):
            if value == 0.25:   # SGD on the unscaled gradient (fp32 masters, fp16 rounding of the result)
                torch.testing.assert_close(p.detach().float(), b - 0.5 * g / scale, atol=1e-3, rtol=0)
                assert not torch.equal(p.detach().float(), b)
            else:               # overflow: skipped, nothing moved
                assert torch.equal(p.detach().float(), b)
    # hysteresis 2 is not read at stage 0: both overflows halve; the 3rd clean step doubles
    assert scales == [32.0, 16.0, 16.0, 16.0, 32.0] and lsc.cur_iter == 5 and engine.skipped_steps == 2


def test_unfused_fp32_groups_are_the_masters_per_parameter():
    """FP16_UnfusedOptimizer.fp32_groups: one fp32 tensor per parameter, shaped like it, holding the
    master the 16-bit parameter was rounded from (and writing it writes the master)."""
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    cfg = {"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}}, "fp16": {"enabled": True}}
    engine, opt, _, _ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    assert type(opt).__name__ == "FP16_UnfusedOptimizer"
    engine.backward(engine(torch.randn(1, 4).half()).float().pow(2).sum())
    engine.step()
    groups = opt.fp32_groups
    params = list(engine.module.parameters())
    assert [f.shape for f in groups[0]] == [p.shape for p in params]
    for f, p in zip(groups[0], params):
        assert f.dtype == torch.float32 and torch.equal(f.half(), p.detach())
    groups[0][0].fill_(0.5)
    assert torch.all(opt.fp32_groups[0][0] == 0.5) and (opt.fp32_groups_flat[0] == 0.5).sum() == groups[0][0].numel()
