"""data_types.grad_accum_dtype as DeepSpeed 0.19: any dtype at ZeRO 1/2 (gradients accumulate and are
reduced in it), and without ZeRO only the model dtype (fp32 too here), else NotImplementedError."""
import pytest
import torch


@pytest.mark.parametrize("model,accum", [("fp32", "fp16"), ("fp32", "bf16"), ("fp16", "bf16"), ("bf16", "fp16")])
def test_stage0_mix_is_not_implemented(model, accum):
    from deepspeed.config import DeepSpeedConfig
    cfg = {"train_batch_size": 1, "data_types": {"grad_accum_dtype": accum},
           "fp16": {"enabled": model == "fp16"}, "bf16": {"enabled": model == "bf16"}}
    with pytest.raises(NotImplementedError, match="data_types.grad_accum_dtype"):
        DeepSpeedConfig(cfg)
    for stage in (1, 2, 3):
        DeepSpeedConfig(dict(cfg, zero_optimization={"stage": stage}))


def test_zero1_fp32_model_bf16_accumulation_matches_reference():
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    cfg = {"train_batch_size": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert engine.optimizer.grad_bufs[0].dtype == torch.bfloat16
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = [(torch.randn(1, 4), torch.randn(1, 1)) for _ in range(4)]
    for step in range(2):
        for x, y in data[2 * step:2 * step + 2]:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
        # the reference accumulates in fp32; bf16 accumulation rounds each sum to 8 bits of mantissa
        opt.step()
        opt.zero_grad()
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-3)
