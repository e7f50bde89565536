"""The RNG tracker: named streams that fork off and return to the default stream."""
from __future__ import annotations

import pytest
import torch

import deepspeed.checkpointing as ckpt


def _draws(seed, n=5):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_add_creates_stream_from_seed_without_touching_default():
    tracker = ckpt.get_cuda_rng_tracker()
    torch.manual_seed(1)
    expected_default = torch.rand(5)
    torch.manual_seed(1)
    tracker.add("a", 77)
    with tracker.fork("a"):
        first = torch.rand(5)
    assert torch.equal(first, _draws(77))
    assert torch.equal(torch.rand(5), expected_default)  # default stream as if nothing happened


def test_fork_continues_the_stream_and_restores_default():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 77)
    reference = _draws(77, 10)
    torch.manual_seed(3)
    expected_default = torch.rand(4)
    torch.manual_seed(3)
    with tracker.fork("a"):
        part1 = torch.rand(5)
    default_mid = torch.rand(2)
    with tracker.fork("a"):
        part2 = torch.rand(5)
    default_end = torch.rand(2)
    assert torch.equal(torch.cat([part1, part2]), reference)
    assert torch.equal(torch.cat([default_mid, default_end]), expected_default)


def test_fork_restores_default_even_on_error():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 5)
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    with pytest.raises(ValueError):
        with tracker.fork("a"):
            torch.rand(2)
            raise ValueError("boom")
    assert torch.equal(torch.rand(3), expected)


def test_get_and_set_states_rewind_a_stream():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 11)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        assert not torch.equal(torch.rand(4), first)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)


def test_duplicate_names_seeds_and_unknown_streams():
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="'zzz'"):
        with tracker.fork("zzz"):
            pass
    with pytest.raises(TypeError, match="seed"):
        tracker.add("c", 1.5)
    tracker.reset()
    tracker.add("a", 1)  # reset forgets names and seeds


def test_model_parallel_seed_sets_both_documented_streams():
    ckpt.model_parallel_cuda_manual_seed(1234)
    assert torch.equal(torch.rand(5), _draws(1234))  # default stream: the plain seed
    with ckpt.get_cuda_rng_tracker().fork():  # default name: 'model-parallel-rng'
        assert torch.equal(torch.rand(5), _draws(1234 + 2718 + 0))
    assert set(ckpt.get_cuda_rng_tracker().get_states()) == {"model-parallel-rng"}


def test_model_parallel_seed_uses_configured_mpu_rank():
    class Mpu:
        def get_model_parallel_rank(self):
            return 3

        def get_model_parallel_world_size(self):
            return 4

        def get_model_parallel_group(self):
            return None

    ckpt.configure(Mpu())
    ckpt.model_parallel_cuda_manual_seed(10)
    with ckpt.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(5), _draws(10 + 2718 + 3))
    ckpt.model_parallel_reconfigure_tp_seed(20)
    with ckpt.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(5), _draws(20 + 2718 + 3))
