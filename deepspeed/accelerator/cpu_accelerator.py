from __future__ import annotations

import os

import psutil
import torch

from .abstract import DeepSpeedAccelerator


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_count(self) -> int:
        """DeepSpeed's rule: ``LOCAL_SIZE`` (set by the launcher for its ranks) when positive,
        else the number of NUMA nodes that have cores. ``LOCAL_WORLD_SIZE`` (torchrun's
        name) is honoured between the two."""
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            try:
                n = int(os.environ.get(name, "0"))
            except ValueError:
                n = 0
            if n > 0:
                return n
        return _numa_nodes_with_cores()

    # DeepSpeed's CPU accelerator names CUDA_VISIBLE_DEVICES too, so --include/--exclude
    # slot choices reach the workers on CPU as they do on CUDA.
    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]

    def is_synchronized_device(self) -> bool:
        return True

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


def _numa_nodes_with_cores(root: str = "/sys/devices/system/node") -> int:
    """NUMA nodes with at least one core (memory-only HBM nodes do not count); 1 if unknown."""
    try:
        names = [n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return 1
    seen, count = set(), 0
    for name in names:
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                cores = f.read().strip()
        except OSError:
            continue
        if cores and cores not in seen:
            seen.add(cores)
            count += 1
    return max(count, 1)
