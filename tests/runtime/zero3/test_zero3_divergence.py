"""Ranks whose control flow diverges get a clear error on every rank - never a hang or
a crash inside the communication library."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import VOCAB, TinyLM, lm_batches, shard, stage3_config


class SkipsOnRank1(TinyLM):
    """From the second step on, rank 1 skips block 1 (a data-dependent branch gone wrong)."""

    def __init__(self):
        super().__init__(n_layers=3)
        self.calls = 0

    def forward(self, idx, targets):
        import torch.distributed as dist
        self.calls += 1
        x = self.embed(idx)
        for i, b in enumerate(self.blocks):
            if i == 1 and self.calls > 1 and dist.get_rank() == 1:
                continue
            x = b(x)
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, VOCAB), targets.reshape(-1))


def _scenario(rank, ws, mode):
    import deepspeed
    torch.manual_seed(0)
    model = SkipsOnRank1() if mode == "skip_branch" else TinyLM(n_layers=2)
    zero = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0} if mode == "skip_branch" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    eng = deepspeed.initialize(model=model, optimizer=opt, config=stage3_config(gas=1, mb=2, **zero))[0]
    t0 = time.time()
    try:
        for step, b in enumerate(lm_batches(3, 2 * ws)):
            x, y = shard(b, rank, ws, 0, 2)
            loss = eng(x, y)
            if mode == "extra_forward" and step == 1 and rank == 0:
                loss = loss + eng(x, y)       # rank 0 runs two forwards in this micro-step
            eng.backward(loss)
            eng.step()
    except deepspeed.zero.ZeroRankMismatchError as err:
        return {"error": str(err), "seconds": time.time() - t0}
    finally:
        eng.destroy()
    return {"error": None}


def _leaves_early(rank, ws):
    """Rank 1 stops training one step early (and its process exits); rank 0 must get an error."""
    import deepspeed
    torch.manual_seed(0)
    model = TinyLM(n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    eng = deepspeed.initialize(model=model, optimizer=opt, config=stage3_config(gas=1, mb=2))[0]
    t0 = time.time()
    try:
        for step, b in enumerate(lm_batches(3, 2 * ws)):
            if rank == 1 and step == 2:
                return {"error": None}
            x, y = shard(b, rank, ws, 0, 2)
            eng.backward(eng(x, y))
            eng.step()
    except deepspeed.zero.ZeroRankMismatchError as err:
        return {"error": str(err), "seconds": time.time() - t0}
    return {"error": None}


def _body(rank, ws):
    # Both ranks raise at the same collective, so the group stays usable for the next scenario.
    out = {mode: _scenario(rank, ws, mode) for mode in ("skip_branch", "extra_forward")}
    out["leaves_early"] = _leaves_early(rank, ws)   # last: rank 1's process ends after it
    return out


def test_diverging_ranks_fail_clearly_on_every_rank():
    res = run_distributed(_body, 2, timeout=60, pg_timeout=30)
    for mode in ("skip_branch", "extra_forward"):
        for r in res:
            err = r[mode]
            assert err["error"] is not None, f"{mode}: the divergence went unnoticed"
            assert "ranks diverged" in err["error"] and "rank 0:" in err["error"] and "rank 1:" in err["error"]
            assert err["seconds"] < 20
    # the first differing collective names the module rank 0 gathers and rank 1 skipped
    assert "blocks.1" in res[0]["skip_branch"]["error"]
    err = res[0]["leaves_early"]["error"]
    assert err is not None and "did not complete on every data-parallel rank" in err and "Every rank must run" in err
