from __future__ import annotations

import torch

from .abstract import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801
    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index=None) -> None:
        torch.cuda.synchronize(device_index)

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")

    def set_rng_state(self, new_state, device_index=None) -> None:
        torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def default_generator(self, device_index=None):
        return torch.cuda.default_generators[device_index or 0]

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def _torch_pin_memory(self, tensor):
        from ..utils.pin_memory_tracker import track_pinned_memory
        track_pinned_memory(tensor.nbytes)
        return tensor.pin_memory()

    def _torch_is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def Stream(self, *args, **kwargs):  # noqa: N802
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def Event(self, **kwargs):  # noqa: N802
        return torch.cuda.Event(**kwargs)

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]
