"""A parameter that got no gradient in some step has an Adam step count behind its group's
(per-parameter optimizers: stage 0 in fp32). Resume must keep each count: before, every parameter
came back with the group's count and the next update differed (seen ~1e-3 with progressive layer
drop, frozen phases and MoE)."""
import torch

import deepspeed


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.skip_b = False

    def forward(self, x):
        h = self.a(x)
        return (h if self.skip_b else self.b(h)).pow(2).mean()


def _engine(seed):
    torch.manual_seed(seed)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    return deepspeed.initialize(model=_TwoLayers(), config=cfg)[0]


def _steps(engine):
    return [float(s["step"]) for s in engine.optimizer.state.values()]


def test_resume_keeps_per_parameter_step_counts(tmp_path):
    torch.manual_seed(123)
    xs = [torch.randn(2, 4) for _ in range(4)]
    eng = _engine(0)
    for i in range(3):
        eng.module.skip_b = (i == 1)          # b gets no gradient in step 2
        eng.backward(eng(xs[i]))
        eng.step()
    assert _steps(eng) == [3.0, 3.0, 2.0, 2.0]
    eng.save_checkpoint(str(tmp_path))
    resumed = _engine(1)
    resumed.load_checkpoint(str(tmp_path))
    assert _steps(resumed) == [3.0, 3.0, 2.0, 2.0]
    for e in (eng, resumed):                  # one more step each: identical updates
        e.module.skip_b = False
        e.backward(e(xs[3]))
        e.step()
    for p, q in zip(eng.module.parameters(), resumed.module.parameters()):
        assert torch.equal(p, q)
