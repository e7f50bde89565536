"""qgZ's two-level all-to-all (2 simulated nodes of 2 ranks) against the exact fp32 average."""
import pytest
import torch

from tests.helpers.dist import run_distributed


def _body(rank, world_size):
    import torch.distributed as dist
    from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, last_reduce_stats
    from deepspeed.runtime.zero.zeropp import local_all_to_all_groups
    groups = local_all_to_all_groups(2)
    g = torch.Generator().manual_seed(rank)
    ts = [torch.randn(64, 33, generator=g) * (1 + rank), torch.randn(5, generator=g)]
    out = {}
    for mode, grp in (("hier", groups), ("flat", None)):
        got = all_to_all_quant_reduce(ts, grp)
        bound = last_reduce_stats["error_bound"]
        errs = []
        for t, part in zip(ts, got):
            full = t.clone()
            dist.all_reduce(full)
            full = (full / world_size).reshape(-1)
            chunk = -(-full.numel() // world_size)
            exact = full[rank * chunk:(rank + 1) * chunk]
            assert part.shape == exact.shape
            errs.append(float((part - exact).abs().max()) if part.numel() else 0.0)
        out[mode] = (max(errs), bound, last_reduce_stats["sent_bytes"])
    return out


@pytest.mark.slow
def test_hierarchical_quant_reduce_within_bound():
    for r in run_distributed(_body, world_size=4, timeout=120):
        for mode in ("hier", "flat"):
            err, bound, sent = r[mode]
            assert 0 < err <= bound * (1 + 1e-5) + 1e-7, (mode, err, bound)
            assert sent > 0
