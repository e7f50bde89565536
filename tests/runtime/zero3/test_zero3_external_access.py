"""ZeRO-3 parameters read outside their own module's forward (DeepSpeed's ZeROOrderedDict).

A parent module reading a child's weight (TRL's fused LM-head loss reads ``lm_head.weight``
inside the model's forward; tied and shared heads) gets the whole parameter, registered as
an external parameter of the module being run: gathered again for its backward, released
after. Checked against plain PyTorch on the same global batches (fp32, tight tolerance) at
world size 2.
"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed

DIM, OUT, STEPS, LR = 8, 5, 3, 0.05


class Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Parent(torch.nn.Module):
    """Reads ``self.child.lin.weight`` and ``self.head.weight`` in its own forward (neither is
    its parameter), before and after the child runs; the head's own forward never runs."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, DIM)
        self.child = Child()
        self.head = torch.nn.Linear(DIM, OUT, bias=False)

    def forward(self, x, y):
        w = self.child.lin.weight                  # read before the child's forward...
        h = self.child(self.inp(x))                # ...which gathers and releases its own weight
        h = h + torch.nn.functional.linear(h, w)   # ...and used after it
        logits = h @ self.head.weight.t()          # an LM-head-style read of a module never called
        return torch.nn.functional.cross_entropy(logits, y)


def _model(seed=0):
    torch.manual_seed(seed)
    return Parent()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, DIM, generator=g), torch.randint(0, OUT, (4,), generator=g)) for _ in range(STEPS)]


def _body(rank, ws):
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from deepspeed.runtime.zero.partitioned_param import ZeroParamStatus
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // ws, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0}}
    model = _model()
    eng = deepspeed.initialize(model=model, config=cfg)[0]
    out = {"dict_type": all(isinstance(m._parameters, ZeROOrderedDict) for m in eng.module.modules())}
    losses = []
    for x, y in _batches():
        n = x.shape[0] // ws
        loss = eng(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
        out.setdefault("released", []).append(
            [n for n, p in eng.module.named_parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE])
    out["losses"] = losses
    out["registered"] = sorted(id(p) for p in eng.module.__dict__.get("_external_params", {}).values()) == \
        sorted([id(eng.module.child.lin.weight), id(eng.module.head.weight)])
    # outside any forward a read stays a placeholder (as in DeepSpeed: use GatheredParameters)
    out["outside"] = tuple(eng.module.head.weight.shape)
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
        out["params"] = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    eng.destroy()
    out["restored"] = all(type(m._parameters) is dict for m in model.modules())
    return out


def test_parent_reads_child_and_head_weights_matches_plain_pytorch():
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in _batches():
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    res = run_distributed(_body, 2, timeout=120)
    for r in res:
        assert r["dict_type"] and r["registered"] and r["restored"]
        assert r["outside"] == (0,)
        assert all(not left for left in r["released"]), r["released"]   # nothing stays gathered after a step
        for n, p in ref.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), rtol=1e-6, atol=1e-6, msg=n)
    assert res[0]["losses"][-1] < res[0]["losses"][0]
