"""``engine.optimizer._get_norm_groups()`` at stage 3 (DeepSpeed's name, read by upstream's
gradient-clipping tests and AutoEP): per optimizer parameter group, the L2 norm of the
averaged gradients over all ranks, equal to the norm of the full gradients gathered with
``safe_get_full_grad``; and it reads the partitions as they are, so ``safe_set_local_grad``
edits show."""
from __future__ import annotations

import math

import torch

from tests.helpers.dist import run_distributed


def _body(rank, world_size):
    import deepspeed
    from deepspeed.utils import (safe_get_full_grad, safe_get_local_fp32_param, safe_get_local_grad,
                                 safe_get_local_optimizer_state, safe_set_local_grad)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 1))
    groups = [{"params": list(m[0].parameters())}, {"params": list(m[1].parameters()) + list(m[2].parameters()),
                                                      "lr": 0.01}]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(groups, lr=0.1), config=cfg)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
    eng.backward(torch.nn.functional.mse_loss(eng(x), y))
    before = [float(t) for t in eng.optimizer._get_norm_groups()]
    full = [float(safe_get_full_grad(p).norm()) for p in eng.module.parameters()]
    for p in [*m[1].parameters(), *m[2].parameters()]:          # halve group 1's gradients on every rank
        safe_set_local_grad(p, safe_get_local_grad(p) * 0.5)
    after = [float(t) for t in eng.optimizer._get_norm_groups()]
    # m[2].bias has one element: rank 1 owns none of it and gets empty fragments, never None
    # (DeepSpeed's test_zero_tensor_fragment asserts not-None on every rank)
    bias = m[2].bias
    local = [safe_get_local_fp32_param(bias), safe_get_local_grad(bias)]
    eng.step()
    local.append(safe_get_local_optimizer_state(bias, "momentum_buffer"))
    return before, full, after, [None if t is None else t.numel() for t in local]


def test_norm_groups_equal_full_gradient_norms_and_see_local_edits():
    res = run_distributed(_body, world_size=2, timeout=90)
    assert [r[3] for r in res] == [[1, 1, None], [0, 0, None]], [r[3] for r in res]   # SGD w/o momentum: no state
    for before, full, after, _ in res:
        want = [math.hypot(full[0], full[1]), math.hypot(*full[2:])]
        assert all(abs(b - w) <= 1e-5 * w for b, w in zip(before, want)), (before, want)
        assert abs(after[0] - before[0]) <= 1e-6 * before[0]
        assert abs(after[1] - before[1] / 2) <= 1e-5 * before[1]



def test_submodule_attached_after_initialize_gets_a_zero_ordered_dict():
    """A module attached after ``initialize`` (with torch's plain-dict ``_parameters``) is
    converted by the root's next forward, which runs (DeepSpeed's regression #6961); modules
    converted at initialize keep their container."""
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            y = self.fc(x)
            return self.late(y) if hasattr(self, "late") else y

    m = Tiny()
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config={
        "train_batch_size": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    first = eng.module.fc._parameters
    assert isinstance(first, ZeROOrderedDict)
    late = torch.nn.Linear(8, 8, bias=False)
    late._parameters = dict(late._parameters)
    eng.module.late = late
    x = torch.randn(2, 8)
    out = eng(x)
    assert isinstance(eng.module.late._parameters, ZeROOrderedDict)
    assert eng.module.fc._parameters is first
    with deepspeed.zero.GatheredParameters([eng.module.fc.weight]):
        want = late(x @ eng.module.fc.weight.t())
    torch.testing.assert_close(out, want)
    eng.destroy()
