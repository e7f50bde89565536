"""Partitioned activations over a real 2-rank model-parallel group (gloo, spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


class WorldMpu:
    """The whole 2-process world is one model-parallel group (data-parallel size 1)."""

    def get_model_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return None


VARIANTS = {
    "checkpoint": {},
    "partition": dict(partition_activations=True),
    "partition_cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
    "partition_contiguous": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3),
}


def _kept_bytes(model, x, checkpoint):
    """Bytes the checkpointed block chain keeps for backward, and the kept tensors."""
    from ._models import SavedBytes
    xin = x.clone().requires_grad_(True)
    with SavedBytes() as meter:
        h = xin
        for block in model.blocks:
            h = checkpoint(block, h)
    h.sum().backward()  # give contiguous slots back
    return meter.total, [t.clone() for t in meter.tensors]


def _body(rank, world_size):
    import deepspeed.checkpointing as ckpt
    from ._models import Stack, grads_of
    torch.manual_seed(0)
    model = Stack(d=8, layers=3)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))  # same input on both ranks
    out = {"plain": grads_of(model, x)}
    for name, kwargs in VARIANTS.items():
        ckpt.configure(WorldMpu(), **kwargs)
        out[name] = grads_of(model, x, ckpt=ckpt.checkpoint)
        out[name + "_bytes"], out[name + "_kept"] = _kept_bytes(model, x, ckpt.checkpoint)
    # An odd-sized activation is padded to a multiple of the group size and cut back after the gather.
    ckpt.configure(WorldMpu(), partition_activations=True)
    odd = torch.randn(3, 7, generator=torch.Generator().manual_seed(4), requires_grad=True)
    ckpt.checkpoint(lambda t: (t * t).sum(), odd).backward()
    out["odd_grad"] = odd.grad.clone()
    # The two documented RNG streams.
    ckpt.model_parallel_cuda_manual_seed(100)
    out["default_draw"] = torch.rand(4)
    with ckpt.get_cuda_rng_tracker().fork():
        out["mp_draw"] = torch.rand(4)
    return out


def _assert_grads_equal(a, b):
    loss_a, grads_a, gx_a = a
    loss_b, grads_b, gx_b = b
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert torch.equal(gx_a, gx_b)


def test_partitioned_activations_two_ranks():
    results = run_distributed(_body, world_size=2, timeout=120)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    full_bytes = x.numel() * x.element_size()
    for rank, out in enumerate(results):
        for name in VARIANTS:
            _assert_grads_equal(out["plain"], out[name])
        # Unpartitioned: each of the 3 checkpoints keeps a whole activation.
        assert out["checkpoint_bytes"] == 3 * full_bytes
        # Partitioned: each rank keeps exactly half of each, wherever it is kept.
        assert out["partition_bytes"] == out["partition_cpu_bytes"] == 3 * full_bytes // 2
        assert all(t.numel() == x.numel() // 2 for t in out["partition_kept"])
        # The first checkpoint's input is x itself: rank r keeps the r-th half.
        half = x.numel() // 2
        assert torch.equal(out["partition_kept"][0], x.reshape(-1)[rank * half:(rank + 1) * half])
        # Contiguous: one buffer of 3 half-size slots, so every kept slot shares one storage.
        assert out["partition_contiguous_bytes"] == 3 * full_bytes // 2
        odd = torch.randn(3, 7, generator=torch.Generator().manual_seed(4))
        assert torch.equal(out["odd_grad"], 2 * odd)
    assert torch.equal(results[0]["default_draw"], results[1]["default_draw"])
    assert torch.equal(results[0]["default_draw"], torch.rand(4, generator=torch.Generator().manual_seed(100)))
    for rank, out in enumerate(results):
        expected = torch.rand(4, generator=torch.Generator().manual_seed(100 + 2718 + rank))
        assert torch.equal(out["mp_draw"], expected)
    assert not torch.equal(results[0]["mp_draw"], results[1]["mp_draw"])
