from __future__ import annotations

import os

import psutil
import torch

from .abstract import DeepSpeedAccelerator


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_count(self) -> int:
        # One "device" per process; the launcher's default process count on CPU is 1
        # unless --num_procs / --num_gpus says otherwise.
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def set_device(self, device_index) -> None:
        return None

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None) -> None:
        torch.set_rng_state(new_state)

    def memory_allocated(self, device_index=None) -> int:
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self, device_index=None) -> int:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def is_fp16_supported(self) -> bool:
        return True  # PyTorch runs fp16 math on CPU; slower, but correct.
