import torch

from deepspeed.accelerator import get_accelerator


def test_cpu_accelerator_basics():
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.communication_backend_name() == "gloo"
    assert acc.device_count() >= 1 and acc.current_device() == 0
    assert acc.memory_allocated() > 0  # process RSS
    assert acc.max_memory_allocated() >= acc.memory_allocated() // 2
    assert acc.is_bf16_supported() and acc.is_fp16_supported()


def test_rng_state_round_trip():
    acc = get_accelerator()
    acc.manual_seed(3)
    state = acc.get_rng_state()
    a = torch.rand(4)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(4))
