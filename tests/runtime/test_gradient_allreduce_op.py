"""``gradient_allreduce_op`` ("mean" / "sum"), ``engine.allreduce_gradients()`` and
``safe_update_full_grad_vectorized``, against
hand-computed gradients: a linear loss ``(w * x).sum()`` has gradient ``x`` on each rank, so
after one SGD step with lr 1 from w = 0 the weight is minus the reduced gradient."""
import pytest
import torch

from deepspeed.config.errors import DeepSpeedConfigAssertionError
from deepspeed.runtime.config import DeepSpeedConfig
from tests.helpers.dist import run_distributed


class _LinearLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return (self.weight * x).sum()


def _engine(stage, op, extra=None):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 0,
           "gradient_allreduce_op": op, "zero_optimization": {"stage": stage}, **(extra or {})}
    model = _LinearLoss()
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    return engine


def _body(rank, world_size):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)   # rank 0: x, rank 1: 2x
    out = {}
    # one step each: (stage, op, predivide); predivide applies to "mean" only
    for stage, op, extra in [(0, "mean", {}), (0, "sum", {}), (0, "sum", {"gradient_predivide_factor": 2.0}),
                             (1, "sum", {}), (2, "sum", {"prescale_gradients": True}), (2, "mean", {})]:
        engine = _engine(stage, op, extra)
        engine.backward(engine(x))
        engine.step()
        out[(stage, op, tuple(extra))] = engine.module.weight.detach().clone()
        engine.destroy()
    # backward(allreduce_gradients=False) keeps local gradients; allreduce_gradients() reduces them
    for stage in (0, 1):
        engine = _engine(stage, "mean")
        engine.backward(engine(x), allreduce_gradients=False)
        if stage == 0:
            out[("local", stage)] = engine.module.weight.grad.detach().clone()
        engine.allreduce_gradients()
        if stage == 0:
            out[("reduced", stage)] = engine.module.weight.grad.detach().clone()
        engine.allreduce_gradients()   # nothing pending: must not reduce twice
        engine.step()
        out[("explicit", stage)] = engine.module.weight.detach().clone()
        engine.destroy()
    # deepspeed.utils.safe_update_full_grad_vectorized: fp32 stage 0 (p.grad) and stage 2 (partitioned)
    from deepspeed.utils import safe_update_full_grad_vectorized
    for stage in (0, 2):
        engine = _engine(stage, "mean")
        engine.backward(engine(x))
        safe_update_full_grad_vectorized(list(engine.module.parameters()), lambda g, p: g * 3 + 1)
        engine.step()
        out[("update", stage)] = engine.module.weight.detach().clone()
        engine.destroy()
    return out


def test_sum_and_mean_and_explicit_allreduce():
    res = run_distributed(_body, 2, timeout=240)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    total = x + 2 * x          # sum of the two ranks' gradients
    for r in res:
        torch.testing.assert_close(r[(0, "mean", ())], -total / 2)
        torch.testing.assert_close(r[(0, "sum", ())], -total)
        torch.testing.assert_close(r[(0, "sum", ("gradient_predivide_factor",))], -total)
        torch.testing.assert_close(r[(1, "sum", ())], -total)
        torch.testing.assert_close(r[(2, "sum", ("prescale_gradients",))], -total)
        torch.testing.assert_close(r[(2, "mean", ())], -total / 2)
        torch.testing.assert_close(r[("reduced", 0)], total / 2)
        torch.testing.assert_close(r[("explicit", 0)], -total / 2)
        torch.testing.assert_close(r[("explicit", 1)], -total / 2)
        torch.testing.assert_close(r[("update", 0)], -(total / 2 * 3 + 1))
        torch.testing.assert_close(r[("update", 2)], -(total / 2 * 3 + 1))
    torch.testing.assert_close(res[0][("local", 0)], x)
    torch.testing.assert_close(res[1][("local", 0)], 2 * x)


def test_gradient_allreduce_op_config():
    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_allreduce_op == "mean"
    assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    with pytest.raises(ValueError, match="Invalid gradient_allreduce_op.*'mean', 'sum'.*'max'"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "max"})
    with pytest.raises(ValueError, match="gradient_allreduce_op='sum' is not supported with ZeRO stage 3"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})


def test_configure_train_batch_size_and_flat_names():
    cfg = DeepSpeedConfig({"train_batch_size": 8}, world_size=2)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 32, 8, None
    cfg._configure_train_batch_size()
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 2)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError, match="33.*17"):
        cfg._configure_train_batch_size()
    with pytest.raises(DeepSpeedConfigAssertionError):
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = None, None, 2
        cfg._configure_train_batch_size()
    assert cfg._param_dict == {"train_batch_size": 8}
    assert cfg.eigenvalue_enabled is False and cfg.eigenvalue_max_iter == 100
    ev = DeepSpeedConfig({"train_batch_size": 1, "eigenvalue": {"enabled": True, "verbose": True, "layer_num": 3}})
    assert (ev.eigenvalue_enabled, ev.eigenvalue_verbose, ev.eigenvalue_layer_num) == (True, True, 3)


def test_initialize_without_model_is_an_assertion_naming_the_fix():
    import deepspeed
    # DeepSpeed asserts; the model passed positionally lands in 'args'
    with pytest.raises(AssertionError, match="requires a model"):
        deepspeed.initialize(model=None, config={"train_batch_size": 1})
    with pytest.raises(TypeError, match="first positional argument, which is 'args'"):
        deepspeed.initialize(_LinearLoss(), config={"train_batch_size": 1})
