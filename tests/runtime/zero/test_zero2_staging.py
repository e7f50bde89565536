"""ZeRO-2 at two ranks: the staging buffers a micro-step's gradient buckets are laid out in are
written once (each parameter's first gradient copied in, what no gradient wrote zeroed at launch,
not zero-filled and added into) and reused by the next bucket within the same backward, never
kept between steps. Trains exactly as plain PyTorch, with a parameter that gets no gradient (its
slot in a reused buffer must read zero, not the previous bucket's values) and a layer used twice.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.dist import run_distributed

STEPS, GAS, MB, LR = 3, 2, 2, 0.05


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)     # never in the forward: no gradient ever (registered first,
        self.inp = nn.Linear(8, 16)       # so its bucket is the last one backward would reach)
        self.mid = nn.Linear(16, 16)      # applied twice
        self.mid2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        return F.mse_loss(self.out(_trunk(self, x)), y)


def _trunk(m, x):
    h = torch.tanh(m.inp(x))
    h = torch.tanh(m.mid(torch.tanh(m.mid(h))))
    return torch.tanh(m.mid2(h))


def _model():
    torch.manual_seed(0)
    return Net()


def _batches(ws):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GAS * MB * ws, 8, generator=g), torch.randn(GAS * MB * ws, 4, generator=g))
            for _ in range(STEPS)]


def _run(rank, ws):
    import deepspeed
    import deepspeed.runtime.precision.grad_reduce as gr

    allocs = []
    orig = gr.transient_buffer

    def counted(n, *a, **k):
        allocs.append(n)
        return orig(n, *a, **k)

    gr.transient_buffer = counted
    try:
        model = _model()
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 80, "overlap_comm": True}}
        eng, *_ = deepspeed.initialize(model=model, config=cfg,
                                       optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        red = eng.optimizer.reducer
        stagings = []
        orig_staging = red._staging

        def spy(b):
            if b.order not in red.staging:
                stagings.append(b.order)
            return orig_staging(b)

        red._staging = spy
        left_over = 0
        for x, y in _batches(ws):
            for m in range(GAS):
                lo = rank * GAS * MB + m * MB
                eng.backward(eng(x[lo:lo + MB], y[lo:lo + MB]))
                left_over += len(red.staging) + len(red.spare)   # nothing kept after a backward
                eng.step()
        from deepspeed.utils import safe_get_full_fp32_param
        full = {n: safe_get_full_fp32_param(p).clone() for n, p in eng.module.named_parameters()}
        n_buckets = len(eng.optimizer.buckets)
        eng.destroy()
    finally:
        gr.transient_buffer = orig
    return {"full": full, "allocs": len(allocs), "stagings": len(stagings), "left_over": left_over,
            "n_buckets": n_buckets}


def test_stage2_staging_written_once_reused_within_a_step_and_matches_plain_pytorch():
    res = run_distributed(_run, 2, timeout=150)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for x, y in _batches(2):
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
    want = dict(ref.named_parameters())
    for r in res:
        assert r["n_buckets"] >= 3, r["n_buckets"]
        assert r["left_over"] == 0
        # one staging buffer per bucket per micro-step, fewer allocations: reused within the step
        assert r["stagings"] == r["n_buckets"] * STEPS * GAS, (r["stagings"], r["n_buckets"])
        assert r["allocs"] < r["stagings"], (r["allocs"], r["stagings"])
        for n, p in want.items():
            torch.testing.assert_close(r["full"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(r["full"]["unused.weight"], _model().unused.weight.detach())
